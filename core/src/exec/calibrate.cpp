#include "spmdx/exec/calibrate.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <chrono>
#include <ctime>

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

}  // namespace

plan::Calibration measure_compute(plan::Calibration base, double seconds) {
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const std::int64_t n = 384;
  const at::Tensor a = at::randn({n, n}), b = at::randn({n, n});
  const double matmul = per_call([&] { (void)at::mm(a, b); }, seconds / 2);
  const std::int64_t m = 4 << 20;
  const at::Tensor x = at::randn({m}), y = at::randn({m});
  const double add = per_call([&] { (void)at::add(x, y); }, seconds / 2);
  const at::Tensor one = at::randn({1});
  const double tiny = per_call([&] { (void)at::add(one, one); }, 0.05);
  at::set_num_threads(threads);
  base.matmul_flops_per_second = 2.0 * n * n * n / matmul;
  base.memory_bytes_per_second = 12.0 * static_cast<double>(m) / add;
  base.node_seconds = tiny;
  char when[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M", std::localtime(&now));
  base.compute_source = std::string("measured ") + when + " (ATen mm 384^3, add 4Mi f32 and 1 f32, 1 thread)";
  return base;
}

plan::Calibration ensure_calibration(const std::filesystem::path& dump_folder) {
  const auto file = plan::calibration_path(dump_folder);
  plan::Calibration c = plan::load_calibration(file);
  if (c.compute_source.rfind("measured", 0) == 0) return c;
  c = measure_compute(c);
  plan::save_calibration(file, c);
  return c;
}

}  // namespace spmdx::exec
