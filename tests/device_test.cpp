// The device layer on any machine: the CPU device, what make_device says where a GPU cannot be
// had, the kernels the sdpa and adamw ops use off the CPU (checked on the CPU against ATen's
// fused attention and the CPU AdamW kernel), and the executor's ordering of collectives with a
// device's compute stream, with a fake stream device and fake backends that log each call.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "spmdx/exec/calibrate.h"
#include "spmdx/exec/device.h"
#include "spmdx/exec/distributed.h"
#include "spmdx/exec/executor.h"
#include "spmdx/exec/kernels.h"
#include "spmdx/sharding/mesh.h"
#include "test_util.h"

namespace spmdx::exec {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(Device, CpuDeviceHasNoStream) {
  auto cpu = make_device({"cpu", 0, false});
  EXPECT_EQ(cpu->device(), c10::Device(c10::DeviceType::CPU));
  EXPECT_EQ(cpu->memory(), MemoryType::host);
  EXPECT_EQ(cpu->compute_stream(), nullptr);
  EXPECT_EQ(cpu->describe(), "cpu");
  try {
    cpu->capture([] {});
    FAIL() << "a CPU device captured a CUDA graph";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("training.device = \"cuda\""));
  }
}

// Blocks of 1 MiB or more are handed out again for the same size once freed (a train step's
// sizes repeat, and fresh memory faults its pages in at every first touch), still counted as
// given back; another size gets another block; a small one is not cached.
TEST(Device, CpuDeviceReusesAFreedLargeBlockForTheSameSize) {
  auto cpu = make_device({"cpu", 0, false});
  cpu->reset_peak_memory();
  const std::int64_t base = cpu->peak_memory_bytes();
  { const at::Tensor once = at::empty({16 << 20}, at::kFloat); }  // 64 MiB in use once: what may be held (in use + cached)
  const void* first = nullptr;
  {
    const at::Tensor a = at::empty({3 << 20}, at::kFloat);  // 12 MiB
    first = a.data_ptr();
  }
  cpu->reset_peak_memory();
  EXPECT_EQ(cpu->peak_memory_bytes(), base) << "a cached block is not in use";
  {
    const at::Tensor other = at::empty({(3 << 20) + 16}, at::kFloat);
    EXPECT_NE(other.data_ptr(), first) << "another size";
  }
  const at::Tensor again = at::empty({3 << 18}, at::kDouble);  // 6 MiB: not the 12 MiB block
  EXPECT_NE(again.data_ptr(), first);
  const at::Tensor same = at::empty({3 << 20}, at::kFloat);
  EXPECT_EQ(same.data_ptr(), first) << "the freed 12 MiB block, reused";
  EXPECT_EQ(cpu->peak_memory_bytes(), base + (12 << 20) + (6 << 20));
}

// The CPU device counts every ATen CPU allocation, as the CUDA caching allocator does on a GPU:
// the peak since the reset, temporaries inside a kernel included, and tensors made before the
// device (by c10's default allocator) freed safely.
TEST(Device, CpuDeviceCountsThePeakOfAllocatedBytes) {
  const at::Tensor before = at::ones({1000}, at::kFloat);  // may come from c10's default allocator
  auto cpu = make_device({"cpu", 0, false});
  cpu->reset_peak_memory();
  const std::int64_t base = cpu->peak_memory_bytes();
  EXPECT_GE(base, 0);
  {
    at::Tensor a = at::empty({1 << 20}, at::kFloat);  // 4 MiB
    EXPECT_EQ(cpu->peak_memory_bytes(), base + (4 << 20));
    at::Tensor b = at::empty({1 << 18}, at::kDouble);  // 2 MiB more
    EXPECT_EQ(cpu->peak_memory_bytes(), base + (6 << 20));
  }
  EXPECT_EQ(cpu->peak_memory_bytes(), base + (6 << 20)) << "the peak stays after the tensors go";
  cpu->reset_peak_memory();
  EXPECT_EQ(cpu->peak_memory_bytes(), base) << "their bytes were given back";
  // A temporary: exp(x) + x makes exp(x) (4 MiB) and the sum (4 MiB) before exp(x) goes.
  const at::Tensor x = at::zeros({1 << 20}, at::kFloat);
  cpu->reset_peak_memory();
  const at::Tensor y = at::exp(x) + x;
  EXPECT_EQ(cpu->peak_memory_bytes(), base + (4 << 20) + (8 << 20));
  EXPECT_EQ(y[7].item<float>(), 1.0f);
  EXPECT_EQ(before.sum().item<float>(), 1000.0f);
  // From another thread (a comm thread, ATen's intra-op pool) too.
  cpu->reset_peak_memory();
  std::thread([] { at::Tensor t = at::empty({1 << 20}, at::kFloat); }).join();
  EXPECT_EQ(cpu->peak_memory_bytes(), base + (12 << 20)) << "x and y held, and the thread's 4 MiB";
}

