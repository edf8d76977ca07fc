// Debug hook plugins: graph pictures, partition checks, timelines, divergence detection, a
// flight recorder (docs/DESIGN.md: "Debug hooks").
//
// The host calls a hook at four kinds of moments:
//  - compile stages (captured, propagated, rewritten, planned), once per job on rank 0 (and by
//    `spmdx compile`), with a GraphView of the logical graph or of each rank's graph;
//  - validation of the propagated and rewritten graphs: per node OnVertexValidate and per edge
//    OnEdgeConsistency, the design's callbacks;
//  - per collective on every rank: when the executor issues it and when it completes or fails;
//  - per step on every rank, after the step's global synchronisation (OnGlobalSyncComplete).
// Every callback has a default that does nothing, so a hook overrides only what it needs.
//
// Errors: a hook that throws is reported with its name and the callback, and the run goes on
// (after 10 errors the host stops calling it). Only a ValidationError stops the job: a
// validator throws it when its options say the check must fail the run.
//
// Threads: on_collective and on_step_end come from the rank's compute thread; on_failure may
// come from another thread (a signal) while they run, so a hook that keeps state for it locks.
//
// Times are wall-clock seconds since the Unix epoch (system_clock), so that traces of several
// ranks on one host line up. Plain C++20: part of the plugin ABI.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "spmdx/comm.h"
#include "spmdx/placement.h"
#include "spmdx/strategy.h"

