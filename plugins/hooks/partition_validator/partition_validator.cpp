// partition_validator: checks a sharding plan before any step runs (docs/DESIGN.md:
// TensorShardPlan::validate, partition quality):
//  - edge-cut ratio: of the propagated graph's edges (a value read by a node), the share whose
//    placements change between producer and consumer, i.e. that need a redistribution; by
//    count and by bytes;
//  - load balance: per rank, estimated FLOPs and bytes sent; the standard deviation over ranks
//    divided by the mean (coefficient of variation);
//  - memory: per rank, the train state (parameters, gradients' share, AdamW moments: the rank
//    graph's inputs) plus the peak of live activations in execution order, against a budget;
//  - per edge (OnEdgeConsistency): placements name a mesh dim each and shard a dim the tensor has;
//  - per node (OnVertexValidate): no rank holds an empty shard (more shards than elements).
// A failing check throws ValidationError (the job stops before its first step) naming the
// rank and the tensors; with fail = false it is only reported.
//
// Options ([hooks.partition_validator]): max_edge_cut_ratio (default 1: off),
// max_load_imbalance (std/mean of per-rank FLOPs, default 0.25), memory_budget (bytes per
// rank, "16GiB"; default 0: off), fail (default true).
// Output: <dump>/hooks/partition_validator/report.json and report.txt.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "spmdx/core/log.h"
#include "spmdx/files.h"
#include "spmdx/options.h"
#include "spmdx/plugin.h"
#include "spmdx/text.h"

namespace {

using nlohmann::json;

// "%526 = matmul(...) f32[8, 128, 192]": a value by its name (or the op making it) and shape.
std::string describe(const spmdx::GraphView& g, int v) {
  const auto& value = g.values[static_cast<std::size_t>(v)];
  std::string s = value.name;
  if (value.producer >= 0) s += " (" + g.nodes[static_cast<std::size_t>(value.producer)].op + ")";
  s += " " + value.dtype + "[";
  for (std::size_t i = 0; i < value.shape.size(); ++i) s += (i ? ", " : "") + std::to_string(value.shape[i]);
  return s + "]";
}

struct RankLoad {
  double flops = 0;
  double comm_bytes = 0;
  double state_bytes = 0;
  double peak_activation_bytes = 0;
  std::vector<std::pair<double, std::string>> largest;  // live at the peak, largest first
  std::vector<double> node_flops;
  std::vector<std::string> node_names;
};

double mean_of(const std::vector<double>& xs) {
  double s = 0;
  for (double x : xs) s += x;
  return xs.empty() ? 0 : s / static_cast<double>(xs.size());
}

double cv_of(const std::vector<double>& xs) {  // std / mean
  const double m = mean_of(xs);
  if (m <= 0) return 0;
  double v = 0;
  for (double x : xs) v += (x - m) * (x - m);
  return std::sqrt(v / static_cast<double>(xs.size())) / m;
}

class PartitionValidator final : public spmdx::Hook {
 public:
  explicit PartitionValidator(const spmdx::Options& options) {
    spmdx::OptionReader o("[hooks.partition_validator]", options);
    max_cut_ = o.get_double("max_edge_cut_ratio", 1.0, 0, 1);
    max_imbalance_ = o.get_double("max_load_imbalance", 0.25, 0, 1e9);
    budget_ = o.get_bytes("memory_budget", 0);
    fail_ = o.get_bool("fail", true);
    o.done();
  }

  void init(const spmdx::HookContext& context) override { context_ = context; }

  void on_vertex_validate(const spmdx::GraphView& g, int node) override {
    if (g.rank < 0) return;
    for (int v : g.nodes[static_cast<std::size_t>(node)].outputs) {
      const auto& value = g.values[static_cast<std::size_t>(v)];
      if (std::find(value.shape.begin(), value.shape.end(), 0) != value.shape.end() && warnings_.size() < 20) {
        warnings_.push_back("rank " + std::to_string(g.rank) + " holds an empty shard of " + value.name + " (" + g.nodes[static_cast<std::size_t>(node)].op +
                            "): more shards than elements along a sharded dim");
      }
    }
  }

  bool on_edge_consistency(const spmdx::GraphView& g, const spmdx::GraphEdge& e) override {
    const auto& value = g.values[static_cast<std::size_t>(e.value)];
    for (const auto* pl : {&e.from, &e.to}) {
      if (pl->empty()) continue;  // unknown (a local half of a redistribution)
      if (pl->size() != g.mesh.size()) return false;
      for (const auto& p : *pl) {
        if (p.is_shard() && (p.dim() < 0 || p.dim() >= static_cast<int>(value.shape.size()))) return false;
      }
    }
    if (g.stage == spmdx::CompileStage::propagated) {
      ++edges_;
      edge_bytes_ += static_cast<double>(value.bytes);
      if (e.from != e.to) {
        ++cut_;
        cut_bytes_ += static_cast<double>(value.bytes);
      }
    }
    return true;
  }

