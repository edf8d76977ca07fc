// One-rank training with the static train-step graph: parameters and AdamW state live here as
// ATen tensors; each step feeds them, with the batch, through the Executor and keeps the
// graph's next.* outputs.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>

#include "spmdx/exec/executor.h"
#include "spmdx/models/model.h"
#include "spmdx/train/train_step.h"

namespace spmdx::exec {

/// Values for every InitSpec of `model`, deterministic for `seed`: one CPU generator seeded
/// with it draws the normal tensors in declaration order; rope tables are computed.
/// dtype: the parameters' (the model's graph dtype).
TensorMap init_tensors(const models::Model& model, std::uint64_t seed);

class Trainer {
 public:
  struct StepResult {
    double loss = 0.0;       ///< mean cross entropy of the batch, before the update
    double grad_norm = 0.0;  ///< global L2 norm of the gradients, before clipping
  };

  /// Appends the train step to the model's forward graph (verify()-ed) and starts from
  /// `init` (every InitSpec name) with zero AdamW state.
  Trainer(models::Model model, const train::TrainStepConfig& config, TensorMap init);
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  /// One step. `step` is 1-based (AdamW's bias correction), `lr` this step's learning rate;
  /// tokens and labels are i64 [batch, seq_len] as the model was built for. Throws
  /// std::invalid_argument when their shape differs.
  StepResult step(std::int64_t step, double lr, const at::Tensor& tokens, const at::Tensor& labels);

  /// Parameters, buffers and optimizer state by name (P, exp_avg.P, exp_avg_sq.P).
  const TensorMap& state() const noexcept { return state_; }
  const models::Model& model() const noexcept { return model_; }
  /// Peak bytes of node outputs during the last step (Executor::peak_bytes).
  std::int64_t peak_bytes() const noexcept { return executor_->peak_bytes(); }
  Executor& executor() noexcept { return *executor_; }

 private:
  models::Model model_;
  std::vector<std::string> state_names_;
  TensorMap state_;
  std::unique_ptr<Executor> executor_;
};

}  // namespace spmdx::exec
