#include "spmdx/hooks/graph_view.h"

#include <map>
#include <sstream>
#include <unordered_map>

#include "spmdx/models/model.h"
#include "spmdx/sharding/cost_model.h"

namespace spmdx::hooks {
namespace {

using Placements = std::vector<Placement>;

std::string attrs_str(const ir::Node& node) {
  std::string out;
  for (const auto& [k, v] : node.attrs()) out += (out.empty() ? "" : " ") + k + "=" + ir::attribute_str(v);
  return out;
}

// Appends the graph's values and nodes to `view`; `placement_of` gives a value's placements
// (empty when unknown), `reads` a node's read placements (may be empty).
template <class PlacementOf, class Reads>
void fill(GraphView& view, const ir::Graph& graph, const std::vector<const ir::Node*>& order, const sharding::DeviceMesh& mesh,
          PlacementOf placement_of, Reads reads) {
  view.mesh = mesh.dims();
  view.world_size = static_cast<int>(mesh.size());
  std::unordered_map<const ir::Value*, int> index;
  auto add_value = [&](const ir::Value* v, int producer) {
    GraphValue gv;
    gv.name = v->name().empty() ? v->ref() : v->name();
    gv.shape = v->meta().shape;
    gv.dtype = ir::to_string(v->meta().dtype);
    gv.bytes = v->meta().nbytes();
    gv.placements = placement_of(v);
    gv.producer = producer;
    index[v] = static_cast<int>(view.values.size());
    view.values.push_back(std::move(gv));
  };
  for (const ir::Value* v : graph.inputs()) {
    add_value(v, -1);
    view.inputs.push_back(index.at(v));
  }
  for (const ir::Node* node : order) {
    GraphNode gn;
    gn.op = node->op();
    gn.attrs = attrs_str(*node);
    for (const ir::Value* v : node->inputs()) gn.inputs.push_back(index.at(v));
    for (const ir::Value* v : node->outputs()) {
      add_value(v, static_cast<int>(view.nodes.size()));
      gn.outputs.push_back(index.at(v));
    }
    gn.reads = reads(node);
    gn.flops = sharding::node_flops(*node);
    gn.collective = sharding::is_collective(gn.op);
    if (node->attrs().count("mesh_dim") > 0) gn.mesh_dim = static_cast<int>(node->attr_int("mesh_dim"));
    if (gn.collective) {
      const double k = static_cast<double>(mesh.size(gn.mesh_dim));
      const double in = static_cast<double>(node->input(0)->meta().nbytes());
      double sent = (k - 1) / k * in;                                 // reduce_scatter, all_to_all
      if (gn.op == "all_reduce") sent = 2 * (k - 1) / k * in;          // ring: reduce-scatter + all-gather
      if (gn.op == "all_gather") sent = (k - 1) * in;                  // every other block passes through
      gn.comm_bytes = static_cast<std::int64_t>(sent);
    }
    // The layer: that of a parameter it reads directly ("layers.3", "norm", "output": a
    // collective on a parameter too), else that of its input made last (a residual add that
    // reads the block before and this block's attention belongs to this block; a gradient
    // add in the backward, to the block whose backward made it), else none.
    for (const ir::Value* v : node->inputs()) {
      if (v->producer() == nullptr && v->meta().requires_grad) {
        gn.layer = models::layer_of(v->name());
        break;
      }
    }
    if (gn.layer.empty()) {
      int latest = -1;
      for (int vi : gn.inputs) {
        const int p = view.values[static_cast<std::size_t>(vi)].producer;
        if (p > latest && !view.nodes[static_cast<std::size_t>(p)].layer.empty()) latest = p;
      }
      if (latest >= 0) gn.layer = view.nodes[static_cast<std::size_t>(latest)].layer;
    }
    view.nodes.push_back(std::move(gn));
  }
  for (const auto& [name, v] : graph.outputs()) view.outputs.emplace_back(name, index.at(v));
}

// The placements after a communication node, from its input's.
Placements after(const ir::Node& node, Placements in) {
  if (in.empty() || node.attrs().count("mesh_dim") == 0) {
    if (node.op() == "chunk" || node.op() == "to_partial") return {};  // local halves: the next collective tells
    return in;
  }
  auto& p = in.at(static_cast<std::size_t>(node.attr_int("mesh_dim")));
  const std::string& op = node.op();
  if (op == "all_reduce" || op == "all_gather") p = Placement::replicate();
  if (op == "reduce_scatter") p = Placement::shard(static_cast<int>(node.attr_int("dim")));
  if (op == "all_to_all") p = Placement::shard(static_cast<int>(node.attr_int("scatter_dim")));
  return in;
}

std::vector<const ir::Node*> graph_order(const ir::Graph& graph) {
  std::vector<const ir::Node*> out;
  for (const auto& n : graph.nodes()) out.push_back(n.get());
  return out;
}

}  // namespace

GraphView captured_view(const ir::Graph& graph, const sharding::DeviceMesh& mesh) {
  GraphView view;
  view.stage = CompileStage::captured;
  fill(view, graph, graph_order(graph), mesh, [](const ir::Value*) { return Placements{}; }, [](const ir::Node*) { return std::vector<Placements>{}; });
  return view;
}

GraphView propagated_view(const sharding::DistributedPlan& plan) {
  GraphView view;
  view.stage = CompileStage::propagated;
  fill(
      view, *plan.graph, graph_order(*plan.graph), plan.mesh, [&](const ir::Value* v) { return plan.placement.at(v); },
      [&](const ir::Node* n) { return plan.inputs.at(n); });
  return view;
}

GraphView rank_view(const sharding::DistributedPlan& plan, const ir::Graph& rank_graph, int rank, const plan::RuntimePlan* runtime) {
  // rank_graph() emits each logical node after the communication nodes of its inputs, in the
  // logical order: walking both graphs together gives every value its placements.
  std::vector<const ir::Node*> logical;
  for (const auto& n : plan.graph->nodes()) logical.push_back(n.get());
  std::unordered_map<const ir::Value*, Placements> placement;
  for (const ir::Value* v : rank_graph.inputs()) {
    if (const ir::Value* lv = plan.graph->find_input(v->name())) placement[v] = plan.placement.at(lv);
  }
  std::size_t next = 0;
  for (const auto& node : rank_graph.nodes()) {
    if (sharding::is_communication(node->op())) {
      auto it = placement.find(node->input(0));
      placement[node->output()] = after(*node, it == placement.end() ? Placements{} : it->second);
    } else if (next < logical.size() && logical[next]->op() == node->op()) {
      for (std::size_t i = 0; i < node->outputs().size(); ++i) placement[node->outputs()[i]] = plan.placement.at(logical[next]->outputs()[i]);
      ++next;
    }
  }
  GraphView view;
  view.stage = runtime != nullptr ? CompileStage::planned : CompileStage::rewritten;
  view.rank = rank;
  std::vector<const ir::Node*> order = graph_order(rank_graph);
  if (runtime != nullptr) {  // the plan's execution order
    const auto nodes = order;
    for (std::size_t p = 0; p < runtime->order.size(); ++p) order[p] = nodes[static_cast<std::size_t>(runtime->order[p])];
  }
  fill(
      view, rank_graph, order, plan.mesh,
      [&](const ir::Value* v) {
        auto it = placement.find(v);
        return it == placement.end() ? Placements{} : it->second;
      },
      [](const ir::Node*) { return std::vector<Placements>{}; });
  if (runtime != nullptr) {  // view index = position in the plan's order
    for (std::size_t p = 0; p < view.nodes.size(); ++p) {
      if (!view.nodes[p].collective) continue;
      const int first = runtime->first_use[static_cast<std::size_t>(runtime->order[p])];
      view.nodes[p].wait_before = !runtime->options.overlap ? static_cast<int>(p) + 1
                                  : first < static_cast<int>(view.nodes.size()) ? first : -1;
    }
  }
  return view;
}

std::vector<GraphEdge> edges_of(const GraphView& view) {
  std::vector<GraphEdge> edges;
  for (std::size_t n = 0; n < view.nodes.size(); ++n) {
    const GraphNode& node = view.nodes[n];
    for (std::size_t i = 0; i < node.inputs.size(); ++i) {
      const GraphValue& v = view.values[static_cast<std::size_t>(node.inputs[i])];
      GraphEdge e;
      e.value = node.inputs[i];
      e.producer = v.producer;
      e.consumer = static_cast<int>(n);
      e.input_index = static_cast<int>(i);
      e.from = v.placements;
      e.to = i < node.reads.size() ? node.reads[i] : v.placements;
      edges.push_back(std::move(e));
    }
  }
  return edges;
}

}  // namespace spmdx::hooks
