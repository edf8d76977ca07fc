// `spmdx bench fit RUN --calibrate FILE`: fits the cost model's per-collective cost to a run's
// measured exposed communication (plan/estimate.h: fit_collective_seconds) and writes it into
// the calibration that strategy = "auto" and compile --estimate read. Exit 0 when written, 1
// when the run's metrics or the calibration cannot be read or fitted.
#include <cstdio>
#include <filesystem>

#include "command.h"
#include "usage.h"
#include "spmdx/plan/estimate.h"

namespace spmdx::cli {
namespace {

class BenchFit final : public Command {
 public:
  CLI::App* add(CLI::App& parent, const std::string& name) override {
    auto* fit = parent.add_subcommand(name, "Fit the cost model's per-collective cost (strategy = \"auto\", compile --estimate) to a run's measured steps");
    fit->add_option("run", run_, "A run's job.dump_folder or its metrics.jsonl (several ranks, a few steps)")->required();
    fit->add_option("--calibrate", calibrate_, "The calibration.json to update (the job's: <job.dump_folder>/calibration.json)")->required();
    fit->add_option("--warmup", warmup_, "Steps dropped from the front")->capture_default_str()->check(CLI::Range(0, 1000000));
    return fit;
  }

  int run(const CLI::App&, int, char**) override {
    std::filesystem::path metrics = run_;
    if (std::filesystem::is_directory(metrics)) metrics /= "metrics.jsonl";
    const auto c = spmdx::plan::fit_collective_seconds(spmdx::plan::load_calibration(calibrate_), metrics, warmup_);
    spmdx::plan::save_calibration(calibrate_, c);
    std::printf("%.0f us a collective (%s) written to %s\n", c.collective_seconds * 1e6, c.collective_source.c_str(), calibrate_.c_str());
    return 0;
  }

 private:
  std::string run_;
  std::string calibrate_;
  std::int64_t warmup_ = 2;
};

}  // namespace

std::unique_ptr<Command> make_bench_fit() { return std::make_unique<BenchFit>(); }

}  // namespace spmdx::cli
