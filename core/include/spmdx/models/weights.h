// Weights in and out of spmdx as safetensors files, under spmdx's names or Hugging Face's: the
// checks that need only the files' headers (no LibTorch), so that `spmdx run` refuses a bad
// checkpoint.initial_load_path before any rank starts. The tensors themselves are read by
// exec::load_initial_weights (spmdx/exec/checkpoint.h).
//
// Names: spmdx's built-in llama uses torchtitan's (`layers.0.attention.wq.weight`); Hugging
// Face's Llama uses `model.layers.0.self_attn.q_proj.weight`, and lays each head's query and
// key rows out for its half-split rotary embedding (rotate_half) where torchtitan and Meta
// interleave pairs: the mapping and the row permutation are those of torchtitan's
// Llama3StateDictAdapter and transformers' convert_llama_weights_to_hf.py.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "spmdx/models/model.h"

namespace spmdx::models {

/// One tensor of a safetensors file (Hugging Face's format: u64 little-endian header length,
/// a JSON header {name: {dtype, shape, data_offsets [begin, end)}, __metadata__}, the data).
struct SafetensorsTensor {
  std::string name;
  std::string dtype;                 ///< the file's: "F32", "BF16", "F16", "F64", "I64", ...
  std::vector<std::int64_t> shape;
  std::uint64_t offset = 0;          ///< where its bytes start, from the start of the file
  std::uint64_t nbytes = 0;
};

/// The tensors `file` holds, checked against the format: a header length within the file (and
/// at most 100 MB, the format's limit), a JSON object, a known dtype, a shape of non-negative
/// sizes and data_offsets that lie inside the data and hold exactly numel x dtype size bytes.
/// Throws std::runtime_error naming the file (and the tensor).
std::vector<SafetensorsTensor> read_safetensors_header(const std::filesystem::path& file);

/// Bytes per element of a safetensors dtype ("F32": 4); 0 for a dtype the format lacks.
std::size_t safetensors_dtype_size(const std::string& dtype);

/// Hugging Face's name of a built-in llama parameter ("layers.3.feed_forward.w1.weight" ->
/// "model.layers.3.mlp.gate_proj.weight"); "" for a name with none (the RoPE tables, which
/// Hugging Face's model makes from its config).
std::string hf_name(const std::string& name);

/// The inverse of hf_name; "" for a name that is not a Hugging Face Llama parameter.
std::string from_hf_name(const std::string& hf);

/// The heads of a query or key projection, for the rotary row permutation between torchtitan's
/// interleaved layout and Hugging Face's half-split one: args.n_heads for `...attention.wq.weight`
/// and `...attention.wk.weight` (spmdx's llama has as many key heads as query heads), else 0.
std::int64_t rotary_heads(const std::string& name, const ModelArgs& args);

/// Where each trainable parameter of a model comes from in a set of safetensors files.
struct WeightLoad {
  struct Source {
    std::filesystem::path file;
    SafetensorsTensor tensor;
    std::int64_t unpermute_heads = 0;  ///< > 0: Hugging Face's half-split rows, back to the interleaved layout
  };
  std::map<std::string, Source> params;  ///< by the model's parameter name
  bool hf_names = false;                 ///< the files use Hugging Face's names
  std::vector<std::string> ignored;      ///< in the files, not loaded: the model's buffers, made from the config
                                         ///< (spmdx's rope.cos/sin, Hugging Face's rotary_emb.inv_freq)
  std::size_t files = 0;
};

/// Matches `path` (a .safetensors file, or a folder of them, as Hugging Face shards a model) to
/// `model`'s trainable parameters: under the model's own names (spmdx's, which are torchtitan's
/// for llama, and a .pt2 program's) or, for the built-in llama, Hugging Face's. Throws
/// std::invalid_argument, one line per problem, naming `path` and each tensor that is missing,
/// extra (in the files, not in the model), of another shape, of a dtype that is not floating
/// point, or in two files; std::runtime_error for a file that is not safetensors.
WeightLoad plan_weight_load(const std::filesystem::path& path, const Model& model);

}  // namespace spmdx::models
