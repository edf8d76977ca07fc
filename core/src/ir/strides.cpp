#include "spmdx/ir/strides.h"

#include <algorithm>

namespace spmdx::ir {

std::vector<std::int64_t> contiguous_strides(const std::vector<std::int64_t>& shape) {
  std::vector<std::int64_t> s(shape.size(), 1);
  for (std::size_t d = shape.size(); d-- > 1;) s[d - 1] = s[d] * std::max<std::int64_t>(shape[d], 1);
  return s;
}

std::optional<std::vector<std::int64_t>> view_strides(const std::vector<std::int64_t>& old_shape, const std::vector<std::int64_t>& old_strides,
                                                      const std::vector<std::int64_t>& new_shape) {
  std::int64_t numel = 1;
  for (auto d : old_shape) numel *= d;
  if (numel == 0 || old_shape.empty()) return contiguous_strides(new_shape);
  std::vector<std::int64_t> out(new_shape.size(), 1);
  std::int64_t view_d = static_cast<std::int64_t>(new_shape.size()) - 1;
  std::int64_t chunk_base = old_strides.back(), tensor_numel = 1, view_numel = 1;
  for (std::int64_t t = static_cast<std::int64_t>(old_shape.size()) - 1; t >= 0; --t) {
    tensor_numel *= old_shape[static_cast<std::size_t>(t)];
    const auto prev = static_cast<std::size_t>(t - 1);
    if (t == 0 || (old_shape[prev] != 1 && old_strides[prev] != tensor_numel * chunk_base)) {
      while (view_d >= 0 && (view_numel < tensor_numel || new_shape[static_cast<std::size_t>(view_d)] == 1)) {
        out[static_cast<std::size_t>(view_d)] = view_numel * chunk_base;
        view_numel *= new_shape[static_cast<std::size_t>(view_d)];
        --view_d;
      }
      if (view_numel != tensor_numel) return std::nullopt;
      if (t > 0) {
        chunk_base = old_strides[prev];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  if (view_d != -1) return std::nullopt;
  return out;
}

bool front_is_view(const std::vector<std::int64_t>& shape, std::int64_t dim) {
  if (dim < 0) dim += static_cast<std::int64_t>(shape.size());
  for (std::int64_t d = 0; d < dim; ++d) {
    if (shape[static_cast<std::size_t>(d)] != 1) return false;
  }
  return true;
}

}  // namespace spmdx::ir