TEST(Device, CudaWithoutAGpuSaysWhyAndWhatToDo) {
  const std::string why = cuda_problem(1);
  if (why.empty()) GTEST_SKIP() << "this machine has a GPU: make_device(cuda) is checked by cuda_test";
  EXPECT_THAT(why, testing::AnyOf(HasSubstr("no usable CUDA device"), HasSubstr("no CUDA device"), HasSubstr("built without CUDA")));
  try {
    make_device({"cuda", 0, false});
    FAIL() << "make_device(cuda) succeeded where cuda_problem says: " << why;
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("training.device = \"cpu\""));
  }
}

TEST(Device, UnknownKindIsRefused) {
  EXPECT_THROW(make_device({"tpu", 0, false}), std::runtime_error);
}

// attention() against ATen's fused CPU kernel, forward and backward, causal or not.
TEST(DeviceKernels, AttentionEqualsTheFusedCpuKernel) {
  at::manual_seed(3);
  for (bool causal : {false, true}) {
    const at::Tensor q = at::randn({2, 3, 7, 8}), k = at::randn({2, 3, 7, 8}), v = at::randn({2, 3, 7, 8});
    auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal);
    const auto mine = attention(q, k, v, causal);
    EXPECT_TRUE(at::allclose(mine[0], out, 1e-5, 1e-6)) << "causal " << causal << ": max diff " << (mine[0] - out).abs().max().item<double>();
    EXPECT_TRUE(at::allclose(mine[1], lse, 1e-5, 1e-6)) << "causal " << causal;
    const at::Tensor g = at::randn_like(out);
    auto [gq, gk, gv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(g, q, k, v, out, lse, 0.0, causal);
    const auto grads = attention_backward(g, q, k, v, mine[0], mine[1], causal);
    EXPECT_TRUE(at::allclose(grads[0], gq, 1e-4, 1e-5)) << "dq, causal " << causal << ": max diff " << (grads[0] - gq).abs().max().item<double>();
    EXPECT_TRUE(at::allclose(grads[1], gk, 1e-4, 1e-5)) << "dk, causal " << causal;
    EXPECT_TRUE(at::allclose(grads[2], gv, 1e-4, 1e-5)) << "dv, causal " << causal;
  }
}

