// The eager LibTorch implementation the static train step is checked against: modules written
// directly with ATen ops, autograd for the backward pass, torch::nn::utils::clip_grad_norm_ and
// torch::optim::AdamW. Written independently of the IR (rotary by complex multiplication,
// attention by at::scaled_dot_product_attention) so that a shared mistake is unlikely.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <string>

#include "spmdx/models/model.h"
#include "spmdx/train/train_step.h"

namespace spmdx::test {

class EagerTrainer {
 public:
  EagerTrainer(const models::ModelArgs& args, const train::TrainStepConfig& config,
               const std::map<std::string, at::Tensor>& init, double lr);
  ~EagerTrainer();
  /// One step at learning rate `lr`; returns the loss before the update.
  double step(double lr, const at::Tensor& tokens, const at::Tensor& labels);
  at::Tensor param(const std::string& name) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace spmdx::test
