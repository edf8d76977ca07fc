#include "spmdx/comm/bench.h"

#include "spmdx/comm/all_to_all_v.h"

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

void print_header(const std::string& op, int n, const CommBackend& b) {
  std::printf("# spmdx bench comm: %s, %d ranks, %s\n", op.c_str(), n, b.describe().c_str());
  std::printf("#                                     out-of-place                       in-place\n");
  std::printf("# %10s %12s %6s %6s %9s %8s %8s %6s %9s %8s %8s %6s\n", "size", "count", "type", "redop", "time(us)", "algbw",
              "busbw", "#wrong", "time(us)", "algbw", "busbw", "#wrong");
  std::printf("# %10s %12s %6s %6s %9s %8s %8s %6s %9s %8s %8s %6s\n", "(B)", "(elements)", "", "", "", "(GB/s)", "(GB/s)", "", "",
              "(GB/s)", "(GB/s)", "");
}

// One size's line of the table: out-of-place, then in-place.
// us[1] < 0: the op has no in-place form here, and its columns say n/a.
void print_row(const std::string& op, int n, std::size_t count, const double us[2], const std::int64_t wrong[2]) {
  const double bytes = static_cast<double>(count) * 4;
  auto row = [&](int m) {
    if (us[m] < 0) {
      std::printf(" %9s %8s %8s %6s", "n/a", "n/a", "n/a", "n/a");
      return;
    }
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

// One size of the sweep: the op's buffers on this rank, the op on them, and the check of what
// it gave.
class SizeRun {
 public:
  SizeRun(CommBackend& b, int rank, int n, const BenchOptions& o, std::size_t count)
      : b_(b), rank_(rank), n_(n), o_(o), op_(o.op), count_(count), block_(count / static_cast<std::size_t>(n)),
        counts_(static_cast<std::size_t>(n), block_) {}

  // Microseconds per operation, out-of-place or in-place; `wrong` gets the wrong elements of
  // the first result.
  double time(bool in_place, std::int64_t& wrong) {
    prepare();
    finish(issue(in_place), op_.c_str());
    wrong = check();
    for (int i = 0; i < o_.warmup; ++i) finish(issue(in_place), op_.c_str());
    finish(b_.barrier(0), "barrier");
    const auto t0 = Clock::now();
    for (int i = 0; i < o_.iters; ++i) finish(issue(in_place), op_.c_str());
    return std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / o_.iters;
  }

 private:
  void prepare() {
    if (op_ == "all_reduce" || op_ == "broadcast") {
      in_.assign(count_, 0);
      for (std::size_t i = 0; i < count_; ++i) in_[i] = value(rank_, i);
      out_ = in_;
    } else if (op_ == "all_gather") {
      in_.resize(block_);
      for (std::size_t i = 0; i < block_; ++i) in_[i] = value(rank_, i);
      out_.assign(count_, 0);
    } else {  // reduce_scatter, all_to_all: the input is the full size
      in_.resize(count_);
      for (std::size_t i = 0; i < count_; ++i) in_[i] = value(rank_, i);
      out_.assign(op_ == "reduce_scatter" ? block_ : count_, 0);
    }
  }

  std::unique_ptr<Work> issue(bool in_place) {
    const CommDType t = CommDType::f32;
    if (op_ == "all_reduce") {
      if (!in_place) std::copy(in_.begin(), in_.end(), out_.begin());  // out-of-place: the result lands in another buffer
      return b_.all_reduce(0, {out_.data(), count_, t}, ReduceOp::sum);
    }
    if (op_ == "broadcast") {
      if (!in_place) std::copy(in_.begin(), in_.end(), out_.begin());
      return b_.broadcast(0, {out_.data(), count_, t}, 0);
    }
    if (op_ == "all_gather") return b_.all_gather(0, {in_.data(), block_, t}, {out_.data(), count_, t}, counts_);
    if (op_ == "reduce_scatter") return b_.reduce_scatter(0, {in_.data(), count_, t}, {out_.data(), block_, t}, counts_, ReduceOp::sum);
    if (op_ == "all_to_all_v") {  // the split sizes as expert parallelism sends them: known to the senders only
      recv_.assign(counts_.size(), 0);
      return all_to_all_v(b_, 0, {in_.data(), count_, t}, {out_.data(), count_, t}, counts_, recv_.data());
    }
    return b_.all_to_all(0, {in_.data(), count_, t}, {out_.data(), count_, t}, counts_, counts_);
  }

  std::int64_t check() const {
    std::int64_t wrong = 0;
    for (std::size_t i = 0; i < out_.size(); ++i) {
      float want = 0;
      if (op_ == "all_reduce") {
        for (int r = 0; r < n_; ++r) want += value(r, i);
      } else if (op_ == "broadcast") {
        want = value(0, i);
      } else if (op_ == "all_gather") {
        want = value(static_cast<int>(i / block_), i % block_);
      } else if (op_ == "reduce_scatter") {
        for (int r = 0; r < n_; ++r) want += value(r, static_cast<std::size_t>(rank_) * block_ + i);
      } else {  // all_to_all (and _v, split evenly): block j came from rank j, its block `rank`
        want = value(static_cast<int>(i / block_), static_cast<std::size_t>(rank_) * block_ + i % block_);
      }
      wrong += out_[i] != want;
    }
    if (op_ == "all_to_all_v") {
      for (std::size_t j = 0; j < recv_.size(); ++j) wrong += recv_[j] != counts_[j];  // each sender's count, learnt
    }
    return wrong;
  }

  // Waits for one operation. Past the timeout it aborts the backend and lets the operation
  // fail before the buffers it uses go away.
  void finish(std::unique_ptr<Work> w, const char* what) {
    if (w->wait(o_.timeout_seconds)) return;
    b_.abort();
    try {
      w->wait(60);
    } catch (const CommError&) {
    }
    throw CommError(std::string(what) + " of " + std::to_string(count_ * 4) + " bytes timed out after " +
                        std::to_string(o_.timeout_seconds) + " s (--timeout-seconds)", -1);
  }

  CommBackend& b_;
  const int rank_, n_;
  const BenchOptions& o_;
  const std::string& op_;
  const std::size_t count_, block_;
  const std::vector<std::size_t> counts_;
  std::vector<float> in_, out_;
  std::vector<std::size_t> recv_;
};

}  // namespace

std::int64_t run_comm_bench(CommBackend& b, int rank, int n, const BenchOptions& o) {
  const std::string& op = o.op;
  if (op != "all_reduce" && op != "all_gather" && op != "reduce_scatter" && op != "all_to_all" && op != "all_to_all_v" && op != "broadcast") {
    throw std::invalid_argument("unknown op '" + op + "' (all_reduce, all_gather, reduce_scatter, all_to_all, all_to_all_v, broadcast)");
  }
  if (rank == 0) print_header(op, n, b);
  std::int64_t total_wrong = 0;
  std::vector<std::uint64_t> sizes;
  for (std::uint64_t s = std::max<std::uint64_t>(o.min_bytes, 4); s <= o.max_bytes; s *= 2) sizes.push_back(s);
  for (const std::uint64_t size : sizes) {
    // size: the bytes of the full result (nccl-tests' convention); count in f32 elements,
    // rounded to a multiple of the rank count for the ops that split it.
    std::size_t count = size / 4;
    if (op != "all_reduce" && op != "broadcast") count = count / static_cast<std::size_t>(n) * static_cast<std::size_t>(n);
    if (count == 0) continue;
    SizeRun run(b, rank, n, o, count);
    double us[2] = {0, 0};
    std::int64_t wrong[2] = {0, 0};
    for (int mode = 0; mode < 2; ++mode) {
      const bool in_place = mode == 1;
      if (in_place && op != "all_reduce" && op != "broadcast") {  // no in-place form: nothing measured
        us[1] = -1;
        continue;
      }
      us[mode] = run.time(in_place, wrong[mode]);
    }
    total_wrong += wrong[0] + wrong[1];
    if (rank == 0 && o.times != nullptr) o.times->emplace_back(static_cast<double>(count) * 4, us[0] * 1e-6);
    if (rank == 0) print_row(op, n, count, us, wrong);
  }
  if (rank == 0) std::printf("# wrong results: %lld\n", static_cast<long long>(total_wrong));
  return total_wrong;
}

}  // namespace spmdx::comm
