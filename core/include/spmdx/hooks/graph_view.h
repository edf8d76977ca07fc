// GraphViews (interfaces/spmdx/hook.h): what debug hooks see of each compile stage, made from
// the IR, the sharding plan and the RuntimePlan, with estimated FLOPs per node (the cost
// model's, sharding/cost_model.h).
#pragma once

#include <vector>

#include "spmdx/hook.h"
#include "spmdx/ir/graph.h"
#include "spmdx/plan/runtime_plan.h"
#include "spmdx/sharding/rewriter.h"

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

}  // namespace spmdx::hooks
