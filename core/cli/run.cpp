// `spmdx run CONFIG`: trains the job its config describes. With --nproc it checks everything
// that can be checked before any rank starts (config, tokenizer, degrees, plugins, data, GPUs),
// then starts the ranks here, each this same command told its rank by the environment (as
// torchrun --standalone; --nnodes for several hosts); without, it runs as the rank its
// environment names (one rank alone, or started by torchrun, srun or mpirun). Exit 0 when the
// job finished, 1 when it could not start or a rank failed, 2 on a usage error.
#include <sys/prctl.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <optional>
#include <unistd.h>

#include "command.h"
#include "job_calibration.h"
#include "self_exe.h"
#include "usage.h"
#include "spmdx/config/config.h"
#include "spmdx/core/log.h"
#include "spmdx/core/registry.h"
#include "spmdx/data/tokenizer.h"
#include "spmdx/launch/launcher.h"
#include "spmdx/job/compile.h"
#include "spmdx/job/preflight.h"
#include "spmdx/job/spec.h"
#include "spmdx/text.h"
#ifdef SPMDX_HAVE_EXEC
#include "spmdx/exec/calibrate.h"
#include "spmdx/exec/device.h"
#include "spmdx/exec/kernels.h"
#include "spmdx/job/run.h"
#include "spmdx/job/fault_injection.h"
#endif

