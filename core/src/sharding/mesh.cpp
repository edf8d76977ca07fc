#include "spmdx/sharding/mesh.h"

#include <set>
#include <stdexcept>

namespace spmdx::sharding {

DeviceMesh::DeviceMesh(std::vector<MeshDim> dims, std::int64_t world_size) : dims_(std::move(dims)) {
  if (dims_.empty()) throw std::invalid_argument("DeviceMesh: no dims");
  std::set<std::string> names;
  for (const auto& d : dims_) {
    if (d.name.empty() || !names.insert(d.name).second) {
      throw std::invalid_argument("DeviceMesh: dim names must be unique and non-empty, got '" + d.name + "' in " + str());
    }
    if (d.size < 1) throw std::invalid_argument("DeviceMesh: dim '" + d.name + "' has size " + std::to_string(d.size));
    size_ *= d.size;
  }
  if (world_size > 0 && size_ != world_size) {
    throw std::invalid_argument("DeviceMesh " + str() + " has " + std::to_string(size_) + " ranks but world_size is " +
                                std::to_string(world_size) + ": make the product of the parallel degrees equal world_size");
  }
}

int DeviceMesh::dim_index(const std::string& name) const {
  for (std::size_t i = 0; i < dims_.size(); ++i) {
    if (dims_[i].name == name) return static_cast<int>(i);
  }
  return -1;
}

std::vector<std::int64_t> DeviceMesh::coordinate(std::int64_t rank) const {
  if (rank < 0 || rank >= size_) throw std::out_of_range("rank " + std::to_string(rank) + " outside mesh " + str());
  std::vector<std::int64_t> c(dims_.size());
  for (std::size_t i = dims_.size(); i-- > 0;) {
    c[i] = rank % dims_[i].size;
    rank /= dims_[i].size;
  }
  return c;
}

std::int64_t DeviceMesh::rank(const std::vector<std::int64_t>& coordinate) const {
  std::int64_t r = 0;
  for (std::size_t i = 0; i < dims_.size(); ++i) r = r * dims_[i].size + coordinate.at(i);
  return r;
}

std::vector<std::int64_t> DeviceMesh::group(std::int64_t rank_, int dim) const {
  std::vector<std::int64_t> c = coordinate(rank_);
  std::vector<std::int64_t> out;
  for (std::int64_t i = 0; i < size(dim); ++i) {
    c[static_cast<std::size_t>(dim)] = i;
    out.push_back(rank(c));
  }
  return out;
}

std::string DeviceMesh::str() const {
  std::string out;
  for (const auto& d : dims_) out += (out.empty() ? "" : " x ") + d.name + "=" + std::to_string(d.size);
  return out.empty() ? "(empty)" : out;
}

}  // namespace spmdx::sharding
