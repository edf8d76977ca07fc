#include "spmdx/exec/checkpoint.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <unistd.h>

#include <boost/crc.hpp>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "spmdx/core/files.h"
#include "spmdx/exec/kernels.h"
#include "spmdx/exec/simulated.h"

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
  std::ifstream in(file, std::ios::binary);
  if (!in) fail(file, std::string("cannot read: ") + std::strerror(errno));
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::string encode(const TensorMap& tensors) {
  json header{{"tensors", json::array()}};
  std::string data;
  for (const auto& [name, t0] : tensors) {
    const at::Tensor t = t0.contiguous();
    const auto bytes = static_cast<std::size_t>(t.nbytes());
    header["tensors"].push_back({{"name", name},
                                 {"dtype", ir::to_string(from_aten(t.scalar_type()))},
                                 {"shape", t.sizes().vec()},
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

TensorMap decode(const fs::path& file) {
  const std::string bytes = read_file(file);
  if (bytes.size() < 16 || std::memcmp(bytes.data(), kMagic, 8) != 0) fail(file, "not a spmdx checkpoint shard (bad magic)");
  std::uint64_t n = 0;
  std::memcpy(&n, bytes.data() + 8, 8);
  if (n > bytes.size() - 16) fail(file, "truncated header");
  json header;
  try {
    header = json::parse(bytes.substr(16, n));
  } catch (const json::exception& e) {
    fail(file, std::string("corrupted header: ") + e.what());
  }
  const std::size_t base = 16 + n;
  TensorMap out;
  for (const auto& t : header.at("tensors")) {
    const auto name = t.at("name").get<std::string>();
    const auto offset = t.at("offset").get<std::size_t>(), size = t.at("bytes").get<std::size_t>();
    if (base + offset + size > bytes.size()) fail(file, "truncated: tensor '" + name + "' ends past the end of the file");
    const char* p = bytes.data() + base + offset;
    if (crc32(p, size) != t.at("crc32").get<std::uint32_t>()) fail(file, "corrupted: tensor '" + name + "' fails its checksum");
    const auto dtype = ir::parse_dtype(t.at("dtype").get<std::string>());
    if (!dtype) fail(file, "unknown dtype for '" + name + "'");
    at::Tensor x = at::empty(t.at("shape").get<std::vector<std::int64_t>>(), at::TensorOptions().dtype(to_aten(*dtype)));
    if (static_cast<std::size_t>(x.nbytes()) != size) fail(file, "tensor '" + name + "' has the wrong size");
    std::memcpy(x.data_ptr(), p, size);
    out[name] = x;
  }
  return out;
}

std::string placements_text(const sharding::Placements& p) { return to_string(p); }

// "S(0)RP(sum)" -> {Shard(0), Replicate, Partial(sum)}.
sharding::Placements parse_placements(const std::string& text, const fs::path& file) {
  sharding::Placements out;
  std::size_t i = 0;
  auto bad = [&] { fail(file, "bad placements '" + text + "'"); };
  while (i < text.size()) {
    if (text[i] == 'R') {
      out.push_back(Placement::replicate());
      ++i;
      continue;
    }
    const auto close = text.find(')', i);
    if ((text[i] != 'S' && text[i] != 'P') || i + 1 >= text.size() || text[i + 1] != '(' || close == std::string::npos) bad();
    const std::string arg = text.substr(i + 2, close - i - 2);
    if (text[i] == 'S') {
      if (arg.empty() || arg.find_first_not_of("0123456789") != std::string::npos) bad();
      out.push_back(Placement::shard(std::stoi(arg)));
    } else {
      bool found = false;
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min, ReduceOp::prod}) {
        if (arg == to_string(op)) out.push_back(Placement::partial(op)), found = true;
      }
      if (!found) bad();
    }
    i = close + 1;
  }
  return out;
}

}  // namespace

fs::path save_checkpoint(const fs::path& folder, const CheckpointMeta& meta, const sharding::DeviceMesh& mesh, std::int64_t rank,
                         const TensorMap& local, const std::map<std::string, ir::TensorMeta>& global,
                         const std::map<std::string, sharding::Placements>& placements, CommBackend* backend) {
  const fs::path final_dir = folder / ("step-" + std::to_string(meta.step));
  const fs::path tmp = folder / (".step-" + std::to_string(meta.step) + ".partial");
  if (rank == 0) {
    fs::remove_all(tmp);
    fs::create_directories(tmp);
  }
  if (backend) backend->barrier(0)->wait(600);
  fs::create_directories(tmp);
  write_file(tmp / ("rank" + std::to_string(rank) + ".bin"), encode(local));
  if (backend) backend->barrier(0)->wait(600);  // every shard is on disk
  if (rank == 0) {
    json m{{"format", "spmdx.checkpoint"}, {"version", 1}, {"step", meta.step}, {"data_samples", meta.data_samples},
           {"world_size", mesh.size()}, {"mesh", json::array()}, {"tensors", json::object()}};
    for (const auto& d : mesh.dims()) m["mesh"].push_back({{"name", d.name}, {"size", d.size}});
    for (const auto& [name, g] : global) {
      m["tensors"][name] = {{"shape", g.shape}, {"dtype", ir::to_string(g.dtype)}, {"placements", placements_text(placements.at(name))}};
    }
    write_file(tmp / "metadata.json", m.dump(1));
    fsync_path(tmp);
    fs::remove_all(final_dir);
    fs::rename(tmp, final_dir);  // the checkpoint exists only from here on
    fsync_path(folder);
  }
  if (backend) backend->barrier(0)->wait(600);
  return final_dir;
}

std::optional<std::int64_t> find_checkpoint(const fs::path& folder, std::int64_t load_step) {
  if (load_step >= 0) {
    if (!fs::exists(folder / ("step-" + std::to_string(load_step)) / "metadata.json")) {
      throw std::runtime_error("checkpoint.load_step " + std::to_string(load_step) + ": no whole checkpoint " +
                               (folder / ("step-" + std::to_string(load_step))).string());
    }
    return load_step;
  }
  std::optional<std::int64_t> best;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(folder, ec)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("step-", 0) != 0 || !fs::exists(e.path() / "metadata.json")) continue;
    try {
      const std::int64_t s = std::stoll(n.substr(5));
      if (!best || s > *best) best = s;
    } catch (const std::exception&) {
    }
  }
  return best;
}

