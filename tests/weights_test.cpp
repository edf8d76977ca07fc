// Weights in and out (issue 20, item 4) as a user runs them: `spmdx export [--names hf]` and
// checkpoint.initial_load_path, through `spmdx run` with real rank processes. The loss of
// exported weights against a PyTorch Llama is tests/reference/hf_llama.py's.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstring>
#include <fstream>
#include <limits>
#include <functional>
#include <string>
#include <vector>

#include "run_util.h"
#include "spmdx/models/weights.h"

namespace spmdx {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::AllOf;
using ::testing::Not;

using test::spmdx;

// A tensor of a safetensors file, with its bytes.
struct Entry {
  std::string name, dtype;
  std::vector<std::int64_t> shape;
  std::string bytes;
};

std::vector<Entry> read_entries(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  const std::string all(std::istreambuf_iterator<char>(in), {});
  std::vector<Entry> out;
  for (const auto& t : models::read_safetensors_header(file)) out.push_back({t.name, t.dtype, t.shape, all.substr(t.offset, t.nbytes)});
  return out;
}

void write_entries(const fs::path& file, const std::vector<Entry>& entries) {
  nlohmann::json header = nlohmann::json::object();
  std::string data;
  for (const auto& e : entries) {
    header[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {data.size(), data.size() + e.bytes.size()}}};
    data += e.bytes;
  }
  const std::string h = header.dump();
  const std::uint64_t n = h.size();
  std::ofstream out(file, std::ios::binary);
  out.write(reinterpret_cast<const char*>(&n), 8);
  out << h << data;
}

// Trains `config` (with `args`) for `steps` steps with a checkpoint at the last; returns its
// step-N folder.
fs::path train(const test::TempDir& dir, const std::string& name, const std::string& config, const std::string& args, int steps) {
  const fs::path dump = dir / name;
  auto r = spmdx("run '" SPMDX_SOURCE_DIR "/configs/" + config + "' " + args + " --training.steps " + std::to_string(steps) +
                 " --checkpoint.enable true --checkpoint.interval " + std::to_string(steps) + " --job.dump_folder '" + dump.string() + "'");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return dump / "checkpoint" / ("step-" + std::to_string(steps));
}

void export_to(const fs::path& step, const fs::path& out, const std::string& args = "") {
  auto r = spmdx("export '" + step.string() + "' '" + out.string() + "' " + args);
  ASSERT_EQ(r.exit_code, 0) << r.output;
}

// The same weights, loaded on 1 rank and resharded onto fsdp x tp (2 x 2) and onto dp 2, give
// the same losses; the Hugging Face export loads to the same numbers as spmdx's own.
TEST(Weights, AnExportLoadsOntoAnyMeshWithTheLossesOfOneRank) {
  test::TempDir dir;
  const std::string data = test::corpus_file(dir);
  const std::string job = "--data.paths '" + data + "' --training.global_batch_size 8 --training.seq_len 32 --model.flavor tiny";
  const fs::path step = train(dir, "train", "llama_debug.toml", job + " --nproc 4", 3);
  export_to(step, dir / "w.safetensors");
  export_to(step, dir / "hf.safetensors", "--names hf");
  auto load = [&](const std::string& file, const std::string& mesh, const std::string& name) {
    auto r = spmdx("run '" SPMDX_SOURCE_DIR "/configs/llama_debug.toml' " + job + " " + mesh + " --training.steps 4 --checkpoint.initial_load_path '" +
                   (dir / file).string() + "' --job.dump_folder '" + (dir / name).string() + "'");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    return std::make_pair(test::losses(dir / name / "metrics.jsonl"), r.output);
  };
  const auto [one, one_out] = load("w.safetensors", "--nproc 1 --parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 1", "one");
  ASSERT_EQ(one.size(), 4u);
  EXPECT_THAT(one_out, HasSubstr("initial weights: 21 parameters from " + (dir / "w.safetensors").string() + " (1 file, spmdx names), resharded onto mesh "));
  EXPECT_THAT(one_out, HasSubstr("; not loaded, made from the config: rope.cos, rope.sin\n"));
  // Not the seeded start: a fresh run's first loss is near ln(264) = 5.58.
  auto fresh = spmdx("run '" SPMDX_SOURCE_DIR "/configs/llama_debug.toml' " + job + " --nproc 4 --training.steps 1 --job.dump_folder '" + (dir / "fresh").string() + "'");
  ASSERT_EQ(fresh.exit_code, 0) << fresh.output;
  EXPECT_GT(test::losses(dir / "fresh" / "metrics.jsonl")[0] - one[0], 0.05);
  // Hugging Face's sharded form: a folder of files, each with some of the tensors.
  const std::vector<Entry> hf = read_entries(dir / "hf.safetensors");
  fs::create_directories(dir / "sharded");
  write_entries(dir / "sharded" / "model-00001-of-00002.safetensors", std::vector<Entry>(hf.begin(), hf.begin() + 10));
  write_entries(dir / "sharded" / "model-00002-of-00002.safetensors", std::vector<Entry>(hf.begin() + 10, hf.end()));
  int runs = 0;
  for (const auto& [file, mesh] : {std::pair<std::string, std::string>{"w.safetensors", "--nproc 4"},
                                   {"hf.safetensors", "--nproc 4"},
                                   {"sharded", "--nproc 4"},
                                   {"hf.safetensors", "--nproc 2 --parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 1 "
                                                      "--parallelism.tensor_parallel_degree 1"}}) {
    const auto [got, out] = load(file, mesh, "run" + std::to_string(++runs));
    ASSERT_EQ(got.size(), one.size()) << file << " " << mesh;
    for (std::size_t i = 0; i < one.size(); ++i) EXPECT_NEAR(got[i], one[i], 1e-5 * std::abs(one[i])) << file << " " << mesh << " step " << i + 1;
  }
}

