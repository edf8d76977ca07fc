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

/// A Mixture-of-Experts feed-forward layer, as torchtitan's MoE (models/moe/moe.py, MoEArgs):
/// token-choice top-k routing over `experts` SwiGLU experts, dropless (every token reaches its
/// top_k experts: the slots are sorted by expert and run as one grouped GEMM whose group ends are
/// data), with optional shared experts on every token and DeepSeek-V3's auxiliary-loss-free load
/// balancing (a per-layer expert_bias used only for choosing experts).
struct MoEArgs {
  std::int64_t experts = 0;       ///< 0: no MoE layers (a dense model)
  std::int64_t top_k = 1;
  std::int64_t hidden = 0;        ///< each expert's SwiGLU hidden size (torchtitan's moe_inter_dim / moe_hidden_dim)
  std::int64_t shared_experts = 0;  ///< a dense SwiGLU of hidden x shared_experts on every token (0: none)
  std::string score_func = "softmax";  ///< "softmax" or "sigmoid", in float32
  bool route_norm = false;        ///< divide the top-k scores by their sum (+1e-20)
  double route_scale = 1.0;       ///< then multiply them by this
  bool score_before_experts = false;  ///< weight the routed tokens before the experts (else their outputs after)
  std::int64_t expert_groups = 0;   ///< node-limited routing: experts in this many groups (0: off) ...
  std::int64_t limited_groups = 0;  ///< ... of which each token's top_k come from the best this many (by each group's top-2 sum)
  /// DeepSeek-V3's load balancing (Wang et al. 2024, arXiv:2408.15664; torchtitan's
  /// load_balance_coeff): after each step expert_bias += coeff x sign(mean load - load), centred;
  /// 0: no expert_bias.
  double load_balance_coeff = 1e-3;
  std::int64_t dense_layers = 0;  ///< the first this many layers keep a dense FFN (DeepSeek-V3's n_dense_layers)
  /// Expert parallelism (torchtitan's expert_parallel_degree): > 1 builds the routed experts in
  /// blocks of this many ranks of mesh dim `expert_dim` (each block its ranks' tokens and
  /// experts / degree experts), exchanged by expert_dispatch / expert_combine; the numbers are
  /// those of degree 1 (sums in another order aside).
  std::int64_t expert_parallel = 1;
  std::string expert_dim = "dp_shard";
  /// The tokens' blocks, one per data-parallel rank (dp_replicate x dp_shard: HSDP's replicas
  /// each exchange within their own expert_parallel blocks); 0: expert_parallel.
  std::int64_t expert_blocks = 0;
};

struct ModelArgs {
  std::string name;    ///< "mlp", "llama", "qwen3", "deepseek_v3", or "pt2" (a torch.export program read from `path`)
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
  /// Each attention head's size; 0: dim / n_heads (Qwen3's is 128 whatever dim is).
  std::int64_t head_dim = 0;
  bool qk_norm = false;         ///< RMSNorm over head_dim on each head's query and key before RoPE (Qwen3)
  bool tie_embeddings = false;  ///< the output projection is tok_embeddings.weight (Qwen3 up to 4B)
  std::string rope_style = "interleaved";  ///< rotary_embedding's style: "interleaved" (Llama 3) or "half" (Qwen3's cos_sin)
  MoEArgs moe;                  ///< moe.experts > 0: the FFN of layers from moe.dense_layers on is an MoE
};

/// The flavors: llama `debugmodel` (torchtitan's: dim 256, 6 layers, 16 heads, FFN 768,
/// rope_theta 500000, Llama 3.1 RoPE scaling 8 / 1 / 4 / 8192, norm eps 1e-5) and `tiny`
/// (dim 64, 2 layers, 4 heads, FFN 192, the same RoPE and eps), and `large` (dim 2048, 8
/// layers, 16 heads, FFN 5632 = torchtitan's 8/3 x dim rounded up to 256; 0.41 x 10^9
/// parameters: a flavor that keeps one GPU busy, for scripts/device_check); `tiny_gqa` (tiny
/// with 2 key/value heads for its 4 query heads); torchtitan's llama3 `8B` (dim 4096, 32
/// layers, 32 heads, 8 KV heads, FFN 14336), `70B` (8192, 80, 64, 8, 28672) and `405B` (16384,
/// 126, 128, 8, 53248), rope_theta 500000 with Llama 3.1 scaling; mlp `tiny` (dim 64,
/// FFN 192), `debugmodel` (dim 256, FFN 768) and `large` (dim 2048, FFN 5632). qwen3: torchtitan's
/// Qwen3 flavors (models/qwen3/__init__.py: head_dim 128, q/k RMSNorm, eps 1e-6, RoPE theta 1e6
/// in the rotate_half convention, tied embeddings up to 4B): dense `debugmodel`, `0.6B`,
/// `1.7B`, `4B`, `8B`, `14B`, `32B`; MoE `debugmodel_moe`, `30B-A3B`, `235B-A22B` (softmax
/// scores with route_norm, no shared experts); and spmdx's `tiny_moe` (dim 64, 2 layers, 4 heads
/// of 16, 2 KV heads, 8 experts of hidden 32, top 2). deepseek_v3: torchtitan's DeepSeek-V3
/// flavors (models/deepseek_v3/__init__.py) `debugmodel`, `16B`, `236B`, `671B`, and `tiny_moe`
/// (dim 64, 2 layers of which 1 dense, 8 experts of hidden 32, top 2, 1 shared, sigmoid scores
/// with route_norm and route_scale 2.5, 4 groups of which 2 chosen), with plain multi-head
/// attention (head_dim 128; tiny_moe 16) in place of its multi-head latent attention (MLA, not
/// built: mla_note says so). Throws std::invalid_argument naming the model or flavor and listing
/// the known ones.
ModelArgs model_args(const std::string& name, const std::string& flavor, std::int64_t vocab_size);

