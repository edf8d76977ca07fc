// Expert parallelism's token exchange (issue 46) in the blocked form the graph holds it in: a
// layer's routed slots as [P, S, D], block p the S slots of the tokens of data-parallel rank p,
// sorted by expert; counts [P, E] how many of block p's slots go to each of the E experts, which
// lie in P groups of E / P (expert e on rank e / (E / P)). expert_dispatch moves every slot to the
// block of its expert's rank, expert_combine moves it back: on one device a permutation (its
// kernel below, which defines the numbers); sharded Shard(0) over the expert-parallel mesh dim,
// each rank holds its own block and the rewriter makes the node an all_to_all_v (ops/comm.cpp)
// that moves only the rows each pair exchanges, as torchtitan's all_to_all dispatch
// (models/moe token_dispatcher / expert_parallel.py: the counts exchanged first, then the rows
// with split sizes known at run time, then regrouped by local expert).
#include "common.h"

namespace spmdx::ops {
namespace {

// The mesh dim whose ranks hold the blocks (and the experts): its strategy is Shard(0), made an
// all_to_all_v by the rewriter; "" on one device.
[[maybe_unused]] const ir::AttrSpec kExpertDim{"expert_dim", ir::AttrType::string, false, std::string("")};

// dispatch's and combine's counts: i64 [P, E], E a multiple of P.
[[maybe_unused]] void check_counts(const ir::TensorMeta& counts, std::int64_t blocks) {
  if (counts.dtype != ir::DType::i64 || counts.rank() != 2 || counts.shape[0] != blocks || counts.shape[1] % blocks != 0) {
    fail("counts must be i64 [" + std::to_string(blocks) + ", experts] with experts a multiple of " + std::to_string(blocks) + ", got " + counts.str());
  }
}

// Both ops move rows of D elements as a whole: the features may be split alike, and both are
// linear in the rows. Sharding the blocks is the exchange itself (sharding/propagate's expert
// dim takes it): no rule here claims it. Each one's gradient is the other of the output's.
[[maybe_unused]] Op exchange(const std::string& name, const std::string& inverse, ir::InferFn infer, ir::Sample sample) {
  Op op;
  OpSchema& s = op.schema;
  s.name = name;
  s.min_inputs = s.max_inputs = 2;
  s.attrs = {kExpertDim};
  s.infer = std::move(infer);
  s.vjp = [inverse](Graph& g, const Node& n, const Grads& go) {
    return Grads{g.add(inverse, {go[0], n.input(1)}, {{"expert_dim", n.attr_string("expert_dim")}}), nullptr};
  };
  s.flops = [](const Node&) { return 0.0; };  // moves rows
  s.samples = {std::move(sample)};
  op.rules = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t ranks) {
    Strategies st{{{R(), R()}, {R()}}, {{P(), R()}, {P()}}};
    if (in[0][2] >= ranks) st.push_back({{S(2), R()}, {S(2)}});
    return st;
  };
  return op;
}

}  // namespace

// expert_dispatch: slots [P, S, D], counts [P, E] -> [P, P * S, D]: block q holds, for each of its
// experts e = q E/P .. (q + 1) E/P - 1 in turn, the slots every block p sends to e, p in order
// (expert-major, so each expert's rows are contiguous for grouped_mm), then zero rows. A block's
// slots past the sum of its counts go nowhere. The gradient is expert_combine of the output's.
SPMDX_OP(exchange(
    "expert_dispatch", "expert_combine",
    [](const Metas& in, const Attributes&) {
      const ir::TensorMeta& x = *in[0];
      floating(x, "slots");
      if (x.rank() != 3) fail("slots must be [blocks, slots, features], got " + x.str());
      check_counts(*in[1], x.shape[0]);
      return std::vector{like(x, Shape{x.shape[0], x.shape[0] * x.shape[1], x.shape[2]}, x.requires_grad)};
    },
    // 2 blocks of 6 slots to 4 experts, 2 a block, each count below 2: every slot placed or left
    {"expert_dispatch", {{{2, 6, 3}}, {{2, 4}, Fill::indices, 2}}, {}}))

