#include "spmdx/comm/score_map.h"

#include <algorithm>
#include <set>
#include <stdexcept>

#include "spmdx/comm/all_to_all_v.h"
#include "spmdx/core/log.h"
#include "spmdx/core/registry.h"
#include "spmdx/text.h"

namespace spmdx::comm {
namespace {

const char* memory_name(MemoryType m) { return m == MemoryType::cuda ? "cuda" : "host"; }

// Member i's store generation: above 2^40, where no plain backend's generation (0, then +1 per
// hot-swap) reaches, and apart for each member and each generation of the scored backend.
std::int64_t member_generation(std::int64_t generation, std::size_t i) {
  return (static_cast<std::int64_t>(i + 1) << 40) + generation;
}

// Also StreamOrdered for its members that are: a call in device memory goes to a member that
// orders itself after the compute stream, or fails (the host would otherwise read its output
// before it is there). And VariableAllToAll, failing naming the member chosen when it lacks it.
class ScoredBackend final : public CommBackend, public StreamOrdered, public VariableAllToAll {
 public:
  explicit ScoredBackend(std::vector<std::pair<std::string, std::unique_ptr<CommBackend>>> members) : members_(std::move(members)) {
    for (const auto& m : members_) capabilities_.push_back(m.second->capabilities());
  }
  ~ScoredBackend() override { finalize(); }

  void init(const CommInit& init) override {
    for (std::size_t i = 0; i < members_.size(); ++i) {
      CommInit mine = init;
      mine.generation = member_generation(init.generation, i);
      members_[i].second->init(mine);
    }
    groups_.assign(1, std::vector<int>(members_.size(), 0));  // group 0: every rank, in each member
  }
  void finalize() override {
    for (auto& m : members_) m.second->finalize();
  }
  void abort() noexcept override {
    for (auto& m : members_) m.second->abort();
  }
  std::string describe() const override {
    std::vector<std::string> parts;
    for (const auto& m : members_) parts.push_back(m.second->describe());
    return "scored: " + join(parts, " | ");
  }
  const std::vector<std::vector<CommCapability>>& member_capabilities() const { return capabilities_; }
  std::vector<CommCapability> capabilities() const override {
    std::vector<CommCapability> out;
    for (const auto& c : capabilities_) out.insert(out.end(), c.begin(), c.end());
    return out;
  }
  int new_group(const std::vector<int>& ranks) override {
    std::vector<int> ids;
    for (auto& m : members_) ids.push_back(m.second->new_group(ranks));
    groups_.push_back(std::move(ids));
    return static_cast<int>(groups_.size() - 1);
  }

  std::unique_ptr<Work> all_reduce(int group, CommBuffer buf, ReduceOp op) override {
    const std::size_t i = pick("all_reduce", buf.memory, buf.bytes());
    return members_[i].second->all_reduce(id(group, i), buf, op);
  }
  std::unique_ptr<Work> all_gather(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> counts) override {
    const std::size_t i = pick("all_gather", out.memory, out.bytes());
    return members_[i].second->all_gather(id(group, i), in, out, std::move(counts));
  }
  std::unique_ptr<Work> reduce_scatter(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> counts, ReduceOp op) override {
    const std::size_t i = pick("reduce_scatter", in.memory, in.bytes());
    return members_[i].second->reduce_scatter(id(group, i), in, out, std::move(counts), op);
  }
  std::unique_ptr<Work> all_to_all(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> send_counts,
                                   std::vector<std::size_t> recv_counts) override {
    const std::size_t i = pick("all_to_all", in.memory, 0);
    return members_[i].second->all_to_all(id(group, i), in, out, std::move(send_counts), std::move(recv_counts));
  }
  std::unique_ptr<Work> all_to_all_v(int group, CommBuffer in, CommBuffer out, std::vector<std::size_t> send_counts,
                                     std::size_t* recv_counts) override {
    const std::size_t i = pick("all_to_all_v", in.memory, 0);
    return comm::all_to_all_v(*members_[i].second, id(group, i), in, out, std::move(send_counts), recv_counts);
  }
  std::unique_ptr<Work> broadcast(int group, CommBuffer buf, int root_member) override {
    const std::size_t i = pick("broadcast", buf.memory, buf.bytes());
    return members_[i].second->broadcast(id(group, i), buf, root_member);
  }
  std::unique_ptr<Work> send(CommBuffer buf, int peer_rank, int tag) override {
    return members_[pick("send", buf.memory, buf.bytes())].second->send(buf, peer_rank, tag);
  }
  std::unique_ptr<Work> recv(CommBuffer buf, int peer_rank, int tag) override {
    return members_[pick("recv", buf.memory, buf.bytes())].second->recv(buf, peer_rank, tag);
  }
  std::unique_ptr<Work> barrier(int group) override {
    const std::size_t i = pick("barrier", MemoryType::host, 0);
    return members_[i].second->barrier(id(group, i));
  }

