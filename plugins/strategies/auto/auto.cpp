// auto: the planner of `[parallelism] strategy = "auto"` (planner.h). It solves one mesh dim's
// choice of a strategy per node as Alpa's intra-operator integer linear program (Zheng et al.,
// OSDI 2022, section 4.1) with COIN-OR CBC:
//   x[v][s] in {0, 1}, sum_s x[v][s] = 1                       (each node runs one candidate)
//   y[e][a][b] >= 0, sum_b y[e][a][b] = x[from][a], sum_a y[e][a][b] = x[to][b]
//                                                              (the edge's pair, linearised)
//   minimise sum node_cost[v][s] x[v][s] + sum edge cost[a][b] y[e][a][b]
// The marginal constraints on y (instead of y >= x + x - 1) keep the LP relaxation tight: on a
// tree it is integral. Nodes with one candidate and edges whose costs do not depend on the
// choice are folded into constants or into their other end's costs; repeated edges between two
// nodes are summed. Costs are scaled to microseconds so that CBC's tolerances (1e-6 .. 1e-9)
// do not round them away. The host's greedy choice is the MIP start, so the time limit never
// returns worse than it.
#include <spmdx/plugin.h>

#include <Cbc_C_Interface.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <memory>
#include <stdexcept>
#include <utility>
#include <vector>

