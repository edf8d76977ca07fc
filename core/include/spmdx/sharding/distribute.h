// From one logical graph to per-rank graphs (../shared/DESIGN.md: sharding propagation ->
// redistribute plans -> Rewriter -> DistributedGraph), as GSPMD and PyTorch DTensor do:
//  1. propagate(): every value gets a placement per mesh dim. Graph inputs take what the
//     strategy gave (Replicate otherwise); each node picks, per mesh dim, the strategy of its
//     rule table with the least cost: the bytes its inputs' redistribution sends (a value
//     already redistributed to the same placement is reused for free) plus the bytes of the
//     outputs the rank computes (so that replicating work is not free). Greedy, in graph order.
//  2. redistribute_plan(): a placement change as a list of steps per mesh dim, printable
//     before anything runs.
//  3. rank_graph(): the rank's own graph: local shapes, and the plan's steps as collectives
//     (all_reduce, all_gather, reduce_scatter, all_to_all) and local ops (chunk, to_partial).
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "spmdx/ir/graph.h"
#include "spmdx/placement.h"
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
  /// bytes / beta, with the ring's k-1 messages per phase. See CostModel.
  double seconds = 0;
};

/// The alpha-beta cost model of the mesh's links, per mesh dim: alpha, the latency of one
/// message (seconds); beta, the bandwidth (bytes per second). The defaults are one host's
/// shared memory; a dim that spans hosts would use its network's numbers.
struct CostModel {
  double alpha = 10e-6;
  double beta = 10e9;
};

/// The steps that take a tensor of global `meta` from `from` to `to` on `mesh`: collectives
/// from the last mesh dim to the first, then local steps from the first to the last.
std::vector<RedistributeStep> redistribute_plan(const DeviceMesh& mesh, const ir::TensorMeta& meta, const Placements& from,
                                                const Placements& to, const CostModel& cost = {});
/// "mesh dim 1: P(sum) -> R all_reduce (2048 bytes); ...".
std::string to_string(const std::vector<RedistributeStep>& plan);

struct DistributedPlan {
  DeviceMesh mesh;
  const ir::Graph* graph = nullptr;                                ///< the logical graph
  std::map<const ir::Value*, Placements> placement;                ///< as each value is produced
  std::map<const ir::Node*, std::vector<Placements>> inputs;       ///< what each node reads
  std::map<std::string, Placements> outputs;                       ///< each graph output, as returned
  double comm_bytes = 0;                                           ///< per rank per run, all steps
  double comm_seconds = 0;                                         ///< their alpha-beta estimate
  /// FSDP's reshard after forward: nodes after this one (the loss) redistribute the `use`
  /// inputs again instead of keeping the forward's copies alive (-1: never).
  std::int64_t reshard_after = -1;
  std::set<const ir::Value*> resharded;

  /// The key of a value's version in `placements` as read by `node` (a resharded input read
  /// after the forward is a different version from the forward's).
  std::string version_key(const ir::Value* v, const Placements& placements, const ir::Node* node) const;

  /// The logical graph annotated: each node with the placements it reads and writes, and each
  /// redistribution with its steps.
  std::string str() const;
  /// The same as JSON: {"mesh": [{name, size}], "comm_bytes", "inputs": {name: "S(0)R"},
  /// "nodes": [{id, op, inputs: [...], outputs: [...]}], "redistributions": [{value, from, to,
  /// steps: [{mesh_dim, op, from, to, bytes}]}], "outputs": {name: placements}}.
  std::string to_json() const;
};

/// Placements for the whole graph. `inputs`: graph input name -> placements (others
/// Replicate); `outputs`: graph output name -> the placements it must be returned in (others
/// keep theirs, Partial ones become Replicate); `use`: graph input name -> the placements it is
/// redistributed to as soon as the step starts (FSDP's unshard: stored sharded, used whole);
/// such an input is read only in these placements or as stored (the strategy decided how it is
/// computed: a TP weight stays on its shard even where gathering it would move fewer bytes).
/// The gradient an adamw node reads is made in its parameter's placement as soon as it is
/// produced (all_reduce for DDP, reduce_scatter for FSDP), so clipping and AdamW reuse it.
/// With reshard_after_forward, the backward redistributes the `use` inputs again (FSDP2's
/// reshard_after_forward=True: less memory, one more all_gather per parameter).
/// Throws std::invalid_argument naming an input or output that is not in the graph or whose
/// placement count is not the mesh's ndim, and ir::IrError for an op without sharding rules.
DistributedPlan propagate(const ir::Graph& graph, const DeviceMesh& mesh, const std::map<std::string, Placements>& inputs,
                          const std::map<std::string, Placements>& outputs = {},
                          const std::map<std::string, Placements>& use = {}, bool reshard_after_forward = false);

/// The graph rank `rank` runs. Every rank's graph has the same nodes in the same order (only
/// shapes and attributes differ), so collectives match up across ranks. verify()-ed. Throws
/// ir::IrError when a local shape disagrees with its ShardingSpec.
ir::Graph rank_graph(const DistributedPlan& plan, std::int64_t rank);

/// True for the ops rank_graph() inserts (collectives and their local halves).
bool is_communication(const std::string& op);
/// True for the ops that talk to other ranks: all_reduce, all_gather, reduce_scatter, all_to_all.
bool is_collective(const std::string& op);

}  // namespace spmdx::sharding
