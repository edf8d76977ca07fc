#include "spmdx/job/fault_injection.h"

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <thread>
#include <unistd.h>
#include <sstream>
#include <stdexcept>

#include "spmdx/text.h"
#include "spmdx/train/train_step.h"

namespace spmdx::job {
using namespace spmdx::train;

namespace {

constexpr const char* kForms =
    "skip_collective:rank=R,step=S,index=I, perturb:rank=R,step=S,tensor=NAME[,delta=D], or kill|stop|slow|hold:rank=R,step=S[,at=start|collective|commit|recovery]"
    "[,index=I][,seconds=X], slow:rank=R,factor=F[,step=S] (every compute op F times as long from step S), slow:rank=R,at=restart[,seconds=X] "
    "or hold:rank=R,step=S,at=restart; several separated by ';'";

// One fault of the list: its kind and its key=value pairs, checked for form.
struct Item {
  std::string kind;
  std::vector<std::pair<std::string, std::string>> pairs;
};

std::vector<Item> split_faults(const std::string& spec) {
  std::vector<Item> out;
  std::stringstream faults(spec);
  std::string one;
  while (std::getline(faults, one, ';')) {
    if (one.empty()) continue;
    auto bad = [&](const std::string& why) { return std::invalid_argument("SPMDX_FAULT='" + spec + "': " + why + " (expected " + kForms + ")"); };
    Item it;
    const auto colon = one.find(':');
    it.kind = one.substr(0, colon);
    if (it.kind != "skip_collective" && it.kind != "perturb" && it.kind != "kill" && it.kind != "stop" && it.kind != "slow" && it.kind != "hold") {
      throw bad("unknown fault '" + it.kind + "'");
    }
    std::stringstream list(colon == std::string::npos ? "" : one.substr(colon + 1));
    std::string item;
    while (std::getline(list, item, ',')) {
      const auto eq = item.find('=');
      if (eq == std::string::npos) throw bad("'" + item + "' is not key=value");
      const std::string key = item.substr(0, eq);
      for (const auto& [k, v] : it.pairs) {
        if (k == key) throw bad("'" + key + "' given twice in '" + one + "'");
      }
      it.pairs.emplace_back(key, item.substr(eq + 1));
    }
    out.push_back(std::move(it));
  }
  return out;
}

std::int64_t whole(const std::string& spec, const std::string& key, const std::string& value) {
  std::size_t used = 0;
  long long x = 0;
  try {
    x = std::stoll(value, &used);
  } catch (const std::logic_error&) {
    used = 0;
  }
  if (used == 0 || used != value.size() || x < 0) {
    // A step is counted from 1, as the step lines count them (step=0 is refused likewise, below).
    throw std::invalid_argument("SPMDX_FAULT='" + spec + "': " + key + "='" + value + "' is not a whole number >= " + (key == "step" ? "1" : "0") +
                                " (expected " + kForms + ")");
  }
  return static_cast<std::int64_t>(x);
}

double number(const std::string& spec, const std::string& key, const std::string& value) {
  try {
    std::size_t used = 0;
    const double x = std::stod(value, &used);
    if (used == value.size()) return x;
  } catch (const std::logic_error&) {
  }
  throw std::invalid_argument("SPMDX_FAULT='" + spec + "': " + key + "='" + value + "' is not a number");
}

}  // namespace

Fault parse_fault(const char* text) {
  Fault f;
  if (text == nullptr || *text == '\0') return f;
  const std::string spec(text);
  (void)parse_process_faults(text);  // every fault of the list is checked, whichever part reads it
  for (const Item& it : split_faults(spec)) {
    if (it.kind != "skip_collective" && it.kind != "perturb") continue;
    if (!f.kind.empty()) throw std::invalid_argument("SPMDX_FAULT='" + spec + "': one skip_collective or perturb fault at a time");
    auto bad = [&](const std::string& why) { return std::invalid_argument("SPMDX_FAULT='" + spec + "': " + why + " (expected " + kForms + ")"); };
    f.kind = it.kind;
    for (const auto& [key, value] : it.pairs) {
      if (key == "rank") f.rank = static_cast<int>(whole(spec, key, value));
      else if (key == "step") f.step = whole(spec, key, value);
      else if (key == "index") f.index = whole(spec, key, value);
      else if (key == "tensor") f.tensor = value;
      else if (key == "delta") f.delta = number(spec, key, value);
      else throw bad("unknown key '" + key + "'");
    }
    if (f.rank < 0 || f.step < 1) throw bad("rank=R and step=S (S >= 1) are required");
    if (f.kind == "perturb" && f.tensor.empty()) throw bad("perturb needs tensor=NAME");
  }
  return f;
}

std::vector<ProcessFault> parse_process_faults(const char* text) {
  std::vector<ProcessFault> out;
  if (text == nullptr || *text == '\0') return out;
  const std::string spec(text);
  for (const Item& it : split_faults(spec)) {
    if (it.kind != "kill" && it.kind != "stop" && it.kind != "slow" && it.kind != "hold") continue;
    auto bad = [&](const std::string& why) { return std::invalid_argument("SPMDX_FAULT='" + spec + "': " + why + " (expected " + kForms + ")"); };
    ProcessFault f;
    f.kind = it.kind;
    bool index_set = false, seconds_set = false, at_set = false, factor_set = false;
    for (const auto& [key, value] : it.pairs) {
      if (key == "rank") f.rank = static_cast<int>(whole(spec, key, value));
      else if (key == "step") f.step = whole(spec, key, value);
      else if (key == "index") f.index = whole(spec, key, value), index_set = true;
      else if (key == "at") f.at = value, at_set = true;
      else if (key == "seconds" && f.kind == "slow") f.seconds = number(spec, key, value), seconds_set = true;
      else if (key == "factor" && f.kind == "slow") {
        if (value.empty() || value.find_first_not_of("0123456789.") != std::string::npos) throw bad("factor='" + value + "' is not a decimal number");
        f.factor = number(spec, key, value), factor_set = true;
      }
      else throw bad("unknown key '" + key + "' for " + f.kind);
    }
    if (factor_set) {  // a slower device: every compute op, from step S on
      if (!(f.factor > 1 && f.factor <= 100)) throw bad("factor must be more than 1 and at most 100 (the rank's compute takes F times as long)");
      if (seconds_set || at_set || index_set) throw bad("slow with factor=F takes rank=R and step=S only (no seconds, at or index): it slows every compute op from step S on");
      if (f.step == -1) f.step = 1;
    }
    if (f.at == "restart") {  // a restarted process, slow to come up
      if (f.kind != "slow" && f.kind != "hold") {
        throw bad("at=restart goes with slow (sleep seconds=X) or hold (until step=S is committed) before a restarted rank asks to join");
      }
      if (f.kind == "slow" && f.step != -1) throw bad("slow at=restart takes no step=S: the restarted rank sleeps seconds=X before it asks to join");
      if (f.kind == "slow") f.step = 0;
    }
    if (f.rank < 0 || f.step < 0 || (f.step < 1 && f.at != "restart")) throw bad("rank=R and step=S (S >= 1) are required");
    if (f.at != "start" && f.at != "collective" && f.at != "commit" && f.at != "recovery" && f.at != "restart") {
      throw bad("at='" + f.at + "' is not start, collective, commit, recovery or restart");
    }
    if (index_set && f.at != "collective" && f.at != "recovery") throw bad("index=I goes with at=collective or at=recovery");
    if (!(f.seconds >= 0 && f.seconds <= 3600)) throw bad("seconds must be 0 to 3600");
    if (f.kind == "hold" && f.at != "start" && f.at != "commit" && f.at != "restart") throw bad("hold waits at=start, at=commit or at=restart");
    for (const auto& o : out) {
      if (o.factor > 0 && f.factor > 0 && o.rank == f.rank) throw bad("rank " + std::to_string(f.rank) + " is given two slow factors: one a rank");
      if (o.kind == f.kind && o.rank == f.rank && o.step == f.step && o.at == f.at && o.index == f.index) {
        throw bad("the same " + f.kind + " fault of rank " + std::to_string(f.rank) + " is listed twice (each fires once a job)");
      }
    }
    f.id = static_cast<int>(out.size());
    out.push_back(f);
  }
  return out;
}

double compute_slowdown(const std::vector<ProcessFault>& faults, int rank, std::int64_t step) {
  for (const auto& f : faults) {
    if (f.factor > 0 && f.rank == rank && f.step <= step) return f.factor;
  }
  return 1;
}

const ProcessFault* due_fault(const std::vector<ProcessFault>& faults, int rank, std::int64_t step, const std::string& at, std::int64_t index) {
  for (const auto& f : faults) {
    if (f.factor > 0) continue;  // compute_slowdown's
    if (f.rank == rank && f.step == step && f.at == at && ((at != "collective" && at != "recovery") || f.index == index)) return &f;
  }
  return nullptr;
}

void fire(const ProcessFault& f) {
  const std::string where = f.at == "collective" ? "as it issues backend call " + std::to_string(f.index) + " of step " + std::to_string(f.step)
                            : f.at == "recovery" ? "after " + std::to_string(f.index) + " tensors of the state transfer after step " + std::to_string(f.step)
                            : f.at == "restart"  ? "at its restart, before it asks to join"
                                                 : "at " + f.at + " of step " + std::to_string(f.step);
  char sleeps[64];
  std::snprintf(sleeps, sizeof sleeps, "sleeps %g s", f.seconds);
  std::fprintf(stderr, "SPMDX_FAULT: rank %d %s %s\n", f.rank,
               f.kind == "kill" ? "kills itself (SIGKILL)" : f.kind == "stop" ? "stops itself (SIGSTOP)" : sleeps,
               where.c_str());
  std::fflush(stderr);
  if (f.kind == "kill") ::kill(::getpid(), SIGKILL);
  else if (f.kind == "stop") ::kill(::getpid(), SIGSTOP);
  else std::this_thread::sleep_for(std::chrono::duration<double>(f.seconds));
}

void check_fault(const Fault& fault, const launch::RankEnv& env, const JobSpec& spec, const PlacedJob& job) {
  if (fault.kind.empty()) return;
  const auto state_names = train::step_state_names(job.model.graph, job.model.params);
  if (fault.rank >= env.world_size || fault.step > spec.steps) {
    throw std::invalid_argument("SPMDX_FAULT: rank " + std::to_string(fault.rank) + ", step " + std::to_string(fault.step) +
                                " never happens in this job (" + std::to_string(env.world_size) + " ranks, " + std::to_string(spec.steps) + " steps)");
  }
  if (fault.kind == "perturb" && std::find(state_names.begin(), state_names.end(), fault.tensor) == state_names.end()) {
    throw std::invalid_argument("SPMDX_FAULT: no tensor '" + fault.tensor + "' in the train state; it has " + join(state_names));
  }
}

void check_process_faults(const std::vector<ProcessFault>& faults, const launch::RankEnv& env, const JobSpec& spec) {
  for (const auto& f : faults) {
    if (f.rank >= env.world_size || f.step > spec.steps) {
      throw std::invalid_argument("SPMDX_FAULT: " + f.kind + " at rank " + std::to_string(f.rank) + ", step " + std::to_string(f.step) +
                                  " never happens in this job (" + std::to_string(env.world_size) + " ranks, " + std::to_string(spec.steps) + " steps)");
    }
    if ((f.at == "recovery" || f.at == "collective" || f.at == "restart" || f.kind == "hold") && !spec.fault_tolerance.enable) {
      throw std::invalid_argument("SPMDX_FAULT: " + f.kind + " at=" + f.at + " acts under fault tolerance: set fault_tolerance.enable = true");
    }
  }
}

}  // namespace spmdx::job
