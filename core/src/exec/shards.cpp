#include "spmdx/exec/shards.h"

#include <ATen/ATen.h>

#include <functional>
#include <stdexcept>

#include "spmdx/sharding/spec.h"

namespace spmdx::exec {

using sharding::DeviceMesh;

at::Tensor reduce_tensors(const std::vector<at::Tensor>& xs, const std::string& op) {
  at::Tensor acc = xs[0].clone();
  for (std::size_t i = 1; i < xs.size(); ++i) {
    if (op == "sum" || op == "avg") acc.add_(xs[i]);
    else if (op == "max") acc = at::maximum(acc, xs[i]);
    else if (op == "min") acc = at::minimum(acc, xs[i]);
    else if (op == "prod") acc.mul_(xs[i]);
    else throw std::invalid_argument("unknown reduce op '" + op + "'");
  }
  if (op == "avg") acc.div_(static_cast<double>(xs.size()));
  return acc;
}

std::int64_t chunk_offset(const std::vector<std::int64_t>& sizes, std::int64_t index) {
  std::int64_t start = 0;
  for (std::int64_t i = 0; i < index; ++i) start += sizes[static_cast<std::size_t>(i)];
  return start;
}

at::Tensor shard_tensor(const at::Tensor& full, const sharding::Placements& placements, const DeviceMesh& mesh,
                        const std::vector<std::int64_t>& coordinate) {
  at::Tensor t = full;
  for (int i = 0; i < mesh.ndim(); ++i) {
    const Placement& p = placements.at(static_cast<std::size_t>(i));
    const std::int64_t j = coordinate.at(static_cast<std::size_t>(i));
    if (p.is_shard()) {
      const auto sizes = sharding::chunk_sizes(t.size(p.dim()), mesh.size(i));
      t = t.narrow(p.dim(), chunk_offset(sizes, j), sizes[static_cast<std::size_t>(j)]);
    } else if (p.is_partial() && p.reduce_op() == ReduceOp::sum && j != 0) {
      t = at::zeros_like(t);
    }
  }
  t = t.contiguous();
  if (t.has_storage() && static_cast<std::size_t>(t.nbytes()) != t.storage().nbytes() && !t.is_same(full)) t = t.clone();
  return t;
}

at::Tensor assemble_tensor(const std::vector<at::Tensor>& local, const sharding::Placements& placements, const DeviceMesh& mesh) {
  std::vector<std::int64_t> coord(static_cast<std::size_t>(mesh.ndim()), 0);
  std::function<at::Tensor(int)> level = [&](int i) -> at::Tensor {
    if (i == mesh.ndim()) return local.at(static_cast<std::size_t>(mesh.rank(coord)));
    const Placement& p = placements.at(static_cast<std::size_t>(i));
    std::vector<at::Tensor> parts;
    for (std::int64_t j = 0; j < (p.is_replicate() ? 1 : mesh.size(i)); ++j) {
      coord[static_cast<std::size_t>(i)] = j;
      parts.push_back(level(i + 1));
    }
    coord[static_cast<std::size_t>(i)] = 0;
    if (p.is_shard()) return at::cat(parts, p.dim());
    if (p.is_partial()) return reduce_tensors(parts, spmdx::to_string(p.reduce_op()));
    return parts[0];
  };
  return level(0);
}

}  // namespace spmdx::exec
