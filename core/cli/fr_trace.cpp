// `spmdx fr-trace`: merges the flight_recorder hook's per-rank dumps of a run and names the rank
// missing from a collective (hooks/fr_trace.h), as PyTorch's fr_trace does for NCCL's flight
// recorder. Exit 0 with the report, 1 when the folder cannot be read.
#include <iostream>

#include "command.h"
#include "usage.h"
#include "spmdx/hooks/fr_trace.h"

namespace spmdx::cli {
namespace {

class FrTrace final : public Command {
 public:
  CLI::App* add(CLI::App& parent, const std::string& name) override {
    auto* fr_trace = parent.add_subcommand(name, "Merge the flight_recorder hook's dumps; name the rank missing from a collective");
    fr_trace->add_option("folder", folder_, "<job.dump_folder>/hooks/flight_recorder")->required();
    return fr_trace;
  }

  int run(const CLI::App&, int, char**) override {
    std::cout << spmdx::hooks::analyze_flight_recorder(folder_).text;
    return 0;
  }

 private:
  std::string folder_;
};

}  // namespace

std::unique_ptr<Command> make_fr_trace() { return std::make_unique<FrTrace>(); }

}  // namespace spmdx::cli
