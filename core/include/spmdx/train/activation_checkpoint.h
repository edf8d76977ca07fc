// Activation checkpointing as a graph pass over the train step (torchtitan's
// [activation_checkpoint], torch.utils.checkpoint's recomputation): the forward values of a
// checkpointed layer that the backward reads are no longer kept from the forward; the nodes
// that make them run again, from the layer's inputs, just before their first backward reader.
// Run on the logical graph, before sharding: a collective inside a recomputed region (TP's
// all_reduce) is inserted for the recomputation too, and the RuntimePlan places it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "spmdx/ir/graph.h"

namespace spmdx::train {

/// [activation_checkpoint] as torchtitan reads it.
struct ActivationCheckpoint {
  std::string mode = "none";  ///< "none", "full" (every layer) or "selective"
  /// selective: "op" keeps the outputs of matmuls and attention (torchtitan's op save list:
  /// mm, sdpa) and recomputes the rest; a positive integer N recomputes every N-th layer fully.
  std::string selective_option = "op";
  /// activation_checkpoint.keep_collective_outputs: a collective that a recomputation would issue
  /// again reads the forward's output instead (keep_collective_outputs()); off: re-issued.
  bool keep_collective_outputs = false;
};

/// What the pass did, for logs and tests.
struct CheckpointReport {
  std::int64_t layers = 0;            ///< layers checkpointed
  std::int64_t recomputed_nodes = 0;  ///< nodes added to recompute forward values
  /// Bytes (global shapes) of the forward values the backward no longer keeps from the forward.
  std::int64_t freed_bytes = 0;
};

/// The ops whose outputs selective "op" checkpointing keeps (torchtitan's _save_list:
/// aten.mm and the scaled-dot-product attention kernels).
bool kept_by_selective(const std::string& op);

/// Rewrites `graph`, a train step whose first `forward_nodes` nodes are the forward (as
/// append_train_step leaves it), into a new graph with the same inputs, outputs and values.
/// A layer is the run of forward nodes after a read of a trainable parameter whose name has a
/// numbered prefix ("layers.3.attention.wq.weight" -> layers.3, models::layer_of) until a read
/// of another layer's or an unnumbered parameter (embeddings, final norm, output: never
/// checkpointed). `params`: the trainable parameter names. Throws std::invalid_argument for an
/// unknown mode or selective option.
ir::Graph checkpoint_activations(const ir::Graph& graph, std::size_t forward_nodes, const std::vector<std::string>& params,
                                 const ActivationCheckpoint& options, CheckpointReport* report = nullptr);

/// The same, for a train step whose forward nodes are those flagged in `forward` (one flag per
/// node, in graph order): gradient accumulation's step, where each microbatch's forward is
/// followed by its backward. A layer's run ends at a backward node, so each microbatch's
/// layers are checkpointed on their own, and recomputed before that microbatch's backward
/// reads them. Throws std::invalid_argument, also when `forward` has not one flag per node.
ir::Graph checkpoint_activations(const ir::Graph& graph, const std::vector<bool>& forward, const std::vector<std::string>& params,
                                 const ActivationCheckpoint& options, CheckpointReport* report = nullptr);

/// On a rank's graph of a checkpointed train step (sharding::rank_graph): where a recomputation
/// issues a collective again on a value that computes what an earlier collective's input did
/// (the same ops on the same inputs: value numbering), the later one's readers read the earlier
/// one's output, kept from the forward to the backward as torchtitan's save_list keeps
/// reduce_scatter's; the recomputed nodes that fed only it are dropped. Only collectives of
/// values made from the batch ("tokens", "labels", and a microbatch's "tokens.K", "labels.K"): those of parameters alone (FSDP's
/// all_gathers, again in the backward) stay, as keeping them is reshard_after_forward = false.
/// Deterministic, so every rank merges the same collectives. Returns how many it merged.
std::int64_t keep_collective_outputs(ir::Graph& rank_graph);

}  // namespace spmdx::train
