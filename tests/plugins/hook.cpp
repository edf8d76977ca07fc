// Test hook: counts the callbacks it gets and writes them to <output_dir>/rank<R>.txt at
// on_compile_end and finish; option `throw_in` names a callback where it throws
// std::runtime_error ("compile", "vertex", "step"), `validate` = "compile" throws
// ValidationError at on_compile_end, `bad_edges` = "true" marks every propagated edge
// whose placements change inconsistent.
#include <spmdx/plugin.h>

#include <fstream>
#include <map>
#include <stdexcept>
#include <string>

namespace {

class Counting final : public spmdx::Hook {
 public:
  explicit Counting(const spmdx::Options& o) {
    for (const auto& [k, v] : o) {
      if (k != "throw_in" && k != "validate" && k != "bad_edges") throw std::invalid_argument("unknown option '" + k + "'");
    }
    auto get = [&](const char* k) {
      auto it = o.find(k);
      return it == o.end() ? std::string() : it->second;
    };
    throw_in_ = get("throw_in");
    validate_ = get("validate");
    bad_edges_ = get("bad_edges") == "true";
  }
  void init(const spmdx::HookContext& c) override { context_ = c; }
  void on_compile_stage(const spmdx::GraphView& g) override {
    ++counts_[std::string("stage.") + spmdx::to_string(g.stage)];
    counts_[std::string("nodes.") + spmdx::to_string(g.stage)] += static_cast<long>(g.nodes.size());
    if (throw_in_ == "compile") throw std::runtime_error("compile stage trouble");
  }
  void on_vertex_validate(const spmdx::GraphView& g, int) override {
    ++counts_[std::string("vertex.") + spmdx::to_string(g.stage)];
    if (throw_in_ == "vertex") throw std::runtime_error("vertex trouble");
  }
  bool on_edge_consistency(const spmdx::GraphView& g, const spmdx::GraphEdge& e) override {
    ++counts_[std::string("edge.") + spmdx::to_string(g.stage)];
    if (e.from != e.to) ++counts_["edge.redistributed"];
    return !(bad_edges_ && e.from != e.to);
  }
  void on_compile_end() override {
    write();
    if (validate_ == "compile") throw spmdx::ValidationError("the plan is not acceptable");
  }
  void on_collective(const spmdx::CollectiveInfo& c) override { ++counts_[std::string("collective.") + spmdx::to_string(c.state)]; }
  void on_step_end(const spmdx::StepInfo& s) override {
    ++counts_["step"];
    counts_["spans"] += static_cast<long>(s.spans.size());
    counts_["tensors"] = static_cast<long>(s.tensors.size());
    if (throw_in_ == "step") throw std::runtime_error("step trouble at step " + std::to_string(s.step));
  }
  void finish() override { write(); }

 private:
  void write() {
    std::ofstream out(context_.output_dir + "/rank" + std::to_string(context_.rank) + ".txt");
    for (const auto& [k, v] : counts_) out << k << " " << v << "\n";
  }
  std::string throw_in_, validate_;
  bool bad_edges_ = false;
  spmdx::HookContext context_;
  std::map<std::string, long> counts_;
};

void register_hook(spmdx::Registrar& r) {
  r.add_hook("test_hook", [](const spmdx::Options& o) { return std::make_unique<Counting>(o); });
}

}  // namespace

SPMDX_PLUGIN("test_hook", hook, "1.0.0", "test: counts hook callbacks", register_hook)
