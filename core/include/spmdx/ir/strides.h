// Strides in elements of a tensor of the IR, as ATen's kernels lay tensors out: what the memory
// plan (plan/memory_plan.h) and the view ops' records (core/src/ops/shape.cpp) know of views.
// No LibTorch here: ATen's rules, written out.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace spmdx::ir {

/// A contiguous tensor of `shape` (a size-0 dim counts as 1, as ATen's contiguous strides).
std::vector<std::int64_t> contiguous_strides(const std::vector<std::int64_t>& shape);

/// The strides of a view of (old_shape, old_strides) as new_shape, or none when a reshape must
/// copy: ATen's computeStride (aten/src/ATen/TensorUtils.cpp).
std::optional<std::vector<std::int64_t>> view_strides(const std::vector<std::int64_t>& old_shape, const std::vector<std::int64_t>& old_strides,
                                                      const std::vector<std::int64_t>& new_shape);

/// True when moving `dim` of a contiguous tensor of `shape` to the front keeps it contiguous
/// (every dim before it has size 1): movedim(dim, 0).contiguous(), and a narrow of that dim
/// made contiguous, are views.
bool front_is_view(const std::vector<std::int64_t>& shape, std::int64_t dim);

}  // namespace spmdx::ir
