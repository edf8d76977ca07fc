// Speed-balanced data parallelism (parallelism.balance = "speed", issue 49): each data-parallel
// rank takes a share of the global batch proportional to its measured throughput, in whole rows,
// so that a job of unequal ranks runs at the speed of their sum instead of the slowest's.
//
// PyTorch DDP, FSDP2 and torchtitan split the batch evenly; research systems balance by ratios
// tuned by hand or profiled once (HetPipe, Park et al., USENIX ATC 2020; Whale, Jia et al., USENIX
// ATC 2022; Cephalo, Guo et al. 2024). Here the ratio is measured while the job runs: a rank's
// cost is its compute time (the step's wall time less the time it waited for collectives), the
// median over the steps since the last re-plan, fitted as a line (fixed + rows x per_row)
// through its last splits. Every rank publishes its line and its median step in the job's store
// at the same step, reads everyone's, and computes the same split from the same numbers: the
// model's split when predicted shorter by more than parallelism.balance_threshold (hysteresis), at
// most every parallelism.balance_interval steps, or back to the fastest split measured when the
// one in force ran slower than it (the clock overrules the model).
//
// The numbers do not depend on the split: the loss is the sum of the token losses over the
// count of tokens, both summed over the ranks (models::build_model's cross_entropy "sum" / count_valid),
// so rows weigh the same wherever they run, and the global batch is the same rows in the same
// order (TextDataset: sample index s of step t is t x global_batch_size + s).
// No LibTorch here.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "spmdx/comm.h"
#include "spmdx/sharding/mesh.h"

namespace spmdx::job {

/// parallelism.balance, balance_interval, balance_threshold.
struct BalanceSpec {
  bool speed = false;          ///< "speed"; false: "even" (every data-parallel rank global / dp rows, as DDP)
  std::int64_t interval = 5;   ///< steps between two re-plans, at least 2 (the first step of a split is warm-up, not measured)
  double threshold = 0.1;      ///< re-plan when the predicted step is shorter by more than this share
  /// parallelism.balance_speeds: each data-parallel rank's relative speed (empty: not given),
  /// the split at start and what spmdx compile --estimate plans with.
  std::vector<double> speeds;
  /// The most rows a data-parallel rank may take (0: no bound): parallelism.memory_budget's,
  /// balance_max_rows (job/memory_budget.h), set by the run before it balances.
  std::int64_t max_rows = 0;
};

/// A rank's compute time for a step of `rows` rows, in seconds: fixed + rows x per_row (the
/// optimizer, the norms of the gradients and other per-step work, and the work of each row).
struct RankCost {
  double fixed = 0;
  double per_row = 1;
  double at(std::int64_t rows) const { return fixed + static_cast<double>(rows) * per_row; }
};

/// The cost line through a rank's measurements (rows, seconds), least squares: with one count of
/// rows measured, the proportional line (fixed 0); a fit whose fixed part is negative keeps the
/// proportional line through the newest point, and one whose per-row part is not positive as
/// well (noise). Throws std::invalid_argument for no points, or rows or seconds <= 0.
RankCost fit_cost(const std::vector<std::pair<std::int64_t, double>>& points);

/// The split of `rows` whole rows over ranks of costs `costs` that minimises the predicted step,
/// max_i costs_i.at(rows_i), every rank at least one row: water-filling, each row in turn to the
/// rank that would finish first with it (optimal for a min-max of separable increasing costs).
/// Ties go to the lower index, so every rank computes the same split, and equal costs give an
/// even split (rows / n each, the first rows % n ranks one more). Throws std::invalid_argument
/// for rows < costs.size(), no costs, or a per_row that is not finite and > 0 or a fixed part
/// that is not finite and >= 0. `max_rows` > 0: no rank takes more (parallelism.memory_budget's
/// bound); throws std::invalid_argument when rows > costs.size() x max_rows.
std::vector<std::int64_t> balanced_rows(std::int64_t rows, const std::vector<RankCost>& costs, std::int64_t max_rows = 0);

/// Seconds of the slowest rank under a split: max_i costs_i.at(rows_i).
double predicted_seconds(const std::vector<std::int64_t>& rows, const std::vector<RankCost>& costs);

/// "6:6:2".
std::string split_text(const std::vector<std::int64_t>& rows);
/// "1 : 0.5 : 0.5" (3 significant digits each).
std::string speeds_text(const std::vector<double>& speeds);

/// The mesh dims that split the batch (dp_replicate, efsdp, dp_shard: sharding::make_mesh's),
/// the data-parallel degree (their product) and a rank's index among them (row-major in mesh
/// order, as the batch's nested Shard(0) chunks are taken).
std::int64_t data_parallel_degree(const sharding::DeviceMesh& mesh);
std::int64_t data_parallel_index(const sharding::DeviceMesh& mesh, const std::vector<std::int64_t>& coordinate);
bool is_data_parallel_dim(const std::string& mesh_dim);

/// One rank's side of the balancing: the split in force, its measurements, and the exchanges
/// through the job's store that make every rank take the same split at the same step.
class Balancer {
 public:
  /// `rows`: the global batch; `dp_index` of `dp_degree` this rank's data-parallel index; the
  /// store and the timeout of its blocking reads (comm.timeout_seconds). The split starts even.
  Balancer(const BalanceSpec& spec, std::int64_t rows, std::int64_t dp_degree, std::int64_t dp_index, int rank, int world_size, Store& store,
           double timeout_seconds);

