// The host side of debug hooks (interfaces/spmdx/hook.h): HookSet, which makes the hooks a
// config enables and calls them, keeping a hook's exception from taking the run down. The
// GraphViews it hands them are made in graph_view.h.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "spmdx/hook.h"
#include "spmdx/hooks/graph_view.h"
#include "spmdx/ir/graph.h"
#include "spmdx/plan/runtime_plan.h"
#include "spmdx/sharding/rewriter.h"

namespace spmdx {
class PluginRegistry;
}

namespace spmdx::hooks {

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

/// The hooks a job enables, as its config says them (job::hook_spec reads them).
struct HookSpec {
  std::vector<std::string> enabled;                                   ///< hooks.enable
  std::map<std::string, std::map<std::string, std::string>> options;  ///< hook name -> [hooks.<name>]
  std::string dump_folder;                                            ///< job.dump_folder: they write under its hooks/
  std::vector<std::string> problems;  ///< found reading the config, said with the hooks' own problems
};

/// The hooks `spec` enables, made and initialised. Throws std::invalid_argument with
/// spec.problems and what HookSet's constructor throws, a line each.
HookSet make_hooks(const HookSpec& spec, PluginRegistry& registry, const HookContext& base);

}  // namespace spmdx::hooks
