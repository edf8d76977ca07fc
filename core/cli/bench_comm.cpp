// `spmdx bench comm`: times one collective over a comm backend, size by size, as nccl-tests do
// (algbw, busbw, results checked): starts --nproc ranks here, each this same command told its
// rank by the environment, or runs as the rank its environment names. With --calibrate, rank 0
// fits the ring model's alpha and beta to the times and writes them to a calibration.json.
// Exit 0 when every result was right, 1 when one was wrong or the sweep failed.
#include <sys/prctl.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <unistd.h>

#include "command.h"
#include "self_exe.h"
#include "usage.h"
#include "spmdx/comm/bench.h"
#include "spmdx/comm/score_map.h"
#include "spmdx/comm/store.h"
#include "spmdx/core/registry.h"
#include "spmdx/launch/launcher.h"
#include "spmdx/plan/estimate.h"
#include "spmdx/text.h"
#include "spmdx/job/compile.h"
#include "spmdx/job/preflight.h"
#include "spmdx/job/spec.h"

namespace spmdx::cli {
namespace {

struct BenchCommOptions {
  std::string backend = "ucx";
  int nproc = 2;
  std::string op = "all_reduce";
  std::string min_bytes = "8";
  std::string max_bytes = "64M";
  int iters = 20;
  int warmup = 5;
  double timeout_seconds = 300;
  std::vector<std::string> plugin_paths;
  std::string calibrate;            ///< --calibrate: the calibration.json to write alpha and beta to
  std::string link = "intra_host";  ///< --link
};

int run_bench_comm(const BenchCommOptions& o, const std::vector<std::string>& raw_args) {
  spmdx::comm::BenchOptions bo;
  bo.op = o.op;
  bo.min_bytes = spmdx::parse_bytes(o.min_bytes);
  bo.max_bytes = spmdx::parse_bytes(o.max_bytes);
  bo.iters = o.iters;
  bo.warmup = o.warmup;
  bo.timeout_seconds = o.timeout_seconds;
  if (bo.min_bytes < 4 || bo.max_bytes < 4) {
    throw std::invalid_argument("--min-bytes and --max-bytes must be at least 4 (one float32), got " + o.min_bytes + " and " + o.max_bytes);
  }
  if (bo.min_bytes > bo.max_bytes) throw std::invalid_argument("--min-bytes is larger than --max-bytes");
  if (!o.calibrate.empty() && o.nproc < 2 && std::getenv("SPMDX_STORE_HOSTED") == nullptr) {
    throw std::invalid_argument("--calibrate fits the link between ranks: give --nproc 2 or more");
  }
  if (!o.calibrate.empty()) spmdx::plan::load_calibration(o.calibrate);  // a bad file is named before the sweep, not after
  if (!o.calibrate.empty() && o.op != "all_reduce" && o.op != "all_gather" && o.op != "reduce_scatter") {
    throw std::invalid_argument("--calibrate fits the ring model of all_reduce, all_gather or reduce_scatter, not --op " + o.op);
  }
  const std::vector<std::filesystem::path> paths(o.plugin_paths.begin(), o.plugin_paths.end());
  if (std::getenv("SPMDX_STORE_HOSTED") == nullptr) {
    {  // the backend and its options, once, before any rank starts
      spmdx::PluginRegistry registry;
      registry.discover(spmdx::plugin_search_path(paths));
      if (const std::string why = spmdx::job::comm_backend_problem(registry, o.backend, "cpu"); !why.empty()) {
        throw std::invalid_argument("--backend \"" + o.backend + "\"" + why);
      }
    }
    std::vector<std::string> argv{self_exe()};
    for (const auto& a : raw_args) argv.push_back(a);
    return spmdx::launch::launch({o.nproc, 1, 0, "", 0, "spmdx bench comm", ""}, argv);
  }
  prctl(PR_SET_PDEATHSIG, SIGTERM);
  const auto env = spmdx::launch::rank_env();
  spmdx::comm::TcpStore store(env.master_addr, env.master_port, env.token, 60, env.rank);
  spmdx::PluginRegistry registry;
  registry.discover(spmdx::plugin_search_path(paths));
  auto backend = spmdx::comm::make_job_backend(registry, o.backend, {spmdx::MemoryType::host}, true);
  backend->init({env.rank, env.world_size, 0, &store, bo.timeout_seconds});
  std::vector<std::pair<double, double>> times;
  if (!o.calibrate.empty()) bo.times = &times;
  const std::int64_t wrong = spmdx::comm::run_comm_bench(*backend, env.rank, env.world_size, bo);
  if (!o.calibrate.empty() && env.rank == 0 && wrong == 0) {
    // The ring's counts per rank (redistribute.h): all_reduce 2(k-1) messages and 2(k-1)/k of
    // the bytes, all_gather and reduce_scatter half that.
    const double k = static_cast<double>(env.world_size), phases = bo.op == "all_reduce" ? 2 : 1;
    std::vector<double> messages, bytes, seconds;
    for (const auto& [size, t] : times) messages.push_back(phases * (k - 1)), bytes.push_back(phases * (k - 1) / k * size), seconds.push_back(t);
    const auto link = spmdx::plan::fit_alpha_beta(messages, bytes, seconds);
    spmdx::plan::Calibration c = spmdx::plan::load_calibration(o.calibrate);
    char source[256];
    std::snprintf(source, sizeof source, "spmdx bench comm --op %s, %d ranks, %s, %zu sizes", bo.op.c_str(), env.world_size, backend->describe().c_str(), times.size());
    (o.link == "inter_host" ? c.inter_host : c.intra_host) = link;
    (o.link == "inter_host" ? c.inter_source : c.intra_source) = source;
    spmdx::plan::save_calibration(o.calibrate, c);
    std::printf("# calibration: %s alpha %.2f us, beta %.3f GB/s (fitted to t = messages x alpha + bytes / beta) written to %s\n", o.link.c_str(),
                link.alpha * 1e6, link.beta / 1e9, o.calibrate.c_str());
  }
  backend->barrier(0)->wait(bo.timeout_seconds);
  backend->finalize();
  return wrong == 0 ? 0 : 1;
}

class BenchComm final : public Command {
 public:
  CLI::App* add(CLI::App& parent, const std::string& name) override {
    auto* bench_comm = parent.add_subcommand(name, "Time one collective over a backend, size by size, as nccl-tests do (algbw, busbw, checked)");
    bench_comm->add_option("--backend", o_.backend, "The comm plugin, \"name\" or \"name:key=value;...\" (ucx:chunk_bytes=1048576)")->capture_default_str();
    bench_comm->add_option("--nproc", o_.nproc, "Ranks to start here")->capture_default_str()->check(CLI::Range(1, 256));
    bench_comm->add_option("--op", o_.op, "The collective")->capture_default_str()
        ->check(CLI::IsMember({"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_to_all_v", "broadcast"}));
    bench_comm->add_option("--min-bytes", o_.min_bytes, "The smallest size (8, 4K, 64M, ...)")->capture_default_str();
    bench_comm->add_option("--max-bytes", o_.max_bytes, "The largest size")->capture_default_str();
    bench_comm->add_option("--iters", o_.iters, "Timed operations per size")->capture_default_str()->check(CLI::PositiveNumber);
    bench_comm->add_option("--warmup", o_.warmup, "Untimed operations per size")->capture_default_str()->check(CLI::NonNegativeNumber);
    bench_comm->add_option("--timeout-seconds", o_.timeout_seconds, "A collective that takes longer fails, naming the peer")
        ->capture_default_str()->check(CLI::Range(0.1, 1e6));
    bench_comm->add_option("--plugin-path", o_.plugin_paths, "Plugin files or folders searched first");
    bench_comm->add_option("--calibrate", o_.calibrate,
                           "Fit alpha and beta of the ring model to the out-of-place times and write them to this calibration.json (strategy = \"auto\" and compile --estimate read <job.dump_folder>/calibration.json)");
    bench_comm->add_option("--link", o_.link, "The link the ranks share: intra_host (one host) or inter_host (one rank a host)")
        ->capture_default_str()->check(CLI::IsMember({"intra_host", "inter_host"}));
    return bench_comm;
  }

  int run(const CLI::App&, int argc, char** argv) override { return run_bench_comm(o_, std::vector<std::string>(argv + 1, argv + argc)); }

 private:
  BenchCommOptions o_;
};

}  // namespace

std::unique_ptr<Command> make_bench_comm() { return std::make_unique<BenchComm>(); }

}  // namespace spmdx::cli
