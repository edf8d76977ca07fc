// How each collective node of a rank graph becomes a call on the comm backend (internal to
// the exec library): the buffers the call moves, laid out as the backend takes them (the dim
// a collective concatenates moved outermost, all_to_all's blocks packed), and how the node's
// output tensor is made from them once the call is done. An op-keyed table, as the kernels
// are (kernels.h); DistributedExecutor issues, waits and buckets.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "spmdx/comm.h"
#include "spmdx/ir/graph.h"

namespace spmdx::exec {

/// A collective handed to the backend.
struct Lowered {
  std::unique_ptr<Work> work;           ///< the backend's call in flight
  std::vector<at::Tensor> keep;         ///< buffers the call uses: alive until it is done
  std::function<at::Tensor()> finish;   ///< the node's output, once the call is done
};

/// Issues node `n` (all_reduce, all_gather, reduce_scatter or all_to_all, with the attributes
/// ops.h gives it) on `group` with local input `x`. `before_call` runs once the call's buffers
/// are made (queued on the compute stream, on a GPU) and right before the backend's call: the
/// executor orders the backend after the compute stream there.
using Lowering = std::function<Lowered(CommBackend& backend, int group, const ir::Node& n, const at::Tensor& x, const std::function<void()>& before_call)>;

/// The lowering of a collective op; nullptr for an op without one.
const Lowering* find_lowering(const std::string& op);

/// A tensor's memory as the backend takes it (contiguous; host or CUDA memory by its device).
CommBuffer buffer(const at::Tensor& t);
/// "sum", "avg", "max", "min", "prod" -> the ReduceOp; throws std::invalid_argument otherwise.
ReduceOp reduce_op(const std::string& name);

}  // namespace spmdx::exec
