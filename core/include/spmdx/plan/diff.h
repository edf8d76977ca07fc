// `spmdx diff A B`: are two compiled jobs the same, and if not, where do they differ first?
//
// A and B are what `spmdx compile --dump` writes (logical.json, plan.json, rankR.json,
// rankR.plan.json) or the same documents made in memory from a config. The graphs are matched
// structurally, as isomorphism up to value names and the order of independent nodes: every
// value gets a signature hashed from its op, attributes, output metas and its inputs'
// signatures (graph inputs: their names and metas), as Weisfeiler-Lehman refinement does on
// a DAG in one topological pass; nodes pair up by equal signatures. Then, level by level:
//  1. the logical graph: its nodes that have no counterpart and whose inputs all do (the first
//     differences; everything downstream of them differs too);
//  2. the sharding plan: for each pair of logical nodes, the placements and the
//     redistributions (collective, mesh dim, bytes) on its inputs; for each parameter, its
//     placement;
//  3. the rank graphs: local input shapes, and the collectives no counterpart matches;
//  4. the runtime plans: the buckets (op, mesh dim, bytes, members), in issue order.
// A summary counts collectives and bytes per op and mesh dim in each job (rank 0's graph).
// No LibTorch: documents are JSON text.
#pragma once

#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

namespace spmdx::plan {

/// Bad input: a missing folder or file, a document of the wrong format, a malformed one.
class DiffInputError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// One compiled job's documents, as JSON text.
struct JobDump {
  std::string label;                    ///< the folder or config it came from
  std::string logical, plan;            ///< logical.json, plan.json
  std::vector<std::string> ranks;       ///< rankR.json, R = 0, 1, ... (may be empty)
  std::vector<std::string> rank_plans;  ///< rankR.plan.json (may be shorter than ranks)
};

/// Reads a `spmdx compile --dump` folder. Throws DiffInputError naming the file.
JobDump read_dump(const std::filesystem::path& folder);

struct Difference {
  std::string level;   ///< "logical", "plan", "rank R", "runtime plan R"
  std::string where;   ///< the source: a parameter ("layers.3.attention.wo"), or op and value
  std::string what;    ///< what differs, A's side first, e.g. "P(sum)->S(0) reduce_scatter over dp_shard in B, all_reduce over tp in A"
};

/// Collectives of one op over one mesh dim, in rank 0's graph.
struct CollectiveCount {
  std::string op, mesh_dim;
  long long count_a = 0, count_b = 0;
  double bytes_a = 0, bytes_b = 0;  ///< input bytes per step on rank 0
};

struct DiffResult {
  std::string a_label, b_label;
  std::vector<Difference> differences;  ///< in graph order, level by level
  std::vector<CollectiveCount> summary;
  long long logical_nodes_a = 0, logical_nodes_b = 0, unmatched_logical = 0;
  long long ranks_compared = 0;
  double seconds = 0;
  bool equivalent() const { return differences.empty(); }
};

/// Compares job B against job A. Throws DiffInputError on malformed documents.
DiffResult diff_jobs(const JobDump& a, const JobDump& b);

/// The first `max_differences` differences, the per-level counts and the summary table.
std::string to_text(const DiffResult& d, std::size_t max_differences = 10);
/// Everything as JSON (schema "spmdx.diff/1").
std::string to_json(const DiffResult& d);

}  // namespace spmdx::plan
