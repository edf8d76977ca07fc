#include "spmdx/exec/checkpoint.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <unistd.h>

#include <boost/crc.hpp>
#include <cmath>
#include <cstring>
#include <fstream>
#include <set>
#include <string_view>
#include <nlohmann/json.hpp>

#include "spmdx/files.h"
#include "spmdx/core/log.h"
#include "spmdx/exec/kernels.h"
#include "spmdx/exec/shards.h"
#include "spmdx/sharding/spec.h"
#include "spmdx/train/checkpoint_folder.h"
#include "spmdx/text.h"

namespace spmdx::exec {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr char kMagic[8] = {'S', 'P', 'M', 'D', 'X', 'C', 'K', '1'};

std::uint32_t crc32(const void* data, std::size_t n) {
  boost::crc_32_type crc;
  crc.process_bytes(data, n);
  return crc.checksum();
}

[[noreturn]] void fail(const fs::path& file, const std::string& why) {
  throw std::runtime_error("checkpoint file " + file.string() + ": " + why);
}

void write_file(const fs::path& file, const std::string& bytes) {
  {
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    out.flush();
    if (!out) fail(file, std::string("cannot write: ") + std::strerror(errno));
  }
  fsync_path(file);
}

std::string read_file(const fs::path& file) {
  try {
    return read_file_bytes(file);  // a folder, FIFO or device is said, not read (a FIFO would block)
  } catch (const std::runtime_error& e) {
    fail(file, std::string("cannot read: ") + e.what());
  }
}

// `where`: each tensor's offset in its global tensor, per dim (as torch.distributed.checkpoint's
// chunk offsets), so that a load can tell placements that do not describe the file.
std::string encode(const TensorMap& tensors, const std::map<std::string, std::vector<std::int64_t>>& where) {
  json header{{"tensors", json::array()}};
  std::string data;
  for (const auto& [name, t0] : tensors) {
    const at::Tensor t = t0.to(at::kCPU).contiguous();  // a GPU tensor is copied to the host
    const auto bytes = static_cast<std::size_t>(t.nbytes());
    header["tensors"].push_back({{"name", name},
                                 {"dtype", ir::to_string(from_aten(t.scalar_type()))},
                                 {"shape", t.sizes().vec()},
                                 {"global_offset", where.at(name)},
                                 {"offset", data.size()},
                                 {"bytes", bytes},
                                 {"crc32", crc32(t.data_ptr(), bytes)}});
    data.append(static_cast<const char*>(t.data_ptr()), bytes);
  }
  const std::string h = header.dump();
  const std::uint64_t n = h.size();
  std::string out(kMagic, 8);
  out.append(reinterpret_cast<const char*>(&n), 8);
  return out + h + data;
}

// The shard file's header: the JSON between the 16-byte preamble and the data, as bytes.
struct ShardFile {
  std::string bytes;
  std::size_t header_begin = 16, header_end = 16;  // [begin, end) of the JSON header
};

// The JSON header's length, from a shard file's 16-byte preamble (the magic, then the length as
// a little-endian uint64), checked against `file_size`.
std::uint64_t header_length(const fs::path& file, std::string_view preamble, std::uint64_t file_size) {
  if (preamble.size() < 16 || file_size < 16 || std::memcmp(preamble.data(), kMagic, 8) != 0) fail(file, "not a spmdx checkpoint shard (bad magic)");
  std::uint64_t n = 0;
  std::memcpy(&n, preamble.data() + 8, 8);
  if (n > file_size - 16) {
    fail(file, "truncated or corrupted: its header length says " + std::to_string(n) + " bytes, the file holds " + std::to_string(file_size - 16) + " after the preamble");
  }
  return n;
}

ShardFile read_shard(const fs::path& file) {
  ShardFile f{read_file(file)};
  f.header_end = 16 + static_cast<std::size_t>(header_length(file, f.bytes, f.bytes.size()));
  return f;
}

std::uint32_t header_crc(const ShardFile& f) { return crc32(f.bytes.data() + f.header_begin, f.header_end - f.header_begin); }

// Every tensor of a shard file, each checked: header fields typed and in range, data inside the
// file, shape and dtype matching the byte count (before anything is allocated), CRC-32.
struct Decoded {
  TensorMap tensors;
  std::map<std::string, std::vector<std::int64_t>> global_offset;  // where the header says so
};

Decoded decode(const fs::path& file, const ShardFile& f) {
  json header;
  try {
    const std::string text = f.bytes.substr(f.header_begin, f.header_end - f.header_begin);
    check_json_nesting(text);
    header = json::parse(text);
  } catch (const std::exception& e) {
    fail(file, std::string("corrupted header: ") + e.what());
  }
  if (!header.is_object() || !header.contains("tensors") || !header["tensors"].is_array()) fail(file, "corrupted header: no \"tensors\" list");
  const std::size_t base = f.header_end, size_of_data = f.bytes.size() - base;
  Decoded decoded;
  TensorMap& out = decoded.tensors;
  std::size_t i = 0;
  for (const auto& t : header["tensors"]) {
    const std::string at = "header tensor #" + std::to_string(i++);
    auto unsigned_field = [&](const char* key) -> std::uint64_t {
      if (!t.is_object() || !t.contains(key) || !t[key].is_number_unsigned()) fail(file, at + ": \"" + key + "\" must be a whole number >= 0");
      return t[key].get<std::uint64_t>();
    };
    if (!t.is_object() || !t.contains("name") || !t["name"].is_string()) fail(file, at + ": \"name\" must be a string");
    const auto name = t["name"].get<std::string>();
    const std::uint64_t offset = unsigned_field("offset"), size = unsigned_field("bytes"), crc = unsigned_field("crc32");
    if (offset > size_of_data || size > size_of_data - offset) fail(file, "truncated: tensor '" + name + "' ends past the end of the file");
    if (!t.contains("dtype") || !t["dtype"].is_string()) fail(file, "tensor '" + name + "': \"dtype\" must be a string");
    const auto dtype = ir::parse_dtype(t["dtype"].get<std::string>());
    if (!dtype) fail(file, "tensor '" + name + "': unknown dtype '" + t["dtype"].get<std::string>() + "'");
    if (!t.contains("shape") || !t["shape"].is_array() || t["shape"].size() > 16) fail(file, "tensor '" + name + "': \"shape\" must be a list of at most 16 sizes");
    std::vector<std::int64_t> shape;
    std::uint64_t numel = 1;
    for (const auto& d : t["shape"]) {
      if (!d.is_number_unsigned() || d.get<std::uint64_t>() > (std::uint64_t{1} << 40)) fail(file, "tensor '" + name + "': a size in \"shape\" is not a whole number in [0, 2^40]");
      const std::uint64_t x = d.get<std::uint64_t>();
      if (x != 0 && numel > (std::uint64_t{1} << 50) / x) fail(file, "tensor '" + name + "': \"shape\" holds more than 2^50 elements");
      numel *= x;
      shape.push_back(static_cast<std::int64_t>(x));
    }
    if (numel * ir::element_size(*dtype) != size) {
      fail(file, "tensor '" + name + "' is " + ir::to_string(*dtype) + ir::shape_str(shape) + " but holds " + std::to_string(size) + " bytes");
    }
    const char* p = f.bytes.data() + base + offset;
    if (crc32(p, size) != crc) fail(file, "corrupted: tensor '" + name + "' fails its checksum");
    if (out.count(name)) fail(file, "tensor '" + name + "' appears twice");
    if (t.contains("global_offset")) {
      const json& g = t["global_offset"];
      std::vector<std::int64_t> where;
      for (const auto& d : g.is_array() ? g : json::array()) {
        if (!d.is_number_unsigned() || d.get<std::uint64_t>() > (std::uint64_t{1} << 40)) break;
        where.push_back(d.get<std::int64_t>());
      }
      if (!g.is_array() || where.size() != shape.size()) fail(file, "tensor '" + name + "': \"global_offset\" must be one whole number >= 0 per dim");
      decoded.global_offset[name] = where;
    }
    at::Tensor x = at::empty(shape, at::TensorOptions().dtype(to_aten(*dtype)));
    std::memcpy(x.data_ptr(), p, size);
    out[name] = x;
  }
  return decoded;
}

std::string placements_text(const sharding::Placements& p) { return to_string(p); }

// "S(0)RP(sum)" -> {Shard(0), Replicate, Partial(sum)}.
sharding::Placements parse_placements(const std::string& text, const fs::path& file) {
  auto placements = sharding::parse_placements(text);
  if (!placements) fail(file, "bad placements '" + text + "'");
  return *placements;
}

constexpr int kMetadataVersion = 2;  // 2: metadata.json has its own crc32 and each shard file's size and header CRC
constexpr int kPipelineVersion = 3;  // 3: pipeline stages (written only with them, so that builds before them refuse it by version)
const char* const kReadableVersions = "1, 2, 3";

// The checksum of metadata.json: CRC-32 of its compact JSON (keys sorted) without "crc32".
std::uint32_t metadata_crc(json m) {
  m.erase("crc32");
  const std::string text = m.dump();
  return crc32(text.data(), text.size());
}

// A shard file's size and the CRC-32 of its header (which holds every tensor's CRC-32), read
// from its first bytes only.
std::pair<std::uint64_t, std::uint32_t> shard_signature(const fs::path& file) {
  std::error_code ec;
  if (!fs::is_regular_file(file, ec)) fail(file, "is not a regular file");
  std::ifstream in(file, std::ios::binary);
  char pre[16];
  in.read(pre, 16);
  const std::uint64_t size = fs::file_size(file);
  const std::uint64_t n = header_length(file, std::string_view(pre, static_cast<std::size_t>(in.gcount())), size);
  std::string header(static_cast<std::size_t>(n), '\0');
  if (!in.read(header.data(), static_cast<std::streamsize>(n))) fail(file, "truncated header");
  return {size, crc32(header.data(), header.size())};
}

struct SavedTensor {
  std::vector<std::int64_t> shape;
  ir::DType dtype = ir::DType::f32;
  sharding::Placements placements;
  int stage = 0;  // v3: the pipeline stage whose ranks hold it
  ir::TensorMeta meta() const { return {shape, dtype}; }
};

struct Metadata {
  int version = 0;
  CheckpointMeta meta;
  std::vector<MeshDim> mesh;  // one stage's, with pipeline stages
  std::int64_t stages = 1;     // v3: pipeline.stages
  std::map<std::string, SavedTensor> tensors;
  std::vector<std::pair<std::uint64_t, std::uint32_t>> files;  // v2: per rank, bytes and header CRC-32
};

// Reads metadata.json field by field, each error naming the file and the key.
class MetadataReader {
 public:
  explicit MetadataReader(const fs::path& dir) : dir_(dir), mfile_(dir / "metadata.json") {
    const std::string text = read_file(mfile_);
    try {
      check_json_nesting(text);
      m_ = json::parse(text);
    } catch (const std::exception& e) {
      fail(mfile_, std::string("corrupted (not JSON): ") + e.what());
    }
    if (!m_.is_object()) fail(mfile_, "corrupted: not a JSON object");
    if (m_.value("format", json()) != "spmdx.checkpoint") fail(mfile_, "not a spmdx checkpoint (no \"format\": \"spmdx.checkpoint\")");
  }