  /// The split at start: every rank publishes `prior` (its CPU share under spmdx run
  /// --cpu-affinity, else its host's CPUs over its ranks) and the split is proportional to each
  /// data-parallel index's smallest. `first_step`: the job's first (a resumed job's is past 1),
  /// which warms up and is not measured. Returns true when it is not the even split.
  bool start(double prior, std::int64_t first_step = 1);
  /// Records step `step`'s compute seconds and wall seconds (this rank's). After step
  /// changed_at + interval it exchanges the costs and the median steps (every rank calls this at
  /// every step, so all reach it together) and returns true when the split changed; `said` is
  /// then the line to log. The model's split is taken when predicted shorter by more than the
  /// threshold; a split whose steps ran longer than the fastest split measured by more than the
  /// threshold goes back to that one (and is not taken again until the steps of a split run
  /// longer than they did by more than the threshold: the speeds drifted).
  bool after_step(std::int64_t step, double compute_seconds, double step_seconds, std::string* said);

  const std::vector<std::int64_t>& split() const noexcept { return split_; }
  std::int64_t rows() const { return split_.at(static_cast<std::size_t>(dp_index_)); }
  /// The first global row of this rank's share: its rows are [offset, offset + rows()).
  std::int64_t offset() const;
  /// Per data-parallel index, the costs of the last exchange (at start: 1 / the prior a row).
  const std::vector<RankCost>& costs() const noexcept { return costs_; }
  /// The step after which the costs were last exchanged (a re-plan, whether or not it changed
  /// the split; 0: none yet).
  std::int64_t exchanged_after() const noexcept { return exchanged_after_; }

  /// Every rank's hash of what it runs over the data-parallel mesh dims must be the same (the
  /// collectives of a rank's plan for its rows: their ops, shapes and order); throws
  /// std::runtime_error naming the ranks that differ. An exchange of its own, after a re-plan.
  void check_same_collectives(std::uint64_t hash, const std::string& what);

 private:
  // Each rank's value under `key`, published and read through the store.
  std::vector<std::string> exchange(const std::string& key, const std::string& mine);
  // Per data-parallel index, the cost of its slowest rank at its rows ("index fixed per_row step"
  // each); `longest_step`, when given, gets the longest of the published steps.
  std::vector<RankCost> per_index(const std::vector<std::string>& published, double* longest_step = nullptr) const;

  BalanceSpec spec_;
  std::int64_t global_rows_, dp_degree_, dp_index_;
  int rank_, world_size_;
  Store& store_;
  double timeout_;
  std::vector<std::int64_t> split_;
  std::vector<RankCost> costs_;
  std::vector<double> window_;       // compute seconds of the measured steps of this split
  std::vector<std::pair<std::int64_t, double>> measured_;  // (rows, median seconds) of the last splits, one per count of rows
  std::vector<double> walls_;                              // wall seconds of the measured steps of this split
  std::map<std::vector<std::int64_t>, double> tried_;      // each split run: its step (the slowest rank's median), when last run
  std::set<std::vector<std::int64_t>> rejected_;           // splits that ran slower than the fastest tried
  std::int64_t changed_at_ = 0;      // the split in force took effect after this step
  std::int64_t exchanged_after_ = 0;
  std::int64_t exchanges_ = 0;       // part of each exchange's store key
};

}  // namespace spmdx::job
