// Planner plugins: choose one strategy per node of a graph, on one mesh dim, minimising a cost
// the host computed. This is the intra-operator pass of Alpa (Zheng et al., OSDI 2022,
// "Alpa: Automating Inter- and Intra-Operator Parallelism for Distributed Deep Learning",
// section 4.1): every node has candidate strategies (its sharding rules on that mesh dim), each
// with a cost of its own (compute time, the resharding of graph inputs it reads), and every edge
// between a producer and a consumer a cost per pair of their candidates (the resharding of the
// value between the producer's output placement and the one the consumer reads). The host
// builds the problem from its cost model (`strategy = "auto"`, docs/DESIGN.md "auto-sharding")
// and propagates the placements the chosen strategies give; a planner only solves it, so a
// third party can bring another solver or heuristic without seeing the graph.
// Plain C++20: part of the plugin ABI (3.2).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace spmdx {

/// One mesh dim's choice problem. Costs are seconds of one rank's step (the host's estimate);
/// a cost at or above `forbidden` marks a choice the host cannot run (a parameter read other
/// than as its strategy placed it).
struct PlannerProblem {
  std::string mesh_dim;       ///< the dim's name ("tp"), for messages
  std::int64_t ranks = 1;     ///< its size
  /// node_cost[v][s]: the cost of node v running its candidate s; every node has >= 1 candidate.
  std::vector<std::vector<double>> node_cost;
  /// A producer's candidate against a consumer's: cost[a * |to's candidates| + b] when `from`
  /// runs candidate a and `to` candidate b (row-major). from != to.
  struct Edge {
    std::int32_t from = 0;
    std::int32_t to = 0;
    std::vector<double> cost;
  };
  std::vector<Edge> edges;
  /// A feasible choice to start from (the host's greedy propagation), one per node, or empty.
  std::vector<std::int32_t> start;
  double time_limit_seconds = 10;  ///< stop then and return the best choice found
  double forbidden = 1e9;
};

struct PlannerSolution {
  std::vector<std::int32_t> choice;  ///< a candidate per node (node_cost's order)
  double objective = 0;              ///< its total cost, seconds
  double bound = 0;                  ///< the solver's lower bound on any choice's cost
  bool optimal = false;              ///< proven optimal (else the time limit ended the search)
  double seconds = 0;                ///< the solver's wall time
  std::string solver;                ///< e.g. "CBC 2.10.8 (COIN-OR), 812 nodes, 21340 columns"
};

class Planner {
 public:
  virtual ~Planner() = default;
  /// The least-cost choice of `problem` found within its time limit; at worst `start` (or
  /// each node's cheapest candidate without one). Throws std::invalid_argument for a
  /// malformed problem (an edge whose cost size is not the product of its ends' candidates,
  /// a node index out of range, a node with no candidate), naming it.
  virtual PlannerSolution solve(const PlannerProblem& problem) const = 0;
};

/// The cost of `choice` on `problem`: every node's chosen cost plus every edge's chosen pair.
/// Inline, so that host and plugins price a choice alike.
inline double planner_cost(const PlannerProblem& problem, const std::vector<std::int32_t>& choice) {
  double total = 0;
  for (std::size_t v = 0; v < problem.node_cost.size(); ++v) total += problem.node_cost[v][static_cast<std::size_t>(choice[v])];
  for (const auto& e : problem.edges) {
    const std::size_t width = problem.node_cost[static_cast<std::size_t>(e.to)].size();
    total += e.cost[static_cast<std::size_t>(choice[static_cast<std::size_t>(e.from)]) * width +
                    static_cast<std::size_t>(choice[static_cast<std::size_t>(e.to)])];
  }
  return total;
}

}  // namespace spmdx
