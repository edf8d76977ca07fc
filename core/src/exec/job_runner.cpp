#include "spmdx/exec/job_runner.h"

#include <ATen/ATen.h>

#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <optional>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <sstream>
#include <csignal>
#include <pthread.h>
#include <sys/sysinfo.h>
#include <unistd.h>
#include <fstream>
#include <nlohmann/json.hpp>

#include "spmdx/comm/health.h"
#include "spmdx/comm/score_map.h"
#include "spmdx/comm/store.h"
#include "spmdx/files.h"
#include "spmdx/core/log.h"
#include "spmdx/core/registry.h"
#include "spmdx/text.h"
#include "spmdx/data/text_dataset.h"
#include "spmdx/comm/c10d_store.h"
#include "spmdx/exec/checkpoint.h"
#include "spmdx/exec/comm_chain.h"
#include "spmdx/exec/device.h"
#include "spmdx/exec/kernels.h"
#include "spmdx/exec/distributed.h"
#include "spmdx/exec/shards.h"
#include "spmdx/exec/trainer.h"
#include "spmdx/exec/profiler.h"
#include "spmdx/metrics/tensorboard.h"
#include "spmdx/core/version.h"
#include "spmdx/launch/launcher.h"
#include "spmdx/launch/rendezvous.h"
#include "spmdx/hooks/hook_set.h"
#include "spmdx/sharding/spec.h"
#include "spmdx/train/checkpoint_folder.h"
#include "spmdx/train/job.h"
#include "spmdx/plan/memory_plan.h"
#include "spmdx/train/memory_budget.h"