namespace spmdx {

/// Where in compilation a GraphView was taken.
///  captured:   the logical train-step graph (forward, loss, backward, clip, AdamW), no placements;
///  propagated: the logical graph, every value placed on the mesh (GraphEdge::to filled in);
///  rewritten:  one rank's graph with local shapes and explicit collectives;
///  planned:    the same in execution order, with where each collective is waited for.
enum class CompileStage : std::uint8_t { captured, propagated, rewritten, planned };

inline const char* to_string(CompileStage s) noexcept {
  switch (s) {
    case CompileStage::captured: return "captured";
    case CompileStage::propagated: return "propagated";
    case CompileStage::rewritten: return "rewritten";
    case CompileStage::planned: return "planned";
  }
  return "unknown";
}

/// A tensor of a graph.
struct GraphValue {
  std::string name;                    ///< "tokens", "layers.0.attention.wq.weight", or "%12"
  std::vector<std::int64_t> shape;     ///< global in logical graphs, local in rank graphs
  std::string dtype;                   ///< "f32", "i64", ...
  std::int64_t bytes = 0;              ///< of `shape`
  std::vector<Placement> placements;   ///< one per mesh dim; empty at `captured`
  int producer = -1;                   ///< node index, -1 for a graph input
};

/// A node (op) of a graph.
struct GraphNode {
  std::string op;                      ///< "matmul", "all_reduce", ...
  std::string attrs;                   ///< printed attributes, "dim=0 mesh_dim=1"
  std::vector<int> inputs;             ///< value indices
  std::vector<int> outputs;            ///< value indices
  /// `propagated`: the placements the node reads each input in (a difference from the value's
  /// own placements is a redistribution); empty at other stages.
  std::vector<std::vector<Placement>> reads;
  /// "layers.3", "tok_embeddings", "norm", ...: the layer of the parameter the node reads (a
  /// collective of one too), else that of its input made last; "" when none.
  std::string layer;
  double flops = 0;                    ///< estimate: 2·M·N·K for matmuls, 4·B·H·S²·D for attention, else elements written
  bool collective = false;             ///< all_reduce, all_gather, reduce_scatter or all_to_all
  int mesh_dim = -1;                   ///< a collective's mesh dim (its group)
  std::int64_t comm_bytes = 0;         ///< a collective's bytes sent per rank (ring counts)
  int wait_before = -1;                ///< `planned`: the node before which the collective is waited for (-1: at the end)
};

/// One view of a graph, self-contained (no pointers into the host).
struct GraphView {
  CompileStage stage = CompileStage::captured;
  int rank = -1;                       ///< -1 for the logical graph
  int world_size = 1;
  std::vector<MeshDim> mesh;
  std::vector<GraphValue> values;
  std::vector<GraphNode> nodes;        ///< in execution order
  std::vector<int> inputs;             ///< value indices of the graph inputs
  std::vector<std::pair<std::string, int>> outputs;  ///< named graph outputs
};

/// A use of a value: producer (node or graph input) -> consumer node.
struct GraphEdge {
  int value = -1;
  int producer = -1;                   ///< node index, -1 for a graph input
  int consumer = -1;                   ///< node index
  int input_index = 0;                 ///< which input of the consumer
  std::vector<Placement> from;         ///< as produced
  std::vector<Placement> to;           ///< as the consumer reads it (differs: a redistribution)
};

/// Every hook instance gets this once, before any other callback.
struct HookContext {
  std::string name;                    ///< the hook's name ("timeline")
  int rank = 0;
  int world_size = 1;
  std::vector<MeshDim> mesh;
  std::vector<std::int64_t> coordinate;  ///< this rank's place on the mesh
  std::string output_dir;              ///< <job.dump_folder>/hooks/<name>/, created by the host
  Store* store = nullptr;              ///< for exchanging results across ranks; null with one rank or in `spmdx compile`
  double timeout_seconds = 300;        ///< comm.timeout_seconds: how long cross-rank waits may take
  bool compile_only = false;           ///< `spmdx compile`: no step will run
  /// The first step this run trains: 1, or the step after the checkpoint it resumed from in
  /// the same dump folder. A hook that writes files keeps what earlier runs recorded for the
  /// steps before it, and replaces the rest (ABI 2.1).
  std::int64_t first_step = 1;
};

enum class CollectiveState : std::uint8_t { issued, completed, failed };

inline const char* to_string(CollectiveState s) noexcept {
  switch (s) {
    case CollectiveState::issued: return "issued";
    case CollectiveState::completed: return "completed";
    case CollectiveState::failed: return "failed";
  }
  return "unknown";
}

/// A collective of the executor, reported when issued and again when it completes or fails.
struct CollectiveInfo {
  std::string op;                      ///< "all_reduce", "all_gather", "reduce_scatter", "all_to_all"
  int mesh_dim = 0;
  std::string group_name;              ///< the mesh dim's name ("dp_shard")
  std::vector<int> group_ranks;        ///< global ranks of the group, ascending
  std::uint64_t seq = 0;               ///< per group, from 0 over the run (as c10d's sequence number)
  std::int64_t step = 0;               ///< the training step
  std::int64_t bytes = 0;              ///< this rank's input bytes
  CommDType dtype = CommDType::f32;
  std::vector<std::int64_t> shape;     ///< this rank's input shape
  std::string value;                   ///< the value it produces ("%123")
  CollectiveState state = CollectiveState::issued;
  double issued_at = 0;                ///< seconds since the epoch
  double started_at = 0;               ///< when the backend began moving data (0: unknown)
  double finished_at = 0;              ///< when it completed or failed (0: not yet)
  std::string error;                   ///< `failed`: the backend's message
  /// Its place in the step's plan: the ordinal, among the step's collective nodes in plan
  /// order, of the node that issues it (a bucket: its last member). The same on every rank
  /// (every rank runs the same plan), so ranks compare it to tell a skipped collective from
  /// the next one (ABI 2.1; -1: not known).
  std::int64_t index = -1;
};

/// A tensor of this rank's train state, in host memory; valid during the callback only.
struct TensorView {
  std::string name;                    ///< "layers.0.attention_norm.weight", "exp_avg.<param>", "loss"
  std::vector<std::int64_t> shape;     ///< local
  CommDType dtype = CommDType::f32;
  const void* data = nullptr;          ///< contiguous
  std::size_t bytes = 0;
  std::vector<Placement> placements;   ///< one per mesh dim
};

/// A span of time on one of the rank's threads.
struct Span {
  std::string name;                    ///< the op ("matmul", "all_reduce")
  std::string thread;                  ///< "compute" or "comm"
  double start = 0;                    ///< seconds since the epoch
  double end = 0;
  std::int64_t bytes = 0;              ///< comm: bytes sent by this rank; compute: 0
};

struct StepInfo {
  std::int64_t step = 0;               ///< 1-based training step just completed
  bool last = false;                   ///< the run's last step
  int rank = 0;
  int world_size = 1;
  double loss = 0.0;                   ///< the step's global loss (mean over tokens)
  double step_seconds = 0.0;           ///< wall time of the step on this rank
  double comm_seconds = 0.0;           ///< time some collective was in flight (union of spans)
  double exposed_comm_seconds = 0.0;   ///< time compute waited for collectives
  double hidden_comm_seconds = 0.0;    ///< of comm_seconds, the time compute was not waiting; hidden / comm is the overlap ratio
  std::vector<TensorView> tensors;     ///< the state after the step: parameters, then optimizer state, then "loss"
  std::vector<Span> spans;             ///< the step's compute (per node) and comm (per collective) spans
};

/// Thrown by a validator whose check fails and whose options say the run must stop; the host
/// stops the job before its next step (or before the first one) with this message.
class ValidationError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class Hook {
 public:
  virtual ~Hook() = default;
  virtual void init(const HookContext& context) { (void)context; }
  /// A compile stage's graph: the logical graph (captured, propagated), then each rank's
  /// (rewritten, planned), on rank 0 only.
  virtual void on_compile_stage(const GraphView& graph) { (void)graph; }
  /// OnVertexValidate: every node of the propagated and rewritten graphs, in order.
  virtual void on_vertex_validate(const GraphView& graph, int node) { (void)graph, (void)node; }
  /// OnEdgeConsistency: every edge of the same graphs; false marks the edge inconsistent (the
  /// host reports it with the hook's name; a ValidationError stops the job).
  virtual bool on_edge_consistency(const GraphView& graph, const GraphEdge& edge) { return (void)graph, (void)edge, true; }
  /// After the validation callbacks of one graph.
  virtual void on_validate_end(const GraphView& graph) { (void)graph; }
  /// After the last compile stage, before any step: where a validator that has seen every
  /// graph decides (a ValidationError stops the job).
  virtual void on_compile_end() {}
  /// A collective was issued, or completed, or failed.
  virtual void on_collective(const CollectiveInfo& collective) { (void)collective; }
  /// OnGlobalSyncComplete: after each step, on every rank.
  virtual void on_step_end(const StepInfo& step) { (void)step; }
  /// The rank is failing (a collective failed or timed out, a signal, an exception): dump now.
  virtual void on_failure(const std::string& what) { (void)what; }
  /// After the last step (not called when the run fails).
  virtual void finish() {}
};

}  // namespace spmdx
