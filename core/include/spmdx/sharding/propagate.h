// Sharding propagation (docs/DESIGN.md: "sharding propagation"), as GSPMD and PyTorch
// DTensor do: every value of the logical graph gets a placement per mesh dim. Graph inputs take
// what the strategies gave (Replicate otherwise); each node picks, per mesh dim, the strategy of
// its rule table (rules.h) with the least cost: the bytes its inputs' redistribution sends (a
// value already redistributed to the same placement is reused for free) plus the bytes of the
// outputs the rank computes (so that replicating work is not free). Greedy, in graph order.
#pragma once

#include <map>
#include <set>
#include <string>
#include <vector>

#include "spmdx/planner.h"
#include "spmdx/sharding/redistribute.h"
#include "spmdx/sharding/rules.h"

namespace spmdx::sharding {

/// Per node, per mesh dim: the strategy a planner chose, as signature() spells it.
using ForcedChoices = std::map<const ir::Node*, std::map<int, std::string>>;

struct DistributedPlan {
  DeviceMesh mesh;
  const ir::Graph* graph = nullptr;                                ///< the logical graph
  std::map<const ir::Value*, Placements> placement;                ///< as each value is produced
  std::map<const ir::Node*, std::vector<Placements>> inputs;       ///< what each node reads
  std::map<std::string, Placements> outputs;                       ///< each graph output, as returned
  double comm_bytes = 0;                                           ///< per rank per run, all steps
  double comm_seconds = 0;                                         ///< their alpha-beta estimate
  std::vector<double> comm_bytes_by_dim;                           ///< comm_bytes per mesh dim (ndim entries)
  std::vector<double> comm_messages_by_dim;                        ///< messages per rank per mesh dim (ring counts)
  /// FSDP's reshard after forward: node ids (ascending) after which the `use` inputs are
  /// redistributed again instead of keeping the earlier copies alive: the end of the forward
  /// (the loss); with gradient accumulation, the end of each microbatch's forward and of its
  /// backward, as FSDP2 gathers again in each microbatch's forward and backward. Empty: never.
  std::vector<std::int64_t> reshard_after;
  std::set<const ir::Value*> resharded;

  /// The key of a value's version in `placements` as read by `node` (a resharded input read
  /// after a reshard point is a different version from the one before it).
  std::string version_key(const ir::Value* v, const Placements& placements, const ir::Node* node) const;
  /// The keys of `placements` after each reshard point: a resharded value in its own
  /// placement needs no redistribution there either.
  std::vector<std::string> resharded_keys(const Placements& placements) const;