  Metadata read() const {
    Metadata md;
    md.version = read_version();
    read_progress(md.meta);
    if (md.version >= kPipelineVersion) md.stages = integer(field(field(m_, "pipeline", "pipeline"), "stages", "pipeline.stages"), "pipeline.stages", 1, 1'000'000);
    const std::int64_t world = read_mesh(md.mesh, md.stages);
    check_shard_files(world);
    if (md.version >= 2) md.files = read_file_list(world);
    const json& tensors = field(m_, "tensors", "tensors");
    if (!tensors.is_object()) bad("tensors", "must be an object of name -> {shape, dtype, placements}");
    for (const auto& [name, t] : tensors.items()) {
      md.tensors[name] = read_tensor("tensors." + name, t, md.mesh.size());
      if (md.version >= kPipelineVersion) md.tensors[name].stage = static_cast<int>(integer(field(t, "stage", "tensors." + name + ".stage"), "tensors." + name + ".stage", 0, md.stages - 1));
    }
    return md;
  }

 private:
  [[noreturn]] void bad(const std::string& key, const std::string& why) const { fail(mfile_, "key '" + key + "' " + why); }

  std::int64_t integer(const json& v, const std::string& key, std::int64_t lo, std::int64_t hi) const {
    if (!v.is_number_integer()) bad(key, "must be a whole number, is " + std::string(v.type_name()) + " " + v.dump());
    if (v.is_number_unsigned() ? v.get<std::uint64_t>() > static_cast<std::uint64_t>(hi) : (v.get<std::int64_t>() < lo || v.get<std::int64_t>() > hi)) {
      bad(key, "must be between " + std::to_string(lo) + " and " + std::to_string(hi) + ", is " + v.dump());
    }
    return v.get<std::int64_t>();
  }

