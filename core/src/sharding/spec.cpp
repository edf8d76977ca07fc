#include "spmdx/sharding/spec.h"

#include <algorithm>

namespace spmdx::sharding {

std::optional<std::vector<Placement>> parse_placements(std::string_view text) {
  std::vector<Placement> out;
  std::size_t i = 0;
  while (i < text.size()) {
    if (text[i] == 'R') {
      out.push_back(Placement::replicate());
      ++i;
      continue;
    }
    const auto close = text.find(')', i);
    if ((text[i] != 'S' && text[i] != 'P') || i + 1 >= text.size() || text[i + 1] != '(' || close == std::string_view::npos) return std::nullopt;
    const std::string_view arg = text.substr(i + 2, close - i - 2);
    if (text[i] == 'S') {
      if (arg.empty() || arg.size() > 6 || arg.find_first_not_of("0123456789") != std::string_view::npos) return std::nullopt;
      out.push_back(Placement::shard(std::stoi(std::string(arg))));
    } else {
      bool found = false;
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min, ReduceOp::prod}) {
        if (arg == to_string(op)) out.push_back(Placement::partial(op)), found = true;
      }
      if (!found) return std::nullopt;
    }
    i = close + 1;
  }
  return out;
}

std::vector<std::int64_t> chunk_sizes(std::int64_t n, std::int64_t k) {
  const std::int64_t c = (n + k - 1) / k;
  std::vector<std::int64_t> out;
  for (std::int64_t j = 0; j < k; ++j) out.push_back(std::max<std::int64_t>(0, std::min(c, n - j * c)));
  return out;
}

std::vector<std::int64_t> shape_after(const DeviceMesh& mesh, const std::vector<Placement>& placements,
                                      std::vector<std::int64_t> shape, const std::vector<std::int64_t>& coordinate,
                                      int upto, std::vector<std::int64_t>* offset) {
  if (offset) offset->assign(shape.size(), 0);
  for (int i = 0; i < upto; ++i) {
    const Placement& p = placements.at(static_cast<std::size_t>(i));
    if (!p.is_shard()) continue;
    auto& n = shape.at(static_cast<std::size_t>(p.dim()));
    const auto sizes = chunk_sizes(n, mesh.size(i));
    const auto j = static_cast<std::size_t>(coordinate.at(static_cast<std::size_t>(i)));
    if (offset) {
      for (std::size_t c = 0; c < j; ++c) (*offset)[static_cast<std::size_t>(p.dim())] += sizes[c];
    }
    n = sizes[j];
  }
  return shape;
}

double shape_bytes(const std::vector<std::int64_t>& shape, ir::DType dtype) {
  double n = 1;
  for (auto d : shape) n *= static_cast<double>(d);
  return n * static_cast<double>(ir::element_size(dtype));
}

std::vector<std::int64_t> ShardingSpec::local_shape(const DeviceMesh& mesh, const std::vector<std::int64_t>& coordinate) const {
  return shape_after(mesh, placements, meta.shape, coordinate, mesh.ndim());
}

std::vector<std::int64_t> ShardingSpec::local_offset(const DeviceMesh& mesh, const std::vector<std::int64_t>& coordinate) const {
  std::vector<std::int64_t> offset;
  shape_after(mesh, placements, meta.shape, coordinate, mesh.ndim(), &offset);
  return offset;
}

std::string ShardingSpec::str() const { return to_string(placements) + " " + meta.str(); }

}  // namespace spmdx::sharding
