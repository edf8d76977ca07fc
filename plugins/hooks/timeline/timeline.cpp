// timeline: Chrome trace / Perfetto JSON (the Trace Event Format's complete "X" events) of the
// recorded steps, per rank and merged: one process per rank, a "compute" thread with every
// kernel and every wait for a collective, a "comm" thread with the backend's collective spans,
// and per step the overlap ratio (hidden / total communication). Open in ui.perfetto.dev or
// chrome://tracing.
//
// Options ([hooks.timeline]): start_step, the first step recorded (default 1); steps, how
// many (default 5).
// Output: <dump>/hooks/timeline/rank<R>.json, and on rank 0 merged.json (every rank's file
// that exists once all ranks wrote theirs) and summary.json (per rank and step: step, comm and
// exposed comm in ms, overlap ratio). A run resumed from a checkpoint in the same folder keeps
// what the runs before recorded for the steps before its first. Nothing an earlier run wrote is
// lost: a file this run would replace or cut (a run from step 1, steps past the checkpoint, a
// trace it cannot read) is first kept whole as <name>.<N>.json, the next free N, and said.
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "spmdx/core/log.h"
#include "spmdx/files.h"
#include "spmdx/options.h"
#include "spmdx/plugin.h"
#include "spmdx/text.h"

namespace {

using nlohmann::json;
namespace fs = std::filesystem;

class Timeline final : public spmdx::Hook {
 public:
  explicit Timeline(const spmdx::Options& options) {
    spmdx::OptionReader o("[hooks.timeline]", options);
    start_ = o.get_int("start_step", 1, 1, 1'000'000'000);
    steps_ = o.get_int("steps", 5, 1, 10'000);
    o.done();
  }

  void init(const spmdx::HookContext& context) override {
    context_ = context;
    const int pid = context.rank;
    events_.push_back({{"ph", "M"}, {"name", "process_name"}, {"pid", pid}, {"args", {{"name", "rank " + std::to_string(pid)}}}});
    events_.push_back({{"ph", "M"}, {"name", "process_sort_index"}, {"pid", pid}, {"args", {{"sort_index", pid}}}});
    const char* threads[] = {"compute", "comm"};
    for (int t = 0; t < 2; ++t) {
      events_.push_back({{"ph", "M"}, {"name", "thread_name"}, {"pid", pid}, {"tid", t}, {"args", {{"name", threads[t]}}}});
    }
    if (context.compile_only) return;
    keep_earlier_trace();
    if (context.rank == 0) keep_earlier_merge();
  }

  void on_step_end(const spmdx::StepInfo& step) override {
    if (step.step < start_ || step.step >= start_ + steps_) return;
    std::lock_guard lock(mutex_);
    const int pid = context_.rank;
    auto us = [](double seconds) { return seconds * 1e6; };
    double first = 1e300, last = 0;
    for (const auto& s : step.spans) {
      first = std::min(first, s.start);
      last = std::max(last, s.end);
      json args{{"step", step.step}};
      if (s.bytes > 0) args["bytes"] = s.bytes;
      events_.push_back({{"ph", "X"}, {"name", s.name}, {"cat", s.thread}, {"pid", pid}, {"tid", s.thread == "comm" ? 1 : 0},
                         {"ts", us(s.start)}, {"dur", us(s.end - s.start)}, {"args", args}});
    }
    const double overlap = step.comm_seconds > 0 ? std::clamp(step.hidden_comm_seconds / step.comm_seconds, 0.0, 1.0) : 0.0;
    if (first < last) {
      events_.push_back({{"ph", "X"}, {"name", "step " + std::to_string(step.step)}, {"cat", "step"}, {"pid", pid}, {"tid", 0},
                         {"ts", us(first)}, {"dur", us(last - first)},
                         {"args", {{"step", step.step}, {"loss", step.loss}, {"comm_ms", step.comm_seconds * 1e3},
                                   {"exposed_comm_ms", step.exposed_comm_seconds * 1e3}, {"overlap_ratio", overlap}}}});
      events_.push_back({{"ph", "C"}, {"name", "overlap_ratio"}, {"pid", pid}, {"ts", us(first)}, {"args", {{"overlap", overlap}}}});
    }
    summary_.push_back({{"rank", pid}, {"step", step.step}, {"step_ms", step.step_seconds * 1e3}, {"comm_ms", step.comm_seconds * 1e3},
                        {"exposed_comm_ms", step.exposed_comm_seconds * 1e3}, {"overlap_ratio", overlap}});
  }

  void on_failure(const std::string&) override { write_own(); }  // what was recorded so far

  void finish() override {
    if (summary_.empty()) {
      SPMDX_WARN("timeline: no step recorded (start_step " << start_ << ", steps " << steps_ << " is past the run's last step)");
    }
    // Counted written even when the write fails, so that rank 0 never waits for it.
    try {
      write_own();
    } catch (...) {
      if (context_.store != nullptr) context_.store->add("spmdx/hooks/timeline/written", 1);
      throw;
    }
    if (context_.store != nullptr) context_.store->add("spmdx/hooks/timeline/written", 1);
    if (context_.rank != 0) return;
    // Rank 0 merges once every rank wrote its file (or the timeout passed: merge what exists).
    if (context_.store != nullptr) {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(context_.timeout_seconds);
      while (context_.store->add("spmdx/hooks/timeline/written", 0) < context_.world_size && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
    json merged = json::array(), summary = json::array();
    std::vector<int> missing;
    for (int r = 0; r < context_.world_size; ++r) {
      const fs::path file = fs::path(context_.output_dir) / ("rank" + std::to_string(r) + ".json");
      json doc;
      try {
        const std::string text = spmdx::read_file_bytes(file);
        spmdx::check_json_nesting(text);
        doc = json::parse(text);
      } catch (const std::exception&) {
        missing.push_back(r);  // absent, unreadable, or half-written by a failing rank
        continue;
      }
      for (const auto& e : doc.at("traceEvents")) merged.push_back(e);
      for (const auto& s : doc.at("otherData").at("summary")) summary.push_back(s);
    }
    spmdx::write_file_atomic(fs::path(context_.output_dir) / "merged.json",
                             json{{"traceEvents", merged}, {"displayTimeUnit", "ms"}}.dump() + "\n");
    spmdx::write_file_atomic(fs::path(context_.output_dir) / "summary.json", summary.dump(1) + "\n");
    double hidden = 0, total = 0;
    for (const auto& s : summary) {
      total += s.at("comm_ms").get<double>();
      hidden += s.at("comm_ms").get<double>() * s.at("overlap_ratio").get<double>();
    }
    std::string miss;
    for (int r : missing) miss += (miss.empty() ? "" : ", ") + std::to_string(r);
    char ratio[16];
    std::snprintf(ratio, sizeof ratio, "%.2f", total > 0 ? hidden / total : 0.0);
    SPMDX_INFO("timeline: " << summary.size() << " rank-steps, overlap ratio " << ratio << "; open "
                            << (fs::path(context_.output_dir) / "merged.json").string() << " in ui.perfetto.dev"
                            << (missing.empty() ? "" : " (no trace from rank " + miss + ": on another host's disk?)"));
  }

 private:
  void write_own() {
    std::lock_guard lock(mutex_);
    const json doc{{"traceEvents", events_}, {"displayTimeUnit", "ms"}, {"otherData", {{"rank", context_.rank}, {"summary", summary_}}}};
    spmdx::write_file_atomic(fs::path(context_.output_dir) / ("rank" + std::to_string(context_.rank) + ".json"), doc.dump() + "\n");
  }

  static bool is_file(const fs::path& file) {
    std::error_code ec;
    return fs::is_regular_file(fs::symlink_status(file, ec));
  }

  // This rank's trace of an earlier run in this folder. Resumed (first_step > 1), it keeps the
  // events and summary rows of the steps before this run's first (spans carry their step; a
  // step's overlap counter shares the start of its "step N" span). Whatever it would not keep
  // (steps from first_step on, an unreadable trace, all of it in a run from step 1) is kept
  // whole aside first, and the kept part written at once, so that a run killed before its end
  // leaves the history for the next resume.
  void keep_earlier_trace() {
    const fs::path own = fs::path(context_.output_dir) / ("rank" + std::to_string(context_.rank) + ".json");
    if (!is_file(own)) return;  // none (a FIFO or folder is no trace: left alone)
    std::string why;     // what this run would lose, "" when nothing
    bool part = false;   // the steps before first_step are kept, the rest left out
    if (context_.first_step <= 1) {
      why = "holds the trace of an earlier run";
    } else {
      try {
        const std::string text = spmdx::read_file_bytes(own);
        spmdx::check_json_nesting(text);
        const json old = json::parse(text);
        std::set<double> step_starts;
        json kept = json::array();
        std::size_t recorded = 0;  // events of steps (not the metadata every trace starts with)
        for (const auto& e : old.at("traceEvents")) {
          if (e.value("ph", "") == "M") continue;
          ++recorded;
          if (e.value("ph", "") != "X" || !e.contains("args") || !e["args"].contains("step")) continue;
          if (e["args"]["step"].get<std::int64_t>() >= context_.first_step) continue;
          kept.push_back(e);
          if (e.value("cat", "") == "step") step_starts.insert(e.at("ts").get<double>());
        }
        for (const auto& e : old.at("traceEvents")) {
          if (e.value("ph", "") == "C" && step_starts.count(e.at("ts").get<double>())) kept.push_back(e);
        }
        json summary = json::array();
        const json& rows = old.at("otherData").at("summary");
        for (const auto& row : rows) {
          if (row.at("step").get<std::int64_t>() < context_.first_step) summary.push_back(row);
        }
        if (kept.size() < recorded || summary.size() < rows.size()) {
          why = "holds steps this run trains again (from step " + std::to_string(context_.first_step) + " on)";
          part = true;
        }
        for (auto& e : kept) events_.push_back(std::move(e));
        summary_ = std::move(summary);
      } catch (const std::exception& e) {
        why = std::string("cannot be read as a trace (") + e.what() + ")";
      }
    }
    if (why.empty()) return;  // every event kept: this run's trace adds to it
    const fs::path aside = spmdx::move_aside(own);
    if (part) write_own();
    SPMDX_WARN("timeline: " << own.string() << " " << why << ": it is kept whole as " << aside.string()
                            << (part ? ", and the trace goes on from its steps before " + std::to_string(context_.first_step) : std::string()));
  }

  // Rank 0: the merged trace and summary of an earlier run, which finish() rewrites from the
  // ranks' traces. Kept whole aside when they hold what those will not (steps from first_step
  // on, or anything at all in a run from step 1); a resumed run's merge holds their steps again.
  void keep_earlier_merge() {
    const fs::path dir(context_.output_dir);
    bool lose = context_.first_step <= 1;
    if (!lose && is_file(dir / "summary.json")) {
      try {
        const std::string text = spmdx::read_file_bytes(dir / "summary.json");
        spmdx::check_json_nesting(text);
        for (const auto& row : json::parse(text)) lose = lose || row.at("step").get<std::int64_t>() >= context_.first_step;
      } catch (const std::exception&) {
        lose = true;
      }
    }
    if (!lose) return;
    std::string kept;
    for (const char* name : {"merged.json", "summary.json"}) {
      if (!is_file(dir / name)) continue;
      kept += (kept.empty() ? "" : ", ") + (dir / name).string() + " as " + spmdx::move_aside(dir / name).filename().string();
    }
    if (!kept.empty()) SPMDX_WARN("timeline: the merged trace of an earlier run is kept whole: " << kept);
  }

  std::int64_t start_ = 1, steps_ = 5;
  spmdx::HookContext context_;
  std::mutex mutex_;  // on_failure may come from the signal thread
  json events_ = json::array();
  json summary_ = json::array();
};

void register_timeline(spmdx::Registrar& r) {
  r.add_hook("timeline", [](const spmdx::Options& o) { return std::make_unique<Timeline>(o); });
}

}  // namespace

SPMDX_PLUGIN("timeline", hook, "0.1.0", "Chrome trace / Perfetto JSON per rank and merged: compute and comm spans, overlap ratio",
             register_timeline)
