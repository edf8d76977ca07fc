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
  /// Dynamic loss scaling for float16 (torch.amp.GradScaler's scale, unscale_, step): the
  /// backward runs on loss x "loss_scale" (an input), the gradients are unscaled before the
  /// norm and clipping, and AdamW skips the update when the norm is not finite.
  bool loss_scaling = false;
  /// Gradient accumulation (torchtitan's global_batch_size > local_batch_size x the
  /// data-parallel degree): the forward graph is one microbatch's, run this many times on the
  /// inputs "tokens", "labels" (microbatch 0) and "tokens.K", "labels.K" (K = 1 ..
  /// microbatches - 1), each microbatch's backward right after its forward (so one
  /// microbatch's activations live at a time). The loss and gradients are the microbatches'
  /// mean (torchtitan scales each microbatch's loss by 1 / steps), which is the full batch's
  /// mean loss; clipping and AdamW run once, on the summed gradients. A gradient is summed while
  /// it is Partial, so a data-parallel reduction (DDP's all_reduce, FSDP's reduce_scatter) runs
  /// once per step, as FSDP2's set_requires_gradient_sync(False) on all but the last microbatch.
  std::int64_t microbatches = 1;
  /// Auxiliary-loss-free load balancing of MoE layers (DeepSeek-V3, Wang et al. 2024,
  /// arXiv:2408.15664; torchtitan's load_balance_coeff and its optimizer pre-hook
  /// _update_expert_bias): for each forward output "X.tokens_per_expert" whose graph reads
  /// "X.expert_bias", the step outputs next.X.expert_bias = bias + d - mean(d) with
  /// d = coeff x sign(mean(load) - load), load being the tokens_per_expert of the whole step
  /// (summed over microbatches, and over the data-parallel ranks once sharded). The bias is not
  /// trained; it is state (step_state_names), saved in checkpoints.
  double load_balance_coeff = 1e-3;
};

/// Appends to `forward` (output "loss", a scalar; trainable parameters named in `params`) the
/// backward pass, clipping (as torch.nn.utils.clip_grad_norm_: coef = min(1, max_norm /
/// (norm + 1e-6))) and one AdamW update. Adds inputs "lr" and "step" (scalars in the loss's
/// dtype: the learning rate of this step and its 1-based count), and per parameter P the
/// state "exp_avg.P" and "exp_avg_sq.P" (zeros before the first step). Adds outputs
/// "grad_norm" (before clipping) and "next.S" for every state S (each P, exp_avg.P,
/// exp_avg_sq.P): feed them back as S for the next step. With loss_scaling, adds the input
/// "loss_scale" (a float32 scalar, GradScaler's scale) and the output "found_inf" (1.0 when a
/// gradient overflowed: the update was skipped, every next.S equals S); "grad_norm" is then
/// the unscaled gradients' norm (inf or nan on overflow). With microbatches > 1 the graph is
/// rebuilt as that field says, with the same input and output names plus the microbatches'
/// batch inputs. Throws ir::IrError naming a parameter that is not a graph input, and
/// std::invalid_argument for microbatches < 1.
void append_train_step(ir::Graph& forward, const std::vector<std::string>& params, const TrainStepConfig& config);

/// The name of microbatch `k`'s input `name` ("tokens", "labels"): the name itself for k = 0,
/// else "name.k".
std::string microbatch_input(const std::string& name, std::int64_t k);

/// True for the batch's inputs: "tokens", "labels", and a microbatch's "tokens.K", "labels.K".
bool is_batch_input(const std::string& name);

/// Per node of a train step (append_train_step's), in graph order: whether it computes the
/// output "loss" (a forward node, of any microbatch), rather than a gradient or an update.
std::vector<bool> forward_nodes_of(const ir::Graph& step);

/// True for an MoE layer's forward output of the tokens each expert received ("X.tokens_per_expert",
/// models::build_model's), which the step sums over microbatches and load balancing reads.
bool is_tokens_per_expert(const std::string& output);

/// The state names append_train_step adds for `params`: each P, then exp_avg.P and
/// exp_avg_sq.P.
std::vector<std::string> train_state_names(const std::vector<std::string>& params);

/// Every state a train step `step` feeds back: train_state_names(params), then each other graph
/// input B the step updates (it has an output "next.B": an MoE layer's expert_bias), in input
/// order.
std::vector<std::string> step_state_names(const ir::Graph& step, const std::vector<std::string>& params);

/// The inputs of `step` other than `params`' state that it updates (step_state_names' tail).
std::vector<std::string> updated_buffers(const ir::Graph& step, const std::vector<std::string>& params);

/// torchtitan's learning-rate schedule ([lr_scheduler]): linear warm-up, a stable phase, then
/// a decay to min_lr_factor (warmup-stable-decay, Hu et al. 2024, MiniCPM).
struct LrSchedule {
  std::int64_t warmup_steps = 2;
  std::int64_t steps = 10;        ///< the steps the schedule spans: lr_scheduler.total_steps, or training.steps when unset
  double decay_ratio = -1;        ///< the share of steps that decay (-1: unset, every step after warm-up)
  std::string decay_type = "linear";  ///< "linear", "sqrt" or "cosine"
  double min_lr_factor = 0.0;     ///< the decay ends at lr x this
};

/// The phases of `schedule` as torchtitan's build_lr_schedulers sizes them: warm-up cut to the
/// steps there are; decay = round(steps x decay_ratio) (Python's round: ties to even), cut to
/// the steps after warm-up, or every step after warm-up when decay_ratio is unset; stable =
/// steps + 1 - warmup - decay (one virtual step more, so that the last step's lr is not 0).
struct LrPhases {
  std::int64_t warmup = 0, stable = 0, decay = 0;
};
LrPhases lr_phases(const LrSchedule& schedule);

/// The learning-rate factor of 1-based `step`, as torchtitan's linear_warmup_stable_decay in
/// v0.2.2 (torchtitan/components/lr_scheduler.py at 73a0e69, the behaviour of its PR #1284 of
/// 2025-06-11, unchanged at HEAD) under LambdaLR, whose 0-based c = step - 1: warm-up (c <
/// warmup): (c + 1) / warmup; stable (c < warmup + stable): 1; decay, with p = (c + 1 - warmup -
/// stable) / decay: linear 1 - p, sqrt 1 - sqrt(p), cosine (1 + cos(pi p)) / 2, then
/// min_lr_factor + (1 - min_lr_factor) x that. Before #1284 stable had no virtual step and the
/// decay ended at 0 on the last step. The learning rate of step s is lr x lr_factor(s, ...);
/// `step` should be at most schedule.steps (past it, the decay goes on below min_lr_factor, as
/// torchtitan's would).
double lr_factor(std::int64_t step, const LrSchedule& schedule);

}  // namespace spmdx::train
