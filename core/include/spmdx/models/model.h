// Models as forward graphs: `mlp` and `llama` (Llama 3 as torchtitan's llama3 model), each with
// flavors. Building needs no LibTorch; the parameter values come from init_tensors()
// (spmdx/exec/init.h) following each parameter's InitSpec.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "spmdx/ir/graph.h"

namespace spmdx::models {

/// Llama 3.1's RoPE frequency scaling (torchtitan's RoPEScalingArgs, and apply_scaling in its
/// llama3 model): frequencies whose wavelength 2 pi / f exceeds original / low_freq_factor are
/// divided by scaling_factor, those below original / high_freq_factor kept, and those between
/// blended by smooth = (original / wavelength - low) / (high - low). scaling_factor 0: none.
struct RopeScaling {
  double scaling_factor = 0.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  double original_max_position_embeddings = 8192;
};

/// How a graph input is filled before the first step.
struct InitSpec {
  enum class Kind {
    normal,        ///< N(0, std^2), from the seeded generator in declaration order
    trunc_normal,  ///< N(0, std^2) truncated to [-bound, bound], as torch.nn.init.trunc_normal_
    ones,
    zeros,
    rope_cos,      ///< cos(t * f_i), [seq_len, head_dim/2]: f_i = theta^(-2i/head_dim), with Llama 3.1's
                   ///< scaling when rope_scaling_factor > 0, as torchtitan's precompute_freqs_cis
    rope_sin,
    data,          ///< the bytes in `data` (an imported program's weights, buffers and constants)
  };
  std::string name;
  std::vector<std::int64_t> shape;
  Kind kind = Kind::normal;
  double std = 0.02;
  double bound = 2.0;       ///< trunc_normal: the absolute cut (torchtitan: 2, or 3 std for output.weight)
  double rope_theta = 0.0;  ///< rope tables only
  RopeScaling rope_scaling;  ///< rope tables only
  bool trainable = true;    ///< false for buffers (rope tables)
  /// Kind::data: the tensor's elements, contiguous, in the graph input's dtype (native byte
  /// order): `nbytes` bytes, owned with whoever read them (the importer's cache of the file),
  /// so that a model built twice holds its weights once.
  std::shared_ptr<const unsigned char> data;
  std::size_t nbytes = 0;
};

struct ModelArgs {
  std::string name;    ///< "mlp", "llama", or "pt2" (a torch.export program read from `path`)
  std::string flavor;  ///< "tiny", "debugmodel"; unused for "pt2"
  std::string path;    ///< "pt2": the archive (torch.export.save's .pt2)
  /// "pt2": the program's user inputs that take the batch's tokens and labels, in that order,
  /// by name; empty: by position (the first takes tokens, the second, if any, labels).
  std::vector<std::string> inputs;
  /// "pt2": "auto" (a scalar output is the loss, logits [..., vocab] get mean cross entropy
  /// against the labels), "cross_entropy" (the output must be logits) or "output" (the output
  /// must be the scalar loss).
  std::string loss = "auto";
  std::int64_t vocab_size = 256;
  std::int64_t dim = 64;
  std::int64_t n_layers = 2;
  std::int64_t n_heads = 4;
  /// Key/value heads (grouped-query attention, Ainslie et al. 2023; torchtitan's n_kv_heads):
  /// each serves n_heads / n_kv_heads query heads in a row (torchtitan's repeat_kv). 0: n_heads.
  std::int64_t n_kv_heads = 0;
  std::int64_t ffn_hidden = 192;
  double rope_theta = 500000.0;
  RopeScaling rope_scaling{8.0, 1.0, 4.0, 8192};  ///< torchtitan's llama3 default (RoPEScalingArgs())
  double norm_eps = 1e-5;
  /// llama: "causal", or "block_causal" (torchtitan's model.attn_mask_type): a token attends
  /// only within its own document, documents ending at each `eos_id` token of the batch's ids
  /// (torchtitan's get_document_mask_mod: the EOS belongs to the document it ends).
  std::string attn_mask_type = "causal";
  std::int64_t eos_id = -1;  ///< the tokenizer's EOS id, for block_causal
};

/// The flavors: llama `debugmodel` (torchtitan's: dim 256, 6 layers, 16 heads, FFN 768,
/// rope_theta 500000, Llama 3.1 RoPE scaling 8 / 1 / 4 / 8192, norm eps 1e-5) and `tiny`
/// (dim 64, 2 layers, 4 heads, FFN 192, the same RoPE and eps), and `large` (dim 2048, 8
/// layers, 16 heads, FFN 5632 = torchtitan's 8/3 x dim rounded up to 256; 0.41 x 10^9
/// parameters: a flavor that keeps one GPU busy, for scripts/device_check); `tiny_gqa` (tiny
/// with 2 key/value heads for its 4 query heads); torchtitan's llama3 `8B` (dim 4096, 32
/// layers, 32 heads, 8 KV heads, FFN 14336), `70B` (8192, 80, 64, 8, 28672) and `405B` (16384,
/// 126, 128, 8, 53248), rope_theta 500000 with Llama 3.1 scaling; mlp `tiny` (dim 64,
/// FFN 192), `debugmodel` (dim 256, FFN 768) and `large` (dim 2048, FFN 5632). Throws std::invalid_argument naming the
/// model or flavor and listing the known ones.
ModelArgs model_args(const std::string& name, const std::string& flavor, std::int64_t vocab_size);

/// torchtitan's FeedForward hidden size: int(2 x 4 dim / 3), times ffn_dim_multiplier (int),
/// rounded up to a multiple of multiple_of (8B: 14336, 70B: 28672, 405B: 53248).
std::int64_t llama3_ffn_hidden(std::int64_t dim, double ffn_dim_multiplier, std::int64_t multiple_of);

/// A forward graph: inputs are "tokens" and "labels" (i64[batch, seq_len], labels = tokens
/// shifted by one) then the parameters and buffers in init order; the output "loss" (f32[],
/// mean cross entropy over all tokens).
struct Model {
  ModelArgs args;
  ir::Graph graph;
  std::vector<InitSpec> init;          ///< every parameter and buffer, in declaration order
  std::vector<std::string> params;     ///< trainable names, in declaration order
};

/// Builds the forward graph for a batch of [batch, seq_len] tokens. For "pt2" the program is
/// imported (set_importer) and its exported tokens must be [batch, seq_len]. Throws
/// std::invalid_argument for bad arguments and the importer's errors.
Model build_model(const ModelArgs& args, std::int64_t batch, std::int64_t seq_len, ir::DType dtype = ir::DType::f32);

/// Reads a model from a file (ModelArgs::path) for ModelArgs::name "pt2". The library that can
/// read one (spmdx_exec, which links LibTorch: spmdx/exec/pt2_import.h) sets it when it is loaded;
/// without it build_model refuses "pt2" saying so.
using Importer = std::function<Model(const ModelArgs&)>;
void set_importer(Importer importer);
/// Lets the importer forget the files it has read (their weights stay alive only while a
/// Model's InitSpec data holds them). A no-op without an importer.
void release_imports();
/// Set with the importer: what release_imports calls.
void set_import_release(std::function<void()> release);

/// The model args.path holds, through the importer, with the batch shape it was exported for.
/// Throws std::invalid_argument without an importer, and what the importer throws.
Model import_model(const ModelArgs& args);

/// The trainable parameters' elements (buffers such as RoPE tables not counted).
std::int64_t parameter_count(const Model& m);

/// The elements of the trainable parameters an `embedding` node looks up (directly or through
/// a cast): torchtitan's nparams_embedding (tok_embeddings.weight; GPT-2's wte and wpe).
std::int64_t embedding_parameter_count(const Model& m);

/// Training FLOPs per token, torchtitan's MFU formula (get_dense_model_nparams_and_flops):
/// 6 x (parameters - embedding parameters) for the matmuls of forward and backward, plus
/// 12 x layers x heads x head_dim x seq_len for attention's score and value matmuls (causal
/// sparsity not discounted, recomputation not counted). The attention term only for llama;
/// mlp has none, and an imported pt2 program's heads are unknown (6N only).
double flops_per_token(const Model& m, std::int64_t seq_len);

/// "llama debugmodel", "mlp tiny", or "pt2 outputs/export/gpt2.pt2": the model for messages.
std::string model_label(const ModelArgs& args);

/// Where a tensor name belongs in the model: up to its first numeric segment ("layers.3" for
/// "layers.3.attention.wq.weight", "model.layers.3" for Hugging Face's, "transformer.h.3" for
/// GPT-2's; also for the "exp_avg."/"exp_avg_sq."/"next." forms), else its first segment
/// ("tok_embeddings" for "tok_embeddings.weight"); "" for batch inputs and scalars (tokens,
/// labels, lr, step).
std::string layer_of(const std::string& tensor_name);

}  // namespace spmdx::models
