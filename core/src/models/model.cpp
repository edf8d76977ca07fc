#include <cmath>
#include <stdexcept>
#include <set>

#include "spmdx/ir/builder.h"
#include "spmdx/models/model.h"

namespace spmdx::models {
namespace {

using Shape = std::vector<std::int64_t>;
using ir::Value;

class Builder {
 public:
  Builder(Model& m, ir::DType dtype) : m_(m), b_(m.graph, dtype) {}

  Value* param(const std::string& name, Shape shape, InitSpec::Kind kind, double std = 0.0, double bound = 2.0) {
    m_.init.push_back({name, shape, kind, std, bound, 0.0, {}, true, nullptr, 0});
    m_.params.push_back(name);
    return b_.param(name, std::move(shape));
  }
  Value* buffer(const std::string& name, Shape shape, InitSpec::Kind kind, double theta, const RopeScaling& scaling) {
    m_.init.push_back({name, shape, kind, 0.0, 0.0, theta, scaling, false, nullptr, 0});
    return b_.input(name, std::move(shape), b_.dtype());
  }
  ir::GraphBuilder& b() { return b_; }

 private:
  Model& m_;
  ir::GraphBuilder b_;
};

// Mean cross entropy over tokens, as the sum over tokens divided by their count: both parts
// stay exact when the batch is sharded (each is a sum across ranks), unlike a mean of means.
Value* loss_of(ir::GraphBuilder& b, Value* logits, Value* labels, std::int64_t vocab) {
  ir::Graph& g = b.graph();
  Value* flat = b.reshape(labels, {-1});
  Value* total = g.add("cross_entropy", {b.reshape(logits, {-1, vocab}), flat}, {{"reduction", std::string("sum")}});
  Value* count = g.add("count_valid", {flat}, {{"dtype", std::string(ir::to_string(b.dtype()))}});
  return g.add("div", {total, count});
}

// tokens -> embedding -> relu(linear) -> linear -> logits.
void build_mlp(Model& m, Builder& mb, Value* tokens, Value* labels) {
  const auto& a = m.args;
  auto& b = mb.b();
  Value* emb = mb.param("tok_embeddings.weight", {a.vocab_size, a.dim}, InitSpec::Kind::normal, 1.0);
  Value* w1 = mb.param("w1.weight", {a.ffn_hidden, a.dim}, InitSpec::Kind::normal, 0.02);
  Value* w2 = mb.param("output.weight", {a.vocab_size, a.ffn_hidden}, InitSpec::Kind::normal, 0.02);
  Value* h = b.relu(b.linear(b.embedding(emb, tokens), w1));
  m.graph.add_output("loss", loss_of(b, b.linear(h, w2), labels, a.vocab_size));
}

// A SwiGLU feed-forward: w2(silu(w1 y) * w3 y).
Value* swiglu(ir::GraphBuilder& b, Value* y, Value* w1, Value* w2, Value* w3) { return b.linear(b.mul(b.silu(b.linear(y, w1)), b.linear(y, w3)), w2); }

// The casts an MoE layer's float32 arithmetic (scores, weighting) needs around values of the
// model's dtype: none when that is float32.
struct Float32Casts {
  ir::Graph& g;
  ir::DType dtype;
  Value* to_f32(Value* v) const { return dtype == ir::DType::f32 ? v : g.add("cast", {v}, {{"dtype", std::string(ir::to_string(ir::DType::f32))}}); }
  Value* back(Value* v) const { return dtype == ir::DType::f32 ? v : g.add("cast", {v}, {{"dtype", std::string(ir::to_string(dtype))}}); }
};

// An MoE layer's shared experts (torchtitan's FeedForward of hidden x shared_experts) on x.
Value* shared_experts(Builder& mb, Value* x, const std::string& p, std::int64_t hidden, double depth_std) {
  using K = InitSpec::Kind;
  const std::int64_t dim = x->meta().shape.back();
  return swiglu(mb.b(), x, mb.param(p + "shared_experts.w1.weight", {hidden, dim}, K::trunc_normal, 0.02),
                mb.param(p + "shared_experts.w2.weight", {dim, hidden}, K::trunc_normal, depth_std),
                mb.param(p + "shared_experts.w3.weight", {hidden, dim}, K::trunc_normal, depth_std));
}

// torchtitan's MoE forward (models/moe/moe.py: TokenChoiceTopKRouter, TokenReorderer,
// GroupedExperts with torch._grouped_mm, MoE.forward), one static graph: y [batch, seq, dim] ->
// the same shape. Scores in float32; the bias (load balancing) only chooses experts; the slots
// are sorted by expert (stable), each slot's token gathered, the experts run as grouped GEMMs whose
// group ends are the cumulative counts, the outputs weighted by their scores and added back into
// their tokens' rows (onto the shared experts' output, if any).
Value* moe_layer(Model& m, Builder& mb, Value* y, const std::string& p, std::int64_t layer) {
  const MoEArgs& a = m.args.moe;
  auto& b = mb.b();
  ir::Graph& g = m.graph;
  using K = InitSpec::Kind;
  const Shape shape = y->meta().shape;
  const std::int64_t dim = shape.back(), tokens = y->meta().numel() / dim, E = a.experts, k = a.top_k, slots = tokens * k;
  const double depth_std = 0.02 / std::sqrt(2.0 * static_cast<double>(layer + 1));
  const Float32Casts cast{g, y->meta().dtype};
  const std::string f32 = ir::to_string(ir::DType::f32);

  Value* x = b.reshape(y, {tokens, dim});
  Value* gate = mb.param(p + "router.gate.weight", {E, dim}, K::trunc_normal, depth_std);
  Value* logits = cast.to_f32(b.linear(x, gate));
  Value* scores = a.score_func == "sigmoid" ? g.add("sigmoid", {logits}) : g.add("softmax", {logits}, {{"dim", std::int64_t{-1}}});
  Value* choice = scores;
  if (a.load_balance_coeff > 0) {
    m.init.push_back({p + "expert_bias", {E}, K::zeros, 0.0, 0.0, 0.0, {}, false, nullptr, 0});
    choice = b.add(scores, b.input(p + "expert_bias", {E}, ir::DType::f32));
  }
  if (a.expert_groups > 0) {
    // Node-limited routing: only the experts of each token's best limited_groups groups (ranked
    // by the sum of their two best scores) may be chosen; the others are pushed 1e30 down (as
    // -inf in torchtitan: only the choice reads these scores).
    const std::int64_t G = a.expert_groups, per = E / G;
    Value* grouped = b.reshape(choice, {tokens, G, per});
    Value* best2 = g.add_node("topk", {grouped}, {{"k", std::int64_t{2}}})->output(0);
    Value* group_scores = g.add("sum", {best2}, {{"dims", Shape{-1}}});
    ir::Node* best_groups = g.add_node("topk", {group_scores}, {{"k", a.limited_groups}});
    Value* ones = g.add("ones_like", {best_groups->output(0)});
    Value* keep = g.add("scatter_add", {g.add("zeros_like", {group_scores}), best_groups->output(1), ones}, {{"dim", std::int64_t{1}}});  // 1 kept, 0 not
    Value* penalty = g.add("mul_scalar", {g.add("add_scalar", {keep}, {{"value", -1.0}})}, {{"value", 1e30}});
    choice = b.reshape(b.add(grouped, g.add("expand", {b.reshape(penalty, {tokens, G, 1})}, {{"shape", Shape{tokens, G, per}}})), {tokens, E});
  }
  Value* chosen = g.add_node("topk", {choice}, {{"k", k}})->output(1);  // [tokens, k]
  Value* top = g.add("gather", {scores, chosen}, {{"dim", std::int64_t{1}}});
  if (a.route_norm) top = g.add("div", {top, g.add("add_scalar", {g.add("sum", {top}, {{"dims", Shape{-1}}, {"keepdim", true}})}, {{"value", 1e-20}})});
  if (a.route_scale != 1.0) top = g.add("mul_scalar", {top}, {{"value", a.route_scale}});
  if (a.expert_parallel > 1) {
    Value* w1 = mb.param(p + "experts.w1", {E, a.hidden, dim}, K::trunc_normal, 0.02);
    Value* w2 = mb.param(p + "experts.w2", {E, dim, a.hidden}, K::trunc_normal, depth_std);
    Value* w3 = mb.param(p + "experts.w3", {E, a.hidden, dim}, K::trunc_normal, depth_std);
    for (const char* w : {"w1", "w2", "w3"}) m.expert_params.push_back(p + "experts." + w);
    auto base = [&]() -> Value* { return a.shared_experts > 0 ? shared_experts(mb, x, p, a.hidden * a.shared_experts, depth_std) : nullptr; };
    return b.reshape(expert_parallel_experts(g, x, chosen, top, w1, w2, w3, base, a, p + "tokens_per_expert"), shape);
  }
  Value* flat = b.reshape(chosen, {slots});
  Value* counts = g.add("bincount", {flat}, {{"minlength", E}});
  g.add_output(p + "tokens_per_expert", g.add("cast", {counts}, {{"dtype", f32}}));
  Value* order = g.add("argsort", {flat}, {{"stable", true}});
  Value* weights = b.reshape(g.add("gather", {b.reshape(top, {slots}), order}, {{"dim", std::int64_t{0}}}), {slots, 1});
  Value* index = g.add("expand", {b.reshape(g.add("floor_divide_scalar", {order}, {{"value", k}}), {slots, 1})}, {{"shape", Shape{slots, dim}}});
  Value* routed = g.add("gather", {x, index}, {{"dim", std::int64_t{0}}});
  if (a.score_before_experts) routed = cast.back(b.mul(cast.to_f32(routed), weights));
  Value* offs = g.add("cumsum", {counts}, {{"dim", std::int64_t{0}}});
  Value* w1 = mb.param(p + "experts.w1", {E, a.hidden, dim}, K::trunc_normal, 0.02);
  Value* w2 = mb.param(p + "experts.w2", {E, dim, a.hidden}, K::trunc_normal, depth_std);
  Value* w3 = mb.param(p + "experts.w3", {E, a.hidden, dim}, K::trunc_normal, depth_std);
  auto grouped_mm = [&](Value* in, Value* w) { return g.add("grouped_mm", {in, b.transpose(w, 1, 2), offs}); };
  Value* out = grouped_mm(b.mul(b.silu(grouped_mm(routed, w1)), grouped_mm(routed, w3)), w2);
  Value* base = a.shared_experts > 0 ? shared_experts(mb, x, p, a.hidden * a.shared_experts, depth_std) : g.add("zeros_like", {x});
  if (!a.score_before_experts) out = cast.back(b.mul(cast.to_f32(out), weights));
  return b.reshape(g.add("scatter_add", {base, index, out}, {{"dim", std::int64_t{0}}}), shape);
}

// The built-in decoder-only transformers. Llama 3 as torchtitan's llama3 model: pre-norm RMSNorm
// blocks, rotary attention (causal, Llama 3.1 frequency scaling), SwiGLU feed-forward; parameter
// names and init as torchtitan's init_weights: the embedding N(0, 1); wq, wk, wv, w1
// trunc_normal(std 0.02); wo, w2, w3 trunc_normal(depth-scaled std 0.02 / sqrt(2 (layer + 1))),
// all cut at +-2; output.weight trunc_normal(std dim^-1/2) cut at 3 std; norms ones. Qwen3 (its
// torchtitan model) adds q/k RMSNorm over each head, a head_dim of its own, rotate_half RoPE and
// tied embeddings (the one weight initialised as output.weight, torchtitan skipping the
// embedding's init); MoE layers (moe_layer) take the FFN's place from moe.dense_layers on.
void build_decoder(Model& m, Builder& mb, Value* tokens, Value* labels, std::int64_t batch, std::int64_t seq) {
  const auto& a = m.args;
  auto& b = mb.b();
  const std::int64_t hd = head_dim_of(a);
  using K = InitSpec::Kind;
  const double out_std = 1.0 / std::sqrt(static_cast<double>(a.dim));
  Value* embedding = a.tie_embeddings ? mb.param("tok_embeddings.weight", {a.vocab_size, a.dim}, K::trunc_normal, out_std, 3.0 * out_std)
                                      : mb.param("tok_embeddings.weight", {a.vocab_size, a.dim}, K::normal, 1.0);
  Value* h = b.embedding(embedding, tokens);
  // block_causal: each position's document, from the batch's ids (one op, shared by the layers).
  Value* documents = a.attn_mask_type == "block_causal" ? m.graph.add("document_ids", {tokens}, {{"eos", a.eos_id}}) : nullptr;
  Value* cos = mb.buffer("rope.cos", {seq, hd / 2}, K::rope_cos, a.rope_theta, a.rope_scaling);
  Value* sin = mb.buffer("rope.sin", {seq, hd / 2}, K::rope_sin, a.rope_theta, a.rope_scaling);
  auto rotary = [&](Value* x) {
    return a.rope_style == "interleaved" ? b.rotary(x, cos, sin) : m.graph.add("rotary_embedding", {x, cos, sin}, {{"style", a.rope_style}});
  };
  for (std::int64_t l = 0; l < a.n_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    const double depth_std = 0.02 / std::sqrt(2.0 * static_cast<double>(l + 1));
    Value* x = b.rms_norm(h, mb.param(p + "attention_norm.weight", {a.dim}, K::ones), a.norm_eps);
    auto heads = [&](const std::string& w, std::int64_t n, double std) {
      Value* t = b.reshape(b.linear(x, mb.param(p + "attention." + w + ".weight", {n * hd, a.dim}, K::trunc_normal, std)), {batch, seq, n, hd});
      if (a.qk_norm && w != "wv") t = b.rms_norm(t, mb.param(p + "attention." + w.substr(1) + "_norm.weight", {hd}, K::ones), a.norm_eps);
      return t;
    };
    // Grouped-query attention: each key/value head serves `rep` query heads in a row, as
    // torchtitan's repeat_kv (expand, then merge the two head dims).
    const std::int64_t kv = a.n_kv_heads > 0 ? a.n_kv_heads : a.n_heads, rep = a.n_heads / kv;
    auto repeat = [&](Value* t) {  // [batch, kv, seq, hd] -> [batch, kv * rep, seq, hd]
      if (rep == 1) return t;
      Value* e = m.graph.add("expand", {b.reshape(t, {batch, kv, 1, seq, hd})}, {{"shape", Shape{batch, kv, rep, seq, hd}}});
      return b.reshape(e, {batch, kv * rep, seq, hd});
    };
    Value* q = b.transpose(rotary(heads("wq", a.n_heads, 0.02)), 1, 2);
    Value* k = repeat(b.transpose(rotary(heads("wk", kv, 0.02)), 1, 2));
    Value* v = repeat(b.transpose(heads("wv", kv, 0.02), 1, 2));
    Value* attention = documents != nullptr ? m.graph.add_node("sdpa", {q, k, v, documents}, {{"causal", true}})->output(0) : b.causal_attention(q, k, v);
    Value* o = b.reshape(b.transpose(attention, 1, 2), {batch, seq, a.n_heads * hd});
    h = b.add(h, b.linear(o, mb.param(p + "attention.wo.weight", {a.dim, a.n_heads * hd}, K::trunc_normal, depth_std)));
    Value* y = b.rms_norm(h, mb.param(p + "ffn_norm.weight", {a.dim}, K::ones), a.norm_eps);
    if (a.moe.experts > 0 && l >= a.moe.dense_layers) {
      h = b.add(h, moe_layer(m, mb, y, p + "moe.", l));
      continue;
    }
    Value* w1 = mb.param(p + "feed_forward.w1.weight", {a.ffn_hidden, a.dim}, K::trunc_normal, 0.02);
    Value* w2 = mb.param(p + "feed_forward.w2.weight", {a.dim, a.ffn_hidden}, K::trunc_normal, depth_std);
    Value* w3 = mb.param(p + "feed_forward.w3.weight", {a.ffn_hidden, a.dim}, K::trunc_normal, depth_std);
    h = b.add(h, swiglu(b, y, w1, w2, w3));
  }
  h = b.rms_norm(h, mb.param("norm.weight", {a.dim}, K::ones), a.norm_eps);
  Value* output = a.tie_embeddings ? embedding : mb.param("output.weight", {a.vocab_size, a.dim}, K::trunc_normal, out_std, 3.0 * out_std);
  m.graph.add_output("loss", loss_of(b, b.linear(h, output), labels, a.vocab_size));
}

Importer& importer() {
  static Importer f;
  return f;
}

std::function<void()>& releaser() {
  static std::function<void()> f;
  return f;
}

}  // namespace

// expert_parallel_experts (spmdx/models/model.h): block p the tokens of rank p of the expert
// dim (x's rows p n .. (p + 1) n - 1), its slots sorted by expert within the block, sent to the
// blocks of their experts' ranks, run there as each block's grouped GEMMs over its E / P experts
// (their rows expert-major), and sent back. Numbers as moe_layer's flat form: the same products
// and the same sums per token, in another order.
ir::Value* expert_parallel_experts(ir::Graph& g, ir::Value* x, ir::Value* chosen, ir::Value* top, ir::Value* w1, ir::Value* w2, ir::Value* w3,
                                   const std::function<ir::Value*()>& base, const MoEArgs& a, const std::string& load_output) {
  ir::GraphBuilder b(g, x->meta().dtype);
  const std::int64_t P = a.expert_parallel, D = a.expert_blocks > 0 ? a.expert_blocks : P, dim = x->meta().shape[1], tokens = x->meta().shape[0],
                     E = w1->meta().shape[0], k = chosen->meta().shape[1];
  if (P < 1 || D % P != 0 || tokens % D != 0 || E % P != 0) {
    throw std::invalid_argument("expert parallelism of degree " + std::to_string(P) + " in " + std::to_string(D) + " blocks needs the tokens (" +
                                std::to_string(tokens) + ") to divide by the blocks, and the blocks and the experts (" + std::to_string(E) + ") by the degree");
  }
  const std::int64_t n = tokens / D, slots = n * k, local = E / P;
  const Float32Casts cast{g, x->meta().dtype};
  const std::string f32 = ir::to_string(ir::DType::f32);
  const ir::Attributes on_dim{{"expert_dim", a.expert_dim}, {"group", P}};  // each run of P blocks exchanges on its own (HSDP's replicas, efsdp's groups)

  Value* ids = b.reshape(chosen, {D, slots});
  Value* counts = g.add("bincount", {ids}, {{"minlength", E}});  // [D, E]: each block's slots per expert
  g.add_output(load_output, g.add("sum", {g.add("cast", {counts}, {{"dtype", f32}})}, {{"dims", Shape{0}}}));
  Value* order = g.add("argsort", {ids}, {{"dim", std::int64_t{1}}, {"stable", true}});
  Value* weights = b.reshape(g.add("gather", {b.reshape(top, {D, slots}), order}, {{"dim", std::int64_t{1}}}), {D, slots, 1});
  Value* index = g.add("expand", {b.reshape(g.add("floor_divide_scalar", {order}, {{"value", k}}), {D, slots, 1})}, {{"shape", Shape{D, slots, dim}}});
  Value* xb = b.reshape(x, {D, n, dim});
  Value* routed = g.add("gather", {xb, index}, {{"dim", std::int64_t{1}}});
  if (a.score_before_experts) routed = cast.back(b.mul(cast.to_f32(routed), weights));
  Value* rows = g.add("expert_dispatch", {routed, counts}, on_dim);  // [D, P x slots, dim]
  Value* shared = base ? base() : nullptr;  // while the rows are in flight
  // Each block's rows per local expert (over all blocks' slots of its run), and their ends.
  Value* received = b.reshape(g.add("sum", {b.reshape(counts, {D / P, P, P, local})}, {{"dims", Shape{1}}}), {D, local});
  Value* offs = g.add("cumsum", {received}, {{"dim", std::int64_t{1}}});
  auto blocks = [&](Value* w) {  // [E, out, in] -> each block's experts, [P, local, in, out]
    const Shape& s = w->meta().shape;
    return b.transpose(b.reshape(w, {P, local, s[1], s[2]}), 2, 3);
  };
  auto grouped_mm = [&](Value* in, Value* w) { return g.add("grouped_mm", {in, blocks(w), offs}); };
  Value* out = g.add("expert_combine", {grouped_mm(b.mul(b.silu(grouped_mm(rows, w1)), grouped_mm(rows, w3)), w2), counts}, on_dim);  // [D, slots, dim]
  Value* onto = shared != nullptr ? b.reshape(shared, {D, n, dim}) : g.add("zeros_like", {xb});
  if (!a.score_before_experts) out = cast.back(b.mul(cast.to_f32(out), weights));
  return b.reshape(g.add("scatter_add", {onto, index, out}, {{"dim", std::int64_t{1}}}), {tokens, dim});
}

void set_importer(Importer f) { importer() = std::move(f); }
void set_import_release(std::function<void()> release) { releaser() = std::move(release); }
void release_imports() {
  if (releaser()) releaser()();
}

Model import_model(const ModelArgs& args) {
  if (!importer()) throw std::invalid_argument("model \"pt2\": this program was built without the importer (spmdx_exec, which needs LibTorch)");
  if (args.path.empty()) throw std::invalid_argument("model \"pt2\" needs model.path: the .pt2 file torch.export.save wrote");
  return importer()(args);
}

std::int64_t llama3_ffn_hidden(std::int64_t dim, double ffn_dim_multiplier, std::int64_t multiple_of) {
  std::int64_t hidden = 2 * (4 * dim) / 3;
  hidden = static_cast<std::int64_t>(ffn_dim_multiplier * static_cast<double>(hidden));
  return multiple_of * ((hidden + multiple_of - 1) / multiple_of);
}

std::int64_t parameter_count(const Model& m) {
  std::int64_t n = 0;
  for (const auto& init : m.init) {
    if (!init.trainable) continue;
    std::int64_t e = 1;
    for (const std::int64_t d : init.shape) e *= d;
    n += e;
  }
  return n;
}

std::int64_t embedding_parameter_count(const Model& m) {
  std::set<const ir::Value*> tables;
  for (const auto& n : m.graph.nodes()) {
    if (n->op() != "embedding") continue;
    const ir::Value* w = n->input(0);
    while (w->producer() != nullptr && w->producer()->op() == "cast") w = w->producer()->input(0);
    if (w->producer() == nullptr) tables.insert(w);
  }
  std::int64_t count = 0;
  for (const auto& init : m.init) {
    if (!init.trainable) continue;
    const ir::Value* v = m.graph.find_input(init.name);
    if (v == nullptr || tables.count(v) == 0) continue;
    std::int64_t e = 1;
    for (const std::int64_t d : init.shape) e *= d;
    count += e;
  }
  return count;
}

std::int64_t active_parameter_count(const Model& m) {
  if (m.args.moe.experts <= 0) return parameter_count(m);
  // The routed experts: the built-in ones by name; an imported model's, those its expert
  // parallelism built.
  const std::set<std::string> expert(m.expert_params.begin(), m.expert_params.end());
  std::int64_t n = 0;
  for (const auto& init : m.init) {
    if (!init.trainable) continue;
    std::int64_t e = 1;
    for (const std::int64_t d : init.shape) e *= d;
    n += init.name.find(".moe.experts.") != std::string::npos || expert.count(init.name) ? e / m.args.moe.experts * m.args.moe.top_k : e;
  }
  return n;
}

double flops_per_token(const Model& m, std::int64_t seq_len) {
  double flops = 6.0 * static_cast<double>(active_parameter_count(m) - embedding_parameter_count(m));
  if (is_builtin_transformer(m.args.name)) {
    const double head_dim = static_cast<double>(head_dim_of(m.args));
    flops += 12.0 * static_cast<double>(m.args.n_layers) * static_cast<double>(m.args.n_heads) * head_dim * static_cast<double>(seq_len);
  }
  return flops;
}

namespace {

// torchtitan's Qwen3 flavors (models/qwen3/__init__.py): head_dim 128, q/k norm, RMSNorm eps
// 1e-6, RoPE theta 1e6 (235B-A22B: 5e6) without scaling in the rotate_half ("cos_sin") form;
// dense FFN `hidden`, or MoE layers of `experts` x `moe_hidden` choosing top 8, softmax scores
// with route_norm, no shared experts; tied embeddings on the small dense ones.
bool qwen3_flavor(const std::string& flavor, ModelArgs& a) {
  struct F {
    const char* name;
    std::int64_t dim, layers, heads, kv, hidden, experts, moe_hidden, top_k;
    bool tied;
    double theta;
    std::int64_t head_dim;
  };
  static const F flavors[] = {
      {"debugmodel", 256, 8, 16, 8, 3072, 0, 0, 0, true, 1e6, 128},
      {"0.6B", 1024, 28, 16, 8, 3072, 0, 0, 0, true, 1e6, 128},
      {"1.7B", 2048, 28, 16, 8, 6144, 0, 0, 0, true, 1e6, 128},
      {"4B", 2560, 36, 32, 8, 9728, 0, 0, 0, true, 1e6, 128},
      {"8B", 4096, 36, 32, 8, 12288, 0, 0, 0, false, 1e6, 128},
      {"14B", 5120, 40, 40, 8, 17408, 0, 0, 0, false, 1e6, 128},
      {"32B", 5120, 64, 64, 8, 25600, 0, 0, 0, false, 1e6, 128},
      {"debugmodel_moe", 256, 8, 16, 8, 0, 64, 768, 8, false, 1e6, 128},
      {"30B-A3B", 2048, 48, 32, 4, 0, 128, 768, 8, false, 1e6, 128},
      {"235B-A22B", 4096, 94, 64, 4, 0, 128, 1536, 8, false, 5e6, 128},
      {"tiny_moe", 64, 2, 4, 2, 0, 8, 32, 2, false, 1e6, 16},  // spmdx's, for CPU tests
  };
  for (const F& f : flavors) {
    if (flavor != f.name) continue;
    a.dim = f.dim, a.n_layers = f.layers, a.n_heads = f.heads, a.n_kv_heads = f.kv, a.ffn_hidden = f.hidden, a.head_dim = f.head_dim;
    a.tie_embeddings = f.tied, a.rope_theta = f.theta, a.rope_scaling = {}, a.rope_style = "half", a.qk_norm = true, a.norm_eps = 1e-6;
    if (f.experts > 0) {
      a.moe.experts = f.experts, a.moe.hidden = f.moe_hidden, a.moe.top_k = f.top_k;
      a.moe.score_func = "softmax", a.moe.route_norm = true, a.moe.score_before_experts = false;
    }
    return true;
  }
  return false;
}

// torchtitan's DeepSeek-V3 flavors (models/deepseek_v3/__init__.py; 16B with DeepSeek-V2-Lite's
// 27 layers), eps 1e-5, RoPE theta 10000 in the interleaved form (YaRN, which torchtitan applies
// past 4096 positions, is not), attention as plain multi-head attention of head_dim 128 (the
// v_head_dim) in place of MLA.
bool deepseek_v3_flavor(const std::string& flavor, ModelArgs& a) {
  struct F {
    const char* name;
    std::int64_t dim, hidden, moe_hidden, layers, dense, heads, experts, shared, top_k, groups, limited;
    const char* score;
    bool route_norm;
    double route_scale;
    std::int64_t head_dim;
  };
  static const F flavors[] = {
      {"debugmodel", 256, 1024, 256, 6, 1, 16, 8, 2, 3, 0, 0, "softmax", false, 1.0, 128},
      {"16B", 2048, 10944, 1408, 27, 1, 16, 64, 2, 6, 0, 0, "softmax", false, 1.0, 128},
      {"671B", 7168, 18432, 2048, 61, 3, 128, 256, 1, 8, 8, 4, "sigmoid", true, 2.5, 128},
      {"tiny_moe", 64, 128, 32, 2, 1, 4, 8, 1, 2, 4, 2, "sigmoid", true, 2.5, 16},  // spmdx's, for CPU tests
  };
  for (const F& f : flavors) {
    if (flavor != f.name) continue;
    a.dim = f.dim, a.ffn_hidden = f.hidden, a.n_layers = f.layers, a.n_heads = f.heads, a.n_kv_heads = 0, a.head_dim = f.head_dim;
    a.rope_theta = 10000.0, a.rope_scaling = {}, a.norm_eps = 1e-5;
    a.moe.experts = f.experts, a.moe.hidden = f.moe_hidden, a.moe.shared_experts = f.shared, a.moe.top_k = f.top_k, a.moe.dense_layers = f.dense;
    a.moe.expert_groups = f.groups, a.moe.limited_groups = f.limited, a.moe.score_func = f.score, a.moe.route_norm = f.route_norm;
    a.moe.route_scale = f.route_scale, a.moe.score_before_experts = false;
    return true;
  }
  return false;
}

}  // namespace

bool is_builtin_transformer(const std::string& name) { return name == "llama" || name == "qwen3" || name == "deepseek_v3"; }

std::int64_t head_dim_of(const ModelArgs& args) { return args.head_dim > 0 ? args.head_dim : args.dim / args.n_heads; }

std::string mla_note(const ModelArgs& args) {
  if (args.name != "deepseek_v3") return "";
  return "deepseek_v3: multi-head latent attention (MLA) is not built; its attention here is plain multi-head attention (" +
         std::to_string(args.n_heads) + " heads of " + std::to_string(head_dim_of(args)) + "), so its parameters and FLOPs differ from DeepSeek-V3's";
}

ModelArgs model_args(const std::string& name, const std::string& flavor, std::int64_t vocab_size) {
  ModelArgs a;
  a.name = name;
  a.flavor = flavor;
  a.vocab_size = vocab_size;
  if (name == "pt2") return a;  // everything else comes from the file
  if (name != "mlp" && !is_builtin_transformer(name)) {
    throw std::invalid_argument("unknown model '" + name + "'; known models: mlp, llama, qwen3, deepseek_v3, pt2");
  }
  if (name == "qwen3") {
    if (!qwen3_flavor(flavor, a)) {
      throw std::invalid_argument("unknown flavor '" + flavor + "' of model 'qwen3'; known flavors: debugmodel, 0.6B, 1.7B, 4B, 8B, 14B, 32B, debugmodel_moe, 30B-A3B, 235B-A22B, tiny_moe");
    }
  } else if (name == "deepseek_v3") {
    if (!deepseek_v3_flavor(flavor, a)) throw std::invalid_argument("unknown flavor '" + flavor + "' of model 'deepseek_v3'; known flavors: debugmodel, 16B, 671B, tiny_moe");
  } else if (flavor == "tiny") {
    a.dim = 64, a.n_layers = 2, a.n_heads = 4, a.ffn_hidden = 192;
  } else if (flavor == "debugmodel") {
    a.dim = 256, a.n_layers = 6, a.n_heads = 16, a.ffn_hidden = 768;
  } else if (flavor == "large") {
    a.dim = 2048, a.n_layers = 8, a.n_heads = 16, a.ffn_hidden = 5632;
  } else if (flavor == "tiny_gqa" && name == "llama") {
    a.dim = 64, a.n_layers = 2, a.n_heads = 4, a.n_kv_heads = 2, a.ffn_hidden = 192;
  } else if (flavor == "8B" && name == "llama") {  // torchtitan's llama3 flavors
    a.dim = 4096, a.n_layers = 32, a.n_heads = 32, a.n_kv_heads = 8, a.ffn_hidden = llama3_ffn_hidden(4096, 1.3, 1024);
  } else if (flavor == "70B" && name == "llama") {
    a.dim = 8192, a.n_layers = 80, a.n_heads = 64, a.n_kv_heads = 8, a.ffn_hidden = llama3_ffn_hidden(8192, 1.3, 4096);
  } else if (flavor == "405B" && name == "llama") {
    a.dim = 16384, a.n_layers = 126, a.n_heads = 128, a.n_kv_heads = 8, a.ffn_hidden = llama3_ffn_hidden(16384, 1.2, 4096);
  } else {
    throw std::invalid_argument("unknown flavor '" + flavor + "' of model '" + name + "'; known flavors: tiny, debugmodel, large" +
                                (name == "llama" ? ", tiny_gqa, 8B, 70B, 405B" : ""));
  }
  if (vocab_size <= 0) throw std::invalid_argument("vocab_size must be positive, got " + std::to_string(vocab_size));
  return a;
}

Model build_model(const ModelArgs& args, std::int64_t batch, std::int64_t seq_len, ir::DType dtype) {
  if (batch <= 0 || seq_len <= 0) {
    throw std::invalid_argument("batch and seq_len must be positive, got " + std::to_string(batch) + " x " + std::to_string(seq_len));
  }
  if (args.name == "pt2") {
    Model m = import_model(args);
    const ir::Value* tokens = m.graph.find_input("tokens");
    if (tokens->meta().shape != std::vector<std::int64_t>{batch, seq_len}) {
      throw std::invalid_argument(args.path + ": the program was exported for tokens " + ir::shape_str(tokens->meta().shape) + ", not [" +
                                  std::to_string(batch) + ", " + std::to_string(seq_len) + "]");
    }
    return m;
  }
  if (args.head_dim > 0 && args.head_dim % 2 != 0) throw std::invalid_argument("head_dim " + std::to_string(args.head_dim) + " must be even (RoPE rotates pairs)");
  if (args.head_dim <= 0 && (args.dim % args.n_heads != 0 || (args.dim / args.n_heads) % 2 != 0)) {
    throw std::invalid_argument("dim " + std::to_string(args.dim) + " must split into " + std::to_string(args.n_heads) +
                                " heads of even size");
  }
  if (const MoEArgs& moe = args.moe; moe.experts > 0) {
    if (moe.top_k < 1 || moe.top_k > moe.experts) throw std::invalid_argument("moe top_k " + std::to_string(moe.top_k) + " must lie in [1, " + std::to_string(moe.experts) + "] (the experts)");
    if (moe.expert_groups > 0 && (moe.experts % moe.expert_groups != 0 || moe.experts / moe.expert_groups < 2 || moe.limited_groups < 1 ||
                                  moe.limited_groups > moe.expert_groups || moe.limited_groups * (moe.experts / moe.expert_groups) < moe.top_k)) {
      throw std::invalid_argument("moe expert groups: " + std::to_string(moe.experts) + " experts in " + std::to_string(moe.expert_groups) + " groups (at least 2 each), " +
                                  std::to_string(moe.limited_groups) + " of them chosen, must hold the top " + std::to_string(moe.top_k));
    }
    if (moe.score_func != "softmax" && moe.score_func != "sigmoid") throw std::invalid_argument("moe score_func must be \"softmax\" or \"sigmoid\", got \"" + moe.score_func + "\"");
  }
  Model m;
  m.args = args;
  Builder mb(m, dtype);
  Value* tokens = mb.b().input("tokens", {batch, seq_len}, ir::DType::i64);
  Value* labels = mb.b().input("labels", {batch, seq_len}, ir::DType::i64);
  if (args.name == "mlp") {
    build_mlp(m, mb, tokens, labels);
  } else {
    build_decoder(m, mb, tokens, labels, batch, seq_len);
  }
  return m;
}

std::string model_label(const ModelArgs& args) {
  if (args.name == "pt2") return args.name + " " + args.path;
  std::string label = args.name + " " + args.flavor;
  try {
    if (model_args(args.name, args.flavor, args.vocab_size).n_layers != args.n_layers) label += " (" + std::to_string(args.n_layers) + (args.n_layers == 1 ? " layer)" : " layers)");
  } catch (const std::invalid_argument&) {
  }
  return label;
}

std::string layer_of(const std::string& tensor_name) {
  std::string name = tensor_name;
  for (const char* prefix : {"exp_avg_sq.", "exp_avg.", "next."}) {
    if (name.rfind(prefix, 0) == 0) name = name.substr(std::string(prefix).size());
  }
  if (name.find('.') == std::string::npos) return "";  // tokens, labels, lr, step, %12
  // Up to the first numeric segment: "layers.3", "model.layers.3" (Hugging Face), "transformer.h.3" (GPT-2).
  for (std::size_t start = 0; start < name.size();) {
    const std::size_t end = std::min(name.find('.', start), name.size());
    if (end > start && name.find_first_not_of("0123456789", start) >= end) return name.substr(0, end);
    start = end + 1;
  }
  return name.substr(0, name.find('.'));
}

}  // namespace spmdx::models
