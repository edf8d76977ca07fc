// DistributedExecutor: runs this rank's graph (sharding::rank_graph) for real, with a comm
// backend for its collectives. A collective is issued as soon as its input is computed and
// waited for only when a node first needs its output (as torch.distributed._spmd's
// schedule_comm_wait), so the backend's communication thread works while compute goes on.
// On a GPU (device.h) the waits are between streams: a backend that is StreamOrdered (comm.h)
// starts each call after an event of the compute stream, and the compute stream waits on the
// call's event before its first reader; the host waits for every call once per step, after
// the step's kernels are queued (where timeouts and failed peers are reported).
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "spmdx/comm.h"
#include "spmdx/comm/staging.h"
#include "spmdx/exec/device.h"
#include "spmdx/exec/executor.h"
#include "spmdx/hook.h"
#include "spmdx/plan/memory_plan.h"
#include "spmdx/plan/runtime_plan.h"
#include "spmdx/sharding/mesh.h"

namespace spmdx::hooks {
class HookSet;
}

namespace spmdx::exec {

/// Per-run timings, in seconds.
struct RunStats {
  double total = 0;          ///< wall time of run()
  double comm = 0;           ///< time at least one collective was moving data (union of the backend's spans)
  double exposed_comm = 0;   ///< time the compute thread waited for collectives
  double hidden_comm = 0;    ///< of `comm`, the time compute was not waiting (it ran kernels)
  /// Hidden / total communication time (0 without communication, or when the backend does
  /// not report its spans).
  double overlap_ratio() const noexcept { return comm > 0 ? std::clamp(hidden_comm / comm, 0.0, 1.0) : 0.0; }
  std::int64_t collectives = 0;
  double comm_bytes = 0;     ///< bytes of the tensors handed to collectives
  /// Bytes: the device's allocator peak over the step (Device::peak_memory_bytes: the CPU
  /// allocator's count, or the CUDA caching allocator's), which plan::plan_memory predicts;
  /// without a device, the most the step's values held at once (each storage once).
  std::int64_t peak_bytes = 0;
  /// Nodes the memory plan writes in place that ran out of place because their input's
  /// storage was still shared at run time (0 when the plan holds).
  std::int64_t in_place_fallbacks = 0;
};

class DistributedExecutor {
 public:
  /// `graph` is this rank's; `backend` is initialised with the mesh's ranks. Makes one group per
  /// mesh dim (every rank calls this in the same order) and the RuntimePlan it runs by
  /// (`options`: buckets, prefetch, overlap). Throws std::invalid_argument for an op without a
  /// kernel.
  /// `device`: where the inputs live and kernels run (outlives the executor); null: the CPU.
  /// `rank_memory`: each rank's memory (job/devices.h), in a mesh of CUDA and CPU ranks; on a
  /// CUDA rank whose groups hold a host rank, the calls go through comm::StagingBackend (staged
  /// through pinned host memory where the backend cannot move both). Empty: every rank's is
  /// this rank's.
  DistributedExecutor(const ir::Graph& graph, const sharding::DeviceMesh& mesh, std::int64_t rank, CommBackend* backend,
                      double timeout_seconds, const plan::PlanOptions& options = {}, Device* device = nullptr,
                      std::vector<MemoryType> rank_memory = {});
  const plan::RuntimePlan& plan() const noexcept { return plan_; }
  /// The memory plan it follows (in-place writes) and its predicted peak.
  const plan::MemoryPlan& memory() const noexcept { return memory_; }

