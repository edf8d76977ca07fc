#include "spmdx/train/train_step.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <stdexcept>

#include "spmdx/ir/autodiff.h"

namespace spmdx::train {

using ir::Value;

std::vector<std::string> train_state_names(const std::vector<std::string>& params) {
  std::vector<std::string> names = params;
  for (const auto& p : params) names.push_back("exp_avg." + p);
  for (const auto& p : params) names.push_back("exp_avg_sq." + p);
  return names;
}

namespace {

// An MoE layer's forward output of the tokens each expert received (models::build_model's
// "layers.L.moe.tokens_per_expert"): summed over microbatches, read by load balancing.
constexpr const char* kLoadSuffix = "tokens_per_expert";

// The same view of the same value, made once: each VJP reshapes or transposes what it reads on
// its own (a linear's input, once per weight reading it: q, k and v), and sharding then moves
// each copy on its own (three all_gathers of one activation under TP). Views cost nothing to
// share, so sharing them changes no number and no buffer's life.
// `ends`: with gradient accumulation, the node count at the end of each microbatch: views are
// shared within a microbatch only (sharing one across microbatches would keep what FSDP gathered
// for the first alive through all of them).
void deduplicate_views(ir::Graph& g, const std::vector<std::size_t>& ends = {}) {
  std::map<std::string, Value*> seen;
  std::vector<ir::Node*> copies;
  std::size_t index = 0;
  for (const auto& n : g.nodes()) {
    const std::size_t segment = static_cast<std::size_t>(std::upper_bound(ends.begin(), ends.end(), index++) - ends.begin());
    const std::string& op = n->op();
    if (op != "reshape" && op != "transpose" && op != "permute" && op != "expand" && op != "slice") continue;
    std::string key = std::to_string(segment) + ":" + op + "(" + std::to_string(n->input(0)->id()) + ")";
    for (const auto& [name, value] : n->attrs()) key += name + "=" + ir::attribute_str(value) + ";";
    const auto [it, fresh] = seen.emplace(key, n->output());
    if (fresh) continue;
    g.replace_all_uses(n->output(), it->second);
    copies.push_back(n.get());
  }
  g.erase(copies);
}

// `forward` (one microbatch's) run `microbatches` times in a new graph, each copy's backward
// right after it: the same inputs, plus "tokens.K" and "labels.K" for K >= 1; outputs as
// `forward`'s, of microbatch 0, but "loss", the microbatches' mean. `grads`: per parameter of
// `params`, the mean of the microbatches' gradients of their losses (x loss_scale when given).
ir::Graph unroll_microbatches(const ir::Graph& forward, const std::vector<std::string>& params, std::int64_t microbatches, bool loss_scaling,
                              std::vector<Value*>& grads, std::vector<std::size_t>& ends) {
  ir::Graph g;
  std::map<const Value*, Value*> shared;  // forward's inputs -> g's, for every microbatch but the batch
  for (const Value* in : forward.inputs()) shared[in] = g.add_input(in->name(), in->meta());
  const Value* loss = forward.find_output("loss");
  const ir::TensorMeta scalar{{}, loss->meta().dtype, loss->meta().device, false};
  Value* loss_scale = loss_scaling ? g.add_input("loss_scale", scalar) : nullptr;
  std::vector<Value*> weights;
  for (const auto& name : params) weights.push_back(g.find_input(name));
  const ir::Attributes mean{{"value", 1.0 / static_cast<double>(microbatches)}};
  Value* loss_sum = nullptr;
  std::map<const Value*, Value*> first;  // microbatch 0's values, for the other outputs
  std::map<std::string, Value*> counts;   // the MoE layers' tokens_per_expert, summed
  for (std::int64_t k = 0; k < microbatches; ++k) {
    std::map<const Value*, Value*> map = shared;
    for (const Value* in : forward.inputs()) {
      if (k > 0 && (in->name() == "tokens" || in->name() == "labels")) map[in] = g.add_input(microbatch_input(in->name(), k), in->meta());
    }
    for (const auto& n : forward.nodes()) {
      std::vector<Value*> in;
      for (const Value* v : n->inputs()) in.push_back(map.at(v));
      const ir::Node* copy = g.add_node(n->op(), in, n->attrs());
      for (std::size_t i = 0; i < n->outputs().size(); ++i) map[n->outputs()[i]] = copy->outputs()[i];
    }
    for (const auto& [name, v] : forward.outputs()) {  // the whole step's tokens per expert: every microbatch's
      if (is_tokens_per_expert(name)) counts[name] = k == 0 ? map.at(v) : g.add("add", {counts.at(name), map.at(v)});
    }
    Value* loss_k = map.at(loss);
    const std::vector<Value*> grads_k = ir::gradients(g, loss_scale ? g.add("mul", {loss_k, loss_scale}) : loss_k, weights);
    for (std::size_t i = 0; i < grads_k.size(); ++i) grads[i] = k == 0 ? grads_k[i] : g.add("add", {grads[i], grads_k[i]});
    loss_sum = k == 0 ? loss_k : g.add("add", {loss_sum, loss_k});
    if (k == 0) first = std::move(map);
    ends.push_back(g.num_nodes());
  }
  for (Value*& gr : grads) gr = g.add("mul_scalar", {gr}, mean);
  for (const auto& [name, v] : forward.outputs()) {
    if (name == "loss") g.add_output(name, g.add("mul_scalar", {loss_sum}, mean));
    else if (counts.count(name) > 0) g.add_output(name, counts.at(name));
    else g.add_output(name, first.at(v));
  }
  return g;
}

}  // namespace

bool is_tokens_per_expert(const std::string& name) {
  const std::string suffix = kLoadSuffix;
  return name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0 && name[name.size() - suffix.size() - 1] == '.';
}

std::vector<std::string> updated_buffers(const ir::Graph& step, const std::vector<std::string>& params) {
  const std::vector<std::string> trained = train_state_names(params);
  const std::set<std::string> known(trained.begin(), trained.end());
  std::vector<std::string> out;
  for (const Value* in : step.inputs()) {
    if (known.count(in->name()) == 0 && step.find_output("next." + in->name()) != nullptr) out.push_back(in->name());
  }
  return out;
}

std::vector<std::string> step_state_names(const ir::Graph& step, const std::vector<std::string>& params) {
  std::vector<std::string> out = train_state_names(params);
  for (auto& b : updated_buffers(step, params)) out.push_back(std::move(b));
  return out;
}

std::string microbatch_input(const std::string& name, std::int64_t k) { return k == 0 ? name : name + "." + std::to_string(k); }

bool is_batch_input(const std::string& name) {
  for (const char* base : {"tokens", "labels"}) {
    const std::string b = base;
    if (name == b) return true;
    if (name.size() > b.size() + 1 && name.compare(0, b.size() + 1, b + ".") == 0 &&
        name.find_first_not_of("0123456789", b.size() + 1) == std::string::npos) {
      return true;
    }
  }
  return false;
}

std::vector<bool> forward_nodes_of(const ir::Graph& step) {
  const std::set<const ir::Node*> reach = ir::producers_of(step.find_output("loss"));
  std::vector<bool> out;
  for (const auto& n : step.nodes()) out.push_back(reach.count(n.get()) > 0);
  return out;
}

void append_train_step(ir::Graph& g, const std::vector<std::string>& params, const TrainStepConfig& config) {
  if (config.microbatches < 1) throw std::invalid_argument("append_train_step: microbatches must be >= 1, not " + std::to_string(config.microbatches));
  Value* loss = g.find_output("loss");
  if (loss == nullptr) throw ir::IrError("append_train_step: the forward graph has no output named 'loss'");
  std::vector<Value*> weights;
  for (const auto& name : params) {
    Value* w = g.find_input(name);
    if (w == nullptr) throw ir::IrError("append_train_step: parameter '" + name + "' is not an input of the graph");
    weights.push_back(w);
  }
  const ir::TensorMeta scalar{{}, loss->meta().dtype, loss->meta().device, false};
  auto attr = [](double v) { return ir::Attributes{{"value", v}}; };
  // float16: the backward runs on the scaled loss, its gradients unscaled (GradScaler.scale,
  // then unscale_ before clipping, which torch documents for clip_grad_norm_).
  std::vector<Value*> grads(weights.size());
  std::vector<std::size_t> ends;  // each microbatch's last node + 1
  Value* loss_scale = nullptr;
  if (config.microbatches == 1) {
    loss_scale = config.loss_scaling ? g.add_input("loss_scale", scalar) : nullptr;
    grads = ir::gradients(g, loss_scale ? g.add("mul", {loss, loss_scale}) : loss, weights);
  } else {
    g = unroll_microbatches(g, params, config.microbatches, config.loss_scaling, grads, ends);
    for (std::size_t i = 0; i < params.size(); ++i) weights[i] = g.find_input(params[i]);
    loss_scale = g.find_input("loss_scale");
  }
  deduplicate_views(g, ends);
  if (loss_scale != nullptr) {
    Value* inv = g.add("rdiv_scalar", {loss_scale}, attr(1.0));
    for (Value*& gr : grads) gr = g.add("mul", {gr, inv});
  }

  // Global L2 norm of all gradients (the root of the sum of their squared norms, as
  // clip_grad_norm_'s norm of the per-gradient norms), then the clip coefficient.
  Value* sq = nullptr;
  for (Value* gr : grads) {
    Value* s = g.add("squared_norm", {gr});
    sq = sq == nullptr ? s : g.add("add", {sq, s});
  }
  Value* norm = g.add("sqrt", {sq});
  g.add_output("grad_norm", norm);
  Value* found_inf = loss_scale ? g.add("found_inf", {norm}) : nullptr;  // an inf or nan in any gradient reaches the norm
  if (found_inf != nullptr) g.add_output("found_inf", found_inf);
  if (config.max_norm > 0) {
    Value* coef = g.add("clamp_max_scalar", {g.add("rdiv_scalar", {g.add("add_scalar", {norm}, attr(1e-6))}, attr(config.max_norm))},
                        attr(1.0));
    for (Value*& gr : grads) gr = g.add("mul", {gr, coef});
  }

  // AdamW, one fused op per parameter.
  const AdamWConfig& o = config.adamw;
  Value* lr = g.add_input("lr", scalar);
  Value* step = g.add_input("step", scalar);
  const ir::Attributes hyper{{"beta1", o.beta1}, {"beta2", o.beta2}, {"eps", o.eps}, {"weight_decay", o.weight_decay}};
  std::vector<std::pair<std::string, Value*>> next, next_m, next_v;
  for (std::size_t i = 0; i < params.size(); ++i) {
    const ir::TensorMeta state{weights[i]->meta().shape, weights[i]->meta().dtype, weights[i]->meta().device, false};
    Value* m = g.add_input("exp_avg." + params[i], state);
    Value* v = g.add_input("exp_avg_sq." + params[i], state);
    std::vector<Value*> in{weights[i], grads[i], m, v, lr, step};
    if (found_inf != nullptr) in.push_back(found_inf);
    ir::Node* update = g.add_node("adamw", in, hyper);
    next.emplace_back(params[i], update->output(0));
    next_m.emplace_back("exp_avg." + params[i], update->output(1));
    next_v.emplace_back("exp_avg_sq." + params[i], update->output(2));
  }
  for (const auto* group : {&next, &next_m, &next_v}) {
    for (const auto& [name, value] : *group) g.add_output("next." + name, value);
  }
  // MoE load balancing (torchtitan's _update_expert_bias, run before the optimizer step; the
  // bias does not touch this step's gradients, so where it runs in the step changes nothing).
  std::vector<std::pair<std::string, Value*>> loads;
  for (const auto& [name, v] : g.outputs()) {
    if (is_tokens_per_expert(name)) loads.emplace_back(name, v);
  }
  for (const auto& [name, load] : loads) {
    const std::string bias_name = name.substr(0, name.size() - std::string(kLoadSuffix).size()) + "expert_bias";
    Value* bias = g.find_input(bias_name);
    if (bias == nullptr) continue;
    if (config.load_balance_coeff <= 0) throw std::invalid_argument("append_train_step: the model reads " + bias_name + " but load_balance_coeff is " + std::to_string(config.load_balance_coeff));
    Value* deficit = g.add("sub", {g.add("mean", {load}), load});
    Value* delta = g.add("mul_scalar", {g.add("sign", {deficit})}, attr(config.load_balance_coeff));
    g.add_output("next." + bias_name, g.add("add", {bias, g.add("sub", {delta, g.add("mean", {delta})})}));
  }
#ifndef NDEBUG
  g.verify();
#endif
}

LrPhases lr_phases(const LrSchedule& s) {
  LrPhases p;
  p.warmup = std::min(s.warmup_steps, s.steps);
  p.decay = s.decay_ratio >= 0 ? static_cast<std::int64_t>(std::nearbyint(static_cast<double>(s.steps) * s.decay_ratio))  // ties to even, as Python's round
                               : s.steps - p.warmup;
  if (p.warmup + p.decay > s.steps) p.decay = s.steps - p.warmup;
  p.stable = s.steps + 1 - p.warmup - p.decay;  // + 1: a virtual last step, so that the lr of the last step is not 0
  return p;
}

double lr_factor(std::int64_t step, const LrSchedule& s) {
  const LrPhases p = lr_phases(s);
  const std::int64_t c = step - 1;  // LambdaLR counts from 0
  if (c < p.warmup) return static_cast<double>(c + 1) / static_cast<double>(p.warmup);
  if (c < p.warmup + p.stable || p.decay <= 0) return 1.0;
  const double progress = static_cast<double>(c + 1 - p.warmup - p.stable) / static_cast<double>(p.decay);
  double f = 1.0 - progress;
  if (s.decay_type == "sqrt") f = 1.0 - std::sqrt(progress);
  else if (s.decay_type == "cosine") f = 0.5 * (1.0 + std::cos(M_PI * progress));
  return s.min_lr_factor + (1.0 - s.min_lr_factor) * f;
}

}  // namespace spmdx::train