TensorMap load_checkpoint(const fs::path& folder, std::int64_t step, const sharding::DeviceMesh& mesh, std::int64_t rank,
                          const std::map<std::string, ir::TensorMeta>& global,
                          const std::map<std::string, sharding::Placements>& placements, CheckpointMeta* meta) {
  const fs::path dir = folder / ("step-" + std::to_string(step));
  const fs::path mfile = dir / "metadata.json";
  json m;
  try {
    m = json::parse(read_file(mfile));
  } catch (const json::exception& e) {
    fail(mfile, std::string("corrupted: ") + e.what());
  }
  if (m.value("format", "") != "spmdx.checkpoint") fail(mfile, "not a spmdx checkpoint");
  std::vector<MeshDim> dims;
  for (const auto& d : m.at("mesh")) dims.push_back({d.at("name").get<std::string>(), d.at("size").get<std::int64_t>()});
  const sharding::DeviceMesh saved(dims);
  if (meta) *meta = {m.at("step").get<std::int64_t>(), m.at("data_samples").get<std::uint64_t>()};
  bool same = saved.dims().size() == mesh.dims().size();
  for (std::size_t i = 0; same && i < mesh.dims().size(); ++i) {
    same = saved.dims()[i].name == mesh.dims()[i].name && saved.dims()[i].size == mesh.dims()[i].size;
  }
  for (const auto& [name, g] : global) {
    if (!m.at("tensors").contains(name)) fail(mfile, "has no tensor '" + name + "' (saved by another model?)");
    const auto& t = m.at("tensors").at(name);
    if (t.at("shape").get<std::vector<std::int64_t>>() != g.shape || t.at("dtype").get<std::string>() != ir::to_string(g.dtype)) {
      fail(mfile, "tensor '" + name + "' was saved as " + t.at("dtype").get<std::string>() + ir::shape_str(t.at("shape").get<std::vector<std::int64_t>>()) +
                      ", this run has " + g.str());
    }
    same = same && t.at("placements").get<std::string>() == placements_text(placements.at(name));
  }
  TensorMap out;
  if (same) {  // the same layout: this rank's own file
    const TensorMap mine = decode(dir / ("rank" + std::to_string(rank) + ".bin"));
    for (const auto& [name, g] : global) {
      auto it = mine.find(name);
      if (it == mine.end()) fail(dir / ("rank" + std::to_string(rank) + ".bin"), "has no tensor '" + name + "'");
      out[name] = it->second;
    }
    return out;
  }
  // Another mesh or strategy: reassemble every tensor from all saved shards, then reshard.
  std::vector<TensorMap> files;
  for (std::int64_t r = 0; r < saved.size(); ++r) files.push_back(decode(dir / ("rank" + std::to_string(r) + ".bin")));
  const auto coord = mesh.coordinate(rank);
  for (const auto& [name, g] : global) {
    std::vector<at::Tensor> parts;
    for (auto& f : files) parts.push_back(f.at(name));
    const at::Tensor full = assemble_tensor(parts, parse_placements(m.at("tensors").at(name).at("placements").get<std::string>(), mfile), saved);
    out[name] = shard_tensor(full, placements.at(name), mesh, coord);
  }
  return out;
}

