// `spmdx bench compare A B`: is run B slower than run A beyond the noise? Compares two runs'
// step times (metrics.jsonl, or run folders holding one) or two saved `spmdx bench comm`
// outputs (bench/compare.h). Exit 0: no regression (or none asked about); 1: B slower than
// --max-slowdown allows; 2: bad input.
#include <iostream>

#include "command.h"
#include "usage.h"
#include "spmdx/bench/compare.h"

namespace spmdx::cli {
namespace {

class BenchCompare final : public Command {
 public:
  CLI::App* add(CLI::App& parent, const std::string& name) override {
    auto* cmp = parent.add_subcommand(name, "Is run B slower than run A beyond the noise? Two metrics.jsonl (or run folders) or two bench comm outputs");
    cmp->add_option("run_a", a_, "The baseline: a run's job.dump_folder, its metrics.jsonl, or a saved bench comm output")->required();
    cmp->add_option("run_b", b_, "The run to judge, of the same kind")->required();
    cmp->add_option("--max-slowdown", max_slowdown_, "Exit 1 when B's step time is slower than this beyond the noise (5%, 0.05)")
        ->each([this](const std::string&) { max_slowdown_given_ = true; });
    cmp->add_option("--warmup", warmup_, "Steps dropped from the front of each metrics.jsonl")->capture_default_str()->check(CLI::Range(0, 1000000));
    add_json_flag(*cmp, json_, "the comparison", "schema spmdx.bench.compare/1");
    return cmp;
  }

  int run(const CLI::App&, int, char**) override {
    try {
      spmdx::bench::CompareOptions options;
      options.warmup = warmup_;
      if (max_slowdown_given_) options.max_slowdown = spmdx::bench::parse_fraction(max_slowdown_);
      const auto c = spmdx::bench::compare_runs(a_, b_, options);
      std::cout << (json_ ? spmdx::bench::to_json(c) : spmdx::bench::to_text(c));
      return c.regressed ? 1 : 0;
    } catch (const spmdx::bench::CompareInputError& e) {
      std::cerr << "error: " << e.what() << "\n";
      return 2;
    }
  }

 private:
  std::string a_, b_, max_slowdown_;
  bool max_slowdown_given_ = false;
  int warmup_ = 2;
  bool json_ = false;
};

}  // namespace

std::unique_ptr<Command> make_bench_compare() { return std::make_unique<BenchCompare>(); }

}  // namespace spmdx::cli
