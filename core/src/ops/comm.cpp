// Communication ops, inserted by the rewriter (sharding/redistribute.h) into the per-rank
// graphs: the collectives (torch.distributed's all_reduce, all_gather_into_tensor,
// reduce_scatter_tensor, all_to_all_single), to_partial's local half, and pipelining's point to
// point send and recv. They have no sharding rules (the rewriter places them) and no VJP
// (placed after autodiff). The collectives and send/recv run in the comm layer
// (exec/distributed.cpp), not as kernels; to_partial has one.
//
// mesh_dim names the process group: the ranks that differ from this one only along that mesh
// dim. sizes: the chunk sizes of all group members along `dim` (torch.chunk); index: this
// rank's position in the group.
#include "common.h"

namespace spmdx::ops {
namespace {

[[maybe_unused]] const ir::AttrSpec kMeshDim{"mesh_dim", ir::AttrType::integer, true, {}};
[[maybe_unused]] const ir::AttrSpec kReduceOp{"op", ir::AttrType::string, false, std::string("sum")};
[[maybe_unused]] const ir::AttrSpec kIndex{"index", ir::AttrType::integer, true, {}};
[[maybe_unused]] const ir::AttrSpec kPeer{"peer", ir::AttrType::integer, true, {}};
[[maybe_unused]] const ir::AttrSpec kTag{"tag", ir::AttrType::integer, true, {}};

[[maybe_unused]] Op comm(const std::string& name, int inputs, std::vector<ir::AttrSpec> attrs, ir::InferFn infer) {
  Op op;
  op.schema.name = name;
  op.schema.min_inputs = op.schema.max_inputs = inputs;
  op.schema.attrs = std::move(attrs);
  op.schema.infer = std::move(infer);
  return op;
}

[[maybe_unused]] std::vector<ir::TensorMeta> same_meta(const Metas& in, const Attributes&) { return std::vector{*in[0]}; }

}  // namespace

// all_reduce: x -> the reduction (`op`) of x over the group, as torch.distributed.all_reduce.
SPMDX_OP(comm("all_reduce", 1, {kMeshDim, kReduceOp}, same_meta))

// all_gather: this rank's chunk of `dim` -> the whole dim, every member's chunk in index order
// (torch.distributed.all_gather_into_tensor along dim).
SPMDX_OP(comm("all_gather", 1, {kMeshDim, {"dim", ir::AttrType::integer, true, {}}, {"sizes", ir::AttrType::ints, true, {}}, kIndex},
              [](const Metas& in, const Attributes& a) {
                Shape s = in[0]->shape;
                auto d = static_cast<std::size_t>(wrap_dim(std::get<std::int64_t>(a.at("dim")), in[0]->rank()));
                if (s[d] != at_index(a, "sizes")) fail("the local dim " + std::to_string(d) + " is not this rank's chunk size");
                s[d] = sum_of(std::get<Shape>(a.at("sizes")));
                return std::vector{like(*in[0], s, in[0]->requires_grad)};
              }))

// reduce_scatter: x -> this rank's chunk of `dim` of the reduction over the group
// (torch.distributed.reduce_scatter_tensor along dim).
SPMDX_OP(comm("reduce_scatter", 1, {kMeshDim, {"dim", ir::AttrType::integer, true, {}}, kReduceOp, {"sizes", ir::AttrType::ints, true, {}}, kIndex},
              scatter_dim))

// all_to_all: Shard(gather_dim) -> Shard(scatter_dim) along the group (torch.distributed.all_to_all_single).
SPMDX_OP(comm("all_to_all", 1,
              {kMeshDim, {"gather_dim", ir::AttrType::integer, true, {}}, {"scatter_dim", ir::AttrType::integer, true, {}},
               {"gather_sizes", ir::AttrType::ints, true, {}}, {"scatter_sizes", ir::AttrType::ints, true, {}}, kIndex},
              [](const Metas& in, const Attributes& a) {
                Shape s = in[0]->shape;
                auto g = static_cast<std::size_t>(wrap_dim(std::get<std::int64_t>(a.at("gather_dim")), in[0]->rank()));
                auto c = static_cast<std::size_t>(wrap_dim(std::get<std::int64_t>(a.at("scatter_dim")), in[0]->rank()));
                if (s[g] != at_index(a, "gather_sizes") || s[c] != sum_of(std::get<Shape>(a.at("scatter_sizes")))) {
                  fail("local shape does not match gather_sizes / scatter_sizes");
                }
                s[g] = sum_of(std::get<Shape>(a.at("gather_sizes")));
                s[c] = at_index(a, "scatter_sizes");
                return std::vector{like(*in[0], s, in[0]->requires_grad)};
              }))

// all_to_all_v: expert parallelism's exchange (expert_dispatch or expert_combine, `direction`,
// on this rank's block [1, rows, D] with its counts [1, E]) over the group of `members`: the
// counts first (each member learns how many of its experts' rows come from whom), then the rows
// with split sizes known only at run time (torch.distributed.all_to_all_single with
// input/output_split_sizes), regrouped expert-major on dispatch (and back before combine).
SPMDX_OP(comm("all_to_all_v", 2, {kMeshDim, {"direction", ir::AttrType::string, true, {}}, {"members", ir::AttrType::integer, true, {}}},
              [](const Metas& in, const Attributes& a) {
                Shape s = in[0]->shape;
                const std::int64_t members = std::get<std::int64_t>(a.at("members"));
                const auto& direction = std::get<std::string>(a.at("direction"));
                if (s.size() != 3 || s[0] != 1) fail("all_to_all_v: x must be one block [1, rows, features], got " + in[0]->str());
                if (direction == "dispatch") s[1] *= members;
                else if (direction == "combine" && s[1] % members == 0) s[1] /= members;
                else fail("all_to_all_v: direction must be \"dispatch\" or \"combine\" (rows a multiple of members), got \"" + direction + "\"");
                return std::vector{like(*in[0], s, in[0]->requires_grad)};
              }))

// to_partial (local, Replicate -> Partial(sum)): the value on index 0, zeros elsewhere; on
// index 0 the output is the input itself (a view, for the memory plan).
SPMDX_OP([] {
  Op op = comm("to_partial", 1, {kIndex}, same_meta);
  op.schema.layout = [](const Node& n, std::size_t, const ir::LayoutQuery& q) -> std::optional<ir::OutputLayout> {
    if (n.attr_int("index") == 0) return ir::OutputLayout{q.strides(0), true};
    return std::nullopt;
  };
  return op;
}())
SPMDX_KERNEL("to_partial", [](const Node& n, const Tensors& x) { return one(n.attr_int("index") == 0 ? x[0] : at::zeros_like(x[0])); })

// Point to point between pipeline stages (torch.distributed's isend / irecv, as
// torch.distributed.pipelining's stages exchange activations and their gradients). peer: the
// global rank on the other side; tag: what the pair's two nodes share (0 to 2^24 - 1).
// send: x -> a f32[] token, complete when x has gone (nothing reads it; the executor waits for
// it at the end of the step).
SPMDX_OP(comm("send", 1, {kPeer, kTag}, [](const Metas& in, const Attributes&) {
  return std::vector{ir::TensorMeta{{}, ir::DType::f32, in[0]->device, false}};
}))

// recv: () -> a tensor of `shape` and `dtype` ("f32", ...) from peer.
SPMDX_OP(comm("recv", 0,
              {kPeer, kTag, {"shape", ir::AttrType::ints, true, {}}, {"dtype", ir::AttrType::string, true, {}},
               {"device", ir::AttrType::string, false, std::string("cpu")}},
              [](const Metas&, const Attributes& a) {
                const auto dtype = ir::parse_dtype(std::get<std::string>(a.at("dtype")));
                if (!dtype) fail("recv: unknown dtype '" + std::get<std::string>(a.at("dtype")) + "'");
                return std::vector{ir::TensorMeta{std::get<Shape>(a.at("shape")), *dtype, std::get<std::string>(a.at("device")), false}};
              }))

}  // namespace spmdx::ops
