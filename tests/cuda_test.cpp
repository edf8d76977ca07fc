// The CUDA device where a GPU is (scripts/device_check runs it there): the device a rank takes,
// the kernels the sdpa and adamw ops use on CUDA against the CPU's, a CUDA graph replaying an
// executor run exactly, and the executor ordering the nccl plugin's collective with the compute
// stream. Skipped, saying why, where no GPU can be had.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "spmdx/core/registry.h"
#include "spmdx/exec/device.h"
#include "spmdx/exec/distributed.h"
#include "spmdx/exec/executor.h"
#include "spmdx/exec/kernels.h"
#include "spmdx/sharding/mesh.h"

namespace spmdx::exec {
namespace {

using ::testing::HasSubstr;

class Cuda : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const std::string why = cuda_problem(1); !why.empty()) GTEST_SKIP() << why;
    device_ = make_device({"cuda", 0, false});
  }
  std::unique_ptr<Device> device_;
};

TEST_F(Cuda, TakesGpuLocalRankWithTf32Off) {
  EXPECT_EQ(device_->device(), c10::Device(c10::DeviceType::CUDA, 0));
  EXPECT_EQ(device_->memory(), MemoryType::cuda);
  EXPECT_NE(device_->compute_stream(), nullptr);
  EXPECT_THAT(device_->describe(), HasSubstr("cuda:0 ("));
  EXPECT_THAT(device_->describe(), HasSubstr("TF32 off"));
  EXPECT_FALSE(at::globalContext().allowTF32CuBLAS());
  device_->reset_peak_memory();
  const at::Tensor big = at::empty({1 << 20}, at::TensorOptions().dtype(at::kFloat).device(device_->device()));
  EXPECT_GE(device_->peak_memory_bytes(), 4 << 20);
}

TEST_F(Cuda, AttentionAndAdamWOnTheGpuEqualTheCpu) {
  at::manual_seed(7);
  const at::Tensor q = at::randn({2, 4, 16, 8}), k = at::randn({2, 4, 16, 8}), v = at::randn({2, 4, 16, 8});
  const auto dev = device_->device();
  const auto cpu = attention(q, k, v, true);
  const auto gpu = attention(q.to(dev), k.to(dev), v.to(dev), true);
  EXPECT_TRUE(at::allclose(gpu[0].cpu(), cpu[0], 1e-4, 1e-5));
  EXPECT_TRUE(at::allclose(gpu[1].cpu(), cpu[1], 1e-4, 1e-5));
  const at::Tensor p = at::randn({8, 8}), g = at::randn({8, 8}), m = at::zeros({8, 8}), s = at::zeros({8, 8});
  const at::Tensor lr = at::scalar_tensor(1e-3, at::kFloat), step = at::scalar_tensor(1.0, at::kFloat);
  const AdamW h{0.9, 0.95, 1e-8, 0.1};
  const auto a = adamw_on_device(p, g, m, s, lr, step, h);
  const auto b = adamw_on_device(p.to(dev), g.to(dev), m.to(dev), s.to(dev), lr.to(dev), step.to(dev), h);
  for (std::size_t i = 0; i < 3; ++i) EXPECT_TRUE(at::allclose(b[i].cpu(), a[i], 1e-5, 1e-7)) << "output " << i;
}

