#include "spmdx/job/step_loop.h"

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

#include "spmdx/exec/shards.h"
#include "spmdx/files.h"
#include "spmdx/text.h"
#include "spmdx/train/checkpoint_folder.h"

namespace spmdx::job {
using namespace spmdx::exec;
using namespace spmdx::train;

using Clock = std::chrono::steady_clock;

namespace {

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

// OnGlobalSyncComplete: the train state after the step (views of this rank's shards), the loss
// and the step's spans, for the hooks.
void tell_hooks(hooks::HookSet& hooks, std::int64_t step, const JobSpec& spec, const launch::RankEnv& env, double loss, const RunStats& st,
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

}  // namespace

void StepLoop::resume(const CheckpointMeta& meta) {
  optimizer_steps = meta.optimizer_steps >= 0 ? meta.optimizer_steps : meta.step;
  if (meta.loss_scale > 0 && loss_scaling) {
    scaler.scale = meta.loss_scale;
    scaler.growth_tracker = std::min(meta.growth_tracker, scaler.growth_interval - 1);
  }
}

void StepLoop::feed_microbatches(TensorMap& feed, const char* name, const at::Tensor& global, const sharding::Placements& pl, const c10::Device& on) const {
  const std::int64_t m = spec.step.microbatches;
  if (balancer != nullptr) {
    // This rank's rows of the split in force. Its plan is the job's for dp x its rows (every data-parallel
    // rank holding as many), so the rows stand for each rank's chunk of that batch and shard_tensor
    // takes them as any other layout's (tp and cp slicing the same rows alike).
    const std::int64_t dp = spec.dims.dp_replicate * spec.dims.dp_shard;
    feed[name] = shard_tensor(global.narrow(0, balancer->offset(), balancer->rows()).repeat({dp, 1}), pl, job.mesh, coord).to(on);
    return;
  }
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

TensorMap StepLoop::run_step(TensorMap& feed, std::int64_t step) {
  if (!spec.device.cuda_graphs || !warmed_up) {
    warmed_up = true;
    TensorMap out = executor->run(feed, step);
    for (const auto& s : names) state[s] = out.at("next." + s);
    return out;
  }
  if (!graph) {
    graph_feed = feed;  // the state's tensors, updated in place by each replay
    executor->set_capturing(true);
    graph = device.capture([&] {
      graph_out = executor->run(graph_feed, step);
      for (const auto& s : names) graph_feed.at(s).copy_(graph_out.at("next." + s));
    });
    executor->set_capturing(false);
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

double StepLoop::step(std::int64_t step) {
  c10::InferenceMode no_autograd;  // the state tensors are inference tensors: updated in place below (a fault, a CUDA graph's copies)
  if (const ProcessFault* f = due_fault(process_faults, env.rank, step, "start"); f != nullptr) ft != nullptr ? ft->act(*f) : fire(*f);
  if (const double factor = compute_slowdown(process_faults, env.rank, step); factor != slowdown_in_force) {
    slowdown_in_force = factor;
    executor->set_compute_slowdown(factor);
    std::fprintf(stderr, "SPMDX_FAULT: rank %d runs every compute op %.10g times as long from step %lld\n", env.rank, factor, static_cast<long long>(step));
    std::fflush(stderr);
  }
  if (ft != nullptr) {
    if (auto* live = dynamic_cast<LiveBackend*>(backend.get())) live->set_step(step);
  }
  if (failover || ft != nullptr) {
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
  bool profiling = profiler != nullptr && profiler->chosen(step);
  if (profiling) {
    executor->set_record_spans(true);
    profiler->start();
  }
  std::string failed;  // fault tolerance: why this rank could not finish the step
  try {
    out = run_step(feed, step);
  } catch (const CommError& e) {
    if (profiling) profiler->cancel(), executor->set_record_spans(false);
    if (failover) throw StepFailed(e.what(), false);
    if (ft == nullptr) throw;
    failed = e.what();
    profiling = false;
  }
  if (const ProcessFault* f = due_fault(process_faults, env.rank, step, "commit"); f != nullptr) ft != nullptr ? ft->act(*f) : fire(*f);
  if (ft != nullptr) {
    // Where training stands after the step in either outcome: what a configuration the vote
    // opens gives the groups that join it.
    const FtProgress aborted{step, optimizer_steps_before, data_before.samples, scaler_before.scale, scaler_before.growth_tracker};
    FtProgress committed = aborted;
    if (failed.empty()) {
      const bool overflow = loss_scaling && out.at("found_inf").item<float>() != 0;
      train::GradScaler after = scaler;
      if (loss_scaling) after.update(overflow);
      committed = {step + 1, optimizer_steps + (overflow ? 0 : 1), dataset.state().samples, loss_scaling ? after.scale : 0.0, after.growth_tracker};
    }
    const FtDecision d = ft->vote_step(step, step == spec.steps, failed, committed, aborted);
    if (d.stop) throw std::runtime_error("fault tolerance: step " + std::to_string(step) + ": " + d.why + "; the job stops");
    if (!d.commit) {
      for (auto& [name, t] : before) state[name] = std::move(t);
      before.clear();
      dataset.restore(data_before);
      optimizer_steps = optimizer_steps_before;
      scaler = scaler_before;
      reconfigure(d.config, step - 1);
      if (lead) std::printf("fault tolerance: step %lld dropped by every replica group (%s); it runs again over the live groups\n", static_cast<long long>(step), d.why.c_str());
      std::fflush(stdout);
      throw StepDropped{};
    }
    ft_next_config = d.config;
  }
  if (profiling) {
    const std::filesystem::path trace = profiler->stop(step, executor->spans());
    executor->set_record_spans(hooks.empty() ? false : true);
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
  const RunStats st = graph ? graph_stats : executor->stats();
  if (lead && spec.memory_budget > 0 && st.peak_bytes > spec.memory_budget && !over_budget_said) {
    over_budget_said = true;  // the budget bounds the planned peak; the allocator's may differ by a little (docs/memory.md, "A budget")
    std::printf("warning: step %lld held %lld bytes (%s) at its peak, %lld more than parallelism.memory_budget = %lld bytes; the budget bounds the "
                "planned peak (%lld bytes), which the allocator's count can pass by a little: lower the budget by the difference to keep under it\n",
                static_cast<long long>(step), static_cast<long long>(st.peak_bytes), human_bytes(static_cast<double>(st.peak_bytes)).c_str(),
                static_cast<long long>(st.peak_bytes - spec.memory_budget), static_cast<long long>(spec.memory_budget),
                static_cast<long long>(planned_peak));
  }
  if (!hooks.empty()) tell_hooks(hooks, step, spec, env, loss, st, names, state, out, state_placements, job.mesh, *executor);
  // Hot-swap at a step boundary: nothing is in flight between runs; the old backend leaves
  // the job, the other one joins it under the next generation's keys. Recorded on this step:
  // its metrics row says what was swapped to, and the line comes after its step line.
  const std::int64_t swap_every = spec.comm.swap_at_step;
  std::string swapped;  // "after step N: swapped ...", said after the step's row
  if (backend && swap_every > 0 && step % swap_every == 0 && step < spec.steps) {
    backend->barrier(0)->wait(timeout);
    backend->finalize();
    const std::int64_t generation = step / swap_every;
    const std::string& next = generation % 2 == 1 ? spec.comm.swap_to : spec.comm.backend;
    const std::string& previous = generation % 2 == 1 ? spec.comm.backend : spec.comm.swap_to;
    backend.reset();
    backend = join_backend(registry, next, *comm_spec, env, *store, generation);
    executor->set_backend(backend.get());
    if (validation != nullptr) validation->executor.set_backend(backend.get());
    const std::string now = (next == "auto" ? "auto -> " : "") + backend->describe();
    if (metrics) metrics->add_to_next_row("comm_swap", {{"from", previous}, {"to", next}, {"backend", now}, {"generation", generation}});
    if (lead && generation % std::max<std::int64_t>(1, log_freq) == 0) swapped = "after step " + std::to_string(step) + ": swapped the comm backend to " + now;
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
    // MoE load balance: each layer's most loaded expert against the mean (the slots of the step
    // over the experts), as torchtitan's MoE metrics; the worst layer on the step line.
    nlohmann::json layers = nlohmann::json::object();
    double worst = 0, most = 0, mean = 0;
    for (const auto& [name, t] : out) {
      if (!train::is_tokens_per_expert(name)) continue;
      const at::Tensor load = t.to(at::kCPU, at::kDouble);
      const double m = load.mean().item<double>(), x = load.max().item<double>();
      layers[models::layer_of(name)] = m > 0 ? x / m : 0.0;
      if (m > 0 && x / m > worst) worst = x / m;
      most = std::max(most, x), mean = m;
    }
    if (!layers.empty()) {
      metrics->add_to_next_row("moe_load_imbalance", worst);
      metrics->add_to_next_row("moe_load_max", most);
      metrics->add_to_next_row("moe_load_mean", mean);
      metrics->add_to_next_row("moe_load_layers", std::move(layers));
    }
    double trained_rows = static_cast<double>(spec.global_batch_size);
    if (ft != nullptr) {  // the rows of the groups away were not trained
      const auto live = static_cast<std::int64_t>(ft->config().groups.size());
      trained_rows = trained_rows * static_cast<double>(live) / static_cast<double>(ft->groups());
      metrics->add_to_next_row("replicas_live", live);
      metrics->add_to_next_row("replica_groups", ft->groups());
      std::vector<int> live_groups;  // which groups trained the step (their rows of the batch)
      for (const auto& g : ft->config().groups) live_groups.push_back(g.group);
      metrics->add_to_next_row("replicas", live_groups);
      metrics->add_to_next_row("samples", static_cast<std::int64_t>(trained_rows));
      if (drops > 0) metrics->add_to_next_row("dropped", drops);  // times the step was dropped and run again
    }
    if (balancer != nullptr) metrics->add_to_next_row("balance_rows", balancer->split());
    metrics->row(step, spec.steps, loss, out.at("grad_norm").item<double>(), lr, trained_rows * static_cast<double>(spec.seq_len) / st.total, st,
                 loss_scaling ? std::optional<std::pair<double, bool>>{{loss_scale, skipped}} : std::nullopt);
  }
  if (!swapped.empty()) std::printf("%s\n", swapped.c_str()), std::fflush(stdout);
  if (checkpointing && (step % spec.checkpoint.interval == 0 || step == spec.steps)) {
    CheckpointMeta meta{step, dataset.state().samples, tokenizer_id, optimizer_steps};
    if (loss_scaling) meta.loss_scale = scaler.scale, meta.growth_tracker = scaler.growth_tracker;
    meta.lr_schedule = spec.schedule;
    std::filesystem::path where;
    try {
      // Fault tolerance: the lowest live rank writes the metadata, and the first live group the
      // shards of the ranks away too (the same coordinates hold the same bytes in every group),
      // so a checkpoint is whole whether or not a lost group ever comes back.
      SaveRoles roles;
      if (ft != nullptr) {
        roles.writes_metadata = env.rank == ft->lead();
        if (ft->config().groups.front().group == env.rank / ft->ranks_per_group()) {
          for (int g = 0; g < ft->groups(); ++g) {
            if (!ft->config().has(g)) roles.also_ranks.push_back(g * ft->ranks_per_group() + env.rank % ft->ranks_per_group());
          }
        }
      } else {
        roles.writes_metadata = env.rank == 0;
      }
      where = save_checkpoint(ckpt_dir, meta, job.mesh, env.rank, state, state_metas, state_placements, backend.get(), *pipeline_stages, &roles);
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
  if (ft != nullptr && ft_next_config != ft->config().id) reconfigure(ft_next_config, step);
  if (balancer != nullptr && step < spec.steps) {
    // Every rank reaches this at every step; the balancer exchanges its rates at the same ones.
    std::string said;
    if (balancer->after_step(step, st.total - st.exposed_comm, st.total, &said)) {
      if (lead) std::printf("%s\n", said.c_str()), std::fflush(stdout);
      replan();
    }
    if (metrics && balancer->exchanged_after() == step) {  // what each re-plan saw, kept split or not: each data-parallel rank's ms a step, fixed and a row
      nlohmann::json costs = nlohmann::json::array();
      for (const RankCost& c : balancer->costs()) costs.push_back({{"fixed_ms", c.fixed * 1e3}, {"row_ms", c.per_row * 1e3}});
      metrics->add_to_next_row("balance_costs", std::move(costs));
    }
  }
  return loss;
}

void StepLoop::reconfigure(std::int64_t id, std::int64_t after_step) {
  executor->set_backend(nullptr);
  ft->watch(nullptr);
  if (backend) {
    backend->abort();  // what is still queued fails now
    backend.reset();
  }
  for (;;) {
    ft->adopt(id);
    if (lead && env.rank != ft->lead()) {  // the old lead closes its metrics before the new one opens them
      lead = false;
      if (on_lead_change) on_lead_change(false, 0);
    }
    std::string why;
    try {
      backend = ft->join();
      executor->set_backend(backend.get());
      ft->watch(backend.get());
      ft->transfer(*backend, state, names, after_step);
    } catch (const CommError& e) {
      why = e.what();
    }
    const FtDecision d = ft->vote_join(why);
    if (d.stop) throw std::runtime_error("fault tolerance: " + d.why + "; the job stops");
    if (d.commit && d.config == id) break;
    executor->set_backend(nullptr);
    ft->watch(nullptr);
    if (backend) backend->abort(), backend.reset();
    id = d.config;
  }
  const FtConfig& c = ft->config();
  if (!lead && env.rank == ft->lead()) {
    lead = true;
    if (on_lead_change) on_lead_change(true, c.progress.next_step);
  }
  say_configuration();
}

void StepLoop::say_configuration() {
  const FtConfig& c = ft->config();
  if (lead && static_cast<std::int64_t>(c.groups.size()) != replicas_said) {
    replicas_said = static_cast<std::int64_t>(c.groups.size());
    std::string joined;
    for (const auto& j : c.joiners) joined += (joined.empty() ? "" : ", ") + launch::ft::group_text(j.group, ft->ranks_per_group()) + " (restart " + std::to_string(j.attempt) + ")";
    std::printf("fault tolerance: from step %lld, %zu of %d replica groups train (%s)%s%s\n", static_cast<long long>(c.progress.next_step), c.groups.size(),
                ft->groups(), launch::ft::members_text(c.groups).c_str(), joined.empty() ? "" : "; given the live groups' state: ", joined.c_str());
    std::fflush(stdout);
  }
}

std::int64_t StepLoop::join_restarted() {
  lead = false;
  const std::int64_t id = ft->config().id;
  std::string why;
  try {
    ft->transfer(*backend, state, names, ft->config().progress.next_step - 1);
  } catch (const CommError& e) {
    why = e.what();
  }
  const FtDecision d = ft->vote_join(why);
  if (d.stop) throw std::runtime_error("fault tolerance: " + d.why + "; the job stops");
  if (!d.commit || d.config != id) {
    reconfigure(d.config, ft->config().progress.next_step - 1);
  } else if (env.rank == ft->lead()) {
    lead = true;
    if (on_lead_change) on_lead_change(true, ft->config().progress.next_step);
    say_configuration();  // the old lead, no longer one, does not
  }
  const FtProgress& p = ft->config().progress;
  dataset.restore(data::TextDatasetState{p.samples});
  optimizer_steps = p.optimizer_steps;
  if (loss_scaling && p.loss_scale > 0) scaler.scale = p.loss_scale, scaler.growth_tracker = p.growth_tracker;
  std::printf("%s (restart %d): given the live groups' state; trains from step %lld\n", launch::ft::group_text(ft->group(), ft->ranks_per_group()).c_str(),
              ft->attempt(), static_cast<long long>(p.next_step));
  std::fflush(stdout);
  return p.next_step;
}

void StepLoop::recover(std::int64_t step, const StepFailed& f) {
  const std::string why = f.voted ? f.what() : vote(*store, vote_key(step), env.rank, env.world_size, f.what(), timeout + 30);
  ++recoveries;
  executor->set_backend(nullptr);
  if (validation != nullptr) validation->executor.set_backend(nullptr);
  backend = chain->replace(std::move(backend), step, why);
  executor->set_backend(backend.get());
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

std::pair<double, double> StepLoop::run(std::int64_t first_step, bool serves_store) {
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
      } catch (const StepDropped&) {
        ++drops;
        continue;  // the same step, from the state before it, over the live groups
      }
      if (step == first_step) first_loss = loss;
      last_loss = loss;
      drops = 0;
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

}  // namespace spmdx::job
