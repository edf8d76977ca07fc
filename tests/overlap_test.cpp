// Overlap, bucketing and prefetch (comm.overlap, comm.bucket_cap_mb, comm.prefetch) as the
// executor carries them out, counted instead of timed: the main job's rank 0 runs one step with
// them on and with them off against a backend that records every call it gets, the bytes, and
// how many kernels the executor had run (its own compute spans) when it issued the call and
// when it first waited for it. With them off every wait follows its issue with no kernel
// between: all communication is exposed. With them on the same bytes go in fewer calls, issued
// before the compute they overlap with and waited for later, exactly where the RuntimePlan
// says. Whether that makes the step faster on a given machine is a measurement
// (bench/overlap_compare.sh), not a test: nothing here reads a clock.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <regex>
#include <sstream>

#include "spmdx/config/config.h"
#include "spmdx/core/registry.h"
#include "spmdx/exec/distributed.h"
#include "spmdx/exec/kernels.h"
#include "spmdx/sharding/redistribute.h"
#include "spmdx/job/compile.h"
#include "spmdx/job/preflight.h"
#include "spmdx/job/spec.h"

namespace spmdx::exec {
namespace {

using ::testing::HasSubstr;

// One backend call as the backend saw it.
struct Call {
  std::string op;
  std::int64_t bytes = 0;
  std::int64_t issued_after = -1;  ///< kernels the executor had run when it made the call
  std::int64_t waited_after = -1;  ///< kernels it had run when it first waited for the call
  bool operator==(const Call&) const = default;
};
std::ostream& operator<<(std::ostream& out, const Call& c) {
  return out << c.op << " " << c.bytes << " B, issued after kernel " << c.issued_after << ", waited after kernel " << c.waited_after;
}

class CountingBackend;

// Done at once (the data is copied when the call is made); wait() notes when the executor
// first asked.
class CountedWork final : public Work {
 public:
  CountedWork(CountingBackend& backend, std::size_t index) : backend_(backend), index_(index) {}
  bool wait(double) override;
  bool test() override { return true; }

 private:
  CountingBackend& backend_;
  std::size_t index_;
};

// Rank 0 of every group, the other ranks absent: all_reduce leaves the buffer as it is,
// all_gather puts this rank's shard in every rank's block, reduce_scatter keeps this rank's
// block, all_to_all gives every block what this rank sends itself. The numbers are not what a job computes; the calls, their bytes and their order are.
class CountingBackend final : public CommBackend {
 public:
  const DistributedExecutor* executor = nullptr;
  std::vector<Call> calls;

  // The kernels the executor has run this step: one compute span each (a wait is a span too,
  // named "wait <op>", and is not a kernel).
  std::int64_t kernels_run() const {
    std::int64_t n = 0;
    for (const Span& s : executor->spans()) n += s.thread == "compute" && s.name.rfind("wait ", 0) != 0;
    return n;
  }

  void init(const CommInit&) override {}
  void finalize() override {}
  void abort() noexcept override {}
  std::string describe() const override { return "counting"; }
  std::vector<CommCapability> capabilities() const override { return {}; }
  int new_group(const std::vector<int>& ranks) override {
    if (ranks.empty() || ranks.front() != 0) throw std::logic_error("CountingBackend plays rank 0, the first of each of its groups");
    return 0;
  }
  std::unique_ptr<Work> all_reduce(int, CommBuffer buf, ReduceOp) override { return record("all_reduce", buf.bytes()); }
  std::unique_ptr<Work> all_gather(int, CommBuffer in, CommBuffer out, std::vector<std::size_t> counts) override {
    const std::size_t size = comm_dtype_size(in.dtype);
    std::size_t offset = 0;
    for (std::size_t c : counts) {
      std::memcpy(static_cast<char*>(out.data) + offset * size, in.data, std::min(c, in.count) * size);
      offset += c;
    }
    return record("all_gather", in.bytes());
  }
  std::unique_ptr<Work> reduce_scatter(int, CommBuffer in, CommBuffer out, std::vector<std::size_t> counts, ReduceOp) override {
    std::memcpy(out.data, in.data, counts.at(0) * comm_dtype_size(in.dtype));
    return record("reduce_scatter", in.bytes());
  }
  std::unique_ptr<Work> all_to_all(int, CommBuffer in, CommBuffer out, std::vector<std::size_t> send_counts, std::vector<std::size_t> recv_counts) override {
    const std::size_t size = comm_dtype_size(in.dtype);
    std::size_t offset = 0;
    for (std::size_t c : recv_counts) {  // every rank sends what this one sends itself
      std::memcpy(static_cast<char*>(out.data) + offset * size, in.data, std::min(c, send_counts.at(0)) * size);
      offset += c;
    }
    return record("all_to_all", in.bytes());
  }
  std::unique_ptr<Work> broadcast(int, CommBuffer, int) override { return unused("broadcast"); }
  std::unique_ptr<Work> send(CommBuffer, int, int) override { return unused("send"); }
  std::unique_ptr<Work> recv(CommBuffer, int, int) override { return unused("recv"); }
  std::unique_ptr<Work> barrier(int) override { return unused("barrier"); }

