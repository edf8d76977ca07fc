// RuntimePlan (docs/DESIGN.md): how one rank runs its DistributedGraph. From the rank's
// graph (sharding::rank_graph) it decides
//  - the execution order: FSDP's parameter all_gathers of the next layer are issued when the
//    current layer's parameters are first used (FSDP2's forward and backward prefetch), every
//    other node keeps the graph's order;
//  - buckets: gradient all_reduces (DDP) and reduce_scatters (FSDP) of one mesh dim, reduce op
//    and dtype whose first use is far enough are fused into flat buffers of up to bucket_bytes, the first one of a mesh dim up to
//    first_bucket_bytes so that communication starts early in the backward (PyTorch DDP's
//    Reducer: bucket_cap_mb = 25, first bucket 1 MiB);
//  - waits: a collective (or bucket) is issued once its last input exists and waited for just
//    before its first use (torch.distributed._spmd's schedule_comm_wait), or right away with
//    overlap off; a gradient reduce_scatter, whose input is the whole gradient, is waited for
//    at the latest when the next reduce_scatter of its mesh dim starts (FSDP2 keeps one in
//    flight: the full gradients of a layer go as the next layer's are made, instead of all of
//    them living until the optimizer reads the shards).
// Every rank of a group makes the same buckets: the members of a group run the same
// collectives with the same shapes in the same order. No LibTorch.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "spmdx/ir/graph.h"
#include "spmdx/sharding/mesh.h"

namespace spmdx::plan {

struct PlanOptions {
  double bucket_bytes = 25.0 * 1024 * 1024;      ///< a bucket's cap, bytes (0: no bucketing)
  double first_bucket_bytes = 1.0 * 1024 * 1024;  ///< the cap of each mesh dim's first bucket, bytes
  bool prefetch = true;                           ///< issue the next layer's parameter all_gathers early
  bool overlap = true;                            ///< false: wait for each collective right after issuing it
  /// The caller hands the step its parameters and AdamW state to update in place (JAX's
  /// buffer donation; spmdx run does): the inputs adamw reads as param, exp_avg and
  /// exp_avg_sq are overwritten with their updates (memory_plan.h).
  bool donate_state = false;
  bool in_place = true;  ///< elementwise kernels write into an input that dies there (memory_plan.h)
};

/// Collectives sent as one over a flat buffer. all_reduce: the members' inputs concatenated in
/// member order (each flattened), all_reduced once, each member's output a slice of the result.
/// reduce_scatter: the buffer holds, for each rank j of the group in turn, every member's
/// chunk j (as FSDP2 packs a layer's gradients), so one reduce_scatter leaves each rank its
/// chunks of every member.
struct Bucket {
  std::vector<int> members;   ///< node indices (graph order) of its collectives, in execution order
  std::string op;             ///< "all_reduce" or "reduce_scatter"
  int mesh_dim = 0;
  std::string reduce_op;      ///< "sum", "avg", ...
  std::int64_t bytes = 0;     ///< of the flat buffer
  double cap = 0;             ///< the cap it was filled to: first_bucket_bytes for a mesh dim's first
  int issue_after = 0;        ///< position in RuntimePlan::order of its last member: issued there
  int first_use = 0;          ///< position in `order` of the first node reading any member
};

struct RuntimePlan {
  PlanOptions options;
  std::vector<int> order;         ///< node indices (graph order) in execution order
  std::vector<int> first_use;     ///< per node index: position in `order` of its first reader (order.size(): none)
  std::vector<int> bucket_of;     ///< per node index: its bucket, or -1
  std::vector<Bucket> buckets;
  std::vector<int> prefetched;    ///< node indices of the all_gathers moved ahead of their place
  std::int64_t collectives = 0;   ///< collective nodes in the graph
  std::int64_t issues = 0;        ///< backend calls per run: unbucketed collectives + buckets
  /// Per position in `order`: node indices of collectives (every member of a bucket) whose
  /// outputs are waited for before that position runs, ahead of their first use (the
  /// reduce_scatter bound above). Empty lists mostly; order.size() entries.
  std::vector<std::vector<int>> wait_before;
  /// The same per node index: the position wait_before waits for it at, or -1 (its first use).
  std::vector<int> bound_wait;

  /// Where the host waits for node `node`'s collective (its bucket's): its first use, an
  /// earlier wait_before position, or its issue with overlap off.
  int waited_at(int node) const;

  /// One line per collective issue (position, op, mesh dim, bytes, where it is waited for) and
  /// per bucket; the summary first. `graph` is the graph the plan was made for.
  std::string str(const ir::Graph& graph, const sharding::DeviceMesh& mesh) const;
  /// The same as JSON ("format": "spmdx.runtime_plan", version 1): options, collectives,
  /// issues, prefetched (the all_gathers' output value ids) and buckets ({op, reduce_op,
  /// mesh_dim, mesh_dim_name, bytes, cap, members: the member collectives' output value ids
  /// as in the graph's JSON, issue_after, first_use}). What `spmdx diff` compares.
  std::string to_json(const ir::Graph& graph, const sharding::DeviceMesh& mesh) const;
};

/// The plan for `graph` (a rank graph). Throws ir::IrError when the graph is not in
/// topological order.
RuntimePlan make_runtime_plan(const ir::Graph& graph, const sharding::DeviceMesh& mesh, const PlanOptions& options = {});


}  // namespace spmdx::plan
