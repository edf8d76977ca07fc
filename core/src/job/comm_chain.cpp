#include "spmdx/job/comm_chain.h"

#include <stdexcept>

#include "spmdx/comm/health.h"
#include "spmdx/comm/score_map.h"
#include "spmdx/job/preflight.h"
#include "spmdx/text.h"

namespace spmdx::job {

std::string vote(Store& store, const std::string& key, int rank, int world_size, const std::string& why_not, double timeout_seconds) {
  // The first "no" leaves its reason before its vote is counted; the last vote counted opens
  // the result, which the others wait for in the store (a blocking get: no polling, which on a
  // host with fewer cores than ranks would take cycles from ranks still computing their step).
  if (!why_not.empty() && store.add(key + "/no", 1) == 1) store.set(key + "/why", "rank " + std::to_string(rank) + ": " + why_not);
  store.add(key + "/r" + std::to_string(rank), 1);  // who voted, to name who did not
  if (store.add(key + "/voted", 1) == world_size) {
    // A "no" means the ranks go on past a failure (another backend, the step again): the rank
    // blamed for it is forgotten, so that a later failure is not blamed on it. Nobody runs a
    // collective while the others wait for this vote.
    if (store.add(key + "/no", 0) > 0) store.add(std::string(comm::kFaultKey) + "_reported", -store.add(std::string(comm::kFaultKey) + "_reported", 0));
    store.set(key + "/all", "1");
  } else {
    try {
      store.get(key + "/all", timeout_seconds);
    } catch (const CommError& e) {
      std::vector<int> missing;
      for (int r = 0; r < world_size && missing.size() < 16; ++r) {
        if (store.add(key + "/r" + std::to_string(r), 0) == 0) missing.push_back(r);
      }
      throw CommError((missing.empty() ? std::string("a rank") : rank_list(missing)) + " did not reach the vote '" + key + "' within " +
                          seconds_text(timeout_seconds) + " s (comm.timeout_seconds + 30): hung, or gone",
                      missing.empty() ? -1 : missing.front());
    }
  }
  if (store.add(key + "/no", 0) == 0) return "";
  return store.get(key + "/why", timeout_seconds);
}

std::unique_ptr<CommBackend> join_backend(PluginRegistry& registry, const std::string& backend_spec, const CommSpec& spec,
                                          const launch::RankEnv& env, Store& store, std::int64_t generation) {
  std::string choice;
  const PluginSpec* parsed = spec.find_parsed(backend_spec);  // JobSpec's, parsed once
  auto backend = parsed != nullptr ? comm::make_job_backend(registry, *parsed, backend_spec, spec.memory, true, &choice)  // ranks here are processes
                                   : comm::make_job_backend(registry, backend_spec, spec.memory, true, &choice);
  return join_backend(std::move(backend), choice, backend_spec, spec, env, store, generation);
}

std::unique_ptr<CommBackend> join_backend(std::unique_ptr<CommBackend> backend, const std::string& choice, const std::string& backend_spec,
                                          const CommSpec& spec, const launch::RankEnv& env, Store& store, std::int64_t generation) {
  const std::string key = "spmdx/comm_choice/g" + std::to_string(generation);
  if (env.rank == 0) store.set(key, choice);
  if (const std::string first = store.get(key, spec.timeout_seconds); first != choice) {
    throw std::invalid_argument("comm.backend = \"" + backend_spec + "\" made " + choice + " on rank " + std::to_string(env.rank) + " but " + first +
                                " on rank 0: every rank must find the same comm plugins (the same plugins.paths and SPMDX_PLUGIN_PATH)");
  }
  try {
    backend->init({env.rank, env.world_size, generation, &store, spec.timeout_seconds});
  } catch (const CommError& e) {
    if (e.peer() >= 0 && e.peer() != env.rank) {
      try {
        if (store.add(std::string(comm::kFaultKey) + "_reported", 1) == 1) store.set(comm::kFaultKey, std::to_string(e.peer()));
      } catch (const std::exception&) {
      }
    }
    throw;
  }
  return backend;
}

std::string FallbackEvent::str() const {
  const std::string when = step > 0 ? "at step " + std::to_string(step) : "at start";
  if (what == "strategies") return "strategies " + from + " passed over " + when + " (" + reason + "); " + (to.empty() ? "none left" : "using " + to);
  if (from == to) return "comm backend \"" + from + "\" failed " + when + " (" + reason + "); rejoined it and ran the step again";
  return "comm backend \"" + from + "\" " + (step > 0 ? "failed " : "passed over ") + when + " (" + reason + "); " +
         (to.empty() ? "no backend left" : "using \"" + to + "\"" + (step > 0 ? " and ran the step again" : ""));
}

std::unique_ptr<CommBackend> CommChain::join_from(std::size_t from, std::int64_t step) {
  for (std::size_t i = from; i < spec_.chain.size(); ++i) {
    const std::int64_t generation = joins_++ == 0 ? 0 : kFirstFallbackGeneration + joins_;
    std::unique_ptr<CommBackend> backend;
    std::string why_not;
    try {
      // What the launcher checks before start (capabilities, memory, in-process-only plugins),
      // then the join itself.
      const bool cuda = !spec_.memory.empty() && spec_.memory.front() == MemoryType::cuda;
      std::unique_ptr<CommBackend> made;  // made once: checked, then joined
      std::string choice;
      if (const std::string problem = comm_backend_problem(registry_, spec_.chain[i], cuda ? "cuda" : "cpu", &made, &choice, spec_.find_parsed(spec_.chain[i])); !problem.empty()) {
        why_not = "\"" + spec_.chain[i] + "\"" + problem;
      } else {
        backend = join_backend(std::move(made), choice, spec_.chain[i], spec_, env_, store_, generation);
      }
    } catch (const std::exception& e) {
      why_not = e.what();
    }
    // Every rank must have it: one that started here is given up when another rank could not.
    const std::string verdict = vote(store_, "spmdx/comm_chain/g" + std::to_string(generation), env_.rank, env_.world_size, why_not,
                                     spec_.timeout_seconds + 30);
    if (verdict.empty()) {
      if (i != current_) failures_.clear();  // a rejoined backend keeps its count
      current_ = i;
      return backend;
    }
    if (backend) {
      backend->abort();
      backend.reset();
    }
    events_.push_back({"comm", spec_.chain[i], i + 1 < spec_.chain.size() ? spec_.chain[i + 1] : "", verdict, step});
  }
  std::string tried;
  for (const auto& e : events_) tried += "\n  " + e.str();
  throw std::runtime_error("no comm backend of comm.backend and comm.fallback could serve the job:" + tried);
}

std::unique_ptr<CommBackend> CommChain::join_at_start() {
  if (spec_.chain.size() == 1) {  // no fallback: the backend's own errors, as they are
    ++joins_;
    return join_backend(registry_, spec_.chain.front(), spec_, env_, store_, 0);
  }
  return join_from(0, 0);
}

std::unique_ptr<CommBackend> CommChain::replace(std::unique_ptr<CommBackend> failed, std::int64_t step, const std::string& reason) {
  if (failed) {
    failed->abort();  // what is still queued fails now; the comm thread ends with the backend
    failed.reset();
  }
  failures_.push_back(step);
  while (!failures_.empty() && failures_.front() <= step - spec_.failure_window) failures_.pop_front();
  const bool next = static_cast<std::int64_t>(failures_.size()) >= spec_.max_failures;
  const std::size_t from = current_;
  if (next && from + 1 >= spec_.chain.size()) {
    events_.push_back({"comm", spec_.chain[from], "", reason, step});
    throw std::runtime_error("step " + std::to_string(step) + ": comm backend \"" + spec_.chain[from] + "\" failed " + std::to_string(failures_.size()) +
                             " time" + (failures_.size() == 1 ? "" : "s") + " within " + std::to_string(spec_.failure_window) +
                             " steps (comm.max_failures " + std::to_string(spec_.max_failures) + ") and comm.fallback has no backend after it: " + reason);
  }
  const std::size_t to = next ? from + 1 : from;
  const std::size_t at = events_.size();
  auto backend = join_from(to, step);  // a next one that cannot start either is passed over with an event of its own
  events_.insert(events_.begin() + static_cast<std::ptrdiff_t>(at), {"comm", spec_.chain[from], spec_.chain[current_], reason, step});
  return backend;
}

}  // namespace spmdx::job