// The linear and matmul kernels on each CPU matmul library (training.cpu_matmul): the same
// values as float64 ATen within float32 rounding, the same bits on every call, and the
// library make_device was given in use. x W^T, and x W by a whole weight (the linear's input
// gradient, which the oneDNN path runs as x (W^T)^T); a strided input takes ATen's path.
TEST(DeviceKernels, Float32LinearsOnEachCpuMatmulLibraryGiveATensValues) {
  at::manual_seed(11);
  ir::Graph g;
  ir::Value* x = g.add_input("x", ir::TensorMeta{{3, 5, 16}, ir::DType::f32, "cpu", false});
  ir::Value* w = g.add_input("w", ir::TensorMeta{{24, 16}, ir::DType::f32, "cpu", false});
  ir::Value* go = g.add_input("go", ir::TensorMeta{{3, 5, 24}, ir::DType::f32, "cpu", false});
  g.add_output("y", g.add("linear", {x, w}));
  g.add_output("gx", g.add("matmul", {go, w}));
  ir::Value* xt = g.add("transpose", {x}, {{"dim0", std::int64_t{0}}, {"dim1", std::int64_t{1}}});  // [5, 3, 16], strided
  g.add_output("yt", g.add("linear", {xt, w}));
  const at::Tensor xs = at::randn({3, 5, 16}), ws = at::randn({24, 16}), gos = at::randn({3, 5, 24});
  const TensorMap want{{"y", at::linear(xs.to(at::kDouble), ws.to(at::kDouble))},
                       {"gx", at::matmul(gos.to(at::kDouble), ws.to(at::kDouble))},
                       {"yt", at::linear(xs.to(at::kDouble).transpose(0, 1), ws.to(at::kDouble))}};
  std::vector<std::string> libraries{"aten", "auto"};
  if (onednn_linear_available()) libraries.push_back("onednn");
  for (const std::string& library : libraries) {
    (void)make_device({"cpu", 0, false, library});
    EXPECT_EQ(cpu_matmul(), library == "aten" || !onednn_linear_available() ? CpuMatmul::aten : CpuMatmul::onednn) << library;
    Executor ex(g);
    const TensorMap first = ex.run({{"x", xs}, {"w", ws}, {"go", gos}});
    const TensorMap again = ex.run({{"x", xs}, {"w", ws}, {"go", gos}});
    for (const auto& [name, expected] : want) {
      const at::Tensor& got = first.at(name);
      EXPECT_EQ(got.sizes(), expected.sizes()) << library << " " << name;
      EXPECT_EQ(got.scalar_type(), at::kFloat) << library << " " << name;
      EXPECT_TRUE(at::allclose(got.to(at::kDouble), expected, 1e-5, 1e-5))
          << library << " " << name << ": max diff " << (got.to(at::kDouble) - expected).abs().max().item<double>();
      EXPECT_TRUE(at::equal(got, again.at(name))) << library << " " << name << " changed between two runs";
    }
  }
  try {
    (void)make_device({"cpu", 0, false, "blas"});
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_THAT(e.what(), HasSubstr("training.cpu_matmul = \"blas\": use \"auto\", \"onednn\" or \"aten\""));
  }
  (void)make_device({"cpu", 0, false, "auto"});
}