// Every kind of bad file is refused before any rank starts, naming the file and the tensor.
TEST(Weights, ABadInitialLoadPathIsRefusedBeforeAnyRankStartsNamingTheTensor) {
  test::TempDir dir;
  const std::string data = test::corpus_file(dir);
  const std::string job = "--data.paths '" + data + "' --training.global_batch_size 8 --training.seq_len 32";
  export_to(train(dir, "mlp", "mlp_dp.toml", job + " --nproc 2", 1), dir / "mlp.safetensors");
  const std::vector<Entry> good = read_entries(dir / "mlp.safetensors");
  ASSERT_EQ(good.size(), 3u);
  auto refused = [&](const std::function<void(std::vector<Entry>&)>& edit, const std::string& config = "mlp_dp.toml", const std::string& args = "--nproc 2",
                     const std::vector<Entry>* from = nullptr) {
    std::vector<Entry> entries = from ? *from : good;
    edit(entries);
    const fs::path file = dir / "bad.safetensors";
    write_entries(file, entries);
    auto r = spmdx("run '" SPMDX_SOURCE_DIR "/configs/" + config + "' " + job + " " + args + " --checkpoint.initial_load_path '" + file.string() +
                   "' --job.dump_folder '" + (dir / "bad").string() + "'");
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_THAT(r.output, Not(HasSubstr("[rank"))) << r.output;
    EXPECT_THAT(r.output, HasSubstr("checkpoint.initial_load_path")) << r.output;
    EXPECT_THAT(r.output, HasSubstr(file.string() + ": ")) << r.output;
    return r.output;
  };
  // The file's tensors in its header's (alphabetical) order.
  ASSERT_EQ(good[0].name, "output.weight");
  ASSERT_EQ(good[1].name, "tok_embeddings.weight");
  ASSERT_EQ(good[2].name, "w1.weight");
  EXPECT_THAT(refused([](auto& e) { e.erase(e.begin()); }), HasSubstr("missing tensor 'output.weight': mlp tiny needs it"));
  EXPECT_THAT(refused([](auto& e) { e.push_back({"w9.weight", "F32", {2}, std::string(8, '\0')}); }),
              HasSubstr("extra tensor 'w9.weight': mlp tiny has no such parameter"));
  EXPECT_THAT(refused([](auto& e) {
                e[2].shape = {191, 64};
                e[2].bytes.resize(191 * 64 * 4);
              }),
              AllOf(HasSubstr("tensor 'w1.weight' is [191, 64], but mlp tiny needs [192, 64]"), Not(HasSubstr("missing tensor 'w1.weight'"))));
  EXPECT_THAT(refused([](auto& e) { e[1].dtype = "I32"; }), HasSubstr("tensor 'tok_embeddings.weight' is I32: parameters load from floating-point tensors"));
  EXPECT_THAT(refused([](auto& e) { e[1].bytes.resize(4); }), HasSubstr("tensor 'tok_embeddings.weight': 4 bytes of data for F32 [264, 64], which needs 67584"));

  // Hugging Face names are named as the file has them, with spmdx's beside.
  export_to(train(dir, "llama", "llama_debug.toml", job + " --nproc 4 --model.flavor tiny", 1), dir / "hf.safetensors", "--names hf");
  const std::vector<Entry> hf = read_entries(dir / "hf.safetensors");
  const std::string llama = "llama_debug.toml", four = "--nproc 4 --model.flavor tiny";
  EXPECT_THAT(refused([](auto& e) { std::erase_if(e, [](const Entry& x) { return x.name == "model.layers.1.self_attn.q_proj.weight"; }); }, llama, four, &hf),
              HasSubstr("missing tensor 'model.layers.1.self_attn.q_proj.weight' (layers.1.attention.wq.weight): llama tiny needs it"));
  EXPECT_THAT(refused([](auto& e) { e.push_back({"model.layers.0.mlp.gate.weight", "F32", {2}, std::string(8, '\0')}); }, llama, four, &hf),
              HasSubstr("extra tensor 'model.layers.0.mlp.gate.weight': not a Hugging Face Llama parameter"));

  // A tensor in two files of a folder.
  fs::create_directories(dir / "twice");
  write_entries(dir / "twice" / "a.safetensors", good);
  write_entries(dir / "twice" / "b.safetensors", {good[2]});
  auto r = spmdx("run '" SPMDX_SOURCE_DIR "/configs/mlp_dp.toml' " + job + " --nproc 2 --checkpoint.initial_load_path '" + (dir / "twice").string() + "'");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("tensor 'w1.weight' is in both a.safetensors and b.safetensors")) << r.output;

  // Not a safetensors file at all; a folder without one; a path that is not there.
  test::write_file(dir / "text.safetensors", "hello, this is not a safetensors file");
  for (const auto& [path, says] : {std::pair<fs::path, std::string>{dir / "text.safetensors", "not a safetensors file"},
                                   {dir.path(), "is a folder with no .safetensors file in it"},
                                   {dir / "nowhere.safetensors", "does not exist"}}) {
    fs::create_directories(dir / "empty");
    const fs::path p = path == dir.path() ? dir / "empty" : path;
    auto r = spmdx("run '" SPMDX_SOURCE_DIR "/configs/mlp_dp.toml' " + job + " --nproc 2 --checkpoint.initial_load_path '" + p.string() + "'");
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_THAT(r.output, HasSubstr(says)) << r.output;
    EXPECT_THAT(r.output, Not(HasSubstr("[rank"))) << r.output;
  }
}

