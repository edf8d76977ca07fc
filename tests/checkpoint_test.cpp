// Checkpoint files as they are found after crashes, disk faults and hand edits. A fuzz test
// mutates metadata.json and the shard files of a 4-rank checkpoint (fsdp x tp 2 x 2, uneven
// shards) in hundreds of ways — raw bytes flipped, cut, inserted, and fields replaced with
// wrong types and out-of-range values, re-signed as a writer would — and loads each on the
// same mesh (every rank) and on another (resharding from every file). Every load must either
// be refused with a std::runtime_error naming the checkpoint file, or give exactly the tensors
// that were saved: never a crash, another exception type, a NaN or other values.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <barrier>
#include <limits>
#include <optional>
#include <sys/stat.h>
#include <boost/crc.hpp>
#include <cstring>
#include <fstream>
#include <random>
#include <set>
#include <thread>

#include "spmdx/exec/checkpoint.h"
#include "spmdx/exec/simulated.h"
#include "spmdx/train/checkpoint_folder.h"
#include "test_util.h"

namespace spmdx {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using ::testing::HasSubstr;
using sharding::Placements;

// Ranks as threads: only barrier() is used by save_checkpoint.
class ThreadBarrierBackend final : public CommBackend {
 public:
  explicit ThreadBarrierBackend(std::barrier<>& b) : b_(b) {}
  void init(const CommInit&) override {}
  void finalize() override {}
  void abort() noexcept override {}
  std::string describe() const override { return "threads"; }
  std::vector<CommCapability> capabilities() const override { return {}; }
  int new_group(const std::vector<int>&) override { return 0; }
  std::unique_ptr<Work> all_reduce(int, CommBuffer, ReduceOp) override { throw std::logic_error("unused"); }
  std::unique_ptr<Work> all_gather(int, CommBuffer, CommBuffer, std::vector<std::size_t>) override { throw std::logic_error("unused"); }
  std::unique_ptr<Work> reduce_scatter(int, CommBuffer, CommBuffer, std::vector<std::size_t>, ReduceOp) override { throw std::logic_error("unused"); }
  std::unique_ptr<Work> all_to_all(int, CommBuffer, CommBuffer, std::vector<std::size_t>, std::vector<std::size_t>) override {
    throw std::logic_error("unused");
  }
  std::unique_ptr<Work> broadcast(int, CommBuffer, int) override { throw std::logic_error("unused"); }
  std::unique_ptr<Work> send(CommBuffer, int, int) override { throw std::logic_error("unused"); }
  std::unique_ptr<Work> recv(CommBuffer, int, int) override { throw std::logic_error("unused"); }
  std::unique_ptr<Work> barrier(int) override {
    b_.arrive_and_wait();
    return std::make_unique<Done>();
  }

