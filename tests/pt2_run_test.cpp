// Training an imported program as a user does: `spmdx run` on the examples' configs
// (examples/export/*.toml) with the fixtures of pt2_fixtures, real rank processes over ucx.
// Four ranks as fsdp 4, dp x tp (tp by plan), fsdp x tp and HSDP give the one-rank losses; bad
// files and configs fail before any rank starts; `spmdx import` says what a file holds.
// Hugging Face transformers models (tests/fixtures/hf_models.py) give the one-rank losses on
// fsdp 2, tp 2 and fsdp 2 x cp 2; its Mixtures of Experts give PyTorch's losses on 1 rank and fsdp 2.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <functional>
#include <map>
#include <tuple>

#include "run_util.h"

namespace spmdx {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::Not;

const fs::path kFixtures = PT2_FIXTURE_DIR;

using test::spmdx;

// `spmdx run` of an example's config on the fixture of that model, with the test's corpus.
test::CommandResult run_example(const std::string& model, const test::TempDir& dir, const std::string& name, int nproc, const std::string& flags,
                                const std::string& model_path = "") {
  const std::string path = model_path.empty() ? (kFixtures / (model + ".pt2")).string() : model_path;
  return spmdx("run '" SPMDX_SOURCE_DIR "/examples/export/" + model + ".toml' --nproc " + std::to_string(nproc) + " --model.path '" + path +
               "' --data.paths '" + (dir / "corpus.txt").string() + "' --training.steps 4 --job.dump_folder '" + (dir / name).string() + "' " + flags);
}

// A layout of a run: its name (the dump folder), its rank count and its flags.
struct Layout {
  std::string name;
  int nproc;
  std::string flags;
};

// Runs `one` (one rank) and then each of `layouts` by `run` in `dir`: each layout's losses equal
// the one-rank losses <= 1e-5 relative. Every run's output goes to `outputs` (by layout name)
// for what a caller checks beyond the losses.
void expect_losses_of_one_rank(const std::string& model, const test::TempDir& dir, const Layout& one, const std::vector<Layout>& layouts,
                               const std::function<test::CommandResult(const Layout&)>& run, std::map<std::string, std::string>* outputs = nullptr) {
  auto first = run(one);
  ASSERT_EQ(first.exit_code, 0) << model << " " << one.name << "\n" << first.output;
  const auto want = test::losses(dir / one.name / "metrics.jsonl");
  ASSERT_EQ(want.size(), 4u) << model;
  EXPECT_LT(want.back(), want.front()) << model;
  for (const auto& layout : layouts) {
    auto r = run(layout);
    ASSERT_EQ(r.exit_code, 0) << model << " " << layout.name << "\n" << r.output;
    if (outputs != nullptr) (*outputs)[layout.name] = r.output;
    const auto got = test::losses(dir / layout.name / "metrics.jsonl");
    ASSERT_EQ(got.size(), want.size()) << model << " " << layout.name;
    for (std::size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(got[i], want[i], 1e-5 * std::abs(want[i])) << model << " " << layout.name << " step " << i + 1;
  }
}

class Pt2Run : public ::testing::TestWithParam<std::string> {};

TEST_P(Pt2Run, FourRanksGiveTheLossesOfOneRank) {
  test::TempDir dir;
  test::corpus_file(dir);
  const std::string model = GetParam();
  const std::vector<Layout> layouts = {
      {"fsdp4", 4, "--parallelism.data_parallel_shard_degree 4 --parallelism.tensor_parallel_degree 1"},
      {"dp2xtp2", 4, "--parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 2"},
      {"fsdp2xtp2", 4, "--parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 2"},
      {"hsdp2x2", 4, "--parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 1"},
      // Context parallelism on an exported program: its sequence split in order (it makes its
      // own positions), attention's query rows split.
      {"fsdp2xcp2", 4, "--parallelism.data_parallel_shard_degree 2 --parallelism.context_parallel_degree 2 --parallelism.tensor_parallel_degree 1"},
  };
  std::map<std::string, std::string> outputs;
  expect_losses_of_one_rank(
      model, dir, {"one", 1, "--parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 1"}, layouts,
      [&](const Layout& l) { return run_example(model, dir, l.name, l.nproc, l.flags); }, &outputs);
  EXPECT_THAT(outputs["fsdp2xcp2"], HasSubstr("in order (an imported program makes its own positions); attention: 2 of 2 split their query rows"));
}

// gpt2: a tied embedding and a plan of its own; torchtitan_llama: logits with cross entropy
// appended, complex rotary, GQA; hf_llama: the built-in plan's Hugging Face names.
// transformers_qwen3: transformers' own Qwen3 as it exports by default (sdpa under its mask).
INSTANTIATE_TEST_SUITE_P(Examples, Pt2Run, ::testing::Values("gpt2", "torchtitan_llama", "hf_llama", "transformers_qwen3"));

// A fixture's one-rank losses on fsdp 2, tp 2 by a written plan ("": the built-in plan) and
// fsdp 2 x cp 2, after `compile` plans it: a config written around tests/fixtures/<fixture>.py's
// export.
void expect_layouts_give_one_rank_losses(const std::string& fixture, const std::string& tp_plan) {
  test::TempDir dir;
  test::corpus_file(dir);
  const fs::path config = dir / (fixture + ".toml");
  test::write_file(config, "[model]\nname = \"pt2\"\npath = \"" + (kFixtures / (fixture + ".pt2")).string() +
                               "\"\ntokenizer = \"byte\"\n[training]\nsteps = 4\n[optimizer]\nlr = 3e-3\n[data]\npaths = [\"" +
                               (dir / "corpus.txt").string() + "\"]\n[parallelism.tp_plan]\n" + tp_plan);
  const Layout one = {"one", 1, "--parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 1"};
  auto planned = spmdx("compile '" + config.string() + "' " + one.flags);
  ASSERT_EQ(planned.exit_code, 0) << planned.output;
  EXPECT_THAT(planned.output, HasSubstr("planned peak memory"));
  const std::vector<Layout> layouts = {
      {"fsdp2", 2, "--parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 1"},
      {"tp2", 2, "--parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 2"},
      {"fsdp2xcp2", 4, "--parallelism.data_parallel_shard_degree 2 --parallelism.context_parallel_degree 2 --parallelism.tensor_parallel_degree 1"},
  };
  expect_losses_of_one_rank(fixture, dir, one, layouts, [&](const Layout& l) {
    return spmdx("run '" + config.string() + "' --nproc " + std::to_string(l.nproc) + " --job.dump_folder '" + (dir / l.name).string() + "' " + l.flags);
  });
}

// Zero-size dims (tests/fixtures/zero_width.py: Phi3's full rotary slices q[..., 8:] of width 0
// and concatenates it back; planning once divided by that 0 and died with SIGFPE), with a fused
// qkv split, chunk and unbind under tp.
TEST(Pt2RunHuggingFaceOps, ZeroSizeDimsTrainOnEveryLayout) {
  expect_layouts_give_one_rank_losses("zero_width", "\"*.qkv.weight\" = \"colwise\"\n\"*.o.weight\" = \"rowwise\"\n"
                                                    "\"*.up.weight\" = \"colwise\"\n\"*.down.weight\" = \"rowwise\"\n");
}

// GPT-2's Conv1D (addmm, weight [in, out]: column-parallel is shard(1) of the weight and shard(0)
// of the bias), baddbmm, tanh and padding_idx (tests/fixtures/hf_ops.py).
TEST(Pt2RunHuggingFaceOps, AddmmTanhAndPaddingIdxTrainOnEveryLayout) {
  expect_layouts_give_one_rank_losses("hf_ops", "\"*.c_fc.weight\" = \"shard(1)\"\n\"*.c_fc.bias\" = \"shard(0)\"\n\"*.c_proj.weight\" = \"shard(0)\"\n");
}

// Hugging Face models as transformers exports them by default (tests/fixtures/hf_models.py): sdpa
// with the mask transformers builds (causal: the causal kernel), tensor parallel by the built-in
// plan's Hugging Face names under the wrapper's prefix; Qwen3's q/k norms per head.
TEST(Pt2RunHuggingFaceOps, TransformersLlamaAndQwen3TrainOnEveryLayout) {
  expect_layouts_give_one_rank_losses("transformers_llama", "");
  expect_layouts_give_one_rank_losses("transformers_qwen3", "");
}

// Mistral with a sliding window of 8 tokens over 32: the band mask (a constant) becomes sdpa with
// window 8, the tiled window kernel, on every layout (context parallelism's positions too).
TEST(Pt2RunHuggingFaceOps, TransformersSlidingWindowTrainsOnEveryLayout) {
  test::TempDir dir;
  test::corpus_file(dir);
  test::write_file(dir / "mistral.toml", "[model]\nname = \"pt2\"\npath = \"" + (kFixtures / "transformers_mistral.pt2").string() +
                                             "\"\ntokenizer = \"byte\"\n[data]\npaths = [\"" + (dir / "corpus.txt").string() + "\"]\n");
  auto r = spmdx("compile '" + (dir / "mistral.toml").string() + "' --parallelism.data_parallel_shard_degree 1 --dump '" + (dir / "plan").string() + "'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string graph = test::read_file(dir / "plan" / "logical.txt");
  int windowed = 0;
  for (std::size_t at = graph.find("= sdpa("); at != std::string::npos; at = graph.find("= sdpa(", at + 1)) {
    windowed += graph.substr(at, graph.find('\n', at) - at).find("window=8") != std::string::npos;
  }
  EXPECT_EQ(windowed, 2);  // both layers
  EXPECT_THAT(graph, Not(HasSubstr("softmax(")));  // no general masked attention left
  expect_layouts_give_one_rank_losses("transformers_mistral", "");
}

// torch's sdpa with an explicit sliding-window attn_mask, boolean and additive, beside a causal
// layer (tests/fixtures/sliding_window.py): the window kernel on fsdp 2, tp 2 and cp 2.
TEST(Pt2RunHuggingFaceOps, SlidingWindowMaskTrainsOnEveryLayout) {
  expect_layouts_give_one_rank_losses("sliding_window", "\"*.qkv.weight\" = \"colwise\"\n\"*.o.weight\" = \"rowwise\"\n");
}

// The other architectures of tests/fixtures/hf_models.py, one test each (so that ctest -j2 runs
// them side by side: each is 5 spmdx processes, 6 to 12 s with ctest -j2 on 2 busy cores), tensor
// parallel by the built-in plan's Hugging Face names (no plan written):
// - qwen2 (q/k/v biases), gemma2 (soft-capping, padding_idx, eager attention), olmo2 (q/k norms
//   over the whole projection, sharded under tp).
// - gpt2: Conv1D (addmm, weight [in, out]): the built-in plan's c_attn, c_fc, c_proj, Megatron's
//   split as shard(d), column-parallel being shard(1) of the weight and shard(0) of its bias;
//   c_attn's fused q/k/v splits after the shard.
// - phi3: the built-in plan's fused qkv_proj and gate_up_proj; the full rotary's zero-width
//   slices pass through.
class Pt2RunTransformers : public ::testing::TestWithParam<std::string> {};
TEST_P(Pt2RunTransformers, FsdpTpAndCpGiveTheOneRankLosses) { expect_layouts_give_one_rank_losses(GetParam(), ""); }
INSTANTIATE_TEST_SUITE_P(Defaults, Pt2RunTransformers,
                         ::testing::Values("transformers_qwen2", "transformers_gemma2", "transformers_olmo2", "transformers_gpt2", "transformers_phi3"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param.substr(std::string("transformers_").size()); });

// transformers' Mixtures of Experts (tests/fixtures/hf_models.py: Qwen3-MoE and Mixtral, 4
// experts, top 2, each in the default experts implementation, whose grouped GEMM exports as the
// custom op transformers.grouped_mm_fallback, and in "batched_mm") train as PyTorch trains the
// same model on the same batches: `spmdx run` for 5 steps on 1 rank and on fsdp 2 (2 processes),
// then hf_models.py --train-on (torch.optim.AdamW with spmdx's default hyperparameters, on the
// global batches the one-rank run dumped, which fsdp 2's equal): every loss within 1e-5 relative
// of PyTorch's. Routing is a topk: a float32 near-tie could flip a token's expert; none does here.
// Then the same with expert parallelism 2 (`parallelism.expert_parallel_degree 2`): each layer's
// experts module replaced by spmdx's expert-parallel form (2 of the 4 experts a rank, tokens
// exchanged by all_to_all_v), whichever experts implementation exported it; and EP 2 carved from
// dp_shard 4 (4 processes: the experts also FSDP-sharded over efsdp 2).
class Pt2RunTransformersMoe : public ::testing::TestWithParam<std::string> {};
TEST_P(Pt2RunTransformersMoe, OneRankAndFsdp2TrainAsPyTorch) {
  test::TempDir dir;
  test::corpus_file(dir);
  const std::string arch = GetParam();
  const fs::path config = dir / "moe.toml";
  test::write_file(config, "[model]\nname = \"pt2\"\npath = \"" + (kFixtures / ("transformers_" + arch + ".pt2")).string() +
                               "\"\ntokenizer = \"byte\"\n[training]\nsteps = 5\n[data]\npaths = [\"" + (dir / "corpus.txt").string() + "\"]\n");
  const std::vector<Layout> layouts = {{"one", 1, "--parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 1"},
                                       {"fsdp2", 2, "--parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 1"},
                                       {"ep2", 2, "--parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 1 --parallelism.expert_parallel_degree 2"},
                                       {"ep2_efsdp2", 4, "--parallelism.data_parallel_shard_degree 4 --parallelism.tensor_parallel_degree 1 --parallelism.expert_parallel_degree 2"}};
  for (const auto& l : layouts) {
    auto r = spmdx("run '" + config.string() + "' --nproc " + std::to_string(l.nproc) + " --job.dump_folder '" + (dir / l.name).string() +
                   "' --debug.dump_batches true " + l.flags);
    ASSERT_EQ(r.exit_code, 0) << l.name << "\n" << r.output;
    if (l.name == "ep2") {  // each layer's experts module replaced by the expert-parallel form: 2 of the 4 experts a rank, tokens moved
      EXPECT_THAT(r.output, HasSubstr("expert parallelism: ep 2 over dp_shard, 2 of 4 experts a rank")) << r.output;
      EXPECT_THAT(test::read_file(dir / l.name / "metrics.jsonl"), HasSubstr("\"moe_load_imbalance\""));
    }
  }
  for (const char* layout : {"fsdp2", "ep2", "ep2_efsdp2"}) {
    for (int step = 1; step <= 5; ++step) {
      const std::string batch = "debug/batches/step-" + std::to_string(step) + ".tokens.npy";
      EXPECT_EQ(test::read_file(dir / layout / batch), test::read_file(dir / "one" / batch)) << layout << " step " << step;
    }
  }
  auto torch = test::run_command("'" SPMDX_PYTHON "' '" SPMDX_SOURCE_DIR "/tests/fixtures/hf_models.py' " + arch + " --train-on '" + (dir / "one").string() + "'");
  ASSERT_EQ(torch.exit_code, 0) << torch.output;
  const auto want = nlohmann::json::parse(test::read_file(dir / "one" / "pytorch_losses.json"))["losses"].get<std::vector<double>>();
  ASSERT_EQ(want.size(), 5u);
  EXPECT_LT(want.back(), want.front());
  for (const auto& l : layouts) {
    const auto got = test::losses(dir / l.name / "metrics.jsonl");
    ASSERT_EQ(got.size(), want.size()) << l.name;
    double largest = 0;
    for (std::size_t i = 0; i < want.size(); ++i) {
      largest = std::max(largest, std::abs(got[i] - want[i]) / std::abs(want[i]));
      EXPECT_NEAR(got[i], want[i], 1e-5 * std::abs(want[i])) << l.name << " step " << i + 1;
    }
    std::printf("%s %s: 5 losses against PyTorch, largest relative difference %.2e\n", arch.c_str(), l.name.c_str(), largest);
  }
}
INSTANTIATE_TEST_SUITE_P(Defaults, Pt2RunTransformersMoe, ::testing::Values("qwen3_moe", "qwen3_moe_batched_mm", "mixtral", "mixtral_batched_mm"));

// An experts module of transformers' form that computes something else (silu(up) * gate:
// tests/fixtures/hf_models.py mixtral_swapped_experts) is not replaced by SwiGLU experts: expert
// parallelism runs the module's nodes on a sample, finds the difference and refuses, naming the
// module and the key; without expert parallelism the export maps op by op and compiles.
TEST(Pt2RunHuggingFaceOps, ExpertParallelismRefusesExpertsThatAreNotSwiGlu) {
  const std::string model = (kFixtures / "transformers_mixtral_swapped_experts.pt2").string();
  auto r = spmdx("compile '" SPMDX_SOURCE_DIR "/examples/export/transformers_qwen3_moe.toml' --model.path '" + model +
                 "' --world-size 2 --parallelism.expert_parallel_degree 2");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.output, HasSubstr("parallelism.expert_parallel_degree 2 on the experts module 'model.model.layers.0.mlp.experts' (SwappedExperts)")) << r.output;
  EXPECT_THAT(r.output, HasSubstr("compute something other than SwiGLU experts")) << r.output;
  auto plain = spmdx("compile '" SPMDX_SOURCE_DIR "/examples/export/transformers_qwen3_moe.toml' --model.path '" + model +
                     "' --world-size 2 --parallelism.expert_parallel_degree 1");
  EXPECT_EQ(plain.exit_code, 0) << plain.output;
}

// Expert parallelism on an export without experts (transformers' dense Qwen3) is refused naming
// the key and what it applies to, before any rank starts training.
TEST(Pt2RunHuggingFaceOps, ExpertParallelismOnADenseExportIsRefused) {
  test::TempDir dir;
  test::corpus_file(dir);
  const fs::path config = dir / "dense.toml";
  test::write_file(config, "[model]\nname = \"pt2\"\npath = \"" + (kFixtures / "transformers_qwen3.pt2").string() +
                               "\"\ntokenizer = \"byte\"\n[training]\nsteps = 1\n[data]\npaths = [\"" + (dir / "corpus.txt").string() + "\"]\n");
  auto r = spmdx("run '" + config.string() + "' --nproc 2 --job.dump_folder '" + (dir / "out").string() +
                 "' --parallelism.data_parallel_shard_degree 2 --parallelism.expert_parallel_degree 2");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.output, HasSubstr("parallelism.expert_parallel_degree 2: the program has no experts module to place")) << r.output;
  EXPECT_THAT(r.output, HasSubstr("transformers_qwen3.pt2")) << r.output;
}

// The built-in tensor-parallel plan matches a wrapped model's names: transformers' lm_head under
// the wrapper's prefix (`model.lm_head.weight`) is column-parallel, not kept whole.
TEST(Pt2RunHuggingFaceOps, BuiltInPlanShardsAWrappedLmHead) {
  test::TempDir dir;
  test::corpus_file(dir);
  test::write_file(dir / "llama.toml", "[model]\nname = \"pt2\"\npath = \"" + (kFixtures / "transformers_llama.pt2").string() +
                                           "\"\ntokenizer = \"byte\"\n[data]\npaths = [\"" + (dir / "corpus.txt").string() + "\"]\n");
  auto r = spmdx("compile '" + (dir / "llama.toml").string() + "' --parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 2 --dump '" +
                 (dir / "plan").string() + "'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string plan = test::read_file(dir / "plan" / "plan.txt");
  EXPECT_THAT(plan, HasSubstr("input %model.lm_head.weight: S(0) f32[264, 64]"));
  EXPECT_THAT(plan, HasSubstr("input %model.model.embed_tokens.weight: S(1) f32[264, 64]"));
  EXPECT_THAT(plan, HasSubstr("input %model.model.layers.0.self_attn.q_proj.weight: S(0)"));
  EXPECT_THAT(r.output, Not(HasSubstr("whole on every tp rank")));
  // A written plan that leaves large weights whole says so, naming each (the 1-D norms are not
  // named: they are tp's design, and small).
  test::write_file(dir / "zero.toml", "[model]\nname = \"pt2\"\npath = \"" + (kFixtures / "zero_width.pt2").string() +
                                          "\"\ntokenizer = \"byte\"\n[data]\npaths = [\"" + (dir / "corpus.txt").string() +
                                          "\"]\n[parallelism.tp_plan]\n\"*.qkv.weight\" = \"colwise\"\n");
  auto partial = spmdx("compile '" + (dir / "zero.toml").string() + "' --parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 2");
  ASSERT_EQ(partial.exit_code, 0) << partial.output;
  EXPECT_THAT(partial.output, HasSubstr("warning: tensor_parallel on tp (2 ranks) keeps head.weight [264, 32] (27.0% of the model's parameters) whole on every tp rank"));
  EXPECT_THAT(partial.output, HasSubstr("keeps blocks.0.o.weight [32, 32]"));
  EXPECT_THAT(partial.output, Not(HasSubstr("keeps blocks.0.qkv.weight")));
  EXPECT_THAT(partial.output, Not(HasSubstr("norm.weight [32]")));
}

// The built-in plan knows GPT-2's Conv1D names and Phi-3's fused projections: under tp 2 every
// layer weight is sharded (no "whole on every tp rank" warning), Conv1D's column-parallel
// weights on dim 1 and their biases on dim 0.
TEST(Pt2RunHuggingFaceOps, BuiltInPlanShardsGpt2AndPhi3) {
  test::TempDir dir;
  test::corpus_file(dir);
  for (const std::string fixture : {"transformers_gpt2", "transformers_phi3"}) {
    SCOPED_TRACE(fixture);
    test::write_file(dir / "m.toml", "[model]\nname = \"pt2\"\npath = \"" + (kFixtures / (fixture + ".pt2")).string() +
                                         "\"\ntokenizer = \"byte\"\n[data]\npaths = [\"" + (dir / "corpus.txt").string() + "\"]\n");
    auto r = spmdx("compile '" + (dir / "m.toml").string() + "' --parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 2 --dump '" +
                   (dir / fixture).string() + "'");
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_THAT(r.output, Not(HasSubstr("whole on every tp rank"))) << r.output;
    const std::string plan = test::read_file(dir / fixture / "plan.txt");
    if (fixture == "transformers_gpt2") {
      EXPECT_THAT(plan, ::testing::ContainsRegex("input %[a-z_.]*h\\.0\\.attn\\.c_attn\\.weight: S\\(1\\)"));
      EXPECT_THAT(plan, ::testing::ContainsRegex("input %[a-z_.]*h\\.0\\.attn\\.c_attn\\.bias: S\\(0\\)"));
      EXPECT_THAT(plan, ::testing::ContainsRegex("input %[a-z_.]*h\\.0\\.mlp\\.c_proj\\.weight: S\\(0\\)"));
    } else {
      EXPECT_THAT(plan, ::testing::ContainsRegex("input %[a-z_.]*layers\\.0\\.self_attn\\.qkv_proj\\.weight: S\\(0\\)"));
      EXPECT_THAT(plan, ::testing::ContainsRegex("input %[a-z_.]*layers\\.0\\.mlp\\.gate_up_proj\\.weight: S\\(0\\)"));
    }
  }
}

// transformers' RMSNorm (LlamaRMSNorm and its copies: weight * (x * rsqrt(mean(x^2, -1) + eps)))
// imports as one rms_norm with its fused backward, not five elementwise ops and their
// gradients: the two norms of each of the 2 layers and the final one. (The numbers are checked
// against PyTorch by Pt2RunTransformers and the reference tests.)
TEST(Pt2RunHuggingFaceOps, TransformersRmsNormImportsAsOneOp) {
  test::TempDir dir;
  test::corpus_file(dir);
  test::write_file(dir / "llama.toml", "[model]\nname = \"pt2\"\npath = \"" + (kFixtures / "transformers_llama.pt2").string() +
                                           "\"\ntokenizer = \"byte\"\n[data]\npaths = [\"" + (dir / "corpus.txt").string() + "\"]\n");
  auto r = spmdx("compile '" + (dir / "llama.toml").string() + "' --parallelism.data_parallel_shard_degree 1 --dump '" + (dir / "plan").string() + "'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string graph = test::read_file(dir / "plan" / "logical.txt");
  auto count = [&](const std::string& what) {
    int n = 0;
    for (std::size_t at = graph.find(what); at != std::string::npos; at = graph.find(what, at + 1)) ++n;
    return n;
  };
  EXPECT_EQ(count(" = rms_norm("), 5) << graph;
  EXPECT_EQ(count(" = rms_norm_backward("), 5) << graph;
  EXPECT_EQ(count(" = rsqrt("), 0) << graph;
  EXPECT_EQ(count(" = pow_scalar("), 0) << graph;
}

// Gradient accumulation of an exported program: microbatches of its batch (8 rows); a global
// batch of 16 on 1, 2 and 4 ranks gives the same losses, and one that is no multiple of 8 is
// refused naming the export's rows.
TEST(Pt2RunAccumulation, MicrobatchesOfTheExportedBatchGiveTheSameLossesOnAnyMesh) {
  test::TempDir dir;
  test::corpus_file(dir);
  std::vector<std::vector<double>> runs;
  for (const auto& [nproc, local] : std::vector<std::pair<int, int>>{{1, 8}, {2, 4}, {4, 2}}) {
    const std::string name = "ranks" + std::to_string(nproc);
    auto r = run_example("gpt2", dir, name, nproc, "--parallelism.data_parallel_shard_degree " + std::to_string(nproc) +
                                                       " --parallelism.tensor_parallel_degree 1 --training.global_batch_size 16 --training.local_batch_size " +
                                                       std::to_string(local));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    EXPECT_THAT(r.output, HasSubstr("| accum 2"));
    runs.push_back(test::losses(dir / name / "metrics.jsonl"));
    ASSERT_EQ(runs.back().size(), 4u);
  }
  for (std::size_t k = 1; k < runs.size(); ++k) {
    for (std::size_t i = 0; i < runs[0].size(); ++i) EXPECT_NEAR(runs[k][i], runs[0][i], 1e-5 * runs[0][i]) << "run " << k << " step " << i + 1;
  }
  auto bad = run_example("gpt2", dir, "bad", 2, "--parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 1 --training.global_batch_size 12 "
                                                "--training.local_batch_size 4");
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_THAT(bad.output, HasSubstr("training.global_batch_size 12 is not a multiple of the 8 rows"));
}

// Bad files and configs: a clear error, exit 1, and no rank started (nothing in the dump folder).
TEST(Pt2RunErrors, BadInputFailsBeforeAnyRankStarts) {
  test::TempDir dir;
  test::corpus_file(dir);
  const fs::path bad = kFixtures / "bad";
  const std::vector<std::tuple<std::string, std::string, std::string, std::string>> cases = {
      // name, model path ("" = the fixture), flags, what the message must say
      {"dynamic", (bad / "gpt2.pt2").string(), "", "dynamic_shapes"},
      {"unsupported", (bad / "cumsum.pt2").string(), "--model.inputs tokens,labels", "aten.cumsum.default"},
      {"truncated", (bad / "truncated.pt2").string(), "", "truncated"},
      {"old", (bad / "old.pt2").string(), "", "torch 2.7 or older"},
      {"missing", (dir / "nope.pt2").string(), "", "no such file"},
      {"seq_len", "", "--training.seq_len 64", "training.seq_len 64, but"},
      {"batch", "", "--training.global_batch_size 16", "exported for a batch of 8 rows"},
      {"inputs", "", "--model.inputs tokens,labels", "model.inputs names 'tokens'"},
      {"plan_matches_nothing", "", "'--parallelism.tp_plan.transformer.h.*.attn.c_attn.wieght' colwise", "matches no parameter"},
      {"plan_style", "", "--parallelism.tp_plan.lm_head.weight diagonal", "\"diagonal\": the style must be"},
      {"plan_checked_without_tp", "", "--parallelism.tensor_parallel_degree 1 --parallelism.data_parallel_shard_degree 4 --parallelism.tp_plan.nomatch colwise", "matches no parameter"},
      {"batch_over_dp", "", "--parallelism.tensor_parallel_degree 1 --parallelism.data_parallel_shard_degree 3", "exported for a batch of 8 rows, which does not split over the 3"},
      {"path_without_pt2", "", "--model.name llama --model.flavor tiny", "model.path is set but model.name is \"llama\""},
      {"plan_does_not_divide", "", "--parallelism.data_parallel_shard_degree 1 --parallelism.tensor_parallel_degree 3 --parallelism.tp_plan.transformer.wpe.weight 'shard(1)'",
       "does not split evenly over tp=3"},
  };
  for (const auto& [name, path, flags, says] : cases) {
    auto r = run_example("gpt2", dir, name, name == "plan_does_not_divide" || name == "batch_over_dp" ? 3 : 4, flags, path);
    EXPECT_EQ(r.exit_code, 1) << name << "\n" << r.output;
    EXPECT_THAT(r.output, HasSubstr(says)) << name;
    EXPECT_THAT(r.output, Not(HasSubstr("[rank"))) << name;  // no rank started
    EXPECT_FALSE(fs::exists(dir / name / "metrics.jsonl")) << name;
  }
}

// Every construct spmdx cannot train in one list, from `spmdx run` and `spmdx import` alike:
// attention under a mask computed from the batch, cumsum and erf, each with node and source
// line (before, run named the first and import left the masked attention out).
TEST(Pt2RunErrors, EveryConstructThatCannotTrainIsListedOnce) {
  test::TempDir dir;
  test::corpus_file(dir);
  const std::string path = (kFixtures / "bad" / "several.pt2").string();
  test::write_file(dir / "several.toml", "[model]\nname = \"pt2\"\npath = \"" + path + "\"\ntokenizer = \"byte\"\n[data]\npaths = [\"" +
                                             (dir / "corpus.txt").string() + "\"]\n");
  auto run = spmdx("run '" + (dir / "several.toml").string() + "' --job.dump_folder '" + (dir / "out").string() + "'");
  auto import = spmdx("import '" + path + "'");
  EXPECT_EQ(run.exit_code, 1) << run.output;
  EXPECT_EQ(import.exit_code, 1) << import.output;
  EXPECT_THAT(run.output, HasSubstr("4 nodes spmdx cannot train"));
  for (const auto* out : {&run.output, &import.output}) {
    EXPECT_THAT(*out, HasSubstr("aten.scaled_dot_product_attention.default at node 'scaled_dot_product_attention': make_pt2_fixtures.py:"));
    EXPECT_THAT(*out, HasSubstr("a mask computed from the batch"));
    EXPECT_THAT(*out, HasSubstr("aten.cumsum.default at node 'cumsum': make_pt2_fixtures.py:"));
    EXPECT_THAT(*out, HasSubstr("aten.special_erf.default at node 'special_erf'"));
    EXPECT_THAT(*out, HasSubstr("aten.gt.Scalar at node 'gt'"));
  }
  EXPECT_FALSE(fs::exists(dir / "out" / "metrics.jsonl"));
}

// A parameter of one row (gated.pt2's gate [1]) cannot be cut over fsdp 2: the run says so on the
// line after its first, naming it, why and what it costs, and trains.
TEST(Pt2RunFsdp, AParameterShorterThanTheDegreeIsSaidToBeKeptWholeAfterTheFirstLine) {
  test::TempDir dir;
  auto r = spmdx("run '" SPMDX_SOURCE_DIR "/configs/llama_debug.toml' --nproc 2 --model.name pt2 --model.path '" + (kFixtures / "gated.pt2").string() +
                 "' --training.global_batch_size 2 --training.seq_len 8 --parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 1 "
                 "--training.steps 2 --data.paths '" + test::corpus_file(dir) + "' --job.dump_folder '" + (dir / "out").string() + "'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto first = r.output.find("[rank 0] spmdx: pt2 ");
  ASSERT_NE(first, std::string::npos) << r.output;
  const auto next = r.output.find('\n', first) + 1;
  EXPECT_EQ(r.output.substr(next, r.output.find('\n', next) - next),
            "[rank 0] warning: fsdp on dp_shard (2 ranks) keeps 1 parameter (4.0 B) whole on every rank, not sharded: its dim 0 is shorter than 2 (gate [1]); "
            "that costs each rank 8.0 B more than an even share of them (parameters, gradients and AdamW state: 4 x 4.0 B, less 1/2 of it; FSDP2 would pad them "
            "and leave some ranks an empty shard)");
  EXPECT_EQ(test::losses(dir / "out" / "metrics.jsonl").size(), 2u);
}

TEST(Pt2Import, SummaryNamesParametersOpsAndUnsupportedNodes) {
  auto ok = spmdx("import '" + (kFixtures / "gpt2.pt2").string() + "'");
  EXPECT_EQ(ok.exit_code, 0) << ok.output;
  EXPECT_THAT(ok.output, HasSubstr("parameters: 28 tensors, 121088 elements"));
  EXPECT_THAT(ok.output, HasSubstr("tied: lm_head.weight = transformer.wte.weight"));
  EXPECT_THAT(ok.output, HasSubstr("aten.linear.default x9"));
  EXPECT_THAT(ok.output, HasSubstr("imports: "));
  auto json = spmdx("import --json '" + (kFixtures / "torchtitan_llama.pt2").string() + "'");
  ASSERT_EQ(json.exit_code, 0) << json.output;
  const auto j = nlohmann::json::parse(json.output);
  EXPECT_EQ(j["parameter_count"].get<std::int64_t>(), 120128);
  EXPECT_EQ(j["ops"]["aten.view_as_complex.default"].get<int>(), 4);
  EXPECT_TRUE(j["imports"].get<bool>());
  auto graph = spmdx("import --graph '" + (kFixtures / "torchtitan_llama.pt2").string() + "'");
  EXPECT_EQ(graph.exit_code, 0);
  EXPECT_THAT(graph.output, HasSubstr("rotary_embedding("));
  auto bad = spmdx("import '" + (kFixtures / "bad" / "cumsum.pt2").string() + "'");
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_THAT(bad.output, HasSubstr("aten.cumsum.default at node 'cumsum': make_pt2_fixtures.py:"));
  auto corrupt = spmdx("import '" + (kFixtures / "bad" / "aoti.pt2").string() + "'");
  EXPECT_EQ(corrupt.exit_code, 1);
  EXPECT_THAT(corrupt.output, HasSubstr("AOTInductor"));
}

}  // namespace
}  // namespace spmdx
