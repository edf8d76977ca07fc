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

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "spmdx/exec/trainer.h"
#include "spmdx/models/pt2.h"

namespace {

using Clock = std::chrono::steady_clock;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  using namespace spmdx;
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s FILE.pt2 [--flavor debugmodel] [--steps N]\n", argv[0]);
    return 2;
  }
  std::string path = argv[1], flavor = "debugmodel";
  int steps = 10;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--flavor") flavor = argv[i + 1];
    else if (a == "--steps") steps = std::max(1, std::atoi(argv[i + 1]));
    else {
      std::fprintf(stderr, "error: unexpected argument '%s'\n", a.c_str());
      return 2;
    }
  }
  models::ModelArgs pargs = models::model_args("pt2", "", 0);
  pargs.path = path;
  models::Model imported = models::import_pt2(pargs);
  const auto shape = imported.graph.find_input("tokens")->meta().shape;
  const std::int64_t batch = shape[0], seq = shape[1], vocab = imported.args.vocab_size;
  models::Model builtin = models::build_model(models::model_args("llama", flavor, vocab), batch, seq);
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