// sdpa() and sdpa_backward() on the GPU take ATen's fused kernels (FlashAttention-2 for
// bfloat16, the memory-efficient one for float32) and give the CPU's fused kernel's outputs and
// gradients: float32 within 1e-4, bfloat16 within its rounding; no [s, t] matrix is made (the
// allocator's peak over a 4096-long sequence stays far under the 128 MiB its scores would take).
TEST_F(Cuda, FusedAttentionOnTheGpuEqualsTheCpusAndKeepsNoScores) {
  at::manual_seed(11);
  const auto dev = device_->device();
  // ||a - b|| / ||b||, the CPU's float32 result b.
  auto rel = [](const at::Tensor& a, const at::Tensor& b) { return ((a.cpu().to(at::kFloat) - b).norm() / b.norm()).item<double>(); };
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    for (const bool causal : {true, false}) {
      for (const std::int64_t d : {16, 64}) {
        // Inputs exact in dtype, so that the CPU's float32 reference sees the GPU's values.
        auto draw = [&] { return at::randn({2, 4, 80, d}).to(dtype).to(at::kFloat); };
        const at::Tensor q = draw(), k = draw(), v = draw(), g = draw();
        const auto want = sdpa(q, k, v, causal);
        const auto want_grads = sdpa_backward(g, q, k, v, want[0], want[1], causal);
        auto on = [&](const at::Tensor& t) { return t.to(dev, dtype); };
        const auto got = sdpa(on(q), on(k), on(v), causal);
        const auto got_grads = sdpa_backward(on(g), on(q), on(k), on(v), got[0], got[1], causal);
        const double tol = dtype == at::kFloat ? 1e-5 : 1e-2;  // bfloat16: P and the outputs rounded to 8 bits
        const std::string what = std::string(dtype == at::kFloat ? "float32" : "bfloat16") + (causal ? " causal" : "") + " d " + std::to_string(d);
        ASSERT_EQ(got[1].sizes(), want[1].sizes()) << what;
        EXPECT_LE(rel(got[0], want[0]), tol) << what << ": out";
        EXPECT_LE(rel(got[1], want[1]), tol) << what << ": lse";
        for (std::size_t i = 0; i < 3; ++i) EXPECT_LE(rel(got_grads[i], want_grads[i]), tol) << what << ": grad " << i;
      }
    }
  }
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    const auto opts = at::TensorOptions().dtype(dtype).device(dev);
    const at::Tensor q = at::randn({1, 2, 4096, 64}, opts), k = at::randn({1, 2, 4096, 64}, opts), v = at::randn({1, 2, 4096, 64}, opts);
    device_->synchronize();
    device_->reset_peak_memory();
    const std::int64_t before = device_->peak_memory_bytes();
    const auto out = sdpa(q, k, v, true);
    const auto grads = sdpa_backward(at::ones_like(q), q, k, v, out[0], out[1], true);
    device_->synchronize();
    EXPECT_LT(device_->peak_memory_bytes() - before, 48 << 20) << (dtype == at::kFloat ? "float32" : "bfloat16") << ": the [2, 4096, 4096] scores were made";
  }
}

// rms_norm and its backward (ATen's fused CUDA RMSNorm) and adamw (ATen's fused CUDA AdamW,
// lr and step read on the device; with found_inf set, nothing moves) through the executor on the
// GPU and on the CPU: the same values within float32's rounding.
TEST_F(Cuda, FusedRmsNormAndAdamWOnTheGpuEqualTheCpu) {
  at::manual_seed(31);
  ir::Graph g;
  const ir::TensorMeta xm{{4, 8, 256}, ir::DType::f32, "cpu", false}, wm{{256}, ir::DType::f32, "cpu", false}, pm{{64, 32}, ir::DType::f32, "cpu", false},
      scalar{{}, ir::DType::f32, "cpu", false};
  ir::Value* x = g.add_input("x", xm);
  ir::Value* w = g.add_input("w", wm);
  ir::Value* gy = g.add_input("gy", xm);
  g.add_output("y", g.add("rms_norm", {x, w}, {{"eps", 1e-5}}));
  ir::Node* back = g.add_node("rms_norm_backward", {gy, x, w}, {{"eps", 1e-5}});
  g.add_output("gx", back->output(0));
  g.add_output("gw", back->output(1));
  std::vector<ir::Value*> in;
  for (const char* name : {"p", "gp", "m", "v"}) in.push_back(g.add_input(name, pm));
  for (const char* name : {"lr", "step", "found_inf"}) in.push_back(g.add_input(name, scalar));
  ir::Node* adamw = g.add_node("adamw", in, {{"beta1", 0.9}, {"beta2", 0.95}, {"eps", 1e-8}, {"weight_decay", 0.1}});
  for (int i = 0; i < 3; ++i) g.add_output("next" + std::to_string(i), adamw->output(static_cast<std::size_t>(i)));
  const TensorMap cpu_feed{{"x", at::randn({4, 8, 256})}, {"w", at::rand({256}) + 0.5}, {"gy", at::randn({4, 8, 256})},
                           {"p", at::randn({64, 32})}, {"gp", at::randn({64, 32})}, {"m", at::randn({64, 32}) * 0.1}, {"v", at::rand({64, 32}) * 0.01},
                           {"lr", at::scalar_tensor(3e-3, at::kFloat)}, {"step", at::scalar_tensor(7.0, at::kFloat)}, {"found_inf", at::scalar_tensor(0.0, at::kFloat)}};
  for (const double found_inf : {0.0, 1.0}) {
    TensorMap cpu, gpu;  // copies: the executor may update its inputs in place
    for (const auto& [name, t] : cpu_feed) cpu[name] = t.clone();
    cpu["found_inf"] = at::scalar_tensor(found_inf, at::kFloat);
    for (const auto& [name, t] : cpu) gpu[name] = t.to(device_->device());
    Executor on_cpu(g), on_gpu(g);
    const TensorMap want = on_cpu.run(cpu), got = on_gpu.run(gpu);
    for (const char* out : {"y", "gx", "gw", "next0", "next1", "next2"}) {
      const at::Tensor a = got.at(out).cpu(), b = want.at(out);
      EXPECT_LE(((a - b).norm() / b.norm()).item<double>(), 2e-6) << out << ", found_inf " << found_inf;
    }
    if (found_inf != 0) EXPECT_TRUE(at::equal(got.at("next0").cpu(), cpu_feed.at("p"))) << "a skipped step moves nothing";
    else EXPECT_FALSE(at::equal(got.at("next0").cpu(), cpu_feed.at("p")));
  }
}