// bfloat16 and float16 linears on the CPU, both ways a CPU may run them (exec::half_gemm:
// ATen's half kernel where the CPU has bf16/fp16 dot products, else float32 GEMMs of the upcast
// operands), against PyTorch's own half linear and its autograd (LibTorch's at::linear with
// requires_grad): y = x W^T, the input gradient g W (matmul by the whole weight, as linear's vjp
// emits it) and the weight gradient g^T x (linear_weight_grad over the rows), each within one
// rounding of the half dtype (each path sums in float32 and rounds once, in its own order).
// The native path's forward is PyTorch's kernel itself: the same bits.
TEST(DeviceKernels, HalfLinearsMatchPyTorchsHalfKernelOnEitherPath) {
  for (const at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    const ir::DType t = dtype == at::kBFloat16 ? ir::DType::bf16 : ir::DType::f16;
    at::manual_seed(5);
    ir::Graph g;
    ir::Value* x = g.add_input("x", ir::TensorMeta{{3, 40, 96}, t, "cpu", false});
    ir::Value* w = g.add_input("w", ir::TensorMeta{{72, 96}, t, "cpu", false});
    ir::Value* go = g.add_input("go", ir::TensorMeta{{3, 40, 72}, t, "cpu", false});
    g.add_output("y", g.add("linear", {x, w}));
    g.add_output("gx", g.add("matmul", {go, w}));
    g.add_output("gw", g.add("linear_weight_grad", {go, x}));
    // The weight gradient as the autodiff of a matmul writes it: g^T x, g^T a transposed view.
    ir::Value* go_rows = g.add("reshape", {go}, {{"shape", std::vector<std::int64_t>{120, 72}}});
    ir::Value* x_rows = g.add("reshape", {x}, {{"shape", std::vector<std::int64_t>{120, 96}}});
    g.add_output("gw_view", g.add("matmul", {g.add("transpose", {go_rows}, {{"dim0", std::int64_t{0}}, {"dim1", std::int64_t{1}}}), x_rows}));
    const at::Tensor xs = at::randn({3, 40, 96}).to(dtype), ws = (at::randn({72, 96}) * 0.1).to(dtype), gos = at::randn({3, 40, 72}).to(dtype);
    const at::Tensor xr = xs.clone().set_requires_grad(true), wr = ws.clone().set_requires_grad(true);
    const at::Tensor yr = at::linear(xr, wr);
    yr.backward(gos);
    const TensorMap want{{"y", yr.detach()}, {"gx", xr.grad()}, {"gw", wr.grad()}, {"gw_view", wr.grad()}};
    // Per element: one rounding of the half dtype (2^-8 relative for bfloat16's 8 significant
    // bits, 2^-11 for float16's; twice that, each side rounding once) plus float32 sums in
    // another order (2^-20 of the sum of the terms' magnitudes).
    const double half_eps = dtype == at::kBFloat16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
    const at::Tensor x64 = xs.to(at::kDouble).abs(), w64 = ws.to(at::kDouble).abs(), g64 = gos.to(at::kDouble).abs();
    const TensorMap magnitude{{"y", at::linear(x64, w64)}, {"gx", at::matmul(g64, w64)}, {"gw", at::mm(g64.reshape({-1, 72}).t(), x64.reshape({-1, 96}))},
                                {"gw_view", at::mm(g64.reshape({-1, 72}).t(), x64.reshape({-1, 96}))}};
    for (const HalfGemm path : {HalfGemm::native, HalfGemm::upcast}) {
      set_half_gemm(path);
      const std::string how = std::string(dtype == at::kBFloat16 ? "bfloat16" : "float16") + (path == HalfGemm::native ? " native" : " upcast");
      Executor ex(g);
      const TensorMap got = ex.run({{"x", xs}, {"w", ws}, {"go", gos}});
      for (const auto& [name, expected] : want) {
        const at::Tensor& y = got.at(name);
        EXPECT_EQ(y.scalar_type(), dtype) << how << " " << name;
        ASSERT_EQ(y.sizes(), expected.sizes()) << how << " " << name;
        const at::Tensor diff = (y.to(at::kDouble) - expected.to(at::kDouble)).abs();
        const at::Tensor bound = expected.to(at::kDouble).abs() * (2 * half_eps) + magnitude.at(name) * std::ldexp(1.0, -20);
        EXPECT_TRUE(diff.le(bound).all().item<bool>()) << how << " " << name << ": worst diff / bound " << (diff / bound).max().item<double>();
      }
      if (path == HalfGemm::native) {
        EXPECT_TRUE(at::equal(got.at("y"), want.at("y"))) << how << ": PyTorch's kernel, the same bits";
      }
    }
    set_half_gemm(std::nullopt);
  }
  // Where the CPU has the instructions, the native path is its choice; else the upcast one.
  EXPECT_THAT(half_gemm_summary(at::kBFloat16), ::testing::AnyOf(HasSubstr("native (A"), HasSubstr("upcast to float32 (no AVX512-BF16 or AMX-BF16)")));
}