/// For deepseek_v3: the sentence that says its attention is plain multi-head attention in place of
/// DeepSeek-V3's multi-head latent attention; "" for other models.
std::string mla_note(const ModelArgs& args);

/// Each attention head's size: args.head_dim, or dim / n_heads.
std::int64_t head_dim_of(const ModelArgs& args);

/// True for the built-in decoder-only transformers (llama, qwen3, deepseek_v3): RoPE attention
/// blocks with RMSNorm, whose flavors fix their shapes.
bool is_builtin_transformer(const std::string& name);

/// torchtitan's FeedForward hidden size: int(2 x 4 dim / 3), times ffn_dim_multiplier (int),
/// rounded up to a multiple of multiple_of (8B: 14336, 70B: 28672, 405B: 53248).
std::int64_t llama3_ffn_hidden(std::int64_t dim, double ffn_dim_multiplier, std::int64_t multiple_of);

/// A forward graph: inputs are "tokens" and "labels" (i64[batch, seq_len], labels = tokens
/// shifted by one) then the parameters and buffers in init order; the output "loss" (f32[],
/// mean cross entropy over all tokens). Each MoE layer L adds the output
/// "layers.L.moe.tokens_per_expert" (f32 [experts], the slots each expert received: torchtitan's
/// buffer of that name) and, with load balancing, reads the buffer "layers.L.moe.expert_bias"
/// (f32 [experts], zeros at first), which the train step updates (train::TrainStepConfig).
struct Model {
  ModelArgs args;
  ir::Graph graph;
  std::vector<InitSpec> init;          ///< every parameter and buffer, in declaration order
  std::vector<std::string> params;     ///< trainable names, in declaration order
  /// The routed experts' weights ([experts, ...] each) when expert parallelism builds them in
  /// blocks over args.moe.expert_dim: each rank keeps its Shard(0) block and uses it where it is
  /// (the tokens move instead). Empty without expert parallelism.
  std::vector<std::string> expert_params;
};

/// One MoE layer's routed experts under expert parallelism (torchtitan's ExpertParallel,
/// distributed/expert_parallel.py, v0.2.2; DeepSeek-V3's and Megatron-Core's dispatch / combine),
/// written on values already in `g`, for the built-in MoE layer and an imported one alike:
/// - x [tokens, dim] (the layer's input rows), chosen i64 [tokens, top_k] (each token's experts),
///   top [tokens, top_k] (their scores, float32);
/// - w1, w3 [experts, hidden, dim] and w2 [experts, dim, hidden]: SwiGLU experts,
///   w2(silu(w1 x) * w3 x), as torchtitan's GroupedExperts and transformers' gate_up_proj
///   (its first `hidden` rows w1, the rest w3) and down_proj;
/// - base: builds [tokens, dim] the routed outputs are added onto (shared experts), called once
///   right after the dispatch, so that its compute runs while the tokens are in flight (the
///   all_to_all_v is asynchronous); empty (or returning nullptr): zeros.
/// The tokens are cut into a.expert_blocks blocks (one per data-parallel rank; the ranks of
/// a.expert_dim in runs of a.expert_parallel), each block's slots sorted by expert (stable), sent
/// to their experts' blocks in their run (expert_dispatch: an all_to_all_v once sharded), run there
/// as grouped GEMMs over the block's experts / degree experts, sent back (expert_combine), weighted by their scores (before the experts when
/// a.score_before_experts) and added into their tokens' rows. Adds the graph output
/// `load_output` (f32 [experts]: the slots each expert received). Returns [tokens, dim] in x's
/// dtype. Throws std::invalid_argument when the blocks do not divide the tokens, or the degree
/// the blocks or the experts.
ir::Value* expert_parallel_experts(ir::Graph& g, ir::Value* x, ir::Value* chosen, ir::Value* top, ir::Value* w1, ir::Value* w2, ir::Value* w3,
                                   const std::function<ir::Value*()>& base, const MoEArgs& a, const std::string& load_output);

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

/// The parameters a token meets: every trainable parameter, the routed experts' (the built-in
/// layers', and an imported model's expert_params) counted top_k / experts (torchtitan's
/// get_moe_model_nparams_and_flops: dense + active sparse); for a dense model parameter_count.
std::int64_t active_parameter_count(const Model& m);

/// Training FLOPs per token, torchtitan's MFU formula (get_dense_model_nparams_and_flops, and
/// get_moe_model_nparams_and_flops for MoE models, with active parameters):
/// 6 x (active parameters - embedding parameters) for the matmuls of forward and backward, plus
/// 12 x layers x heads x head_dim x seq_len for attention's score and value matmuls (causal
/// sparsity not discounted, recomputation not counted). The attention term only for the built-in transformers;
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