namespace spmdx::cli {
namespace {

struct RunOptions {
  std::string config;
  int nproc = 0;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr;
  int master_port = 0;
  int max_restarts = 0;
  std::optional<std::string> cpu_affinity;  ///< --cpu-affinity: one CPU list a local rank, ';' separated
  bool print_config = false;
  std::vector<std::string> overrides;
};

// The preflight's problems, and for training.device = "cuda" whether this host has a GPU for
// each of its `ranks_per_host` ranks: checked before any rank starts, since each would fail
// with the same message.
std::vector<std::string> run_problems(const spmdx::config::Config& cfg, std::int64_t world_size, int ranks_per_host, spmdx::PluginRegistry& registry,
                                      std::unique_ptr<spmdx::data::Tokenizer>* tokenizer, std::optional<spmdx::job::JobSpec>* spec,
                                      const std::string& start_flag = "") {
  std::vector<std::string> problems = spmdx::job::preflight(cfg, world_size, registry, tokenizer, spec, spmdx::job::Preflight::run, start_flag);
#ifdef SPMDX_HAVE_EXEC
  // SPMDX_FAULT's form, once here rather than by every rank as it starts.
  if (const char* faults = std::getenv("SPMDX_FAULT"); faults != nullptr && *faults != '\0') {
    try {
      (void)spmdx::job::parse_fault(faults);
      const auto process_faults = spmdx::job::parse_process_faults(faults);
      if (spec->has_value()) {
        spmdx::launch::RankEnv env;
        env.world_size = static_cast<int>(world_size);
        spmdx::job::check_process_faults(process_faults, env, **spec);
      }
    } catch (const std::invalid_argument& e) {
      problems.push_back(e.what());
    }
  }
  if (!cfg.has_problem("training.device") && cfg.get_string("training.device") == "cuda" && cfg.get_list("training.devices").empty()) {
    if (const std::string why = spmdx::exec::cuda_problem(ranks_per_host); !why.empty()) {
      problems.push_back(cfg.where({"training.device"}) + ": training.device = \"cuda\": " + why);
    }
  }
  // training.devices: the GPUs this host's "cuda" ranks take (local rank = rank mod ranks per host).
  if (const auto& devices = cfg.get_list("training.devices"); !cfg.has_problem("training.devices") && !devices.empty()) {
    int needed = 0;
    std::vector<int> cuda_ranks;
    for (std::size_t r = 0; r < devices.size(); ++r) {
      if (devices[r] != "cuda") continue;
      needed = std::max(needed, static_cast<int>(r) % std::max(ranks_per_host, 1) + 1);
      cuda_ranks.push_back(static_cast<int>(r));
    }
    if (needed > 0) {
      if (std::string why = spmdx::exec::cuda_problem(needed); !why.empty()) {
        // Its advice names training.device; here the list's entries are what to change.
        if (const std::string advice = "; use training.device = \"cpu\""; why.size() >= advice.size() && why.compare(why.size() - advice.size(), advice.size(), advice) == 0) {
          why.resize(why.size() - advice.size());
        }
        problems.push_back(cfg.where({"training.devices"}) + ": training.devices puts " + spmdx::rank_list(cuda_ranks) + " on \"cuda\": " + why +
                           "; make " + (cuda_ranks.size() == 1 ? "its entry" : "their entries") + " \"cpu\", or \"auto\" (a GPU where the local rank has one, else the CPU)");
      }
    }
  }
#else
  (void)ranks_per_host;
#endif
  return problems;
}

int run_run(const RunOptions& o) {
  const bool launched = std::getenv("SPMDX_STORE_HOSTED") != nullptr;
  // --cpu-affinity's lists, checked before anything is read: a usage error (exit 2).
  std::vector<std::string> cpu_affinity;
  if (o.cpu_affinity && !launched) {
    try {
      if (o.nproc < 1) throw std::invalid_argument("--cpu-affinity pins the ranks spmdx run starts: give --nproc N (under torchrun, srun or mpirun, pin with their own binding)");
      cpu_affinity = spmdx::launch::cpu_affinity_lists(*o.cpu_affinity, o.nproc);
    } catch (const std::invalid_argument& e) {
      std::cerr << "error: " << e.what() << "\n";
      return 2;
    }
  }
  // A rank the launcher started: the launcher has checked everything already.
  spmdx::config::Config cfg = spmdx::config::Config::load(o.config, o.overrides, /*throw_on_problems=*/launched);
  if (o.print_config) {
    cfg.check();
    std::cout << cfg.to_toml();
    return 0;
  }
  if (o.nproc > 0 && !launched) {
    // strategy = "auto" prices plans with this machine's rates: measured once, before the ranks share its cores.
    if (!cfg.has_problem("parallelism.strategy") && !cfg.has_problem("job.dump_folder") && cfg.get_string("parallelism.strategy") == "auto") job_calibration(cfg);
    // Check everything that can be checked before starting any rank, and say all of it at once.
    spmdx::PluginRegistry registry;
    std::unique_ptr<spmdx::data::Tokenizer> tokenizer;
    std::optional<spmdx::job::JobSpec> spec;
    cfg.check(run_problems(cfg, o.nproc * o.nnodes, o.nproc, registry, &tokenizer, &spec, o.nnodes == 1 ? "--nproc" : ""));
    spmdx::job::check_data(cfg, *tokenizer, *spec);  // reads the data: only once the rest is right
    if (!cfg.ignored().empty()) std::cerr << cfg.ignored_text() << "\n";
#ifdef SPMDX_HAVE_EXEC
    if (spec->device.kind == "cpu") {  // MFU's peak: measured once per machine (cached), before the ranks share its cores
      spmdx::exec::set_cpu_matmul(spmdx::exec::cpu_matmul_named(spec->device.cpu_matmul));
      (void)spmdx::exec::gemm_peak();
    }
#endif
    std::vector<std::string> argv{self_exe(), "run", o.config};
    for (const auto& a : o.overrides) argv.push_back(a);
    spmdx::launch::LaunchOptions lo{o.nproc, o.nnodes, o.node_rank, o.master_addr, o.master_port, "spmdx run", ""};
    if (const auto& ft = spec->fault_tolerance; ft.enable) {
      lo.ft_groups = static_cast<int>(ft.groups);
      lo.ft_ranks_per_group = static_cast<int>(ft.ranks_per_group);
      lo.ft_min_replicas = static_cast<int>(ft.min_replicas);
      lo.ft_timeout_seconds = ft.timeout_seconds;
    } else if (o.max_restarts > 0) {
      cfg.check({cfg.where({"fault_tolerance.enable"}) + ": --max-restarts " + std::to_string(o.max_restarts) +
                 " starts lost replica groups again, under fault_tolerance.enable = true (off here); spmdx does not restart a whole job: "
                 "resume it from its checkpoint (checkpoint.enable = true)"});
    }
    lo.max_restarts = o.max_restarts;
    lo.cpu_affinity = cpu_affinity;
    const auto& enabled = cfg.get_list("hooks.enable");
    if (std::find(enabled.begin(), enabled.end(), "flight_recorder") != enabled.end()) {
      lo.flight_recorder_dir = (std::filesystem::path(cfg.get_string("job.dump_folder")) / "hooks" / "flight_recorder").string();
    }
    return spmdx::launch::launch(lo, argv);
  }
  const spmdx::launch::RankEnv env = spmdx::launch::rank_env();
  if (env.source == "single" && !cfg.has_problem("parallelism.")) {  // a job of several ranks started as one: say how to start it
    const std::int64_t want = spmdx::job::degree_product(cfg);
    if (want > 1) {  // with the config's other problems, if any: each is to fix before starting them
      cfg.check({cfg.where(spmdx::job::kDegreeKeys) + ": its parallelism degrees make " + std::to_string(want) + " ranks: start them with --nproc " +
                 std::to_string(want) + " (or under torchrun, srun, mpirun)"});
    }
  }
  if (!launched) {  // one rank, or started by hand, torchrun, srun or mpirun: this rank checks its own job
    spmdx::PluginRegistry registry;
    std::unique_ptr<spmdx::data::Tokenizer> tokenizer;
    std::optional<spmdx::job::JobSpec> spec;
    // Its warnings are the same for every rank of a host (the config's, the host's plugins and
    // backends): said by the host's first local rank, once.
    std::optional<spmdx::log::ThreadLevel> said_by_local_rank_0;
    if (env.local_rank != 0) said_by_local_rank_0.emplace(spmdx::log::Level::error);
    cfg.check(run_problems(cfg, env.world_size, env.local_world_size, registry, &tokenizer, &spec));
    if (env.rank == 0 && !cfg.ignored().empty()) std::cerr << cfg.ignored_text() << "\n";
  }
  if (launched) {
    prctl(PR_SET_PDEATHSIG, SIGTERM);  // never outlive the launcher
    if (getppid() == 1) return 1;
  }
  // One "[rank R]" a line: the launcher puts it on each line of the ranks it started; a rank
  // started otherwise (torchrun, srun, mpirun) puts it on its log lines itself.
  if (env.world_size > 1 && !launched) spmdx::log::set_rank(env.rank);
#ifdef SPMDX_HAVE_EXEC
  return spmdx::job::run_job(cfg, env);
#else
  std::cerr << "error: this spmdx was built without LibTorch (SPMDX_WITH_TORCH=OFF) and cannot run jobs\n";
  return 1;
#endif
}

class Run final : public Command {
 public:
  CLI::App* add(CLI::App& parent, const std::string& name) override {
    auto* run_cmd = parent.add_subcommand(name, "Train: the job its config describes, on --nproc ranks here or as torchrun/srun/mpirun started it");
    run_cmd->allow_extras();  // --section.key value overrides
    run_cmd->add_option("config", o_.config, "The job's TOML config")->required()->check(CLI::ExistingFile);
    run_cmd->add_option("--nproc,--nproc-per-node", o_.nproc, "Start this many ranks on this machine (as torchrun --standalone)")
        ->check(CLI::Range(1, 4096));
    run_cmd->add_option("--nnodes", o_.nnodes, "Nodes in the job (torchrun's flag; needs SPMDX_JOB_TOKEN)")->check(CLI::Range(1, 100000));
    run_cmd->add_option("--node-rank", o_.node_rank, "This node's index, 0 .. nnodes-1 (node 0 serves the store)")->check(CLI::NonNegativeNumber);
    run_cmd->add_option("--master-addr", o_.master_addr, "Node 0's address, reachable from every node");
    run_cmd->add_option("--master-port", o_.master_port, "The store's port on node 0")->check(CLI::Range(1, 65535));
    run_cmd->add_option("--max-restarts", o_.max_restarts,
                        "Fault tolerance: start lost replica groups again, at most this many times over the job (torchrun's flag)")
        ->check(CLI::Range(0, 1000000));
    run_cmd->add_option("--cpu-affinity", o_.cpu_affinity,
                        "Pin local rank r to the r-th of these ';'-separated CPU lists (taskset's form), e.g. \"0;1;1\": "
                        "unlike ranks on one machine; each rank's intra-op threads are its share of its CPUs");
    run_cmd->add_flag("--print-config", o_.print_config, "Print the effective config and exit");
    run_cmd->footer(kOverridesHelp);
    return run_cmd;
  }

  int run(const CLI::App& cmd, int, char**) override {
    o_.overrides = cmd.remaining();
    return run_run(o_);
  }

 private:
  RunOptions o_;
};

}  // namespace

std::unique_ptr<Command> make_run() { return std::make_unique<Run>(); }

}  // namespace spmdx::cli
