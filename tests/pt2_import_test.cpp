// Importing torch.export programs (.pt2) against PyTorch itself. The fixtures are written at
// test time by examples/export/*.py with the project's Python (the pt2_fixtures test, into
// PT2_FIXTURE_DIR): for each example model, PyTorch autograd's loss and gradients at the
// exported weights, and the losses of 10 torch.optim.AdamW steps with clipping and
// torchtitan's schedule. spmdx must match: loss and every gradient <= 1e-5 relative (f32), the
// 10 losses <= 1e-5. Then the bad inputs, each refused with a message naming what is wrong.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <map>
#include <fstream>

#include "spmdx/exec/executor.h"
#include "spmdx/exec/trainer.h"
#include "spmdx/ir/autodiff.h"
#include "spmdx/exec/pt2_import.h"
#include "spmdx/models/model.h"
#include "test_util.h"

namespace spmdx {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
namespace fs = std::filesystem;

const fs::path kDir = PT2_FIXTURE_DIR;

nlohmann::json reference(const std::string& model) {
  std::ifstream in(kDir / (model + ".reference.json"));
  if (!in) throw std::runtime_error("no fixture " + (kDir / (model + ".reference.json")).string() + ": run the pt2_fixtures test first");
  return nlohmann::json::parse(in);
}

models::Model import(const std::string& model, const std::string& suffix = ".pt2") {
  models::ModelArgs args = models::model_args("pt2", "", 0);
  args.path = (kDir / (model + suffix)).string();
  return models::import_pt2(args);
}

at::Tensor batch_tensor(const nlohmann::json& r, const char* key) {
  return at::tensor(r[key].get<std::vector<std::int64_t>>(), at::kLong).reshape({r["batch"].get<std::int64_t>(), r["seq"].get<std::int64_t>()});
}

class Pt2Model : public ::testing::TestWithParam<std::string> {};

// Loss and every parameter's gradient at the exported weights, as PyTorch autograd has them:
// from export().run_decompositions({}) and from export()'s training IR as is.
void expect_autograd_values(const std::string& model, const std::string& suffix) {
  SCOPED_TRACE(model + suffix);
  const nlohmann::json r = reference(model);
  models::Model m = import(model, suffix);
  std::vector<ir::Value*> params;
  for (const auto& p : m.params) params.push_back(m.graph.find_input(p));
  const auto grads = ir::gradients(m.graph, m.graph.find_output("loss"), params);
  for (std::size_t i = 0; i < grads.size(); ++i) m.graph.add_output("grad." + m.params[i], grads[i]);
  exec::TensorMap feed = exec::init_tensors(m, 0);
  feed["tokens"] = batch_tensor(r, "tokens");
  feed["labels"] = batch_tensor(r, "labels");
  const exec::TensorMap out = exec::Executor(m.graph).run(feed);
  const double loss = out.at("loss").item<double>();
  EXPECT_NEAR(loss, r["loss"].get<double>(), 1e-5 * std::abs(r["loss"].get<double>()));
  // The same parameters, in PyTorch's order (named_parameters: a tied weight once).
  EXPECT_EQ(m.params, r["parameters"].get<std::vector<std::string>>());
  // Relative to the gradient's largest entry, with a floor of 1e-3 of the largest of any
  // parameter: a gradient that is zero in exact arithmetic (a key bias under softmax) is noise
  // in both, and only its absolute size can be compared.
  std::map<std::string, at::Tensor> wants;
  double largest = 0;
  for (const auto& p : m.params) {
    wants[p] = at::tensor(r["grads"][p].get<std::vector<float>>()).reshape(m.graph.find_input(p)->meta().shape);
    largest = std::max(largest, wants[p].abs().max().item<double>());
  }
  for (const auto& p : m.params) {
    const at::Tensor& want = wants[p];
    const double scale = std::max(want.abs().max().item<double>(), 1e-3 * largest);
    EXPECT_LE((out.at("grad." + p) - want).abs().max().item<double>() / scale, 1e-5) << p;
  }
  std::printf("%s%s: loss %.6f (PyTorch %.6f), %zu parameters\n", model.c_str(), suffix.c_str(), loss, r["loss"].get<double>(), m.params.size());
}

TEST_P(Pt2Model, LossAndGradientsMatchPyTorchAutograd) { expect_autograd_values(GetParam(), ".pt2"); }
TEST_P(Pt2Model, TrainingIrAsExportedMatchesToo) { expect_autograd_values(GetParam(), ".training_ir.pt2"); }

// Ten AdamW steps with clipping and the warm-up/decay schedule, as torch.optim.AdamW runs them,
// each loss <= 1e-5 relative (the issue asks 5 steps; all 10 have been <= 2e-7).
void expect_adamw_steps(const std::string& model) {
  SCOPED_TRACE(model);
  const nlohmann::json r = reference(model);
  models::Model m = import(model);
  exec::TensorMap init = exec::init_tensors(m, 0);
  train::TrainStepConfig config;
  config.adamw = {r["beta1"].get<double>(), r["beta2"].get<double>(), r["eps"].get<double>(), r["weight_decay"].get<double>()};
  config.max_norm = r["max_norm"].get<double>();
  exec::Trainer trainer(std::move(m), config, init);
  const at::Tensor tokens = batch_tensor(r, "tokens"), labels = batch_tensor(r, "labels");
  const auto want = r["losses"].get<std::vector<double>>();
  const train::LrSchedule schedule{r["warmup_steps"].get<std::int64_t>(), r["steps"].get<std::int64_t>()};
  double largest = 0;  // the largest relative difference, printed
  for (std::size_t s = 0; s < want.size(); ++s) {
    const auto step = static_cast<std::int64_t>(s + 1);
    const double got = trainer.step(step, r["lr"].get<double>() * train::lr_factor(step, schedule), tokens, labels).loss;
    largest = std::max(largest, std::abs(got - want[s]) / std::abs(want[s]));
    EXPECT_NEAR(got, want[s], 1e-5 * std::abs(want[s])) << "step " << step;
  }
  std::printf("%s: %zu AdamW losses against PyTorch, largest relative difference %.2e\n", model.c_str(), want.size(), largest);
  EXPECT_LT(want.back(), want.front());  // it trains
}

TEST_P(Pt2Model, TenAdamWStepsMatchPyTorchEager) { expect_adamw_steps(GetParam()); }

// The examples, a minGPT-style model with hand-written attention and its causal mask applied
// by masked_fill, an additive mask and torch.where (tests/fixtures/masked_attention.py), and a
// Phi3-style model whose full rotary slices and concatenates zero-width tensors
// (tests/fixtures/zero_width.py: [8, 4, 16, 0]; planning once divided by that 0), and a
// GPT-2/Gemma-2-style model with addmm (Conv1D), baddbmm, tanh (gelu_new, logit soft-capping)
// and an embedding with padding_idx 0, whose row's gradient is zero (tests/fixtures/hf_ops.py).
// And torch's sdpa with a sliding-window attn_mask, boolean and additive, beside a causal layer
// (tests/fixtures/sliding_window.py): the reference is torch's masked sdpa. And a tiny token-choice
// Mixture of Experts routed by topk, a stable argsort, gather and scatter_add, beside a
// _grouped_mm over constant groups (tests/fixtures/moe_ops.py).
INSTANTIATE_TEST_SUITE_P(Examples, Pt2Model,
                         ::testing::Values("torchtitan_llama", "hf_llama", "gpt2", "masked_attention", "zero_width", "hf_ops", "sliding_window", "moe_ops"));

// The Mixture of Experts' aten ops map onto spmdx's MoE records (core/src/ops/moe.cpp):
// topk, argsort.stable (-> argsort), sort (-> argsort, its values gathered), gather,
// scatter_add and _grouped_mm (-> grouped_mm, its i32 offs a frozen input).
TEST(Pt2Import, MixtureOfExpertsOpsMapOntoTheMoeRecords) {
  for (const char* suffix : {".pt2", ".training_ir.pt2"}) {
    SCOPED_TRACE(suffix);
    models::Model m = import("moe_ops", suffix);
    std::map<std::string, int> count;
    for (const auto& n : m.graph.nodes()) ++count[n->op()];
    EXPECT_EQ(count["topk"], 1);
    EXPECT_EQ(count["argsort"], 2);
    EXPECT_EQ(count["gather"], 5);
    EXPECT_EQ(count["scatter_add"], 1);
    EXPECT_EQ(count["grouped_mm"], 1);
  }
}

// A constant mask that is causal within a window of W tokens becomes sdpa with window W (the
// tiled kernel); the causal mask stays the causal kernel, and nothing else is left as scores.
TEST(Pt2Import, SlidingWindowMasksBecomeTheWindowKernel) {
  for (const auto& [model, windows] : std::vector<std::pair<std::string, std::vector<std::int64_t>>>{{"sliding_window", {6, 0, 6}}, {"transformers_mistral", {8, 8}}}) {
    SCOPED_TRACE(model);
    models::Model m = import(model);
    std::vector<std::int64_t> got;
    for (const auto& n : m.graph.nodes()) {
      EXPECT_NE(n->op(), "softmax");
      if (n->op() == "sdpa") {
        EXPECT_TRUE(n->attr_bool("causal"));
        got.push_back(n->attr_int("window"));
      }
    }
    EXPECT_EQ(got, windows);
  }
}

// Hugging Face transformers models as exported with their defaults (tests/fixtures/hf_models.py,
// export().run_decompositions({}): their training IR wraps the rotary tables in
// higher_order.wrap_with_set_grad_enabled, which the importer does not inline yet):
// sdpa with the boolean mask transformers builds under export (a constant: causal here), q/k
// norms (Qwen3, OLMo2), q/k/v biases (Qwen2), soft-capping and padding_idx (Gemma 2), fused
// qkv/gate_up with full rotary and a zero-width pass-through (Phi3), a sliding window of 8 tokens
// (Mistral: the band mask as general masked attention).
class Pt2Transformers : public ::testing::TestWithParam<std::string> {};
TEST_P(Pt2Transformers, LossAndGradientsMatchPyTorchAutograd) { expect_autograd_values(GetParam(), ".pt2"); }
TEST_P(Pt2Transformers, TenAdamWStepsMatchPyTorchEager) { expect_adamw_steps(GetParam()); }
INSTANTIATE_TEST_SUITE_P(Defaults, Pt2Transformers,
                         ::testing::Values("transformers_llama", "transformers_qwen2", "transformers_qwen3", "transformers_gemma2", "transformers_gpt2", "transformers_phi3", "transformers_mistral",
                                           "transformers_olmo2", "transformers_qwen3_moe", "transformers_qwen3_moe_batched_mm", "transformers_mixtral",
                                           "transformers_mixtral_batched_mm"));

// transformers' Mixture of Experts (Qwen3-MoE, Mixtral: 2 MoE layers) onto spmdx's records. The
// default experts implementation: the slots sorted by expert (sort -> argsort), each slot's token
// (floor_divide -> floor_divide_scalar) and row (x[ids] -> embedding), the tokens per expert
// (histc of the float ids -> bincount) and their running sum (cumsum), two
// transformers.grouped_mm_fallback -> grouped_mm per layer, the inverse order (index_put of
// arange over empty_like -> scatter_add) and the rows put back by it (embedding). "batched_mm":
// each token copied per expert (repeat_interleave -> expand), each slot's expert weights
// (gate_up_proj[ids], down_proj[ids] -> embedding) and a bmm (matmul) per projection.
TEST(Pt2Import, TransformersMixturesOfExpertsMapOntoTheMoeRecords) {
  for (const char* arch : {"transformers_qwen3_moe", "transformers_mixtral"}) {
    for (const std::string suffix : {"", "_batched_mm"}) {
      SCOPED_TRACE(arch + suffix);
      models::Model m = import(arch + suffix);
      std::map<std::string, int> count;
      for (const auto& n : m.graph.nodes()) ++count[n->op()];
      EXPECT_EQ(count["topk"], 2);
      if (suffix.empty()) {
        EXPECT_EQ(count["grouped_mm"], 4);
        EXPECT_EQ(count["argsort"], 2);
        EXPECT_EQ(count["floor_divide_scalar"], 2);
        EXPECT_EQ(count["bincount"], 2);
        EXPECT_EQ(count["cumsum"], 2);
        EXPECT_EQ(count["scatter_add"], 2);
        EXPECT_EQ(count["zeros_like"], 2);
        EXPECT_EQ(count["embedding"], 1 + 2 * 3);  // the tokens', then per layer: tokens by slot, scores by slot, slots by token
        EXPECT_EQ(count["matmul"], 0);
      } else {
        EXPECT_EQ(count["grouped_mm"], 0);
        EXPECT_EQ(count["argsort"], 0);
        EXPECT_EQ(count["embedding"], 1 + 2 * 2);  // the tokens', then per layer: gate_up_proj and down_proj by slot
        EXPECT_EQ(count["matmul"], 4);
      }
    }
  }
}

// GPT-2's output layer is its token embedding: one parameter, used twice, its gradient the sum.
TEST(Pt2Import, TiedWeightIsOneParameter) {
  models::Model m = import("gpt2");
  EXPECT_THAT(m.params, ::testing::Contains("transformer.wte.weight"));
  EXPECT_THAT(m.params, ::testing::Not(::testing::Contains("lm_head.weight")));
  int uses = 0;
  for (const auto& u : m.graph.find_input("transformer.wte.weight")->uses()) uses += u.user->op() == "embedding" || u.user->op() == "linear";
  EXPECT_EQ(uses, 2);
  const models::Pt2Summary s = models::summarize_pt2((kDir / "gpt2.pt2").string());
  ASSERT_EQ(s.tied.size(), 1u);
  EXPECT_EQ(s.tied[0], std::make_pair(std::string("lm_head.weight"), std::string("transformer.wte.weight")));
  EXPECT_EQ(s.parameter_count(), reference("gpt2")["grads"].size() > 0 ? 121088 : 0);
}

// A parameter exported with requires_grad=False is frozen, as AdamW leaves it in PyTorch.
TEST(Pt2Import, FrozenParameterIsNotTrained) {
  models::Model m = import("frozen");
  EXPECT_EQ(m.params, (std::vector<std::string>{"head.weight", "head.bias"}));
  ASSERT_NE(m.graph.find_input("emb.weight"), nullptr);
  EXPECT_FALSE(m.graph.find_input("emb.weight")->meta().requires_grad);
  // spmdx import says the same: the frozen parameter is listed with the buffers.
  const models::Pt2Summary s = models::summarize_pt2((kDir / "frozen.pt2").string());
  ASSERT_EQ(s.parameters.size(), 2u);
  ASSERT_EQ(s.buffers.size(), 1u);
  EXPECT_EQ(s.buffers[0].name, "emb.weight");
}

// torchtitan's complex rotary embedding becomes the IR's rotary_embedding; HF's half-split
// rotary maps op by op with its cos/sin tables computed once at import.
TEST(Pt2Import, RotaryPatternsMap) {
  models::Model t = import("torchtitan_llama");
  int rotary = 0;
  for (const auto& n : t.graph.nodes()) rotary += n->op() == "rotary_embedding";
  EXPECT_EQ(rotary, 4);  // q and k in 2 layers
  models::Model h = import("hf_llama");
  int consts = 0;
  for (const auto* v : h.graph.inputs()) consts += v->name().rfind("const.", 0) == 0;
  EXPECT_GE(consts, 2);  // cos and sin, folded
  EXPECT_EQ(h.graph.find_input("model.rotary_emb.inv_freq"), nullptr);  // only used to fold them
}

// The built-in llama with model.attn_mask_type = "block_causal" (documents from the batch's EOS
// tokens, the tiled kernel) at the weights, rotary tables and batch of a torchtitan-style Llama
// in PyTorch given torchtitan's block-causal mask explicitly (tests/fixtures/block_causal.py):
// the same loss and every gradient.
TEST(BuiltInLlama, BlockCausalMatchesPyTorchWithAnExplicitMask) {
  const nlohmann::json r = reference("block_causal");
  models::ModelArgs args = models::model_args("llama", "tiny", r["vocab"].get<std::int64_t>());
  args.dim = r["dim"].get<std::int64_t>(), args.n_layers = r["layers"].get<std::int64_t>(), args.n_heads = r["heads"].get<std::int64_t>();
  args.n_kv_heads = r["kv_heads"].get<std::int64_t>(), args.ffn_hidden = r["ffn"].get<std::int64_t>();
  args.attn_mask_type = "block_causal", args.eos_id = r["eos"].get<std::int64_t>();
  models::Model m = models::build_model(args, r["batch"].get<std::int64_t>(), r["seq"].get<std::int64_t>());
  int documents = 0;
  for (const auto& n : m.graph.nodes()) {
    if (n->op() == "sdpa") documents += n->inputs().size() == 4;
  }
  EXPECT_EQ(documents, args.n_layers);
  std::vector<ir::Value*> params;
  for (const auto& p : m.params) params.push_back(m.graph.find_input(p));
  const auto grads = ir::gradients(m.graph, m.graph.find_output("loss"), params);
  for (std::size_t i = 0; i < grads.size(); ++i) m.graph.add_output("grad." + m.params[i], grads[i]);
  exec::TensorMap feed;
  auto table = [&](const char* key) { return at::tensor(r[key].get<std::vector<float>>()).reshape(m.graph.find_input("rope.cos")->meta().shape); };
  feed["rope.cos"] = table("rope_cos");
  feed["rope.sin"] = table("rope_sin");
  for (const auto& p : m.params) feed[p] = at::tensor(r["weights"][p].get<std::vector<float>>()).reshape(m.graph.find_input(p)->meta().shape);
  feed["tokens"] = batch_tensor(r, "tokens");
  feed["labels"] = batch_tensor(r, "labels");
  const exec::TensorMap out = exec::Executor(m.graph).run(feed);
  EXPECT_NEAR(out.at("loss").item<double>(), r["loss"].get<double>(), 1e-5 * r["loss"].get<double>());
  for (const auto& p : m.params) {
    const at::Tensor want = at::tensor(r["grads"][p].get<std::vector<float>>()).reshape(m.graph.find_input(p)->meta().shape);
    EXPECT_LE((out.at("grad." + p) - want).abs().max().item<double>() / want.abs().max().item<double>(), 1e-5) << p;
  }
  // The mask matters: plain causal attention gives another loss.
  args.attn_mask_type = "causal";
  models::Model causal = models::build_model(args, r["batch"].get<std::int64_t>(), r["seq"].get<std::int64_t>());
  exec::TensorMap plain = feed;
  EXPECT_GT(std::abs(exec::Executor(causal.graph).run(plain).at("loss").item<double>() - r["loss"].get<double>()), 1e-3);
}

// ---- Bad input: each a clear error ----

std::string import_error(const std::string& path) {
  models::ModelArgs args = models::model_args("pt2", "", 0);
  args.path = path;
  try {
    models::import_pt2(args);
  } catch (const models::ImportError& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(Pt2ImportErrors, DynamicShapes) {
  EXPECT_THAT(import_error((kDir / "bad" / "gpt2.pt2").string()), HasSubstr("dynamic"));
}

TEST(Pt2ImportErrors, ArchivesFromTorch27And28) {
  EXPECT_THAT(import_error((kDir / "bad" / "old.pt2").string()), HasSubstr("torch 2.7 or older"));
  EXPECT_THAT(import_error((kDir / "bad" / "torch28.pt2").string()), HasSubstr("torch 2.8 or older"));
}

TEST(Pt2ImportErrors, UnsupportedOpNamedWithSourceLine) {
  const std::string e = import_error((kDir / "bad" / "cumsum.pt2").string());
  EXPECT_THAT(e, HasSubstr("aten.cumsum.default"));
  EXPECT_THAT(e, HasSubstr("make_pt2_fixtures.py:"));  // the source line
  EXPECT_THAT(e, HasSubstr("cumsum("));
  const models::Pt2Summary s = models::summarize_pt2((kDir / "bad" / "cumsum.pt2").string());
  ASSERT_EQ(s.unsupported.size(), 1u);
  EXPECT_EQ(s.unsupported[0].op, "aten.cumsum.default");
}

// x[ids] = v where ids may name a row twice (which write wins is not defined) is refused, naming
// what spmdx maps instead; transformers' own index_put (over a permutation) imports (above).
TEST(Pt2ImportErrors, IndexPutThatMayWriteARowTwice) {
  const std::string e = import_error((kDir / "bad" / "index_put.pt2").string());
  EXPECT_THAT(e, HasSubstr("aten.index_put.default"));
  EXPECT_THAT(e, HasSubstr("make_pt2_fixtures.py:"));
  EXPECT_THAT(e, HasSubstr("that may repeat a row"));
  EXPECT_THAT(e, HasSubstr("a permutation of x's rows"));
}

// Two parameters that are different rows of one storage are not tied, whatever their values.
TEST(Pt2ImportErrors, ParametersSharingStorageAsDifferentViews) {
  EXPECT_THAT(import_error((kDir / "bad" / "views.pt2").string()), HasSubstr("different views"));
  EXPECT_THROW(models::summarize_pt2((kDir / "bad" / "views.pt2").string()), models::ImportError);
}

TEST(Pt2ImportErrors, TruncatedWeight) {
  EXPECT_THAT(import_error((kDir / "bad" / "truncated.pt2").string()), HasSubstr("truncated"));
}

TEST(Pt2ImportErrors, CorruptZip) {
  test::TempDir dir;
  std::ifstream in(kDir / "gpt2.pt2", std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  test::write_file(dir / "half.pt2", bytes.substr(0, bytes.size() / 2));
  EXPECT_THAT(import_error((dir / "half.pt2").string()), HasSubstr("not a readable PT2 archive"));
  test::write_file(dir / "text.pt2", "hello");
  EXPECT_THAT(import_error((dir / "text.pt2").string()), HasSubstr("not a readable PT2 archive"));
  EXPECT_THAT(import_error((dir / "missing.pt2").string()), HasSubstr("no such file"));
}

TEST(Pt2ImportErrors, UnknownFieldInModelJson) {
  const std::string e = import_error((kDir / "bad" / "unknown_field.pt2").string());
  EXPECT_THAT(e, HasSubstr("unknown field 'shiny_new_field'"));
}

// Copying or printing a value that deep would overflow the stack: refused before it is parsed.
TEST(Pt2ImportErrors, ModelJsonNestedTooDeep) {
  const std::string e = import_error((kDir / "bad" / "deep.pt2").string());
  EXPECT_THAT(e, HasSubstr("deep.pt2"));
  EXPECT_THAT(e, HasSubstr("models/model.json is not valid JSON: JSON nested more than 256 arrays or objects deep (at byte 264)"));
}

TEST(Pt2ImportErrors, AFloatWhereAWholeNumberBelongsIsShownAsWritten) {
  EXPECT_THAT(import_error((kDir / "bad" / "huge_major.pt2").string()),
              HasSubstr("models/model.json schema_version major is 1e+30, not a whole number: the file is damaged"));
}

// A value the program never defines is named with the node that reads it (it said "map::at").
TEST(Pt2ImportErrors, AnUndefinedValueIsNamedWithTheNodeThatReadsIt) {
  const std::string node = import_error((kDir / "bad" / "undefined_value.pt2").string());
  EXPECT_THAT(node, HasSubstr("undefined_value.pt2: node 'view_3' (aten.view.default, "));
  EXPECT_THAT(node, HasSubstr("): reads value 'no_such_value', which no input of the program and no earlier node defines: the file is damaged"));
  const std::string output = import_error((kDir / "bad" / "undefined_output.pt2").string());
  EXPECT_THAT(output, HasSubstr("undefined_output.pt2: the program returns value 'no_such_output', which no input of the program and no earlier node defines"));
  for (const auto& e : {node, output}) EXPECT_THAT(e, Not(HasSubstr("map::at")));
}

// A value of the wrong JSON type is named by its file in the archive and its JSON pointer (it
// said "type must be string, but is number"), in the program and in the weights' config.
TEST(Pt2ImportErrors, AValueOfTheWrongJsonTypeIsNamedByItsPath) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"number_target", "number_target.pt2: models/model.json /graph_module/graph/nodes/[0-9]+/target is 5, not a string: the file is damaged"},
      {"number_name", "number_name.pt2: models/model.json /graph_module/graph/nodes/[0-9]+/inputs/0/arg/as_tensor/name is 7, not a string: the file is damaged"},
      {"number_path_name", "number_path_name.pt2: data/weights/model_weights_config.json /config/[a-z_.]+/path_name is 3, not a string: the file is damaged"},
  };
  for (const auto& [name, want] : cases) {
    const std::string e = import_error((kDir / "bad" / (name + ".pt2")).string());
    EXPECT_THAT(e, ::testing::ContainsRegex(want)) << name;
    EXPECT_THAT(e, Not(HasSubstr("type must be"))) << name;
    EXPECT_THROW(models::summarize_pt2((kDir / "bad" / (name + ".pt2")).string()), models::ImportError) << name;
  }
}

// A view or split whose sizes were edited disagrees with the shapes tensor_values records (from
// which the mapping takes its output shapes): refused naming the node and both shapes.
TEST(Pt2ImportErrors, ViewAndSplitSizesThatDisagreeWithTheRecordedShapesAreRefused) {
  EXPECT_THAT(import_error((kDir / "bad" / "view_sizes.pt2").string()),
              ::testing::ContainsRegex("view_sizes.pt2: node 'view' \\(aten.view.default, .*\\): its arguments give its output 'view' the shape \\[8, 32, 16, 4\\], "
                                       "but tensor_values records \\[8, 32, 4, 16\\]: the file is damaged"));
  EXPECT_THAT(import_error((kDir / "bad" / "split_sizes.pt2").string()),
              ::testing::ContainsRegex("split_sizes.pt2: node 'split' \\(aten.split.Tensor, .*\\): its arguments give its output 'getitem' the shape \\[8, 32, 65\\], "
                                       "but tensor_values records \\[8, 32, 64\\]"));
}

TEST(Pt2ImportErrors, AotInductorPackage) {
  EXPECT_THAT(import_error((kDir / "bad" / "aoti.pt2").string()), HasSubstr("AOTInductor"));
}

}  // namespace
}  // namespace spmdx
