// `spmdx diff A B`: compares two compiled jobs, each a `spmdx compile --dump` folder or a config
// compiled in memory: their logical graphs, placements, rank graphs, collectives and buckets
// (plan/diff.h), level by level. Exit 0: equivalent; 1: they differ; 2: bad input (a missing or
// malformed dump, a bad config).
#include <filesystem>
#include <iostream>
#include <optional>

#include "command.h"
#include "compile_dump.h"
#include "usage.h"
#include "spmdx/config/config.h"
#include "spmdx/core/registry.h"
#include "spmdx/data/tokenizer.h"
#include "spmdx/plan/diff.h"
#include "spmdx/job/compile.h"
#include "spmdx/job/preflight.h"
#include "spmdx/job/spec.h"

namespace spmdx::cli {
namespace {

// A config compiled in memory into the documents `spmdx diff` compares, every rank's (a
// config with problems is refused as spmdx compile refuses it).
spmdx::plan::JobDump compile_for_diff(const std::string& config) {
  spmdx::config::Config cfg = spmdx::config::Config::load(config, {}, /*throw_on_problems=*/false);
  const std::int64_t world = spmdx::job::degree_product(cfg);
  spmdx::PluginRegistry registry;
  std::unique_ptr<spmdx::data::Tokenizer> tokenizer;
  std::optional<spmdx::job::JobSpec> checked_spec;
  cfg.check(spmdx::job::preflight(cfg, world, registry, &tokenizer, &checked_spec, spmdx::job::Preflight::plan));
  const spmdx::job::JobSpec& spec = checked_spec.value();
  spmdx::job::CompiledJob compiled = spmdx::job::compile_job(spec, registry);
  const spmdx::job::PlacedJob& job = compiled.job;
  const spmdx::sharding::DistributedPlan& plan = compiled.plan;
  spmdx::plan::JobDump d;
  d.label = config;
  for (auto& [name, text] : dump_documents(job, plan, spec, world, /*everything=*/false)) {
    if (name == "logical.json") d.logical = std::move(text);
    else if (name == "plan.json") d.plan = std::move(text);
    else if (name.size() > 10 && name.compare(name.size() - 10, 10, ".plan.json") == 0) d.rank_plans.push_back(std::move(text));
    else d.ranks.push_back(std::move(text));
  }
  return d;
}

class Diff final : public Command {
 public:
  CLI::App* add(CLI::App& parent, const std::string& name) override {
    auto* diff = parent.add_subcommand(name, "Compare two compiled jobs (compile --dump folders or configs): graphs, placements, collectives, buckets");
    diff->add_option("a", a_, "A spmdx compile --dump folder, or a config .toml (compiled in memory)")->required();
    diff->add_option("b", b_, "The same for the other job")->required();
    add_json_flag(*diff, json_, "every difference and the summary", "schema spmdx.diff/1");
    diff->add_option("--max", max_, "Differences printed per level (text)")->capture_default_str()->check(CLI::Range(1, 1000000));
    return diff;
  }

  int run(const CLI::App&, int, char**) override {
    auto load = [](const std::string& path) {
      std::error_code ec;
      if (std::filesystem::is_regular_file(path, ec)) return compile_for_diff(path);
      return spmdx::plan::read_dump(path);
    };
    try {
      const auto d = spmdx::plan::diff_jobs(load(a_), load(b_));
      std::cout << (json_ ? spmdx::plan::to_json(d) : spmdx::plan::to_text(d, max_));
      return d.equivalent() ? 0 : 1;
    } catch (const std::exception& e) {
      std::cerr << "error: " << e.what() << "\n";
      return 2;
    }
  }

 private:
  std::string a_, b_;
  bool json_ = false;
  std::size_t max_ = 10;
};

}  // namespace

std::unique_ptr<Command> make_diff() { return std::make_unique<Diff>(); }

}  // namespace spmdx::cli