namespace spmdx::exec {
namespace {

using Clock = std::chrono::steady_clock;

// Intra-op threads for this rank: OMP_NUM_THREADS when set (torchrun sets it to 1 for several
// ranks per host, and a user's value wins, as in PyTorch), else this process's CPUs (its
// affinity mask: taskset, a cgroup cpuset, a SLURM binding) shared among the host's ranks.
int intra_op_threads(int local_world_size) {
  if (const char* v = std::getenv("OMP_NUM_THREADS"); v != nullptr && *v != '\0') {
    char* end = nullptr;
    const long n = std::strtol(v, &end, 10);
    if (*end == '\0' && n >= 1 && n <= 4096) return static_cast<int>(n);
    SPMDX_WARN("OMP_NUM_THREADS='" << v << "' is not a whole number from 1 to 4096: ignored, threads come from the CPUs available");
  }
  return std::max(1, static_cast<int>(launch::usable_cpus()) / std::max(1, local_world_size));
}

// Resident memory of this process, in bytes (from /proc/self/statm).
std::int64_t rss_bytes() {
  std::ifstream statm("/proc/self/statm");
  std::int64_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * static_cast<std::int64_t>(sysconf(_SC_PAGESIZE));
}

// Fault injection for testing the debug hooks, from SPMDX_FAULT (never set in normal runs):
//   skip_collective:rank=R,step=S,index=I  rank R does not issue the collective at plan index I of
//                                          step S (CollectiveInfo::index; a bucket member: its bucket)
//   perturb:rank=R,step=S,tensor=NAME[,delta=D]  rank R adds D (1e-3) to NAME after step S
struct Fault {
  std::string kind;
  int rank = -1;
  std::int64_t step = -1, index = 0;
  std::string tensor;
  double delta = 1e-3;
};

Fault parse_fault(const char* text) {
  Fault f;
  if (text == nullptr || *text == '\0') return f;
  const std::string spec(text);
  auto bad = [&](const std::string& why) {
    return std::invalid_argument("SPMDX_FAULT='" + spec + "': " + why +
                                 " (expected skip_collective:rank=R,step=S,index=I or perturb:rank=R,step=S,tensor=NAME[,delta=D])");
  };
  const auto colon = spec.find(':');
  f.kind = spec.substr(0, colon);
  if (f.kind != "skip_collective" && f.kind != "perturb") throw bad("unknown fault '" + f.kind + "'");
  std::stringstream list(colon == std::string::npos ? "" : spec.substr(colon + 1));
  std::string item;
  while (std::getline(list, item, ',')) {
    const auto eq = item.find('=');
    if (eq == std::string::npos) throw bad("'" + item + "' is not key=value");
    const std::string key = item.substr(0, eq), value = item.substr(eq + 1);
    auto integer = [&] {
      std::size_t used = 0;
      long long x = 0;
      try {
        x = std::stoll(value, &used);
      } catch (const std::logic_error&) {
        used = 0;
      }
      if (used == 0 || used != value.size() || x < 0) throw bad(key + "='" + value + "' is not a whole number >= 0");
      return static_cast<std::int64_t>(x);
    };
    if (key == "rank") f.rank = static_cast<int>(integer());
    else if (key == "step") f.step = integer();
    else if (key == "index") f.index = integer();
    else if (key == "tensor") f.tensor = value;
    else if (key == "delta") {
      try {
        std::size_t used = 0;
        f.delta = std::stod(value, &used);
        if (used != value.size()) throw std::invalid_argument(value);
      } catch (const std::logic_error&) {
        throw bad("delta='" + value + "' is not a number");
      }
    } else {
      throw bad("unknown key '" + key + "'");
    }
  }
  if (f.rank < 0 || f.step < 1) throw bad("rank=R and step=S (S >= 1) are required");
  if (f.kind == "perturb" && f.tensor.empty()) throw bad("perturb needs tensor=NAME");
  return f;
}

// With debug hooks on, SIGTERM, SIGINT and SIGUSR1 go to a thread of their own: SIGUSR1 asks
// the hooks to dump (the flight recorder) and goes on; SIGTERM and SIGINT (the launcher
// stopping the job, Ctrl-C) dump, then exit 128 + signal. Blocked before any other thread
// starts, so that every thread inherits the mask.
class SignalDumper {
 public:
  SignalDumper() {
    sigemptyset(&set_);
    for (int s : {SIGTERM, SIGINT, SIGUSR1, SIGUSR2}) sigaddset(&set_, s);
    pthread_sigmask(SIG_BLOCK, &set_, &old_);
  }
  void start(hooks::HookSet* hooks) {
    thread_ = std::thread([this, hooks] {
      while (true) {
        int sig = 0;
        if (sigwait(&set_, &sig) != 0 || sig == SIGUSR2) return;  // SIGUSR2: the destructor's stop
        hooks->failure(std::string("signal ") + strsignal(sig) + (sig == SIGUSR1 ? " (dump requested)" : ""));
        if (sig != SIGUSR1) {
          std::fflush(nullptr);
          _exit(128 + sig);
        }
      }
    });
  }
  ~SignalDumper() {
    if (thread_.joinable()) {
      pthread_kill(thread_.native_handle(), SIGUSR2);
      thread_.join();
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }

 private:
  sigset_t set_, old_;
  std::thread thread_;
};

// What the token ids of a run mean, for checkpoints: "byte (264 ids, BOS 256, EOS 257)", or "tokenizer.json <FNV-1a of its
// bytes> (<n> ids)": another file with the same vocabulary size maps ids to other tokens.
std::string tokenizer_fingerprint(const std::string& spec, std::int64_t vocab) {
  // "byte" alone was the 256-id byte tokenizer without BOS/EOS, before documents kept their
  // boundaries: its checkpoints have 256 embedding rows and are refused on resume.
  if (spec == "byte") return "byte (264 ids, BOS 256, EOS 257)";
  std::filesystem::path p = spec;
  std::error_code ec;
  if (std::filesystem::is_directory(p, ec)) p /= "tokenizer.json";
  std::ifstream in(p, std::ios::binary);
  const std::string bytes(std::istreambuf_iterator<char>(in), {});
  return "tokenizer.json " + fnv1a_hex(bytes) + " (" + std::to_string(vocab) + " ids)";
}

// A NumPy .npy file (format 1.0) of int64 [rows, cols], little endian, C order.
std::string npy_i64(const std::vector<std::int64_t>& data, std::int64_t rows, std::int64_t cols) {
  std::string header = "{'descr': '<i8', 'fortran_order': False, 'shape': (" + std::to_string(rows) + ", " + std::to_string(cols) + "), }";
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::string out("\x93NUMPY\x01\x00", 8);
  const auto len = static_cast<std::uint16_t>(header.size());
  out += static_cast<char>(len & 0xff);
  out += static_cast<char>(len >> 8);
  out += header;
  out.append(reinterpret_cast<const char*>(data.data()), data.size() * sizeof(std::int64_t));
  return out;
}

// Resuming at `first_step`: metrics.jsonl keeps the rows of the steps before it and the resumed
// run appends. When the file holds more (rows of steps past the checkpoint, from a run that went
// on after it; lines that are not a step's row, torn by a crash), it is kept whole as
// metrics.<N>.jsonl first, said, and rewritten with those rows alone: no row is ever lost.
void keep_rows_before(const std::filesystem::path& file, std::int64_t first_step) {
  if (!unreadable_file(file).empty()) return;  // none (or a FIFO, which would block)
  const std::string text = read_file_bytes(file);
  std::string kept, line;
  std::int64_t past = 0, torn = 0;
  std::istringstream in(text);
  while (std::getline(in, line)) {
    try {
      check_json_nesting(line);
      const auto row = nlohmann::json::parse(line);
      const std::int64_t step = row.at("step").get<std::int64_t>();
      if (step >= 1 && step < first_step) {
        kept += line + "\n";
        continue;
      }
      if (step >= 1) {  // past the checkpoint: the resumed run writes it again
        ++past;
        continue;
      }
    } catch (const std::exception&) {
    }
    if (!line.empty()) ++torn;
  }
  if (kept == text) return;  // nothing to leave out: appended to as it is
  if (past == 0 && torn == 0) {  // every row kept, the last one without its newline (cut just before it): added
    write_file_atomic(file, kept);
    return;
  }
  const std::filesystem::path aside = move_aside(file);
  write_file_atomic(file, kept);
  std::ostringstream what;
  if (past > 0) what << past << " row" << (past == 1 ? "" : "s") << " of steps past the checkpoint's (a run that went on after it: step " << first_step << " on is trained again)";
  if (torn > 0) {
    what << (past > 0 ? " and " : "") << torn << " line" << (torn == 1 ? "" : "s") << " that " << (torn == 1 ? "is" : "are")
         << " not a step's metrics (not JSON, or no step >= 1: torn by a crash, or edited)";
  }
  SPMDX_WARN(file.string() << ": resuming at step " << first_step << ", it keeps the rows of steps 1-" << first_step - 1 << " and leaves out " << what.str()
                           << "; the file as it was is kept whole as " << aside.string());
}

}  // namespace

namespace {

// Resuming: from the newest checkpoint (or checkpoint.load_step), refused here, before anything
// is made, when it was saved with another tokenizer.
// A resume under another learning-rate schedule than the one the checkpoint's steps followed:
// each changed value, the lr of the first step resumed under both, and the flags that keep the
// checkpoint's. "" when the schedules agree.
std::string schedule_change(const train::LrSchedule& saved, const train::LrSchedule& now, std::int64_t first_step, double lr) {
  std::vector<std::string> changed, keep;
  auto number = [](double x) {
    std::ostringstream o;
    o << x;
    return o.str();
  };
  auto compare = [&](const std::string& what, const std::string& key, const std::string& was, const std::string& is) {
    if (was == is) return;
    changed.push_back(what + " " + was + " -> " + is);
    keep.push_back("--" + key + " " + was);
  };
  compare("the span (lr_scheduler.total_steps, else training.steps)", "lr_scheduler.total_steps", std::to_string(saved.steps), std::to_string(now.steps));
  compare("lr_scheduler.warmup_steps", "lr_scheduler.warmup_steps", std::to_string(saved.warmup_steps), std::to_string(now.warmup_steps));
  compare("lr_scheduler.decay_ratio", "lr_scheduler.decay_ratio", number(saved.decay_ratio), number(now.decay_ratio));
  compare("lr_scheduler.decay_type", "lr_scheduler.decay_type", saved.decay_type, now.decay_type);
  compare("lr_scheduler.min_lr_factor", "lr_scheduler.min_lr_factor", number(saved.min_lr_factor), number(now.min_lr_factor));
  if (changed.empty()) return "";
  char lrs[160];
  if (first_step <= saved.steps) {
    std::snprintf(lrs, sizeof lrs, "step %lld's lr is %.3e, where the checkpoint's schedule gives %.3e", static_cast<long long>(first_step),
                  lr * train::lr_factor(first_step, now), lr * train::lr_factor(first_step, saved));
  } else {
    std::snprintf(lrs, sizeof lrs, "step %lld's lr is %.3e, past the end of the checkpoint's schedule (%lld steps)", static_cast<long long>(first_step),
                  lr * train::lr_factor(first_step, now), static_cast<long long>(saved.steps));
  }
  std::string out = "the checkpoint was saved under another learning-rate schedule: " + join(changed) +
                    ". The resumed steps follow this run's schedule, not the one the first steps followed (" + lrs + "). To keep the checkpoint's, set";
  for (const auto& k : keep) out += " " + k;
  return out;
}

std::optional<std::int64_t> find_resume(const config::Config& cfg, const train::JobSpec& spec, const std::string& tokenizer_id, bool lead) {
  const train::CheckpointSpec& ckpt = spec.checkpoint;
  const std::filesystem::path& ckpt_dir = ckpt.folder;
  std::optional<std::int64_t> resume_step;
  if (ckpt.enable || ckpt.load_step >= 0) resume_step = find_checkpoint(ckpt_dir, ckpt.load_step, lead);
  if (resume_step) {
    const CheckpointMeta saved = read_checkpoint_meta(ckpt_dir, *resume_step);
    if (const std::string change = saved.lr_schedule && *resume_step < spec.steps ? schedule_change(*saved.lr_schedule, spec.schedule, *resume_step + 1, spec.lr) : "";
        lead && !change.empty()) {
      SPMDX_WARN((ckpt_dir / train::checkpoint_name(*resume_step)).string() << ": " << change);
    }
    if (!saved.tokenizer.empty() && saved.tokenizer != tokenizer_id) {
      throw config::ConfigError(cfg.where({"model.tokenizer"}) + ": the checkpoint " + (ckpt_dir / ("step-" + std::to_string(*resume_step))).string() +
                                " was saved with another tokenizer (" + saved.tokenizer + "), this run has " + tokenizer_id +
                                " (model.tokenizer): its embeddings would mean other tokens; resume with the tokenizer it was trained with" +
                                (saved.tokenizer == "byte" ? std::string(" (\"byte\" alone is the byte tokenizer of 256 ids and no BOS/EOS, before documents "
                                                                         "kept their boundaries: that checkpoint cannot resume here; start afresh)")
                                                           : std::string()));
    }
  }
  return resume_step;
}

// A fault that can never happen is a mistake in the test that planted it.
void check_fault(const Fault& fault, const launch::RankEnv& env, const train::JobSpec& spec, const train::PlacedJob& job) {
  if (fault.kind.empty()) return;
  const auto state_names = train::train_state_names(job.model.params);
  if (fault.rank >= env.world_size || fault.step > spec.steps) {
    throw std::invalid_argument("SPMDX_FAULT: rank " + std::to_string(fault.rank) + ", step " + std::to_string(fault.step) +
                                " never happens in this job (" + std::to_string(env.world_size) + " ranks, " + std::to_string(spec.steps) + " steps)");
  }
  if (fault.kind == "perturb" && std::find(state_names.begin(), state_names.end(), fault.tensor) == state_names.end()) {
    throw std::invalid_argument("SPMDX_FAULT: no tensor '" + fault.tensor + "' in the train state; it has " + join(state_names));
  }
}

// The rendezvous: the store (this rank's server when it hosts one, torchrun's c10d store, or a
// client of rank 0's), and every rank's identity checked by rank 0. Nothing for one rank.
struct Joined {
  std::unique_ptr<comm::TcpStoreServer> server;
  std::unique_ptr<Store> store;
};

Joined join_job(const config::Config& cfg, const launch::RankEnv& env, double timeout) {
  Joined j;
  if (env.world_size <= 1) return j;
  if (!env.store_hosted && !env.c10d_store && env.rank == 0) j.server = std::make_unique<comm::TcpStoreServer>("0.0.0.0", env.master_port, env.token);
  if (env.rank == 0) {
    // One "[rank 0]" a line, as the log's: the launcher's on the ranks it started, its own otherwise.
    std::printf("%swaiting for %d ranks to join at %s:%d (comm.timeout_seconds = %g)\n", env.store_hosted ? "" : "[rank 0] ", env.world_size,
                env.master_addr.c_str(), env.master_port, timeout);
    std::fflush(stdout);
  }
  if (env.c10d_store) {  // under torchrun: its agent's c10d TCPStore
    j.store = comm::connect_c10d_store(env.master_addr, env.master_port, "spmdx/" + env.run_id + "/", timeout);
  } else {
    j.store = std::make_unique<comm::TcpStore>(env.master_addr, env.master_port, env.token, timeout, env.rank);
  }
  // Every rank says who it is and what it runs; rank 0 checks that they agree.
  launch::RankIdentity me;
  me.rank = env.rank;
  me.world_size = env.world_size;
  me.world_size_from = env.world_size_from;
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  me.host = host;
  // Hosts are told apart by name and network namespace (containers, or tests/two_hosts.sh's
  // namespaces, may share a name).
  char ns[64] = {};
  if (const ssize_t n = ::readlink("/proc/self/ns/net", ns, sizeof ns - 1); n > 0) me.host += std::string(" (") + std::string(ns, static_cast<std::size_t>(n)) + ")";
  me.local_rank = env.local_rank;
  me.local_world_size = env.local_world_size;
  me.version = std::string("spmdx ") + SPMDX_VERSION + ", plugin ABI " + std::to_string(SPMDX_ABI_MAJOR) + "." + std::to_string(SPMDX_ABI_MINOR);
  me.token = env.token;
  me.settings = cfg.settings();
  // Where each node keeps its own files may differ (node-local disks); what runs may not.
  for (const char* local : {"job.dump_folder", "plugins.paths"}) me.settings.erase(local);
  launch::rendezvous(*j.store, me, timeout, env.master_addr + ":" + std::to_string(env.master_port), j.server ? std::min(12.0, timeout) : 0.0);
  return j;
}

// This rank's shards of the initial parameters (the same full values on every rank, drawn on
// the CPU, so a GPU run starts where a CPU run does, or read from checkpoint.initial_load_path
// when `fresh`: nothing to resume) and zero AdamW state, on `device`; rank 0 writes them whole
// first when debug.dump_initial_weights asks. `loaded`: what was read, for the log.
TensorMap initial_state(const train::JobSpec& spec, train::PlacedJob& job, const sharding::DistributedPlan& plan, std::int64_t rank,
                        bool fresh, const c10::Device& device, std::string* loaded) {
  const auto coord = job.mesh.coordinate(rank);
  const bool dump_whole = fresh && rank == 0;
  TensorMap state;
  TensorMap full = init_tensors(job.model, spec.seed);
  if (const auto& path = spec.checkpoint.initial_load_path; fresh && !path.empty()) {
    const models::WeightLoad load = models::plan_weight_load(path, job.model);
    for (auto& [name, t] : load_initial_weights(load, at::kFloat)) full[name] = t.to(full.at(name).scalar_type());
    *loaded = "initial weights: " + std::to_string(load.params.size()) + " parameters from " + path.string() + " (" + std::to_string(load.files) +
              (load.files == 1 ? " file, " : " files, ") + (load.hf_names ? "Hugging Face" : "spmdx") + " names), resharded onto mesh " + job.mesh.str() +
              (load.ignored.empty() ? "" : "; not loaded, made from the config: " + join(load.ignored));
  }
  if (dump_whole && spec.output.dump_initial_weights) {
    const auto dir = spec.output.dump_folder / "debug";
    std::filesystem::create_directories(dir);
    write_safetensors(dir / "initial.safetensors", full, {{"format", "pt"}, {"step", "0"}, {"seed", std::to_string(spec.seed)}});
  }
  for (const auto& [name, t] : full) state[name] = shard_tensor(t, plan.placement.at(job.model.graph.find_input(name)), job.mesh, coord).to(device);
  for (const auto& p : job.model.params) {
    state["exp_avg." + p] = at::zeros_like(state.at(p));
    state["exp_avg_sq." + p] = at::zeros_like(state.at(p));
  }
  // An imported model's weights, whole, are no longer needed once this rank holds its shards.
  for (auto& init : job.model.init) init.data.reset();
  models::release_imports();
  return state;
}

// What metrics.enable_tensorboard writes: TensorBoard tag (torchtitan's names where it has
// them), the metrics.jsonl key, and the factor from the key's unit to the tag's.
struct TensorBoardScalar {
  const char* tag;
  const char* key;
  double scale;
};
constexpr TensorBoardScalar kTensorBoardScalars[] = {
    {"loss_metrics/global_avg_loss", "loss", 1.0},
    {"grad_norm", "grad_norm", 1.0},
    {"lr", "lr", 1.0},
    {"throughput(tps)", "tokens_per_s", 1.0},
    {"time_metrics/end_to_end(s)", "step_ms", 1e-3},
    {"time_metrics/comm(s)", "comm_ms", 1e-3},
    {"time_metrics/exposed_comm(s)", "exposed_comm_ms", 1e-3},
    {"memory/max_active(GiB)", "peak_mem_bytes", 1.0 / (1024.0 * 1024.0 * 1024.0)},
    {"memory/planned_peak(GiB)", "planned_peak_mem_bytes", 1.0 / (1024.0 * 1024.0 * 1024.0)},
    {"validation_metrics/loss", "val_loss", 1.0},
    {"validation_metrics/perplexity", "val_perplexity", 1.0},
};

// Rank 0's metrics: <dump>/metrics.jsonl (a resumed run keeps the rows before its first step
// and appends), the banner, a JSON row per step and a printed line every metrics.log_freq.
class MetricsWriter {
 public:
  MetricsWriter(const train::OutputSpec& output, std::int64_t first_step, bool checkpointing, std::int64_t planned_peak_bytes, std::int64_t microbatches)
      : dump_(output.dump_folder), log_freq_(output.log_freq), planned_peak_(planned_peak_bytes), microbatches_(microbatches) {
    if (!output.tensorboard_folder.empty()) tensorboard_.emplace(output.tensorboard_folder);
    std::filesystem::create_directories(dump_);
    if (first_step > 1) {
      // Resumed: keep the history of the steps up to the checkpoint, drop those past it (a run
      // that went on after it and failed), and append from here.
      keep_rows_before(file(), first_step);
      out_.open(file(), std::ios::app);
    } else {
      // Starting at step 1 beside an earlier run's metrics: they are kept whole, aside.
      std::error_code ec;
      if (std::filesystem::file_size(file(), ec) > 0 && !ec) {
        const std::filesystem::path aside = move_aside(file());
        SPMDX_WARN("starting from step 1 in " << dump_.string() << ", which holds the metrics of an earlier run: they are kept whole as " << aside.string()
                                               << ", and metrics.jsonl holds this run's"
                                               << (checkpointing ? "" : " (with checkpoint.enable true, a run saves checkpoints and resumes from the newest)"));
      }
      out_.open(file(), std::ios::trunc);
    }
    if (!out_) throw std::runtime_error("cannot write " + file().string());
  }

