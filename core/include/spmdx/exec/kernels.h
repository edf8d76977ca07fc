// ATen kernels for the IR's ops: one function per op name, no autograd at run time.
// The only place, with the executor, where the IR meets LibTorch.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <string>
#include <vector>

#include "spmdx/ir/graph.h"

namespace spmdx::exec {

/// Computes a node's outputs from its input tensors (in the node's input order).
using Kernel = std::function<std::vector<at::Tensor>(const ir::Node& node, const std::vector<at::Tensor>& inputs)>;

/// The kernel of an op, or nullptr.
const Kernel* find_kernel(const std::string& op);

/// ATen's scalar type for an IR dtype (f32 -> at::kFloat, ...).
at::ScalarType to_aten(ir::DType dtype);
/// The IR dtype of an ATen scalar type; throws std::invalid_argument for one the IR lacks.
ir::DType from_aten(at::ScalarType type);

}  // namespace spmdx::exec
