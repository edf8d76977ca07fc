#include "spmdx/models/weights.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>
#include <stdexcept>

#include "spmdx/files.h"
#include "spmdx/text.h"

namespace spmdx::models {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// torchtitan's Llama3StateDictAdapter.from_hf_map, "{}" standing for the layer index.
const std::vector<std::pair<std::string, std::string>>& hf_map() {
  static const std::vector<std::pair<std::string, std::string>> m = {
      {"tok_embeddings.weight", "model.embed_tokens.weight"},
      {"layers.{}.attention.wq.weight", "model.layers.{}.self_attn.q_proj.weight"},
      {"layers.{}.attention.wk.weight", "model.layers.{}.self_attn.k_proj.weight"},
      {"layers.{}.attention.wv.weight", "model.layers.{}.self_attn.v_proj.weight"},
      {"layers.{}.attention.wo.weight", "model.layers.{}.self_attn.o_proj.weight"},
      {"layers.{}.feed_forward.w1.weight", "model.layers.{}.mlp.gate_proj.weight"},
      {"layers.{}.feed_forward.w3.weight", "model.layers.{}.mlp.up_proj.weight"},
      {"layers.{}.feed_forward.w2.weight", "model.layers.{}.mlp.down_proj.weight"},
      {"layers.{}.attention_norm.weight", "model.layers.{}.input_layernorm.weight"},
      {"layers.{}.ffn_norm.weight", "model.layers.{}.post_attention_layernorm.weight"},
      {"norm.weight", "model.norm.weight"},
      {"output.weight", "lm_head.weight"},
  };
  return m;
}

// Whether `name` matches `pattern` ("layers.{}.x"); `index`: the layer index "{}" stood for.
bool match(const std::string& pattern, const std::string& name, std::string* index) {
  const auto at = pattern.find("{}");
  if (at == std::string::npos) return pattern == name;
  const std::string head = pattern.substr(0, at), tail = pattern.substr(at + 2);
  if (name.size() <= head.size() + tail.size() || name.compare(0, head.size(), head) != 0 ||
      name.compare(name.size() - tail.size(), tail.size(), tail) != 0) {
    return false;
  }
  *index = name.substr(head.size(), name.size() - head.size() - tail.size());
  return !index->empty() && index->size() <= 9 && index->find_first_not_of("0123456789") == std::string::npos;
}

std::string translate(const std::string& name, bool to_hf) {
  for (const auto& [ours, theirs] : hf_map()) {
    const std::string& from = to_hf ? ours : theirs;
    const std::string& to = to_hf ? theirs : ours;
    std::string index;
    if (!match(from, name, &index)) continue;
    const auto at = to.find("{}");
    return at == std::string::npos ? to : to.substr(0, at) + index + to.substr(at + 2);
  }
  return "";
}

bool is_hf_rotary_buffer(const std::string& name) {
  std::string index;
  return match("model.layers.{}.self_attn.rotary_emb.inv_freq", name, &index);
}

[[noreturn]] void bad_file(const fs::path& file, const std::string& why) { throw std::runtime_error(file.string() + ": " + why); }

std::vector<fs::path> safetensors_files(const fs::path& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) throw std::invalid_argument(path.string() + " does not exist: name a .safetensors file or a folder of them");
  if (!fs::is_directory(path, ec)) {
    // Not a FIFO or device, whose reading would block or never end.
    if (!fs::is_regular_file(path, ec)) throw std::invalid_argument(path.string() + " is not a regular file: name a .safetensors file or a folder of them");
    return {path};
  }
  std::vector<fs::path> files;
  for (fs::directory_iterator it(path, ec), end; !ec && it != end; it.increment(ec)) {
    if (it->path().extension() == ".safetensors" && it->is_regular_file()) files.push_back(it->path());
  }
  if (ec) throw std::invalid_argument("cannot read the folder " + path.string() + ": " + ec.message());
  std::sort(files.begin(), files.end());
  if (files.empty() && fs::exists(path / "metadata.json", ec)) {
    throw std::invalid_argument(path.string() + " is a spmdx checkpoint, not safetensors: write one with `spmdx export " + path.string() +
                                " weights.safetensors`, or copy the folder under <job.dump_folder>/<checkpoint.folder>/ to resume from it");
  }
  if (files.empty() && fs::exists(path / ".metadata", ec)) {
    throw std::invalid_argument(path.string() + " is a torch.distributed.checkpoint folder (torchtitan's), not safetensors: save it with torchtitan's "
                                "checkpoint.last_save_in_hf = true, or convert it with torch.distributed.checkpoint.format_utils, first");
  }
  if (files.empty()) throw std::invalid_argument(path.string() + " is a folder with no .safetensors file in it");
  return files;
}

}  // namespace