 private:
  std::unique_ptr<Work> record(const std::string& op, std::size_t bytes) {
    calls.push_back({op, static_cast<std::int64_t>(bytes), kernels_run(), -1});
    return std::make_unique<CountedWork>(*this, calls.size() - 1);
  }
  static std::unique_ptr<Work> unused(const std::string& op) { throw std::logic_error("the main job's step makes no " + op); }
};

bool CountedWork::wait(double) {
  Call& c = backend_.calls.at(index_);
  if (c.waited_after < 0) c.waited_after = backend_.kernels_run();
  return true;
}

// Rank 0's step of configs/llama_debug.toml (the main job) with the given overrides, as
// `spmdx run --nproc 4` plans it.
struct MainJob {
  job::JobSpec spec;
  std::unique_ptr<job::PlacedJob> job;
  std::unique_ptr<ir::Graph> graph;
  std::unique_ptr<sharding::DeviceMesh> mesh;
  explicit MainJob(const std::vector<std::pair<std::string, std::string>>& overrides) {
    config::Config cfg = config::Config::load(SPMDX_SOURCE_DIR "/configs/llama_debug.toml");
    for (const auto& [key, value] : overrides) cfg.override_value(key, value);
    PluginRegistry registry;
    registry.discover({{BUILTIN_PLUGIN_DIR, PluginSource::Origin::builtin}});
    spec = job::job_spec(cfg, 4, 264);  // the byte tokenizer's 264 ids
    job = std::make_unique<job::PlacedJob>(job::place_job(spec, registry));
    const sharding::DistributedPlan plan = job::propagate_job(*job);
    graph = std::make_unique<ir::Graph>(job::rank_program(*job, plan, 0, spec));
    mesh = std::make_unique<sharding::DeviceMesh>(job::run_mesh(*job));
  }
  // Inputs of the rank's shapes: token ids 0, AdamW's step 1, every other tensor 0.01.
  TensorMap feed() const {
    TensorMap f;
    for (const ir::Value* v : graph->inputs()) {
      const auto type = to_aten(v->meta().dtype);
      f[v->name()] = c10::isIntegralType(type, /*includeBool=*/true) ? at::zeros(v->meta().shape, type)
                                                     : at::full(v->meta().shape, v->name() == "step" ? 1.0 : 0.01, at::TensorOptions().dtype(type));
    }
    return f;
  }
};

// What the plan says the executor will do: per backend call in issue order, its op, bytes,
// and the kernels before its issue and before its wait (nodes with a kernel at earlier
// positions of the plan's order).
std::vector<Call> planned_calls(const ir::Graph& g, const plan::RuntimePlan& p) {
  std::vector<const ir::Node*> nodes;
  for (const auto& n : g.nodes()) nodes.push_back(n.get());
  std::vector<std::int64_t> kernels_before(p.order.size() + 1, 0);
  for (std::size_t q = 0; q < p.order.size(); ++q) {
    kernels_before[q + 1] = kernels_before[q] + (find_kernel(nodes[static_cast<std::size_t>(p.order[q])]->op()) != nullptr);
  }
  std::vector<Call> out;
  for (std::size_t q = 0; q < p.order.size(); ++q) {
    const int i = p.order[q];
    const ir::Node* n = nodes[static_cast<std::size_t>(i)];
    if (!sharding::is_collective(n->op())) continue;
    const int b = p.bucket_of[static_cast<std::size_t>(i)];
    if (b >= 0 && p.buckets[static_cast<std::size_t>(b)].issue_after != static_cast<int>(q)) continue;  // a bucket is one call, made at its last member
    std::int64_t bytes = 0;
    for (int m : b >= 0 ? p.buckets[static_cast<std::size_t>(b)].members : std::vector<int>{i}) bytes += nodes[static_cast<std::size_t>(m)]->input(0)->meta().nbytes();
    out.push_back({n->op(), bytes, kernels_before[q], kernels_before[static_cast<std::size_t>(p.waited_at(i))]});
  }
  return out;
}

// A controlled schedule: a call takes the time of 1 kernel plus 1 per 64 KiB it moves (a
// latency and a bandwidth, in kernels), and runs while the kernels between its issue and its
// wait do; the rest of it the executor waits through, exposed.
struct Schedule {
  double total = 0, exposed = 0;
  double hidden_share() const { return total > 0 ? 1.0 - exposed / total : 0.0; }
};
Schedule schedule(const std::vector<Call>& calls) {
  Schedule s;
  for (const Call& c : calls) {
    const double takes = 1.0 + static_cast<double>(c.bytes) / 65536.0;
    s.total += takes;
    s.exposed += std::max(0.0, takes - static_cast<double>(c.waited_after - c.issued_after));
  }
  return s;
}

struct Ran {
  std::vector<Call> calls, planned;
  RunStats stats;
  plan::RuntimePlan plan;
  std::string plan_text;
};

Ran run_step(const MainJob& j) {
  CountingBackend backend;
  DistributedExecutor ex(*j.graph, *j.mesh, 0, &backend, 60, j.spec.plan);
  ex.set_record_spans(true);
  backend.executor = &ex;
  ex.run(j.feed(), 1);
  return {backend.calls, planned_calls(*j.graph, ex.plan()), ex.stats(), ex.plan(), ex.plan().str(*j.graph, *j.mesh)};
}

std::int64_t count(const std::vector<Call>& calls, const std::string& op) {
  return std::count_if(calls.begin(), calls.end(), [&](const Call& c) { return c.op == op; });
}

const std::vector<std::pair<std::string, std::string>> kOff = {{"comm.overlap", "false"}, {"comm.bucket_cap_mb", "0"}, {"comm.prefetch", "false"}};

struct Layout {
  std::string name;
  std::vector<std::pair<std::string, std::string>> degrees;
};

void PrintTo(const Layout& layout, std::ostream* out) { *out << layout.name; }

class OverlapOnAndOff : public ::testing::TestWithParam<Layout> {};

TEST_P(OverlapOnAndOff, MoveTheSameBytesInFewerCallsAndOffExposesEveryOne) {
  const Layout& layout = GetParam();
  auto off_overrides = layout.degrees;
  off_overrides.insert(off_overrides.end(), kOff.begin(), kOff.end());
  const MainJob on_job(layout.degrees), off_job(off_overrides);
  ASSERT_TRUE(on_job.spec.plan.overlap && on_job.spec.plan.prefetch && on_job.spec.plan.bucket_bytes > 0);
  ASSERT_TRUE(!off_job.spec.plan.overlap && !off_job.spec.plan.prefetch && off_job.spec.plan.bucket_bytes == 0) << "the comm.* keys reach the plan";
  const Ran on = run_step(on_job), off = run_step(off_job);

  // The executor does what its plan says, call by call: op, bytes, and the kernels run before
  // each issue and each wait.
  EXPECT_EQ(on.calls, on.planned);
  EXPECT_EQ(off.calls, off.planned);

  // The same bytes, by the executor's count and by what reached the backend.
  std::int64_t on_bytes = 0, off_bytes = 0;
  for (const Call& c : on.calls) on_bytes += c.bytes;
  for (const Call& c : off.calls) off_bytes += c.bytes;
  EXPECT_GT(off_bytes, 0);
  EXPECT_EQ(on_bytes, off_bytes);
  EXPECT_EQ(on.stats.comm_bytes, off.stats.comm_bytes);
  EXPECT_EQ(on.stats.comm_bytes, static_cast<double>(on_bytes));

  // Off: one call per collective of the graph. On: the gradients' collectives bucketed.
  EXPECT_EQ(on.plan.collectives, off.plan.collectives);
  EXPECT_EQ(off.stats.collectives, off.plan.collectives);
  EXPECT_EQ(static_cast<std::int64_t>(off.calls.size()), off.stats.collectives);
  EXPECT_EQ(on.stats.collectives, on.plan.issues);
  EXPECT_EQ(static_cast<std::int64_t>(on.calls.size()), on.stats.collectives);
  EXPECT_LT(on.stats.collectives, off.stats.collectives);
  EXPECT_TRUE(off.plan.buckets.empty());
  EXPECT_FALSE(on.plan.buckets.empty());

  // Off: every call waited for before the next kernel. On: calls with kernels between their
  // issue and their wait.
  for (const Call& c : off.calls) EXPECT_EQ(c.waited_after, c.issued_after) << c;
  std::int64_t overlapped = 0, between = 0;
  for (const Call& c : on.calls) {
    EXPECT_GE(c.waited_after, c.issued_after) << c;
    overlapped += c.waited_after > c.issued_after;
    between += c.waited_after - c.issued_after;
  }
  EXPECT_GT(overlapped, 0);
  EXPECT_GT(between, 0);

  // Under the controlled schedule, off exposes all of its communication; on hides part of
  // its own and exposes less than off does. (How much depends on the schedule's constants and
  // the bucket cap: DDP's 25 MiB buckets on this 20 MiB model are mostly filled by the last
  // gradients, read at once by the gradient norm; bench/overlap.sh measures smaller buckets.)
  const Schedule s_on = schedule(on.calls), s_off = schedule(off.calls);
  EXPECT_DOUBLE_EQ(s_off.exposed, s_off.total);
  EXPECT_LT(s_on.exposed, s_on.total) << "nothing hidden";
  EXPECT_LT(s_on.exposed, s_off.exposed);
  std::printf("%s: off %zu calls, %.1f of %.1f kernel-times exposed; on %zu calls (%lld with kernels between issue and wait), %.1f of %.1f exposed (%.0f%% hidden); %lld bytes each\n",
              layout.name.c_str(), off.calls.size(), s_off.exposed, s_off.total, on.calls.size(), static_cast<long long>(overlapped), s_on.exposed, s_on.total,
              100 * s_on.hidden_share(), static_cast<long long>(on_bytes));

  // What `spmdx compile --dump` prints (rankR.plan.txt) says the same: off, every call is
  // waited for at its own position, no bucket, nothing prefetched.
  EXPECT_THAT(off.plan_text, HasSubstr(" collectives in " + std::to_string(off.plan.collectives) + " backend calls (0 buckets), 0 parameter all_gathers prefetched"));
  EXPECT_THAT(off.plan_text, HasSubstr("overlap off"));
  EXPECT_THAT(on.plan_text, HasSubstr(" collectives in " + std::to_string(on.plan.issues) + " backend calls (" + std::to_string(on.plan.buckets.size()) + " buckets)"));
  const std::regex line(R"(^\[(\d+)\] .*; waited at \[(\d+)\])");
  int lines = 0, later = 0;
  for (const auto& [text, is_off] : {std::pair{off.plan_text, true}, std::pair{on.plan_text, false}}) {
    std::istringstream in(text);
    for (std::string l; std::getline(in, l);) {
      std::smatch m;
      if (!std::regex_search(l, m, line)) continue;
      if (is_off) {
        ++lines;
        EXPECT_EQ(m[1].str(), m[2].str()) << l;
      } else {
        later += std::stoi(m[2]) > std::stoi(m[1]) + 1;
      }
    }
  }
  EXPECT_EQ(lines, off.plan.collectives);
  EXPECT_GT(later, 0);
}

INSTANTIATE_TEST_SUITE_P(
    MainJob, OverlapOnAndOff,
    ::testing::Values(Layout{"FsdpTimesTp", {}},  // the main job as it is: fsdp 2 x tp 2
                      Layout{"Ddp", {{"parallelism.data_parallel_replicate_degree", "4"},
                                     {"parallelism.data_parallel_shard_degree", "1"},
                                     {"parallelism.tensor_parallel_degree", "1"}}}),
    [](const auto& info) { return info.param.name; });

// FSDP's prefetch: with it, some parameter all_gathers are issued while the previous layer's
// kernels still have to run, and waited for after them; without it, none is.
TEST(FsdpPrefetch, IssuesTheNextLayersAllGathersBeforeTheCurrentLayersKernels) {
  const std::vector<std::pair<std::string, std::string>> fsdp = {{"parallelism.data_parallel_shard_degree", "4"}, {"parallelism.tensor_parallel_degree", "1"}};
  auto no_prefetch = fsdp;
  no_prefetch.emplace_back("comm.prefetch", "false");
  const Ran with = run_step(MainJob(fsdp)), without = run_step(MainJob(no_prefetch));
  EXPECT_EQ(with.calls, with.planned);
  EXPECT_EQ(without.calls, without.planned);
  EXPECT_EQ(count(with.calls, "all_gather"), count(without.calls, "all_gather"));
  ASSERT_GT(count(with.calls, "all_gather"), 0);
  auto early = [](const Ran& r) {  // all_gathers with kernels between their issue and their wait
    std::int64_t n = 0;
    for (const Call& c : r.calls) n += c.op == "all_gather" && c.waited_after > c.issued_after;
    return n;
  };
  EXPECT_FALSE(with.plan.prefetched.empty());
  EXPECT_TRUE(without.plan.prefetched.empty());
  // Each prefetched all_gather is one more with kernels between its issue and its wait (without
  // prefetch a parameter's all_gather is issued where its chain reads it: none, in the main job).
  EXPECT_GE(early(with), early(without) + static_cast<std::int64_t>(with.plan.prefetched.size()));
  EXPECT_EQ(early(without), 0);
}

}  // namespace
}  // namespace spmdx::exec
