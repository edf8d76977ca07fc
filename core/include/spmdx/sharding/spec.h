// ShardingSpec: one Placement per mesh dim plus the global TensorMeta; gives each rank's
// local shape and offset. Shards follow torch.chunk: a dim of n elements split k ways gives
// chunks of ceil(n/k), the last ones smaller (possibly empty). Several mesh dims sharding the
// same tensor dim nest in mesh-dim order, as DTensor does.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "spmdx/ir/tensor_meta.h"
#include "spmdx/placement.h"
#include "spmdx/sharding/mesh.h"

namespace spmdx::sharding {

/// The placements of their printed form ("S(0)R", "P(sum)", "" for none; to_string's inverse);
/// nullopt when `text` is not one (a shard dim past 999999, an unknown reduction, stray text).
std::optional<std::vector<Placement>> parse_placements(std::string_view text);

/// Sizes of the k chunks of n elements (torch.chunk, padded with empty chunks to k).
std::vector<std::int64_t> chunk_sizes(std::int64_t n, std::int64_t k);

struct ShardingSpec {
  std::vector<Placement> placements;  ///< one per mesh dim
  ir::TensorMeta meta;                ///< global

  /// The local shape at a mesh coordinate.
  std::vector<std::int64_t> local_shape(const DeviceMesh& mesh, const std::vector<std::int64_t>& coordinate) const;
  /// Where the local shard starts in the global tensor, per tensor dim.
  std::vector<std::int64_t> local_offset(const DeviceMesh& mesh, const std::vector<std::int64_t>& coordinate) const;
  /// "S(0)R f32[8, 64]".
  std::string str() const;
};

/// Bytes of a tensor of `shape` and `dtype`, as a double (a planned shape may not fit 64 bits
/// of elements): what the cost model counts.
double shape_bytes(const std::vector<std::int64_t>& shape, ir::DType dtype);

/// `shape` after the shards of mesh dims [0, upto) at `coordinate` (nested sharding): what mesh
/// dim `upto` sees. Also gives, in `offset` when not null, where that block starts.
std::vector<std::int64_t> shape_after(const DeviceMesh& mesh, const std::vector<Placement>& placements,
                                      std::vector<std::int64_t> shape, const std::vector<std::int64_t>& coordinate,
                                      int upto, std::vector<std::int64_t>* offset = nullptr);

}  // namespace spmdx::sharding
