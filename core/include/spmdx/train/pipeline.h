// Pipeline parallelism (GPipe, Huang et al. 2019; PipeDream-Flush's 1F1B, Narayanan et al.
// 2021; torch.distributed.pipelining and torchtitan's pipeline_parallel_* keys): the ranks form
// `stages` groups along an outermost mesh dim `pp`; each group holds the layers of one stage.
// The train step is not rewritten for it: every rank plans the whole step as one graph on the
// other mesh dims (sharding::rank_graph), and stage_graph() then keeps the nodes of its stage,
// replaces each value another stage computes by a recv and adds a send for each value another
// stage reads, and orders the nodes by the schedule (each microbatch's forward and backward are
// the unrolled microbatches of train_step.h). Clipping and AdamW follow their parameters: each
// stage sums its gradients' squares, the sum crosses the stages once, and the last stage sends
// the clip coefficient back (the grad norm reduced over pp). The loss and grad norm are the last
// stage's, sent to every stage so that each rank reports them.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "spmdx/ir/graph.h"
#include "spmdx/sharding/mesh.h"

namespace spmdx::train {

/// [parallelism] pipeline_parallel_*, resolved (job::job_spec).
struct PipelineSpec {
  std::int64_t stages = 1;         ///< pipeline_parallel_degree: groups of ranks (mesh dim pp)
  std::string schedule = "1F1B";   ///< pipeline_parallel_schedule: "GPipe", "1F1B" or "Interleaved1F1B"
  std::int64_t microbatches = 1;   ///< per step: the train step's microbatches (TrainStepConfig)
  /// Chunks of layers per stage (Interleaved1F1B's virtual stages; 1 otherwise): chunk c runs on
  /// stage c % stages, so stage s holds chunks s, s + stages, ...
  std::int64_t virtual_stages = 1;
  /// Per chunk, its first layer (first_layer[0] = 0, ascending): chunk c holds layers
  /// [first_layer[c], first_layer[c + 1]), the last chunk those after its first.
  std::vector<std::int64_t> first_layer{0};
  std::int64_t chunks() const { return stages * virtual_stages; }
  /// The chunk of layer `layer` (>= 0): its stage without virtual stages.
  int chunk_of_layer(std::int64_t layer) const;
};

/// The layer index a parameter's name carries: the number ending models::layer_of's prefix
/// ("layers.3.attention.wq.weight", Hugging Face's "model.layers.3.mlp.up_proj.weight", GPT-2's
/// "transformer.h.3.attn.c_attn.weight": 3), or -1 ("tok_embeddings.weight").
std::int64_t layer_of(const std::string& name);

/// One entry of a stage's schedule: the forward or the backward of a microbatch.
struct PipelineAction {
  bool forward = true;
  std::int64_t microbatch = 0;
  std::int64_t chunk = 0;  ///< the chunk it runs (the stage itself without virtual stages)
  friend bool operator==(const PipelineAction&, const PipelineAction&) = default;
};

/// Per stage, its actions in the order it runs them. GPipe: every forward, then every backward
/// (microbatch order). 1F1B (torch.distributed.pipelining.Schedule1F1B): stage s runs
/// min(stages - 1 - s, microbatches) forwards, then a forward and a backward in turn, then the
/// backwards left, so that at most stages - s microbatches' activations are alive on it.
/// Interleaved1F1B (virtual_stages > 1; Megatron-LM's interleaved schedule, torch's
/// ScheduleInterleaved1F1B): microbatches in groups of `stages` go through each of the stage's
/// chunks in turn, with (stages - s - 1) x 2 + (virtual_stages - 1) x stages warm-up forwards;
/// needs microbatches a multiple of stages.
std::vector<std::vector<PipelineAction>> pipeline_schedule(const PipelineSpec& spec);

/// The schedule's idle share when a forward and a backward each take the same time on every
/// stage: (stages - 1) / (virtual_stages x microbatches + stages - 1), for GPipe and 1F1B alike
/// (virtual_stages 1) and Interleaved1F1B.
double bubble_fraction(const PipelineSpec& spec);

/// The layers stage `stage` holds, for messages: "layers 0 to 1", "layer 2", "layers 4 on" (the
/// last chunk), each of its chunks' joined by ", " with virtual stages.
std::string stage_layers(const PipelineSpec& spec, std::int64_t stage);

/// The schedule as a table of ticks for every stage (a forward takes 1 tick, a backward 2, as
/// the backward computes two gradients per matmul), `stage`'s row marked; each cell is the
/// action running ("F3", "B0") or idle ("."), then each stage's idle share. What
/// `spmdx compile --dump` writes as rankR.schedule.txt.
std::string schedule_table(const PipelineSpec& spec, std::int64_t stage);

/// Per node of `graph` (a rank graph of the train step: sharding::rank_graph, whose inputs are
/// the parameters `params`, their AdamW state "exp_avg.P" and "exp_avg_sq.P", the batch, lr and
/// step), the chunk that computes it (its stage without virtual stages), or -1 for a node no parameter reaches (a RoPE table's
/// slice: each stage that reads it computes it). A parameter belongs to its layer's stage;
/// one outside the layers to stage 0 when the forward reads it before any layer's (the
/// embedding), else to the last stage (the final norm, the output). A forward node goes to
/// the latest stage of its inputs; a backward or optimizer node to the latest stage of the
/// parameters and forward values it reads (the stage whose forward it differentiates), else
/// (gradients only) to the stage of its largest input: a gradient's clipping runs where the
/// gradient is, and only the clip coefficient moves.
std::vector<int> node_stages(const ir::Graph& graph, const PipelineSpec& spec, const std::vector<std::string>& params);

/// What stage_graph made.
struct StageGraph {
  ir::Graph graph;
  std::int64_t stage = 0;
  std::int64_t sends = 0, recvs = 0;       ///< send and recv nodes
  std::int64_t bytes_sent = 0;             ///< bytes the sends move per step
  /// Every input of the whole graph by name: the stage whose ranks hold it as an input of their
  /// stage graph (a parameter and its AdamW state: their stage; a RoPE table, the batch: the
  /// first stage that reads it; none reads it: absent), for checkpoints.
  std::map<std::string, int> input_stage;
};

/// The graph global rank `rank` runs: the nodes of its stage (rank / ranks_per_stage) of
/// `graph` (the rank graph of its position on the other mesh dims) in schedule order, each
/// value of another stage received from the rank of that stage at the same position (rank +
/// (other - stage) x ranks_per_stage), each value another stage reads sent to it right after it
/// is made (tags: the value's place in a walk of the graph every rank makes alike). Inputs: the
/// graph inputs its nodes read. Outputs: "next.S" for its stage's state, and every other output
/// of `graph` ("loss", "grad_norm", "found_inf"), received from the stage that computes it.
/// Collectives' mesh_dim counts from 1: the executor's mesh is pipeline_mesh()'s. Throws
/// std::invalid_argument when the stages leave a stage without a parameter.
StageGraph stage_graph(const ir::Graph& graph, const PipelineSpec& spec, const std::vector<std::string>& params, std::int64_t rank,
                       std::int64_t ranks_per_stage);

/// `mesh` (the mesh the train step is sharded over) with the dim pp of `stages` ranks put
/// outermost: the mesh the ranks of a pipelined job form (ranks_per_stage = mesh.size()); pp
/// alone when a stage has one rank.
sharding::DeviceMesh pipeline_mesh(const sharding::DeviceMesh& mesh, std::int64_t stages);

}  // namespace spmdx::train
