// Sliding-window attention against full causal attention, one rank, forward and backward: the
// tiled window kernel (exec/kernels.h, tiled_attention) vs ATen's fused causal kernel
// (exec::sdpa, the causal path), on the same q, k, v, rounds interleaved so that machine noise
// hits both alike. Prints both medians and the ratio window / causal (goal <= 0.25).
//
//   build/bin/bench_attention [--seq 2048] [--window 256] [--batch 1] [--heads 16] [--head-dim 64] [--rounds 7]
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

#include "spmdx/exec/kernels.h"
#include "spmdx/ir/ops.h"
#include "stats.h"

namespace {

using Clock = std::chrono::steady_clock;

using spmdx::bench::median;

}  // namespace

int main(int argc, char** argv) {
  using namespace spmdx;
  std::int64_t seq = 2048, window = 256, batch = 1, heads = 16, head_dim = 64;
  int rounds = 7;
  CLI::App app{"Sliding-window attention (tiled kernel) vs full causal attention (ATen's fused kernel), forward and backward"};
  app.add_option("--seq", seq);
  app.add_option("--window", window);
  app.add_option("--batch", batch);
  app.add_option("--heads", heads);
  app.add_option("--head-dim", head_dim);
  app.add_option("--rounds", rounds);
  CLI11_PARSE(app, argc, argv);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(0);
  const at::Tensor q = at::randn({batch, heads, seq, head_dim}, gen), k = at::randn({batch, heads, seq, head_dim}, gen);
  const at::Tensor v = at::randn({batch, heads, seq, head_dim}, gen), g = at::randn({batch, heads, seq, head_dim}, gen);
  auto causal = [&] {
    const auto f = exec::sdpa(q, k, v, true);
    return exec::sdpa_backward(g, q, k, v, f[0], f[1], true);
  };
  const exec::AttentionMask mask{window, 1, 0, {}};
  auto windowed = [&] {
    const auto f = exec::tiled_attention(q, k, v, mask);
    return exec::tiled_attention_backward(g, q, k, v, f[0], f[1], mask);
  };
  auto seconds = [](auto&& f) {
    const auto t0 = Clock::now();
    f();
    return std::chrono::duration<double>(Clock::now() - t0).count();
  };
  causal(), windowed();  // warm-up
  std::vector<double> tc, tw;
  for (int r = 0; r < rounds; ++r) {
    tc.push_back(seconds(causal));
    tw.push_back(seconds(windowed));
  }
  std::int64_t pairs = 0;
  for (const auto& t : ir::attention_tiles(seq, seq, 1, 0, window)) pairs += t.rows * (t.key_end - t.key_begin);
  const double causal_pairs = static_cast<double>(seq) * static_cast<double>(seq + 1) / 2;
  std::printf("attention fwd+bwd, q/k/v [%lld, %lld, %lld, %lld] f32, %d rounds, %d threads: causal (ATen fused) %.1f ms, window %lld (tiled) %.1f ms: "
              "window / causal = %.3f (goal <= 0.25; score pairs visited %.3f of causal's)\n",
              static_cast<long long>(batch), static_cast<long long>(heads), static_cast<long long>(seq), static_cast<long long>(head_dim), rounds, at::get_num_threads(),
              1e3 * median(tc), static_cast<long long>(window), 1e3 * median(tw), median(tw) / median(tc), static_cast<double>(pairs) / causal_pairs);
  return 0;
}
