// flight_recorder: the last N collectives of each rank in a ring buffer (op, group, sequence
// number, bytes, state, times), dumped to <dump>/hooks/flight_recorder/rank<R>.json when the
// rank fails (a collective fails or times out, an exception), on SIGTERM or SIGINT, and on
// SIGUSR1 (without stopping). `spmdx fr-trace <folder>` merges the dumps and names the rank
// missing from a collective, as PyTorch's NCCL Flight Recorder and its fr_trace tool do.
//
// Options ([hooks.flight_recorder]): size, entries kept per rank (default 2000);
// dump_at_end, also dump after the last step (default true: a rank that finished while others
// hang is then seen in the merge, with the collectives it did issue).
// A rank keeps its own dump of an earlier run whole as rank<R>.<N>.json (the next free N) when
// it starts, and rank 0 those of ranks beyond world_size, and each says so: a merge never mixes
// runs (fr-trace reads rank<R>.json alone), and the dumps of the failure a run resumes after,
// or of any run before, are never lost.
#include <deque>
#include <filesystem>
#include <cstdio>
#include <mutex>
#include <random>
#include <nlohmann/json.hpp>

#include "spmdx/core/log.h"
#include "spmdx/files.h"
#include "spmdx/options.h"
#include "spmdx/plugin.h"

namespace {

using nlohmann::json;

// The rank of a dump's file name, rank<R>.json exactly; -1 for any other (rank0.1.json is a dump
// kept aside, rank01.json none of ours).
int rank_of(const std::string& name) {
  if (name.size() < 10 || name.compare(0, 4, "rank") != 0 || name.compare(name.size() - 5, 5, ".json") != 0) return -1;
  const std::string digits = name.substr(4, name.size() - 9);
  if (digits.size() > 9 || (digits.size() > 1 && digits[0] == '0') || digits.find_first_not_of("0123456789") != std::string::npos) return -1;
  return std::stoi(digits);
}

class FlightRecorder final : public spmdx::Hook {
 public:
  explicit FlightRecorder(const spmdx::Options& options) {
    spmdx::OptionReader o("[hooks.flight_recorder]", options);
    size_ = static_cast<std::size_t>(o.get_int("size", 2000, 1, 10'000'000));
    dump_at_end_ = o.get_bool("dump_at_end", true);
    o.done();
  }

  void init(const spmdx::HookContext& context) override {
    context_ = context;
    if (context.compile_only) return;
    // The run's id, drawn by rank 0 and shared through the store: fr-trace refuses to merge the
    // dumps of different runs.
    const std::string key = "spmdx/hooks/flight_recorder/run";
    if (context.store == nullptr || context.rank == 0) {
      std::random_device rd;
      char id[17];
      std::snprintf(id, sizeof id, "%08x%08x", rd(), rd());
      run_ = id;
      if (context.store != nullptr) context.store->set(key, run_);
    } else {
      run_ = context.store->get(key, context.timeout_seconds);
    }
    retire(path_of(context.rank));
    if (context.rank != 0) return;
    std::error_code ec;
    for (const auto& f : std::filesystem::directory_iterator(context.output_dir, ec)) {
      if (rank_of(f.path().filename().string()) >= context.world_size) retire(f.path());
    }
  }

  void on_collective(const spmdx::CollectiveInfo& c) override {
    std::lock_guard lock(mutex_);
    if (c.state != spmdx::CollectiveState::issued) {
      // Completion: update the entry of this (group, seq), newest first. One that fell out of
      // the ring is older than all it keeps: dropped, so that the ring keeps the newest.
      for (auto it = entries_.rbegin(); it != entries_.rend(); ++it) {
        if (it->mesh_dim == c.mesh_dim && it->seq == c.seq) {
          *it = c;
          return;
        }
      }
      return;
    }
    entries_.push_back(c);
    if (entries_.size() > size_) entries_.pop_front();
  }

  void on_failure(const std::string& what) override { dump(what); }

  void finish() override {
    if (dump_at_end_) dump("end of run");
  }

 private:
  // A dump of an earlier run (the one whose failure this run resumes after, say): kept whole
  // under the next free name, out of the way of fr-trace's merge of this run's dumps.
  void retire(const std::filesystem::path& old) const {
    std::error_code ec;
    if (!std::filesystem::is_regular_file(std::filesystem::symlink_status(old, ec))) return;
    const std::filesystem::path aside = spmdx::move_aside(old);
    SPMDX_WARN("flight_recorder: " << old.string() << " holds the dump of an earlier run: it is kept whole as " << aside.string()
                                   << " (spmdx fr-trace merges rank<R>.json alone)");
  }

  std::filesystem::path path_of(int rank) const { return std::filesystem::path(context_.output_dir) / ("rank" + std::to_string(rank) + ".json"); }

  void dump(const std::string& reason) {
    std::lock_guard lock(mutex_);
    json mesh = json::array();
    for (const auto& d : context_.mesh) mesh.push_back({{"name", d.name}, {"size", d.size}});
    json entries = json::array();
    for (const auto& c : entries_) {
      entries.push_back({{"op", c.op},
                         {"mesh_dim", c.mesh_dim},
                         {"group_name", c.group_name},
                         {"group_ranks", c.group_ranks},
                         {"seq", c.seq},
                         {"step", c.step},
                         {"index", c.index},
                         {"bytes", c.bytes},
                         {"dtype", spmdx::to_string(c.dtype)},
                         {"shape", c.shape},
                         {"value", c.value},
                         {"state", spmdx::to_string(c.state)},
                         {"issued_at", c.issued_at},
                         {"started_at", c.started_at},
                         {"finished_at", c.finished_at},
                         {"error", c.error}});
    }
    const json doc{{"format", "spmdx-flight-recorder-1"}, {"run", run_}, {"rank", context_.rank}, {"world_size", context_.world_size}, {"size", size_},
                   {"mesh", mesh}, {"reason", reason}, {"entries", entries}};
    const auto path = path_of(context_.rank);
    spmdx::write_file_atomic(path, doc.dump(1) + "\n");
    if (reason == "end of run") return;  // quiet: nothing went wrong
    SPMDX_WARN("flight_recorder: rank " << context_.rank << " dumped its last " << entries_.size() << " collectives to " << path.string()
                                        << " (" << reason << "); merge the ranks' dumps with: spmdx fr-trace " << context_.output_dir);
  }

  std::string run_;
  std::size_t size_ = 2000;
  bool dump_at_end_ = false;
  spmdx::HookContext context_;
  std::mutex mutex_;
  std::deque<spmdx::CollectiveInfo> entries_;
};

void register_flight_recorder(spmdx::Registrar& r) {
  r.add_hook("flight_recorder", [](const spmdx::Options& o) { return std::make_unique<FlightRecorder>(o); });
}

}  // namespace

SPMDX_PLUGIN("flight_recorder", hook, "0.1.0", "Ring buffer of the last collectives per rank, dumped on failure; spmdx fr-trace merges the dumps",
             register_flight_recorder)
