#include "spmdx/sharding/redistribute.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>

#include "spmdx/sharding/rules.h"
#include "spmdx/sharding/spec.h"

namespace spmdx::sharding {
namespace {

const Placement kR = Placement::replicate();

bool shards(const Placement& p, int d) { return p.is_shard() && p.dim() == d; }

}  // namespace

double redistribute_bytes(const Placement& from, const Placement& to, double bytes, std::int64_t k) {
  if (from == to || k == 1) return 0;
  const double f = static_cast<double>(k - 1) / static_cast<double>(k);
  if (from.is_partial()) return to.is_shard() ? f * bytes : 2 * f * bytes;           // reduce_scatter / all_reduce
  if (from.is_shard()) return to.is_shard() ? f * bytes / static_cast<double>(k) : f * bytes;  // all_to_all / all_gather
  return to.is_partial() ? 1.0 : 0.0;  // local; a Partial made from a Replicate costs later, so not quite free
}

bool is_communication(const std::string& op) { return is_collective(op) || op == "chunk" || op == "to_partial"; }

bool is_collective(const std::string& op) {
  return op == "all_reduce" || op == "all_gather" || op == "reduce_scatter" || op == "all_to_all" || op == "all_to_all_v";
}

std::vector<RedistributeStep> redistribute_plan(const DeviceMesh& mesh, const ir::TensorMeta& meta, const Placements& from,
                                                const Placements& to, const CostModel& cost) {
  const int n = mesh.ndim();
  Placements state = from;
  // Mesh dims whose shard must be undone first because an outer mesh dim changes the same
  // tensor dim (nested shards are only right when applied outer to inner).
  std::vector<bool> force(static_cast<std::size_t>(n), false);
  for (bool changed = true; changed;) {
    changed = false;
    for (int i = 0; i < n; ++i) {
      const auto& f = state[static_cast<std::size_t>(i)];
      const auto& t = to[static_cast<std::size_t>(i)];
      if (f == t && !force[static_cast<std::size_t>(i)]) continue;
      for (int j = i + 1; j < n; ++j) {
        const auto& sj = state[static_cast<std::size_t>(j)];
        if (!force[static_cast<std::size_t>(j)] && sj.is_shard() && (shards(f, sj.dim()) || shards(t, sj.dim()))) {
          force[static_cast<std::size_t>(j)] = changed = true;
        }
      }
    }
  }
  std::vector<RedistributeStep> steps;
  const std::vector<std::int64_t> zero(static_cast<std::size_t>(n), 0);
  auto others_shard = [&](int i, int d) {
    for (int j = 0; j < n; ++j) {
      if (j != i && (shards(state[static_cast<std::size_t>(j)], d) || shards(to[static_cast<std::size_t>(j)], d))) return true;
    }
    return false;
  };
  // Whether a reduce_scatter on mesh dim i along tensor dim d gives the right block: it does
  // when no other mesh dim shards d, or only outer ones that stay as they are (the local
  // tensor is then their block, and nested shards go outer to inner: the same block that
  // all_reduce + chunk would give, for half the bytes).
  auto scatter_ok = [&](int i, int d) {
    for (int j = 0; j < n; ++j) {
      if (j == i) continue;
      const auto& sj = state[static_cast<std::size_t>(j)];
      const auto& tj = to[static_cast<std::size_t>(j)];
      if (!shards(sj, d) && !shards(tj, d)) continue;
      if (j < i && sj == tj && !force[static_cast<std::size_t>(j)]) continue;
      return false;
    }
    return true;
  };
  for (int i = n - 1; i >= 0; --i) {
    Placement& s = state[static_cast<std::size_t>(i)];
    const Placement& t = to[static_cast<std::size_t>(i)];
    if ((s == t && !force[static_cast<std::size_t>(i)]) || s.is_replicate()) continue;
    // The block this step moves: the tensor as every other mesh dim holds it now (outer dims
    // still as they were, inner ones already redistributed), whole along mesh dim i. Counting
    // only the outer dims' shards overstated, e.g., FSDP's all_gather of a TP-sharded weight
    // by the TP degree.
    Placements seen = state;
    seen[static_cast<std::size_t>(i)] = kR;
    const double bytes = shape_bytes(shape_after(mesh, seen, meta.shape, zero, n), meta.dtype);
    const std::int64_t k = mesh.size(i);
    RedistributeStep step{i, s, kR, "", 0};
    if (s.is_partial()) {
      if (t.is_shard() && !force[static_cast<std::size_t>(i)] && scatter_ok(i, t.dim())) step.to = t, step.op = "reduce_scatter";
      else step.op = "all_reduce";
    } else if (t.is_shard() && !force[static_cast<std::size_t>(i)] && !others_shard(i, s.dim()) && !others_shard(i, t.dim())) {
      step.to = t, step.op = "all_to_all";
    } else {
      step.op = "all_gather";
    }
    step.bytes = redistribute_bytes(step.from, step.to, bytes, k);
    const double messages = static_cast<double>(k - 1) * (step.op == "all_reduce" ? 2 : 1);
    step.seconds = messages * cost.alpha + step.bytes / cost.beta;
    step.messages = messages;
    s = step.to;
    steps.push_back(step);
  }
  for (int i = 0; i < n; ++i) {
    Placement& s = state[static_cast<std::size_t>(i)];
    const Placement& t = to[static_cast<std::size_t>(i)];
    if (s == t) continue;
    RedistributeStep step{i, s, t, t.is_shard() ? "chunk" : (t.is_partial() && t.reduce_op() == ReduceOp::sum ? "to_partial" : "none"), 0};
    s = t;
    steps.push_back(step);
  }
  return steps;
}

std::string to_string(const std::vector<RedistributeStep>& plan) {
  std::ostringstream out;
  for (std::size_t i = 0; i < plan.size(); ++i) {
    const auto& s = plan[i];
    out << (i ? "; " : "") << "mesh dim " << s.mesh_dim << ": " << s.from.str() << " -> " << s.to.str() << " " << s.op;
    if (s.bytes > 0) out << " (" << static_cast<std::int64_t>(s.bytes) << " bytes)";
  }
  return out.str();
}

}  // namespace spmdx::sharding