// What the format forbids is refused as the safetensors package refuses it: a name twice (the
// last would win), data_offsets that overlap, leave a gap, end before they begin, or leave bytes
// after the last tensor.
TEST(Weights, AHeaderTheFormatForbidsIsRefusedNamingTheTensor) {
  test::TempDir dir;
  auto raw = [&](const std::string& header, std::size_t data_bytes) {
    const fs::path file = dir / "raw.safetensors";
    const std::uint64_t n = header.size();
    std::ofstream out(file, std::ios::binary);
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << header << std::string(data_bytes, '\0');
    out.close();
    try {
      models::read_safetensors_header(file);
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_THAT(raw(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", 16),
              HasSubstr("its header names tensor 'a' twice"));
  EXPECT_THAT(raw(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8),
              HasSubstr("tensor 'b' starts at data byte 4, where the tensor before it still lies (overlapping data_offsets)"));
  EXPECT_THAT(raw(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})", 12),
              HasSubstr("tensor 'b' starts at data byte 8, where byte 4 was expected (a gap)"));
  EXPECT_THAT(raw(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 12), HasSubstr("8 bytes follow the last tensor's data"));
  EXPECT_THAT(raw(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", 8), HasSubstr("tensor 'a': data_offsets [8, 4) end before they begin"));
  EXPECT_EQ(raw(R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"BF16","shape":[2,1],"data_offsets":[4,8]}})", 8),
            "accepted");
}

// Weights that are not finite stop the ranks before the first step, naming the tensor and the
// file; a file mixing spmdx's and Hugging Face's names is said to, once.
TEST(Weights, NonFiniteWeightsAndMixedNamesAreNamed) {
  test::TempDir dir;
  const std::string data = test::corpus_file(dir);
  const std::string job = "--data.paths '" + data + "' --training.global_batch_size 8 --training.seq_len 32";
  const fs::path step = train(dir, "mlp", "mlp_dp.toml", job + " --nproc 2", 1);
  export_to(step, dir / "w.safetensors");
  std::vector<Entry> e = read_entries(dir / "w.safetensors");
  ASSERT_EQ(e[2].name, "w1.weight");
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(e[2].bytes.data() + 40, &nan, sizeof nan);
  write_entries(dir / "nan.safetensors", e);
  auto r = spmdx("run '" SPMDX_SOURCE_DIR "/configs/mlp_dp.toml' " + job + " --nproc 2 --job.dump_folder '" + (dir / "nan").string() +
                 "' --checkpoint.initial_load_path '" + (dir / "nan.safetensors").string() + "'");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("tensor 'w1.weight' in " + (dir / "nan.safetensors").string() + " holds NaN or infinite values")) << r.output;
  EXPECT_THAT(r.output, Not(HasSubstr("step    1 |")));

  const fs::path llama = train(dir, "llama", "llama_debug.toml", job + " --nproc 4 --model.flavor tiny", 1);
  export_to(llama, dir / "hf.safetensors", "--names hf");
  export_to(llama, dir / "ours.safetensors");
  std::vector<Entry> mixed = read_entries(dir / "ours.safetensors");
  for (const auto& x : read_entries(dir / "hf.safetensors")) {
    if (x.name == "lm_head.weight") mixed.push_back(x);
  }
  std::erase_if(mixed, [](const Entry& x) { return x.name == "output.weight"; });
  write_entries(dir / "mixed.safetensors", mixed);
  r = spmdx("run '" SPMDX_SOURCE_DIR "/configs/llama_debug.toml' " + job + " --nproc 4 --model.flavor tiny --checkpoint.initial_load_path '" +
            (dir / "mixed.safetensors").string() + "'");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("the files mix spmdx's names (20, e.g. 'layers.0.attention.wk.weight') with Hugging Face's (e.g. 'lm_head.weight')"));
  EXPECT_THAT(r.output, Not(HasSubstr("extra tensor"))) << r.output;
  EXPECT_THAT(r.output, Not(HasSubstr("missing tensor"))) << r.output;
}

