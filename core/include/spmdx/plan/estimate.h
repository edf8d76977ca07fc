// The calibrated cost model of `spmdx compile --estimate` and `strategy = "auto"`: how long one
// rank's step takes, predicted before any rank starts, from rates measured on this machine (as
// Alpa profiles its mesh: Zheng et al., OSDI 2022, section 6). Compute: each node's FLOPs
// (sharding::node_flops, sharding/cost_model.h) at the measured matmul rate, or the bytes it reads and writes at the
// measured memory rate, whichever the node is bound by. Communication: the plan's messages and
// bytes per mesh dim by the alpha-beta model (Hockney 1994) with alpha and beta fitted from
// `spmdx bench comm --calibrate` per link (this host's shared memory; between hosts).
// No LibTorch: exec/calibrate.h measures the compute rates.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "spmdx/ir/graph.h"
#include "spmdx/sharding/propagate.h"

namespace spmdx::plan {

/// Measured rates, as `calibration.json` in the job's dump folder keeps them.
struct Calibration {
  double matmul_flops_per_second = 50e9;   ///< f32 matmul on one thread
  /// bfloat16 matmuls on one thread, as the kernels run them on this CPU (native or upcast,
  /// exec::half_gemm); 0: unknown, priced at the float32 rate.
  double half_matmul_flops_per_second = 0;
  /// float16 matmuls, likewise (a CPU may run bfloat16 native and float16 upcast); 0: the float32 rate.
  double float16_matmul_flops_per_second = 0;
  double memory_bytes_per_second = 10e9;   ///< an elementwise op's bytes read + written per second, one thread
  double node_seconds = 5e-6;             ///< a kernel's fixed cost (ATen's dispatch, allocation): a 1-element add, one thread
  std::string compute_source = "defaults (not measured)";
  /// What a collective costs beyond its messages and bytes inside a step: ranks reaching it at
  /// different times (ranks sharing cores wait on each other's time slices). Fitted to a real
  /// run's exposed communication by `spmdx bench fit`; 0 until then.
  double collective_seconds = 0;
  std::string collective_source = "not fitted (spmdx bench fit)";
  sharding::CostModel intra_host{};        ///< ranks of one host (shared memory)
  sharding::CostModel inter_host{50e-6, 1.25e9};  ///< ranks on different hosts (TCP: 10 Gb/s)
  std::string intra_source = "defaults (not measured)", inter_source = "defaults (not measured)";

