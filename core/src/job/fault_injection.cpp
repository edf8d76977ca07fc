#include "spmdx/job/fault_injection.h"

#include <algorithm>
#include <sstream>
#include <stdexcept>

#include "spmdx/text.h"
#include "spmdx/train/train_step.h"

namespace spmdx::job {
using namespace spmdx::train;

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

}  // namespace spmdx::job
