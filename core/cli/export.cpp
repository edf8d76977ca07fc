// `spmdx export`: writes a checkpoint's parameters, consolidated from every rank's shards, as
// one safetensors file, under spmdx's (torchtitan's) names or Hugging Face's Llama names.
// Exit 0 when written, 1 when it cannot be (or this build has no LibTorch).
#include <iostream>

#include "command.h"
#include "usage.h"
#ifdef SPMDX_HAVE_EXEC
#include "spmdx/exec/checkpoint.h"
#endif

namespace spmdx::cli {
namespace {

class Export final : public Command {
 public:
  CLI::App* add(CLI::App& parent, const std::string& name) override {
    auto* export_cmd = parent.add_subcommand(name, "Write a checkpoint's parameters, consolidated, as a safetensors file");
    export_cmd->add_option("checkpoint", step_folder_, "A checkpoint's step-N folder")->required()->check(CLI::ExistingDirectory);
    export_cmd->add_option("out", out_, "The .safetensors file to write")->required();
    export_cmd->add_option("--names", names_,
                           "spmdx (torchtitan's names) | hf (Hugging Face's Llama names, query and key rows permuted for its rotary layout; llama only)")
        ->check(CLI::IsMember({"spmdx", "hf"}));
    return export_cmd;
  }

  int run(const CLI::App&, int, char**) override {
#ifdef SPMDX_HAVE_EXEC
    const std::size_t n = spmdx::exec::export_safetensors(step_folder_, out_, names_ == "hf");
    std::cout << "wrote " << n << " tensors to " << out_ << (names_ == "hf" ? " (Hugging Face names, rotary rows half-split)" : "") << "\n";
    return 0;
#else
    std::cerr << "error: this spmdx was built without LibTorch\n";
    return 1;
#endif
  }

 private:
  std::string step_folder_, out_, names_ = "spmdx";
};

}  // namespace

std::unique_ptr<Command> make_export() { return std::make_unique<Export>(); }

}  // namespace spmdx::cli
