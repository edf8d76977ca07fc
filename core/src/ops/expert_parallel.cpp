// Expert parallelism's token exchange (issue 46) in the blocked form the graph holds it in: a
// layer's routed slots as [P, S, D], block p the S slots of the tokens of data-parallel rank p,
// sorted by expert; counts [P, E] how many of block p's slots go to each of the E experts, which
// lie in P groups of E / P (expert e on rank e / (E / P)). expert_dispatch moves every slot to the
// block of its expert's rank, expert_combine moves it back: on one device a permutation (its
// kernel below, which defines the numbers); sharded Shard(0) over the expert-parallel mesh dim,
// each rank holds its own block and the rewriter makes the node an all_to_all_v (ops/comm.cpp)
// that moves only the rows each pair exchanges, as torchtitan's all_to_all dispatch
// (models/moe token_dispatcher / expert_parallel.py: the counts exchanged first, then the rows
// with split sizes known at run time, then regrouped by local expert). With attr `group` G > 0
// the blocks exchange only within groups of G consecutive blocks ([D, S, F] is D / G such
// exchanges side by side): expert parallelism of degree G inside each replica of HSDP, whose
// groups lie on other data-parallel mesh dims, where the blocks split as whole groups.
#include "common.h"

namespace spmdx::ops {
namespace {

// The mesh dim whose ranks hold the blocks (and the experts): its strategy is Shard(0), made an
// all_to_all_v by the rewriter; "" on one device.
[[maybe_unused]] const ir::AttrSpec kExpertDim{"expert_dim", ir::AttrType::string, false, std::string("")};
// The blocks exchanged together (the expert-parallel degree); 0: all of them.
[[maybe_unused]] const ir::AttrSpec kGroup{"group", ir::AttrType::integer, false, std::int64_t{0}};

// The blocks of one exchange: attr group, or all `blocks`; a divisor of blocks.
[[maybe_unused]] std::int64_t group_of(const Attributes& attrs, std::int64_t blocks) {
  const auto it = attrs.find("group");
  const std::int64_t g = it == attrs.end() ? 0 : std::get<std::int64_t>(it->second);
  if (g < 0 || (g > 0 && blocks % g != 0)) fail("group " + std::to_string(g) + " must divide the " + std::to_string(blocks) + " blocks");
  return g == 0 ? blocks : g;
}

// dispatch's and combine's counts: i64 [D, E], E a multiple of the group G.
[[maybe_unused]] void check_counts(const ir::TensorMeta& counts, std::int64_t blocks, std::int64_t group) {
  if (counts.dtype != ir::DType::i64 || counts.rank() != 2 || counts.shape[0] != blocks || counts.shape[1] % group != 0) {
    fail("counts must be i64 [" + std::to_string(blocks) + ", experts] with experts a multiple of " + std::to_string(group) + ", got " + counts.str());
  }
}

// Both ops move rows of D elements as a whole: the features may be split alike, and both are
// linear in the rows. Sharding the blocks is the exchange itself (sharding/propagate's expert
// dim takes it): no rule here claims it. Each one's gradient is the other of the output's.
[[maybe_unused]] Op exchange(const std::string& name, const std::string& inverse, ir::InferFn infer, std::vector<ir::Sample> samples) {
  Op op;
  OpSchema& s = op.schema;
  s.name = name;
  s.min_inputs = s.max_inputs = 2;
  s.attrs = {kExpertDim, kGroup};
  s.infer = std::move(infer);
  s.vjp = [inverse](Graph& g, const Node& n, const Grads& go) {
    return Grads{g.add(inverse, {go[0], n.input(1)}, {{"expert_dim", n.attr_string("expert_dim")}, {"group", n.attr_int("group")}}), nullptr};
  };
  s.flops = [](const Node&) { return 0.0; };  // moves rows
  s.samples = std::move(samples);
  // Blocks split as whole groups (each rank's blocks exchange among themselves) on a mesh dim
  // other than the expert dim.
  op.rules = [](const Node& n, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t ranks) {
    Strategies st{{{R(), R()}, {R()}}, {{P(), R()}, {P()}}};
    if (in[0][2] >= ranks) st.push_back({{S(2), R()}, {S(2)}});
    const std::int64_t blocks = in[0][0], group = n.attr_int("group");
    if (group > 0 && blocks % ranks == 0 && (blocks / ranks) % group == 0) st.push_back({{S(0), S(0)}, {S(0)}});
    return st;
  };
  return op;
}

}  // namespace

// expert_dispatch: slots [D, S, F], counts [D, E] -> [D, G * S, F] (G: attr group, or D): in each
// group of G blocks, block q holds, for each of its experts e = q E/G .. (q + 1) E/G - 1 in turn,
// the slots every block p of its group sends to e, p in order (expert-major, so each expert's rows
// are contiguous for grouped_mm), then zero rows. A block's slots past the sum of its counts go
// nowhere. The gradient is expert_combine of the output's.
SPMDX_OP(exchange(
    "expert_dispatch", "expert_combine",
    [](const Metas& in, const Attributes& attrs) {
      const ir::TensorMeta& x = *in[0];
      floating(x, "slots");
      if (x.rank() != 3) fail("slots must be [blocks, slots, features], got " + x.str());
      const std::int64_t group = group_of(attrs, x.shape[0]);
      check_counts(*in[1], x.shape[0], group);
      return std::vector{like(x, Shape{x.shape[0], group * x.shape[1], x.shape[2]}, x.requires_grad)};
    },
    // 2 blocks of 6 slots to 4 experts, 2 a block, each count below 2: every slot placed or left;
    // then 4 blocks in 2 groups of 2 (HSDP's replicas)
    {{"expert_dispatch", {{{2, 6, 3}}, {{2, 4}, Fill::indices, 2}}, {}},
     {"expert_dispatch_groups", {{{4, 6, 3}}, {{4, 4}, Fill::indices, 2}}, {{"group", std::int64_t{2}}}}}))

// expert_combine: [D, G * S, F] laid out as expert_dispatch's output, counts [D, E] -> [D, S, F]:
// every slot back in its block's place; slots past the sum of a block's counts are zero. The
// gradient is expert_dispatch of the output's.
SPMDX_OP(exchange(
    "expert_combine", "expert_dispatch",
    [](const Metas& in, const Attributes& attrs) {
      const ir::TensorMeta& y = *in[0];
      floating(y, "rows");
      if (y.rank() != 3 || y.shape[0] == 0) fail("rows must be [blocks, group x slots, features], got " + y.str());
      const std::int64_t group = group_of(attrs, y.shape[0]);
      if (y.shape[1] % group != 0) fail("rows must be [blocks, group (" + std::to_string(group) + ") x slots, features], got " + y.str());
      check_counts(*in[1], y.shape[0], group);
      return std::vector{like(y, Shape{y.shape[0], y.shape[1] / group, y.shape[2]}, y.requires_grad)};
    },
    {{"expert_combine", {{{2, 12, 3}}, {{2, 4}, Fill::indices, 2}}, {}},
     {"expert_combine_groups", {{{4, 12, 3}}, {{4, 4}, Fill::indices, 2}}, {{"group", std::int64_t{2}}}}}))

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

// One group's exchange: x [G, S, F] (dispatch) or [G, G * S, F] (combine), counts [G, E].
at::Tensor dispatch_group(const at::Tensor& x, const at::Tensor& counts) {
  const std::int64_t blocks = x.size(0), slots = x.size(1), d = x.size(2);
  auto [rows, from] = dispatch_map(counts, slots, x.device());
  at::Tensor out = at::zeros({blocks * blocks * slots, d}, x.options());
  out.index_copy_(0, rows, x.reshape({blocks * slots, d}).index_select(0, from));
  return out.view({blocks, blocks * slots, d});
}

at::Tensor combine_group(const at::Tensor& x, const at::Tensor& counts) {
  const std::int64_t blocks = x.size(0), slots = x.size(1) / blocks, d = x.size(2);
  auto [rows, from] = dispatch_map(counts, slots, x.device());
  at::Tensor out = at::zeros({blocks * slots, d}, x.options());
  out.index_copy_(0, from, x.reshape({blocks * blocks * slots, d}).index_select(0, rows));
  return out.view({blocks, slots, d});
}

// Each group of attr group blocks on its own.
at::Tensor by_group(const Node& n, const Tensors& x, at::Tensor (*f)(const at::Tensor&, const at::Tensor&)) {
  const std::int64_t blocks = x[0].size(0), group = n.attr_int("group") > 0 ? n.attr_int("group") : blocks;
  if (group == blocks) return f(x[0], x[1]);
  std::vector<at::Tensor> parts;
  for (std::int64_t b = 0; b < blocks; b += group) parts.push_back(f(x[0].narrow(0, b, group), x[1].narrow(0, b, group)));
  return at::cat(parts);
}

}  // namespace

SPMDX_KERNEL("expert_dispatch", [](const Node& n, const Tensors& x) { return one(by_group(n, x, dispatch_group)); })
SPMDX_KERNEL("expert_combine", [](const Node& n, const Tensors& x) { return one(by_group(n, x, combine_group)); })
#endif

}  // namespace spmdx::ops