  /// Runs the graph on this rank's local inputs (on the device's, each of the input's shape);
  /// returns its local outputs once the device has computed them. Throws std::invalid_argument
  /// for a missing input or one of another shape or device, and CommError when a collective
  /// fails or times out (naming the collective and the peer).
  TensorMap run(const TensorMap& inputs, std::int64_t step = 0);
  /// Reports every collective (issued, completed, failed) to `hooks`, and keeps the last run's
  /// compute and comm spans for StepInfo (spans()). Null: off.
  void set_hooks(hooks::HookSet* hooks) { hooks_ = hooks; }
  /// The last run's spans (only with hooks set, or set_record_spans(true)).
  const std::vector<Span>& spans() const noexcept { return spans_; }
  /// Keeps the compute and comm spans of the runs from now on without hooks (the profiler's
  /// steps, whose trace gets them).
  void set_record_spans(bool on) { record_spans_ = on; }
  /// Fault injection for testing the debug hooks: in `step`, this rank does not issue its
  /// collective number `index` (0-based, among the step's collective nodes in plan order, as
  /// CollectiveInfo::index counts them; a bucket member: the whole bucket) and goes on with
  /// the input (all_reduce) or zeros as the output, as a rank whose code skipped the call
  /// would. Throws std::invalid_argument when the step has no collective `index`.
  void inject_skip(std::int64_t step, std::int64_t index);
  /// Uses another backend from the next run on (hot-swap), making its groups; between runs
  /// nothing is in flight. `backend` is initialised with the same ranks.
  void set_backend(CommBackend* backend);
  /// What the staging of a mixed mesh copied (all zeros when this rank stages nothing).
  comm::StagingStats staging_stats() const { return staged_ ? staged_->stats() : comm::StagingStats{}; }
  const RunStats& stats() const noexcept { return stats_; }
  /// While a CUDA graph captures run() (Device::capture): the host neither synchronises with
  /// the device nor reads its statistics, which capture forbids.
  void set_capturing(bool on) { capturing_ = on; }
  /// The rank's compute takes `factor` times as long from the next run on: each kernel's wall
  /// time adds (factor - 1) x it to a sleep taken at the end of the run, its overshoot counted
  /// against the next (SPMDX_FAULT's slow:rank=R,factor=F, a slower device emulated on a
  /// uniform machine; collectives are not slowed, and the step's end is where the others wait
  /// for it). Sleeping after every kernel, or every 2 ms, made a step 3.5x as long at factor 3
  /// (a sleep's cost, and the kernels after it slower). 1: off. On a CPU the kernel's time is
  /// its own; on CUDA it is the launch's.
  void set_compute_slowdown(double factor) { compute_slowdown_ = factor; }

 private:
  const ir::Graph& graph_;
  std::vector<const ir::Node*> nodes_;  // graph order
  plan::RuntimePlan plan_;
  plan::MemoryPlan memory_;
  std::vector<const InPlaceKernel*> in_place_;  // per node: its in-place kernel when the memory plan writes it in place
  // Where each bucket member's data goes, in elements: all_reduce, one block per member;
  // reduce_scatter, per rank j of the group a block per member (in_offset[j]), and one output
  // block per member.
  struct MemberLayout {
    std::vector<std::int64_t> in_offset;  // per rank of the group (all_reduce: one)
    std::int64_t out_offset = 0;
    std::int64_t dim = 0, inner = 1;      // reduce_scatter: the scattered dim, elements per row
  };
  struct BucketLayout {
    std::int64_t in_numel = 0, out_numel = 0;
    std::vector<std::size_t> counts;      // reduce_scatter: elements each rank receives
  };
  std::vector<MemberLayout> member_;  // per node
  std::vector<BucketLayout> layout_;  // per bucket
  std::vector<const Kernel*> kernels_;
  std::vector<int> groups_;  // backend group id per mesh dim
  std::vector<std::vector<int>> mesh_dims_;  // the ranks of this rank's group along each mesh dim
  std::vector<std::vector<const ir::Value*>> dead_;  // per plan position: values whose last use it is
  std::vector<std::string> mesh_dim_names_;
  std::vector<std::uint64_t> seq_;  // per mesh dim: collectives issued so far over the run
  std::uint64_t p2p_seq_ = 0;       // sends and recvs issued so far over the run
  CommBackend* backend_;
  std::vector<MemoryType> rank_memory_;               // empty: one memory for the whole mesh
  std::unique_ptr<comm::HostStaging> host_staging_;  // a mixed mesh's CUDA rank: its pinned buffers
  std::unique_ptr<comm::StagingBackend> staged_;     // ... and the backend_ it calls through
  std::int64_t rank_ = 0;
  Device* device_;                     // null: the CPU
  StreamOrdered* ordered_ = nullptr;   // backend_'s, when it has it and the device has streams
  double timeout_;
  RunStats stats_;
  hooks::HookSet* hooks_ = nullptr;
  bool record_spans_ = false;
  bool spans_on() const noexcept { return hooks_ != nullptr || record_spans_; }
  bool capturing_ = false;
  double compute_slowdown_ = 1;
  double slowdown_owed_ = 0;  ///< seconds of set_compute_slowdown's sleep owed by this run (negative: overslept)
  std::vector<Span> spans_;
  std::pair<std::int64_t, std::int64_t> skip_{-1, -1};

  struct Step;  // one run's tensors and calls in flight (distributed.cpp)
  void add_to_bucket(Step& s, std::size_t pos, std::size_t index, bool skip);
  void issue_collective(Step& s, std::size_t index);
  void issue_point_to_point(Step& s, std::size_t index);
  void order_before_call();
  bool writable(const ir::Node& n, const std::vector<at::Tensor>& args, const std::vector<int>& into) const;
};

/// True for the point-to-point ops between pipeline stages, "send" and "recv" (ir/ops.cpp).
inline bool is_point_to_point(const std::string& op) { return op == "send" || op == "recv"; }
/// ATen's tensor dtype as the comm layer's; throws std::invalid_argument for bool.
CommDType comm_dtype(at::ScalarType type);

}  // namespace spmdx::exec
