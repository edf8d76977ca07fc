// consistency: every `every` steps, each rank hashes the tensors that should be identical on
// other ranks — a tensor's copies are the ranks that agree on its coordinate along every mesh
// dim where it is not Replicate (a replicated parameter, its optimizer state, the loss) — and
// posts the hashes to the job's store; rank 0 compares them and names the first diverging
// tensor (in parameter order), the step and the rank that differs from the majority of its
// copies. Bitwise: the collectives give every rank the same bits (ring all_reduce distributes
// each reduced chunk from one rank), so any difference is a bug or corruption.
//
// Options ([hooks.consistency]): every, steps between checks, and the last step is always
// checked (default 10); fail, stop the
// job on a divergence (default true; false only reports it).
// Output: <dump>/hooks/consistency/report.json (rank 0): the checks and the first divergence; a
// run resumed in the same folder keeps those of the steps before it. A report this run would
// replace or cut (a run from step 1, checks past the checkpoint, one it cannot read) is first
// kept whole as report.<N>.json, the next free N, and said: nothing an earlier run wrote is lost.
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "spmdx/core/log.h"
#include "spmdx/files.h"
#include "spmdx/options.h"
#include "spmdx/plugin.h"
#include "spmdx/text.h"

namespace {

using nlohmann::json;

// FNV-1a, 64 bits, over the tensor's bytes (the same as the core's fnv1a_hex, which a plugin may not link).
std::uint64_t fnv1a(const void* data, std::size_t n) {
  std::uint64_t h = 14695981039346656037ull;
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

class Consistency final : public spmdx::Hook {
 public:
  explicit Consistency(const spmdx::Options& options) {
    spmdx::OptionReader o("[hooks.consistency]", options);
    every_ = o.get_int("every", 10, 1, 1'000'000'000);
    fail_ = o.get_bool("fail", true);
    o.done();
  }

  void init(const spmdx::HookContext& context) override {
    context_ = context;
    if (context.store == nullptr && !context.compile_only) {
      SPMDX_INFO("consistency: one rank, nothing to compare");
    }
    if (context.rank == 0 && context.store != nullptr && !context.compile_only) keep_earlier_report();  // one rank writes no report
  }

  void on_step_end(const spmdx::StepInfo& step) override {
    if (context_.store == nullptr || (step.step % every_ != 0 && !step.last)) return;
    // This rank's hashes: "name|copy key|hash" per line, in the state's order.
    std::ostringstream mine;
    for (const auto& t : step.tensors) {
      std::string copy;  // which copy of the tensor this rank holds
      for (std::size_t d = 0; d < t.placements.size() && d < context_.coordinate.size(); ++d) {
        if (!t.placements[d].is_replicate()) copy += context_.mesh[d].name + "=" + std::to_string(context_.coordinate[d]) + " ";
      }
      mine << t.name << "|" << copy << "|" << std::hex << fnv1a(t.data, t.bytes) << std::dec << "\n";
    }
    const std::string prefix = "spmdx/hooks/consistency/" + std::to_string(step.step) + "/";
    context_.store->set(prefix + std::to_string(context_.rank), mine.str());
    if (context_.rank != 0) return;
    // Rank 0: every rank's hashes, grouped by (tensor, copy).
    std::vector<std::string> order;
    std::map<std::string, std::map<std::string, std::vector<int>>> by_copy;  // "name|copy" -> hash -> ranks
    for (int r = 0; r < context_.world_size; ++r) {
      std::istringstream lines(context_.store->get(prefix + std::to_string(r), context_.timeout_seconds));
      std::string line;
      while (std::getline(lines, line)) {
        const auto bar = line.rfind('|');
        const std::string key = line.substr(0, bar);
        if (by_copy.find(key) == by_copy.end()) order.push_back(key);
        by_copy[key][line.substr(bar + 1)].push_back(r);
      }
    }
    ++checks_;
    report_["checks"].push_back({{"step", step.step}, {"tensors", order.size()}});
    for (const auto& key : order) {
      const auto& hashes = by_copy[key];
      if (hashes.size() < 2) continue;
      // The majority hash is the reference; the other ranks diverge.
      auto majority = hashes.begin();
      for (auto it = hashes.begin(); it != hashes.end(); ++it) {
        if (it->second.size() > majority->second.size()) majority = it;
      }
      std::vector<int> odd;
      for (const auto& [h, ranks] : hashes) {
        if (h != majority->first) odd.insert(odd.end(), ranks.begin(), ranks.end());
      }
      const bool tie = std::count_if(hashes.begin(), hashes.end(), [&](const auto& e) { return e.second.size() == majority->second.size(); }) > 1;
      const std::string name = key.substr(0, key.find('|'));
      std::string copy = key.substr(key.find('|') + 1);
      if (!copy.empty() && copy.back() == ' ') copy.pop_back();
      const std::string message =
          "step " + std::to_string(step.step) + ": tensor " + name + (copy.empty() ? "" : " (copy " + copy + ")") + " differs on " +
          spmdx::rank_list(odd) + " from " + spmdx::rank_list(majority->second) +
          (tie ? " (no majority: either side may be wrong)" : "") + "; it should be identical on all of them";
      if (!report_.contains("divergence") || report_["divergence"].is_null()) {  // the first one is the one to chase
        report_["divergence"] = {{"step", step.step}, {"tensor", name}, {"copy", copy}, {"ranks", odd}, {"reference_ranks", majority->second},
                                 {"message", message}};
      }
      ++divergences_;
      write_report();
      SPMDX_ERROR("consistency: " << message);
      if (fail_) throw spmdx::ValidationError(message);
      return;
    }
    write_report();
  }

  void finish() override {
    if (context_.rank == 0 && context_.store != nullptr) {
      write_report();
      if (divergences_ == 0) {
        SPMDX_INFO("consistency: " << checks_ << " check(s), no divergence; report in " << context_.output_dir);
      } else {
        SPMDX_ERROR("consistency: " << checks_ << " check(s), " << divergences_ << " with a divergence; the first: "
                                    << report_["divergence"]["message"].get<std::string>() << "; report in " << context_.output_dir);
      }
    }
  }

 private:
  void write_report() {
    report_["every"] = every_;
    if (!report_.contains("divergence")) report_["divergence"] = nullptr;
    spmdx::write_file_atomic(std::filesystem::path(context_.output_dir) / "report.json", report_.dump(1) + "\n");
  }

  // An earlier run's report in this folder. Resumed (first_step > 1), it keeps the checks (and a
  // divergence) of the steps before this run's first. Whatever it would not keep (checks from
  // first_step on, an unreadable report, all of it in a run from step 1) is kept whole aside
  // first, and the kept part written at once, for the next resume should this run be killed.
  void keep_earlier_report() {
    const std::filesystem::path file = std::filesystem::path(context_.output_dir) / "report.json";
    std::error_code ec;
    if (!std::filesystem::is_regular_file(std::filesystem::symlink_status(file, ec))) return;  // none (a FIFO or folder is no report: left alone)
    std::string why;  // what this run would lose, "" when nothing
    bool part = false;
    if (context_.first_step <= 1) {
      why = "holds the report of an earlier run";
    } else {
      try {
        const std::string text = spmdx::read_file_bytes(file);
        spmdx::check_json_nesting(text);
        const json old = json::parse(text);
        const json& checks = old.at("checks");
        for (const auto& c : checks) {
          if (c.at("step").get<std::int64_t>() < context_.first_step) report_["checks"].push_back(c);
        }
        const json& d = old.value("divergence", json());
        const bool divergence_past = d.is_object() && d.at("step").get<std::int64_t>() >= context_.first_step;
        if (d.is_object() && !divergence_past) report_["divergence"] = d;
        if (report_["checks"].size() < checks.size() || divergence_past) {
          why = "holds checks of steps this run trains again (from step " + std::to_string(context_.first_step) + " on)";
          part = true;
        }
      } catch (const std::exception& e) {
        why = std::string("cannot be read as a report (") + e.what() + ")";
        report_ = {{"checks", json::array()}};
      }
    }
    if (why.empty()) return;  // every check kept: this run's add to them
    const std::filesystem::path aside = spmdx::move_aside(file);
    if (part) write_report();
    SPMDX_WARN("consistency: " << file.string() << " " << why << ": it is kept whole as " << aside.string()
                               << (part ? ", and the report goes on from its checks before step " + std::to_string(context_.first_step) : std::string()));
  }

  std::int64_t every_ = 10;
  bool fail_ = true;
  int checks_ = 0, divergences_ = 0;
  spmdx::HookContext context_;
  json report_ = {{"checks", json::array()}};
};

void register_consistency(spmdx::Registrar& r) {
  r.add_hook("consistency", [](const spmdx::Options& o) { return std::make_unique<Consistency>(o); });
}

}  // namespace

SPMDX_PLUGIN("consistency", hook, "0.1.0", "Checksums of tensors that should be identical across ranks; names the first that diverges",
             register_consistency)
