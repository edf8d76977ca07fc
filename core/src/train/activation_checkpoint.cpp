#include "spmdx/train/activation_checkpoint.h"
#include "spmdx/ir/ops.h"

#include <algorithm>
#include <map>
#include <set>
#include <stdexcept>
#include <unordered_map>

#include "spmdx/models/model.h"
#include "spmdx/sharding/redistribute.h"
#include "spmdx/train/train_step.h"

namespace spmdx::train {
namespace {

using ir::Node;
using ir::Value;

bool numbered(const std::string& layer) { return layer.find_first_of("0123456789") != std::string::npos; }

// One checkpointed layer: its forward nodes (indices into graph order), how it treats them, and
// what the rewrite needs.
struct Region {
  std::string layer;
  std::set<int> nodes;
  bool keep_matmuls = false;                  // selective "op": matmul and attention outputs stay
  std::vector<const Value*> recomputed;       // its values a backward node reads, made again
  int insert_at = -1;                         // the first backward reader of any of them
  std::vector<int> clones;                    // nodes to run again, in graph order
};

// Per forward node, the layer run it belongs to: -1 outside any numbered layer.
std::vector<int> layer_runs(const std::vector<const Node*>& nodes, const std::vector<bool>& forward, const std::set<std::string>& params,
                            std::vector<std::string>& run_layer) {
  std::vector<int> run(nodes.size(), -1);
  std::string layer;
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    if (!forward[i]) continue;
    for (const Value* in : nodes[i]->inputs()) {
      if (in->producer() == nullptr && params.count(in->name()) > 0) {
        const std::string l = models::layer_of(in->name());
        layer = numbered(l) ? l : "";
        break;
      }
    }
    if (layer.empty()) continue;
    if (run_layer.empty() || run_layer.back() != layer || (i > 0 && run[i - 1] != static_cast<int>(run_layer.size()) - 1)) run_layer.push_back(layer);
    run[i] = static_cast<int>(run_layer.size()) - 1;
  }
  return run;
}

}  // namespace

bool kept_by_selective(const std::string& op) {
  const ir::OpSchema* s = ir::OpRegistry::global().find(op);
  return s != nullptr && s->saved_by_selective;
}

ir::Graph checkpoint_activations(const ir::Graph& graph, std::size_t forward_nodes, const std::vector<std::string>& params,
                                 const ActivationCheckpoint& options, CheckpointReport* report) {
  std::vector<bool> forward(graph.num_nodes(), false);
  std::fill(forward.begin(), forward.begin() + static_cast<std::ptrdiff_t>(std::min(forward_nodes, forward.size())), true);
  return checkpoint_activations(graph, forward, params, options, report);
}

