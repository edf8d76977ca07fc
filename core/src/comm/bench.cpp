#include "spmdx/comm/bench.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <vector>

namespace spmdx::comm {
namespace {

using Clock = std::chrono::steady_clock;

double bus_factor(const std::string& op, int n) {
  if (op == "all_reduce") return 2.0 * (n - 1) / n;
  if (op == "broadcast") return 1.0;
  return static_cast<double>(n - 1) / n;
}

// Element i of rank r's input, exact in f32 and small enough to sum over many ranks.
float value(int r, std::size_t i) { return static_cast<float>((r + 1) * 3 + static_cast<int>(i % 7)); }

}  // namespace

std::int64_t run_comm_bench(CommBackend& b, int rank, int n, const BenchOptions& o) {
  const std::string& op = o.op;
  if (op != "all_reduce" && op != "all_gather" && op != "reduce_scatter" && op != "all_to_all" && op != "broadcast") {
    throw std::invalid_argument("unknown op '" + op + "' (all_reduce, all_gather, reduce_scatter, all_to_all, broadcast)");
  }
  if (rank == 0) {
    std::printf("# spmdx bench comm: %s, %d ranks, %s\n", op.c_str(), n, b.describe().c_str());
    std::printf("#                                     out-of-place                       in-place\n");
    std::printf("# %10s %12s %6s %6s %9s %8s %8s %6s %9s %8s %8s %6s\n", "size", "count", "type", "redop", "time(us)", "algbw",
                "busbw", "#wrong", "time(us)", "algbw", "busbw", "#wrong");
    std::printf("# %10s %12s %6s %6s %9s %8s %8s %6s %9s %8s %8s %6s\n", "(B)", "(elements)", "", "", "", "(GB/s)", "(GB/s)", "", "",
                "(GB/s)", "(GB/s)", "");
  }
  std::int64_t total_wrong = 0;
  std::vector<std::uint64_t> sizes;
  for (std::uint64_t s = std::max<std::uint64_t>(o.min_bytes, 4); s <= o.max_bytes; s *= 2) sizes.push_back(s);
  for (const std::uint64_t size : sizes) {
    // size: the bytes of the full result (nccl-tests' convention); count in f32 elements,
    // rounded to a multiple of the rank count for the ops that split it.
    std::size_t count = size / 4;
    if (op != "all_reduce" && op != "broadcast") count = count / static_cast<std::size_t>(n) * static_cast<std::size_t>(n);
    if (count == 0) continue;
    const std::size_t block = count / static_cast<std::size_t>(n);
    std::vector<float> in, out;
    std::vector<std::size_t> counts(static_cast<std::size_t>(n), block);
    auto prepare = [&](bool in_place) {
      if (op == "all_reduce" || op == "broadcast") {
        in.assign(count, 0);
        for (std::size_t i = 0; i < count; ++i) in[i] = value(rank, i);
        out = in;
      } else if (op == "all_gather") {
        in.resize(block);
        for (std::size_t i = 0; i < block; ++i) in[i] = value(rank, i);
        out.assign(count, 0);
      } else {  // reduce_scatter, all_to_all: the input is the full size
        in.resize(count);
        for (std::size_t i = 0; i < count; ++i) in[i] = value(rank, i);
        out.assign(op == "reduce_scatter" ? block : count, 0);
      }
      (void)in_place;
    };
    auto issue = [&](bool in_place) -> std::unique_ptr<Work> {
      const CommDType t = CommDType::f32;
      if (op == "all_reduce") {
        if (!in_place) std::copy(in.begin(), in.end(), out.begin());  // out-of-place: the result lands in another buffer
        return b.all_reduce(0, {out.data(), count, t}, ReduceOp::sum);
      }
      if (op == "broadcast") {
        if (!in_place) std::copy(in.begin(), in.end(), out.begin());
        return b.broadcast(0, {out.data(), count, t}, 0);
      }
      if (op == "all_gather") return b.all_gather(0, {in.data(), block, t}, {out.data(), count, t}, counts);
      if (op == "reduce_scatter") return b.reduce_scatter(0, {in.data(), count, t}, {out.data(), block, t}, counts, ReduceOp::sum);
      return b.all_to_all(0, {in.data(), count, t}, {out.data(), count, t}, counts, counts);
    };
    auto check = [&]() {
      std::int64_t wrong = 0;
      for (std::size_t i = 0; i < out.size(); ++i) {
        float want = 0;
        if (op == "all_reduce") {
          for (int r = 0; r < n; ++r) want += value(r, i);
        } else if (op == "broadcast") {
          want = value(0, i);
        } else if (op == "all_gather") {
          want = value(static_cast<int>(i / block), i % block);
        } else if (op == "reduce_scatter") {
          for (int r = 0; r < n; ++r) want += value(r, static_cast<std::size_t>(rank) * block + i);
        } else {  // all_to_all: block j came from rank j, its block `rank`
          want = value(static_cast<int>(i / block), static_cast<std::size_t>(rank) * block + i % block);
        }
        wrong += out[i] != want;
      }
      return wrong;
    };
    double us[2] = {0, 0};
    std::int64_t wrong[2] = {0, 0};
    for (int mode = 0; mode < 2; ++mode) {
      const bool in_place = mode == 1;
      if (in_place && op != "all_reduce" && op != "broadcast") {  // no in-place form: report the same op
        us[1] = us[0];
        wrong[1] = wrong[0];
        continue;
      }
      // Waits for one operation. Past the timeout it aborts the backend and lets the operation
      // fail before the buffers it uses go away.
      auto finish = [&](std::unique_ptr<Work> w, const char* what) {
        if (w->wait(o.timeout_seconds)) return;
        b.abort();
        try {
          w->wait(60);
        } catch (const CommError&) {
        }
        throw CommError(std::string(what) + " of " + std::to_string(count * 4) + " bytes timed out after " +
                            std::to_string(o.timeout_seconds) + " s (--timeout-seconds)", -1);
      };
      prepare(in_place);
      finish(issue(in_place), op.c_str());
      wrong[mode] = check();
      for (int i = 0; i < o.warmup; ++i) finish(issue(in_place), op.c_str());
      finish(b.barrier(0), "barrier");
      const auto t0 = Clock::now();
      for (int i = 0; i < o.iters; ++i) finish(issue(in_place), op.c_str());
      us[mode] = std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / o.iters;
    }
    total_wrong += wrong[0] + wrong[1];
    if (rank == 0) {
      const double bytes = static_cast<double>(count) * 4;
      auto row = [&](int m) {
        const double algbw = bytes / (us[m] * 1e-6) / 1e9;
        std::printf(" %9.1f %8.3f %8.3f %6lld", us[m], algbw, algbw * bus_factor(op, n), static_cast<long long>(wrong[m]));
      };
      std::printf("  %10llu %12zu %6s %6s", static_cast<unsigned long long>(count * 4), count, "float",
                  op == "all_reduce" || op == "reduce_scatter" ? "sum" : "none");
      row(0);
      row(1);
      std::printf("\n");
      std::fflush(stdout);
    }
  }
  if (rank == 0) std::printf("# wrong results: %lld\n", static_cast<long long>(total_wrong));
  return total_wrong;
}

}  // namespace spmdx::comm