// The gradient norm's squared_norm: the sum of squares of 3,000,001 float32 elements (rows of
// 4096 and a rest) within float32 rounding of the float64 sum, as at::sum(x * x) is, where
// the whole tensor's float32 vector_norm squared is 1e-3 off; and the sum of a split tensor's
// parts' squared norms (a sharded gradient's Partial) gives the whole's.
TEST(DeviceKernels, SquaredNormIsTheSumOfSquaresWithinFloat32Rounding) {
  at::manual_seed(9);
  const std::int64_t n = 3000001;
  const at::Tensor xs = at::randn({n});
  ir::Graph g;
  ir::Value* x = g.add_input("x", ir::TensorMeta{{n}, ir::DType::f32, "cpu", false});
  g.add_output("whole", g.add("squared_norm", {x}));
  g.add_output("head", g.add("squared_norm", {g.add("chunk", {x}, {{"dim", std::int64_t{0}}, {"sizes", std::vector<std::int64_t>{1000000, 2000001}}, {"index", std::int64_t{0}}})}));
  g.add_output("tail", g.add("squared_norm", {g.add("chunk", {x}, {{"dim", std::int64_t{0}}, {"sizes", std::vector<std::int64_t>{1000000, 2000001}}, {"index", std::int64_t{1}}})}));
  Executor ex(g);
  const TensorMap got = ex.run({{"x", xs}});
  const double want = xs.to(at::kDouble).square().sum().item<double>();
  EXPECT_EQ(got.at("whole").scalar_type(), at::kFloat);
  EXPECT_EQ(got.at("whole").dim(), 0);
  EXPECT_NEAR(got.at("whole").item<double>(), want, 2e-7 * want);
  EXPECT_NEAR(got.at("head").item<double>() + got.at("tail").item<double>(), want, 2e-7 * want);
  EXPECT_GT(std::abs(std::pow(at::linalg_vector_norm(xs, 2).item<double>(), 2) - want), 2e-7 * want) << "the naive whole-tensor norm is exact here: the test would not catch it";
}

// The cost model's matmul rate is the kernels' own: a calibration names the linears' library,
// is kept while that library is in use, and is measured again under the other one.
TEST(DeviceKernels, CalibrationIsMeasuredAgainForTheOtherCpuMatmulLibrary) {
  if (!onednn_linear_available()) GTEST_SKIP() << "this LibTorch has no oneDNN linear";
  test::TempDir dir;
  const auto file = plan::calibration_path(dir.path());
  set_cpu_matmul(CpuMatmul::aten);
  const plan::Calibration aten = ensure_calibration(dir.path());
  EXPECT_THAT(aten.compute_source, HasSubstr("float32 linears on ATen's BLAS"));
  plan::Calibration pinned = aten;
  pinned.matmul_flops_per_second = 1234e3;  // a rate no measurement gives: kept or replaced
  plan::save_calibration(file, pinned);
  EXPECT_DOUBLE_EQ(ensure_calibration(dir.path()).matmul_flops_per_second, 1234e3) << "the same library: kept";
  set_cpu_matmul(CpuMatmul::onednn);
  const plan::Calibration onednn = ensure_calibration(dir.path());
  EXPECT_THAT(onednn.compute_source, HasSubstr("float32 linears on oneDNN"));
  EXPECT_NE(onednn.matmul_flops_per_second, 1234e3) << "measured again, not the ATen rate kept";  // (how fast: the machine's business)
  EXPECT_GT(onednn.matmul_flops_per_second, 0);
  EXPECT_DOUBLE_EQ(plan::load_calibration(file).matmul_flops_per_second, onednn.matmul_flops_per_second) << "and written";
  pinned.compute_source = "measured 2026-11-30 12:00 (ATen mm 384^3, add 4Mi f32 and 1 f32, 1 thread)";  // before the library was named
  plan::save_calibration(file, pinned);
  EXPECT_NE(ensure_calibration(dir.path()).matmul_flops_per_second, 1234e3) << "an MKL rate under oneDNN";
  (void)make_device({"cpu", 0, false, "auto"});
}

