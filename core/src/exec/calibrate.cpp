#include "spmdx/exec/calibrate.h"
#include "spmdx/exec/kernels.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <time.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "spmdx/core/log.h"
#include "spmdx/files.h"
#include "spmdx/metrics/tensorboard.h"
#include "spmdx/text.h"

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
  // bfloat16's path (native, upcast) since it was named: measured again when it changed.
  if (source.find("bfloat16 GEMMs ") != std::string::npos && source.find(half_gemm_summary(at::kBFloat16)) == std::string::npos) return true;
  if (source.find("float32 linears on ") != std::string::npos) return source.find(linears_on()) == std::string::npos;
  return source.find("ATen mm") != std::string::npos && cpu_matmul() == CpuMatmul::onednn;
}

double thread_cpu_seconds() {
  timespec t{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// The share of the wall time since it was made that this thread ran on a core (at most 1).
class CpuShare {
 public:
  double now() const {
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall0_).count();
    return wall > 0 ? std::min(1.0, (thread_cpu_seconds() - cpu0_) / wall) : 1.0;
  }

 private:
  std::chrono::steady_clock::time_point wall0_ = std::chrono::steady_clock::now();
  double cpu0_ = thread_cpu_seconds();
};

// How a measurement taken at `share` of a core says it was busy.
std::string busy_text(double share) { return "the measuring thread ran " + std::to_string(static_cast<int>(100 * share)) + "% of the time"; }

// "measured 2026-12-06 08:44": a measurement's source begins so (ensure_calibration checks it).
std::string measured_now() {
  char when[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M", std::localtime(&now));
  return std::string("measured ") + when;
}

// Below this share of the wall time on a core, the measuring thread waited for one: the machine
// was busy (CI's tests beside it measured a matmul rate of 22 GFLOP/s, idle 75).
constexpr double kIdleShare = 0.8;

}  // namespace

plan::Calibration measure_compute(plan::Calibration base, double seconds, double* cpu_share) {
  const CpuShare ran;
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
  // The same three in bfloat16 and in float16 as the kernels run them on this CPU
  // (exec::half_gemm: native, or float32 GEMMs of the upcast operands).
  double half_matmul[2] = {0, 0};
  for (const int i : {0, 1}) {
    const at::ScalarType t = i == 0 ? at::kBFloat16 : at::kHalf;
    const at::Tensor xh = x.to(t), wh = w.to(t), gh = g.to(t);
    half_matmul[i] = per_call(
                         [&] {
                           (void)cpu_linear(xh, wh);
                           (void)cpu_linear(gh, wh.t());
                           (void)cpu_half_aware_matmul(gh.t(), xh);
                         },
                         seconds / 4) /
                     3;
  }
  const std::int64_t m = 4 << 20;
  const at::Tensor u = at::randn({m}), v = at::randn({m});
  const double add = per_call([&] { (void)at::add(u, v); }, seconds / 2);
  const at::Tensor one = at::randn({1});
  const double tiny = per_call([&] { (void)at::add(one, one); }, 0.05);
  at::set_num_threads(threads);
  base.matmul_flops_per_second = 2.0 * n * n * n / matmul;
  base.half_matmul_flops_per_second = 2.0 * n * n * n / half_matmul[0];
  base.float16_matmul_flops_per_second = 2.0 * n * n * n / half_matmul[1];
  base.memory_bytes_per_second = 12.0 * static_cast<double>(m) / add;
  base.node_seconds = tiny;
  base.compute_source = measured_now() + " (a linear's three 384^3 products, " + linears_on() + ", " + half_gemm_summary(at::kBFloat16) + ", " + half_gemm_summary(at::kHalf) + "; add 4Mi f32 and 1 f32; 1 thread)";
  if (cpu_share != nullptr) *cpu_share = ran.now();
  return base;
}

plan::Calibration ensure_calibration(const std::filesystem::path& dump_folder) {
  const auto file = plan::calibration_path(dump_folder);
  plan::Calibration c = plan::load_calibration(file);
  if (c.compute_source.rfind("measured", 0) == 0 && !other_library(c.compute_source)) return c;
  double share = 1;
  c = measure_compute(c, 0.6, &share);
  if (share < kIdleShare) {
    const std::string ran = busy_text(share);
    c.compute_source += "; busy: " + ran;
    SPMDX_WARN(file.string() << ": the machine was busy while spmdx measured its compute rates (" << ran
                             << "), so they are low and estimates long: delete the file to measure again when it is idle");
  }
  plan::save_calibration(file, c);
  return c;
}

double GemmPeak::of(const std::string& dtype) const {
  if (dtype == "float32") return float32;
  if (dtype == "bfloat16") return bfloat16;
  if (dtype == "float16") return float16;
  throw std::invalid_argument("GEMM peak of dtype '" + dtype + "': float32, bfloat16 or float16");
}

namespace {

std::string cpuinfo_field(const std::string& key) {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) != 0) continue;
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    const auto start = line.find_first_not_of(' ', colon + 1);
    return start == std::string::npos ? "" : line.substr(start);
  }
  return "";
}

// The CPU's model name ("unknown CPU" where /proc/cpuinfo has none).
std::string cpu_model() {
  const std::string m = cpuinfo_field("model name");
  return m.empty() ? "unknown CPU" : m;
}