  std::filesystem::path file() const { return dump_ / "metrics.jsonl"; }
  /// `key` = `value` in the next row written (a fallback, the backend after it).
  void add_to_next_row(const std::string& key, nlohmann::json value) { next_row_[key] = std::move(value); }

  // scaling: float16's loss scale this step ran with, and whether its update was skipped.
  void row(std::int64_t step, std::int64_t last_step, double loss, double grad_norm, double lr, double tokens_per_s, const RunStats& st,
           const std::optional<std::pair<double, bool>>& scaling) {
    const double now = metrics::unix_time_s();  // when the step's row is written: its wall clock, and TensorBoard's wall_time
    nlohmann::json row{{"step", step},
                       {"time", now},
                       {"loss", loss},
                       {"grad_norm", grad_norm},
                       {"lr", lr},
                       {"tokens_per_s", tokens_per_s},
                       {"step_ms", st.total * 1e3},
                       {"compute_ms", (st.total - st.exposed_comm) * 1e3},
                       {"comm_ms", st.comm * 1e3},
                       {"exposed_comm_ms", st.exposed_comm * 1e3},
                       {"overlap_ratio", st.overlap_ratio()},
                       {"collectives", st.collectives},
                       {"comm_bytes", st.comm_bytes},
                       {"peak_mem_bytes", st.peak_bytes},
                       {"planned_peak_mem_bytes", planned_peak_},
                       {"rss_bytes", rss_bytes()}};
    if (scaling) row["loss_scale"] = scaling->first, row["skipped"] = scaling->second;
    row.update(next_row_);
    next_row_ = nlohmann::json::object();
    out_ << row.dump() << "\n" << std::flush;
    if (!out_) throw std::runtime_error("cannot write " + file().string() + ": " + std::strerror(errno));
    if (tensorboard_) {
      for (const auto& [tag, key, scale] : kTensorBoardScalars) {
        if (row.contains(key)) tensorboard_->add_scalar(tag, row.at(key).get<double>() * scale, step, now);
      }
      tensorboard_->flush();
    }
    if (step % log_freq_ == 0 || step == last_step) {
      char validation[48] = "";
      if (row.contains("val_loss")) std::snprintf(validation, sizeof validation, " | val_loss %.4f", row.at("val_loss").get<double>());
      char scale[96] = "";
      if (scaling) std::snprintf(scale, sizeof scale, " | loss scale %.9g%s", scaling->first, scaling->second ? " (overflow: update skipped)" : "");
      if (std::isnan(grad_norm)) grad_norm = std::fabs(grad_norm);  // "nan", not "-nan": a float16 overflow's
      char accum[32] = "";
      if (microbatches_ > 1) std::snprintf(accum, sizeof accum, " | accum %lld", static_cast<long long>(microbatches_));
      std::printf("step %4lld | loss %8.4f | grad_norm %7.3f | lr %.2e | %9.0f tok/s | %7.1f ms | exposed comm %4.1f%% | peak %s%s%s%s\n",
                  static_cast<long long>(step), loss, grad_norm, lr, tokens_per_s, st.total * 1e3, 100.0 * st.exposed_comm / st.total,
                  human_bytes(static_cast<double>(st.peak_bytes)).c_str(), accum, validation, scale);
      std::fflush(stdout);
    }
  }

 private:
  std::filesystem::path dump_;
  std::int64_t log_freq_;
  std::int64_t planned_peak_;  ///< plan_memory's peak of this rank's step (bytes)
  std::int64_t microbatches_;  ///< gradient accumulation's, shown on the step line when > 1
  std::optional<metrics::EventWriter> tensorboard_;  ///< metrics.enable_tensorboard's event file
  std::ofstream out_;
  nlohmann::json next_row_ = nlohmann::json::object();
};

// [validation]: the forward-only graph on the job's mesh with its own executor (which donates
// nothing: it reads the train state), and the held-out data, read from its start at each
// validation so that every validation sees the same batches (as torchtitan's validator makes a
// fresh iterator over its data loader each time).
struct Validation {
  Validation(const train::JobSpec& spec, const train::PlacedJob& job, std::int64_t rank, CommBackend* backend, double timeout, Device& device,
             const data::Tokenizer& tokenizer)
      : placed(train::place_validation(spec, job)),
        plan(sharding::propagate(placed.model.graph, job.mesh, placed.inputs, {}, job.use, false, -1, job.context_parallel_dim, job.context_parallel_allgather)),
        graph(stage_of(sharding::rank_graph(plan, rank % job.mesh.size()), job, rank)),
        executor(graph, train::run_mesh(job), rank, backend, timeout, options(spec.plan), &device),
        dataset(train::validation_data(spec), tokenizer),
        steps(spec.validation.steps > 0 ? spec.validation.steps
                                        : std::max<std::int64_t>(1, static_cast<std::int64_t>(dataset.stream().size()) /
                                                                        (spec.validation.global_batch_size * spec.seq_len))),
        mesh(job.mesh),
        coord(job.mesh.coordinate(rank % job.mesh.size())),
        on(device.device()) {}

