// How each collective node of a rank graph becomes a call on the comm backend (internal to
// the exec library): the buffers the call moves, laid out as the backend takes them (the dim
// a collective concatenates moved outermost, all_to_all's blocks packed), and how the node's
// output tensor is made from them once the call is done. An op-keyed table, as the kernels
// are (kernels.h); DistributedExecutor issues, waits and buckets.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "spmdx/comm.h"
#include "spmdx/ir/graph.h"

namespace spmdx::exec {

/// A collective handed to the backend.
struct Lowered {
  std::unique_ptr<Work> work;           ///< the backend's call in flight
  std::vector<at::Tensor> keep;         ///< buffers the call uses: alive until it is done
  std::function<at::Tensor()> finish;   ///< the node's output, once the call is done
};

/// Issues node `n` (all_reduce, all_gather, reduce_scatter or all_to_all, with the attributes
/// ops.h gives it) on `group` with local input `x`. `before_call` runs once the call's buffers
/// are made (queued on the compute stream, on a GPU) and right before the backend's call: the
/// executor orders the backend after the compute stream there.
using Lowering = std::function<Lowered(CommBackend& backend, int group, const ir::Node& n, const at::Tensor& x, const std::function<void()>& before_call)>;

/// The lowering of a collective op; nullptr for an op without one.
const Lowering* find_lowering(const std::string& op);

/// An all_to_all_single whose split sizes only the senders know (LoweredV::output_split_sizes
/// tells the receiver's, once the call is done).
struct LoweredV : Lowered {
  std::function<std::vector<std::int64_t>()> output_split_sizes;  ///< rows from each member, once the call is done
};

/// torch.distributed.all_to_all_single(output, x, output_split_sizes=<learnt>,
/// input_split_sizes) over comm::all_to_all_v (expert parallelism's dispatch and combine; no IR
/// op issues it yet). `x` is [N, ...]: rows along the leading dim, input_split_sizes[j] of them
/// (in order) for member j of `group`, one entry per member, summing to N. finish() gives a
/// [output_rows, ...] tensor of x's dtype and device: the rows received, packed in member
/// order, then zeros; output_split_sizes() the rows received from each member (zeros when a
/// row holds no elements: the call moves elements, not rows). output_rows is
/// the most this member may receive (tokens x top_k x members for a dropless dispatch); more
/// fails the call's Work naming the counts. Throws std::invalid_argument for split sizes that
/// do not sum to N or are negative, and for a backend without all_to_all_v, naming it.
LoweredV all_to_all_single(CommBackend& backend, int group, const at::Tensor& x, const std::vector<std::int64_t>& input_split_sizes,
                           std::int64_t output_rows, const std::function<void()>& before_call);

/// Expert parallelism's exchange: node `n` (all_to_all_v, ops/comm.cpp) on this rank's block `x`
/// [1, rows, D] with its counts [1, E] (E / members experts a member). The counts go first (an
/// all_to_all of E / members each, waited for here: the rows' split sizes and their regrouping
/// follow from them), then the rows by all_to_all_single with those split sizes. "dispatch":
/// x's rows are the block's slots sorted by expert; the output [1, members x rows, D] holds, for
/// each local expert in turn, the rows every member sent it, member by member, then zeros.
/// "combine": the reverse (x laid out as dispatch's output, the output as dispatch's input; a
/// slot past the counts' sum is zero). `timeout_seconds` bounds the counts' exchange.
Lowered expert_exchange(CommBackend& backend, int group, const ir::Node& n, const at::Tensor& x, const at::Tensor& counts, double timeout_seconds,
                        const std::function<void()>& before_call);

/// A tensor's memory as the backend takes it (contiguous; host or CUDA memory by its device).
CommBuffer buffer(const at::Tensor& t);
/// "sum", "avg", "max", "min", "prod" -> the ReduceOp; throws std::invalid_argument otherwise.
ReduceOp reduce_op(const std::string& name);

}  // namespace spmdx::exec