  void issue_after(void* stream) override {
    for (auto& m : members_) {
      if (auto* ordered = dynamic_cast<StreamOrdered*>(m.second.get())) ordered->issue_after(stream);
    }
  }
  bool stream_wait(Work& work, void* stream) override {
    for (auto& m : members_) {
      if (auto* ordered = dynamic_cast<StreamOrdered*>(m.second.get()); ordered != nullptr && ordered->stream_wait(work, stream)) return true;
    }
    return false;
  }

 private:
  std::size_t pick(const char* op, MemoryType memory, std::size_t bytes) const {
    const int i = choose_backend(capabilities_, op, memory, bytes);
    if (i < 0) {
      throw std::invalid_argument(std::string("comm: no backend of ") + describe() + " serves " + op + " of " + std::to_string(bytes) + " bytes in " +
                                  memory_name(memory) + " memory (see `spmdx plugins --json` for their capabilities)");
    }
    const auto& member = members_[static_cast<std::size_t>(i)];
    if (memory == MemoryType::cuda && dynamic_cast<StreamOrdered*>(member.second.get()) == nullptr) {
      throw std::invalid_argument("comm: " + member.first + " would run " + op + " on CUDA memory inside comm.backend = \"auto\", but it does not order its " +
                                  "calls with the GPU's streams (StreamOrdered, comm.h): pin comm.backend = \"" + member.first + "\" or use nccl");
    }
    return static_cast<std::size_t>(i);
  }
  int id(int group, std::size_t member) const {
    if (group < 0 || group >= static_cast<int>(groups_.size())) throw std::invalid_argument("comm: no group " + std::to_string(group));
    return groups_[static_cast<std::size_t>(group)][member];
  }

