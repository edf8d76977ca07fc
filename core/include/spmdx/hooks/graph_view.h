// GraphViews (interfaces/spmdx/hook.h): what debug hooks see of each compile stage, made from
// the IR, the sharding plan and the RuntimePlan, with estimated FLOPs per node.
#pragma once

#include <vector>

#include "spmdx/hook.h"
#include "spmdx/ir/graph.h"
#include "spmdx/plan/runtime_plan.h"
#include "spmdx/sharding/distribute.h"

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

/// Estimated seconds of a node's kernel on one rank: its node_flops at `flops_per_second` where
/// it does more than one per output element (matmuls, attention), else the bytes it reads and
/// writes at `bytes_per_second` (memory bound). The cost model's (plan/estimate.h) and the
/// intra-op problems' (sharding::propagate_optimal) per-node work.
double node_seconds(const ir::Node& node, double flops_per_second, double bytes_per_second);

}  // namespace spmdx::hooks