// A calibration measured while other threads have every core is low (CI's tests beside it made
// the matmul rate 22 GFLOP/s, idle 75): its source and a warning say so.
TEST(DeviceKernels, ACalibrationMeasuredOnABusyMachineSaysSo) {
  test::TempDir dir;
  std::atomic<bool> stop{false};
  std::vector<std::thread> spinners;
  for (unsigned i = 0; i < 3 * std::max(1u, std::thread::hardware_concurrency()); ++i) {
    spinners.emplace_back([&] {
      while (!stop.load(std::memory_order_relaxed)) {
      }
    });
  }
  double share = 1;
  (void)measure_compute(plan::Calibration{}, 0.3, &share);
  testing::internal::CaptureStderr();
  const plan::Calibration busy = ensure_calibration(dir.path());
  const std::string warned = testing::internal::GetCapturedStderr();
  stop = true;
  for (auto& t : spinners) t.join();
  EXPECT_LT(share, 0.8);
  EXPECT_THAT(busy.compute_source, HasSubstr("; busy: the measuring thread ran "));
  EXPECT_THAT(warned, HasSubstr(plan::calibration_path(dir.path()).string() + ": the machine was busy while spmdx measured its compute rates"));
  EXPECT_EQ(plan::load_calibration(plan::calibration_path(dir.path())).compute_source, busy.compute_source) << "written, as before";
}

// adamw_on_device (lr and step as tensors) against the adamw kernel the CPU runs (host scalars).
TEST(DeviceKernels, AdamWWithTensorHyperparametersEqualsTheCpuKernel) {
  at::manual_seed(5);
  ir::Graph g;
  const ir::TensorMeta w{{4, 6}, ir::DType::f32, "cpu", false}, scalar{{}, ir::DType::f32, "cpu", false};
  std::vector<ir::Value*> in;
  for (const char* name : {"w", "g", "m", "v"}) in.push_back(g.add_input(name, w));
  in.push_back(g.add_input("lr", scalar));
  in.push_back(g.add_input("step", scalar));
  const AdamW h{0.9, 0.95, 1e-8, 0.1};
  ir::Node* n = g.add_node("adamw", in, {{"beta1", h.beta1}, {"beta2", h.beta2}, {"eps", h.eps}, {"weight_decay", h.weight_decay}});
  for (int i = 0; i < 3; ++i) g.add_output("out" + std::to_string(i), n->output(static_cast<std::size_t>(i)));
  Executor ex(g);
  const at::Tensor p = at::randn({4, 6}), grad = at::randn({4, 6}), m = at::randn({4, 6}) * 0.1, v = at::rand({4, 6}) * 0.01;
  for (double step : {1.0, 7.0}) {
    const at::Tensor lr = at::scalar_tensor(3e-3, at::kFloat), st = at::scalar_tensor(step, at::kFloat);
    TensorMap out = ex.run({{"w", p}, {"g", grad}, {"m", m}, {"v", v}, {"lr", lr}, {"step", st}});
    const auto mine = adamw_on_device(p, grad, m, v, lr, st, h);
    for (int i = 0; i < 3; ++i) {
      const at::Tensor& want = out.at("out" + std::to_string(i));
      EXPECT_TRUE(at::allclose(mine[static_cast<std::size_t>(i)], want, 1e-6, 1e-7))
          << "output " << i << " at step " << step << ": max diff " << (mine[static_cast<std::size_t>(i)] - want).abs().max().item<double>();
    }
    EXPECT_FALSE(at::equal(mine[0], p));  // it did step
  }
}

// ---- the executor and a device's compute stream ----

// A GPU as the executor sees it, on CPU tensors: a compute stream (a fake handle) and a host
// synchronisation that is logged. `on` is the device its tensors must be on.
class FakeStreamDevice final : public Device {
 public:
  FakeStreamDevice(std::vector<std::string>& log, c10::Device on) : log_(log), on_(on) {}
  c10::Device device() const override { return on_; }
  MemoryType memory() const override { return MemoryType::host; }
  void* compute_stream() const override { return reinterpret_cast<void*>(0x57); }
  void synchronize() override { log_.push_back("synchronize"); }
  std::int64_t peak_memory_bytes() const override { return 1234; }
  void reset_peak_memory() override {}
  std::string describe() const override { return "fake"; }
  std::unique_ptr<CapturedStep> capture(const std::function<void()>&) override { return nullptr; }