  // With pipeline stages, `rank`'s stage of the forward (one microbatch: the stages in turn).
  static ir::Graph stage_of(ir::Graph g, const train::PlacedJob& job, std::int64_t rank) {
    if (job.pipeline.stages == 1) return g;
    train::PipelineSpec forward_only = job.pipeline;
    forward_only.microbatches = 1;
    return std::move(train::stage_graph(g, forward_only, job.model.params, rank, job.mesh.size()).graph);
  }

  static plan::PlanOptions options(plan::PlanOptions o) {
    o.donate_state = false;  // the inputs are the train state: never a buffer of this graph's
    return o;
  }

  // The mean loss of `steps` held-out batches under the state's weights. Throws what the
  // executor throws (CommError when a collective fails).
  double run(const TensorMap& state) {
    c10::InferenceMode no_autograd;
    dataset.restore({});
    const sharding::Placements& tokens_pl = plan.placement.at(placed.model.graph.find_input("tokens"));
    const sharding::Placements& labels_pl = plan.placement.at(placed.model.graph.find_input("labels"));
    const std::int64_t rows = dataset.options().batch_size, seq = dataset.options().seq_len;
    double sum = 0;
    for (std::int64_t i = 0; i < steps; ++i) {
      const data::Batch batch = dataset.next_batch();
      TensorMap feed;
      for (const ir::Value* in : graph.inputs()) {
        if (const auto it = state.find(in->name()); it != state.end()) feed.emplace(in->name(), it->second);
      }
      feed["tokens"] = shard_tensor(at::tensor(batch.tokens, at::kLong).reshape({rows, seq}), tokens_pl, mesh, coord).to(on);
      feed["labels"] = shard_tensor(at::tensor(batch.labels, at::kLong).reshape({rows, seq}), labels_pl, mesh, coord).to(on);
      sum += executor.run(feed).at("loss").item<double>();
    }
    return sum / static_cast<double>(steps);
  }

  train::PlacedValidation placed;
  sharding::DistributedPlan plan;
  ir::Graph graph;
  DistributedExecutor executor;
  data::TextDataset dataset;
  std::int64_t steps;
  const sharding::DeviceMesh& mesh;
  std::vector<std::int64_t> coord;
  c10::Device on;
};

// A step whose collectives failed on some rank (the ranks' vote said so, or this rank's own
// call threw): it runs again, after CommChain::replace, from the state before it.
struct StepFailed : std::runtime_error {
  StepFailed(const std::string& why, bool voted_on) : std::runtime_error(why), voted(voted_on) {}
  bool voted;  ///< the ranks voted already: what() is the verdict every rank has
};

// OnGlobalSyncComplete: the train state after the step (views of this rank's shards), the loss
// and the step's spans, for the hooks.
void tell_hooks(hooks::HookSet& hooks, std::int64_t step, const train::JobSpec& spec, const launch::RankEnv& env, double loss, const RunStats& st,
                const std::vector<std::string>& names, const TensorMap& state, const TensorMap& out,
                const std::map<std::string, sharding::Placements>& state_placements, const sharding::DeviceMesh& mesh, const DistributedExecutor& executor) {
  StepInfo info;
  info.step = step;
  info.last = step == spec.steps;
  info.rank = env.rank;
  info.world_size = env.world_size;
  info.loss = loss;
  info.step_seconds = st.total;
  info.comm_seconds = st.comm;
  info.exposed_comm_seconds = st.exposed_comm;
  info.hidden_comm_seconds = st.hidden_comm;
  std::vector<at::Tensor> alive;
  auto view = [&](const std::string& name, const at::Tensor& t, const sharding::Placements& pl) {
    alive.push_back(t.to(at::kCPU).contiguous());  // hooks read host memory
    info.tensors.push_back({name, t.sizes().vec(), comm_dtype(t.scalar_type()), alive.back().data_ptr(), alive.back().nbytes(), pl});
  };
  for (const auto& name : names) view(name, state.at(name), state_placements.at(name));
  view("loss", out.at("loss"), sharding::Placements(static_cast<std::size_t>(mesh.ndim()), Placement::replicate()));
  info.spans = executor.spans();
  hooks.step_end(info);
}

// One rank's step loop: the batch, the step through the executor, the fault a test planted,
// the hooks, a hot-swap of the comm backend, the metrics and checkpoints.
struct StepLoop {
  const launch::RankEnv& env;
  const train::JobSpec& spec;
  const train::PlacedJob& job;
  const sharding::DistributedPlan& plan;
  DistributedExecutor& executor;
  Device& device;
  TensorMap& state;
  const std::map<std::string, ir::TensorMeta>& state_metas;
  const std::map<std::string, sharding::Placements>& state_placements;  // every stage's
  data::TextDataset& dataset;
  hooks::HookSet& hooks;
  PluginRegistry& registry;
  std::unique_ptr<CommBackend>& backend;
  CommChain* chain;  // null for one rank
  Store* store;
  MetricsWriter* metrics;  // rank 0's
  const Fault& fault;
  double timeout;
  std::filesystem::path ckpt_dir;
  std::string tokenizer_id;
  bool lead = env.rank == 0;
  bool checkpointing = spec.checkpoint.enable;
  std::int64_t log_freq = spec.output.log_freq;
  bool dump_batches = spec.output.dump_batches;
  std::filesystem::path batches_dir = spec.output.dump_folder / "debug" / "batches";
  std::vector<std::int64_t> coord = job.mesh.coordinate(env.rank % job.mesh.size());
  const sharding::Placements& tokens_pl = plan.placement.at(job.model.graph.find_input("tokens"));
  const sharding::Placements& labels_pl = plan.placement.at(job.model.graph.find_input("labels"));
  // The state this rank updates (with pipeline stages, its stage's).
  std::vector<std::string> names = [this] {
    std::vector<std::string> out;
    for (auto& n : train::train_state_names(job.model.params)) {
      if (state.count(n) > 0) out.push_back(std::move(n));
    }
    return out;
  }();
  // training.cuda_graphs: the step captured once (at the second step run: the first warms up
  // cuBLAS and the caching allocator eagerly, as torch.cuda.graph asks), its fixed input
  // buffers (the state tensors themselves, the batch, lr and step) and outputs.
  std::unique_ptr<CapturedStep> graph{};
  TensorMap graph_feed{}, graph_out{};
  RunStats graph_stats{};
  bool warmed_up = false;
  // float16: the loss scale (torch.amp.GradScaler's), and the AdamW updates applied so far
  // (a step whose gradients overflow is skipped: its "step" is given to the next one).
  bool loss_scaling = spec.step.loss_scaling;
  train::GradScaler scaler{spec.mixed_precision.init_scale, spec.mixed_precision.growth_interval};
  std::int64_t optimizer_steps = 0;
  bool over_budget_said = false;  // the warning of a measured peak over parallelism.memory_budget, once
  // Run-time failover (comm.fallback): each step starts from a copy of the state, the data
  // position, the optimizer's count and the loss scale, and ends with a vote of every rank that
  // its collectives completed; a step that failed anywhere runs again from the copy.
  bool failover = chain != nullptr && spec.comm.failover();
  TensorMap before{};
  data::TextDatasetState data_before{};
  std::int64_t optimizer_steps_before = 0;
  train::GradScaler scaler_before{};
  std::int64_t recoveries = 0;  // every rank's count of steps run again: part of each vote's key
  std::size_t events_told = 0;  // of chain->events(), said in a metrics row
  std::vector<FallbackEvent> strategy_events{};  // the layouts passed over at start, for the first row
  std::int64_t planned_peak = 0;  // bytes: the memory plan's peak of the step, with the failover's state copy
  Validation* validation = nullptr;  // [validation]
  StepProfiler* profiler = nullptr;  // [profiling]
  const PipelineStages* pipeline_stages = nullptr;  // which stage holds each state tensor

  // Where a resumed job's checkpoint left the optimizer's count and, for float16, the loss
  // scale (a count past this run's growth interval grows it at the next clean step).
  void resume(const CheckpointMeta& meta) {
    optimizer_steps = meta.optimizer_steps >= 0 ? meta.optimizer_steps : meta.step;
    if (meta.loss_scale > 0 && loss_scaling) {
      scaler.scale = meta.loss_scale;
      scaler.growth_tracker = std::min(meta.growth_tracker, scaler.growth_interval - 1);
    }
  }

  // This rank's part of each microbatch of `global` ([global batch, seq] ids) as the graph's
  // inputs `name`, `name`.1, ...: a data-parallel rank's rows [d B/dp, (d+1) B/dp) split in
  // order, microbatch k taking rows [k b, (k+1) b) of them (b = B / (dp x microbatches)), so
  // that the microbatches together are the rows the rank reads without accumulation.
  void feed_microbatches(TensorMap& feed, const char* name, const at::Tensor& global, const sharding::Placements& pl, const c10::Device& on) const {
    const std::int64_t m = spec.step.microbatches;
    if (m == 1) {
      feed[name] = shard_tensor(global, pl, job.mesh, coord).to(on);
      return;
    }
    const std::int64_t dp = spec.dims.dp_replicate * spec.dims.dp_shard;
    const at::Tensor split = global.reshape({dp, m, spec.global_batch_size / (dp * m), spec.seq_len});
    for (std::int64_t k = 0; k < m; ++k) {
      const at::Tensor rows = split.select(1, k).reshape({spec.global_batch_size / m, spec.seq_len});
      feed[train::microbatch_input(name, k)] = shard_tensor(rows, pl, job.mesh, coord).to(on);
    }
  }