  void on_compile_stage(const spmdx::GraphView& g) override {
    if (g.stage != spmdx::CompileStage::rewritten) return;
    RankLoad load;
    // Liveness in execution order: inputs live throughout (the train state), others from
    // their producer to their last reader (outputs to the end).
    std::vector<int> last(g.values.size(), -1);
    for (std::size_t n = 0; n < g.nodes.size(); ++n) {
      for (int v : g.nodes[n].inputs) last[static_cast<std::size_t>(v)] = static_cast<int>(n);
    }
    for (const auto& [name, v] : g.outputs) last[static_cast<std::size_t>(v)] = static_cast<int>(g.nodes.size());
    for (int v : g.inputs) load.state_bytes += static_cast<double>(g.values[static_cast<std::size_t>(v)].bytes);
    std::set<int> live;
    double held = 0;
    std::vector<std::vector<int>> frees(g.nodes.size() + 1);
    for (std::size_t v = 0; v < g.values.size(); ++v) {
      if (g.values[v].producer >= 0 && last[v] >= 0) frees[static_cast<std::size_t>(last[v])].push_back(static_cast<int>(v));
    }
    for (std::size_t n = 0; n < g.nodes.size(); ++n) {
      const auto& node = g.nodes[n];
      load.flops += node.flops;
      load.comm_bytes += static_cast<double>(node.comm_bytes);
      load.node_flops.push_back(node.flops);
      load.node_names.push_back(node.op + " -> " + (node.outputs.empty() ? "" : g.values[static_cast<std::size_t>(node.outputs[0])].name));
      for (int v : node.outputs) {
        live.insert(v);
        held += static_cast<double>(g.values[static_cast<std::size_t>(v)].bytes);
      }
      if (held > load.peak_activation_bytes) {
        load.peak_activation_bytes = held;
        load.largest.clear();
        for (int v : live) load.largest.emplace_back(static_cast<double>(g.values[static_cast<std::size_t>(v)].bytes), describe(g, v));
      }
      for (int v : frees[n]) {
        if (live.erase(v)) held -= static_cast<double>(g.values[static_cast<std::size_t>(v)].bytes);
      }
    }
    std::vector<std::pair<double, std::string>> state;
    for (int v : g.inputs) state.emplace_back(static_cast<double>(g.values[static_cast<std::size_t>(v)].bytes), g.values[static_cast<std::size_t>(v)].name);
    load.largest.insert(load.largest.end(), state.begin(), state.end());
    std::sort(load.largest.rbegin(), load.largest.rend());
    if (load.largest.size() > 5) load.largest.resize(5);
    ranks_[g.rank] = std::move(load);
  }

