#include "spmdx/job/run.h"

#include <ATen/ATen.h>

#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <map>
#include <set>
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
#include "spmdx/job/auto_sharding.h"
#include "spmdx/job/comm_chain.h"
#include "spmdx/job/devices.h"
#include "spmdx/exec/device.h"
#include "spmdx/exec/kernels.h"
#include "spmdx/exec/calibrate.h"
#include "spmdx/plan/target.h"
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
#include "spmdx/job/compile.h"
#include "spmdx/job/fault_injection.h"
#include "spmdx/job/memory_budget.h"
#include "spmdx/job/metrics.h"
#include "spmdx/job/preflight.h"
#include "spmdx/job/signals.h"
#include "spmdx/job/spec.h"
#include "spmdx/job/step_loop.h"
#include "spmdx/job/validation.h"
#include "spmdx/plan/memory_plan.h"

namespace spmdx::job {
using namespace spmdx::exec;
using namespace spmdx::train;

namespace {

using Clock = std::chrono::steady_clock;

// The cores this rank has: its share under spmdx run --cpu-affinity, else this process's CPUs
// shared evenly among the host's ranks.
double rank_cores(const launch::RankEnv& env) {
  const double share = launch::cpu_share(env);
  return share > 0 ? share : static_cast<double>(launch::usable_cpus()) / static_cast<double>(std::max(1, env.local_world_size));
}

// Intra-op threads for this rank: OMP_NUM_THREADS when set (torchrun sets it to 1 for several
// ranks per host, and a user's value wins, as in PyTorch), else this process's CPUs (its
// affinity mask: taskset, a cgroup cpuset, a SLURM binding) shared among the host's ranks.
int intra_op_threads(const launch::RankEnv& env) {
  if (const char* v = std::getenv("OMP_NUM_THREADS"); v != nullptr && *v != '\0') {
    char* end = nullptr;
    const long n = std::strtol(v, &end, 10);
    if (*end == '\0' && n >= 1 && n <= 4096) return static_cast<int>(n);
    SPMDX_WARN("OMP_NUM_THREADS='" << v << "' is not a whole number from 1 to 4096: ignored, threads come from the CPUs available");
  }
  return std::max(1, static_cast<int>(rank_cores(env) + 1e-9));  // the whole cores of it
}

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

std::optional<std::int64_t> find_resume(const config::Config& cfg, const JobSpec& spec, const std::string& tokenizer_id, bool lead, bool restarted) {
  if (restarted) return {};
  const CheckpointSpec& ckpt = spec.checkpoint;
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

// The rendezvous: the store (this rank's server when it hosts one, torchrun's c10d store, or a
// client of rank 0's), and every rank's identity checked by rank 0. Nothing for one rank.
struct Joined {
  std::unique_ptr<comm::TcpStoreServer> server;
  std::unique_ptr<Store> store;
};

Joined join_job(const config::Config& cfg, const launch::RankEnv& env, double timeout, bool restarted) {
  Joined j;
  if (env.world_size <= 1) return j;
  if (!env.store_hosted && !env.c10d_store && env.rank == 0) j.server = std::make_unique<comm::TcpStoreServer>("0.0.0.0", env.master_port, env.token);
  if (env.rank == 0 && !restarted) {
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
  // A replica group restarted under fault tolerance: the job's ranks met long ago, and the
  // launcher started this one with their settings; it joins at the live groups' next step.
  if (restarted) return j;
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
TensorMap initial_state(const JobSpec& spec, PlacedJob& job, const sharding::DistributedPlan& plan, std::int64_t rank,
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

// Each state tensor's global meta and its placement, by name: what checkpoints hold.
std::pair<std::map<std::string, ir::TensorMeta>, std::map<std::string, sharding::Placements>> state_layout(const TensorMap& state, const PlacedJob& job,
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
std::vector<FallbackEvent> strategy_events(const JobSpec& spec) {
  std::vector<FallbackEvent> out;
  const auto& passed = spec.strategies_passed_over;
  for (std::size_t i = 0; i < passed.size(); ++i) {
    out.push_back({"strategies", passed[i].first, i + 1 < passed.size() ? passed[i + 1].first : layout_text(spec.strategies), passed[i].second, 0});
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
hooks::HookSet make_job_hooks(const JobSpec& spec, const launch::RankEnv& env, const PlacedJob& job, PluginRegistry& registry,
                              Store* store, double timeout, std::int64_t first_step) {
  HookContext hook_base;
  hook_base.rank = env.rank;
  hook_base.world_size = env.world_size;
  hook_base.mesh = job.mesh.dims();
  hook_base.coordinate = job.mesh.coordinate(env.rank % job.mesh.size());
  hook_base.store = store;
  hook_base.timeout_seconds = timeout;
  hook_base.first_step = first_step;
  return hooks::make_hooks(spec.hooks, registry, hook_base);
}

// Loads checkpoint `step` over `state` (the trained tensors; buffers stay as made) and puts the
// dataset where it was.
CheckpointMeta resume_from(const std::filesystem::path& ckpt_dir, std::int64_t step, const PlacedJob& job, const launch::RankEnv& env,
                 const std::map<std::string, ir::TensorMeta>& state_metas, const std::map<std::string, sharding::Placements>& state_placements,
                 TensorMap& state, data::TextDataset& dataset, const c10::Device& device, const PipelineStages& pipeline) {
  CheckpointMeta meta;
  // Buffers (the RoPE tables) are made from the config, not loaded: a resume may change
  // training.seq_len, as torchtitan's may.
  std::map<std::string, ir::TensorMeta> trained = state_metas;
  std::set<std::string> buffers;
  const auto updated = updated_buffers(job.model.graph, job.model.params);  // an MoE layer's expert_bias: state, loaded
  for (const auto& spec_i : job.model.init) {
    if (!spec_i.trainable && std::find(updated.begin(), updated.end(), spec_i.name) == updated.end()) trained.erase(spec_i.name), buffers.insert(spec_i.name);
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
std::string what_makes_it_large(const plan::MemoryPlan& planned, const JobSpec& spec, const models::Model& model, std::int64_t tokenizer_vocab) {
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
void check_host_memory(const plan::MemoryPlan& planned, const launch::RankEnv& env, const Device& device, const JobSpec& spec,
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

// The peak FLOP/s of the hardware one rank has, in the step's compute dtype, for MFU, and what it
// is ("" and 0 when unknown). A CPU rank: the measured GEMM peak of a core (exec::gemm_peak)
// times the cores it has (its intra-op threads, at most the host's usable CPUs shared among its
// ranks); a CUDA rank: its device's datasheet peak (plan/target.h), TF32's for float32 when on.
std::pair<double, std::string> peak_flops_per_rank(const JobSpec& spec, const launch::RankEnv& env, const Device& device) {
  const std::string& dtype = spec.mixed_precision.param;
  char text[512];
  if (device.compute_stream() != nullptr) {
    const plan::TargetProfile* t = plan::target_for_device_name(device.describe());
    if (t == nullptr) return {0, "no datasheet peak known for " + device.describe() + " (spmdx knows " + plan::target_names() + ")"};
    const double peak = t->peak_flops(dtype, spec.device.allow_tf32);
    std::snprintf(text, sizeof text, "%.0f TFLOP/s %s%s a rank (%s, dense, datasheet)", peak / 1e12, dtype.c_str(),
                  dtype == "float32" && spec.device.allow_tf32 ? " on TF32" : "", t->label.c_str());
    return {peak, text};
  }
  const exec::GemmPeak p = exec::gemm_peak();
  const double cores = std::min(static_cast<double>(at::get_num_threads()), rank_cores(env));
  const double peak = p.of(dtype) * cores;
  std::snprintf(text, sizeof text, "%.1f GFLOP/s %s a rank = %.1f a core x %.3g core%s (%s)", peak / 1e9, dtype.c_str(), p.of(dtype) / 1e9, cores,
                cores == 1 ? "" : "s", p.source.c_str());
  return {peak, text};
}

// `resumed`: the checkpoint a resumed job starts from (its loss scale replaces the config's).
// `registry`: for the auto line's balanced split (auto_balance_line), made here, where it is said.
void print_banner(const JobSpec& spec, const PlacedJob& job, const sharding::DistributedPlan& plan, const launch::RankEnv& env, const CommBackend* backend,
                  const Device& device, const plan::MemoryPlan& planned, const CheckpointMeta* resumed, PluginRegistry& registry) {
  using train::CheckpointReport;
  double params = 0;
  for (const auto& p : job.model.params) params += static_cast<double>(job.model.graph.find_input(p)->meta().numel());
  std::string linears = device.compute_stream() == nullptr ? std::string(", float32 linears on ") + library_name(cpu_matmul()) : "";
  if (device.compute_stream() == nullptr && spec.mixed_precision.param != "float32") {
    linears += ", " + half_gemm_summary(spec.mixed_precision.param == "bfloat16" ? at::kBFloat16 : at::kHalf);
  }
  std::printf("spmdx: %s (%.2fM parameters), mesh %s (%d rank%s, %s), global batch %lld x %lld, %lld steps, comm %s, %d intra-op thread%s per rank%s\n",
              models::model_label(spec.model).c_str(), params / 1e6,
              run_mesh(job).str().c_str(), env.world_size, env.world_size == 1 ? "" : "s", env.source.c_str(), static_cast<long long>(spec.global_batch_size),
              static_cast<long long>(spec.seq_len), static_cast<long long>(spec.steps),
              backend ? ((spec.comm.backend == "auto" ? "auto -> " : "") + backend->describe()).c_str() : "none (one rank)",
              at::get_num_threads(), at::get_num_threads() == 1 ? "" : "s",
              linears.c_str());
  for (const auto& s : short_parameters(spec, job)) std::printf("warning: %s\n", s.line().c_str());
  for (const auto& line : job.decided_by) std::printf("%s\n", line.c_str());  // who placed each mesh dim
  for (const auto& line : tp_replicated_parameters(spec, job)) std::printf("warning: %s\n", line.c_str());
  if (const std::string note = models::mla_note(spec.model); !note.empty()) std::printf("note: %s\n", note.c_str());
  if (const auto& moe = job.model.args.moe; moe.expert_parallel > 1) {  // the model's: an imported one counts its experts when it is read
    std::printf("expert parallelism: ep %lld over %s, %lld of %lld experts a rank, tokens exchanged by all_to_all_v\n", static_cast<long long>(moe.expert_parallel),
                moe.expert_dim.c_str(), static_cast<long long>(moe.experts / moe.expert_parallel), static_cast<long long>(moe.experts));
  }
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
  if (const std::string cp = context_parallel_summary(spec, job, plan).line(); !cp.empty()) std::printf("%s\n", cp.c_str());
  if (job.loss_parallel) std::printf("loss parallel: cross entropy on the logits sharded on the vocabulary over tp (parallelism.disable_loss_parallel = false)\n");
  if (!spec.output.tensorboard_folder.empty()) std::printf("TensorBoard: event files in %s\n", spec.output.tensorboard_folder.string().c_str());
  if (!spec.auto_report.empty()) {
    std::printf("%s%s\n", spec.auto_report.c_str(), spec.balance.speed ? ("; " + auto_balance_line(spec, registry)).c_str() : "");
  }
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
  if (!spec.planning_target.empty()) {
    std::printf("note: planning.target = \"%s\" priced this job's plan (strategy = \"auto\", the memory budget) for that GPU; it runs on %s here\n",
                spec.planning_target.c_str(), device.describe().c_str());
  }
  if (device.compute_stream() != nullptr) {
    std::printf("device %s (rank 0's)%s\n", device.describe().c_str(), spec.device.cuda_graphs ? ", CUDA graphs: step 1 eager, then captured once and replayed" : "");
  }
  std::fflush(stdout);
}

// `rejoined`: this rank's replica group was restarted under fault tolerance and took the live
// groups' state at `first_step` (the job's steps before it ran without this process).
void print_done(const JobSpec& spec, std::int64_t first_step, double seconds, double first_loss, double last_loss,
                const std::filesystem::path& dump, bool rejoined) {
  const long long ran = static_cast<long long>(spec.steps - first_step + 1);
  const std::string which = first_step > 1 ? " (" + std::to_string(first_step) + "-" + std::to_string(spec.steps) +
                                                 (rejoined ? " on this rank, restarted: the job ran every step" : ", resumed") + ")"
                                           : "";
  std::printf("done: %lld step%s%s in %.2f s, loss %.4f -> %.4f (ln(vocab) = %.4f); metrics in %s\n", ran, ran == 1 ? "" : "s", which.c_str(),
              seconds, first_loss, last_loss, std::log(static_cast<double>(spec.model.vocab_size)),
              (dump / "metrics.jsonl").string().c_str());
}

// parallelism.balance = "speed": this rank's program for `rows` rows, the job compiled for dp x
// rows (every data-parallel rank as many) with every op's strategy pinned (`choices`:
// balance_choices'), which leaves the state's placements and the collectives over the
// data-parallel dims as they are (Balancer::check_same_collectives checks the latter).
struct BalancedProgram {
  std::unique_ptr<CompiledJob> compiled;
  ir::Graph graph;
};

BalancedProgram balanced_program(const JobSpec& spec, PluginRegistry& registry, int rank, std::int64_t rows, const sharding::Placements& tokens_pl,
                                 const std::map<std::int64_t, std::map<int, std::string>>& choices) {
  const JobSpec s = rows_spec(spec, rows, choices);
  BalancedProgram p{std::make_unique<CompiledJob>(s, registry), {}};
  p.graph = rank_program(p.compiled->job, p.compiled->plan, rank, s);
  const ir::Value* tokens = p.graph.find_input("tokens");
  if (tokens == nullptr || tokens->meta().shape.empty() || tokens->meta().shape[0] != rows ||
      p.compiled->plan.placement.at(p.compiled->job.model.graph.find_input("tokens")) != tokens_pl) {
    throw std::runtime_error("parallelism.balance = \"speed\": the plan for " + std::to_string(rows) + " rows a data-parallel rank does not give rank " +
                             std::to_string(rank) + " those rows of the batch (its layout does not split the batch over the data-parallel mesh dims alone): "
                             "use parallelism.balance = \"even\"");
  }
  return p;
}

// What a rank runs over the data-parallel mesh dims, in its run order: each collective's op, mesh
// dim, whole tensor, chunk sizes and bucket (FNV-1a, 64 bits), which every member of its group
// must have alike.
std::uint64_t data_parallel_collectives_hash(const ir::Graph& graph, const plan::RuntimePlan& plan, const sharding::DeviceMesh& mesh) {
  static const std::set<std::string> collectives{"all_reduce", "reduce_scatter", "all_gather", "all_to_all", "all_to_all_v"};
  std::vector<const ir::Node*> nodes;  // graph order, as plan.order counts them
  for (const auto& node : graph.nodes()) nodes.push_back(node.get());
  std::string text;
  for (int index : plan.order) {
    const ir::Node& n = *nodes.at(static_cast<std::size_t>(index));
    if (collectives.count(n.op()) == 0 || n.attrs().count("mesh_dim") == 0) continue;
    const std::int64_t dim = n.attr_int("mesh_dim");
    if (!is_data_parallel_dim(mesh.dims().at(static_cast<std::size_t>(dim)).name)) continue;
    // What every member of the group has alike: the whole tensor (a member's chunk of an uneven
    // shard is its own), the chunks' sizes, the bucket.
    const ir::Value* whole = n.op() == "all_gather" ? n.output() : n.input(0);
    text += n.op() + " " + std::to_string(dim) + " " + (n.op() == "all_to_all" || n.op() == "all_to_all_v" ? ir::to_string(whole->meta().dtype) : whole->meta().str());
    for (const char* sizes : {"sizes", "gather_sizes", "scatter_sizes"}) {
      if (n.attrs().count(sizes) > 0) {
        for (std::int64_t k : n.attr_ints(sizes)) text += " " + std::to_string(k);
      }
    }
    text += " b" + std::to_string(plan.bucket_of.at(static_cast<std::size_t>(index))) + ";";
  }
  std::uint64_t h = 1469598103934665603ull;
  for (unsigned char c : text) h = (h ^ c) * 1099511628211ull;
  return h;
}

}  // namespace

int run_job(const config::Config& cfg, const launch::RankEnv& env) {
  const bool lead = env.rank == 0;
  // Plugins read torchrun's LOCAL_RANK (nccl takes its GPU by it); under srun or mpirun this
  // rank's comes from SLURM_LOCALID or OMPI_COMM_WORLD_LOCAL_RANK. Set before any thread starts.
  ::setenv("LOCAL_RANK", std::to_string(env.local_rank).c_str(), /*overwrite=*/0);
  std::optional<SignalDumper> signals;
  if (hooks_enabled(cfg)) {
    signals.emplace();  // before any thread starts
  } else {
    std::signal(SIGUSR1, SIG_IGN);  // a dump request (the launcher passes it on) with nothing to dump
  }
  const Fault fault = parse_fault(std::getenv("SPMDX_FAULT"));
  const std::vector<ProcessFault> process_faults = parse_process_faults(std::getenv("SPMDX_FAULT"));
  const bool restarted = std::getenv(launch::ft::kRestartEnv) != nullptr;  // fault tolerance: a lost replica group started again
  // spmdx run --cpu-affinity: this rank on its CPUs before any thread starts (they inherit them).
  const std::string cpus = launch::apply_cpu_affinity(env);
  // Ranks on one host share its cores: each takes its part for intra-op threads.
  const int threads = intra_op_threads(env);
  if (!cpus.empty()) {
    std::printf("CPUs %s (--cpu-affinity), %d intra-op thread%s\n", cpus.c_str(), threads, threads == 1 ? "" : "s");
    std::fflush(stdout);
  }
  at::set_num_threads(threads);
  const auto tokenizer = job_tokenizer(cfg);
  PluginRegistry registry;
  discover_plugins(registry, cfg);
  // The config read once; under parallelism.memory_budget, changed as the launcher's check chose.
  // What it warns of was said by the preflight before this (spmdx run's: the launcher's, or
  // under torchrun, srun or mpirun, the first local rank's of each host): not again here.
  const JobSpec spec = [&] {
    const log::ThreadLevel said_by_the_preflight(log::Level::error);
    JobSpec s = job_spec(cfg, env.world_size, tokenizer->vocab_size());
    choose_strategies(s, registry, validator_hooks(s, registry));  // as the launcher chose
    check_runnable(cfg);
    return s;
  }();
  // training.device = "auto" (or a training.devices entry): CUDA where this local rank has a GPU.
  const std::string& configured = spec.device.of(env.rank);
  std::string why_no_gpu;
  const std::string device_kind = resolve_device(configured, env.local_rank, configured == "auto" ? cuda_device_count(&why_no_gpu) : 0);
  if (configured == "auto" && device_kind == "cpu" && !why_no_gpu.empty()) SPMDX_DEBUG("training.device = \"auto\": cpu (" << why_no_gpu << ")");
  const std::unique_ptr<Device> device = make_device({device_kind, env.local_rank, spec.device.allow_tf32, spec.device.cpu_matmul});

  // A job whose checkpoint is already at its last step has nothing to do, and changes nothing.
  const bool checkpointing = spec.checkpoint.enable;
  const std::filesystem::path& ckpt_dir = spec.checkpoint.folder;
  const std::string tokenizer_id = tokenizer_fingerprint(spec.data.tokenizer, tokenizer->vocab_size());
  // A restarted replica group reads no checkpoint: the live groups give it their state.
  const std::optional<std::int64_t> resume_step = find_resume(cfg, spec, tokenizer_id, lead && !restarted, restarted);
  const std::int64_t first_step = resume_step ? *resume_step + 1 : 1;
  if (first_step > spec.steps) {
    if (lead) say_nothing_to_do(ckpt_dir, *resume_step, spec.steps);
    return 0;
  }

  CompiledJob compiled = compile_job(spec, registry);
  PlacedJob& job = compiled.job;
  const sharding::DistributedPlan& plan = compiled.plan;
  check_fault(fault, env, spec, job);
  check_process_faults(process_faults, env, spec);
  std::int64_t kept_collectives = 0;
  // With pipeline stages, this rank plans as its place on one stage's mesh and runs its stage.
  const std::int64_t plan_rank = env.rank % job.mesh.size();
  train::StageGraph staged;
  const ir::Graph graph = rank_program(job, plan, env.rank, spec, &kept_collectives, &staged);
  if (job.fault_domain_dim >= 0) {
    // Over the replica groups a step may only sum (an all_reduce runs over the live groups).
    for (const auto& node : graph.nodes()) {
      if (node->attrs().count("mesh_dim") == 0 || node->attr_int("mesh_dim") != job.fault_domain_dim || node->op() == "all_reduce") continue;
      throw std::invalid_argument("fault_tolerance.enable: this layout moves data between replica groups with " + node->op() +
                                  " (over mesh dim dp_replicate), which a lost group would leave incomplete; fault tolerance needs a layout whose "
                                  "replica groups only all_reduce gradients (the data_parallel strategy on dp_replicate, FSDP or TP inside a group)");
    }
  }

  const double timeout = spec.comm.timeout_seconds;
  Joined joined = join_job(cfg, env, timeout, restarted);
  // Every rank's device: a mesh of CUDA and CPU ranks moves its collectives in host memory
  // (job/devices.h), its CUDA ranks staging them (comm/staging.h).
  const std::vector<std::string> devices =
      joined.store && env.world_size > 1 ? exchange_devices(*joined.store, env.rank, env.world_size, device_kind, timeout) : std::vector<std::string>{device_kind};
  const bool mixed = mixed_devices(devices);
  const std::vector<MemoryType> memory_of_ranks = mixed ? rank_memory(devices) : std::vector<MemoryType>{};
  CommSpec comm_spec = spec.comm;
  comm_spec.memory = job_comm_memory(devices);
  // Debug hooks: made on every rank; the compile stages run on rank 0, before any backend
  // joins, so a validator that fails stops the job before its first step.
  hooks::HookSet hooks = make_job_hooks(spec, env, job, registry, joined.store.get(), timeout, first_step);
  if (signals) signals->start(&hooks);
  if (lead && !restarted && !hooks.empty()) {
    std::vector<std::int64_t> ranks;
    for (std::int64_t r = 0; r < job.mesh.size(); ++r) ranks.push_back(r);
    hooks.compile(plan, ranks, spec.plan);
  }
  std::unique_ptr<CommBackend> backend;
  std::optional<CommChain> chain;
  std::optional<FaultTolerance> ft;
  if (spec.fault_tolerance.enable) {
    // The live ranks' own backend (the first ranks': every group's; a restarted rank joins later).
    ft.emplace(spec, env, *joined.store, registry, process_faults);
    if (restarted) {
      for (const auto& f : process_faults) {
        if (f.rank == env.rank && f.at == "restart") ft->act(f);
      }
    }
    if (!ft->start({first_step, 0, 0, 0, 0})) {  // restarted, and the job finished before it was taken in
      std::printf("%s (restart %d): the job finished before the live groups could take it in\n", launch::ft::group_text(ft->group(), ft->ranks_per_group()).c_str(),
                  ft->attempt());
      return 0;
    }
    backend = ft->join();
    ft->watch(backend.get());
  } else if (env.world_size > 1) {
    chain.emplace(registry, comm_spec, env, *joined.store);
    backend = chain->join_at_start();
  }
  DistributedExecutor executor(graph, run_mesh(job), env.rank, backend.get(), timeout, spec.plan, device.get(), memory_of_ranks);
  if (!hooks.empty()) executor.set_hooks(&hooks);
  if (fault.kind == "skip_collective" && fault.rank == env.rank) executor.inject_skip(fault.step, fault.index);

  // The step's planned peak; with run-time failover, each step also holds a copy of the state.
  // Checked against this host's memory before the first tensor of the state is made.
  plan::MemoryPlan planned = executor.memory();
  if ((chain && spec.comm.failover()) || ft) planned.add_state_copy(state_copy_bytes(graph, job.model.params));
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
  if (lead && !restarted) {
    metrics.emplace(spec.output, first_step, checkpointing, planned.peak_bytes, spec.step.microbatches);
    print_banner(spec, job, plan, env, backend.get(), *device, planned, resume_step ? &resumed : nullptr, registry);
    if (mixed || !spec.device.per_rank.empty() || spec.device.kind == "auto") {
      std::printf("devices: %s%s\n", devices_text(devices).c_str(),
                  mixed ? "; collectives between CUDA and CPU ranks run in host memory (a CUDA rank stages its buffers through pinned host memory "
                          "where the backend cannot move both)"
                        : "");
    }
    const auto [peak, peak_text] = peak_flops_per_rank(spec, env, *device);
    metrics->set_mfu_basis(models::flops_per_token(job.model, spec.seq_len), env.world_size, peak);
    std::printf("mfu: torchtitan's (FLOPs per token x tokens/s per rank / peak), against %s\n", peak_text.c_str());
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
  StepLoop loop{env, spec, job, plan, &executor, *device, state, state_metas, state_placements, dataset, hooks, registry, backend, chain ? &*chain : nullptr,
                joined.store.get(),
                metrics ? &*metrics : nullptr, fault, timeout, ckpt_dir, tokenizer_id};
  loop.strategy_events = strategy_events(spec);
  loop.planned_peak = planned.peak_bytes;
  loop.pipeline_stages = &pipeline_stages;
  loop.comm_spec = &comm_spec;
  std::optional<Validation> validation;
  if (spec.validation.enable) {
    validation.emplace(spec, job, env.rank, backend.get(), timeout, *device, *tokenizer, memory_of_ranks);
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
  loop.process_faults = process_faults;
  // parallelism.balance = "speed": this rank's plan for its rows of each split (compiled as the job
  // for dp x those rows), and the executor of the split in force.
  std::optional<Balancer> balancer;
  std::map<std::int64_t, BalancedProgram> programs;
  std::unique_ptr<DistributedExecutor> balanced_executor;
  if (spec.balance.speed && joined.store && data_parallel_degree(job.mesh) > 1) {  // one data-parallel rank: no batch to split (auto's line says so)
    const std::int64_t dp_index = data_parallel_index(job.mesh, job.mesh.coordinate(plan_rank));
    const auto choices = balance_choices(spec, registry);
    // Under parallelism.memory_budget no rank takes more rows than fit it (every rank computes the same bound).
    BalanceSpec balance = spec.balance;
    balance.max_rows = balance_max_rows(spec, registry, choices);
    if (lead && balance.max_rows > 0) {
      std::printf("balance: at most %lld rows a data-parallel rank: the plan for more is over parallelism.memory_budget %s\n",
                  static_cast<long long>(balance.max_rows), human_bytes(static_cast<double>(spec.memory_budget)).c_str());
    }
    balancer.emplace(balance, spec.global_batch_size, data_parallel_degree(job.mesh), dp_index, env.rank, env.world_size, *joined.store, timeout);
    loop.balancer = &*balancer;
    loop.replan = [&, choices] {
      const std::int64_t rows = balancer->rows();
      auto it = programs.find(rows);
      if (it == programs.end()) it = programs.emplace(rows, balanced_program(spec, registry, env.rank, rows, loop.tokens_pl, choices)).first;
      // Every rank makes its executor anew, in the same order: each makes the backend's groups.
      loop.executor = nullptr;
      balanced_executor = std::make_unique<DistributedExecutor>(it->second.graph, run_mesh(job), env.rank, backend.get(), timeout, spec.plan, device.get(),
                                                                memory_of_ranks);
      if (!hooks.empty()) balanced_executor->set_hooks(&hooks);
      balanced_executor->set_compute_slowdown(loop.slowdown_in_force);
      loop.executor = balanced_executor.get();
      balancer->check_same_collectives(data_parallel_collectives_hash(it->second.graph, balanced_executor->plan(), run_mesh(job)),
                                       "rows " + std::to_string(rows) + " on rank " + std::to_string(env.rank));
      // The step's planned peak for these rows: checked against the host's memory, as at start,
      // and what the step lines and metrics.jsonl compare the allocator's peak with.
      plan::MemoryPlan now = balanced_executor->memory();
      if (chain && spec.comm.failover()) now.add_state_copy(state_copy_bytes(it->second.graph, job.model.params));
      check_host_memory(now, env, *device, spec, job.model, tokenizer->vocab_size());
      loop.planned_peak = now.peak_bytes;
      if (loop.metrics != nullptr) {
        loop.metrics->set_planned_peak(now.peak_bytes);
        std::printf("balance: rank %d plans %lld rows a step, planned peak memory %s\n", env.rank, static_cast<long long>(rows),
                    human_bytes(static_cast<double>(now.peak_bytes)).c_str());
        std::fflush(stdout);
      }
    };
    // The split at start: parallelism.balance_speeds when given, else the cores a rank has.
    const double prior = !spec.balance.speeds.empty() ? spec.balance.speeds.at(static_cast<std::size_t>(dp_index)) : rank_cores(env);
    const bool uneven = balancer->start(prior, first_step);
    if (lead) {
      std::printf("balance: speed; rows per data-parallel rank %s at start (%s), re-planned every %lld steps from their measured compute times when "
                  "%.3g shorter\n",
                  split_text(balancer->split()).c_str(),
                  !uneven ? "even" : spec.balance.speeds.empty() ? "in proportion to their CPU shares" : "in proportion to parallelism.balance_speeds", static_cast<long long>(spec.balance.interval),
                  spec.balance.threshold);
      std::fflush(stdout);
    }
    loop.replan();
  }
  std::int64_t start_step = first_step;
  if (ft) {
    loop.ft = &*ft;
    loop.lead = lead && !restarted;
    if (loop.lead) std::printf("fault tolerance: %d replica groups of %d rank%s (the data_parallel_replicate slices); min_replica_size %lld, timeout %s s\n",
                               ft->groups(), ft->ranks_per_group(), ft->ranks_per_group() == 1 ? "" : "s",
                               static_cast<long long>(spec.fault_tolerance.min_replicas), seconds_text(spec.fault_tolerance.timeout_seconds).c_str());
    const double flops_per_token = models::flops_per_token(job.model, spec.seq_len);
    loop.on_lead_change = [&](bool now_lead, std::int64_t from_step) {
      if (!now_lead) {
        if (metrics) metrics.reset();
        loop.metrics = nullptr;
        return;
      }
      metrics.emplace(spec.output, from_step, checkpointing, planned.peak_bytes, spec.step.microbatches);
      const auto [peak, peak_text] = peak_flops_per_rank(spec, env, *device);
      metrics->set_mfu_basis(flops_per_token, env.world_size, peak);
      loop.metrics = &*metrics;
    };
    if (restarted) start_step = loop.join_restarted();
  }
  const auto run_start = Clock::now();
  const auto [first_loss, last_loss] = loop.run(start_step, joined.server != nullptr);
  if (ft) {
    const std::string said = ft->check_replicas_equal(FaultTolerance::digest(state, loop.names), spec.steps);
    if (!said.empty()) std::printf("%s\n", said.c_str());
    if (loop.lead) {
      if (const std::string unfired = ft->unfired_faults(); !unfired.empty()) std::fprintf(stderr, "%s\n", unfired.c_str());
    }
  }
  // A mixed mesh's CUDA rank: what its collectives copied through host memory.
  if (const comm::StagingStats st = mixed && loop.executor != nullptr ? loop.executor->staging_stats() : comm::StagingStats{};
      st.staged_calls + st.direct_calls > 0) {
    std::printf("staging: %lld collective calls through pinned host memory (%s to host, %s back), %lld passed on as they were%s\n",
                static_cast<long long>(st.staged_calls), human_bytes(static_cast<double>(st.to_host_bytes)).c_str(),
                human_bytes(static_cast<double>(st.to_device_bytes)).c_str(), static_cast<long long>(st.direct_calls),
                spec.balance.speed ? " (since the last re-plan)" : "");
  }
  if (loop.lead) print_done(spec, start_step, std::chrono::duration<double>(Clock::now() - run_start).count(), first_loss, last_loss, dump, restarted);
  if (backend) {
    backend->barrier(0)->wait(timeout);  // rank 0 may serve the store: nobody leaves before everyone is done
    backend->finalize();
  }
  return 0;
}

}  // namespace spmdx::job