  // The step through the executor, or through the captured CUDA graph.
  TensorMap run_step(TensorMap& feed, std::int64_t step) {
    if (!spec.device.cuda_graphs || !warmed_up) {
      warmed_up = true;
      TensorMap out = executor.run(feed, step);
      for (const auto& s : names) state[s] = out.at("next." + s);
      return out;
    }
    if (!graph) {
      graph_feed = feed;  // the state's tensors, updated in place by each replay
      executor.set_capturing(true);
      graph = device.capture([&] {
        graph_out = executor.run(graph_feed, step);
        for (const auto& s : names) graph_feed.at(s).copy_(graph_out.at("next." + s));
      });
      executor.set_capturing(false);
    } else {
      for (const auto& [input, value] : feed) {  // the batch (every microbatch's), lr, step, loss_scale: not the state, updated in place
        if (state.count(input) == 0) graph_feed.at(input).copy_(value);
      }
    }
    const auto t0 = Clock::now();
    device.reset_peak_memory();
    graph->replay();
    device.synchronize();
    graph_stats = {};
    graph_stats.total = std::chrono::duration<double>(Clock::now() - t0).count();
    graph_stats.peak_bytes = device.peak_memory_bytes();
    return graph_out;
  }

  // Runs step `step` (1-based) and returns its loss. Throws std::runtime_error for a loss that
  // is not finite and what the executor, the backend or the checkpoint writer throw.
  double step(std::int64_t step) {
    c10::InferenceMode no_autograd;  // the state tensors are inference tensors: updated in place below (a fault, a CUDA graph's copies)
    if (failover) {
      for (const auto& s : names) before[s] = state.at(s).clone();  // the step updates the state in place
      data_before = dataset.state(), optimizer_steps_before = optimizer_steps, scaler_before = scaler;
    }
    const data::Batch batch = dataset.next_batch();
    if (lead && dump_batches) {
      std::filesystem::create_directories(batches_dir);
      for (const auto& [what, ids] : {std::pair<const char*, const std::vector<std::int64_t>*>{"tokens", &batch.tokens}, {"labels", &batch.labels}}) {
        write_file_atomic(batches_dir / ("step-" + std::to_string(step) + "." + what + ".npy"), npy_i64(*ids, spec.global_batch_size, spec.seq_len));
      }
    }
    auto as_tensor = [&](const std::vector<std::int64_t>& ids) {
      return at::tensor(ids, at::kLong).reshape({spec.global_batch_size, spec.seq_len});
    };
    const c10::Device on = device.device();
    TensorMap feed = state;
    feed_microbatches(feed, "tokens", as_tensor(batch.tokens), tokens_pl, on);
    feed_microbatches(feed, "labels", as_tensor(batch.labels), labels_pl, on);
    const double lr = spec.lr * train::lr_factor(step, spec.schedule);
    feed["lr"] = at::scalar_tensor(lr, at::TensorOptions().dtype(at::kFloat).device(on));
    feed["step"] = at::scalar_tensor(static_cast<double>(optimizer_steps + 1), at::TensorOptions().dtype(at::kFloat).device(on));
    const double loss_scale = scaler.scale;
    if (loss_scaling) feed["loss_scale"] = at::scalar_tensor(loss_scale, at::TensorOptions().dtype(at::kFloat).device(on));
    TensorMap out;
    const bool profiling = profiler != nullptr && profiler->chosen(step);
    if (profiling) {
      executor.set_record_spans(true);
      profiler->start();
    }
    try {
      out = run_step(feed, step);
    } catch (const CommError& e) {
      if (profiling) profiler->cancel(), executor.set_record_spans(false);
      if (failover) throw StepFailed(e.what(), false);
      throw;
    }
    if (profiling) {
      const std::filesystem::path trace = profiler->stop(step, executor.spans());
      executor.set_record_spans(hooks.empty() ? false : true);
      if (lead) std::printf("profiler: step %lld traced in %s (and the other ranks' beside it)\n", static_cast<long long>(step), trace.string().c_str());
    }
    if (failover) {
      if (const std::string no = vote(*store, vote_key(step), env.rank, env.world_size, "", timeout + 30); !no.empty()) throw StepFailed(no, true);
    }
    // Every rank reads the same found_inf (from the all-reduced norm), so all skip together.
    const bool skipped = loss_scaling && out.at("found_inf").item<float>() != 0;
    if (!skipped) ++optimizer_steps;
    if (loss_scaling) scaler.update(skipped);
    if (fault.kind == "perturb" && fault.rank == env.rank && fault.step == step) {
      const auto held = state.find(fault.tensor);  // its name was checked before the first step
      if (held == state.end()) {
        throw std::invalid_argument("SPMDX_FAULT: rank " + std::to_string(env.rank) + " does not hold '" + fault.tensor +
                                    "': it is another pipeline stage's; perturb a rank of that stage");
      }
      held->second.add_(fault.delta);  // in place: a CUDA graph reads it
    }
    const double loss = out.at("loss").item<double>();
    if (validation != nullptr && step % spec.validation.freq == 0) {
      const double val_loss = validation->run(state);
      if (metrics) metrics->add_to_next_row("val_loss", val_loss), metrics->add_to_next_row("val_perplexity", std::exp(val_loss));
    }
    if (!std::isfinite(loss)) {
      throw std::runtime_error("step " + std::to_string(step) + ": the loss is " + std::to_string(loss) +
                               (spec.mixed_precision.param == "float16"
                                    ? " (a float16 forward can overflow, which loss scaling does not guard: if bfloat16 trains, use it; else lower optimizer.lr)"
                                    : ""));
    }
    const RunStats st = graph ? graph_stats : executor.stats();
    if (lead && spec.memory_budget > 0 && st.peak_bytes > spec.memory_budget && !over_budget_said) {
      over_budget_said = true;  // the budget bounds the planned peak; the allocator's may differ by a little (docs/memory.md, "A budget")
      std::printf("warning: step %lld held %lld bytes (%s) at its peak, %lld more than parallelism.memory_budget = %lld bytes; the budget bounds the "
                  "planned peak (%lld bytes), which the allocator's count can pass by a little: lower the budget by the difference to keep under it\n",
                  static_cast<long long>(step), static_cast<long long>(st.peak_bytes), human_bytes(static_cast<double>(st.peak_bytes)).c_str(),
                  static_cast<long long>(st.peak_bytes - spec.memory_budget), static_cast<long long>(spec.memory_budget),
                  static_cast<long long>(planned_peak));
    }
    if (!hooks.empty()) tell_hooks(hooks, step, spec, env, loss, st, names, state, out, state_placements, job.mesh, executor);
    // Hot-swap at a step boundary: nothing is in flight between runs; the old backend leaves
    // the job, the other one joins it under the next generation's keys.
    const std::int64_t swap_every = spec.comm.swap_at_step;
    if (backend && swap_every > 0 && step % swap_every == 0 && step < spec.steps) {
      backend->barrier(0)->wait(timeout);
      backend->finalize();
      const std::int64_t generation = step / swap_every;
      const std::string& next = generation % 2 == 1 ? spec.comm.swap_to : spec.comm.backend;
      backend.reset();
      backend = join_backend(registry, next, spec.comm, env, *store, generation);
      executor.set_backend(backend.get());
      if (validation != nullptr) validation->executor.set_backend(backend.get());
      if (lead && (step / swap_every) % std::max<std::int64_t>(1, log_freq) == 0) {
        std::printf("after step %lld: swapped the comm backend to %s%s\n", static_cast<long long>(step), next == "auto" ? "auto -> " : "",
                    backend->describe().c_str());
      }
    }
    if (metrics) {  // what fell back since the last row, and the backend now
      nlohmann::json told = nlohmann::json::array();
      auto tell = [&](const FallbackEvent& e) { told.push_back({{"what", e.what}, {"from", e.from}, {"to", e.to}, {"reason", e.reason}, {"step", e.step}}); };
      std::for_each(strategy_events.begin(), strategy_events.end(), tell);
      strategy_events.clear();
      if (chain != nullptr && spec.comm.chain.size() > 1) {
        metrics->add_to_next_row("comm_backend", chain->current());
        for (; events_told < chain->events().size(); ++events_told) tell(chain->events()[events_told]);
      }
      if (!told.empty()) metrics->add_to_next_row("fallback", std::move(told));
    }
    if (metrics) {
      metrics->row(step, spec.steps, loss, out.at("grad_norm").item<double>(), lr, static_cast<double>(spec.global_batch_size * spec.seq_len) / st.total, st,
                   loss_scaling ? std::optional<std::pair<double, bool>>{{loss_scale, skipped}} : std::nullopt);
    }
    if (checkpointing && (step % spec.checkpoint.interval == 0 || step == spec.steps)) {
      CheckpointMeta meta{step, dataset.state().samples, tokenizer_id, optimizer_steps};
      if (loss_scaling) meta.loss_scale = scaler.scale, meta.growth_tracker = scaler.growth_tracker;
      meta.lr_schedule = spec.schedule;
      std::filesystem::path where;
      try {
        where = save_checkpoint(ckpt_dir, meta, job.mesh, env.rank, state, state_metas, state_placements, backend.get(), *pipeline_stages);
      } catch (const CommError& e) {  // the save's barrier: a run-time fallback covers the step's collectives, not this
        throw CommError("saving the checkpoint of step " + std::to_string(step) + ": " + e.what() +
                            (failover ? " (comm.fallback covers the steps' collectives, not a checkpoint save's)" : ""),
                        e.peer());
      }
      if (lead) std::printf("saved checkpoint %s\n", where.string().c_str());
      // checkpoint.keep_latest_k: the oldest go only now, with this one complete (every rank's
      // shard written, renamed into place); rank 0 deletes, as torchtitan's.
      if (lead && spec.checkpoint.keep_latest_k > 0) {
        for (const auto& gone : purge_checkpoints(ckpt_dir, spec.checkpoint.keep_latest_k, step)) {
          std::printf("deleted checkpoint %s (checkpoint.keep_latest_k = %lld)\n", gone.string().c_str(), static_cast<long long>(spec.checkpoint.keep_latest_k));
        }
        std::fflush(stdout);
      }
    }
    return loss;
  }

