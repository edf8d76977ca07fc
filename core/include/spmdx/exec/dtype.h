// IR dtypes as ATen scalar types and back: the one place the two type systems meet, for the
// kernels, the executor, checkpoints and the .pt2 importer.
#pragma once

#include <c10/core/ScalarType.h>

#include "spmdx/ir/tensor_meta.h"

namespace spmdx::exec {

/// ATen's scalar type for an IR dtype (f32 -> at::kFloat, ...).
at::ScalarType to_aten(ir::DType dtype);
/// The IR dtype of an ATen scalar type; throws std::invalid_argument for one the IR lacks.
ir::DType from_aten(at::ScalarType type);

}  // namespace spmdx::exec