std::size_t export_safetensors(const fs::path& step_dir, const fs::path& out) {
  const fs::path mfile = step_dir / "metadata.json";
  json m;
  try {
    m = json::parse(read_file(mfile));
  } catch (const json::exception& e) {
    fail(mfile, std::string("corrupted: ") + e.what());
  }
  std::vector<MeshDim> dims;
  for (const auto& d : m.at("mesh")) dims.push_back({d.at("name").get<std::string>(), d.at("size").get<std::int64_t>()});
  const sharding::DeviceMesh saved(dims);
  std::vector<TensorMap> files;
  for (std::int64_t r = 0; r < saved.size(); ++r) files.push_back(decode(step_dir / ("rank" + std::to_string(r) + ".bin")));
  static const std::map<std::string, std::string> names{{"f32", "F32"}, {"f64", "F64"}, {"f16", "F16"}, {"bf16", "BF16"},
                                                        {"i32", "I32"}, {"i64", "I64"}, {"u8", "U8"}, {"bool", "BOOL"}};
  json header = json::object();
  header["__metadata__"] = {{"format", "pt"}, {"step", std::to_string(m.at("step").get<std::int64_t>())}};
  std::string data;
  std::size_t n = 0;
  for (const auto& [name, t] : m.at("tensors").items()) {
    if (name.rfind("exp_avg", 0) == 0) continue;  // optimizer state
    std::vector<at::Tensor> parts;
    for (auto& f : files) parts.push_back(f.at(name));
    const at::Tensor full = assemble_tensor(parts, parse_placements(t.at("placements").get<std::string>(), mfile), saved).contiguous();
    const std::size_t begin = data.size();
    data.append(static_cast<const char*>(full.data_ptr()), static_cast<std::size_t>(full.nbytes()));
    header[name] = {{"dtype", names.at(t.at("dtype").get<std::string>())}, {"shape", full.sizes().vec()}, {"data_offsets", {begin, data.size()}}};
    ++n;
  }
  std::string h = header.dump();
  while (h.size() % 8 != 0) h += ' ';  // the format pads the header to 8 bytes
  const std::uint64_t len = h.size();
  std::string bytes(reinterpret_cast<const char*>(&len), 8);
  bytes += h;
  bytes += data;
  const fs::path tmp = out.string() + ".partial";
  write_file(tmp, bytes);
  fs::rename(tmp, out);
  return n;
}

}  // namespace spmdx::exec