  std::string vote_key(std::int64_t step) const { return "spmdx/step/s" + std::to_string(step) + "/r" + std::to_string(recoveries); }

  // Step `step` failed (StepFailed): every rank learns why through the step's vote, the backend
  // is replaced (CommChain::replace: rejoined, or the next of the chain) and the state, the
  // data position, the optimizer's count and the loss scale are put back as they were before it.
  void recover(std::int64_t step, const StepFailed& f) {
    const std::string why = f.voted ? f.what() : vote(*store, vote_key(step), env.rank, env.world_size, f.what(), timeout + 30);
    ++recoveries;
    executor.set_backend(nullptr);
    if (validation != nullptr) validation->executor.set_backend(nullptr);
    backend = chain->replace(std::move(backend), step, why);
    executor.set_backend(backend.get());
    if (validation != nullptr) validation->executor.set_backend(backend.get());
    for (auto& [name, t] : before) state[name] = std::move(t);
    before.clear();
    dataset.restore(data_before);
    optimizer_steps = optimizer_steps_before;
    scaler = scaler_before;
    if (lead) {
      for (std::size_t i = events_told; i < chain->events().size(); ++i) std::printf("fallback: %s\n", chain->events()[i].str().c_str());
      std::fflush(stdout);
    }
  }

  // Runs steps first_step .. spec.steps; returns the first one's loss and the last one's.
  std::pair<double, double> run(std::int64_t first_step, bool serves_store) {
    double first_loss = 0, last_loss = 0;
    // A failing rank tells the hooks first (the flight recorder dumps), then fails.
    try {
      for (std::int64_t step = first_step; step <= spec.steps;) {
        double loss = 0;
        try {
          loss = this->step(step);
        } catch (const StepFailed& f) {
          recover(step, f);
          continue;  // the same step, from the state before it
        }
        if (step == first_step) first_loss = loss;
        last_loss = loss;
        ++step;
      }
      hooks.finish();
    } catch (const std::exception& e) {
      hooks.failure(e.what());
      // Collectives still queued or waiting on peers fail now, instead of each waiting out
      // comm.timeout_seconds while the backend is destroyed.
      if (backend) backend->abort();
      if (serves_store && dynamic_cast<const CommError*>(&e) != nullptr) {
        // This rank serves the store (started without spmdx run, as under mpirun or srun): the
        // others learn from it which rank failed, at their next health check (every 5 s of a
        // stuck wait). Leaving at once would take the store down with this rank, and they
        // would time out blaming it.
        const double linger = std::min(12.0, timeout);
        std::fprintf(stderr, "rank %d serves the store: keeping it up %.0f s so that the other ranks can name the rank that failed\n",
                     env.rank, linger);
        std::this_thread::sleep_for(std::chrono::duration<double>(linger));
      }
      throw;
    }
    return {first_loss, last_loss};
  }
};

// Each state tensor's global meta and its placement, by name: what checkpoints hold.
std::pair<std::map<std::string, ir::TensorMeta>, std::map<std::string, sharding::Placements>> state_layout(const TensorMap& state, const train::PlacedJob& job,
                                                                                                          const sharding::DistributedPlan& plan) {
  std::map<std::string, ir::TensorMeta> state_metas;
  std::map<std::string, sharding::Placements> state_placements;
  for (const auto& [name, t] : state) {
    const ir::Value* v = job.model.graph.find_input(name);
    state_metas[name] = v->meta();
    state_placements[name] = plan.placement.at(v);
  }
  return {std::move(state_metas), std::move(state_placements)};
}

// The layouts choose_strategies passed over, as events, each followed by the next tried.
std::vector<FallbackEvent> strategy_events(const train::JobSpec& spec) {
  std::vector<FallbackEvent> out;
  const auto& passed = spec.strategies_passed_over;
  for (std::size_t i = 0; i < passed.size(); ++i) {
    out.push_back({"strategies", passed[i].first, i + 1 < passed.size() ? passed[i + 1].first : train::layout_text(spec.strategies), passed[i].second, 0});
  }
  return out;
}

void say_nothing_to_do(const std::filesystem::path& ckpt_dir, std::int64_t resume_step, std::int64_t steps) {
  std::printf("nothing to do: the job is finished (checkpoint %s is at step %lld, training.steps is %lld); nothing was changed "
              "(raise training.steps to train further)\n",
              (ckpt_dir / ("step-" + std::to_string(resume_step))).string().c_str(), static_cast<long long>(resume_step),
              static_cast<long long>(steps));
}

// Debug hooks: made on every rank, each told where it runs.
hooks::HookSet make_job_hooks(const config::Config& cfg, const launch::RankEnv& env, const train::PlacedJob& job, PluginRegistry& registry,
                              Store* store, double timeout, std::int64_t first_step) {
  HookContext hook_base;
  hook_base.rank = env.rank;
  hook_base.world_size = env.world_size;
  hook_base.mesh = job.mesh.dims();
  hook_base.coordinate = job.mesh.coordinate(env.rank % job.mesh.size());
  hook_base.store = store;
  hook_base.timeout_seconds = timeout;
  hook_base.first_step = first_step;
  return hooks::make_hooks(train::hook_spec(cfg), registry, hook_base);
}

// Loads checkpoint `step` over `state` (the trained tensors; buffers stay as made) and puts the
// dataset where it was.
CheckpointMeta resume_from(const std::filesystem::path& ckpt_dir, std::int64_t step, const train::PlacedJob& job, const launch::RankEnv& env,
                 const std::map<std::string, ir::TensorMeta>& state_metas, const std::map<std::string, sharding::Placements>& state_placements,
                 TensorMap& state, data::TextDataset& dataset, const c10::Device& device, const PipelineStages& pipeline) {
  CheckpointMeta meta;
  // Buffers (the RoPE tables) are made from the config, not loaded: a resume may change
  // training.seq_len, as torchtitan's may.
  std::map<std::string, ir::TensorMeta> trained = state_metas;
  std::set<std::string> buffers;
  for (const auto& spec_i : job.model.init) {
    if (!spec_i.trainable) trained.erase(spec_i.name), buffers.insert(spec_i.name);
  }
  for (auto it = trained.begin(); it != trained.end();) it = state.count(it->first) == 0 ? trained.erase(it) : std::next(it);  // another stage's
  for (auto& [name, t] : load_checkpoint(ckpt_dir, step, job.mesh, env.rank, trained, state_placements, &meta, buffers, pipeline)) state[name] = t.to(device);
  dataset.restore({meta.data_samples});
  if (env.rank == 0) {
    std::printf("resumed from %s (step %lld)\n", (ckpt_dir / ("step-" + std::to_string(step))).string().c_str(),
                static_cast<long long>(meta.step));
  }
  return meta;
}

// What makes a planned peak large, for check_host_memory's message: the largest buffers held at
// it, and the vocabulary when its rows are most of the model (a tokenizer id far past the
// others makes millions of rows: 16777216 ids make Llama debugmodel's 5M parameters 8.6G).
std::string what_makes_it_large(const plan::MemoryPlan& planned, const train::JobSpec& spec, const models::Model& model, std::int64_t tokenizer_vocab) {
  std::vector<std::string> held;
  for (std::size_t i = 0; i < planned.largest.size() && i < 3; ++i) {
    const auto& h = planned.largest[i];
    held.push_back(h.what + (h.type.empty() ? "" : " " + h.type) + " (" + human_bytes(static_cast<double>(h.bytes)) + ")");
  }
  std::string out = held.empty() ? "" : "; the largest buffers at the peak: " + join(held);
  const std::int64_t vocab = spec.model.vocab_size;
  double rows = 0, all = 0;
  for (const auto& p : model.params) {
    const ir::TensorMeta& m = model.graph.find_input(p)->meta();
    all += static_cast<double>(m.nbytes());
    if (std::find(m.shape.begin(), m.shape.end(), vocab) != m.shape.end()) rows += static_cast<double>(m.nbytes());
  }
  if (vocab > 0 && all > 0 && rows > all / 2) {
    char share[16];
    std::snprintf(share, sizeof share, "%.0f%%", 100 * rows / all);
    out += "; the vocabulary of " + std::to_string(vocab) + " ids makes the embedding and output rows " + share + " of the model's parameters" +
           (vocab == tokenizer_vocab && spec.data.tokenizer != "byte"
                ? " (model.tokenizer '" + spec.data.tokenizer + "': its largest id + 1; a tokenizer whose ids have a gap gets a row for each missing id: "
                  "renumber them if that is a mistake)"
                : " (model.vocab_size: lower it if that is a mistake)");
  }
  return out;
}

// A planned peak over this host's memory (this rank's peak times the ranks on the host):
// refused when over its RAM and swap, as the kernel's out-of-memory killer would stop a rank
// with SIGKILL (a batch of 100,000 rows here; a vocabulary of 16.7M ids made by a tokenizer id
// near 2^24); warned when over its RAM alone. Called on every rank before its state is
// allocated, since every rank allocates; the host's first rank says why and the others say
// only that they stopped. Throws std::runtime_error.
void check_host_memory(const plan::MemoryPlan& planned, const launch::RankEnv& env, const Device& device, const train::JobSpec& spec,
                       const models::Model& model, std::int64_t tokenizer_vocab) {
  struct sysinfo si {};
  if (!device.device().is_cpu() || ::sysinfo(&si) != 0) return;
  const double ram = static_cast<double>(si.totalram) * si.mem_unit, swap = static_cast<double>(si.totalswap) * si.mem_unit;
  const int ranks = std::max(1, env.local_world_size);
  const double needed = static_cast<double>(planned.peak_bytes) * ranks;
  if (needed <= ram) return;
  const bool says = env.local_rank == 0;
  const std::string over = "the planned peak memory, " + human_bytes(static_cast<double>(planned.peak_bytes)) + " a rank x " + std::to_string(ranks) +
                           (ranks == 1 ? " rank" : " ranks") + " on this host, is over its " + human_bytes(ram) + " of memory";
  const std::string todo = "lower training.local_batch_size or training.seq_len, add hosts, or set parallelism.memory_budget for spmdx to fit the job";
  if (needed > ram + swap) {
    if (!says) throw std::runtime_error("stopped before allocating anything: this host's memory cannot hold the planned peak (local rank 0 says why)");
    throw std::runtime_error(over + (swap > 0 ? " and " + human_bytes(swap) + " of swap" : "") + ": the kernel would kill a rank when memory runs out (planned peak " +
                             planned.str() + what_makes_it_large(planned, spec, model, tokenizer_vocab) + "); " + todo);
  }
  if (says) SPMDX_WARN(over << ": the steps will swap, if no rank is killed" << what_makes_it_large(planned, spec, model, tokenizer_vocab) << "; " << todo);
}

// `resumed`: the checkpoint a resumed job starts from (its loss scale replaces the config's).
void print_banner(const train::JobSpec& spec, const train::PlacedJob& job, const sharding::DistributedPlan& plan, const launch::RankEnv& env, const CommBackend* backend,
                  const Device& device, const plan::MemoryPlan& planned, const CheckpointMeta* resumed) {
  using train::CheckpointReport;
  double params = 0;
  for (const auto& p : job.model.params) params += static_cast<double>(job.model.graph.find_input(p)->meta().numel());
  const std::string linears = device.compute_stream() == nullptr ? std::string(", float32 linears on ") + library_name(cpu_matmul()) : "";
  std::printf("spmdx: %s (%.2fM parameters), mesh %s (%d rank%s, %s), global batch %lld x %lld, %lld steps, comm %s, %d intra-op thread%s per rank%s\n",
              models::model_label(spec.model).c_str(), params / 1e6,
              train::run_mesh(job).str().c_str(), env.world_size, env.world_size == 1 ? "" : "s", env.source.c_str(), static_cast<long long>(spec.global_batch_size),
              static_cast<long long>(spec.seq_len), static_cast<long long>(spec.steps),
              backend ? ((spec.comm.backend == "auto" ? "auto -> " : "") + backend->describe()).c_str() : "none (one rank)",
              at::get_num_threads(), at::get_num_threads() == 1 ? "" : "s",
              linears.c_str());
  for (const auto& s : train::short_parameters(spec, job)) std::printf("warning: %s\n", s.line().c_str());
  if (const std::int64_t m = spec.step.microbatches; m > 1 && spec.pipeline.stages == 1) {
    const std::int64_t rows = spec.global_batch_size / (m * spec.dims.dp_replicate * spec.dims.dp_shard);
    std::printf("gradient accumulation: %lld microbatches of %lld row%s per data-parallel rank (training.local_batch_size), one optimizer step and one gradient reduction per step\n",
                static_cast<long long>(m), static_cast<long long>(rows), rows == 1 ? "" : "s");
  }
  if (job.sequence_parallel_dim >= 0) {
    const std::int64_t most = (spec.seq_len / spec.dims.cp + spec.dims.tp - 1) / spec.dims.tp;  // of a cp rank's share
    std::printf("sequence parallel: the norms and the residual stream are sharded on the sequence over tp (up to %lld token%s a rank)\n",
                static_cast<long long>(most), most == 1 ? "" : "s");
  } else if (!job.sequence_parallel_off.empty()) {
    std::printf("sequence parallel: off, %s\n", job.sequence_parallel_off.c_str());
  }
  if (const std::string cp = train::context_parallel_summary(spec, job, plan).line(); !cp.empty()) std::printf("%s\n", cp.c_str());
  if (job.loss_parallel) std::printf("loss parallel: cross entropy on the logits sharded on the vocabulary over tp (parallelism.disable_loss_parallel = false)\n");
  if (!spec.output.tensorboard_folder.empty()) std::printf("TensorBoard: event files in %s\n", spec.output.tensorboard_folder.string().c_str());
  if (!spec.auto_report.empty()) std::printf("%s\n", spec.auto_report.c_str());
  for (const auto& e : strategy_events(spec)) std::printf("fallback: %s\n", e.str().c_str());  // before the memory lines, which are of the layout chosen
  if (const CheckpointReport& ac = job.checkpointed; spec.activation_checkpoint.mode != "none") {
    std::printf("activation checkpointing %s%s: %lld layers recompute %lld nodes in the backward; %s of forward values (global) not kept\n",
                spec.activation_checkpoint.mode.c_str(), spec.activation_checkpoint.mode == "selective" ? (" (" + spec.activation_checkpoint.selective_option + ")").c_str() : "",
                static_cast<long long>(ac.layers), static_cast<long long>(ac.recomputed_nodes), human_bytes(static_cast<double>(ac.freed_bytes)).c_str());
  }
  // The budget's report names the planned peak of what it chose; without one, the peak as planned.
  if (!spec.memory_fit.empty()) std::printf("%s\n", spec.memory_fit.c_str());
  else std::printf("planned peak memory (rank 0): %s\n", planned.str().c_str());
  if (spec.mixed_precision.param != "float32") {
    char scaling[224] = "";
    if (spec.step.loss_scaling) {
      const bool kept = resumed != nullptr && resumed->loss_scale > 0;
      std::snprintf(scaling, sizeof scaling, "; dynamic loss scale from %g%s, halved on overflow (the update skipped), doubled after %lld clean steps",
                    kept ? resumed->loss_scale : spec.mixed_precision.init_scale, kept ? " (the checkpoint's)" : "",
                    static_cast<long long>(spec.mixed_precision.growth_interval));
    }
    std::printf("mixed precision: %s parameters, %s reduce (matmuls and attention in %s; norms, loss and AdamW in float32 on float32 master weights)%s\n",
                spec.mixed_precision.param.c_str(), spec.mixed_precision.reduce.c_str(), spec.mixed_precision.param.c_str(), scaling);
  }
  if (device.compute_stream() != nullptr) {
    std::printf("device %s (rank 0's)%s\n", device.describe().c_str(), spec.device.cuda_graphs ? ", CUDA graphs: step 1 eager, then captured once and replayed" : "");
  }
  std::fflush(stdout);
}

void print_done(const train::JobSpec& spec, std::int64_t first_step, double seconds, double first_loss, double last_loss,
                const std::filesystem::path& dump) {
  const long long ran = static_cast<long long>(spec.steps - first_step + 1);
  const std::string which = first_step > 1 ? " (" + std::to_string(first_step) + "-" + std::to_string(spec.steps) + ", resumed)" : "";
  std::printf("done: %lld step%s%s in %.2f s, loss %.4f -> %.4f (ln(vocab) = %.4f); metrics in %s\n", ran, ran == 1 ? "" : "s", which.c_str(),
              seconds, first_loss, last_loss, std::log(static_cast<double>(spec.model.vocab_size)),
              (dump / "metrics.jsonl").string().c_str());
}

}  // namespace

int run_job(const config::Config& cfg, const launch::RankEnv& env) {
  const bool lead = env.rank == 0;
  // Plugins read torchrun's LOCAL_RANK (nccl takes its GPU by it); under srun or mpirun this
  // rank's comes from SLURM_LOCALID or OMPI_COMM_WORLD_LOCAL_RANK. Set before any thread starts.
  ::setenv("LOCAL_RANK", std::to_string(env.local_rank).c_str(), /*overwrite=*/0);
  std::optional<SignalDumper> signals;
  if (!cfg.get_list("hooks.enable").empty()) {
    signals.emplace();  // before any thread starts
  } else {
    std::signal(SIGUSR1, SIG_IGN);  // a dump request (the launcher passes it on) with nothing to dump
  }
  const Fault fault = parse_fault(std::getenv("SPMDX_FAULT"));
  // Ranks on one host share its cores: each takes its part for intra-op threads.
  at::set_num_threads(intra_op_threads(env.local_world_size));
  const auto tokenizer = data::make_tokenizer(cfg.get_string("model.tokenizer"));
  PluginRegistry registry;
  train::discover_plugins(registry, cfg);
  // The config read once; under parallelism.memory_budget, changed as the launcher's check chose.
  const train::JobSpec spec = [&] {
    train::JobSpec s = train::job_spec(cfg, env.world_size, tokenizer->vocab_size());
    train::choose_strategies(s, registry, train::validator_hooks(cfg, registry, env.world_size));  // as the launcher chose
    return s;
  }();
  train::check_runnable(cfg);
  const std::unique_ptr<Device> device = make_device({spec.device.kind, env.local_rank, spec.device.allow_tf32, spec.device.cpu_matmul});

  // A job whose checkpoint is already at its last step has nothing to do, and changes nothing.
  const bool checkpointing = spec.checkpoint.enable;
  const std::filesystem::path& ckpt_dir = spec.checkpoint.folder;
  const std::string tokenizer_id = tokenizer_fingerprint(spec.data.tokenizer, tokenizer->vocab_size());
  const std::optional<std::int64_t> resume_step = find_resume(cfg, spec, tokenizer_id, lead);
  const std::int64_t first_step = resume_step ? *resume_step + 1 : 1;
  if (first_step > spec.steps) {
    if (lead) say_nothing_to_do(ckpt_dir, *resume_step, spec.steps);
    return 0;
  }

  train::PlacedJob job = train::place_job(spec, registry);
  check_fault(fault, env, spec, job);
  const auto plan = train::propagate_job(job);
  std::int64_t kept_collectives = 0;
  // With pipeline stages, this rank plans as its place on one stage's mesh and runs its stage.
  const std::int64_t plan_rank = env.rank % job.mesh.size();
  train::StageGraph staged;
  const ir::Graph graph = train::rank_program(job, plan, env.rank, spec, &kept_collectives, &staged);

  const double timeout = spec.comm.timeout_seconds;
  Joined joined = join_job(cfg, env, timeout);
  // Debug hooks: made on every rank; the compile stages run on rank 0, before any backend
  // joins, so a validator that fails stops the job before its first step.
  hooks::HookSet hooks = make_job_hooks(cfg, env, job, registry, joined.store.get(), timeout, first_step);
  if (signals) signals->start(&hooks);
  if (lead && !hooks.empty()) {
    std::vector<std::int64_t> ranks;
    for (std::int64_t r = 0; r < job.mesh.size(); ++r) ranks.push_back(r);
    hooks.compile(plan, ranks, spec.plan);
  }
  std::unique_ptr<CommBackend> backend;
  std::optional<CommChain> chain;
  if (env.world_size > 1) {
    chain.emplace(registry, spec.comm, env, *joined.store);
    backend = chain->join_at_start();
  }
  DistributedExecutor executor(graph, train::run_mesh(job), env.rank, backend.get(), timeout, spec.plan, device.get());
  if (!hooks.empty()) executor.set_hooks(&hooks);
  if (fault.kind == "skip_collective" && fault.rank == env.rank) executor.inject_skip(fault.step, fault.index);

  // The step's planned peak; with run-time failover, each step also holds a copy of the state.
  // Checked against this host's memory before the first tensor of the state is made.
  plan::MemoryPlan planned = executor.memory();
  if (chain && spec.comm.failover()) planned.add_state_copy(train::state_copy_bytes(graph, job.model.params));
  check_host_memory(planned, env, *device, spec, job.model, tokenizer->vocab_size());

  std::string loaded_weights;
  TensorMap state = initial_state(spec, job, plan, plan_rank, !resume_step, device->device(), &loaded_weights);
  // Every stage's state layout (a checkpoint's metadata lists them all), then this rank's part.
  const auto [state_metas, state_placements] = state_layout(state, job, plan);
  PipelineStages pipeline_stages;
  if (job.pipeline.stages > 1) {  // a stage holds its own parameters, state and buffers
    pipeline_stages.stages = job.pipeline.stages;
    for (const auto& [name, meta] : state_metas) {
      const auto holder = staged.input_stage.find(name);  // a buffer no stage reads: with stage 0
      pipeline_stages.stage[name] = holder == staged.input_stage.end() ? 0 : holder->second;
    }
    for (auto it = state.begin(); it != state.end();) it = graph.find_input(it->first) == nullptr ? state.erase(it) : std::next(it);
  }
  data::TextDatasetOptions data_options{spec.data.paths, spec.global_batch_size, spec.seq_len, spec.data.seed};
  data_options.document_separator = spec.data.document_separator;
  data::TextDataset dataset(data_options, *tokenizer);

  // Resume from the checkpoint found above, resharding when it was saved on another mesh,
  // strategy or pipeline.
  CheckpointMeta resumed;
  if (resume_step) resumed = resume_from(ckpt_dir, *resume_step, job, env, state_metas, state_placements, state, dataset, device->device(), pipeline_stages);
  // The step updates the state in place (PlanOptions::donate_state): each tensor must own its
  // storage, not view a larger one (a checkpoint's read buffer, say).
  for (auto& [name, t] : state) {
    if (!t.is_contiguous() || static_cast<std::size_t>(t.nbytes()) != t.storage().nbytes()) t = t.clone(at::MemoryFormat::Contiguous);
  }

  std::optional<MetricsWriter> metrics;
  const std::filesystem::path& dump = spec.output.dump_folder;
  if (lead) {
    metrics.emplace(spec.output, first_step, checkpointing, planned.peak_bytes, spec.step.microbatches);
    print_banner(spec, job, plan, env, backend.get(), *device, planned, resume_step ? &resumed : nullptr);
    if (job.pipeline.stages > 1) {
      std::printf("pipeline: %lld stages (mesh dim pp) of %lld rank%s, schedule %s, %lld microbatches, theoretical bubble %.3f; stage 0 (rank 0) sends %lld and receives %lld tensors a step\n",
                  static_cast<long long>(job.pipeline.stages), static_cast<long long>(job.mesh.size()), job.mesh.size() == 1 ? "" : "s", job.pipeline.schedule.c_str(),
                  static_cast<long long>(job.pipeline.microbatches), train::bubble_fraction(job.pipeline), static_cast<long long>(staged.sends),
                  static_cast<long long>(staged.recvs));
      std::printf("pipeline stages hold:");
      for (std::int64_t st = 0; st < job.pipeline.stages; ++st) std::printf("%s stage %lld %s", st ? ";" : "", static_cast<long long>(st), train::stage_layers(job.pipeline, st).c_str());
      std::printf("\n");
      std::fflush(stdout);
    }
    if (!loaded_weights.empty()) std::printf("%s\n", loaded_weights.c_str());
    if (resume_step && !spec.checkpoint.initial_load_path.empty()) {
      std::printf("checkpoint.initial_load_path %s not read: the job resumes from its own checkpoint (as torchtitan's)\n",
                  spec.checkpoint.initial_load_path.string().c_str());
    }
    if (chain) {
      for (const auto& e : chain->events()) std::printf("fallback: %s\n", e.str().c_str());
    }
    if (spec.activation_checkpoint.keep_collective_outputs && spec.activation_checkpoint.mode != "none") {
      std::printf("activation_checkpoint.keep_collective_outputs: %lld collectives of the recomputation read the forward's outputs instead (rank 0)\n",
                  static_cast<long long>(kept_collectives));
      std::fflush(stdout);
    }
  }
  StepLoop loop{env, spec, job, plan, executor, *device, state, state_metas, state_placements, dataset, hooks, registry, backend, chain ? &*chain : nullptr,
                joined.store.get(),
                metrics ? &*metrics : nullptr, fault, timeout, ckpt_dir, tokenizer_id};
  loop.strategy_events = strategy_events(spec);
  loop.planned_peak = planned.peak_bytes;
  loop.pipeline_stages = &pipeline_stages;
  std::optional<Validation> validation;
  if (spec.validation.enable) {
    validation.emplace(spec, job, env.rank, backend.get(), timeout, *device, *tokenizer);
    loop.validation = &*validation;
    if (lead) {
      std::printf("validation: every %lld steps, the mean loss of %lld held-out batches of %lld x %lld tokens (%zu tokens in validation.paths)%s\n",
                  static_cast<long long>(spec.validation.freq), static_cast<long long>(validation->steps), static_cast<long long>(spec.validation.global_batch_size),
                  static_cast<long long>(spec.seq_len), validation->dataset.stream().size(),
                  std::any_of(spec.validation.paths.begin(), spec.validation.paths.end(), [&](const std::string& p) {
                    return std::find(spec.data.paths.begin(), spec.data.paths.end(), p) != spec.data.paths.end();
                  }) ? "; warning: a validation file is also in data.paths, so its text is trained on" : "");
    }
  }
  std::optional<StepProfiler> profiler;
  if (spec.output.profile_freq > 0) {
    profiler.emplace(spec.output.traces_folder, spec.output.profile_freq, env.rank, device->device().is_cuda());
    loop.profiler = &*profiler;
  }
  if (resume_step) loop.resume(resumed);
  const auto run_start = Clock::now();
  const auto [first_loss, last_loss] = loop.run(first_step, joined.server != nullptr);
  if (lead) print_done(spec, first_step, std::chrono::duration<double>(Clock::now() - run_start).count(), first_loss, last_loss, dump);
  if (backend) {
    backend->barrier(0)->wait(timeout);  // rank 0 may serve the store: nobody leaves before everyone is done
    backend->finalize();
  }
  return 0;
}

}  // namespace spmdx::exec