 private:
  struct Done final : Work {
    bool wait(double) override { return true; }
    bool test() override { return true; }
  };
  std::barrier<>& b_;
};

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void spill(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}
std::uint32_t crc32(const std::string& s) {
  boost::crc_32_type c;
  c.process_bytes(s.data(), s.size());
  return c.checksum();
}
// What the writer does: crc32 of the compact JSON without "crc32".
void sign(json& m) {
  m.erase("crc32");
  m["crc32"] = crc32(m.dump());
}

// The saved job: a 2 x 2 mesh, tensors of several placements, dtypes and uneven shards.
struct Saved {
  const sharding::DeviceMesh mesh{{{"dp_shard", 2}, {"tp", 2}}};
  std::map<std::string, ir::TensorMeta> global{{"a", {{4, 6}, ir::DType::f32}},  {"b", {{6}, ir::DType::f32}},
                                                {"c", {{5, 3}, ir::DType::f32}}, {"d", {{3, 4}, ir::DType::i64}},
                                                {"e", {{6, 6}, ir::DType::f32}}};
  std::map<std::string, Placements> placements{{"a", {Placement::shard(0), Placement::shard(1)}},
                                               {"b", {Placement::replicate(), Placement::replicate()}},
                                               {"c", {Placement::shard(0), Placement::replicate()}},
                                               {"d", {Placement::replicate(), Placement::shard(1)}},
                                               {"e", {Placement::shard(1), Placement::shard(0)}}};
  std::map<std::string, at::Tensor> full;
  std::vector<exec::TensorMap> local;  // by rank
  Saved() {
    at::manual_seed(7);
    for (const auto& [name, m] : global) {
      full[name] = m.dtype == ir::DType::i64 ? at::randint(-1000, 1000, m.shape, at::kLong) : at::randn(m.shape, at::kFloat);
    }
    for (std::int64_t r = 0; r < mesh.size(); ++r) {
      exec::TensorMap t;
      for (const auto& [name, f] : full) t[name] = exec::shard_tensor(f, placements.at(name), mesh, mesh.coordinate(r));
      local.push_back(t);
    }
  }
  void save(const fs::path& folder) const {
    std::barrier<> b(static_cast<std::ptrdiff_t>(mesh.size()));
    std::vector<std::thread> ranks;
    for (std::int64_t r = 0; r < mesh.size(); ++r) {
      ranks.emplace_back([&, r] {
        ThreadBarrierBackend backend(b);
        exec::save_checkpoint(folder, {3, 24, "byte"}, mesh, r, local[static_cast<std::size_t>(r)], global, placements, &backend);
      });
    }
    for (auto& t : ranks) t.join();
  }
};

enum class Outcome { refused, loaded };

// Loads `folder`'s step 3 on the saved mesh as every rank, and on one rank with everything
// replicated (reassembled from every file); each must be refused cleanly or be exact.
Outcome load_all(const Saved& s, const fs::path& folder, const std::string& what) {
  int refused = 0, loaded = 0;
  auto attempt = [&](const sharding::DeviceMesh& mesh, std::int64_t rank, const std::map<std::string, Placements>& pl,
                     const std::function<at::Tensor(const std::string&)>& expected) {
    exec::CheckpointMeta meta;
    exec::TensorMap got;
    try {
      got = exec::load_checkpoint(folder, 3, mesh, rank, s.global, pl, &meta);
    } catch (const std::runtime_error& e) {
      EXPECT_THAT(e.what(), HasSubstr("checkpoint")) << what;
      EXPECT_THAT(e.what(), HasSubstr(folder.string())) << what << ": " << e.what();
      ++refused;
      return;
    } catch (const std::exception& e) {
      ADD_FAILURE() << what << ": not a std::runtime_error naming the file: " << e.what();
      return;
    }
    ++loaded;
    EXPECT_EQ(meta.step, 3) << what;
    EXPECT_GE(meta.data_samples, 3u) << what;
    for (const auto& [name, m] : s.global) {
      ASSERT_TRUE(got.count(name)) << what << ": " << name;
      const at::Tensor& t = got.at(name);
      EXPECT_TRUE(t.scalar_type() == expected(name).scalar_type() && t.sizes() == expected(name).sizes() && at::equal(t, expected(name)))
          << what << ": tensor " << name << " loaded with other values";
      if (t.is_floating_point()) {
        EXPECT_FALSE(at::isnan(t).any().item<bool>()) << what;
      }
    }
  };
  for (std::int64_t r = 0; r < s.mesh.size(); ++r) {
    attempt(s.mesh, r, s.placements, [&](const std::string& n) { return s.local[static_cast<std::size_t>(r)].at(n); });
  }
  const sharding::DeviceMesh one({{"dp_shard", 1}});
  std::map<std::string, Placements> replicated;
  for (const auto& [name, m] : s.global) replicated[name] = {Placement::replicate()};
  attempt(one, 0, replicated, [&](const std::string& n) { return s.full.at(n); });
  return refused > 0 ? Outcome::refused : Outcome::loaded;
}

TEST(Checkpoint, ASavedCheckpointLoadsExactlyOnTheSameAndAnotherMesh) {
  test::TempDir dir;
  Saved s;
  s.save(dir / "ckpt");
  EXPECT_EQ(load_all(s, dir / "ckpt", "pristine"), Outcome::loaded);
  const json m = json::parse(slurp(dir / "ckpt" / "step-3" / "metadata.json"));
  EXPECT_EQ(m.at("version"), 2);
  EXPECT_EQ(m.at("files").size(), 4u);
  // As version 1 wrote it (no checksum, no files): still read.
  json v1 = m;
  v1.erase("crc32");
  v1.erase("files");
  v1["version"] = 1;
  spill(dir / "ckpt" / "step-3" / "metadata.json", v1.dump(1));
  EXPECT_EQ(load_all(s, dir / "ckpt", "version 1"), Outcome::loaded);
}

// The named faults of the issue, each refused with the key named (re-signed, so that the field
// check and not the checksum refuses them), and unsigned edits refused by the checksum.
TEST(Checkpoint, EditedMetadataIsRefusedNamingTheFileAndKey) {
  test::TempDir dir;
  Saved s;
  s.save(dir / "pristine");
  const std::vector<std::tuple<std::string, std::function<void(json&)>, std::string>> cases = {
      {"negative step", [](json& m) { m["step"] = -5; }, "key 'step' must be between 1 and"},
      {"step of another folder", [](json& m) { m["step"] = 4; }, "key 'step' is 4 but the checkpoint is in folder step-3"},
      {"negative data_samples", [](json& m) { m["data_samples"] = -1; }, "key 'data_samples' must be between 3 and"},
      {"data_samples past the data", [](json& m) { m["data_samples"] = 1ULL << 62; }, "key 'data_samples' must be between 3 and 30000000"},
      {"unknown version", [](json& m) { m["version"] = 99; }, "key 'version' is 99: this build reads versions 1, 2"},
      {"step as a string", [](json& m) { m["step"] = "3"; }, "key 'step' must be a whole number, is string \"3\""},
      {"world size of no file", [](json& m) { m["world_size"] = 8; }, "key 'world_size' is 8 but the mesh's sizes multiply to 4"},
      {"placements for another layout", [](json& m) { m["tensors"]["e"]["placements"] = "S(0)S(1)"; }, "holds the block at"},
      {"placements that do not fit", [](json& m) { m["tensors"]["a"]["placements"] = "S(0)RR"; }, "has 3 placements for a mesh of 2 dims"},
      {"placements written otherwise", [](json& m) { m["tensors"]["a"]["placements"] = "Shard(0)"; }, "key 'tensors.a.placements' is \"Shard(0)\""},
      {"a shard dim past int", [](json& m) { m["tensors"]["a"]["placements"] = "S(99999999999999999999)R"; },
       "key 'tensors.a.placements' is \"S(99999999999999999999)R\""},  // was "stoi", the message of std::stoi's throw
  };
  for (const auto& [name, edit, expected] : cases) {
    SCOPED_TRACE(name);
    fs::remove_all(dir / "c");
    fs::copy(dir / "pristine", dir / "c", fs::copy_options::recursive);
    const fs::path file = dir / "c" / "step-3" / "metadata.json";
    json m = json::parse(slurp(file));
    edit(m);
    spill(file, m.dump(1));  // not re-signed: the checksum refuses it
    try {
      exec::load_checkpoint(dir / "c", 3, s.mesh, 0, s.global, s.placements, nullptr);
      ADD_FAILURE() << "loaded";
    } catch (const std::runtime_error& e) {
      EXPECT_THAT(e.what(), HasSubstr(file.string()));
      EXPECT_THAT(e.what(), ::testing::AnyOf(HasSubstr("fails its checksum"), HasSubstr("key 'version' is 99")));
    }
    sign(m);
    spill(file, m.dump(1));
    try {
      exec::load_checkpoint(dir / "c", 3, s.mesh, 1, s.global, s.placements, nullptr);
      ADD_FAILURE() << "loaded";
    } catch (const std::runtime_error& e) {
      EXPECT_THAT(e.what(), HasSubstr("checkpoint file " + (dir / "c" / "step-3").string()));
      EXPECT_THAT(e.what(), HasSubstr(expected));
    }
  }
  // A shard file of another save dropped in: same tensors and shapes, other header.
  fs::remove_all(dir / "c");
  fs::copy(dir / "pristine", dir / "c", fs::copy_options::recursive);
  Saved other;
  other.full["a"] = other.full["a"] + 1;
  other.local[1]["a"] = other.local[1]["a"] + 1;
  other.save(dir / "other");
  fs::copy_file(dir / "other" / "step-3" / "rank1.bin", dir / "c" / "step-3" / "rank1.bin", fs::copy_options::overwrite_existing);
  try {
    exec::load_checkpoint(dir / "c", 3, s.mesh, 1, s.global, s.placements, nullptr);
    ADD_FAILURE() << "loaded";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("rank1.bin: its header does not match metadata.json"));
  }
}