 private:
  std::vector<std::string>& log_;
  c10::Device on_;
};

// A 2-rank group whose other rank holds the same values: all_reduce(sum) doubles the buffer.
// The reduction happens when the data is "there" for the reader: at stream_wait (the stream
// waits for it) or at the host's wait, whichever comes first.
class FakeWork final : public Work {
 public:
  FakeWork(std::vector<std::string>& log, CommBuffer buf) : log_(log), buf_(buf) {}
  bool wait(double) override {
    log_.push_back("host wait");
    finish();
    return true;
  }
  bool test() override { return done_; }
  void finish() {
    if (done_) return;
    auto* p = static_cast<float*>(buf_.data);
    for (std::size_t i = 0; i < buf_.count; ++i) p[i] *= 2;
    done_ = true;
  }

 private:
  std::vector<std::string>& log_;
  CommBuffer buf_;
  bool done_ = false;
};

class FakeBackend : public CommBackend {
 public:
  explicit FakeBackend(std::vector<std::string>& log) : log_(log) {}
  void init(const CommInit&) override {}
  void finalize() override {}
  void abort() noexcept override {}
  std::string describe() const override { return "fake"; }
  std::vector<CommCapability> capabilities() const override { return {}; }
  int new_group(const std::vector<int>&) override { return 0; }
  std::unique_ptr<Work> all_reduce(int, CommBuffer buf, ReduceOp) override {
    log_.push_back("all_reduce");
    return std::make_unique<FakeWork>(log_, buf);
  }
  std::unique_ptr<Work> all_gather(int, CommBuffer, CommBuffer, std::vector<std::size_t>) override { throw std::logic_error("unused"); }
  std::unique_ptr<Work> reduce_scatter(int, CommBuffer, CommBuffer, std::vector<std::size_t>, ReduceOp) override { throw std::logic_error("unused"); }
  std::unique_ptr<Work> all_to_all(int, CommBuffer, CommBuffer, std::vector<std::size_t>, std::vector<std::size_t>) override {
    throw std::logic_error("unused");
  }
  std::unique_ptr<Work> broadcast(int, CommBuffer, int) override { throw std::logic_error("unused"); }
  std::unique_ptr<Work> send(CommBuffer, int, int) override { throw std::logic_error("unused"); }
  std::unique_ptr<Work> recv(CommBuffer, int, int) override { throw std::logic_error("unused"); }
  std::unique_ptr<Work> barrier(int) override { throw std::logic_error("unused"); }

 protected:
  std::vector<std::string>& log_;
};

class FakeStreamBackend final : public FakeBackend, public StreamOrdered {
 public:
  using FakeBackend::FakeBackend;
  void issue_after(void* stream) override { log_.push_back(stream == reinterpret_cast<void*>(0x57) ? "issue_after compute" : "issue_after ?"); }
  bool stream_wait(Work& work, void* stream) override {
    log_.push_back(stream == reinterpret_cast<void*>(0x57) ? "stream_wait compute" : "stream_wait ?");
    static_cast<FakeWork&>(work).finish();
    return true;
  }
};

// y = 3 * all_reduce(x @ w) on rank 0 of a 2-rank dp mesh, one collective.
struct OneCollective {
  at::Tensor x, w;  // seeded, so that a failure can be run again

  // y is 6 x @ w when the reduction was waited for before the multiply (3 x @ w when it was
  // not). The executor's matmul may run on oneDNN and this reference on MKL: they round apart,
  // by 1.6e-7 on an entry of 3e-4 that cancelled (float32's epsilon is 1.2e-7), so the
  // tolerance is absolute as well as relative; a missed wait is off by 50%.
  testing::AssertionResult is_reduced(const at::Tensor& y) const {
    const at::Tensor want = at::matmul(x, w) * 6.0;
    if (at::allclose(y, want, 1e-5, 1e-5)) return testing::AssertionSuccess();
    return testing::AssertionFailure() << "y differs from 6 x @ w by up to " << (y - want).abs().max().item<double>() << ":\n" << y << "\nwant\n" << want;
  }