// A job that has a checkpoint of its own resumes from it and never reads initial_load_path
// (as torchtitan's): the file may be gone by then.
TEST(Weights, AJobWithItsOwnCheckpointResumesAndIgnoresTheInitialWeights) {
  test::TempDir dir;
  const std::string data = test::corpus_file(dir);
  const std::string job = "run '" SPMDX_SOURCE_DIR "/configs/mlp_dp.toml' --nproc 2 --data.paths '" + data +
                          "' --training.global_batch_size 8 --training.seq_len 32 --checkpoint.enable true --checkpoint.interval 2 --job.dump_folder '" +
                          (dir / "job").string() + "' --checkpoint.initial_load_path '" + (dir / "w.safetensors").string() + "'";
  export_to(train(dir, "first", "mlp_dp.toml", "--nproc 2 --data.paths '" + data + "' --training.global_batch_size 8 --training.seq_len 32", 2),
            dir / "w.safetensors");
  auto r = spmdx(job + " --training.steps 2");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("initial weights: 3 parameters from"));
  fs::remove(dir / "w.safetensors");
  r = spmdx(job + " --training.steps 4");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("resumed from"));
  EXPECT_THAT(r.output, Not(HasSubstr("initial weights")));
  EXPECT_THAT(r.output, HasSubstr("checkpoint.initial_load_path " + (dir / "w.safetensors").string() + " not read: the job resumes from its own checkpoint"));
}

// The checkpoint folder rather than one of its steps: the newest step is named.
TEST(Weights, ExportOfACheckpointFolderNamesItsNewestStep) {
  test::TempDir dir;
  const fs::path step = train(dir, "mlp", "mlp_dp.toml", "--nproc 2 --data.paths '" + test::corpus_file(dir) +
                                                             "' --training.global_batch_size 8 --training.seq_len 32", 2);
  auto r = spmdx("export '" + step.parent_path().string() + "' '" + (dir / "x.safetensors").string() + "'");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr(" holds checkpoints, not one: name a step folder, e.g. " + step.string() + " (the newest)"));
}

// --names hf is for the built-in llama only.
TEST(Weights, ExportWithHuggingFaceNamesRefusesAModelThatIsNotLlama) {
  test::TempDir dir;
  const fs::path step = train(dir, "mlp", "mlp_dp.toml", "--nproc 2 --data.paths '" + test::corpus_file(dir) +
                                                             "' --training.global_batch_size 8 --training.seq_len 32", 1);
  auto r = spmdx("export '" + step.string() + "' '" + (dir / "x.safetensors").string() + "' --names hf");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("which has no Hugging Face Llama name: --names hf exports spmdx's built-in llama only"));
  EXPECT_FALSE(fs::exists(dir / "x.safetensors"));
}

}  // namespace
}  // namespace spmdx