// A random JSON path of `j` (object keys and array indices), for structured mutations.
void paths(const json& j, std::vector<json::json_pointer>& out, const json::json_pointer& at = json::json_pointer()) {
  out.push_back(at);
  if (j.is_object()) {
    for (const auto& [k, v] : j.items()) paths(v, out, at / k);
  } else if (j.is_array()) {
    for (std::size_t i = 0; i < j.size(); ++i) paths(j[i], out, at / i);
  }
}

const std::vector<json>& replacements() {
  static const std::vector<json> values = {
      -1, 0, 1, 2, 3, 4, 7, 99, 24, 16, 1ULL << 32, 1ULL << 62, -(1LL << 62), 1.5, -0.0, 1e300, "3", "", "f32", "i64", "bf16", "x",
      "S(0)S(1)", "S(1)S(0)", "RR", "S(0)R", "RS(0)", "S(5)R", "P(sum)R", "S(0)", "S(-1)R", "S(", nullptr, true, json::array(),
      json::object(), json::array({1, 2}), json::array({4, 6}), json::array({6, 4}), json::array({-1, 6}), json::array({1ULL << 40, 1ULL << 40}),
      json{{"name", "dp_shard"}, {"size", 4}}};
  return values;
}

TEST(Checkpoint, FuzzedMetadataAndShardFilesAreRefusedCleanlyOrLoadExactly) {
  test::TempDir dir;
  Saved s;
  s.save(dir / "pristine");
  const fs::path step = dir / "work" / "step-3";
  std::mt19937_64 rng(20261201);
  auto pick = [&](std::size_t n) { return static_cast<std::size_t>(rng() % n); };
  std::map<std::string, std::pair<int, int>> tally;  // kind -> refused, loaded
  auto run = [&](const std::string& kind, const std::function<void()>& mutate) {
    fs::remove_all(dir / "work");
    fs::copy(dir / "pristine", dir / "work", fs::copy_options::recursive);
    mutate();
    const Outcome o = load_all(s, dir / "work", kind + " #" + std::to_string(tally[kind].first + tally[kind].second));
    (o == Outcome::refused ? tally[kind].first : tally[kind].second)++;
  };
  auto raw = [&](const fs::path& file, std::size_t lo, std::size_t hi) {
    std::string b = slurp(file);
    hi = std::min(hi, b.size());
    const std::size_t at = lo + pick(std::max<std::size_t>(1, hi - lo));
    switch (pick(5)) {
      case 0: b[at] = static_cast<char>(b[at] ^ (1 + pick(255))); break;  // a flipped byte
      case 1: b.erase(at, 1 + pick(8)); break;                           // bytes lost
      case 2: b.insert(at, 1, static_cast<char>(pick(256))); break;      // a byte more
      case 3: b.resize(at); break;                                        // cut short
      default: b += std::string(1 + pick(64), static_cast<char>(pick(256)));  // garbage appended
    }
    spill(file, b);
  };
  auto structured = [&](json& j) {
    std::vector<json::json_pointer> ps;
    paths(j, ps);
    const auto p = ps[1 + pick(ps.size() - 1)];
    if (pick(6) == 0) {
      j.at(p.parent_pointer()).is_object() ? (void)j.at(p.parent_pointer()).erase(p.back()) : (void)(j[p] = nullptr);
    } else {
      j[p] = replacements()[pick(replacements().size())];
    }
  };
  for (int i = 0; i < 200; ++i) {
    run("metadata bytes", [&] { raw(step / "metadata.json", 0, SIZE_MAX); });
  }
  for (int i = 0; i < 250; ++i) {
    run("metadata fields, re-signed", [&] {
      json m = json::parse(slurp(step / "metadata.json"));
      structured(m);
      if (pick(8) != 0) sign(m);
      spill(step / "metadata.json", m.dump(1));
    });
  }
  for (int i = 0; i < 150; ++i) {
    run("shard bytes", [&] {
      const fs::path f = step / ("rank" + std::to_string(pick(4)) + ".bin");
      const std::string b = slurp(f);
      std::uint64_t n = 0;
      std::memcpy(&n, b.data() + 8, 8);
      if (pick(2) == 0) raw(f, 0, 16 + n);  // preamble and header
      else raw(f, 16 + n, SIZE_MAX);         // data
    });
  }
  for (int i = 0; i < 150; ++i) {
    run("shard header fields, re-signed", [&] {
      const int r = static_cast<int>(pick(4));
      const fs::path f = step / ("rank" + std::to_string(r) + ".bin");
      const std::string b = slurp(f);
      std::uint64_t n = 0;
      std::memcpy(&n, b.data() + 8, 8);
      json h = json::parse(b.substr(16, n));
      structured(h);
      const std::string text = h.dump();
      const std::uint64_t len = text.size();
      std::string out = b.substr(0, 8);
      out.append(reinterpret_cast<const char*>(&len), 8);
      out += text + b.substr(16 + n);
      spill(f, out);
      if (pick(4) != 0) {  // and metadata.json updated to match, as a writer would
        json m = json::parse(slurp(step / "metadata.json"));
        m["files"]["rank" + std::to_string(r) + ".bin"] = {{"bytes", out.size()}, {"header_crc32", crc32(text)}};
        sign(m);
        spill(step / "metadata.json", m.dump(1));
      }
    });
  }
  int total = 0, refused = 0;
  for (const auto& [kind, c] : tally) {
    total += c.first + c.second;
    refused += c.first;
    std::printf("%-32s %4d refused, %4d loaded exactly\n", kind.c_str(), c.first, c.second);
  }
  EXPECT_GE(total, 500);
  // Not vacuous: most mutations are refused (the rest changed nothing that matters, such as
  // a space in metadata.json, or an unknown field).
  EXPECT_GT(refused, total * 3 / 4);
}