  ir::Graph g;
  sharding::DeviceMesh mesh{{{"dp", 2}}};
  OneCollective() {
    const ir::TensorMeta m{{4, 4}, ir::DType::f32, "cpu", false};
    ir::Value* r = g.add("all_reduce", {g.add("matmul", {g.add_input("x", m), g.add_input("w", m)})}, {{"mesh_dim", std::int64_t{0}}, {"op", std::string("sum")}});
    g.add_output("y", g.add("mul_scalar", {r}, {{"value", 3.0}}));
    at::manual_seed(17);
    x = at::randn({4, 4});
    w = at::randn({4, 4});
  }
};

TEST(DeviceOrdering, StreamOrderedBackendWaitsOnStreamsAndTheHostOnlyAtTheEnd) {
  std::vector<std::string> log;
  OneCollective job;
  FakeStreamBackend backend(log);
  FakeStreamDevice device(log, c10::Device(c10::DeviceType::CPU));
  DistributedExecutor ex(job.g, job.mesh, 0, &backend, 10, {}, &device);
  EXPECT_TRUE(job.is_reduced(ex.run({{"x", job.x}, {"w", job.w}}).at("y")));
  // No host synchronisation before the call; the reader's stream waits; the host waits once the
  // step is queued, then synchronises for the step's time.
  EXPECT_THAT(log, ElementsAre("issue_after compute", "all_reduce", "stream_wait compute", "host wait", "synchronize"));
  EXPECT_EQ(ex.stats().peak_bytes, 1234);  // the device's statistics, not the executor's count
  EXPECT_EQ(ex.stats().exposed_comm, 0.0);
}

TEST(DeviceOrdering, BackendWithoutStreamsGetsTheStreamSynchronisedAndHostWaits) {
  std::vector<std::string> log;
  OneCollective job;
  FakeBackend backend(log);
  FakeStreamDevice device(log, c10::Device(c10::DeviceType::CPU));
  DistributedExecutor ex(job.g, job.mesh, 0, &backend, 10, {}, &device);
  EXPECT_TRUE(job.is_reduced(ex.run({{"x", job.x}, {"w", job.w}}).at("y")));
  EXPECT_THAT(log, ElementsAre("synchronize", "all_reduce", "host wait", "synchronize"));
}

TEST(DeviceOrdering, OnTheCpuNoStreamCallsAreMade) {
  std::vector<std::string> log;
  OneCollective job;
  FakeStreamBackend backend(log);
  DistributedExecutor ex(job.g, job.mesh, 0, &backend, 10, {}, nullptr);
  EXPECT_TRUE(job.is_reduced(ex.run({{"x", job.x}, {"w", job.w}}).at("y")));
  EXPECT_THAT(log, ElementsAre("all_reduce", "host wait"));
}

TEST(DeviceOrdering, AnInputOnAnotherDeviceIsRefusedNamingIt) {
  std::vector<std::string> log;
  OneCollective job;
  FakeStreamBackend backend(log);
  FakeStreamDevice gpu(log, c10::Device(c10::DeviceType::CUDA, 0));
  DistributedExecutor ex(job.g, job.mesh, 0, &backend, 10, {}, &gpu);
  try {
    ex.run({{"x", at::randn({4, 4})}, {"w", at::randn({4, 4})}});
    FAIL() << "a CPU tensor was fed to a rank on cuda:0";
  } catch (const std::invalid_argument& e) {
    EXPECT_THAT(e.what(), HasSubstr("input 'x' is on cpu, this rank runs on cuda:0"));
  }
  EXPECT_TRUE(log.empty());
}

}  // namespace
}  // namespace spmdx::exec
