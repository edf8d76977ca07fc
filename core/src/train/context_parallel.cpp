#include "spmdx/train/context_parallel.h"

#include <algorithm>
#include <functional>
#include <map>
#include <set>
#include <unordered_map>

namespace spmdx::train {
namespace {

// Ops that read a flattened [tokens, ...] value row by row and only sum over the rows.
bool reads_rows(const std::string& op) {
  static const std::set<std::string> ops{"cross_entropy", "count_valid", "pick", "amax_rows", "sum_exp_rows", "valid_rows"};
  return ops.count(op) > 0;
}

// A reshape [batch, seq, rest...] -> [batch x seq, rest...] (batch >= 2).
bool flattening(const ir::Node& node, std::int64_t seq_len) {
  if (node.op() != "reshape") return false;
  const auto& in = node.input(0)->meta().shape;
  const auto& out = node.output()->meta().shape;
  if (in.size() < 2 || in[1] != seq_len || in[0] < 2 || out.size() + 1 != in.size() || out[0] != in[0] * in[1]) return false;
  return std::equal(in.begin() + 2, in.end(), out.begin() + 1);
}

// Whether only the loss's row readers read v, directly or through casts (mixed precision casts
// the flattened logits to float32 before cross entropy).
bool read_as_rows(const ir::Value* v) {
  const auto& uses = v->uses();
  return !uses.empty() && std::all_of(uses.begin(), uses.end(), [](const ir::Use& u) {
    return reads_rows(u.user->op()) || (u.user->op() == "cast" && read_as_rows(u.user->output()));
  });
}

// The flattenings the loss reads that can all go sequence-major: every one whose value only
// row readers read, provided every row-indexed input of every row reader comes from them (or is
// computed from them): else none, as a reader pairing a sequence-major value with a batch-major
// one (logits flattened another way, an input given flat) would pair the wrong rows.
std::set<const ir::Node*> loss_flattenings(const ir::Graph& g, std::int64_t seq_len) {
  std::set<const ir::Node*> out;
  std::int64_t rows = -1;
  for (const auto& node : g.nodes()) {
    if (flattening(*node, seq_len) && read_as_rows(node->output())) {
      out.insert(node.get());
      rows = node->output()->meta().shape[0];
    }
  }
  if (out.empty()) return out;
  std::map<const ir::Value*, bool> memo;
  std::function<bool(const ir::Value*)> follows = [&](const ir::Value* v) {  // row-indexed and not made from the flattenings
    const auto& shape = v->meta().shape;
    if (shape.empty() || shape[0] != rows) return true;
    if (const auto it = memo.find(v); it != memo.end()) return it->second;
    const ir::Node* p = v->producer();
    bool ok = p != nullptr && (out.count(p) > 0 || (p->op() != "reshape" && std::all_of(p->inputs().begin(), p->inputs().end(), follows)));
    return memo[v] = ok;
  };
  for (const auto& node : g.nodes()) {
    if (reads_rows(node->op()) && !std::all_of(node->inputs().begin(), node->inputs().end(), follows)) return {};
  }
  return out;
}

}  // namespace

ir::Graph context_parallel(const ir::Graph& forward, std::int64_t seq_len, std::int64_t chunks) {
  using ir::Value;
  if (chunks > 1 && seq_len % chunks != 0) {
    throw ir::IrError("context parallelism: " + std::to_string(chunks) + " pieces do not divide the sequence of " + std::to_string(seq_len));
  }
  std::set<const Value*> tables;  // rotary_embedding's cos and sin
  for (const auto& node : forward.nodes()) {
    if (node->op() == "rotary_embedding") tables.insert({node->input(1), node->input(2)});
  }
  const std::set<const ir::Node*> sequence_major = loss_flattenings(forward, seq_len);
  ir::Graph out;
  std::unordered_map<const Value*, Value*> map;  // old value -> new
  for (const Value* v : forward.inputs()) {
    Value* copy = out.add_input(v->name(), v->meta());
    map[v] = copy;
    if (chunks <= 1) continue;
    const auto& shape = v->meta().shape;
    if ((v->name() == "tokens" || v->name() == "labels") && shape.size() == 2 && shape[1] == seq_len) {
      map[v] = out.add("seq_permute", {copy}, {{"dim", std::int64_t{1}}, {"chunks", chunks}});
    } else if (tables.count(v) > 0 && !shape.empty() && shape[0] == seq_len) {
      map[v] = out.add("seq_permute", {copy}, {{"dim", std::int64_t{0}}, {"chunks", chunks}});
    }
  }
  for (const auto& node : forward.nodes()) {
    std::vector<Value*> in;
    for (const Value* v : node->inputs()) in.push_back(map.at(v));
    if (sequence_major.count(node.get()) > 0) {
      Value* seq_major = out.add("transpose", {in[0]}, {{"dim0", std::int64_t{0}}, {"dim1", std::int64_t{1}}});
      map[node->output()] = out.add("reshape", {seq_major}, {{"shape", node->output()->meta().shape}});
      continue;
    }
    ir::Attributes attrs = node->attrs();
    if ((node->op() == "sdpa" || node->op() == "document_ids") && chunks > 1) attrs["chunks"] = chunks;
    const ir::Node* copy = out.add_node(node->op(), in, attrs);
    for (std::size_t k = 0; k < node->outputs().size(); ++k) map[node->outputs()[k]] = copy->outputs()[k];
  }
  for (const auto& [name, v] : forward.outputs()) out.add_output(name, map.at(v));
  return out;
}

ir::Graph context_parallel_weight_grads(const ir::Graph& step) {
  using ir::Node;
  using ir::Value;
  auto flattening = [](const Value* v) -> const Node* {  // reshape of [..., n] (3 or more dims) to [rows, n]
    const Node* r = v->producer();
    if (r == nullptr || r->op() != "reshape") return nullptr;
    const auto &in = r->input(0)->meta().shape, &out = v->meta().shape;
    return in.size() >= 3 && out.size() == 2 && in.back() == out.back() ? r : nullptr;
  };
  std::unordered_map<const Node*, std::pair<const Value*, const Value*>> replaced;  // matmul -> (g, x)
  std::set<const Node*> dropped;  // their transpose and reshapes, read by nothing else
  for (const auto& node : step.nodes()) {
    if (node->op() != "matmul") continue;
    const Node* t = node->input(0)->producer();
    if (t == nullptr || t->op() != "transpose" || t->input(0)->meta().shape.size() != 2) continue;
    const Node* rg = flattening(t->input(0));
    const Node* rx = flattening(node->input(1));
    if (rg == nullptr || rx == nullptr) continue;
    const auto &g = rg->input(0)->meta().shape, &x = rx->input(0)->meta().shape;
    if (g.size() != x.size() || !std::equal(g.begin(), g.end() - 1, x.begin())) continue;
    replaced[node.get()] = {rg->input(0), rx->input(0)};
  }
  // The views only replaced matmuls (or views dropped before them) read, latest first.
  std::set<const Value*> outputs;
  for (const auto& [name, v] : step.outputs()) outputs.insert(v);
  for (auto it = step.nodes().rbegin(); it != step.nodes().rend(); ++it) {
    const Node& n = **it;
    if ((n.op() != "reshape" && n.op() != "transpose") || n.output()->uses().empty() || outputs.count(n.output()) > 0) continue;
    if (std::all_of(n.output()->uses().begin(), n.output()->uses().end(),
                    [&](const ir::Use& u) { return replaced.count(u.user) > 0 || dropped.count(u.user) > 0; })) {
      dropped.insert(&n);
    }
  }
  ir::Graph out;
  std::unordered_map<const Value*, Value*> map;
  for (const Value* v : step.inputs()) map[v] = out.add_input(v->name(), v->meta());
  for (const auto& node : step.nodes()) {
    if (dropped.count(node.get()) > 0) continue;
    if (const auto it = replaced.find(node.get()); it != replaced.end()) {
      map[node->output()] = out.add("linear_weight_grad", {map.at(it->second.first), map.at(it->second.second)});
      continue;
    }
    std::vector<Value*> in;
    for (const Value* v : node->inputs()) in.push_back(map.at(v));
    const Node* copy = out.add_node(node->op(), in, node->attrs());
    for (std::size_t k = 0; k < node->outputs().size(); ++k) map[node->outputs()[k]] = copy->outputs()[k];
  }
  for (const auto& [name, v] : step.outputs()) out.add_output(name, map.at(v));
  return out;
}

}  // namespace spmdx::train
