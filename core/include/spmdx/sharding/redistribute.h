// Redistribution (docs/DESIGN.md: "redistribute plans"): how a tensor changes placements
// on a DeviceMesh, as DTensor's redistribute does, as a list of steps per mesh dim with their
// bytes and alpha-beta time (Hockney 1994), printable before anything runs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "spmdx/ir/graph.h"
#include "spmdx/placement.h"
#include "spmdx/sharding/cost_model.h"
#include "spmdx/sharding/mesh.h"

namespace spmdx::sharding {

using Placements = std::vector<Placement>;  ///< one per mesh dim

struct RedistributeStep {
  int mesh_dim = 0;
  Placement from = Placement::replicate();
  Placement to = Placement::replicate();
  /// "all_reduce", "all_gather", "reduce_scatter", "all_to_all" (collectives), or "chunk",
  /// "to_partial", "none" (local, no bytes move).
  std::string op;
  /// Bytes each rank sends for this step, by the ring algorithms' counts (all_reduce
  /// 2(k-1)/k of the tensor, all_gather and reduce_scatter (k-1)/k, all_to_all (k-1)/k^2).
  double bytes = 0;
  /// Alpha-beta estimate (Hockney 1994) of the step's time, in seconds: messages x alpha +
  /// bytes / beta, with the ring's k-1 messages per phase. See CostModel (cost_model.h).
  double seconds = 0;
  /// Messages each rank sends for it: the ring's k-1 per phase (all_reduce 2 phases); 0 locally.
  double messages = 0;
};

/// The steps that take a tensor of global `meta` from `from` to `to` on `mesh`: collectives
/// from the last mesh dim to the first, then local steps from the first to the last.
std::vector<RedistributeStep> redistribute_plan(const DeviceMesh& mesh, const ir::TensorMeta& meta, const Placements& from,
                                                const Placements& to, const CostModel& cost = {});
/// "mesh dim 1: P(sum) -> R all_reduce (2048 bytes); ...".
std::string to_string(const std::vector<RedistributeStep>& plan);

/// Bytes one rank sends to move a tensor of `bytes` (as seen on one mesh dim of `k` ranks)
/// from one placement to another on that dim, by the ring algorithms' counts: reduce_scatter
/// and all_gather (k-1)/k of it, all_reduce twice that, all_to_all (k-1)/k^2; local changes 0
/// (a Partial made from a Replicate 1, so that it is not quite free: it costs later).
double redistribute_bytes(const Placement& from, const Placement& to, double bytes, std::int64_t k);

/// True for the ops rank_graph() inserts (collectives and their local halves).
bool is_communication(const std::string& op);
/// True for the ops that talk to other ranks: all_reduce, all_gather, reduce_scatter, all_to_all.
bool is_collective(const std::string& op);

}  // namespace spmdx::sharding