namespace {

constexpr double kScale = 1e6;  // seconds -> microseconds
// The largest cost handed to CBC, in microseconds: its simplex refuses |c| >= 1e25, and costs
// this large mean "never" anyway (a forbidden choice, or a calibration of absurd rates).
constexpr double kMaxCost = 1e15;

double scaled(double seconds) { return std::min(seconds * kScale, kMaxCost); }

void check(const spmdx::PlannerProblem& p) {
  const std::size_t n = p.node_cost.size();
  for (std::size_t v = 0; v < n; ++v) {
    if (p.node_cost[v].empty()) throw std::invalid_argument("auto planner: node " + std::to_string(v) + " of mesh dim " + p.mesh_dim + " has no candidate");
  }
  for (std::size_t i = 0; i < p.edges.size(); ++i) {
    const auto& e = p.edges[i];
    if (e.from < 0 || e.to < 0 || static_cast<std::size_t>(e.from) >= n || static_cast<std::size_t>(e.to) >= n || e.from == e.to) {
      throw std::invalid_argument("auto planner: edge " + std::to_string(i) + " (" + std::to_string(e.from) + " -> " + std::to_string(e.to) +
                                  ") of mesh dim " + p.mesh_dim + " does not join two nodes of the " + std::to_string(n));
    }
    const std::size_t want = p.node_cost[static_cast<std::size_t>(e.from)].size() * p.node_cost[static_cast<std::size_t>(e.to)].size();
    if (e.cost.size() != want) {
      throw std::invalid_argument("auto planner: edge " + std::to_string(i) + " of mesh dim " + p.mesh_dim + " has " + std::to_string(e.cost.size()) +
                                  " costs for " + std::to_string(want) + " pairs of candidates");
    }
  }
  if (!p.start.empty() && p.start.size() != n) throw std::invalid_argument("auto planner: the start choice has " + std::to_string(p.start.size()) + " entries for " + std::to_string(n) + " nodes");
}

class AutoPlanner final : public spmdx::Planner {
 public:
  spmdx::PlannerSolution solve(const spmdx::PlannerProblem& p) const override {
    check(p);
    const auto t0 = std::chrono::steady_clock::now();
    const std::size_t n = p.node_cost.size();
    // Linear costs per node candidate, with the edges to single-candidate nodes folded in.
    std::vector<std::vector<double>> lin = p.node_cost;
    std::map<std::pair<std::int32_t, std::int32_t>, std::vector<double>> pairs;  // both ends free
    double constant = 0;
    for (const auto& e : p.edges) {
      const auto f = static_cast<std::size_t>(e.from), t = static_cast<std::size_t>(e.to);
      const std::size_t nf = lin[f].size(), nt = lin[t].size();
      const auto [lo, hi] = std::minmax_element(e.cost.begin(), e.cost.end());
      if (*hi - *lo <= 1e-15) {
        constant += *lo;
        continue;
      }
      if (nf == 1) {
        for (std::size_t b = 0; b < nt; ++b) lin[t][b] += e.cost[b];
      } else if (nt == 1) {
        for (std::size_t a = 0; a < nf; ++a) lin[f][a] += e.cost[a];
      } else {
        auto& m = pairs[{e.from, e.to}];
        if (m.empty()) m.assign(nf * nt, 0.0);
        for (std::size_t k = 0; k < m.size(); ++k) m[k] += e.cost[k];
      }
    }
    // Columns: x of free nodes, then y of free pairs. Rows: one per free node, then per pair
    // the marginals (nf + nt rows).
    std::vector<std::int64_t> first_x(n, -1);
    std::vector<double> obj, lb, ub;
    std::vector<std::vector<std::pair<int, double>>> col_rows;  // per column: (row, coeff)
    int rows = 0;
    for (std::size_t v = 0; v < n; ++v) {
      if (lin[v].size() == 1) continue;
      first_x[v] = static_cast<std::int64_t>(obj.size());
      const double cheapest = *std::min_element(lin[v].begin(), lin[v].end());
      for (double c : lin[v]) {
        const bool forbidden = c >= p.forbidden && cheapest < p.forbidden;
        obj.push_back(forbidden ? 0.0 : scaled(c));
        lb.push_back(0);
        ub.push_back(forbidden ? 0 : 1);
        col_rows.push_back({{rows, 1.0}});
      }
      ++rows;
    }
    const std::size_t n_x = obj.size();
    std::vector<double> row_lo(static_cast<std::size_t>(rows), 1.0), row_hi(static_cast<std::size_t>(rows), 1.0);
    for (const auto& [ft, m] : pairs) {
      const auto f = static_cast<std::size_t>(ft.first), t = static_cast<std::size_t>(ft.second);
      const std::size_t nf = lin[f].size(), nt = lin[t].size();
      const int row_f = rows, row_t = rows + static_cast<int>(nf);
      for (std::size_t a = 0; a < nf; ++a) col_rows[static_cast<std::size_t>(first_x[f]) + a].push_back({row_f + static_cast<int>(a), -1.0});
      for (std::size_t b = 0; b < nt; ++b) col_rows[static_cast<std::size_t>(first_x[t]) + b].push_back({row_t + static_cast<int>(b), -1.0});
      for (std::size_t a = 0; a < nf; ++a) {
        for (std::size_t b = 0; b < nt; ++b) {
          obj.push_back(scaled(std::min(m[a * nt + b], p.forbidden)));
          lb.push_back(0);
          ub.push_back(1);
          col_rows.push_back({{row_f + static_cast<int>(a), 1.0}, {row_t + static_cast<int>(b), 1.0}});
        }
      }
      rows += static_cast<int>(nf + nt);
      row_lo.resize(static_cast<std::size_t>(rows), 0.0);
      row_hi.resize(static_cast<std::size_t>(rows), 0.0);
    }

    spmdx::PlannerSolution out;
    out.choice.assign(n, 0);
    for (std::size_t v = 0; v < n; ++v) {
      if (lin[v].size() == 1) continue;
      if (!p.start.empty()) out.choice[v] = p.start[v];
      else out.choice[v] = static_cast<std::int32_t>(std::min_element(lin[v].begin(), lin[v].end()) - lin[v].begin());
    }
    std::string what = std::to_string(n) + " nodes, " + std::to_string(obj.size()) + " columns, " + std::to_string(rows) + " rows";
    if (n_x > 0) {
      std::vector<int> start{0}, index;
      std::vector<double> value;
      for (const auto& c : col_rows) {
        for (const auto& [r, coeff] : c) index.push_back(r), value.push_back(coeff);
        start.push_back(static_cast<int>(index.size()));
      }
      std::unique_ptr<Cbc_Model, void (*)(Cbc_Model*)> model(Cbc_newModel(), Cbc_deleteModel);
      Cbc_loadProblem(model.get(), static_cast<int>(obj.size()), rows, start.data(), index.data(), value.data(), lb.data(), ub.data(), obj.data(),
                      row_lo.data(), row_hi.data());
      for (std::size_t c = 0; c < n_x; ++c) Cbc_setInteger(model.get(), static_cast<int>(c));
      Cbc_setLogLevel(model.get(), 0);
      Cbc_setMaximumSeconds(model.get(), std::max(0.1, p.time_limit_seconds));
      if (!p.start.empty()) {
        std::vector<int> idx;
        std::vector<double> ones;
        for (std::size_t v = 0; v < n; ++v) {
          if (first_x[v] >= 0) idx.push_back(static_cast<int>(first_x[v] + p.start[v])), ones.push_back(1.0);
        }
        Cbc_setMIPStartI(model.get(), static_cast<int>(idx.size()), idx.data(), ones.data());
      }
      Cbc_solve(model.get());
      const double* x = Cbc_getColSolution(model.get());
      if (x != nullptr && Cbc_numberSavedSolutions(model.get()) > 0) {
        std::vector<std::int32_t> found(n, 0);
        for (std::size_t v = 0; v < n; ++v) {
          if (first_x[v] < 0) continue;
          std::size_t best = 0;
          for (std::size_t s = 1; s < lin[v].size(); ++s) {
            if (x[first_x[v] + static_cast<std::int64_t>(s)] > x[first_x[v] + static_cast<std::int64_t>(best)]) best = s;
          }
          found[v] = static_cast<std::int32_t>(best);
        }
        if (spmdx::planner_cost(p, found) <= spmdx::planner_cost(p, out.choice)) out.choice = std::move(found);
      }
      out.optimal = Cbc_isProvenOptimal(model.get()) != 0;
      out.bound = Cbc_getBestPossibleObjValue(model.get()) / kScale + constant;
    } else {
      out.optimal = true;
    }
    out.objective = spmdx::planner_cost(p, out.choice);
    if (out.optimal) out.bound = out.objective;
    out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    out.solver = std::string("CBC ") + Cbc_getVersion() + " (COIN-OR), " + what;
    return out;
  }
};

void register_auto(spmdx::Registrar& r) {
  r.add_planner("auto", [](const spmdx::Options&) { return std::make_unique<AutoPlanner>(); });
}

}  // namespace

SPMDX_PLUGIN("auto", strategy, "0.1.0",
             "strategy = \"auto\": chooses each op's placements per mesh dim by an integer linear program (Alpa's intra-op pass), solved by COIN-OR CBC",
             register_auto)