// The kernels' choices on this CPU, which its GEMM rates depend on.
std::string gemm_libraries() {
  return std::string("float32 on ") + library_name(cpu_matmul()) + ", " + half_gemm_summary(at::kBFloat16) + ", " + half_gemm_summary(at::kHalf);
}

std::filesystem::path cache_dir() {
  if (const char* d = std::getenv("SPMDX_CACHE_DIR"); d != nullptr && *d != '\0') return d;
  if (const char* d = std::getenv("XDG_CACHE_HOME"); d != nullptr && *d != '\0') return std::filesystem::path(d) / "spmdx";
  if (const char* d = std::getenv("HOME"); d != nullptr && *d != '\0') return std::filesystem::path(d) / ".cache" / "spmdx";
  return {};
}

}  // namespace

GemmPeak measure_gemm_peak(double seconds) {
  const CpuShare ran;
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const std::int64_t n = 1024;
  const double flops = 2.0 * n * n * n;
  GemmPeak p;
  {
    const at::Tensor a = at::randn({n, n}), b = at::randn({n, n});
    const double linear = per_call([&] { (void)cpu_linear(a, b); }, seconds / 2);
    const double mm = per_call([&] { (void)at::mm(a, b); }, seconds / 2);
    p.float32 = flops / std::min(linear, mm);
  }
  for (const at::ScalarType t : {at::kBFloat16, at::kHalf}) {
    const at::Tensor a = at::randn({n, n}).to(t), b = at::randn({n, n}).to(t);
    const double s = per_call([&] { (void)cpu_half_aware_matmul(a, b); }, seconds / 2);
    (t == at::kBFloat16 ? p.bfloat16 : p.float16) = flops / s;
  }
  at::set_num_threads(threads);
  const double share = ran.now();
  p.source = measured_now() + " on " + cpu_model() + " (1024^3 products, 1 thread; " + gemm_libraries() + ")";
  if (share < kIdleShare) p.source += "; busy: " + busy_text(share);
  return p;
}

GemmPeak gemm_peak() {
  static const GemmPeak peak = [] {
    const std::string key = cpu_model() + " | " + cpuinfo_field("flags") + " | " + gemm_libraries();
    const std::filesystem::path dir = cache_dir();
    const std::filesystem::path file = dir.empty() ? std::filesystem::path() : dir / "gemm_peak.json";
    nlohmann::json cache = nlohmann::json::object();
    if (!file.empty() && unreadable_file(file).empty()) {
      try {
        const std::string text = read_file_bytes(file);
        check_json_nesting(text);  // a forged file nested deep enough would overflow the stack
        cache = nlohmann::json::parse(text);
        if (!cache.is_object()) throw std::invalid_argument("not a JSON object");
      } catch (const std::exception& e) {
        SPMDX_WARN(file.string() << ": not the GEMM peak cache spmdx writes (" << e.what() << "): measured again and rewritten");
        cache = nlohmann::json::object();  // a torn or edited cache
      }
    }
    GemmPeak kept;
    if (cache.contains(key)) {
      try {
        const auto& e = cache.at(key);
        kept = {e.at("float32").get<double>(), e.at("bfloat16").get<double>(), e.at("float16").get<double>(), e.at("source").get<std::string>()};
        // A busy measurement is kept for 10 minutes (the ranks of the job that measured it read
        // it), then measured again.
        const bool fresh = kept.source.find("busy") == std::string::npos || metrics::unix_time_s() - e.value("time", 0.0) < 600;
        // A core's GEMM rate from 0.1 GFLOP/s to 10 TFLOP/s (AMX's bfloat16 peak is about 2): else
        // an edited or corrupt entry, measured again.
        auto plausible = [](double v) { return std::isfinite(v) && v >= 1e8 && v <= 1e13; };
        if (!plausible(kept.float32) || !plausible(kept.bfloat16) || !plausible(kept.float16)) {
          SPMDX_WARN(file.string() << ": its GEMM peak for this CPU is not a rate a core has (" << kept.float32 << ", " << kept.bfloat16 << ", "
                                   << kept.float16 << " FLOP/s): measured again");
          kept = {};
        } else if (fresh) {
          return kept;
        }
      } catch (const std::exception& e) {
        SPMDX_WARN(file.string() << ": its entry for this CPU is not the one spmdx writes (" << e.what() << "): measured again");
        kept = {};
      }
    }
    GemmPeak p = measure_gemm_peak();
    if (kept.float32 > p.float32) p = kept;  // a busy measurement and a busier one: the higher
    if (!file.empty()) {
      cache[key] = {{"float32", p.float32}, {"bfloat16", p.bfloat16}, {"float16", p.float16}, {"source", p.source}, {"time", metrics::unix_time_s()}};
      try {
        std::filesystem::create_directories(dir);
        write_file_atomic(file, cache.dump(1) + "\n");
      } catch (const std::exception& e) {
        SPMDX_WARN("cannot keep this machine's GEMM peak in " << file.string() << " (" << e.what() << "): measured again by the next run");
      }
    }
    return p;
  }();
  return peak;
}

}  // namespace spmdx::exec