ir::Graph checkpoint_activations(const ir::Graph& graph, const std::vector<bool>& forward, const std::vector<std::string>& params,
                                 const ActivationCheckpoint& options, CheckpointReport* report) {
  if (forward.size() != graph.num_nodes()) {
    throw std::invalid_argument("checkpoint_activations: " + std::to_string(forward.size()) + " forward flags for " + std::to_string(graph.num_nodes()) + " nodes");
  }
  std::int64_t every = 0;  // selective N: every N-th layer in full
  if (options.mode == "selective" && options.selective_option != "op") {
    try {
      std::size_t used = 0;
      every = std::stoll(options.selective_option, &used);
      if (used != options.selective_option.size() || every <= 0) throw std::invalid_argument("");
    } catch (const std::exception&) {
      throw std::invalid_argument("activation_checkpoint.selective_ac_option = \"" + options.selective_option +
                                  "\": use \"op\" or a positive integer N (every N-th layer)");
    }
  } else if (options.mode != "none" && options.mode != "full" && options.mode != "selective") {
    throw std::invalid_argument("activation_checkpoint.mode = \"" + options.mode + "\": use \"none\", \"full\" or \"selective\"");
  }
  std::vector<const Node*> nodes;
  std::unordered_map<const Node*, int> index;
  for (const auto& n : graph.nodes()) {
    index[n.get()] = static_cast<int>(nodes.size());
    nodes.push_back(n.get());
  }

  // The layers checkpointed, and in each the values the backward reads that are made again.
  std::vector<std::string> run_layer;
  const std::vector<int> run = options.mode == "none" ? std::vector<int>(nodes.size(), -1)
                                                      : layer_runs(nodes, forward, {params.begin(), params.end()}, run_layer);
  std::vector<Region> regions(run_layer.size());
  for (std::size_t r = 0; r < regions.size(); ++r) {
    regions[r].layer = run_layer[r];
    // torchtitan counts layers from 1 and checkpoints those whose count N divides.
    const bool full = options.mode == "full" || (every > 0 && static_cast<std::int64_t>(r + 1) % every == 0);
    regions[r].keep_matmuls = !full;
    if (!full && every > 0) regions[r].layer.clear();  // not checkpointed
  }
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    if (forward[i] && run[i] >= 0 && !regions[static_cast<std::size_t>(run[i])].layer.empty()) regions[static_cast<std::size_t>(run[i])].nodes.insert(static_cast<int>(i));
  }
  auto region_of = [&](const Value* v) -> Region* {
    if (v->producer() == nullptr) return nullptr;
    const auto i = static_cast<std::size_t>(index.at(v->producer()));
    if (!forward[i] || run[i] < 0) return nullptr;
    Region& r = regions[static_cast<std::size_t>(run[i])];
    if (r.layer.empty() || (r.keep_matmuls && kept_by_selective(v->producer()->op()))) return nullptr;
    return &r;
  };
  std::unordered_map<const Value*, Region*> recompute;  // forward value -> the region that makes it again
  CheckpointReport done;
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    if (!forward[i]) continue;
    for (const Value* v : nodes[i]->outputs()) {
      Region* r = region_of(v);
      if (r == nullptr) continue;
      int first = -1;
      bool output = false;  // the layer's output: the next layer's input, kept for its recomputation anyway
      for (const auto& use : v->uses()) {
        const int u = index.at(use.user);
        if (!forward[static_cast<std::size_t>(u)]) {
          if (first < 0 || u < first) first = u;
        } else if (run[static_cast<std::size_t>(u)] != run[i]) {
          output = true;
        }
      }
      if (first < 0 || output) continue;  // only the forward reads it (freed after it already), or kept
      r->recomputed.push_back(v);
      r->insert_at = r->insert_at < 0 ? first : std::min(r->insert_at, first);
      recompute[v] = r;
      done.freed_bytes += v->meta().nbytes();
    }
  }
  // What each region runs again: the producers of its recomputed values, and of their inputs
  // made in the region, transitively (in graph order).
  for (Region& r : regions) {
    std::set<int> need;
    std::vector<const Value*> stack(r.recomputed.begin(), r.recomputed.end());
    while (!stack.empty()) {
      const Value* v = stack.back();
      stack.pop_back();
      if (region_of(v) != &r || !need.insert(index.at(v->producer())).second) continue;
      for (const Value* in : v->producer()->inputs()) stack.push_back(in);
    }
    r.clones.assign(need.begin(), need.end());
    if (!r.clones.empty()) ++done.layers;
    done.recomputed_nodes += static_cast<std::int64_t>(r.clones.size());
  }

  // The new graph: the same inputs, the forward, and each region's clones just before its
  // first backward reader, which (with every later backward reader) reads the clones.
  ir::Graph out;
  std::unordered_map<const Value*, Value*> map;  // old value -> new
  for (const Value* v : graph.inputs()) map[v] = out.add_input(v->name(), v->meta());
  std::multimap<int, Region*> blocks;
  for (Region& r : regions) {
    if (!r.clones.empty()) blocks.emplace(r.insert_at, &r);
  }
  std::unordered_map<const Value*, Value*> again;  // recomputed old value -> its clone
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    const auto [first, last] = blocks.equal_range(static_cast<int>(i));
    for (auto it = first; it != last; ++it) {
      std::unordered_map<const Value*, Value*> local;  // this region's clones, for each other
      for (int c : it->second->clones) {
        const Node& n = *nodes[static_cast<std::size_t>(c)];
        std::vector<Value*> in;
        for (const Value* v : n.inputs()) in.push_back(local.count(v) > 0 ? local.at(v) : map.at(v));
        const Node* copy = out.add_node(n.op(), in, n.attrs());
        for (std::size_t k = 0; k < n.outputs().size(); ++k) local[n.outputs()[k]] = copy->outputs()[k];
      }
      for (const Value* v : it->second->recomputed) again[v] = local.at(v);
    }
    const Node& n = *nodes[i];
    const bool backward = !forward[i];
    std::vector<Value*> in;
    for (const Value* v : n.inputs()) in.push_back(backward && again.count(v) > 0 ? again.at(v) : map.at(v));
    const Node* copy = out.add_node(n.op(), in, n.attrs());
    for (std::size_t k = 0; k < n.outputs().size(); ++k) map[n.outputs()[k]] = copy->outputs()[k];
  }
  for (const auto& [name, v] : graph.outputs()) out.add_output(name, map.at(v));
  if (report != nullptr) *report = done;
  return out;
}