  const json& field(const json& obj, const std::string& name, const std::string& key) const {
    if (!obj.is_object() || !obj.contains(name)) bad(key, "is missing");
    return obj.at(name);
  }

  // A version this build reads, and (from version 2) the file's own checksum.
  int read_version() const {
    const int version = static_cast<int>(m_.contains("version") && m_["version"].is_number_integer() ? m_["version"].get<std::int64_t>() : -1);
    if (version < 1 || version > kPipelineVersion) {
      bad("version", "is " + (m_.contains("version") ? m_["version"].dump() : std::string("missing")) + ": this build reads versions " + kReadableVersions +
                         " (a newer spmdx wrote it? use that one)");
    }
    if (m_.contains("crc32") || version >= 2) {
      const json& c = field(m_, "crc32", "crc32");
      if (!c.is_number_unsigned() || c.get<std::uint64_t>() != metadata_crc(m_)) {
        fail(mfile_, "fails its checksum (key 'crc32'): it was edited or corrupted after the checkpoint was written; restore it, or resume from another step");
      }
    }
    return version;
  }

  // The step, the samples the data had given, and the tokenizer.
  void read_progress(CheckpointMeta& meta) const {
    meta.step = integer(field(m_, "step", "step"), "step", 1, 1'000'000'000);
    const std::string folder = dir_.filename().string();
    if (folder.rfind("step-", 0) == 0 && folder != "step-" + std::to_string(meta.step)) {
      bad("step", "is " + std::to_string(meta.step) + " but the checkpoint is in folder " + folder);
    }
    const json& samples = field(m_, "data_samples", "data_samples");
    // Every step takes at least one sample and at most training.global_batch_size's largest (1e7).
    const std::int64_t most = meta.step * 10'000'000;
    meta.data_samples = static_cast<std::uint64_t>(integer(samples, "data_samples", meta.step, most));
    if (m_.contains("tokenizer")) {
      if (!m_["tokenizer"].is_string()) bad("tokenizer", "must be a string");
      meta.tokenizer = m_["tokenizer"].get<std::string>();
    }
    if (m_.contains("optimizer_steps")) meta.optimizer_steps = integer(m_["optimizer_steps"], "optimizer_steps", 0, meta.step);
    if (m_.contains("grad_scaler")) {  // float16's loss scale
      const json& g = m_["grad_scaler"];
      if (!g.is_object()) bad("grad_scaler", "must be an object {scale, growth_tracker}, is " + g.dump());
      const json& scale = field(g, "scale", "grad_scaler.scale");
      // A scale float32 can hold, as a normal number (GradScaler keeps it as a float32 tensor).
      if (!scale.is_number() || !(scale.get<double>() >= 1.2e-38 && scale.get<double>() <= 3.4e38)) {
        bad("grad_scaler.scale", "must be a number between 1.2e-38 and 3.4e38 (float32's normal range), is " + scale.dump());
      }
      meta.loss_scale = scale.get<double>();
      meta.growth_tracker = integer(field(g, "growth_tracker", "grad_scaler.growth_tracker"), "grad_scaler.growth_tracker", 0, 1'000'000'000);
    }
    if (m_.contains("lr_schedule")) meta.lr_schedule = read_schedule(m_["lr_schedule"]);
  }

  // lr_schedule {steps, warmup_steps, decay_ratio, decay_type, min_lr_factor}: train::LrSchedule.
  train::LrSchedule read_schedule(const json& s) const {
    if (!s.is_object()) bad("lr_schedule", "must be an object {steps, warmup_steps, decay_ratio, decay_type, min_lr_factor}, is " + s.dump());
    train::LrSchedule out;
    out.steps = integer(field(s, "steps", "lr_schedule.steps"), "lr_schedule.steps", 1, 1'000'000'000);
    out.warmup_steps = integer(field(s, "warmup_steps", "lr_schedule.warmup_steps"), "lr_schedule.warmup_steps", 0, 1'000'000'000);
    const json& ratio = field(s, "decay_ratio", "lr_schedule.decay_ratio");
    if (!ratio.is_number() || !(ratio.get<double>() == -1 || (ratio.get<double>() >= 0 && ratio.get<double>() <= 1))) {
      bad("lr_schedule.decay_ratio", "must be a number between 0 and 1, or -1, is " + ratio.dump());
    }
    out.decay_ratio = ratio.get<double>();
    const json& type = field(s, "decay_type", "lr_schedule.decay_type");
    if (!type.is_string() || (type != "linear" && type != "sqrt" && type != "cosine")) bad("lr_schedule.decay_type", "must be \"linear\", \"sqrt\" or \"cosine\", is " + type.dump());
    out.decay_type = type.get<std::string>();
    const json& floor = field(s, "min_lr_factor", "lr_schedule.min_lr_factor");
    if (!floor.is_number() || !(floor.get<double>() >= 0 && floor.get<double>() <= 1)) bad("lr_schedule.min_lr_factor", "must be a number between 0 and 1, is " + floor.dump());
    out.min_lr_factor = floor.get<double>();
    return out;
  }

  // The mesh's dims, whose sizes (x the pipeline's stages) multiply to the world size it returns.
  std::int64_t read_mesh(std::vector<MeshDim>& dims, std::int64_t stages) const {
    const std::int64_t world = integer(field(m_, "world_size", "world_size"), "world_size", 1, 100'000'000);
    const json& mesh = field(m_, "mesh", "mesh");
    if (!mesh.is_array() || mesh.empty() || mesh.size() > 8) bad("mesh", "must be a list of 1 to 8 {name, size} dims");
    std::int64_t product = 1;
    std::set<std::string> names;
    for (std::size_t i = 0; i < mesh.size(); ++i) {
      const std::string key = "mesh[" + std::to_string(i) + "]";
      const json& n = field(mesh[i], "name", key + ".name");
      if (!n.is_string() || n.get<std::string>().empty() || !names.insert(n.get<std::string>()).second) bad(key + ".name", "must be a name not used by another dim");
      const std::int64_t size = integer(field(mesh[i], "size", key + ".size"), key + ".size", 1, 100'000'000);
      product *= size;
      if (product > 100'000'000) bad("mesh", "has more than 1e8 ranks");
      dims.push_back({n.get<std::string>(), size});
    }
    if (product * stages != world) {
      bad("world_size", "is " + std::to_string(world) + " but the mesh's sizes multiply to " + std::to_string(product) +
                            (stages > 1 ? " x " + std::to_string(stages) + " pipeline stages" : std::string()));
    }
    return world;
  }

  // The shard files: exactly rank0.bin .. rank<world-1>.bin.
  void check_shard_files(std::int64_t world) const {
    std::set<std::int64_t> present;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(dir_, ec)) {
      const std::string n = e.path().filename().string();
      if (n.size() < 9 || n.rfind("rank", 0) != 0 || n.substr(n.size() - 4) != ".bin") continue;
      const std::string digits = n.substr(4, n.size() - 8);
      if (digits.empty() || digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos) continue;
      present.insert(std::stoll(digits));
    }
    for (std::int64_t r = 0; r < world; ++r) {
      if (!present.count(r)) bad("world_size", "is " + std::to_string(world) + " but rank" + std::to_string(r) + ".bin is missing from " + dir_.string());
    }
    if (!present.empty() && *present.rbegin() >= world) {
      bad("world_size", "is " + std::to_string(world) + " but rank" + std::to_string(*present.rbegin()) + ".bin is there too: files of another save mixed in?");
    }
  }

  // Version 2: each shard file's size (checked against the file) and header CRC-32, by rank.
  std::vector<std::pair<std::uint64_t, std::uint32_t>> read_file_list(std::int64_t world) const {
    std::vector<std::pair<std::uint64_t, std::uint32_t>> out;
    std::error_code ec;
    const json& files = field(m_, "files", "files");
    if (!files.is_object() || files.size() != static_cast<std::size_t>(world)) bad("files", "must list the " + std::to_string(world) + " shard files");
    for (std::int64_t r = 0; r < world; ++r) {
      const std::string name = "rank" + std::to_string(r) + ".bin", key = "files." + name;
      const json& f = field(files, name, key);
      const auto bytes = static_cast<std::uint64_t>(integer(field(f, "bytes", key + ".bytes"), key + ".bytes", 16, INT64_MAX));
      const auto crc = static_cast<std::uint32_t>(integer(field(f, "header_crc32", key + ".header_crc32"), key + ".header_crc32", 0, UINT32_MAX));
      if (!fs::is_regular_file(dir_ / name, ec)) fail(dir_ / name, "is not a regular file (a folder, FIFO or device): a checkpoint holds files");
      const std::uint64_t actual = fs::file_size(dir_ / name, ec);
      if (ec || actual != bytes) fail(dir_ / name, "is " + std::to_string(actual) + " bytes, metadata.json says " + std::to_string(bytes) + ": truncated, or from another save");
      out.emplace_back(bytes, crc);
    }
    return out;
  }

  // tensors.<name>: its shape, dtype and placements on a mesh of `mesh_dims` dims.
  SavedTensor read_tensor(const std::string& key, const json& t, std::size_t mesh_dims) const {
    SavedTensor st;
    const json& shape = field(t, "shape", key + ".shape");
    if (!shape.is_array() || shape.size() > 16) bad(key + ".shape", "must be a list of at most 16 sizes");
    for (std::size_t d = 0; d < shape.size(); ++d) st.shape.push_back(integer(shape[d], key + ".shape[" + std::to_string(d) + "]", 0, std::int64_t{1} << 40));
    const json& dtype = field(t, "dtype", key + ".dtype");
    const auto parsed = dtype.is_string() ? ir::parse_dtype(dtype.get<std::string>()) : std::nullopt;
    if (!parsed) bad(key + ".dtype", "is " + dtype.dump() + ", not a dtype (f32, f64, f16, bf16, i32, i64, u8, bool)");
    st.dtype = *parsed;
    const json& pl = field(t, "placements", key + ".placements");
    if (!pl.is_string()) bad(key + ".placements", "must be a string such as \"S(0)R\"");
    try {
      st.placements = parse_placements(pl.get<std::string>(), mfile_);
    } catch (const std::runtime_error&) {
      bad(key + ".placements", "is " + pl.dump() + ": expected one placement per mesh dim, written R, S(<dim>) or P(<op>), e.g. \"S(0)R\"");
    }
    if (st.placements.size() != mesh_dims) {
      bad(key + ".placements", "'" + pl.get<std::string>() + "' has " + std::to_string(st.placements.size()) + " placements for a mesh of " + std::to_string(mesh_dims) + " dims");
    }
    for (const auto& p : st.placements) {
      if (p.is_shard() && (p.dim() < 0 || static_cast<std::size_t>(p.dim()) >= st.shape.size())) {
        bad(key + ".placements", "'" + pl.get<std::string>() + "' shards dim " + std::to_string(p.dim()) + " of a tensor with " + std::to_string(st.shape.size()) + " dims");
      }
    }
    return st;
  }

  const fs::path dir_;  // the step-N folder
  const fs::path mfile_;
  json m_;
};

// metadata.json, checked like data: its own checksum, a version this build reads, and every
// field's type and range, each error naming the file and the key. `dir` is the step-N folder.
Metadata read_metadata(const fs::path& dir) { return MetadataReader(dir).read(); }

// Decodes rank `r`'s shard file and checks it against the metadata: the header's CRC-32 (v2),
// and every tensor of its stage: dtype and shape against what the placements say rank r holds.
TensorMap load_shard(const fs::path& dir, std::int64_t r, const Metadata& md, const sharding::DeviceMesh& saved) {
  const fs::path file = dir / ("rank" + std::to_string(r) + ".bin");
  const ShardFile f = read_shard(file);
  if (!md.files.empty() && header_crc(f) != md.files.at(static_cast<std::size_t>(r)).second) {
    fail(file, "its header does not match metadata.json (files.rank" + std::to_string(r) + ".bin.header_crc32): a shard of another save, or corrupted");
  }
  Decoded d = decode(file, f);
  TensorMap& out = d.tensors;
  const auto coord = saved.coordinate(r % saved.size());
  for (const auto& [name, t] : md.tensors) {
    if (t.stage != r / saved.size()) continue;
    auto it = out.find(name);
    if (it == out.end()) fail(file, "has no tensor '" + name + "' (metadata.json lists it)");
    const sharding::ShardingSpec spec{t.placements, t.meta()};
    const auto want = spec.local_shape(saved, coord);
    if (it->second.sizes().vec() != want || from_aten(it->second.scalar_type()) != t.dtype) {
      fail(file, "tensor '" + name + "' is " + ir::to_string(from_aten(it->second.scalar_type())) + ir::shape_str(it->second.sizes().vec()) +
                     ", but metadata.json's " + to_string(t.placements) + " " + ir::to_string(t.dtype) + ir::shape_str(t.shape) + " gives rank " +
                     std::to_string(r) + " " + ir::shape_str(want));
    }
    if (auto w = d.global_offset.find(name); w != d.global_offset.end() && w->second != spec.local_offset(saved, coord)) {
      fail(file, "tensor '" + name + "' holds the block at " + ir::shape_str(w->second) + " of the global tensor, but metadata.json's placements " +
                     to_string(t.placements) + " put rank " + std::to_string(r) + "'s block at " + ir::shape_str(spec.local_offset(saved, coord)));
    }
  }
  return out;
}

// The first floating tensor of `tensors` holding NaN or an infinity, "" when none: one
// isfinite().all() reduction each, read back once for all (one sync on a GPU).
std::string first_non_finite(const TensorMap& tensors) {
  std::vector<std::string> names;
  std::vector<at::Tensor> finite;
  for (const auto& [name, t] : tensors) {
    if (!t.is_floating_point() || t.numel() == 0) continue;
    names.push_back(name);
    finite.push_back(at::isfinite(t).all());
  }
  if (finite.empty() || at::stack(finite).all().item<bool>()) return "";
  for (std::size_t i = 0; i < finite.size(); ++i) {
    if (!finite[i].item<bool>()) return names[i];
  }
  return "";
}

// "3 NaN or infinite values (of 4096)": only when one is known to be there.
std::string non_finite_count(const at::Tensor& t) {
  const auto bad = (~at::isfinite(t)).sum().item<std::int64_t>();
  return std::to_string(bad) + (bad == 1 ? " NaN or infinite value" : " NaN or infinite values") + " (of " + std::to_string(t.numel()) + ")";
}

// A loaded tensor that holds NaN or an infinity: refused, naming it, its file and the
// checkpoint, and the complete checkpoints before it to resume from instead.
void check_finite(const fs::path& file, const std::string& name, const at::Tensor& t) {
  if (!t.is_floating_point() || t.numel() == 0 || at::isfinite(t).all().item<bool>()) return;
  const fs::path dir = file.parent_path();
  const std::int64_t step = train::checkpoint_step(dir.filename().string()).value_or(0);
  std::string earlier;
  for (const auto& [s, path] : train::scan_checkpoints(dir.parent_path()).complete) {
    if (s < step) earlier = std::to_string(s);
  }
  fail(file, "tensor '" + name + "' holds " + non_finite_count(t) + ": the run that saved checkpoint " + dir.string() +
                 " had diverged, and resuming it would train on NaN. Resume from an earlier step (" +
                 (earlier.empty() ? std::string("none is complete in ") + dir.parent_path().string() : "checkpoint.load_step " + earlier + ", the newest before it") +
                 "), or move " + dir.string() + " away");
}

}  // namespace

fs::path save_checkpoint(const fs::path& folder, const CheckpointMeta& meta, const sharding::DeviceMesh& mesh, std::int64_t rank,
                         const TensorMap& local, const std::map<std::string, ir::TensorMeta>& global,
                         const std::map<std::string, sharding::Placements>& placements, CommBackend* backend, const PipelineStages& pipeline,
                         const SaveRoles* save_roles) {
  const SaveRoles roles = save_roles != nullptr ? *save_roles : SaveRoles{rank == 0, {}};
  const fs::path final_dir = folder / train::checkpoint_name(meta.step);
  const fs::path tmp = folder / ("." + train::checkpoint_name(meta.step) + ".partial");
  if (const std::string bad = first_non_finite(local); !bad.empty()) {  // before anything is written: the earlier checkpoints stay as they are
    const at::Tensor& t = local.at(bad);
    throw std::runtime_error("not saving checkpoint " + final_dir.string() + ": rank " + std::to_string(rank) + "'s tensor '" + bad + "' holds " +
                             non_finite_count(t) + ": training diverged at or before step " + std::to_string(meta.step) +
                             ", and a checkpoint of it could only resume the divergence. The earlier checkpoints in " + folder.string() +
                             " are kept: resume from the newest with checkpoint.enable true (with a lower optimizer.lr, or more lr_scheduler.warmup_steps)");
  }
  // A complete checkpoint of this step (an earlier run's, which went further) is never replaced:
  // every rank refuses before anything is written. Preflight refuses such a resume already
  // (train::newer_checkpoints_problem); this holds whoever calls.
  if (train::scan_checkpoints(folder).complete.count(meta.step) != 0) {
    throw std::runtime_error("not saving checkpoint " + final_dir.string() + ": a complete checkpoint of step " + std::to_string(meta.step) +
                             " is already there, from an earlier run, and spmdx never replaces one (it is kept as it was). Move it away to save "
                             "this run's, or resume from it with checkpoint.load_step " + std::to_string(meta.step));
  }
  if (roles.writes_metadata) {
    fs::remove_all(tmp);
    fs::create_directories(tmp);
  }
  if (backend) backend->barrier(0)->wait(600);
  fs::create_directories(tmp);
  std::vector<std::int64_t> writes{rank};
  writes.insert(writes.end(), roles.also_ranks.begin(), roles.also_ranks.end());
  for (const std::int64_t r : writes) {
    std::map<std::string, std::vector<std::int64_t>> where;
    for (const auto& [name, t] : local) where[name] = sharding::ShardingSpec{placements.at(name), global.at(name)}.local_offset(mesh, mesh.coordinate(r % mesh.size()));
    write_file(tmp / ("rank" + std::to_string(r) + ".bin"), encode(local, where));
  }
  if (backend) backend->barrier(0)->wait(600);  // every shard is on disk
  if (roles.writes_metadata) {
    const bool staged = pipeline.stages > 1;
    json m{{"format", "spmdx.checkpoint"}, {"version", staged ? kPipelineVersion : kMetadataVersion}, {"step", meta.step}, {"data_samples", meta.data_samples},
           {"tokenizer", meta.tokenizer}, {"world_size", mesh.size() * pipeline.stages}, {"mesh", json::array()}, {"tensors", json::object()},
           {"files", json::object()}};
    if (staged) m["pipeline"] = {{"stages", pipeline.stages}};
    if (meta.optimizer_steps >= 0) m["optimizer_steps"] = meta.optimizer_steps;
    if (meta.loss_scale > 0) m["grad_scaler"] = {{"scale", meta.loss_scale}, {"growth_tracker", meta.growth_tracker}};
    if (const auto& lr = meta.lr_schedule) {
      m["lr_schedule"] = {{"steps", lr->steps}, {"warmup_steps", lr->warmup_steps}, {"decay_ratio", lr->decay_ratio}, {"decay_type", lr->decay_type},
                          {"min_lr_factor", lr->min_lr_factor}};
    }
    for (const auto& d : mesh.dims()) m["mesh"].push_back({{"name", d.name}, {"size", d.size}});
    for (const auto& [name, g] : global) {
      m["tensors"][name] = {{"shape", g.shape}, {"dtype", ir::to_string(g.dtype)}, {"placements", placements_text(placements.at(name))}};
      if (staged) m["tensors"][name]["stage"] = pipeline.stage.at(name);
    }
    for (std::int64_t r = 0; r < mesh.size() * pipeline.stages; ++r) {  // ties the shard files to this save
      const std::string name = "rank" + std::to_string(r) + ".bin";
      const auto [bytes, crc] = shard_signature(tmp / name);
      m["files"][name] = {{"bytes", bytes}, {"header_crc32", crc}};
    }
    m["crc32"] = metadata_crc(m);
    write_file(tmp / "metadata.json", m.dump(1));
    fsync_path(tmp);
    fs::remove_all(final_dir);
    fs::rename(tmp, final_dir);  // the checkpoint exists only from here on
    fsync_path(folder);
  }
  if (backend) backend->barrier(0)->wait(600);
  return final_dir;
}

CheckpointMeta read_checkpoint_meta(const fs::path& folder, std::int64_t step) { return read_metadata(folder / train::checkpoint_name(step)).meta; }

std::optional<std::int64_t> find_checkpoint(const fs::path& folder, std::int64_t load_step, bool warn) {
  const train::CheckpointFolder found = train::scan_checkpoints(folder);
  if (warn) {
    for (const auto& p : found.ignored) {
      SPMDX_WARN(p.string() << " is not a checkpoint: spmdx writes step-<N> (N without sign, leading zero or suffix) and reads only those; ignored");
    }
  }
  if (const std::string why = train::resume_problem(folder, found, load_step); !why.empty()) throw std::runtime_error(why);
  if (load_step >= 0) return load_step;
  if (found.complete.empty()) return std::nullopt;
  const auto& [newest, dir] = *found.complete.rbegin();
  if (warn) {
    for (const auto& [step, broken] : found.broken) {
      // Saves appear whole (renamed into place once complete): a newer step folder that is not
      // was damaged afterwards. Skipped, but said.
      if (step > newest) SPMDX_WARN("checkpoint " << broken.first.string() << " " << broken.second << ": skipped; resuming from " << dir.string() << ", the newest complete one");
    }
  }
  return newest;
}

std::vector<fs::path> purge_checkpoints(const fs::path& folder, std::int64_t keep, std::int64_t saved) {
  std::vector<fs::path> deleted;
  if (keep <= 0) return deleted;
  std::vector<std::int64_t> ours;  // complete checkpoints spmdx wrote, oldest first
  for (const auto& [step, dir] : train::scan_checkpoints(folder).complete) {
    std::error_code ec;
    if (fs::is_symlink(fs::symlink_status(dir, ec))) continue;  // a link to a checkpoint elsewhere: not this run's to delete
    try {
      read_metadata(dir);  // its step is its folder's, its shard files are there
    } catch (const std::exception&) {
      continue;  // not a checkpoint as spmdx writes them: never deleted
    }
    ours.push_back(step);
  }
  for (std::size_t i = 0; i + static_cast<std::size_t>(keep) < ours.size(); ++i) {
    if (ours[i] == saved) continue;
    const fs::path dir = folder / train::checkpoint_name(ours[i]), doomed = folder / ("." + train::checkpoint_name(ours[i]) + ".deleting");
    try {
      fs::remove_all(doomed);
      fs::rename(dir, doomed);
      fs::remove_all(doomed);
    } catch (const fs::filesystem_error& e) {
      throw std::runtime_error("checkpoint.keep_latest_k " + std::to_string(keep) + ": cannot delete " + dir.string() + ": " + e.code().message());
    }
    deleted.push_back(dir);
  }
  if (!deleted.empty()) fsync_path(folder);
  return deleted;
}

TensorMap load_checkpoint(const fs::path& folder, std::int64_t step, const sharding::DeviceMesh& mesh, std::int64_t rank,
                          const std::map<std::string, ir::TensorMeta>& global,
                          const std::map<std::string, sharding::Placements>& placements, CheckpointMeta* meta,
                          const std::set<std::string>& not_loaded, const PipelineStages& pipeline) {
  const fs::path dir = folder / ("step-" + std::to_string(step));
  const fs::path mfile = dir / "metadata.json";
  const Metadata md = read_metadata(dir);
  const sharding::DeviceMesh saved(md.mesh);
  if (meta) *meta = md.meta;
  const int stage = static_cast<int>(rank / mesh.size());  // this rank's pipeline stage (0 without)
  bool same = saved.dims().size() == mesh.dims().size() && md.stages == pipeline.stages;
  for (std::size_t i = 0; same && i < mesh.dims().size(); ++i) {
    same = saved.dims()[i].name == mesh.dims()[i].name && saved.dims()[i].size == mesh.dims()[i].size;
  }
  for (const auto& [name, g] : global) {
    auto it = md.tensors.find(name);
    if (it == md.tensors.end()) fail(mfile, "has no tensor '" + name + "' (saved by another model?)");
    const SavedTensor& t = it->second;
    if (t.shape != g.shape || t.dtype != g.dtype) {
      fail(mfile, "tensor '" + name + "' was saved as " + ir::to_string(t.dtype) + ir::shape_str(t.shape) + ", this run has " + g.str());
    }
    same = same && placements_text(t.placements) == placements_text(placements.at(name)) && t.stage == stage;
  }
  std::vector<std::string> extra;
  for (const auto& [name, t] : md.tensors) {  // with pipeline stages in this run, another stage's tensors are not this rank's to load
    if (global.count(name) == 0 && not_loaded.count(name) == 0 && (pipeline.stages == 1 || pipeline.stage.count(name) == 0)) extra.push_back(name);
  }
  if (!extra.empty()) {
    fail(mfile, "holds " + std::to_string(extra.size()) + " tensor(s) this run's model has not, e.g. '" + extra.front() +
                    "' (saved by another model: a different model.flavor or model.n_layers?); resuming would drop them: run with the model "
                    "that saved it, or start a new job.dump_folder");
  }
  TensorMap out;
  const fs::path own = dir / ("rank" + std::to_string(rank) + ".bin");
  if (same) {  // the same layout: this rank's own file
    const TensorMap mine = load_shard(dir, rank, md, saved);
    for (const auto& [name, g] : global) check_finite(own, name, mine.at(name)), out[name] = mine.at(name);
    return out;
  }
  // Another mesh, strategy or pipeline: reassemble every tensor from the shards of the stage
  // that saved it, then reshard.
  std::map<std::int64_t, TensorMap> files;  // read once each, those of the stages holding `global`'s tensors
  const auto coord = mesh.coordinate(rank % mesh.size());
  for (const auto& [name, g] : global) {
    std::vector<at::Tensor> parts;
    const std::int64_t first = md.tensors.at(name).stage * saved.size();
    for (std::int64_t r = first; r < first + saved.size(); ++r) {
      if (files.count(r) == 0) files.emplace(r, load_shard(dir, r, md, saved));
      check_finite(dir / ("rank" + std::to_string(r) + ".bin"), name, files.at(r).at(name));
      parts.push_back(files.at(r).at(name));
    }
    const at::Tensor full = assemble_tensor(parts, md.tensors.at(name).placements, saved);
    out[name] = shard_tensor(full, placements.at(name), mesh, coord);
  }
  return out;
}

void write_safetensors(const fs::path& out, const TensorMap& tensors, const std::map<std::string, std::string>& metadata) {
  static const std::map<std::string, std::string> names{{"f32", "F32"}, {"f64", "F64"}, {"f16", "F16"}, {"bf16", "BF16"},
                                                        {"i32", "I32"}, {"i64", "I64"}, {"u8", "U8"}, {"bool", "BOOL"}};
  json header = json::object();
  header["__metadata__"] = json::object();
  for (const auto& [k, v] : metadata) header["__metadata__"][k] = v;
  std::string data;
  for (const auto& [name, t0] : tensors) {
    const at::Tensor t = t0.to(at::kCPU).contiguous();  // a GPU tensor is copied to the host
    const std::size_t begin = data.size();
    data.append(static_cast<const char*>(t.data_ptr()), static_cast<std::size_t>(t.nbytes()));
    header[name] = {{"dtype", names.at(ir::to_string(from_aten(t.scalar_type())))}, {"shape", t.sizes().vec()}, {"data_offsets", {begin, data.size()}}};
  }
  std::string h = header.dump();
  while (h.size() % 8 != 0) h += ' ';  // the format pads the header to 8 bytes
  const std::uint64_t len = h.size();
  std::string bytes(reinterpret_cast<const char*>(&len), 8);
  bytes += h;
  bytes += data;
  // Only a new file or an existing regular one is replaced: never a device (/dev/null), FIFO,
  // socket, folder or link, which renaming over would destroy.
  std::error_code ec;
  if (out.empty()) throw std::runtime_error("no output file named: name the .safetensors file to write");
  const auto st = fs::symlink_status(out, ec);
  if (fs::is_directory(st)) throw std::runtime_error(out.string() + " is a folder: name the .safetensors file to write");
  if (fs::exists(st) && !fs::is_regular_file(st)) {
    throw std::runtime_error(out.string() + " exists and is not a regular file (a link, device, FIFO or socket): name a new file, or a regular one to replace");
  }
  if (const fs::path parent = out.parent_path(); !parent.empty() && !fs::is_directory(parent, ec)) {
    throw std::runtime_error("cannot write " + out.string() + ": the folder " + parent.string() + " does not exist");
  }
  const fs::path tmp = out.string() + ".partial." + std::to_string(::getpid());  // per writer: two exports to one file never share it
  try {
    write_file(tmp, bytes);
    fs::rename(tmp, out);
  } catch (const std::exception& e) {
    fs::remove(tmp, ec);  // nothing half-written stays behind
    throw std::runtime_error("cannot write " + out.string() + ": " + e.what());
  }
}

namespace {

// The rows [heads x head_dim, dim] as [heads, 2, head_dim / 2, dim] (half-split) from or to
// [heads, head_dim / 2, 2, dim] (interleaved).
at::Tensor permute_rotary_rows(const at::Tensor& w, std::int64_t heads, bool to_hf) {
  if (w.dim() != 2 || heads <= 0 || w.size(0) % (2 * heads) != 0) {
    throw std::invalid_argument("a query or key projection of shape " + ir::shape_str(w.sizes().vec()) + " does not split into " +
                                std::to_string(heads) + " heads of even size");
  }
  const std::int64_t half = w.size(0) / heads / 2;
  const auto from = to_hf ? std::vector<std::int64_t>{heads, half, 2, w.size(1)} : std::vector<std::int64_t>{heads, 2, half, w.size(1)};
  return w.reshape(from).transpose(1, 2).reshape({w.size(0), w.size(1)});
}

}  // namespace

at::Tensor to_hf_rotary_rows(const at::Tensor& w, std::int64_t heads) { return permute_rotary_rows(w, heads, true); }

at::Tensor from_hf_rotary_rows(const at::Tensor& w, std::int64_t heads) { return permute_rotary_rows(w, heads, false); }

TensorMap load_initial_weights(const models::WeightLoad& load, at::ScalarType dtype) {
  static const std::map<std::string, at::ScalarType> types{{"F32", at::kFloat}, {"BF16", at::kBFloat16}, {"F16", at::kHalf}, {"F64", at::kDouble}};
  TensorMap out;
  for (const auto& [name, src] : load.params) {
    std::ifstream in(src.file, std::ios::binary);
    at::Tensor raw = at::empty(src.tensor.shape, at::TensorOptions().dtype(types.at(src.tensor.dtype)));
    in.seekg(static_cast<std::streamoff>(src.tensor.offset));
    in.read(static_cast<char*>(raw.data_ptr()), static_cast<std::streamsize>(src.tensor.nbytes));
    if (!in) throw std::runtime_error("cannot read tensor '" + src.tensor.name + "' from " + src.file.string() + ": " + std::strerror(errno));
    at::Tensor t = raw.to(dtype);
    if (!at::isfinite(t).all().item<bool>()) {
      throw std::runtime_error("tensor '" + src.tensor.name + "' in " + src.file.string() + " holds NaN or infinite values: training from it would give a " +
                               "NaN loss; export the weights again, or from an earlier checkpoint");
    }
    out[name] = src.unpermute_heads > 0 ? from_hf_rotary_rows(t, src.unpermute_heads).contiguous() : t;
  }
  return out;
}

std::size_t export_safetensors(const fs::path& step_dir, const fs::path& out, bool hf_names) {
  // Never into the checkpoint it reads: that would destroy it (and its checksums say so only later).
  std::error_code ec;
  const fs::path dir = fs::weakly_canonical(step_dir, ec), target = fs::weakly_canonical(out, ec);
  const auto rel = target.lexically_relative(dir);
  if (!rel.empty() && *rel.begin() != "..") {
    throw std::runtime_error(out.string() + " is inside the checkpoint " + step_dir.string() + ", which export reads: write it elsewhere");
  }
  if (!fs::exists(step_dir / "metadata.json", ec)) {  // the checkpoint folder itself, say: name one of its steps
    const auto found = train::scan_checkpoints(step_dir);
    if (!found.complete.empty()) {
      throw std::runtime_error(step_dir.string() + " holds checkpoints, not one: name a step folder, e.g. " + found.complete.rbegin()->second.string() + " (the newest)");
    }
  }
  const Metadata md = read_metadata(step_dir);
  if (md.tensors.empty()) fail(step_dir / "metadata.json", "lists no tensors: nothing to export");
  if (hf_names) {
    // Checked before any shard is read: the names, and the heads from the RoPE table.
    for (const auto& [name, t] : md.tensors) {
      if (name.rfind("exp_avg", 0) != 0 && name.rfind("rope.", 0) != 0 && models::hf_name(name).empty()) {
        fail(step_dir / "metadata.json", "holds '" + name + "', which has no Hugging Face Llama name: --names hf exports spmdx's built-in llama only");
      }
    }
    if (md.tensors.count("rope.cos") == 0 || md.tensors.count("layers.0.attention.wq.weight") == 0) {
      fail(step_dir / "metadata.json", "holds no rope.cos table or layers.0.attention.wq.weight: --names hf exports spmdx's built-in llama only");
    }
  }
  const sharding::DeviceMesh saved(md.mesh);
  std::vector<TensorMap> files;
  for (std::int64_t r = 0; r < saved.size() * md.stages; ++r) files.push_back(load_shard(step_dir, r, md, saved));
  TensorMap full;
  for (const auto& [name, t] : md.tensors) {
    if (name.rfind("exp_avg", 0) == 0) continue;  // optimizer state
    std::vector<at::Tensor> parts;  // from the files of the stage that holds it
    for (std::int64_t r = t.stage * saved.size(); r < (t.stage + 1) * saved.size(); ++r) parts.push_back(files[static_cast<std::size_t>(r)].at(name));
    full[name] = assemble_tensor(parts, t.placements, saved);
  }
  if (hf_names) {
    const std::int64_t head_dim = 2 * md.tensors.at("rope.cos").shape.at(1);
    const std::int64_t heads = md.tensors.at("layers.0.attention.wq.weight").shape.at(0) / head_dim;
    models::ModelArgs args;
    args.name = "llama";
    args.n_heads = heads;
    args.n_kv_heads = md.tensors.at("layers.0.attention.wk.weight").shape.at(0) / head_dim;  // grouped-query attention: fewer
    TensorMap hf;
    for (auto& [name, t] : full) {
      if (name.rfind("rope.", 0) == 0) continue;  // Hugging Face's model makes its rotary tables from its config
      const std::int64_t rotary = models::rotary_heads(name, args);
      hf[models::hf_name(name)] = rotary > 0 ? to_hf_rotary_rows(t, rotary).contiguous() : t;
    }
    full = std::move(hf);
  }
  write_safetensors(out, full, {{"format", "pt"}, {"step", std::to_string(md.meta.step)}});
  return full.size();
}

}  // namespace spmdx::exec
