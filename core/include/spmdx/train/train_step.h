// The whole train step as one graph: forward -> loss -> backward -> global-norm gradient
// clipping -> AdamW, ready for the executor (and, later, for sharding).
#pragma once

#include <string>
#include <vector>

#include "spmdx/ir/graph.h"

namespace spmdx::train {

/// AdamW (Loshchilov & Hutter 2019) as torch.optim.AdamW (decoupled weight decay, bias
/// correction, amsgrad off).
struct AdamWConfig {
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
};

struct TrainStepConfig {
  AdamWConfig adamw;
  double max_norm = 1.0;  ///< clip the global L2 norm of all gradients to this (<= 0: no clipping)
};

/// Appends to `forward` (output "loss", a scalar; trainable parameters named in `params`) the
/// backward pass, clipping (as torch.nn.utils.clip_grad_norm_: coef = min(1, max_norm /
/// (norm + 1e-6))) and one AdamW update. Adds inputs "lr" and "step" (scalars in the loss's
/// dtype: the learning rate of this step and its 1-based count), and per parameter P the
/// state "exp_avg.P" and "exp_avg_sq.P" (zeros before the first step). Adds outputs
/// "grad_norm" (before clipping) and "next.S" for every state S (each P, exp_avg.P,
/// exp_avg_sq.P): feed them back as S for the next step. Throws ir::IrError naming a parameter
/// that is not a graph input.
void append_train_step(ir::Graph& forward, const std::vector<std::string>& params, const TrainStepConfig& config);

/// The state names append_train_step adds for `params`: each P, then exp_avg.P and
/// exp_avg_sq.P.
std::vector<std::string> train_state_names(const std::vector<std::string>& params);

/// Learning-rate factor of torchtitan's linear_warmup_linear_decay (then scaled into
/// [lr_min, 1]): `step` is 1-based; steps 1..warmup give step/(warmup+1); then
/// 1 - (step-1-warmup)/max(1, total-warmup). The learning rate of step s is lr * lr_factor(s, ...).
double lr_factor(std::int64_t step, std::int64_t warmup_steps, std::int64_t total_steps, double lr_min = 0.0);

}  // namespace spmdx::train
