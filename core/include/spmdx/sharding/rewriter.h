// The Rewriter (docs/DESIGN.md: "Rewriter -> DistributedGraph"): from a DistributedPlan to
// the graph one rank runs: local shapes, and the plan's redistributions as collectives
// (all_reduce, all_gather, reduce_scatter, all_to_all) and local ops (chunk, to_partial).
#pragma once

#include <cstdint>

#include "spmdx/sharding/propagate.h"

namespace spmdx::sharding {

/// The design's DistributedGraph: the IR graph one rank runs, with local shapes and explicit
/// comm nodes (an ir::Graph: every pass and the executor take it as any other graph).
using DistributedGraph = ir::Graph;

/// The graph rank `rank` runs. Every rank's graph has the same nodes in the same order (only
/// shapes and attributes differ), so collectives match up across ranks. verify()-ed. Throws
/// ir::IrError when a local shape disagrees with its ShardingSpec.
DistributedGraph rank_graph(const DistributedPlan& plan, std::int64_t rank);

}  // namespace spmdx::sharding
