// `spmdx graph`: prints a model's train-step graph (forward, loss, backward, clipping, AdamW) as
// IR, verified: the model a run of the config would train (as job_spec makes it: the
// tokenizer's vocabulary or model.vocab_size, model.n_layers), for its global batch and seq_len;
// each flag given replaces the config's value. Without a config, the flags' defaults and the
// default tokenizer's ids. Exit 0, or 1 when the model cannot be built.
#include <iostream>
#include <set>

#include "command.h"
#include "usage.h"
#include "spmdx/config/config.h"
#include "spmdx/data/tokenizer.h"
#include "spmdx/ir/serialize.h"
#include "spmdx/models/model.h"
#include "spmdx/job/compile.h"
#include "spmdx/job/preflight.h"
#include "spmdx/job/spec.h"
#include "spmdx/train/train_step.h"

namespace spmdx::cli {
namespace {

struct GraphOptions {
  std::string config;  ///< a job's TOML: its model, vocabulary, global batch and seq_len
  std::string model = "llama";
  std::string flavor = "tiny";
  std::int64_t vocab = 0;  ///< 0: the tokenizer's (the config's, or the default one's)
  std::int64_t batch = 8;
  std::int64_t seq = 64;
  bool json = false;
  bool forward_only = false;
  std::set<std::string> given;  ///< the flags given (--model, ...): they replace the config's values
};

// The ids of the tokenizer a config that names none uses (the byte tokenizer's 264).
std::int64_t default_vocab() { return spmdx::data::make_tokenizer(spmdx::config::Config().get_string("model.tokenizer"))->vocab_size(); }

class Graph final : public Command {
 public:
  CLI::App* add(CLI::App& parent, const std::string& name) override {
    auto* graph = parent.add_subcommand(name, "Print a model's train-step graph (forward, backward, clipping, AdamW) as IR");
    graph->fallthrough();
    graph->add_option("config", o_.config, "A job's TOML config: the model a run of it trains, for its global batch and seq_len (flags replace its values)")
        ->check(CLI::ExistingFile);
    graph->add_option("--model", o_.model, "mlp | llama (default: the config's, else llama)");
    graph->add_option("--flavor", o_.flavor, "tiny | debugmodel | ... (default: the config's, else tiny)");
    graph->add_option("--vocab", o_.vocab,
                      "Vocabulary size (default: what a run uses: model.vocab_size or the config's tokenizer's ids; without a config the default tokenizer's, " +
                          std::to_string(default_vocab()) + ")")
        ->check(CLI::PositiveNumber);
    graph->add_option("--batch", o_.batch, "Batch size, rows (default: the config's global batch, else 8)")->check(CLI::PositiveNumber);
    graph->add_option("--seq", o_.seq, "Sequence length, tokens (default: the config's training.seq_len, else 64)")->check(CLI::PositiveNumber);
    add_json_flag(*graph, o_.json, "the graph", "schema spmdx.graph/" + std::to_string(spmdx::ir::kGraphJsonVersion));
    graph->add_flag("--forward-only", o_.forward_only, "Only the forward graph and loss");
    return graph;
  }

  int run(const CLI::App& cmd, int, char**) override {
    for (const char* flag : {"--model", "--flavor", "--vocab", "--batch", "--seq"}) {
      if (cmd.count(flag) > 0) o_.given.insert(flag);
    }
    spmdx::models::ModelArgs args;
    std::int64_t batch = o_.batch, seq = o_.seq;
    if (!o_.config.empty()) {
      const spmdx::config::Config cfg = spmdx::config::Config::load(o_.config);
      const auto tokenizer = spmdx::data::make_tokenizer(cfg.get_string("model.tokenizer"));
      const spmdx::job::JobSpec spec = spmdx::job::job_spec(cfg, spmdx::job::degree_product(cfg), tokenizer->vocab_size());
      args = spec.model;
      if (!o_.given.count("--batch")) batch = spec.global_batch_size;
      if (!o_.given.count("--seq")) seq = spec.seq_len;
      if (o_.given.count("--model") || o_.given.count("--flavor")) {
        args = spmdx::models::model_args(o_.given.count("--model") ? o_.model : args.name, o_.given.count("--flavor") ? o_.flavor : args.flavor, args.vocab_size);
      }
    } else {
      args = spmdx::models::model_args(o_.model, o_.flavor, default_vocab());
    }
    if (o_.given.count("--vocab")) args.vocab_size = o_.vocab;
    spmdx::models::Model m = spmdx::models::build_model(args, batch, seq);
    if (!o_.forward_only) spmdx::train::append_train_step(m.graph, m.params, {});
    m.graph.verify();
    std::cout << (o_.json ? spmdx::ir::to_json(m.graph) + "\n" : m.graph.str());
    return 0;
  }

 private:
  GraphOptions o_;
};

}  // namespace

std::unique_ptr<Command> make_graph() { return std::make_unique<Graph>(); }

}  // namespace spmdx::cli
