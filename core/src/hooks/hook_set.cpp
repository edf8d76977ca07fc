#include "spmdx/hooks/hook_set.h"

#include <algorithm>
#include <filesystem>
#include <set>
#include <stdexcept>

#include "spmdx/core/log.h"
#include "spmdx/core/registry.h"
#include "spmdx/text.h"

namespace spmdx::hooks {
namespace {
constexpr int kMaxErrors = 10;  // after this many exceptions a hook is no longer called
constexpr int kMaxReported = 5;  // inconsistent edges printed per hook and graph
}  // namespace

HookSet::HookSet(PluginRegistry& registry, const std::vector<std::string>& names,
                 const std::map<std::string, std::map<std::string, std::string>>& options, const HookContext& base,
                 const std::string& dump_folder) {
  // Every hook is made before any is refused, so that all their problems are said at once.
  std::string problems;
  auto problem = [&](const std::string& prefix, const std::string& what) {
    for (const auto& line : split_lines(what)) problems += (problems.empty() ? "" : "\n") + prefix + line;
  };
  std::vector<std::pair<std::string, std::unique_ptr<Hook>>> made;
  std::set<std::string> seen;
  for (const auto& name : names) {
    if (!seen.insert(name).second) {
      problem("hooks.enable: ", "'" + name + "' is listed twice");
      continue;
    }
    Options opts;
    if (auto it = options.find(name); it != options.end()) opts = Options(it->second.begin(), it->second.end());
    try {
      made.emplace_back(name, registry.make_hook(name, opts));
    } catch (const PluginError& e) {
      problem("hooks.enable: ", e.what());
    } catch (const std::exception& e) {
      problem("hook " + name + ": ", e.what());
    }
  }
  if (!problems.empty()) throw std::invalid_argument(problems);
  for (auto& [name, hook] : made) {
    HookContext context = base;
    context.name = name;
    const std::filesystem::path dir = std::filesystem::path(dump_folder) / "hooks" / name;
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) throw std::runtime_error("hook " + name + ": cannot create " + dir.string() + ": " + ec.message());
    context.output_dir = dir.string();
    try {
      hook->init(context);
    } catch (const std::exception& e) {
      throw std::invalid_argument("hook " + name + ": " + e.what() + " (its options are in [hooks." + name + "])");
    }
    hooks_.push_back({name, std::move(hook), 0});
  }
}

std::vector<std::string> HookSet::names() const {
  std::vector<std::string> out;
  for (const auto& e : hooks_) out.push_back(e.name);
  return out;
}

template <class F>
void HookSet::each(const char* callback, F&& f) {
  for (auto& e : hooks_) {
    if (e.errors >= kMaxErrors) continue;
    try {
      f(*e.hook);
    } catch (const ValidationError& v) {
      throw ValidationError("hook " + e.name + ": " + v.what());
    } catch (const std::exception& x) {
      ++e.errors;
      SPMDX_ERROR("hook " << e.name << " failed in " << callback << ": " << x.what()
                          << (e.errors == kMaxErrors ? " (no longer called)" : " (the run goes on)"));
    }
  }
}

void HookSet::validate(const GraphView& view) {
  const auto edges = edges_of(view);
  const std::string where = view.rank < 0 ? std::string("the ") + to_string(view.stage) + " graph" : "rank " + std::to_string(view.rank) + "'s graph";
  for (auto& e : hooks_) {
    if (e.errors >= kMaxErrors) continue;
    try {
      for (std::size_t n = 0; n < view.nodes.size(); ++n) e.hook->on_vertex_validate(view, static_cast<int>(n));
      int bad = 0;
      for (const auto& edge : edges) {
        if (e.hook->on_edge_consistency(view, edge)) continue;
        if (++bad <= kMaxReported) {
          const auto& v = view.values[static_cast<std::size_t>(edge.value)];
          SPMDX_ERROR("hook " << e.name << ": inconsistent edge in " << where << ": " << v.name << " -> node " << edge.consumer << " ("
                              << view.nodes[static_cast<std::size_t>(edge.consumer)].op << ") input " << edge.input_index);
        }
      }
      if (bad > kMaxReported) SPMDX_ERROR("hook " << e.name << ": " << bad - kMaxReported << " more inconsistent edges in " << where);
      e.hook->on_validate_end(view);
    } catch (const ValidationError& v) {
      throw ValidationError("hook " + e.name + ": " + v.what());
    } catch (const std::exception& x) {
      ++e.errors;
      SPMDX_ERROR("hook " << e.name << " failed validating " << where << ": " << x.what() << " (the run goes on)");
    }
  }
}

void HookSet::compile(const sharding::DistributedPlan& plan, const std::vector<std::int64_t>& ranks, const plan::PlanOptions& options) {
  if (hooks_.empty()) return;
  const GraphView captured = captured_view(*plan.graph, plan.mesh);
  each("on_compile_stage(captured)", [&](Hook& h) { h.on_compile_stage(captured); });
  const GraphView propagated = propagated_view(plan);
  each("on_compile_stage(propagated)", [&](Hook& h) { h.on_compile_stage(propagated); });
  validate(propagated);
  for (std::int64_t r : ranks) {
    const ir::Graph g = sharding::rank_graph(plan, r);
    const GraphView rewritten = rank_view(plan, g, static_cast<int>(r));
    each("on_compile_stage(rewritten)", [&](Hook& h) { h.on_compile_stage(rewritten); });
    validate(rewritten);
    const plan::RuntimePlan runtime = plan::make_runtime_plan(g, plan.mesh, options);
    const GraphView planned = rank_view(plan, g, static_cast<int>(r), &runtime);
    each("on_compile_stage(planned)", [&](Hook& h) { h.on_compile_stage(planned); });
  }
  each("on_compile_end", [&](Hook& h) { h.on_compile_end(); });
}

void HookSet::collective(const CollectiveInfo& info) {
  each("on_collective", [&](Hook& h) { h.on_collective(info); });
}

void HookSet::step_end(const StepInfo& step) {
  each("on_step_end", [&](Hook& h) { h.on_step_end(step); });
}

void HookSet::failure(const std::string& what) {
  std::lock_guard lock(*failure_mutex_);
  for (auto& e : hooks_) {
    try {
      e.hook->on_failure(what);
    } catch (const std::exception& x) {
      SPMDX_ERROR("hook " << e.name << " failed in on_failure: " << x.what());
    }
  }
}

void HookSet::finish() {
  each("finish", [&](Hook& h) { h.finish(); });
}

HookSet make_hooks(const HookSpec& spec, PluginRegistry& registry, const HookContext& base) {
  const std::string typos = join(spec.problems, "\n");
  try {
    HookSet hooks(registry, spec.enabled, spec.options, base, spec.dump_folder);
    if (!typos.empty()) throw std::invalid_argument(typos);
    return hooks;
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(typos.empty() || std::string(e.what()) == typos ? std::string(e.what()) : typos + "\n" + e.what());
  }
}

}  // namespace spmdx::hooks
