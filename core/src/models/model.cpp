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

// Llama 3 as torchtitan's llama3 model: pre-norm RMSNorm blocks, rotary attention (causal,
// Llama 3.1 frequency scaling), SwiGLU feed-forward; parameter names and init as torchtitan's
// init_weights: the embedding N(0, 1); wq, wk, wv, w1 trunc_normal(std 0.02); wo, w2, w3
// trunc_normal(depth-scaled std 0.02 / sqrt(2 (layer + 1))), all cut at +-2; output.weight
// trunc_normal(std dim^-1/2) cut at 3 std; norms ones.
void build_llama(Model& m, Builder& mb, Value* tokens, Value* labels, std::int64_t batch, std::int64_t seq) {
  const auto& a = m.args;
  auto& b = mb.b();
  const std::int64_t hd = a.dim / a.n_heads;
  using K = InitSpec::Kind;
  Value* h = b.embedding(mb.param("tok_embeddings.weight", {a.vocab_size, a.dim}, K::normal, 1.0), tokens);
  // block_causal: each position's document, from the batch's ids (one op, shared by the layers).
  Value* documents = a.attn_mask_type == "block_causal" ? m.graph.add("document_ids", {tokens}, {{"eos", a.eos_id}}) : nullptr;
  Value* cos = mb.buffer("rope.cos", {seq, hd / 2}, K::rope_cos, a.rope_theta, a.rope_scaling);
  Value* sin = mb.buffer("rope.sin", {seq, hd / 2}, K::rope_sin, a.rope_theta, a.rope_scaling);
  for (std::int64_t l = 0; l < a.n_layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    const double depth_std = 0.02 / std::sqrt(2.0 * static_cast<double>(l + 1));
    Value* x = b.rms_norm(h, mb.param(p + "attention_norm.weight", {a.dim}, K::ones), a.norm_eps);
    auto heads = [&](const std::string& w, std::int64_t n, double std) {
      return b.reshape(b.linear(x, mb.param(p + "attention." + w + ".weight", {n * hd, a.dim}, K::trunc_normal, std)), {batch, seq, n, hd});
    };
    // Grouped-query attention: each key/value head serves `rep` query heads in a row, as
    // torchtitan's repeat_kv (expand, then merge the two head dims).
    const std::int64_t kv = a.n_kv_heads > 0 ? a.n_kv_heads : a.n_heads, rep = a.n_heads / kv;
    auto repeat = [&](Value* t) {  // [batch, kv, seq, hd] -> [batch, kv * rep, seq, hd]
      if (rep == 1) return t;
      Value* e = m.graph.add("expand", {b.reshape(t, {batch, kv, 1, seq, hd})}, {{"shape", Shape{batch, kv, rep, seq, hd}}});
      return b.reshape(e, {batch, kv * rep, seq, hd});
    };
    Value* q = b.transpose(b.rotary(heads("wq", a.n_heads, 0.02), cos, sin), 1, 2);
    Value* k = repeat(b.transpose(b.rotary(heads("wk", kv, 0.02), cos, sin), 1, 2));
    Value* v = repeat(b.transpose(heads("wv", kv, 0.02), 1, 2));
    Value* attention = documents != nullptr ? m.graph.add_node("sdpa", {q, k, v, documents}, {{"causal", true}})->output(0) : b.causal_attention(q, k, v);
    Value* o = b.reshape(b.transpose(attention, 1, 2), {batch, seq, a.dim});
    h = b.add(h, b.linear(o, mb.param(p + "attention.wo.weight", {a.dim, a.dim}, K::trunc_normal, depth_std)));
    Value* y = b.rms_norm(h, mb.param(p + "ffn_norm.weight", {a.dim}, K::ones), a.norm_eps);
    Value* w1 = mb.param(p + "feed_forward.w1.weight", {a.ffn_hidden, a.dim}, K::trunc_normal, 0.02);
    Value* w2 = mb.param(p + "feed_forward.w2.weight", {a.dim, a.ffn_hidden}, K::trunc_normal, depth_std);
    Value* w3 = mb.param(p + "feed_forward.w3.weight", {a.ffn_hidden, a.dim}, K::trunc_normal, depth_std);
    h = b.add(h, b.linear(b.mul(b.silu(b.linear(y, w1)), b.linear(y, w3)), w2));
  }
  h = b.rms_norm(h, mb.param("norm.weight", {a.dim}, K::ones), a.norm_eps);
  const double out_std = 1.0 / std::sqrt(static_cast<double>(a.dim));
  Value* logits = b.linear(h, mb.param("output.weight", {a.vocab_size, a.dim}, K::trunc_normal, out_std, 3.0 * out_std));
  m.graph.add_output("loss", loss_of(b, logits, labels, a.vocab_size));
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

double flops_per_token(const Model& m, std::int64_t seq_len) {
  double flops = 6.0 * static_cast<double>(parameter_count(m) - embedding_parameter_count(m));
  if (m.args.name == "llama") {
    const double head_dim = static_cast<double>(m.args.dim / m.args.n_heads);
    flops += 12.0 * static_cast<double>(m.args.n_layers) * static_cast<double>(m.args.n_heads) * head_dim * static_cast<double>(seq_len);
  }
  return flops;
}

ModelArgs model_args(const std::string& name, const std::string& flavor, std::int64_t vocab_size) {
  ModelArgs a;
  a.name = name;
  a.flavor = flavor;
  a.vocab_size = vocab_size;
  if (name == "pt2") return a;  // everything else comes from the file
  if (name != "mlp" && name != "llama") {
    throw std::invalid_argument("unknown model '" + name + "'; known models: mlp, llama, pt2");
  }
  if (flavor == "tiny") {
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
  if (args.dim % args.n_heads != 0 || (args.dim / args.n_heads) % 2 != 0) {
    throw std::invalid_argument("dim " + std::to_string(args.dim) + " must split into " + std::to_string(args.n_heads) +
                                " heads of even size");
  }
  Model m;
  m.args = args;
  Builder mb(m, dtype);
  Value* tokens = mb.b().input("tokens", {batch, seq_len}, ir::DType::i64);
  Value* labels = mb.b().input("labels", {batch, seq_len}, ir::DType::i64);
  if (args.name == "mlp") {
    build_mlp(m, mb, tokens, labels);
  } else {
    build_llama(m, mb, tokens, labels, batch, seq_len);
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
