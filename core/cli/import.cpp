// `spmdx import`: inspects a torch.export program (.pt2): what it holds (parameters, buffers,
// inputs, outputs, ops), what spmdx cannot map (with source lines), and whether it imports;
// --graph prints the imported forward graph instead. Exit 0 when it imports, 1 when it cannot
// be trained (or this build has no LibTorch).
#include <nlohmann/json.hpp>

#include <algorithm>
#include <iostream>
#include <optional>

#include "command.h"
#include "usage.h"
#ifdef SPMDX_HAVE_EXEC
#include "spmdx/ir/serialize.h"
#include "spmdx/exec/pt2_import.h"
#include "spmdx/text.h"
#endif

namespace spmdx::cli {
namespace {

struct ImportOptions {
  std::string path;
  std::vector<std::string> inputs;
  std::string loss = "auto";
  bool graph = false;
  bool json = false;
};

#ifdef SPMDX_HAVE_EXEC

// Inspects a .pt2 file: what it holds, what spmdx cannot map (with source lines), and whether
// it imports. Exit 0 when it imports, 1 when it cannot be trained.
int run_import(const ImportOptions& o) {
  using spmdx::models::Pt2Summary;
  const Pt2Summary s = spmdx::models::summarize_pt2(o.path);
  std::string error;
  std::size_t nodes = 0;
  std::optional<spmdx::models::Model> model;
  if (s.unsupported.empty()) {
    spmdx::models::ModelArgs args = spmdx::models::model_args("pt2", "", 0);
    args.path = o.path;
    args.inputs = o.inputs;
    args.loss = o.loss;
    try {
      model.emplace(spmdx::models::import_pt2(args));
      nodes = model->graph.num_nodes();
    } catch (const spmdx::models::ImportError& e) {
      error = e.what();
    }
  }
  if (o.graph && model) {
    std::cout << model->graph.str();
    return 0;
  }
  std::vector<std::pair<std::string, int>> ops(s.ops.begin(), s.ops.end());
  std::stable_sort(ops.begin(), ops.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
  if (o.json) {
    auto tensors = [](const std::vector<Pt2Summary::Tensor>& list) {
      nlohmann::json out = nlohmann::json::array();
      for (const auto& t : list) out.push_back({{"name", t.name}, {"shape", t.shape}, {"dtype", t.dtype}, {"bytes", t.bytes}});
      return out;
    };
    nlohmann::json j{{"path", s.path}, {"torch_version", s.torch_version}, {"schema_version", s.schema_version}, {"verifier", s.verifier},
                     {"parameter_count", s.parameter_count()}, {"parameter_bytes", s.parameter_bytes()}, {"parameters", tensors(s.parameters)},
                     {"buffers", tensors(s.buffers)}, {"inputs", tensors(s.inputs)}, {"outputs", tensors(s.outputs)}, {"ops", s.ops},
                     {"tied", nlohmann::json::array()}, {"unsupported", nlohmann::json::array()}, {"imports", error.empty() && s.unsupported.empty()},
                     {"error", error}, {"ir_nodes", nodes}};
    for (const auto& [alias, param] : s.tied) j["tied"].push_back({{"name", alias}, {"parameter", param}});
    for (const auto& u : s.unsupported) j["unsupported"].push_back({{"op", u.op}, {"node", u.node}, {"source", u.source}, {"why", u.why}});
    std::cout << j.dump(2) << "\n";
    return error.empty() && s.unsupported.empty() ? 0 : 1;
  }
  auto shape = [](const Pt2Summary::Tensor& t) { return t.dtype + spmdx::ir::shape_str(t.shape); };
  std::cout << s.path << ": torch.export program from torch " << s.torch_version << " (schema " << s.schema_version << ", " << s.verifier << " IR)\n";
  std::cout << "parameters: " << s.parameters.size() << (s.parameters.size() == 1 ? " tensor, " : " tensors, ") << s.parameter_count() << " elements, " << spmdx::human_bytes(static_cast<double>(s.parameter_bytes()))
            << (s.tied.empty() ? "" : " (tied: ");
  for (std::size_t i = 0; i < s.tied.size(); ++i) std::cout << (i ? ", " : "") << s.tied[i].first << " = " << s.tied[i].second;
  std::cout << (s.tied.empty() ? "" : ")") << "\n";
  for (const auto& p : s.parameters) std::cout << "  " << p.name << " " << shape(p) << "\n";  // the names a [parallelism.tp_plan] matches
  if (!s.buffers.empty()) {
    std::cout << "buffers and constants (frozen):";
    for (const auto& b : s.buffers) std::cout << " " << b.name << " " << shape(b);
    std::cout << "\n";
  }
  std::cout << "inputs:";
  for (const auto& t : s.inputs) std::cout << " " << t.name << " " << shape(t);
  std::cout << "\noutputs:";
  for (const auto& t : s.outputs) std::cout << " " << t.name << " " << shape(t);
  std::cout << "\nops (" << ops.size() << " kinds):";
  for (const auto& [op, n] : ops) std::cout << " " << op << " x" << n;
  std::cout << "\n";
  if (!s.unsupported.empty()) {
    std::cout << "unsupported (" << s.unsupported.size() << (s.unsupported.size() == 1 ? " node" : " nodes") << "; spmdx cannot train this program):\n";
    for (const auto& u : s.unsupported) std::cout << "  " << u.op << " at node '" << u.node << "'" << (u.source.empty() ? "" : ": " + u.source) << " (" << u.why << ")\n";
    return 1;
  }
  if (!error.empty()) {
    std::cout << "does not import: " << error << "\n";
    return 1;
  }
  std::cout << "imports: " << nodes << " IR nodes (forward and loss); train it with [model] name = \"pt2\", path = \"" << o.path << "\"\n";
  return 0;
}
#endif

class Import final : public Command {
 public:
  CLI::App* add(CLI::App& parent, const std::string& name) override {
    auto* import_cmd = parent.add_subcommand(name, "Inspect a torch.export program (.pt2): parameters, bytes, ops, what spmdx cannot map; --graph prints its IR");
    import_cmd->add_option("model", o_.path, "The .pt2 file torch.export.save wrote (torch >= 2.9)")->required();
    import_cmd->add_option("--inputs", o_.inputs, "The program's inputs that take tokens and labels, in order (as [model] inputs)");
    import_cmd->add_option("--loss", o_.loss, "auto | cross_entropy | output (as [model] loss)")->check(CLI::IsMember({"auto", "cross_entropy", "output"}));
    import_cmd->add_flag("--graph", o_.graph, "Print the imported forward graph (IR) instead of the summary");
    add_json_flag(*import_cmd, o_.json, "the summary");
    return import_cmd;
  }

  int run(const CLI::App&, int, char**) override {
#ifdef SPMDX_HAVE_EXEC
    return run_import(o_);
#else
    std::cerr << "error: this spmdx was built without LibTorch\n";
    return 1;
#endif
  }

 private:
  ImportOptions o_;
};

}  // namespace

std::unique_ptr<Command> make_import() { return std::make_unique<Import>(); }

}  // namespace spmdx::cli
