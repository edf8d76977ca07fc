// The memory one rank holds while it runs its graph in a RuntimePlan's order, known before the
// step runs, and where the executor reuses storages in place. As XLA's heap simulator and
// TVM's storage rewrite do, it follows each buffer from the node that makes it to the last
// holder that lets it go, and lets an elementwise node write into an input that dies there:
//  - the graph's inputs are held by the caller for the whole step; with donate_state the
//    caller hands over the parameters and AdamW state, and adamw updates them in place (JAX's
//    buffer donation), so the step ends with one copy of the state, not two;
//  - a kernel's output is a new buffer, a view of its input's (reshape of a contiguous value,
//    transpose, permute, slice, expand), or an input's buffer it writes in place: an
//    elementwise op's (in_place_ops()) whose value dies at the node, whose buffer no other
//    value, collective or caller holds, of the output's shape and dtype;
//  - a collective holds what its lowering allocates (all_reduce a copy of its input;
//    all_gather and reduce_scatter their output, and their input moved to dim 0 when that is
//    a copy) from its issue to its completion, where its first reader waits (overlap off: at
//    once); a bucket's flat buffer from its first member on (reduce_scatter: also its output
//    buffer), all_reduce members' outputs are views of it;
//  - a value goes after its last reader (one nobody reads, after its maker); the peak is taken
//    when a node's outputs and inputs coexist, plus the node's scratch (the temporaries its
//    kernel allocates: the intermediates of exec/kernels.cpp's composite kernels, ATen's
//    contiguous() copies of strided inputs);
//  - views follow ATen's strides: each value's strides are derived as ATen's kernels lay
//    them out (TensorIterator follows its first dense input; CPU flash attention's output
//    follows q), so a reshape is a view exactly where ATen's computeStride allows one.
// The CPU device's allocator (exec/device.h) measures the same bytes; on a GPU the caching
// allocator adds its rounding. No LibTorch.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "spmdx/ir/graph.h"
#include "spmdx/plan/runtime_plan.h"

namespace spmdx::plan {

/// The predicted peak of one rank's step, what is held at it, and the in-place decisions the
/// executor follows.
struct MemoryPlan {
  std::int64_t peak_bytes = 0;   ///< the most bytes held at once
  int peak_position = -1;        ///< the position in RuntimePlan::order at which it is held
  std::int64_t parameters = 0;   ///< at the peak: parameters (adamw's first input) and their updates, bytes
  std::int64_t gradients = 0;    ///< the gradients adamw reads, bytes
  std::int64_t optimizer_state = 0;  ///< AdamW's exp_avg and exp_avg_sq, bytes
  std::int64_t communication = 0;    ///< collectives' outputs and staging buffers, buckets, bytes
  std::int64_t activations = 0;      ///< the rest: the batch, forward values kept for the backward, temporaries, bytes
  /// With run-time failover (comm.fallback): the copy of the rank's parameters and AdamW state
  /// that each step starts from, held through the step (in peak_bytes), bytes.
  std::int64_t state_copy = 0;
  void add_state_copy(std::int64_t bytes) { state_copy += bytes, peak_bytes += bytes; }
  /// The largest buffers held at the peak, largest first (at most 8): a graph input's name,
  /// `%id (op)` of the value that made it, or what a staging buffer is ("bucket 2
  /// (reduce_scatter of 16 tensors, last %1424)"); the value's type ("" for those); bytes.
  struct Held {
    std::string what, type;
    std::int64_t bytes = 0;
  };
  std::vector<Held> largest;
  /// Per node (graph order), per output: the input whose storage the kernel writes the output
  /// into, or -1 for a new storage (or a view).
  std::vector<std::vector<int>> in_place;
  std::int64_t in_place_bytes = 0;  ///< bytes per step written in place instead of allocated
  std::vector<std::int64_t> held;   ///< per position in plan order: bytes held after its node, before its releases

  /// "47.9 MiB (parameters 5.0 MiB, gradients ..., activations ...)".
  std::string str() const;
  /// For `spmdx compile --dump` (rankR.memory.txt): the peak and where it is, the largest
  /// buffers held there, then per position of `plan` (made for `graph`) its node and the bytes
  /// held after it, the in-place writes marked.
  std::string report(const ir::Graph& graph, const RuntimePlan& plan) const;
};

/// The categories of the breakdown: a buffer counts as the most important of what it holds,
/// parameter > optimizer_state > gradient (adamw's gradient input, and what it was made from
/// on its way from the backward: its reduction, bucket, clipping and casts) > communication
/// (other collectives' outputs and staging buffers) > activation.

/// Ops whose kernel can write its output into an input's storage (exec::find_in_place_kernel
/// has each): op -> the inputs that may be written, in preference order. adamw writes its
/// three outputs into inputs 0, 2 and 3 (param, exp_avg, exp_avg_sq), all or none.
const std::map<std::string, std::vector<int>>& in_place_ops();

/// Simulates `plan` over `graph` (the graph it was made for) with the plan's options
/// (overlap, donate_state, in_place). Throws std::invalid_argument when the plan's order does
/// not cover the graph.
MemoryPlan plan_memory(const ir::Graph& graph, const RuntimePlan& plan);

}  // namespace spmdx::plan
