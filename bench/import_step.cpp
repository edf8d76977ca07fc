// One-rank step time of an imported program against the built-in model of the same shape:
// both as static train-step graphs on the Executor, the same batches and schedule, steps
// interleaved so that machine noise hits both alike. Prints both medians and the ratio
// built-in / imported (1.0: the import adds nothing; the goal is >= 0.95).
//
//   build/bin/bench_import_step FILE.pt2 [--flavor debugmodel] [--steps N]
//
// FILE.pt2: examples/export/torchtitan_llama.py written with the flavor's shape (bench/import.sh
// does it): the built-in llama has no grouped-query attention, so --kv-heads = --heads.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "spmdx/exec/trainer.h"
#include "spmdx/exec/pt2_import.h"
#include "stats.h"

namespace {

using Clock = std::chrono::steady_clock;

using spmdx::bench::median;

}  // namespace

int main(int argc, char** argv) {
  using namespace spmdx;
  std::string path, flavor = "debugmodel";
  int steps = 10;
  CLI::App app{"One-rank step time of an imported program against the built-in model of the same shape"};
  app.add_option("file", path, "the .pt2 program (bench/import.sh writes it)")->required();
  app.add_option("--flavor", flavor, "the built-in llama flavor of the same shape");
  app.add_option("--steps", steps, "timed steps")->check(CLI::Range(1, 1000000));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);  // prints help, or the usage error
    return rc == 0 ? 0 : 2;      // usage errors exit 2, as spmdx's
  }
  models::Model imported, builtin;
  std::int64_t batch = 0, seq = 0;
  try {
    models::ModelArgs pargs = models::model_args("pt2", "", 0);
    pargs.path = path;
    imported = models::import_pt2(pargs);
    const auto& shape = imported.graph.find_input("tokens")->meta().shape;
    batch = shape[0], seq = shape[1];
    builtin = models::build_model(models::model_args("llama", flavor, imported.args.vocab_size), batch, seq);
  } catch (const std::exception& e) {  // an unreadable program, an unknown flavor
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  const std::int64_t vocab = imported.args.vocab_size;
  std::int64_t n_imported = 0, n_builtin = 0;
  for (const auto& p : imported.params) n_imported += imported.graph.find_input(p)->meta().numel();
  for (const auto& p : builtin.params) n_builtin += builtin.graph.find_input(p)->meta().numel();
  if (n_imported != n_builtin) {
    std::fprintf(stderr, "error: %s has %lld parameters, llama %s %lld: export it with the flavor's shape (bench/import.sh)\n", path.c_str(),
                 static_cast<long long>(n_imported), flavor.c_str(), static_cast<long long>(n_builtin));
    return 1;
  }
  train::TrainStepConfig config;
  exec::TensorMap init_a = exec::init_tensors(imported, 0), init_b = exec::init_tensors(builtin, 42);
  exec::Trainer a(std::move(imported), config, init_a);
  exec::Trainer b(std::move(builtin), config, init_b);
  at::Generator data = at::make_generator<at::CPUGeneratorImpl>(7);
  std::vector<double> ta, tb;
  const int warmup = 2;
  for (int step = 1; step <= warmup + steps; ++step) {
    at::Tensor s = at::randint(0, vocab, {batch, seq + 1}, data, at::TensorOptions().dtype(at::kLong));
    at::Tensor tokens = s.slice(1, 0, seq).contiguous(), labels = s.slice(1, 1, seq + 1).contiguous();
    const double lr = 8e-4 * train::lr_factor(step, {2, warmup + steps});
    auto t0 = Clock::now();
    a.step(step, lr, tokens, labels);
    auto t1 = Clock::now();
    b.step(step, lr, tokens, labels);
    auto t2 = Clock::now();
    if (step > warmup) {
      ta.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
      tb.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
    }
  }
  std::printf("one-rank step, imported %s vs built-in llama %s (%lld parameters, batch %lld x %lld), %d timed steps, %d threads\n", path.c_str(),
              flavor.c_str(), static_cast<long long>(n_builtin), static_cast<long long>(batch), static_cast<long long>(seq), steps, at::get_num_threads());
  std::printf("imported %.2f ms, built-in %.2f ms: ratio built-in/imported %.3f (goal >= 0.95)\n", median(ta), median(tb), median(tb) / median(ta));
  return 0;
}