// expert_combine: [P, P * S, D] laid out as expert_dispatch's output, counts [P, E] -> [P, S, D]:
// every slot back in its block's place; slots past the sum of a block's counts are zero. The
// gradient is expert_dispatch of the output's.
SPMDX_OP(exchange(
    "expert_combine", "expert_dispatch",
    [](const Metas& in, const Attributes&) {
      const ir::TensorMeta& y = *in[0];
      floating(y, "rows");
      if (y.rank() != 3 || y.shape[0] == 0 || y.shape[1] % y.shape[0] != 0) fail("rows must be [blocks, blocks x slots, features], got " + y.str());
      check_counts(*in[1], y.shape[0]);
      return std::vector{like(y, Shape{y.shape[0], y.shape[1] / y.shape[0], y.shape[2]}, y.requires_grad)};
    },
    {"expert_combine", {{{2, 12, 3}}, {{2, 4}, Fill::indices, 2}}, {}}))

#if defined(SPMDX_OPS_KERNELS)
namespace {

// For each row of dispatch's output (flattened [P * P * S]), the flattened slot it holds, or -1.
std::vector<std::int64_t> dispatch_sources(const at::Tensor& counts, std::int64_t slots) {
  const at::Tensor c = counts.to(at::kCPU, at::kLong).contiguous();
  const std::int64_t blocks = c.size(0), experts = c.size(1), local = experts / blocks;
  const std::int64_t* n = c.data_ptr<std::int64_t>();
  std::vector<std::int64_t> start(static_cast<std::size_t>(blocks * experts));  // each (block, expert)'s first slot
  for (std::int64_t p = 0; p < blocks; ++p) {
    std::int64_t at = 0;
    for (std::int64_t e = 0; e < experts; ++e) {
      const std::int64_t k = n[p * experts + e];
      if (k < 0) throw std::runtime_error("expert_dispatch: counts must be >= 0, got " + std::to_string(k) + " (block " + std::to_string(p) + ", expert " + std::to_string(e) + ")");
      start[static_cast<std::size_t>(p * experts + e)] = at;
      at += k;
    }
    if (at > slots) {
      throw std::runtime_error("expert_dispatch: block " + std::to_string(p) + "'s counts sum to " + std::to_string(at) + ", more than its " + std::to_string(slots) + " slots");
    }
  }
  std::vector<std::int64_t> src(static_cast<std::size_t>(blocks * blocks * slots), -1);
  for (std::int64_t q = 0; q < blocks; ++q) {
    std::int64_t row = q * blocks * slots;
    for (std::int64_t e = q * local; e < (q + 1) * local; ++e) {
      for (std::int64_t p = 0; p < blocks; ++p) {
        for (std::int64_t i = 0; i < n[p * experts + e]; ++i) src[static_cast<std::size_t>(row++)] = p * slots + start[static_cast<std::size_t>(p * experts + e)] + i;
      }
    }
  }
  return src;
}

// The rows of dispatch's output that hold a slot, and those slots.
std::pair<at::Tensor, at::Tensor> dispatch_map(const at::Tensor& counts, std::int64_t slots, const at::Device& device) {
  const std::vector<std::int64_t> src = dispatch_sources(counts, slots);
  std::vector<std::int64_t> rows, from;
  for (std::size_t r = 0; r < src.size(); ++r) {
    if (src[r] >= 0) rows.push_back(static_cast<std::int64_t>(r)), from.push_back(src[r]);
  }
  auto to = [&](std::vector<std::int64_t>& v) { return at::tensor(v, at::TensorOptions().dtype(at::kLong)).to(device); };
  return {to(rows), to(from)};
}

}  // namespace

SPMDX_KERNEL("expert_dispatch", [](const Node&, const Tensors& x) {
  const std::int64_t blocks = x[0].size(0), slots = x[0].size(1), d = x[0].size(2);
  auto [rows, from] = dispatch_map(x[1], slots, x[0].device());
  at::Tensor out = at::zeros({blocks * blocks * slots, d}, x[0].options());
  out.index_copy_(0, rows, x[0].reshape({blocks * slots, d}).index_select(0, from));
  return one(out.view({blocks, blocks * slots, d}));
})

SPMDX_KERNEL("expert_combine", [](const Node&, const Tensors& x) {
  const std::int64_t blocks = x[0].size(0), slots = x[0].size(1) / blocks, d = x[0].size(2);
  auto [rows, from] = dispatch_map(x[1], slots, x[0].device());
  at::Tensor out = at::zeros({blocks * slots, d}, x[0].options());
  out.index_copy_(0, from, x[0].reshape({blocks * blocks * slots, d}).index_select(0, rows));
  return one(out.view({blocks, slots, d}));
})
#endif

}  // namespace spmdx::ops
