#include "spmdx/train/train_step.h"

#include <algorithm>
#include <cmath>
#include <map>

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

// The same view of the same value, made once: each VJP reshapes or transposes what it reads on
// its own (a linear's input, once per weight reading it: q, k and v), and sharding then moves
// each copy on its own (three all_gathers of one activation under TP). Views cost nothing to
// share, so sharing them changes no number and no buffer's life.
void deduplicate_views(ir::Graph& g) {
  std::map<std::string, Value*> seen;
  std::vector<ir::Node*> copies;
  for (const auto& n : g.nodes()) {
    const std::string& op = n->op();
    if (op != "reshape" && op != "transpose" && op != "permute" && op != "expand" && op != "slice") continue;
    std::string key = op + "(" + std::to_string(n->input(0)->id()) + ")";
    for (const auto& [name, value] : n->attrs()) key += name + "=" + ir::attribute_str(value) + ";";
    const auto [it, fresh] = seen.emplace(key, n->output());
    if (fresh) continue;
    g.replace_all_uses(n->output(), it->second);
    copies.push_back(n.get());
  }
  for (ir::Node* n : copies) g.erase(n);
}

}  // namespace

void append_train_step(ir::Graph& g, const std::vector<std::string>& params, const TrainStepConfig& config) {
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
  Value* loss_scale = config.loss_scaling ? g.add_input("loss_scale", scalar) : nullptr;
  std::vector<Value*> grads = ir::gradients(g, loss_scale ? g.add("mul", {loss, loss_scale}) : loss, weights);
  deduplicate_views(g);
  if (loss_scale != nullptr) {
    Value* inv = g.add("rdiv_scalar", {loss_scale}, attr(1.0));
    for (Value*& gr : grads) gr = g.add("mul", {gr, inv});
  }

  // Global L2 norm of all gradients, then the clip coefficient.
  Value* sq = nullptr;
  for (Value* gr : grads) {
    Value* s = g.add("sum", {g.add("mul", {gr, gr})});
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
#ifndef NDEBUG
  g.verify();
#endif
}

double lr_factor(std::int64_t step, const LrSchedule& s) {
  const std::int64_t warmup = s.warmup_steps;
  std::int64_t decay = s.decay_ratio >= 0 ? static_cast<std::int64_t>(std::nearbyint(static_cast<double>(s.steps) * s.decay_ratio))  // Python's round: ties to even
                                          : s.steps - warmup;
  if (warmup + decay > s.steps) decay = s.steps - warmup;
  const std::int64_t stable = s.steps - warmup - decay;
  const std::int64_t c = step - 1;  // LambdaLR counts from 0
  if (c < warmup) return static_cast<double>(c + 1) / static_cast<double>(warmup);
  if (c < warmup + stable || decay <= 0) return 1.0;
  const double p = static_cast<double>(c + 1 - warmup - stable) / static_cast<double>(decay);
  double f = 1.0 - p;
  if (s.decay_type == "sqrt") f = 1.0 - std::sqrt(p);
  else if (s.decay_type == "cosine") f = 0.5 * (1.0 + std::cos(M_PI * p));
  return s.min_lr_factor + (1.0 - s.min_lr_factor) * f;
}

}  // namespace spmdx::train