// One rank, everything replicated: `tensors` saved as checkpoint `step` of `folder`.
void save_one_rank(const fs::path& folder, std::int64_t step, const exec::TensorMap& tensors, std::optional<train::LrSchedule> schedule = std::nullopt) {
  const sharding::DeviceMesh one({{"dp_shard", 1}});
  std::map<std::string, ir::TensorMeta> global;
  std::map<std::string, Placements> placements;
  for (const auto& [name, t] : tensors) {
    global[name] = {t.sizes().vec(), ir::DType::f32};
    placements[name] = {Placement::replicate()};
  }
  exec::CheckpointMeta meta{step, static_cast<std::uint64_t>(step) * 4, "byte"};
  meta.lr_schedule = std::move(schedule);
  exec::save_checkpoint(folder, meta, one, 0, tensors, global, placements, nullptr);
}

// Writes `value` over every element of tensor `name` in `shard` (a float32 tensor), its CRC-32,
// the shard's header CRC and size in metadata.json and metadata.json's own CRC recomputed, as a
// writer would: a checkpoint consistent in every checksum.
void overwrite_tensor(const fs::path& shard, const std::string& name, float value) {
  std::string b = slurp(shard);
  std::uint64_t n = 0;
  std::memcpy(&n, b.data() + 8, 8);
  json h = json::parse(b.substr(16, n));
  std::string data = b.substr(16 + n);
  for (auto& t : h["tensors"]) {
    if (t["name"] != name) continue;
    const std::size_t at = t["offset"].get<std::size_t>(), bytes = t["bytes"].get<std::size_t>();
    for (std::size_t i = 0; i < bytes; i += 4) std::memcpy(data.data() + at + i, &value, 4);
    t["crc32"] = crc32(data.substr(at, bytes));
  }
  const std::string text = h.dump();
  const std::uint64_t len = text.size();
  std::string out = b.substr(0, 8);
  out.append(reinterpret_cast<const char*>(&len), 8);
  out += text + data;
  spill(shard, out);
  const fs::path mfile = shard.parent_path() / "metadata.json";
  json m = json::parse(slurp(mfile));
  m["files"][shard.filename().string()] = {{"bytes", out.size()}, {"header_crc32", crc32(text)}};
  sign(m);
  spill(mfile, m.dump(1));
}