  /// {"format": "spmdx.calibration/1", "compute": {...}, "links": {"intra_host": {alpha_s,
  /// beta_bytes_per_s, source}, "inter_host": {...}}}.
  std::string to_json() const;
  /// Throws std::invalid_argument naming `where` and the key for malformed JSON or a rate <= 0.
  static Calibration from_json(const std::string& text, const std::string& where);
  /// The matmul rate for nodes computing in `dtype` (bfloat16's or float16's own when known).
  double matmul_rate(ir::DType dtype) const {
    if (dtype == ir::DType::bf16 && half_matmul_flops_per_second > 0) return half_matmul_flops_per_second;
    if (dtype == ir::DType::f16 && float16_matmul_flops_per_second > 0) return float16_matmul_flops_per_second;
    return matmul_flops_per_second;
  }
  /// One line: "matmul 61.2 GFLOP/s, memory 9.8 GB/s a thread; shared memory 12 us, 4.1 GB/s; ...".
  std::string str() const;
};

/// <dump_folder>/calibration.json.
std::filesystem::path calibration_path(const std::filesystem::path& dump_folder);
/// The file's calibration, or the defaults when it does not exist. Throws std::invalid_argument
/// naming the file when it cannot be read or parsed.
Calibration load_calibration(const std::filesystem::path& file);
/// Writes it atomically (files.h), creating the folder.
void save_calibration(const std::filesystem::path& file, const Calibration& c);
/// Least-squares alpha and beta of the ring model t = messages * alpha + bytes / beta from a
/// sweep of (messages, bytes sent per rank, seconds) points (spmdx bench comm's out-of-place
/// times); alpha >= 0. Throws std::invalid_argument with fewer than 2 distinct sizes.
sharding::CostModel fit_alpha_beta(const std::vector<double>& messages, const std::vector<double>& bytes, const std::vector<double>& seconds);

/// The links of `mesh`'s dims: a dim whose ranks span hosts of `ranks_per_host` uses
/// inter_host, the others intra_host (row-major: dim d's ranks are stride apart, stride the
/// product of the later dims' sizes).
std::vector<sharding::CostModel> mesh_links(const sharding::DeviceMesh& mesh, std::int64_t ranks_per_host, const Calibration& c);

/// One rank's predicted step.
struct StepEstimate {
  double compute_seconds = 0;  ///< its graph's nodes at the calibrated rates (times its threads), times the core sharing
  double comm_seconds = 0;     ///< its collectives and pipeline sends by alpha-beta, per mesh dim's link, plus issues x collective_seconds
  double bubble_seconds = 0;   ///< with pipeline stages: the schedule's idle time (pipeline_step); 0 otherwise
  double step_seconds = 0;     ///< compute + comm + bubble: the CPU's comm runs on the same cores, so none is assumed hidden
  std::int64_t threads = 1;    ///< a rank's intra-op threads: max(1, cores / ranks_per_host), as spmdx run gives them
  double core_sharing = 1;     ///< ranks_per_host x threads / cores (>= 1): compute slows by it
  std::vector<double> comm_seconds_by_dim;  ///< per dim of the mesh the rank runs on (pp first with pipeline stages)
  std::vector<double> comm_bytes_by_dim;
  std::int64_t peak_bytes = 0;  ///< the memory plan's (with pipeline stages: the largest stage's)
  std::int64_t issues = 0;      ///< collective calls a step (RuntimePlan::issues: buckets count once)
  std::int64_t nodes = 0;       ///< kernels a step (communication ops excluded)
  std::int64_t stages = 1;      ///< pipeline stages (pipeline_step: the stages given; the caller sets the pipeline's count)
  double bubble_fraction = 0;   ///< the schedule's idle share (train::bubble_fraction)
  std::vector<double> stage_seconds;  ///< per stage priced, its busy time (compute + comm), with pipeline stages
  std::vector<std::int64_t> priced_stages;  ///< the stages stage_seconds are of (the caller's: pipeline_step leaves it empty)
};

/// What one rank's program sends a step, per dim of the mesh it runs on.
struct Traffic {
  std::vector<double> bytes_by_dim;     ///< bytes the rank sends
  std::vector<double> messages_by_dim;  ///< messages it sends
};

/// The traffic of `rank_graph` (a rank's program, as rank_program makes it) on `mesh` (the mesh
/// it runs on: train::run_mesh): each collective node on its mesh_dim attribute by the ring
/// algorithms' counts, as sharding::redistribute_plan prices the step that made it (all_reduce
/// 2(k-1)/k of its input in 2(k-1) messages; reduce_scatter and all_to_all (k-1)/k of the input,
/// all_gather of the output, in k-1 messages), and each pipeline send (a value to the next or
/// previous stage: its bytes in one message) on the mesh dim named "pp".
Traffic rank_traffic(const ir::Graph& rank_graph, const sharding::DeviceMesh& mesh);

/// The compute seconds of `rank_graph`'s nodes (communication ops, sends and recvs excluded) at `c`'s rates on
/// `threads` threads (the rates scaled linearly), each plus c.node_seconds.
double compute_seconds(const ir::Graph& rank_graph, const Calibration& c, std::int64_t threads = 1);
/// `rank_graph` (a rank's program) on `mesh` (the mesh it runs on) and its `traffic`: compute
/// at the calibrated rates times core sharing, communication per mesh dim over mesh_links plus
/// `issues` (RuntimePlan::issues) x c.collective_seconds. `peak_bytes` from the caller's memory plan.
StepEstimate estimate_step(const ir::Graph& rank_graph, const sharding::DeviceMesh& mesh, const Traffic& traffic, const Calibration& c,
                           std::int64_t ranks_per_host, std::int64_t cores, std::int64_t peak_bytes, std::int64_t issues = 0);

/// A pipelined step from each stage's estimate (estimate_step of the program of a rank of that
/// stage): the slowest stage's busy time B, which the schedule stretches to B / (1 - bubble)
/// (GPipe and 1F1B: bubble = (stages - 1) / (microbatches + stages - 1), Huang et al. 2019,
/// Narayanan et al. 2021; train::bubble_fraction). Compute and comm are the slowest stage's, the
/// peak the largest stage's. Throws std::invalid_argument for no stages or a bubble outside [0, 1).
StepEstimate pipeline_step(const std::vector<StepEstimate>& stages, double bubble_fraction);

/// A run's measured step (its metrics.jsonl: the median after `warmup` steps of exposed_comm_ms,
/// comm_bytes and collectives) fitted into c.collective_seconds: (exposed communication - the
/// bytes at the host link's beta) / collectives, at least 0. Throws std::invalid_argument
/// naming the file when it has no such steps.
Calibration fit_collective_seconds(Calibration c, const std::filesystem::path& metrics, std::int64_t warmup = 2);

}  // namespace spmdx::plan