  /// The logical graph annotated: each node with the placements it reads and writes, and each
  /// redistribution that runs with its steps, once, before the node that makes it: a version
  /// another operand or an earlier node made already is reused (rank_graph), not listed again.
  std::string str() const;
  /// The same as JSON: {"mesh": [{name, size}], "comm_bytes", "comm_seconds",
  /// "comm_bytes_by_dim": {dim name: bytes}, "inputs": {name: "S(0)R"},
  /// "nodes": [{id, op, inputs: [...], outputs: [...]}], "redistributions": [{value, node, from,
  /// to, runs, steps: [{mesh_dim, op, from, to, bytes}]}], "outputs": {name: placements}}, one
  /// redistribution per operand read in other placements; `runs` false where the ranks reuse a
  /// version made before (str() leaves those out).
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
/// With sequence_parallel_dim >= 0 (the tp mesh dim), Megatron-LM's sequence parallelism
/// (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models";
/// torchtitan's SequenceParallel on the norms): the values sequence_parallel_values() names are
/// made Shard(1) on that mesh dim as soon as they exist, and their producers pay for getting
/// there. Nothing else is special: propagation then all_gathers them before the column-parallel
/// matmuls and reduce_scatters the row-parallel matmuls' Partial outputs into them, where
/// plain TP all_reduces, and the norms and residual adds run on 1/tp of the sequence.
/// With context_parallel_dim >= 0 (the cp mesh dim; train/context_parallel.h), the values
/// context_parallel_values() names are made Shard(1) on it the same way: the token embeddings,
/// from which the whole forward follows on its shard of the sequence. With
/// context_parallel_allgather, attention on that dim splits its query rows and all-gathers k
/// and v (Llama 3's; torchtitan's context_parallel_rotate_method = "allgather"); without, it
/// takes whatever moves the fewest bytes, which may split batch or heads by all_to_all
/// (DeepSpeed-Ulysses).
/// `forced` (propagate_optimal's choices, ForcedChoices): per node and mesh dim, the strategy
/// to take where the node's candidates have it and the rules above allow it.
/// `fault_domain_dim` (>= 0: fault tolerance's dp_replicate, job/fault_tolerance.h): on that
/// mesh dim only strategies whose inputs are summed (Partial -> Replicate: an all_reduce, which
/// runs over the live replica groups) or split locally (Replicate -> Shard) are taken where
/// another strategy is possible; the caller checks the rank graph for what is left.
/// Throws std::invalid_argument naming an input or output that is not in the graph or whose
/// placement count is not the mesh's ndim, or a sequence_parallel_dim or context_parallel_dim
/// the mesh has not, and ir::IrError for an op without sharding rules.
DistributedPlan propagate(const ir::Graph& graph, const DeviceMesh& mesh, const std::map<std::string, Placements>& inputs,
                          const std::map<std::string, Placements>& outputs = {},
                          const std::map<std::string, Placements>& use = {}, bool reshard_after_forward = false,
                          int sequence_parallel_dim = -1, int context_parallel_dim = -1, bool context_parallel_allgather = true,
                          const ForcedChoices* forced = nullptr, int fault_domain_dim = -1);

/// "S(0),R->S(0)": an OpStrategy's input and output placements on one mesh dim.
std::string signature(const OpStrategy& strategy);
/// The signature of the strategy `plan` runs `node` with on `mesh_dim`: what it reads and writes there.
std::string taken_signature(const DistributedPlan& plan, const ir::Node& node, int mesh_dim);

/// How the intra-op problems (propagate_optimal) price a plan: each mesh dim's link, and the
/// rates at which a rank computes (plan/estimate.h's Calibration measures them).
struct IntraOpCostModel {
  std::vector<CostModel> links;      ///< per mesh dim; a missing one is CostModel{}
  double flops_per_second = 50e9;    ///< matmuls and attention (node_flops, cost_model.h)
  double bytes_per_second = 10e9;    ///< other ops: the bytes they read and write
  double collective_seconds = 0;     ///< a redistribution's fixed cost beyond alpha-beta (plan::Calibration's)
  double time_limit_seconds = 10;    ///< the planner's, for all mesh dims: each gets what is left; a dim reached with none keeps propagation's choices
};

/// What the planner did on one mesh dim.
struct IntraOpDim {
  std::string mesh_dim;
  double greedy_seconds = 0;  ///< the problem's cost of propagate()'s own choice
  double chosen_seconds = 0;  ///< the planner's choice's cost
  double bound_seconds = 0;   ///< the solver's lower bound
  bool optimal = false;       ///< proven
  double solve_seconds = 0;
  std::int64_t changed = 0;   ///< nodes whose strategy differs from propagate()'s
  std::int64_t forced_kept = 0;  ///< of the planner's choices, those the propagation could take
  std::string solver;
};

/// propagate() with each mesh dim's strategies chosen by `planner` (planner.h; Alpa's intra-op
/// ILP) instead of greedily: dims in order, each problem built on the plan as propagated so far
/// (the other dims as placed), solved, and propagated again with the choices, so that the plan's
/// bookkeeping (hints, FSDP's versions, pins) is propagate()'s own. A choice the rules above
/// refuse for a node (a parameter read other than as its strategy placed it) falls back to the
/// greedy one. `report` (when not null) gets one entry per mesh dim of size > 1. Throws what
/// propagate() and the planner throw.
DistributedPlan propagate_optimal(const ir::Graph& graph, const DeviceMesh& mesh, const std::map<std::string, Placements>& inputs,
                                  const std::map<std::string, Placements>& outputs, const std::map<std::string, Placements>& use,
                                  bool reshard_after_forward, int sequence_parallel_dim, int context_parallel_dim, bool context_parallel_allgather,
                                  const spmdx::Planner& planner, const IntraOpCostModel& cost, std::vector<IntraOpDim>* report = nullptr);

/// The values context parallelism keeps sharded on the sequence: the outputs of the forward's
/// embedding lookups [batch, seq, dim] with at least `k` (the cp degree) positions.
std::set<const ir::Value*> context_parallel_values(const ir::Graph& graph, std::int64_t k);

/// The values sequence parallelism keeps sharded on the sequence: the input and output of each
/// normalization (rms_norm, layer_norm) that computes the loss (the forward; a recomputed
/// norm of activation checkpointing is not one), of 3 or more dims [batch, seq, ...] with at
/// least `k` (the tp degree) positions. Between two such norms sits the residual add, which
/// produces the next norm's input: the whole residual stream.
std::set<const ir::Value*> sequence_parallel_values(const ir::Graph& graph, std::int64_t k);

}  // namespace spmdx::sharding