// A diverged state is never saved (the save throws naming the tensor before writing anything),
// and a checkpoint whose tensors hold NaN or infinities, consistent in every checksum, is refused
// at load naming the tensor, its file and the checkpoint, on the same mesh and resharded.
TEST(Checkpoint, NonFiniteTensorsAreNeverSavedNorLoaded) {
  test::TempDir dir;
  const fs::path folder = dir / "ckpt";
  exec::TensorMap good{{"a", at::randn({4, 6})}, {"b", at::randn({6})}};
  save_one_rank(folder, 2, good);
  save_one_rank(folder, 3, good);
  exec::TensorMap diverged = good;
  diverged["b"] = good.at("b").clone();
  diverged["b"][1] = std::numeric_limits<float>::infinity();
  diverged["b"][4] = std::numeric_limits<float>::quiet_NaN();
  try {
    save_one_rank(folder, 5, diverged);
    ADD_FAILURE() << "saved";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("not saving checkpoint " + (folder / "step-5").string() + ": rank 0's tensor 'b' holds 2 NaN or infinite values (of 6): "
                                    "training diverged at or before step 5"));
    EXPECT_THAT(e.what(), HasSubstr("The earlier checkpoints in " + folder.string() + " are kept"));
  }
  EXPECT_FALSE(fs::exists(folder / "step-5"));
  EXPECT_FALSE(fs::exists(folder / ".step-5.partial"));

  overwrite_tensor(folder / "step-3" / "rank0.bin", "a", std::numeric_limits<float>::quiet_NaN());
  const std::map<std::string, ir::TensorMeta> global{{"a", {{4, 6}, ir::DType::f32}}, {"b", {{6}, ir::DType::f32}}};
  const std::string says = "checkpoint file " + (folder / "step-3" / "rank0.bin").string() + ": tensor 'a' holds 24 NaN or infinite values (of 24): the run that "
                           "saved checkpoint " + (folder / "step-3").string() + " had diverged, and resuming it would train on NaN. Resume from an earlier step "
                           "(checkpoint.load_step 2, the newest before it), or move " + (folder / "step-3").string() + " away";
  const sharding::DeviceMesh one({{"dp_shard", 1}}), two({{"dp_shard", 2}});
  for (const auto& [what, mesh, placement] : std::vector<std::tuple<std::string, sharding::DeviceMesh, Placement>>{
           {"same mesh", one, Placement::replicate()}, {"resharded", two, Placement::shard(0)}}) {
    SCOPED_TRACE(what);
    try {
      exec::load_checkpoint(folder, 3, mesh, 0, global, {{"a", {placement}}, {"b", {placement}}}, nullptr);
      ADD_FAILURE() << "loaded";
    } catch (const std::runtime_error& e) {
      EXPECT_EQ(std::string(e.what()), says);
    }
  }
  // The one before it loads, exactly.
  const exec::TensorMap back = exec::load_checkpoint(folder, 2, one, 0, global, {{"a", {Placement::replicate()}}, {"b", {Placement::replicate()}}}, nullptr);
  EXPECT_TRUE(at::equal(back.at("a"), good.at("a")));
}

