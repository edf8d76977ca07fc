// The host side of debug hooks (interfaces/spmdx/hook.h): GraphViews of the compile stages,
// and HookSet, which makes the hooks a config enables and calls them, keeping a hook's
// exception from taking the run down.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "spmdx/config/config.h"
#include "spmdx/hook.h"
#include "spmdx/ir/graph.h"
#include "spmdx/plan/runtime_plan.h"
#include "spmdx/sharding/distribute.h"

namespace spmdx {
class PluginRegistry;
}

namespace spmdx::hooks {

/// The logical graph as captured (no placements).
GraphView captured_view(const ir::Graph& graph, const sharding::DeviceMesh& mesh);
/// The logical graph with the plan's placements, and what each node reads (GraphNode::reads).
GraphView propagated_view(const sharding::DistributedPlan& plan);
/// A rank's graph (sharding::rank_graph(plan, rank)) with local shapes and placements: the
/// `rewritten` stage in graph order, or with `runtime` (that graph's RuntimePlan) the `planned`
/// stage: nodes in the plan's execution order, and GraphNode::wait_before where the executor
/// waits for each collective.
GraphView rank_view(const sharding::DistributedPlan& plan, const ir::Graph& rank_graph, int rank, const plan::RuntimePlan* runtime = nullptr);
/// Every edge (use of a value by a node) of a view, in node order.
std::vector<GraphEdge> edges_of(const GraphView& view);

/// Estimated floating-point operations of a node: 2·M·N·K for matmul and linear (and their
/// backward, as matmuls), 4·B·H·S²·D for sdpa (8· for its backward), else one per output element.
double node_flops(const ir::Node& node);


class HookSet {
 public:
  HookSet() = default;
  /// Makes and initialises the hooks named in `names` (config hooks.enable), each with its
  /// options (`options["timeline"]` from [hooks.timeline]) and `base` with name and
  /// output_dir = <dump_folder>/hooks/<name> filled in (created). Throws std::invalid_argument
  /// naming hooks.enable and the hooks available for an unknown name or a plugin of another
  /// kind, and the hook's name for an error in its init (a bad option).
  HookSet(PluginRegistry& registry, const std::vector<std::string>& names,
          const std::map<std::string, std::map<std::string, std::string>>& options, const HookContext& base,
          const std::string& dump_folder);

  bool empty() const noexcept { return hooks_.empty(); }
  std::vector<std::string> names() const;

  /// The compile stages, validation included, for the logical graph and the rank graphs of
  /// `ranks`: captured, propagated (validated), then per rank rewritten (validated) and
  /// planned (the RuntimePlan that `options` make). Throws ValidationError ("hook NAME: ...") when a validator stops the job.
  void compile(const sharding::DistributedPlan& plan, const std::vector<std::int64_t>& ranks, const plan::PlanOptions& options = {});
  void collective(const CollectiveInfo& info);
  void step_end(const StepInfo& step);
  /// Thread-safe against the calls above (a signal thread may call it).
  void failure(const std::string& what);
  void finish();

 private:
  struct Entry {
    std::string name;
    std::unique_ptr<Hook> hook;
    int errors = 0;
  };
  // Calls f(hook) for every live hook; reports other exceptions (hook name and `callback`),
  // lets ValidationError through.
  template <class F>
  void each(const char* callback, F&& f);
  void validate(const GraphView& view);
  std::vector<Entry> hooks_;
  std::unique_ptr<std::mutex> failure_mutex_ = std::make_unique<std::mutex>();
};

/// The hooks a config enables (hooks.enable, options from [hooks.<name>]), writing under
/// <job.dump_folder>/hooks/. An options table of a hook that hooks.enable does not list is
/// ignored with a warning (a command line may enable other hooks than the file). Throws what
/// HookSet's constructor throws.
HookSet make_hooks(const config::Config& cfg, PluginRegistry& registry, const HookContext& base);

}  // namespace spmdx::hooks
