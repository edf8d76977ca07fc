// DeviceMesh: an n-D arrangement of ranks with named dims, row-major (the last dim varies
// fastest), as torch.distributed.device_mesh.DeviceMesh. Each dim's slices are process groups.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "spmdx/strategy.h"

namespace spmdx::sharding {

class DeviceMesh {
 public:
  /// Throws std::invalid_argument for an empty mesh, a dim of size < 1, a repeated or empty
  /// name, or (when world_size > 0) a product of sizes that differs from world_size.
  explicit DeviceMesh(std::vector<MeshDim> dims, std::int64_t world_size = 0);

  const std::vector<MeshDim>& dims() const noexcept { return dims_; }
  int ndim() const noexcept { return static_cast<int>(dims_.size()); }
  std::int64_t size() const noexcept { return size_; }          ///< ranks in the mesh
  std::int64_t size(int dim) const { return dims_.at(static_cast<std::size_t>(dim)).size; }
  /// The index of the dim of that name, or -1.
  int dim_index(const std::string& name) const;

  /// The rank's coordinate along each dim.
  std::vector<std::int64_t> coordinate(std::int64_t rank) const;
  std::int64_t rank(const std::vector<std::int64_t>& coordinate) const;
  /// The ranks of `rank`'s group along `dim` (its slice: other coordinates fixed), in
  /// coordinate order.
  std::vector<std::int64_t> group(std::int64_t rank, int dim) const;
  /// "dp_shard=2 x tp=2".
  std::string str() const;

 private:
  std::vector<MeshDim> dims_;
  std::int64_t size_ = 1;
};

}  // namespace spmdx::sharding