// A save never replaces a complete checkpoint of its step (an earlier run's, which went further):
// it fails before anything is written, the checkpoint kept as it was; a step folder that is not
// complete is replaced. Preflight's check names the newer checkpoints a load_step would replace.
TEST(Checkpoint, ASaveNeverReplacesACompleteCheckpointOfItsStep) {
  test::TempDir dir;
  const fs::path folder = dir / "ckpt";
  const exec::TensorMap earlier{{"a", at::randn({4, 6})}}, later{{"a", at::randn({4, 6})}};
  save_one_rank(folder, 4, earlier);
  const std::string metadata = slurp(folder / "step-4" / "metadata.json"), shard = slurp(folder / "step-4" / "rank0.bin");
  try {
    save_one_rank(folder, 4, later);
    ADD_FAILURE() << "saved";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()), "not saving checkpoint " + (folder / "step-4").string() +
                                         ": a complete checkpoint of step 4 is already there, from an earlier run, and spmdx never replaces one (it is kept "
                                         "as it was). Move it away to save this run's, or resume from it with checkpoint.load_step 4");
  }
  EXPECT_EQ(slurp(folder / "step-4" / "metadata.json"), metadata);
  EXPECT_EQ(slurp(folder / "step-4" / "rank0.bin"), shard);
  EXPECT_FALSE(fs::exists(folder / ".step-4.partial"));
  const sharding::DeviceMesh one({{"dp_shard", 1}});
  const std::map<std::string, ir::TensorMeta> global{{"a", {{4, 6}, ir::DType::f32}}};
  const std::map<std::string, Placements> placements{{"a", {Placement::replicate()}}};
  EXPECT_TRUE(at::equal(exec::load_checkpoint(folder, 4, one, 0, global, placements, nullptr).at("a"), earlier.at("a")));
  // Not complete (its metadata.json lost after the save): the save replaces it.
  fs::remove(folder / "step-4" / "metadata.json");
  save_one_rank(folder, 4, later);
  EXPECT_TRUE(at::equal(exec::load_checkpoint(folder, 4, one, 0, global, placements, nullptr).at("a"), later.at("a")));

  save_one_rank(folder, 2, earlier);
  save_one_rank(folder, 6, earlier);
  const train::CheckpointFolder found = train::scan_checkpoints(folder);
  EXPECT_EQ(train::newer_checkpoints_problem(folder, found, 6), "");
  EXPECT_EQ(train::newer_checkpoints_problem(folder, found, 4),
            "checkpoint.load_step 4: " + folder.string() + " also holds a newer complete checkpoint, of step 6 (" + (folder / "step-6").string() +
                "), and this run, training on from step 4 with checkpoint.enable, would save its own in its place. To train on from step 4, move it away "
                "first (out of " + folder.string() + "); to resume from the newest, step 6, set checkpoint.load_step -1");
  EXPECT_EQ(train::newer_checkpoints_problem(folder, found, 2),
            "checkpoint.load_step 2: " + folder.string() + " also holds newer complete checkpoints, of steps 4 and 6 (" + (folder / "step-4").string() + ", " +
                (folder / "step-6").string() + "), and this run, training on from step 2 with checkpoint.enable, would save its own in their place. To "
                "train on from step 2, move them away first (out of " + folder.string() + "); to resume from the newest, step 6, set checkpoint.load_step -1");
}

