// The cost model the planners price with, before anything runs: what a node's kernel costs on
// one rank (its FLOPs, or the bytes it reads and writes: the roofline's two bounds) and what a
// message costs on a mesh dim's link (alpha-beta, Hockney 1994). Propagation's intra-op
// problems (propagate.h), the redistribution plans (redistribute.h), the calibrated step
// estimate (plan/estimate.h), the memory budget and the hooks' GraphViews all read it here.
#pragma once

#include "spmdx/ir/graph.h"

namespace spmdx::sharding {

/// The alpha-beta cost model of the mesh's links, per mesh dim: alpha, the latency of one
/// message (seconds); beta, the bandwidth (bytes per second). The defaults are one host's
/// shared memory; a dim that spans hosts would use its network's numbers.
struct CostModel {
  double alpha = 10e-6;
  double beta = 10e9;
};

/// Estimated floating-point operations of a node: 2·M·N·K for matmul and linear (and their
/// backward, as matmuls), 4·B·H·S²·D for sdpa (8· for its backward), else one per output element.
double node_flops(const ir::Node& node);

/// Estimated seconds of a node's kernel on one rank: its node_flops at `flops_per_second` where
/// it does more than one per output element (matmuls, attention), else the bytes it reads and
/// writes at `bytes_per_second` (memory bound). The calibrated estimate's (plan/estimate.h) and
/// the intra-op problems' (propagate_optimal) per-node work.
double node_seconds(const ir::Node& node, double flops_per_second, double bytes_per_second);

}  // namespace spmdx::sharding
