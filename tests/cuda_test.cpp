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