// metadata.json records the learning-rate schedule under its CRC-32; checkpoints without it
// (written before it was) still read; a wrong value, re-signed, is refused naming the key.
TEST(Checkpoint, TheLrScheduleIsRecordedUnderTheChecksum) {
  test::TempDir dir;
  const fs::path folder = dir / "ckpt", mfile = folder / "step-2" / "metadata.json";
  save_one_rank(folder, 2, {{"a", at::randn({3})}}, train::LrSchedule{5, 40, 0.25, "cosine", 0.1});
  const json m = json::parse(slurp(mfile));
  EXPECT_EQ(m.at("lr_schedule"), (json{{"steps", 40}, {"warmup_steps", 5}, {"decay_ratio", 0.25}, {"decay_type", "cosine"}, {"min_lr_factor", 0.1}}));
  const auto read = exec::read_checkpoint_meta(folder, 2).lr_schedule;
  ASSERT_TRUE(read.has_value());
  EXPECT_EQ(read->steps, 40);
  EXPECT_EQ(read->warmup_steps, 5);
  EXPECT_EQ(read->decay_ratio, 0.25);
  EXPECT_EQ(read->decay_type, "cosine");
  EXPECT_EQ(read->min_lr_factor, 0.1);
  auto refused = [&](const json& edited) {
    spill(mfile, edited.dump(1));
    try {
      exec::read_checkpoint_meta(folder, 2);
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string("read");
  };
  json edited = m;
  edited["lr_schedule"]["steps"] = 80;  // not re-signed
  EXPECT_THAT(refused(edited), HasSubstr("fails its checksum (key 'crc32')"));
  sign(edited);
  EXPECT_EQ(refused(edited), "read");
  EXPECT_EQ(exec::read_checkpoint_meta(folder, 2).lr_schedule->steps, 80);
  edited["lr_schedule"]["decay_type"] = "exponential";
  sign(edited);
  EXPECT_THAT(refused(edited), HasSubstr("key 'lr_schedule.decay_type' must be \"linear\", \"sqrt\" or \"cosine\", is \"exponential\""));
  edited = m;
  edited.erase("lr_schedule");  // as written before it was recorded
  sign(edited);
  EXPECT_EQ(refused(edited), "read");
  EXPECT_FALSE(exec::read_checkpoint_meta(folder, 2).lr_schedule.has_value());
}

// Only the folder names spmdx writes are checkpoints; a step folder is complete when its
// metadata.json is a readable regular file; a resume names what it skips or why it cannot.
TEST(CheckpointFolder, OnlyTheNamesSpmdxWritesCountAndOnlyCompleteOnesResume) {
  for (const auto& [name, step] : std::vector<std::pair<std::string, std::int64_t>>{{"step-1", 1}, {"step-10", 10}, {"step-1000000000", 1000000000}}) {
    EXPECT_EQ(train::checkpoint_step(name), step) << name;
  }
  for (const char* name : {"step-7junk", "step- 9", "step-02", "step-0", "step-", "step-+3", "step--3", "step-3 ", "Step-3", "step-12345678901", "xstep-3"}) {
    EXPECT_FALSE(train::checkpoint_step(name).has_value()) << name;
  }
  test::TempDir dir;
  const fs::path f = dir / "ckpt";
  for (const char* s : {"step-2", "step-4", "step-5", "step-6", "step-7junk", "step- 9", "step-02"}) {
    fs::create_directories(f / s);
    test::write_file(f / s / "metadata.json", "{}");
  }
  fs::remove(f / "step-4" / "metadata.json");
  fs::remove(f / "step-5" / "metadata.json");
  fs::create_symlink(dir / "nowhere.json", f / "step-5" / "metadata.json");
  fs::remove(f / "step-6" / "metadata.json");
  fs::create_symlink("/dev/null", f / "step-6" / "metadata.json");
  test::write_file(f / "step-8", "a file");
  fs::create_symlink(dir / "gone", f / "step-9");
  const train::CheckpointFolder found = train::scan_checkpoints(f);
  EXPECT_EQ(found.complete.size(), 1u);
  EXPECT_EQ(found.complete.count(2), 1u);
  std::map<std::int64_t, std::string> why;
  for (const auto& [s, b] : found.broken) why[s] = b.second;
  EXPECT_EQ(why, (std::map<std::int64_t, std::string>{{4, "has no metadata.json: damaged after it was saved?"},
                                                      {5, "has a metadata.json that is a link to " + (dir / "nowhere.json").string() + ", which does not exist"},
                                                      {6, "has a metadata.json that cannot be read: not a regular file (a folder, FIFO or device)"},
                                                      {8, "is not a folder"},
                                                      {9, "is a link to " + (dir / "gone").string() + ", which does not exist"}}));
  EXPECT_EQ(found.ignored.size(), 3u);
  EXPECT_EQ(exec::find_checkpoint(f, -1), 2);
  EXPECT_EQ(exec::find_checkpoint(f, 2), 2);
  try {
    exec::find_checkpoint(f, 4);
    ADD_FAILURE() << "found";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()), "checkpoint.load_step 4: no complete checkpoint " + (f / "step-4").string() +
                                         " (has no metadata.json: damaged after it was saved?); the complete ones there: steps 2 (checkpoint.load_step -1 resumes from the newest)");
  }
  fs::remove_all(f / "step-2");
  try {
    exec::find_checkpoint(f, -1);
    ADD_FAILURE() << "found";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("no checkpoint in " + f.string() + " is complete, so there is nothing to resume: " + (f / "step-4").string() +
                                    " (has no metadata.json: damaged after it was saved?); " + (f / "step-5").string()));
    EXPECT_THAT(e.what(), HasSubstr("To start over at step 1, move them away; to resume from a good checkpoint, put it in " + f.string() +
                                    " as step-<N> and set checkpoint.load_step <N>"));
  }
  EXPECT_EQ(exec::find_checkpoint(dir / "none", -1), std::nullopt);
  // Where checkpoints cannot be written.
  test::write_file(dir / "file", "");
  ASSERT_EQ(::mkfifo((dir / "fifo").c_str(), 0600), 0);
  EXPECT_EQ(train::unusable_checkpoint_folder(dir / "file"), "is a file, not a folder");
  EXPECT_EQ(train::unusable_checkpoint_folder(dir / "fifo"), "is a FIFO, not a folder");
  EXPECT_EQ(train::unusable_checkpoint_folder(dir / "file" / "ckpt"), "cannot be made: " + (dir / "file").string() + " is not a folder");
  EXPECT_EQ(train::unusable_checkpoint_folder(dir / "new" / "ckpt"), "");
  EXPECT_EQ(train::unusable_checkpoint_folder(f), "");
}