  void on_compile_end() override {
    std::vector<double> flops, bytes;
    for (const auto& [r, l] : ranks_) flops.push_back(l.flops), bytes.push_back(l.comm_bytes);
    const double cut_ratio = edges_ > 0 ? static_cast<double>(cut_) / static_cast<double>(edges_) : 0;
    const double cut_bytes_ratio = edge_bytes_ > 0 ? cut_bytes_ / edge_bytes_ : 0;
    const double imbalance = cv_of(flops), bytes_imbalance = cv_of(bytes);
    json report{{"edges", edges_}, {"cut_edges", cut_}, {"edge_cut_ratio", cut_ratio}, {"edge_cut_bytes_ratio", cut_bytes_ratio},
                {"flops_std_over_mean", imbalance}, {"comm_bytes_std_over_mean", bytes_imbalance}, {"memory_budget", budget_},
                {"warnings", warnings_}, {"ranks", json::array()}};
    std::ostringstream text;
    text << "edge-cut ratio " << cut_ratio << " (" << cut_ << " of " << edges_ << " edges; " << cut_bytes_ratio << " of the bytes)\n"
         << "load: FLOPs std/mean " << imbalance << ", comm bytes std/mean " << bytes_imbalance << "\n";
    std::vector<std::string> failures;
    for (const auto& [r, l] : ranks_) {
      const double memory = l.state_bytes + l.peak_activation_bytes;
      json largest = json::array();
      std::string names;
      for (const auto& [b, n] : l.largest) {
        largest.push_back({{"tensor", n}, {"bytes", b}});
        names += (names.empty() ? "" : ", ") + n + " (" + spmdx::human_bytes(b) + ")";
      }
      report["ranks"].push_back({{"rank", r}, {"flops", l.flops}, {"comm_bytes", l.comm_bytes}, {"state_bytes", l.state_bytes},
                                 {"peak_activation_bytes", l.peak_activation_bytes}, {"memory_bytes", memory}, {"largest_tensors", largest}});
      text << "rank " << r << ": " << l.flops / 1e9 << " GFLOP, sends " << spmdx::human_bytes(l.comm_bytes) << ", memory "
           << spmdx::human_bytes(memory) << " (state " << spmdx::human_bytes(l.state_bytes) << " + activations "
           << spmdx::human_bytes(l.peak_activation_bytes) << ")\n";
      if (budget_ > 0 && memory > budget_) {
        failures.push_back("rank " + std::to_string(r) + " needs about " + spmdx::human_bytes(memory) + ", over memory_budget " +
                           spmdx::human_bytes(budget_) + "; largest tensors: " + names + ". Shard more (a larger data_parallel_shard_degree or tensor_parallel_degree) or raise the budget");
      }
    }
    if (imbalance > max_imbalance_) {
      auto [lo, hi] = std::minmax_element(flops.begin(), flops.end());
      auto rank_at = [&](std::vector<double>::iterator it) {
        auto r = ranks_.begin();
        std::advance(r, it - flops.begin());
        return r;
      };
      const auto heavy = rank_at(hi), light = rank_at(lo);
      // The nodes that differ most between the heaviest and the lightest rank.
      std::vector<std::pair<double, std::string>> diff;
      for (std::size_t n = 0; n < heavy->second.node_flops.size() && n < light->second.node_flops.size(); ++n) {
        diff.emplace_back(heavy->second.node_flops[n] - light->second.node_flops[n], heavy->second.node_names[n]);
      }
      std::sort(diff.rbegin(), diff.rend());
      std::string names;
      for (std::size_t i = 0; i < diff.size() && i < 3 && diff[i].first > 0; ++i) names += (i ? ", " : "") + diff[i].second;
      failures.push_back("load imbalance: FLOPs std/mean " + std::to_string(imbalance) + " > max_load_imbalance " + std::to_string(max_imbalance_) +
                         "; rank " + std::to_string(heavy->first) + " computes " + std::to_string(*hi / std::max(*lo, 1.0)) + "x rank " +
                         std::to_string(light->first) + ", most in: " + names + ". Uneven shards: make the sharded dims divisible by the mesh");
    }
    if (cut_ratio > max_cut_) {
      failures.push_back("edge-cut ratio " + std::to_string(cut_ratio) + " > max_edge_cut_ratio " + std::to_string(max_cut_) +
                         ": " + std::to_string(cut_) + " of " + std::to_string(edges_) + " edges need a redistribution");
    }
    for (const auto& w : warnings_) text << "warning: " << w << "\n";
    for (const auto& f : failures) text << "FAILED: " << f << "\n";
    report["failures"] = failures;
    const std::filesystem::path dir(context_.output_dir);
    spmdx::write_file_atomic(dir / "report.json", report.dump(1) + "\n");
    spmdx::write_file_atomic(dir / "report.txt", text.str());
    if (failures.empty()) {
      SPMDX_INFO("partition_validator: passed (" << ranks_.size() << " ranks, edge-cut ratio " << cut_ratio << ", FLOPs std/mean " << imbalance
                                                 << "); report in " << (dir / "report.txt").string());
      return;
    }
    // With fail on, the first failure is the job's error message; log only the others.
    for (std::size_t i = fail_ ? 1 : 0; i < failures.size(); ++i) SPMDX_ERROR("partition_validator: " << failures[i]);
    if (fail_) throw spmdx::ValidationError(failures.front() + " (report: " + (dir / "report.txt").string() + ")");
  }

  double max_cut_ = 1, max_imbalance_ = 0.25, budget_ = 0;
  bool fail_ = true;
  spmdx::HookContext context_;
  std::int64_t edges_ = 0, cut_ = 0;
  double edge_bytes_ = 0, cut_bytes_ = 0;
  std::vector<std::string> warnings_;
  std::map<int, RankLoad> ranks_;
};

void register_partition_validator(spmdx::Registrar& r) {
  r.add_hook("partition_validator", [](const spmdx::Options& o) { return std::make_unique<PartitionValidator>(o); });
}

}  // namespace

SPMDX_PLUGIN("partition_validator", hook, "0.1.0",
             "Checks a plan before any step: edge-cut ratio, per-rank load std/mean, memory vs a budget", register_partition_validator)
