#include "spmdx/job/balance.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <sstream>
#include <stdexcept>

namespace spmdx::job {

RankCost fit_cost(const std::vector<std::pair<std::int64_t, double>>& points) {
  if (points.empty()) throw std::invalid_argument("fit_cost: no measurements");
  for (const auto& [rows, seconds] : points) {
    if (rows <= 0 || !(seconds > 0) || !std::isfinite(seconds)) {
      throw std::invalid_argument("fit_cost: a measurement of " + std::to_string(rows) + " rows in " + std::to_string(seconds) + " s");
    }
  }
  const auto& [newest_rows, newest_s] = points.back();
  const RankCost proportional{0, newest_s / static_cast<double>(newest_rows)};
  double n = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (const auto& [rows, seconds] : points) {
    const auto x = static_cast<double>(rows);
    n += 1, sx += x, sy += seconds, sxx += x * x, sxy += x * seconds;
  }
  const double d = n * sxx - sx * sx;
  if (d <= 0) return proportional;  // one count of rows
  const double per_row = (n * sxy - sx * sy) / d, fixed = (sy - per_row * sx) / n;
  if (!(per_row > 0) || fixed < 0) return proportional;
  return {fixed, per_row};
}

std::vector<std::int64_t> balanced_rows(std::int64_t rows, const std::vector<RankCost>& costs, std::int64_t max_rows) {
  if (costs.empty()) throw std::invalid_argument("balanced_rows: no ranks");
  for (const RankCost& c : costs) {
    if (!std::isfinite(c.per_row) || c.per_row <= 0 || !std::isfinite(c.fixed) || c.fixed < 0) {
      throw std::invalid_argument("balanced_rows: a rank's cost is " + std::to_string(c.fixed) + " s + " + std::to_string(c.per_row) +
                                  " s a row; the part a row must be finite and > 0, the fixed part finite and >= 0");
    }
  }
  const auto n = static_cast<std::int64_t>(costs.size());
  if (rows < n) throw std::invalid_argument("balanced_rows: " + std::to_string(rows) + " rows cannot give each of " + std::to_string(n) + " ranks one");
  if (max_rows > 0 && rows > n * max_rows) {
    throw std::invalid_argument("balanced_rows: " + std::to_string(rows) + " rows do not fit " + std::to_string(n) + " ranks of at most " + std::to_string(max_rows));
  }
  // Water-filling: each row goes to the rank that would finish first with it. For a bottleneck
  // (min-max) objective over separable increasing costs this greedy order is optimal.
  std::vector<std::int64_t> out(costs.size(), 1);
  for (std::int64_t left = rows - n; left > 0; --left) {
    std::size_t best = out.size();
    double best_t = 0;
    for (std::size_t i = 0; i < out.size(); ++i) {
      if (max_rows > 0 && out[i] >= max_rows) continue;
      if (const double t = costs[i].at(out[i] + 1); best == out.size() || t < best_t) best = i, best_t = t;
    }
    ++out[best];
  }
  return out;
}

double predicted_seconds(const std::vector<std::int64_t>& rows, const std::vector<RankCost>& costs) {
  double worst = 0;
  for (std::size_t i = 0; i < rows.size() && i < costs.size(); ++i) worst = std::max(worst, costs[i].at(rows[i]));
  return worst;
}

std::string split_text(const std::vector<std::int64_t>& rows) {
  std::string out;
  for (std::size_t i = 0; i < rows.size(); ++i) out += (i ? ":" : "") + std::to_string(rows[i]);
  return out;
}

std::string speeds_text(const std::vector<double>& speeds) {
  std::string out;
  for (double v : speeds) {
    char one[32];
    std::snprintf(one, sizeof one, "%s%.3g", out.empty() ? "" : " : ", v);
    out += one;
  }
  return out;
}

bool is_data_parallel_dim(const std::string& mesh_dim) { return mesh_dim == "dp_replicate" || mesh_dim == "efsdp" || mesh_dim == "dp_shard"; }

std::int64_t data_parallel_degree(const sharding::DeviceMesh& mesh) {
  std::int64_t dp = 1;
  for (const auto& d : mesh.dims()) dp *= is_data_parallel_dim(d.name) ? d.size : 1;
  return dp;
}

std::int64_t data_parallel_index(const sharding::DeviceMesh& mesh, const std::vector<std::int64_t>& coordinate) {
  std::int64_t index = 0;
  for (std::size_t i = 0; i < mesh.dims().size(); ++i) {
    if (is_data_parallel_dim(mesh.dims()[i].name)) index = index * mesh.dims()[i].size + coordinate.at(i);
  }
  return index;
}

Balancer::Balancer(const BalanceSpec& spec, std::int64_t rows, std::int64_t dp_degree, std::int64_t dp_index, int rank, int world_size, Store& store,
                   double timeout_seconds)
    : spec_(spec), global_rows_(rows), dp_degree_(dp_degree), dp_index_(dp_index), rank_(rank), world_size_(world_size), store_(store),
      timeout_(timeout_seconds), split_(balanced_rows(rows, std::vector<RankCost>(static_cast<std::size_t>(dp_degree)))) {}

std::int64_t Balancer::offset() const {
  return std::accumulate(split_.begin(), split_.begin() + dp_index_, std::int64_t{0});
}

std::vector<std::string> Balancer::exchange(const std::string& key, const std::string& mine) {
  const std::string base = "spmdx/balance/" + std::to_string(exchanges_++) + "/" + key + "/r";
  store_.set(base + std::to_string(rank_), mine);
  std::vector<std::string> all;
  for (int r = 0; r < world_size_; ++r) {
    try {
      all.push_back(r == rank_ ? mine : store_.get(base + std::to_string(r), timeout_));
    } catch (const CommError& e) {
      throw CommError("parallelism.balance: rank " + std::to_string(r) + " did not publish its " + key + " within comm.timeout_seconds (" + e.what() + ")", r);
    }
  }
  return all;
}

std::vector<RankCost> Balancer::per_index(const std::vector<std::string>& published, double* longest_step) const {
  std::vector<RankCost> out(static_cast<std::size_t>(dp_degree_), RankCost{-1, -1});
  if (longest_step != nullptr) *longest_step = 0;
  for (const auto& text : published) {
    std::istringstream in(text);
    std::int64_t index = -1;
    RankCost c;
    double step = 0;
    in >> index >> c.fixed >> c.per_row >> step;
    if (!in || index < 0 || index >= dp_degree_) throw std::runtime_error("parallelism.balance: a rank published '" + text + "', not 'index fixed per_row step'");
    RankCost& v = out[static_cast<std::size_t>(index)];
    const std::int64_t rows = split_[static_cast<std::size_t>(index)];
    if (v.per_row < 0 || c.at(rows) > v.at(rows)) v = c;  // a group of ranks (tp) goes at its slowest member's pace
    if (longest_step != nullptr) *longest_step = std::max(*longest_step, step);
  }
  for (const RankCost& v : out) {
    if (v.per_row < 0) throw std::runtime_error("parallelism.balance: a data-parallel index published no cost");
  }
  return out;
}

namespace {

std::string ms_text(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f", seconds * 1e3);
  return text;
}

// What a rank publishes: its data-parallel index, its cost line and its median step (seconds).
std::string index_cost(std::int64_t index, const RankCost& c, double step_seconds) {
  char text[128];
  std::snprintf(text, sizeof text, "%lld %.17g %.17g %.17g", static_cast<long long>(index), c.fixed, c.per_row, step_seconds);
  return text;
}

}  // namespace

bool Balancer::start(double prior, std::int64_t first_step) {
  changed_at_ = first_step - 1;
  costs_ = per_index(exchange("prior", index_cost(dp_index_, {0, 1 / (prior > 0 && std::isfinite(prior) ? prior : 1.0)}, 0)));
  const auto before = split_;
  split_ = balanced_rows(global_rows_, costs_, spec_.max_rows);
  return split_ != before;
}

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

bool Balancer::after_step(std::int64_t step, double compute_seconds, double step_seconds, std::string* said) {
  if (step > changed_at_ + 1) {  // a split's first step warms up
    window_.push_back(std::max(compute_seconds, 1e-6));
    walls_.push_back(std::max(step_seconds, 1e-6));
  }
  if (step < changed_at_ + spec_.interval || window_.empty()) return false;
  // The newest median for these rows, after the others' (at most 3 counts of rows: a speed that
  // drifts leaves the fit within a few re-plans).
  std::erase_if(measured_, [&](const auto& m) { return m.first == rows(); });
  measured_.emplace_back(rows(), median(window_));
  if (measured_.size() > 3) measured_.erase(measured_.begin());
  const std::string mine = index_cost(dp_index_, fit_cost(measured_), median(walls_));
  window_.clear(), walls_.clear();
  double wall = 0;  // the split's step: the longest of the ranks' medians
  costs_ = per_index(exchange("cost", mine), &wall);
  exchanged_after_ = step;
  // The steps each split took when last run. One that now takes longer than then by more than
  // the threshold means the ranks' speeds drifted: what was measured before is forgotten.
  const double threshold = spec_.threshold;
  const auto again = tried_.find(split_);
  const bool drifted = again != tried_.end() && wall > again->second * (1 + threshold);
  if (drifted) tried_.clear(), rejected_.clear();
  tried_[split_] = wall;
  const auto best = std::min_element(tried_.begin(), tried_.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
  const auto before = split_;
  std::string why;
  double then = 0, now = predicted_seconds(split_, costs_);
  if (best->first != split_ && best->second < wall * (1 - threshold)) {
    // The model's split ran slower than one run before (contention, or costs the line does not
    // see): back to that one, and this one is not taken again until the speeds drift.
    rejected_.insert(split_);
    split_ = best->first;
    why = "back to the fastest split measured since the speeds last drifted: its steps took " + ms_text(best->second) + " ms, " + split_text(before) + "'s " +
          ms_text(wall) + " ms";
  } else {
    const auto next = balanced_rows(global_rows_, costs_, spec_.max_rows);
    then = predicted_seconds(next, costs_);
    if (next != split_ && rejected_.count(next) == 0 && then < (1 - threshold) * now) {
      split_ = next;
      why = "predicted compute " + ms_text(then) + " ms a step, was " + ms_text(now) + " ms; steps took " + ms_text(wall) + " ms";
    }
  }
  // The speeds drifted: said with the next re-plan's line (only a change of split is said).
  if (drifted) {
    why += std::string(why.empty() ? "" : "; ") + "the speeds drifted (" + split_text(before) + "'s steps took " + ms_text(wall) +
           " ms, more than the threshold over its earlier measure): the splits measured before are forgotten";
  }
  changed_at_ = step;  // measured afresh from here, the next step warming up a new split
  if (split_ == before) return false;
  if (said != nullptr) {
    std::string lines;
    for (const RankCost& c : costs_) lines += " " + ms_text(c.fixed) + "+" + ms_text(c.per_row);
    *said = "balance: after step " + std::to_string(step) + ", rows " + split_text(split_) + " (were " + split_text(before) + "; measured ms a step, fixed + a row:" +
            lines + "; " + why + ")";
  }
  return true;
}

void Balancer::check_same_collectives(std::uint64_t hash, const std::string& what) {
  const auto all = exchange("collectives", std::to_string(hash));
  std::string differ;
  for (int r = 0; r < world_size_; ++r) {
    if (all[static_cast<std::size_t>(r)] != all[0]) differ += (differ.empty() ? "" : ", ") + std::to_string(r);
  }
  if (!differ.empty()) {
    throw std::runtime_error("parallelism.balance = \"speed\": with rows " + split_text(split_) + ", rank(s) " + differ + " would run other collectives over the " +
                             "data-parallel mesh dims than rank 0 (" + what + "); this layout cannot take unequal rows: use parallelism.balance = \"even\"");
  }
}

}  // namespace spmdx::job