// y = tanh(x @ w) * 2: captured once, replayed with new values in the fixed input buffer.
TEST_F(Cuda, CapturedGraphReplaysTheExecutorExactly) {
  at::manual_seed(60);  // the inputs, so that a failure can be run again
  ir::Graph graph;
  const ir::TensorMeta m{{64, 64}, ir::DType::f32, "cuda", false};
  ir::Value* x = graph.add_input("x", m);
  ir::Value* w = graph.add_input("w", m);
  graph.add_output("y", graph.add("mul_scalar", {graph.add("sigmoid", {graph.add("matmul", {x, w})})}, {{"value", 2.0}}));
  Executor ex(graph);
  const auto dev = device_->device();
  TensorMap feed{{"x", at::randn({64, 64}).to(dev)}, {"w", at::randn({64, 64}).to(dev)}};
  ex.run(feed);  // warm-up, as torch.cuda.graph asks
  TensorMap out;
  auto captured = device_->capture([&] { out = ex.run(feed); });
  for (int i = 0; i < 3; ++i) {
    const at::Tensor next = at::randn({64, 64}).to(dev);
    feed.at("x").copy_(next);
    captured->replay();
    device_->synchronize();
    const at::Tensor eager = ex.run({{"x", next}, {"w", feed.at("w")}}).at("y");
    EXPECT_TRUE(at::equal(out.at("y"), eager)) << "replay " << i;
  }
}

// One collective on a CUDA buffer through the nccl plugin (one rank: NCCL takes one GPU per
// rank), ordered with the compute stream by events, not by the host.
TEST_F(Cuda, NcclCollectiveIsOrderedWithTheComputeStream) {
  at::manual_seed(84);  // the inputs, so that a failure can be run again
  PluginRegistry registry;
  registry.discover(plugin_search_path({}));
  auto backend = registry.make_comm_backend("nccl");
  ASSERT_NE(dynamic_cast<StreamOrdered*>(backend.get()), nullptr);
  backend->init({0, 1, 0, nullptr, 60});
  ir::Graph graph;
  const ir::TensorMeta m{{256, 256}, ir::DType::f32, "cuda", false};
  ir::Value* x = graph.add_input("x", m);
  ir::Value* w = graph.add_input("w", m);
  ir::Value* r = graph.add("all_reduce", {graph.add("matmul", {x, w})}, {{"mesh_dim", std::int64_t{0}}, {"op", std::string("sum")}});
  graph.add_output("y", graph.add("mul_scalar", {r}, {{"value", 3.0}}));
  sharding::DeviceMesh mesh({{"dp", 1}});
  DistributedExecutor ex(graph, mesh, 0, backend.get(), 60, {}, device_.get());
  const auto dev = device_->device();
  const at::Tensor xs = at::randn({256, 256}), ws = at::randn({256, 256});
  for (int i = 0; i < 3; ++i) {
    const TensorMap out = ex.run({{"x", xs.to(dev)}, {"w", ws.to(dev)}});
    EXPECT_TRUE(at::allclose(out.at("y").cpu(), at::matmul(xs, ws) * 3.0, 1e-4, 1e-4)) << "run " << i;
  }
  EXPECT_EQ(ex.stats().collectives, 1);
  backend->finalize();
}

}  // namespace
}  // namespace spmdx::exec
