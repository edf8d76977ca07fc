// Placements of a tensor over one mesh dimension: Shard(d), Replicate, Partial(op).
//
// Small immutable values with equality, hashing and two printed forms, as PyTorch DTensor's
// `torch.distributed.tensor.placement_types`:
//   Shard(dim=0)  / S(0)     each rank along the mesh dim holds a torch.chunk slice of dim `dim`
//   Replicate()   / R        each rank holds the whole tensor
//   Partial(sum)  / P(sum)   each rank holds a partial value; the logical tensor is their reduction
//
// Plain C++20: part of the plugin ABI (interfaces/), no LibTorch, no Boost.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace spmdx {

/// Reduction applied across ranks, as `torch.distributed.ReduceOp` / `ncclRedOp_t`.
enum class ReduceOp : std::uint8_t { sum, avg, max, min, prod };

/// "sum", "avg", "max", "min", "prod".
inline const char* to_string(ReduceOp op) noexcept {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::avg: return "avg";
    case ReduceOp::max: return "max";
    case ReduceOp::min: return "min";
    case ReduceOp::prod: return "prod";
  }
  return "?";
}

class Placement {
 public:
  enum class Kind : std::uint8_t { shard, replicate, partial };

  /// Shard tensor dimension `dim` (>= 0) across the mesh dim.
  static Placement shard(int dim) { return Placement(Kind::shard, dim, ReduceOp::sum); }
  static Placement replicate() { return Placement(Kind::replicate, -1, ReduceOp::sum); }
  static Placement partial(ReduceOp op = ReduceOp::sum) { return Placement(Kind::partial, -1, op); }

  Kind kind() const noexcept { return kind_; }
  bool is_shard() const noexcept { return kind_ == Kind::shard; }
  bool is_replicate() const noexcept { return kind_ == Kind::replicate; }
  bool is_partial() const noexcept { return kind_ == Kind::partial; }
  /// The sharded tensor dimension; -1 unless is_shard().
  int dim() const noexcept { return dim_; }
  /// The pending reduction; meaningful only when is_partial().
  ReduceOp reduce_op() const noexcept { return op_; }

  /// Short form: "S(0)", "R", "P(sum)".
  std::string str() const {
    switch (kind_) {
      case Kind::shard: return "S(" + std::to_string(dim_) + ")";
      case Kind::replicate: return "R";
      case Kind::partial: return std::string("P(") + to_string(op_) + ")";
    }
    return "?";
  }
  /// Long form: "Shard(dim=0)", "Replicate()", "Partial(sum)".
  std::string repr() const {
    switch (kind_) {
      case Kind::shard: return "Shard(dim=" + std::to_string(dim_) + ")";
      case Kind::replicate: return "Replicate()";
      case Kind::partial: return std::string("Partial(") + to_string(op_) + ")";
    }
    return "?";
  }

  friend bool operator==(const Placement& a, const Placement& b) noexcept {
    if (a.kind_ != b.kind_) return false;
    if (a.kind_ == Kind::shard) return a.dim_ == b.dim_;
    if (a.kind_ == Kind::partial) return a.op_ == b.op_;
    return true;
  }
  friend bool operator!=(const Placement& a, const Placement& b) noexcept { return !(a == b); }

  std::size_t hash() const noexcept {
    std::size_t h = static_cast<std::size_t>(kind_);
    if (kind_ == Kind::shard) h = h * 31 + static_cast<std::size_t>(dim_);
    if (kind_ == Kind::partial) h = h * 31 + static_cast<std::size_t>(op_);
    return h;
  }

 private:
  Placement(Kind kind, int dim, ReduceOp op) : kind_(kind), dim_(dim), op_(op) {}
  Kind kind_;
  int dim_;
  ReduceOp op_;
};

/// One placement per mesh dim, printed without separators as DTensor does: "S(0)R".
inline std::string to_string(const std::vector<Placement>& placements) {
  std::string out;
  for (const auto& p : placements) out += p.str();
  return out;
}

}  // namespace spmdx

template <>
struct std::hash<spmdx::Placement> {
  std::size_t operator()(const spmdx::Placement& p) const noexcept { return p.hash(); }
};