std::int64_t keep_collective_outputs(ir::Graph& g) {
  // Value numbering: equal numbers for values computed by the same ops from the same values.
  std::unordered_map<const Value*, std::int64_t> number;
  std::unordered_map<const Value*, bool> from_batch;
  std::map<std::string, std::int64_t> table;
  std::int64_t next = 0;
  for (const Value* v : g.inputs()) {
    number[v] = next++;
    from_batch[v] = is_batch_input(v->name());
  }
  std::unordered_map<std::int64_t, Value*> first;  // a collective output's number -> the first collective output with it
  std::vector<std::pair<Value*, Value*>> merge;    // (a recomputation's collective output, the forward's)
  for (const auto& n : g.nodes()) {
    std::string key = n->op() + "(";
    bool batch = false;
    for (const Value* in : n->inputs()) {
      key += std::to_string(number.at(in)) + ",";
      batch = batch || from_batch.at(in);
    }
    key += ")";
    for (const auto& [name, value] : n->attrs()) key += name + "=" + ir::attribute_str(value) + ";";
    for (std::size_t k = 0; k < n->outputs().size(); ++k) {
      const auto it = table.emplace(key + "#" + std::to_string(k), next).first;
      if (it->second == next) ++next;
      number[n->outputs()[k]] = it->second;
      from_batch[n->outputs()[k]] = batch;
    }
    if (!sharding::is_collective(n->op()) || !batch) continue;
    const auto [it, fresh] = first.emplace(number.at(n->output()), n->output());
    if (!fresh && it->second->producer()->input(0) != n->input(0)) merge.emplace_back(n->output(), it->second);
  }
  for (const auto& [later, earlier] : merge) g.replace_all_uses(later, earlier);
  // What only the merged collectives read goes with them (never another collective: every rank
  // runs the same ones).
  std::set<const Node*> merged;
  for (const auto& [later, earlier] : merge) merged.insert(later->producer());
  std::set<const Value*> outputs;
  for (const auto& [name, v] : g.outputs()) outputs.insert(v);
  for (bool erased = true; erased;) {
    erased = false;
    std::vector<Node*> dead;
    for (const auto& n : g.nodes()) {
      const bool unused = std::all_of(n->outputs().begin(), n->outputs().end(), [&](const Value* v) { return v->uses().empty() && outputs.count(v) == 0; });
      if (unused && (merged.count(n.get()) > 0 || !sharding::is_collective(n->op()))) dead.push_back(n.get());
    }
    for (Node* n : dead) merged.erase(n);
    g.erase(dead);
    erased = !dead.empty();
  }
  return static_cast<std::int64_t>(merge.size());
}

}  // namespace spmdx::train