std::size_t safetensors_dtype_size(const std::string& dtype) {
  static const std::map<std::string, std::size_t> sizes{{"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8}, {"I32", 4}, {"I16", 2},
                                                        {"I8", 1},  {"U8", 1},  {"U16", 2}, {"U32", 4},  {"U64", 8}, {"BOOL", 1}};
  const auto it = sizes.find(dtype);
  return it == sizes.end() ? 0 : it->second;
}

std::vector<SafetensorsTensor> read_safetensors_header(const fs::path& file) {
  if (const std::string why = unreadable_file(file); !why.empty()) throw std::runtime_error("cannot open " + file.string() + ": " + why);  // a FIFO would block
  std::ifstream in(file, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + file.string() + ": " + std::strerror(errno));
  in.seekg(0, std::ios::end);
  const auto size = static_cast<std::uint64_t>(in.tellg());
  in.seekg(0);
  if (size < 8) bad_file(file, std::to_string(size) + " bytes, shorter than the 8-byte header length: not a safetensors file");
  unsigned char len_bytes[8];
  in.read(reinterpret_cast<char*>(len_bytes), 8);
  std::uint64_t len = 0;
  for (int i = 7; i >= 0; --i) len = len << 8 | len_bytes[i];  // little-endian
  if (len > 100'000'000 || len > size - 8) {
    bad_file(file, "its header length " + std::to_string(len) + " is past the file's " + std::to_string(size) +
                       " bytes or the format's 100 MB: not a safetensors file, or a truncated one");
  }
  std::string text(static_cast<std::size_t>(len), '\0');
  in.read(text.data(), static_cast<std::streamsize>(len));
  // A name given twice would load the bytes of whichever came last: refused, as the format is.
  std::set<std::string> names;
  std::string twice;
  const json::parser_callback_t unique_names = [&](int depth, json::parse_event_t event, json& parsed) {
    if (event == json::parse_event_t::key && depth == 1 && !names.insert(parsed.get<std::string>()).second && twice.empty()) twice = parsed.get<std::string>();
    return true;
  };
  json header;
  try {
    check_json_nesting(text);
    header = json::parse(text, unique_names);
  } catch (const std::exception& e) {
    bad_file(file, std::string("its header is not JSON (not a safetensors file?): ") + e.what());
  }
  if (!twice.empty()) bad_file(file, "its header names tensor '" + twice + "' twice");
  if (!header.is_object()) bad_file(file, "its header is not a JSON object");
  const std::uint64_t data_begin = 8 + len, data_size = size - data_begin;
  std::vector<SafetensorsTensor> out;
  for (const auto& [name, t] : header.items()) {
    if (name == "__metadata__") continue;
    auto bad = [&](const std::string& why) { bad_file(file, "tensor '" + name + "': " + why); };
    if (!t.is_object() || !t.contains("dtype") || !t.contains("shape") || !t.contains("data_offsets")) bad("needs dtype, shape and data_offsets");
    SafetensorsTensor s;
    s.name = name;
    if (!t["dtype"].is_string() || safetensors_dtype_size(s.dtype = t["dtype"].get<std::string>()) == 0) bad("unknown dtype " + t["dtype"].dump());
    if (!t["shape"].is_array()) bad("shape is not a list");
    std::uint64_t bytes = safetensors_dtype_size(s.dtype);
    for (const auto& d : t["shape"]) {
      if (!d.is_number_unsigned() || d.get<std::uint64_t>() > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) ||
          __builtin_mul_overflow(bytes, d.get<std::uint64_t>(), &bytes)) {
        bad("shape " + t["shape"].dump() + " is not a list of sizes that fit in 64 bits");
      }
      s.shape.push_back(d.get<std::int64_t>());
    }
    const auto& off = t["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned()) bad("data_offsets is not [begin, end]");
    const std::uint64_t begin = off[0].get<std::uint64_t>(), end = off[1].get<std::uint64_t>();
    if (begin > end) bad("data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) + ") end before they begin");
    if (end > data_size) {
      bad("data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) + ") lie outside the " + std::to_string(data_size) + " bytes of data");
    }
    if (end - begin != bytes) {
      bad(std::to_string(end - begin) + " bytes of data for " + s.dtype + " " + ir::shape_str(s.shape) + ", which needs " + std::to_string(bytes));
    }
    s.offset = data_begin + begin;
    s.nbytes = end - begin;
    out.push_back(std::move(s));
  }
  // The tensors tile the data exactly, as the format requires: no two share bytes (one would
  // load the other's), none is missing between them, nothing follows the last.
  std::vector<const SafetensorsTensor*> by_offset;
  for (const auto& t : out) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(), [](const auto* a, const auto* b) { return a->offset < b->offset || (a->offset == b->offset && a->nbytes < b->nbytes); });
  std::uint64_t at = data_begin;
  for (const auto* t : by_offset) {
    if (t->offset != at) {
      bad_file(file, "tensor '" + t->name + "' starts at data byte " + std::to_string(t->offset - data_begin) + ", where " +
                         (t->offset < at ? "the tensor before it still lies (overlapping data_offsets)" : "byte " + std::to_string(at - data_begin) + " was expected (a gap)"));
    }
    at += t->nbytes;
  }
  if (at != size) bad_file(file, std::to_string(size - at) + " bytes follow the last tensor's data: truncated header, or something appended");
  return out;
}

