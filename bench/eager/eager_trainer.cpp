#include "eager_trainer.h"

#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>

#include <cmath>

namespace spmdx::test {

struct EagerTrainer::Impl {
  models::ModelArgs args;
  train::TrainStepConfig config;
  std::map<std::string, at::Tensor> p;  // leaves with requires_grad
  std::vector<at::Tensor> order;
  at::Tensor freqs_cis;  // complex [seq, head_dim/2], built on first use
  std::unique_ptr<torch::optim::AdamW> opt;

  at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w) const {
    return x * at::rsqrt(x.pow(2).mean(-1, true) + args.norm_eps) * w;
  }

  // torchtitan's apply_rotary_emb: view pairs as complex numbers and multiply.
  at::Tensor rotary(const at::Tensor& x) {
    const auto b = x.size(0), s = x.size(1), h = x.size(2), d = x.size(3);
    if (!freqs_cis.defined()) {
      at::Tensor inv = 1.0 / at::pow(args.rope_theta, at::arange(0, d, 2, at::kDouble).slice(0, 0, d / 2) / static_cast<double>(d));
      at::Tensor angles = at::outer(at::arange(s, at::kDouble), inv);
      freqs_cis = at::polar(at::ones_like(angles), angles).to(at::kComplexFloat);
    }
    at::Tensor xc = at::view_as_complex(x.reshape({b, s, h, d / 2, 2}));
    return at::view_as_real(xc * freqs_cis.view({1, s, 1, d / 2})).reshape({b, s, h, d});
  }

  at::Tensor forward(const at::Tensor& tokens, const at::Tensor& labels) {
    const auto b = tokens.size(0), s = tokens.size(1);
    at::Tensor h = at::embedding(p.at("tok_embeddings.weight"), tokens);
    at::Tensor logits;
    if (args.name == "mlp") {
      logits = at::linear(at::relu(at::linear(h, p.at("w1.weight"))), p.at("output.weight"));
    } else {
      const auto hd = args.dim / args.n_heads;
      for (std::int64_t l = 0; l < args.n_layers; ++l) {
        const std::string pre = "layers." + std::to_string(l) + ".";
        at::Tensor x = rms_norm(h, p.at(pre + "attention_norm.weight"));
        auto heads = [&](const char* w) { return at::linear(x, p.at(pre + "attention." + w + ".weight")).view({b, s, args.n_heads, hd}); };
        at::Tensor q = rotary(heads("wq")).transpose(1, 2);
        at::Tensor k = rotary(heads("wk")).transpose(1, 2);
        at::Tensor v = heads("wv").transpose(1, 2);
        at::Tensor o = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
        h = h + at::linear(o.transpose(1, 2).reshape({b, s, args.dim}), p.at(pre + "attention.wo.weight"));
        at::Tensor y = rms_norm(h, p.at(pre + "ffn_norm.weight"));
        h = h + at::linear(at::silu(at::linear(y, p.at(pre + "feed_forward.w1.weight"))) *
                               at::linear(y, p.at(pre + "feed_forward.w3.weight")),
                           p.at(pre + "feed_forward.w2.weight"));
      }
      logits = at::linear(rms_norm(h, p.at("norm.weight")), p.at("output.weight"));
    }
    return at::cross_entropy_loss(logits.reshape({-1, args.vocab_size}), labels.reshape({-1}));
  }
};

EagerTrainer::EagerTrainer(const models::ModelArgs& args, const train::TrainStepConfig& config,
                           const std::map<std::string, at::Tensor>& init, double lr)
    : impl_(std::make_unique<Impl>()) {
  impl_->args = args;
  impl_->config = config;
  for (const auto& [name, t] : init) {
    if (name.rfind("rope.", 0) == 0) continue;  // the reference computes its own rotary table
    at::Tensor leaf = t.detach().clone();
    leaf.set_requires_grad(true);
    impl_->p[name] = leaf;
    impl_->order.push_back(leaf);
  }
  const auto& o = config.adamw;
  impl_->opt = std::make_unique<torch::optim::AdamW>(
      impl_->order, torch::optim::AdamWOptions(lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weight_decay));
}

EagerTrainer::~EagerTrainer() = default;

double EagerTrainer::step(double lr, const at::Tensor& tokens, const at::Tensor& labels) {
  for (auto& group : impl_->opt->param_groups()) static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
  impl_->opt->zero_grad();
  at::Tensor loss = impl_->forward(tokens, labels);
  loss.backward();
  if (impl_->config.max_norm > 0) torch::nn::utils::clip_grad_norm_(impl_->order, impl_->config.max_norm);
  impl_->opt->step();
  return loss.item<double>();
}

at::Tensor EagerTrainer::param(const std::string& name) const { return impl_->p.at(name).detach(); }

}  // namespace spmdx::test
