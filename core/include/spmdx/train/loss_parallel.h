// Loss parallelism (torchtitan's parallelism.disable_loss_parallel = false, DTensor's
// loss_parallel(), Megatron-LM's vocab-parallel cross entropy) as a pass over the forward graph:
// cross entropy written with ops a rank can run on its own columns of the logits, so that under
// tensor parallelism the vocabulary-sharded logits of the column-parallel output layer are
// never gathered; only three numbers a row are all-reduced (the row maximum, the sum of exp,
// the target's logit).
#pragma once

#include "spmdx/ir/graph.h"

namespace spmdx::train {

/// The forward graph with each summed cross entropy, cross_entropy(logits[n, c], targets[n])
/// {reduction = "sum"}, written as
///   m = amax_rows(logits)                                  [n, 1]  (no gradient)
///   lse = log(sum_exp_rows(logits, m)) + m                 [n, 1]  (sum of exp(logits - m) a row)
///   loss = sum((lse - pick(logits, targets)) * valid_rows(targets))
/// with its ignore_index kept; the same value up to float rounding, and its gradient is
/// softmax(logits) - one_hot(targets) on the valid rows, as cross_entropy_backward's. With the
/// logits Shard(1) on a mesh dim, amax_rows gives Partial(max), sum_exp_rows and pick give
/// Partial(sum), and propagation all-reduces those [n, 1] values instead of the logits.
/// Other nodes, a mean cross entropy included, are copied as they are.
ir::Graph vocab_parallel_cross_entropy(const ir::Graph& forward);

}  // namespace spmdx::train