// Hugging Face's rotary layout: within each head, row 2i (interleaved pair member 0) goes to i and
// row 2i+1 to i + head_dim / 2, as transformers' permute(); and back.
TEST(Weights, RotaryRowsGoToHuggingFacesHalfSplitLayoutAndBack) {
  const at::Tensor w = at::arange(8 * 3, at::kFloat).reshape({8, 3});  // 2 heads of head_dim 4
  const at::Tensor hf = exec::to_hf_rotary_rows(w, 2);
  const std::vector<std::int64_t> rows{0, 2, 1, 3, 4, 6, 5, 7};
  for (std::size_t i = 0; i < rows.size(); ++i) EXPECT_TRUE(at::equal(hf[static_cast<std::int64_t>(i)], w[rows[i]])) << "row " << i;
  EXPECT_TRUE(at::equal(exec::from_hf_rotary_rows(hf, 2), w));
  EXPECT_THROW(exec::to_hf_rotary_rows(w, 3), std::invalid_argument);
}

// Every parameter of the built-in llama has a Hugging Face name that maps back to it; the RoPE
// tables have none; names of other models map to nothing.
TEST(Weights, EveryLlamaParameterHasAHuggingFaceNameThatMapsBack) {
  const models::Model m = models::build_model(models::model_args("llama", "tiny", 256), 2, 8);
  std::set<std::string> seen;
  for (const auto& p : m.params) {
    const std::string hf = models::hf_name(p);
    ASSERT_FALSE(hf.empty()) << p;
    EXPECT_EQ(models::from_hf_name(hf), p);
    EXPECT_TRUE(seen.insert(hf).second) << hf;
  }
  EXPECT_EQ(models::hf_name("layers.1.feed_forward.w2.weight"), "model.layers.1.mlp.down_proj.weight");
  EXPECT_EQ(models::hf_name("rope.cos"), "");
  EXPECT_EQ(models::from_hf_name("model.layers.x.mlp.down_proj.weight"), "");
  EXPECT_EQ(models::from_hf_name("transformer.h.0.attn.c_attn.weight"), "");
}

}  // namespace
}  // namespace spmdx
