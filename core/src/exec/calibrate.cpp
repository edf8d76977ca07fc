#include "spmdx/exec/calibrate.h"
#include "spmdx/exec/kernels.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <time.h>

#include <algorithm>
#include <chrono>
#include <ctime>

#include "spmdx/core/log.h"

namespace spmdx::exec {
namespace {

// Seconds per call of `f`, over about `budget` seconds after two warm-up calls.
template <class F>
double per_call(F&& f, double budget) {
  f(), f();
  const auto t0 = std::chrono::steady_clock::now();
  int calls = 0;
  double elapsed = 0;
  do {
    f();
    ++calls;
    elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  } while (elapsed < budget);
  return elapsed / calls;
}

// How the calibration names the float32 linears' library.
std::string linears_on() { return std::string("float32 linears on ") + library_name(cpu_matmul()); }

// A measured calibration of another library than the one in use: one that names it, or one from
// before the library was named (an ATen mm, MKL's rate) while oneDNN is in use.
bool other_library(const std::string& source) {
  if (source.find("float32 linears on ") != std::string::npos) return source.find(linears_on()) == std::string::npos;
  return source.find("ATen mm") != std::string::npos && cpu_matmul() == CpuMatmul::onednn;
}

double thread_cpu_seconds() {
  timespec t{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// Below this share of the wall time on a core, the measuring thread waited for one: the machine
// was busy (CI's tests beside it measured a matmul rate of 22 GFLOP/s, idle 75).
constexpr double kIdleShare = 0.8;

}  // namespace

plan::Calibration measure_compute(plan::Calibration base, double seconds, double* cpu_share) {
  const auto wall0 = std::chrono::steady_clock::now();
  const double cpu0 = thread_cpu_seconds();
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  // A linear's three products as the train step runs them (kernels.h): its forward x W^T and
  // input gradient g W on the library training.cpu_matmul chose, its weight gradient g^T x on
  // ATen's.
  const std::int64_t n = 384;
  const at::Tensor x = at::randn({n, n}), w = at::randn({n, n}), g = at::randn({n, n});
  const double matmul = per_call(
                            [&] {
                              (void)cpu_linear(x, w);
                              (void)cpu_linear(g, w.t());
                              (void)at::mm(g.t(), x);
                            },
                            seconds / 2) /
                        3;
  const std::int64_t m = 4 << 20;
  const at::Tensor u = at::randn({m}), v = at::randn({m});
  const double add = per_call([&] { (void)at::add(u, v); }, seconds / 2);
  const at::Tensor one = at::randn({1});
  const double tiny = per_call([&] { (void)at::add(one, one); }, 0.05);
  at::set_num_threads(threads);
  base.matmul_flops_per_second = 2.0 * n * n * n / matmul;
  base.memory_bytes_per_second = 12.0 * static_cast<double>(m) / add;
  base.node_seconds = tiny;
  char when[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M", std::localtime(&now));
  base.compute_source = std::string("measured ") + when + " (a linear's three 384^3 products, " + linears_on() + "; add 4Mi f32 and 1 f32; 1 thread)";
  if (cpu_share != nullptr) {
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0).count();
    *cpu_share = wall > 0 ? std::min(1.0, (thread_cpu_seconds() - cpu0) / wall) : 1.0;
  }
  return base;
}

plan::Calibration ensure_calibration(const std::filesystem::path& dump_folder) {
  const auto file = plan::calibration_path(dump_folder);
  plan::Calibration c = plan::load_calibration(file);
  if (c.compute_source.rfind("measured", 0) == 0 && !other_library(c.compute_source)) return c;
  double share = 1;
  c = measure_compute(c, 0.6, &share);
  if (share < kIdleShare) {
    const std::string ran = "the measuring thread ran " + std::to_string(static_cast<int>(100 * share)) + "% of the time";
    c.compute_source += "; busy: " + ran;
    SPMDX_WARN(file.string() << ": the machine was busy while spmdx measured its compute rates (" << ran
                             << "), so they are low and estimates long: delete the file to measure again when it is idle");
  }
  plan::save_calibration(file, c);
  return c;
}

}  // namespace spmdx::exec