  std::vector<std::pair<std::string, std::unique_ptr<CommBackend>>> members_;
  std::vector<std::vector<CommCapability>> capabilities_;
  std::vector<std::vector<int>> groups_;  // our group id -> each member's
};

// Whether member `i` wins some (operation, memory, size) against the others: sizes are tried at
// every capability's bounds, where scores can change.
bool wins_somewhere(const std::vector<std::vector<CommCapability>>& caps, std::size_t i, const std::vector<MemoryType>& memory) {
  std::set<std::size_t> sizes{0};
  for (const auto& list : caps) {
    for (const auto& c : list) {
      sizes.insert(c.min_bytes);
      sizes.insert(c.max_bytes);
    }
  }
  for (const auto& op : comm_operations()) {
    for (MemoryType m : memory) {
      for (std::size_t bytes : sizes) {
        if (choose_backend(caps, op, m, bytes) == static_cast<int>(i)) return true;
      }
    }
  }
  return false;
}

}  // namespace

std::vector<MemoryType> job_memory(const std::string& device) {
  if (device == "cuda") return {MemoryType::cuda, MemoryType::host};
  return {MemoryType::host};
}

const std::vector<std::string>& comm_operations() {
  static const std::vector<std::string> ops{"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_to_all_v", "broadcast", "send", "recv", "barrier"};
  return ops;
}

std::string capability_problem(const std::vector<CommCapability>& capabilities) {
  if (capabilities.empty()) return "it declares no capabilities (CommCapability: operation, memory, sizes, score), so it serves nothing";
  const auto& ops = comm_operations();
  for (std::size_t i = 0; i < capabilities.size(); ++i) {
    const CommCapability& c = capabilities[i];
    const std::string which = "capability " + std::to_string(i) + " (" + c.op + ", " + memory_name(c.memory) + ")";
    if (c.op != "*" && std::find(ops.begin(), ops.end(), c.op) == ops.end()) {
      const std::string near = nearest_word(c.op, ops, 3);
      return which + " names operation '" + c.op + "', which is neither \"*\" nor one of " + join(ops) +
             (near.empty() ? std::string("") : " (did you mean " + near + "?)");
    }
    if (c.min_bytes > c.max_bytes) {
      return which + " covers no size: min_bytes " + std::to_string(c.min_bytes) + " is above max_bytes " + std::to_string(c.max_bytes);
    }
    if (c.score < 0) return which + " has a negative score " + std::to_string(c.score) + " (scores are 0 or more; higher wins)";
  }
  return "";
}

int choose_backend(const std::vector<std::vector<CommCapability>>& capabilities, const std::string& op, MemoryType memory, std::size_t bytes) {
  int best = -1;
  int best_score = 0;
  for (std::size_t i = 0; i < capabilities.size(); ++i) {
    for (const auto& c : capabilities[i]) {
      const bool covers = (c.op == "*" || c.op == op) && c.memory == memory && c.min_bytes <= bytes && bytes <= c.max_bytes;
      if (covers && (best < 0 || c.score > best_score)) {
        best = static_cast<int>(i);
        best_score = c.score;
      }
    }
  }
  return best;
}

std::unique_ptr<CommBackend> make_scored_backend(std::vector<std::pair<std::string, std::unique_ptr<CommBackend>>> members) {
  return std::make_unique<ScoredBackend>(std::move(members));
}

std::vector<std::vector<CommCapability>> member_capabilities(const CommBackend& backend) {
  if (const auto* scored = dynamic_cast<const ScoredBackend*>(&backend)) return scored->member_capabilities();
  return {backend.capabilities()};
}

std::vector<Candidate> auto_candidates(PluginRegistry& registry, const std::vector<MemoryType>& memory, bool processes) {
  std::vector<Candidate> out;
  for (const auto& plugin : registry.plugins()) {
    if (plugin.kind != PluginKind::comm) continue;
    try {
      registry.load(plugin.name);
    } catch (const std::exception& e) {
      out.push_back({plugin.name, nullptr, e.what()});
      continue;
    }
    const PluginInfo& loaded = *registry.find(plugin.name);
    for (const auto& name : loaded.factories) {
      Candidate c{name, nullptr, ""};
      if (processes && (loaded.flags & kPluginInProcessOnly) != 0) {
        c.why_not = "in-process only (ranks here are processes)";
      } else {
        try {
          c.backend = registry.make_comm_backend(name);
        } catch (const std::exception& e) {
          c.why_not = e.what();
        }
      }
      if (c.backend) {
        if (const std::string problem = capability_problem(c.backend->capabilities()); !problem.empty()) {
          c.backend.reset();
          c.why_not = "malformed capabilities: " + problem;
        }
      }
      if (c.backend) {
        bool moves = false;
        for (const auto& cap : c.backend->capabilities()) moves = moves || std::find(memory.begin(), memory.end(), cap.memory) != memory.end();
        if (!moves) {
          c.backend.reset();
          c.why_not = std::string("moves no ") + memory_name(memory.front()) + " memory";
        }
      }
      out.push_back(std::move(c));
    }
  }
  // Equal scores go to the first listed: the first by name, whatever the search order found.
  std::stable_sort(out.begin(), out.end(), [](const Candidate& a, const Candidate& b) { return a.name < b.name; });
  // Keep those that win somewhere against the others kept.
  std::vector<std::vector<CommCapability>> caps;
  std::vector<std::size_t> index;
  for (std::size_t i = 0; i < out.size(); ++i) {
    if (!out[i].backend) continue;
    caps.push_back(out[i].backend->capabilities());
    index.push_back(i);
  }
  for (std::size_t k = 0; k < index.size(); ++k) {
    if (wins_somewhere(caps, k, memory)) continue;
    out[index[k]].backend.reset();
    out[index[k]].why_not = "never chosen: for every operation and size another backend scores higher (or as high, with a name first in order)";
  }
  return out;
}

std::unique_ptr<CommBackend> make_job_backend(PluginRegistry& registry, const std::string& spec, const std::vector<MemoryType>& memory,
                                              bool processes, std::string* choice) {
  if (spec.rfind("auto:", 0) == 0) {
    throw std::invalid_argument("\"auto\" takes no options (it makes each backend with its defaults); to give options, "
                                "pin a backend, e.g. \"ucx:" + spec.substr(5) + "\"");
  }
  return make_job_backend(registry, parse_plugin_spec(spec, "comm backend"), spec, memory, processes, choice);
}

std::unique_ptr<CommBackend> make_job_backend(PluginRegistry& registry, const PluginSpec& parsed, const std::string& text, const std::vector<MemoryType>& memory,
                                              bool processes, std::string* choice) {
  if (parsed.name == "auto" && !parsed.options.empty()) {
    throw std::invalid_argument("\"auto\" takes no options (it makes each backend with its defaults); to give options, "
                                "pin a backend, e.g. \"ucx:" + text.substr(text.find(':') + 1) + "\"");
  }
  if (parsed.name != "auto") {
    if (choice != nullptr) *choice = text;
    return registry.make_comm_backend(parsed.name, parsed.options);
  }
  std::vector<Candidate> candidates = auto_candidates(registry, memory, processes);
  // A plugin whose table is broken would never be chosen, silently: it is refused instead.
  for (const auto& c : candidates) {
    if (c.why_not.rfind("malformed capabilities: ", 0) == 0) {
      throw std::invalid_argument("comm backend '" + c.name + "' has " + c.why_not + "; fix the plugin or remove it from the plugin path");
    }
  }
  std::vector<std::pair<std::string, std::unique_ptr<CommBackend>>> kept;
  std::vector<std::string> left_out;
  for (auto& c : candidates) {
    if (c.backend) {
      kept.emplace_back(c.name, std::move(c.backend));
    } else {
      left_out.push_back(c.name + " (" + c.why_not + ")");
    }
  }
  if (kept.empty()) {
    throw std::invalid_argument(std::string("comm.backend = \"auto\" found no comm backend that moves ") + memory_name(memory.front()) +
                                " memory between ranks" + (left_out.empty() ? std::string(": no comm plugin was found") : "; left out: " + join(left_out)) +
                                ". Install or build one (ucx), or name one in comm.backend");
  }
  std::vector<std::string> names;
  for (const auto& k : kept) names.push_back(k.first);
  SPMDX_DEBUG("comm.backend = auto: " << join(names) << (left_out.empty() ? "" : "; left out: " + join(left_out)));
  if (choice != nullptr) *choice = "auto: " + join(names);
  if (kept.size() == 1) return std::move(kept.front().second);
  return make_scored_backend(std::move(kept));
}

}  // namespace spmdx::comm
