#include "spmdx/exec/trainer.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <cstring>
#include <stdexcept>

namespace spmdx::exec {

TensorMap init_tensors(const models::Model& model, std::uint64_t seed) {
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  TensorMap out;
  for (const auto& spec : model.init) {
    const ir::Value* v = model.graph.find_input(spec.name);
    if (v == nullptr) throw std::invalid_argument("init: '" + spec.name + "' is not an input of the model graph");
    const auto options = at::TensorOptions().dtype(to_aten(v->meta().dtype));
    using K = models::InitSpec::Kind;
    switch (spec.kind) {
      case K::normal: out[spec.name] = at::normal(0.0, spec.std, spec.shape, gen, options); break;
      case K::trunc_normal: {
        // torch.nn.init.trunc_normal_'s method (inverse CDF): uniform in [2 Phi(a) - 1, 2 Phi(b) - 1],
        // erfinv, scaled by std sqrt(2), then clamped to [a, b].
        const double a = -spec.bound / spec.std, b = spec.bound / spec.std;
        auto cdf = [](double x) { return 0.5 * (1.0 + std::erf(x / std::sqrt(2.0))); };
        at::Tensor t = at::empty(spec.shape, at::TensorOptions().dtype(at::kDouble));
        t.uniform_(2.0 * cdf(a) - 1.0, 2.0 * cdf(b) - 1.0, gen);
        t.erfinv_().mul_(spec.std * std::sqrt(2.0)).clamp_(-spec.bound, spec.bound);
        out[spec.name] = t.to(options.dtype());
        break;
      }
      case K::ones: out[spec.name] = at::ones(spec.shape, options); break;
      case K::data: {
        at::Tensor t = at::empty(spec.shape, options);
        if (spec.data == nullptr || spec.nbytes != t.nbytes()) {
          throw std::invalid_argument("init: '" + spec.name + "' has " + std::to_string(spec.data ? spec.nbytes : 0) + " bytes of data, not the " +
                                      std::to_string(t.nbytes()) + " its shape and dtype take");
        }
        if (t.nbytes() > 0) std::memcpy(t.data_ptr(), spec.data.get(), t.nbytes());
        out[spec.name] = t;
        break;
      }
      case K::zeros: out[spec.name] = at::zeros(spec.shape, options); break;
      case K::rope_cos:
      case K::rope_sin: {
        // angle[t, i] = t * f_i, f_i = theta^(-2i/head_dim), as torchtitan's precompute_freqs_cis
        // (in f64), with Llama 3.1's frequency scaling (torchtitan's apply_scaling).
        const std::int64_t half = spec.shape[1];
        at::Tensor inv = at::pow(spec.rope_theta, -at::arange(0, half, at::kDouble) * 2.0 / static_cast<double>(2 * half));
        if (const models::RopeScaling& r = spec.rope_scaling; r.scaling_factor > 0) {
          const double low_wavelen = r.original_max_position_embeddings / r.low_freq_factor;
          const double high_wavelen = r.original_max_position_embeddings / r.high_freq_factor;
          const at::Tensor wavelen = 2.0 * M_PI / inv;
          const at::Tensor scaled = at::where(wavelen > low_wavelen, inv / r.scaling_factor, inv);
          const at::Tensor smooth = (r.original_max_position_embeddings / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
          inv = at::where((wavelen >= high_wavelen) & (wavelen <= low_wavelen), (1.0 - smooth) * scaled / r.scaling_factor + smooth * scaled, scaled);
        }
        at::Tensor angles = at::outer(at::arange(spec.shape[0], at::kDouble), inv);
        out[spec.name] = (spec.kind == K::rope_cos ? at::cos(angles) : at::sin(angles)).to(options.dtype());
        break;
      }
    }
  }
  return out;
}

Trainer::Trainer(models::Model model, const train::TrainStepConfig& config, TensorMap init) : model_(std::move(model)) {
  train::append_train_step(model_.graph, model_.params, config);
  model_.graph.verify();
  state_names_ = train::step_state_names(model_.graph, model_.params);
  for (const auto& spec : model_.init) {
    auto it = init.find(spec.name);
    if (it == init.end()) throw std::invalid_argument("Trainer: no initial value for '" + spec.name + "'");
    state_[spec.name] = it->second;
  }
  for (const auto& p : model_.params) {
    state_["exp_avg." + p] = at::zeros_like(state_.at(p));
    state_["exp_avg_sq." + p] = at::zeros_like(state_.at(p));
  }
  executor_ = std::make_unique<Executor>(model_.graph);
}

Trainer::StepResult Trainer::step(std::int64_t step, double lr, const at::Tensor& tokens, const at::Tensor& labels) {
  TensorMap feed = state_;
  feed["tokens"] = tokens;
  feed["labels"] = labels;
  const auto scalar = at::TensorOptions().dtype(to_aten(model_.graph.find_output("loss")->meta().dtype));
  feed["lr"] = at::scalar_tensor(lr, scalar);
  feed["step"] = at::scalar_tensor(static_cast<double>(step), scalar);
  TensorMap out = executor_->run(feed);
  for (const auto& name : state_names_) state_[name] = out.at("next." + name);
  return {out.at("loss").item<double>(), out.at("grad_norm").item<double>()};
}

}  // namespace spmdx::exec
