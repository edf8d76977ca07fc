// Context parallelism (torchtitan's parallelism.context_parallel_degree, mesh dim cp): the
// sequence of every activation is sharded over cp, and attention sees every key it may see
// by all-gathering k and v over cp, as Llama 3 did (Dubey et al. 2024, section 3.3.2; torch's
// context_parallel with set_rotate_method("allgather")). The graph pass below prepares the
// forward graph for that; propagation and the rules do the rest (sdpa's query-row strategy,
// sharding/rules.cpp), so every collective is placed by the rewriter, as for any mesh dim.
#pragma once

#include <cstdint>

#include "spmdx/ir/graph.h"

namespace spmdx::train {

/// The forward graph of a model run with context parallelism over a sequence of `seq_len`:
///   - the flattening reshapes that feed the loss ([batch, seq, ...] -> [batch x seq, ...], read
///     only by cross_entropy, count_valid or loss parallel's ops, directly or through casts)
///     flatten sequence-major (transpose(0, 1) first), so that a sequence shard stays one
///     block of rows and the logits are never gathered; the loss is the same sum over tokens.
///     All of them or none: where a reader of the rows also reads a value flattened otherwise,
///     they all stay batch-major (correct, but the logits are then gathered);
///   - with `chunks` > 1 (causal load balancing, torch's _HeadTailLoadBalancer): the inputs
///     "tokens" and "labels" [batch, seq] and the rotary_embedding tables [seq, d] go through
///     seq_permute (pieces 0, chunks - 1, 1, chunks - 2, ...), and every sdpa is told
///     (attribute chunks), so that with chunks = 2 cp each rank of cp holds one early and one
///     late piece of the sequence: as many causal scores as any other rank.
/// Other nodes are copied as they are. The losses and gradients are those of `forward` up to
/// float rounding (the loss is summed in another order). Throws ir::IrError when chunks does
/// not divide seq_len.
ir::Graph context_parallel(const ir::Graph& forward, std::int64_t seq_len, std::int64_t chunks);

/// The train step (append_train_step's) with each linear weight gradient that autodiff wrote as
/// matmul(transpose(reshape(g, [-1, out])), reshape(x, [-1, in])) over [batch, seq, ...] values
/// written as linear_weight_grad(g, x): the same sum over every token, but with the sequence
/// sharded it needs no all_to_all to a batch split first (the flattened rows of a sequence
/// shard are not a shard of the rows). Other nodes are copied as they are.
ir::Graph context_parallel_weight_grads(const ir::Graph& step);

}  // namespace spmdx::train