std::string hf_name(const std::string& name) { return translate(name, true); }

std::string from_hf_name(const std::string& hf) { return translate(hf, false); }

std::int64_t rotary_heads(const std::string& name, const ModelArgs& args) {
  if (args.name != "llama") return 0;
  std::string index;
  if (match("layers.{}.attention.wq.weight", name, &index)) return args.n_heads;
  return match("layers.{}.attention.wk.weight", name, &index) ? (args.n_kv_heads > 0 ? args.n_kv_heads : args.n_heads) : 0;
}

WeightLoad plan_weight_load(const fs::path& path, const Model& model) {
  WeightLoad load;
  std::vector<std::pair<fs::path, SafetensorsTensor>> found;
  const auto files = safetensors_files(path);
  load.files = files.size();
  for (const auto& f : files) {
    for (auto& t : read_safetensors_header(f)) found.emplace_back(f, std::move(t));
  }
  // Hugging Face's names are told by their prefixes, and only mean anything for the built-in llama
  // (an exported program's own names may be Hugging Face's, and are then the model's names).
  const bool llama = model.args.name == "llama";
  load.hf_names = llama && std::any_of(found.begin(), found.end(), [](const auto& f) {
                    return f.second.name.rfind("model.", 0) == 0 || f.second.name == "lm_head.weight";
                  });
  std::set<std::string> buffers, params(model.params.begin(), model.params.end());
  for (const auto& init : model.init) {
    if (!init.trainable) buffers.insert(init.name);
  }
  std::vector<std::string> problems;
  std::set<std::string> seen;  // parameters the files hold, loadable or not: not also "missing"
  std::vector<std::string> spmdx_named;  // spmdx's names among Hugging Face's
  const std::string label = model_label(model.args);
  for (auto& [file, t] : found) {
    const std::string where = files.size() > 1 ? " (in " + file.filename().string() + ")" : "";
    std::string name = t.name;
    if (load.hf_names) {
      if (is_hf_rotary_buffer(t.name)) {
        load.ignored.push_back(t.name);
        continue;
      }
      name = from_hf_name(t.name);
      if (name.empty() && buffers.count(t.name) > 0) {  // made from the config, whatever the names
        load.ignored.push_back(t.name);
        continue;
      }
      if (name.empty() && params.count(t.name) > 0) {
        spmdx_named.push_back(t.name);
        continue;
      }
      if (name.empty()) {
        problems.push_back("extra tensor '" + t.name + "'" + where + ": not a Hugging Face Llama parameter (the file's names are Hugging Face's)");
        continue;
      }
    }
    if (buffers.count(name) > 0) {
      load.ignored.push_back(t.name);
      continue;
    }
    if (params.count(name) == 0) {
      problems.push_back("extra tensor '" + t.name + "'" + where + ": " + label + " has no such parameter");
      continue;
    }
    seen.insert(name);
    const ir::TensorMeta& meta = model.graph.find_input(name)->meta();
    const std::string shown = load.hf_names ? "'" + t.name + "' (" + name + ")" : "'" + name + "'";
    if (t.shape != meta.shape) {
      problems.push_back("tensor " + shown + where + " is " + ir::shape_str(t.shape) + ", but " + label + " needs " + ir::shape_str(meta.shape));
      continue;
    }
    if (t.dtype != "F32" && t.dtype != "BF16" && t.dtype != "F16" && t.dtype != "F64") {
      problems.push_back("tensor " + shown + where + " is " + t.dtype + ": parameters load from floating-point tensors (F32, BF16, F16, F64)");
      continue;
    }
    if (const auto it = load.params.find(name); it != load.params.end()) {
      problems.push_back("tensor " + shown + " is in both " + it->second.file.filename().string() + " and " + file.filename().string());
      continue;
    }
    load.params[name] = {file, t, load.hf_names ? rotary_heads(name, model.args) : 0};
  }
  if (!spmdx_named.empty()) {  // one problem, not a missing and an extra tensor for each
    const auto hf = std::find_if(found.begin(), found.end(), [](const auto& f) { return f.second.name.rfind("model.", 0) == 0 || f.second.name == "lm_head.weight"; });
    problems.insert(problems.begin(), "the files mix spmdx's names (" + std::to_string(spmdx_named.size()) + ", e.g. '" + spmdx_named.front() +
                                          "') with Hugging Face's (e.g. '" + hf->second.name + "'): use one or the other");
    for (const auto& n : spmdx_named) seen.insert(n);
  }
  for (const auto& p : model.params) {
    if (seen.count(p) > 0) continue;
    const std::string hf = load.hf_names ? hf_name(p) : "";
    problems.push_back("missing tensor '" + (load.hf_names ? hf + "' (" + p + ")" : p + "'") + ": " + label + " needs it");
  }
  if (!problems.empty()) {
    // A line per problem (at most 12, the last saying how many more), the first saying what the
    // files must hold.
    constexpr std::size_t kShown = 12;
    problems.front() += " (the files must hold every parameter of " + label + " with its shape, and nothing else, under " +
                        (load.hf_names ? "Hugging Face's names, as spmdx export --names hf writes them)" : "spmdx's names, as spmdx export writes them)");
    std::string text;
    for (std::size_t i = 0; i < std::min(problems.size(), kShown); ++i) text += (i ? "\n" : "") + path.string() + ": " + problems[i];
    if (problems.size() > kShown) text += "; and " + std::to_string(problems.size() - kShown) + " more problems like these";
    throw std::invalid_argument(text);
  }
  return load;
}

}  // namespace spmdx::models
