// One-rank step time: the static train-step graph on the Executor vs the eager LibTorch peer
// (same model, init, batches and schedule), measured in the same process, interleaved step by
// step so that machine noise hits both alike. Prints one row per model and the ratio
// eager/static (> 1: static is faster).
//
//   build/bin/bench_train_step [--steps N] [--models llama:tiny:8:64,llama:debugmodel:2:256]
//                              [--cpu-matmul auto|onednn|aten]   (the static side's training.cpu_matmul)
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "eager_trainer.h"
#include "spmdx/exec/kernels.h"
#include "spmdx/exec/trainer.h"
#include "stats.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Case {
  std::string model, flavor;
  std::int64_t batch = 0, seq = 0;
};

using spmdx::bench::median;

void run(const Case& c, int steps) {
  constexpr std::int64_t kVocab = 256;
  constexpr double kLr = 8e-4;
  using namespace spmdx;
  const auto args = models::model_args(c.model, c.flavor, kVocab);
  models::Model model = models::build_model(args, c.batch, c.seq);
  exec::TensorMap init = exec::init_tensors(model, 42);
  train::TrainStepConfig config;
  test::EagerTrainer eager(args, config, init, kLr);
  exec::Trainer trainer(std::move(model), config, init);
  trainer.executor().set_profiling(std::getenv("SPMDX_BENCH_PROFILE") != nullptr);
  at::Generator data = at::make_generator<at::CPUGeneratorImpl>(7);
  std::vector<double> t_static, t_eager;
  double loss_static = 0, loss_eager = 0;
  const int warmup = 2;
  for (int step = 1; step <= warmup + steps; ++step) {
    at::Tensor seq = at::randint(0, kVocab, {c.batch, c.seq + 1}, data, at::TensorOptions().dtype(at::kLong));
    at::Tensor tokens = seq.slice(1, 0, c.seq).contiguous(), labels = seq.slice(1, 1, c.seq + 1).contiguous();
    const double lr = kLr * train::lr_factor(step, {2, warmup + steps});
    auto t0 = Clock::now();
    loss_static = trainer.step(step, lr, tokens, labels).loss;
    auto t1 = Clock::now();
    loss_eager = eager.step(lr, tokens, labels);
    auto t2 = Clock::now();
    if (step > warmup) {
      t_static.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
      t_eager.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
    }
  }
  const double s = median(t_static), e = median(t_eager);
  if (std::getenv("SPMDX_BENCH_PROFILE")) {
    std::vector<std::pair<double, std::string>> ops;
    for (const auto& [op, sec] : trainer.executor().op_seconds()) ops.emplace_back(sec, op);
    std::sort(ops.rbegin(), ops.rend());
    for (const auto& [sec, op] : ops) std::fprintf(stderr, "  %-24s %8.2f ms/step\n", op.c_str(), sec * 1e3 / (warmup + steps));
  }
  std::printf("%-6s %-11s %5lld x %-5lld %10.2f %10.2f %8.2fx %12.6f %12.6f %10.1f\n", c.model.c_str(), c.flavor.c_str(),
              static_cast<long long>(c.batch), static_cast<long long>(c.seq), s, e, e / s, loss_static, loss_eager,
              static_cast<double>(trainer.peak_bytes()) / (1 << 20));
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 10;
  std::string spec = "mlp:tiny:8:64,llama:tiny:8:64,llama:debugmodel:2:256";
  std::string library = "auto";
  CLI::App app{"One-rank step time: the static train-step graph vs eager LibTorch, interleaved; prints eager / static"};
  app.add_option("--steps", steps, "timed steps")->check(CLI::Range(1, 1000000));
  app.add_option("--models", spec, "name:flavor:batch:seq, comma separated");
  app.add_option("--cpu-matmul", library, "the static side's training.cpu_matmul: auto | onednn | aten");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);  // prints help, or the usage error
    return rc == 0 ? 0 : 2;      // usage errors exit 2, as spmdx's
  }
  auto usage = [&](const std::string& why) {
    std::fprintf(stderr, "error: %s\n%s", why.c_str(), app.help().c_str());
    return 2;
  };
  try {
    spmdx::exec::set_cpu_matmul(spmdx::exec::cpu_matmul_named(library));
  } catch (const std::runtime_error& e) {
    return usage(std::string("--cpu-matmul: ") + e.what());
  }
  std::vector<Case> cases;
  std::stringstream list(spec);
  std::string item;
  while (std::getline(list, item, ',')) {
    Case c;
    std::vector<std::string> f;
    std::stringstream fields(item);
    for (std::string x; std::getline(fields, x, ':');) f.push_back(x);
    if (f.size() != 4) return usage("--models entry '" + item + "': give name:flavor:batch:seq, e.g. llama:debugmodel:2:256");
    c.model = f[0], c.flavor = f[1];
    auto whole = [](const std::string& x) { return !x.empty() && x.size() <= 9 && x.find_first_not_of("0123456789") == std::string::npos; };
    if (!whole(f[2]) || !whole(f[3])) return usage("--models entry '" + item + "': batch and seq must be whole numbers below 10^9");
    c.batch = std::stoll(f[2]), c.seq = std::stoll(f[3]);
    if (c.batch < 1 || c.seq < 1) return usage("--models entry '" + item + "': batch and seq must be >= 1");
    try {
      spmdx::models::model_args(c.model, c.flavor, 256);
    } catch (const std::invalid_argument& e) {
      return usage("--models entry '" + item + "': " + e.what());
    }
    cases.push_back(c);
  }
  if (cases.empty()) return usage("--models names no model");
  std::printf("static train-step graph vs eager LibTorch (autograd + torch::optim::AdamW), %d timed steps, %d threads, static float32 linears on %s\n",
              steps, at::get_num_threads(), spmdx::exec::library_name(spmdx::exec::cpu_matmul()));
  std::printf("%-6s %-11s %13s %10s %10s %9s %12s %12s %10s\n", "model", "flavor", "batch x seq", "static ms", "eager ms",
              "speedup", "loss static", "loss eager", "peak MiB");
  for (const auto& c : cases) {
    auto fail = [&](const char* why) {
      std::fprintf(stderr, "error: --models entry %s:%s:%lld:%lld: %s\n", c.model.c_str(), c.flavor.c_str(), static_cast<long long>(c.batch),
                   static_cast<long long>(c.seq), why);
      return 1;
    };
    try {
      run(c, steps);
    } catch (const c10::Error& e) {  // e.g. a batch too large for memory (LibTorch's allocator)
      return fail(e.what_without_backtrace());
    } catch (const std::exception& e) {
      return fail(e.what());
    }
  }
  return 0;
}
