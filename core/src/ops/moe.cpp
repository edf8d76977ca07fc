// The ops of a dropless Mixture-of-Experts layer (issue 46), as torchtitan's
// models/common/moe.py uses them: the router's topk, the dispatch's argsort and gather, the
// load's bincount (torch.histc on float ids there), the experts' grouped GEMM whose group ends
// are data (torch._grouped_mm's `offs`) and the combine's scatter_add. Shapes stay static; only
// which rows go to which expert is data. Indices are int64 as PyTorch's; none takes a gradient.
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "common.h"

namespace spmdx::ops {
namespace {

// An integer tensor of indices (int64, as torch.gather and scatter_add take).
[[maybe_unused]] void int64_index(const ir::TensorMeta& m, const char* what) {
  if (m.dtype != ir::DType::i64) fail(std::string(what) + " must be i64, got " + m.str());
}

// gather's and scatter_add's `dim`, wrapped into [0, rank).
[[maybe_unused]] std::int64_t index_dim(const Node& n) { return wrap_dim(n.attr_int("dim"), n.input(0)->meta().rank()); }

// gather's and scatter_add's index against a tensor x it reads or writes along `dim`: the same
// rank, and no larger than x on every other dim (as ATen's gather_shape_check).
[[maybe_unused]] void check_index(const ir::TensorMeta& x, const ir::TensorMeta& index, std::int64_t dim, const char* x_name) {
  int64_index(index, "index");
  if (index.rank() != x.rank()) fail("index " + index.str() + " and " + x_name + " " + x.str() + " must have the same rank");
  for (std::int64_t d = 0; d < x.rank(); ++d) {
    const auto i = static_cast<std::size_t>(d);
    if (d != dim && index.shape[i] > x.shape[i]) {
      fail("index " + index.str() + " is larger than " + x_name + " " + x.str() + " on dim " + std::to_string(d) + ", which is not dim " +
           std::to_string(dim));
    }
  }
}

// Shape checks of grouped_mm and grouped_mm_weight_grad's offs: an integer vector of `groups`.
[[maybe_unused]] void check_offs(const ir::TensorMeta& offs, const Shape& groups) {
  if ((offs.dtype != ir::DType::i32 && offs.dtype != ir::DType::i64) || offs.shape != groups) {
    fail("offs must be i32 or i64 " + ir::shape_str(groups) + " (each group's end row), got " + offs.str());
  }
}

// 2 * rows * k * n for a product of [rows, k] and [k, n] per group: every row is in one group.
[[maybe_unused]] double grouped_flops(std::int64_t rows, std::int64_t k, std::int64_t n) {
  return 2 * static_cast<double>(rows) * static_cast<double>(k) * static_cast<double>(n);
}

}  // namespace

// topk: x[..., n] -> (values [..., k], indices i64 [..., k]), the k largest (smallest with
// largest = false) along the last dim, as torch.topk(x, k, -1, largest, sorted). The gradient
// of the values goes back to the positions they came from, zeros elsewhere (derivatives.yaml's
// value_selecting_reduction_backward): indices are distinct within a row, so a scatter_add into
// zeros is that scatter.
SPMDX_OP([] {
  Op op;
  OpSchema& s = op.schema;
  s.name = "topk";
  s.min_inputs = s.max_inputs = 1;
  s.attrs = {{"k", ir::AttrType::integer, true, {}}, {"largest", ir::AttrType::boolean, false, true}, {"sorted", ir::AttrType::boolean, false, true}};
  s.infer = [](const Metas& in, const Attributes& a) {
    const ir::TensorMeta& x = *in[0];
    if (x.rank() < 1) fail("x must have at least one dim, got " + x.str());
    const std::int64_t k = std::get<std::int64_t>(a.at("k"));
    if (k < 0 || k > x.shape.back()) fail("k = " + std::to_string(k) + " must lie in [0, " + std::to_string(x.shape.back()) + "], the last dim of x " + x.str());
    Shape out = x.shape;
    out.back() = k;
    return std::vector{like(x, out, x.requires_grad), ir::TensorMeta{out, ir::DType::i64, x.device, false}};
  };
  s.vjp = [](Graph& g, const Node& n, const Grads& go) {
    Value* zeros = g.add("zeros_like", {n.input(0)});
    return Grads{g.add("scatter_add", {zeros, n.output(1), go[0]}, {{"dim", std::int64_t{-1}}})};
  };
  // A selection over each row: about one comparison per input element.
  s.flops = [](const Node& n) { return static_cast<double>(n.input(0)->meta().numel()); };
  s.samples = {{"topk", {{{4, 6, 8}}}, {{"k", std::int64_t{3}}}},
               {"topk_smallest", {{{6, 8}}}, {{"k", std::int64_t{2}}, {"largest", false}}}};
  // Any dim but the last, where the selection runs.
  op.rules = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t ranks) {
    Strategies st{{{R()}, {R(), R()}}};
    for (std::size_t d = 0; d + 1 < in[0].size(); ++d) {
      const auto sd = static_cast<std::int64_t>(d);
      if (in[0][d] >= ranks) st.push_back({{S(sd)}, {S(sd), S(sd)}});
    }
    return st;
  };
  return op;
}())
SPMDX_KERNEL("topk", [](const Node& n, const Tensors& x) {
  auto [values, indices] = at::topk(x[0], n.attr_int("k"), -1, n.attr_bool("largest"), n.attr_bool("sorted"));
  return Tensors{values, indices};
})

// argsort: x -> i64 indices that sort x along `dim`, as torch.argsort(x, dim=dim,
// descending=descending, stable=stable): with stable, equal elements keep their order (the
// dispatch sorts token slots by expert id, ties in token order). No gradient.
SPMDX_OP([] {
  Op op;
  OpSchema& s = op.schema;
  s.name = "argsort";
  s.min_inputs = s.max_inputs = 1;
  s.attrs = {{"dim", ir::AttrType::integer, false, std::int64_t{-1}},
             {"descending", ir::AttrType::boolean, false, false},
             {"stable", ir::AttrType::boolean, false, true}};
  s.infer = [](const Metas& in, const Attributes& a) {
    wrap_dim(std::get<std::int64_t>(a.at("dim")), in[0]->rank());
    return std::vector{ir::TensorMeta{in[0]->shape, ir::DType::i64, in[0]->device, false}};
  };
  // n log2 n comparisons for each line of n along dim.
  s.flops = [](const Node& n) {
    const ir::TensorMeta& x = n.input(0)->meta();
    const double len = x.shape.empty() ? 1.0 : static_cast<double>(x.shape[static_cast<std::size_t>(wrap_dim(n.attr_int("dim"), x.rank()))]);
    return static_cast<double>(x.numel()) * std::max(1.0, std::log2(std::max(len, 1.0)));
  };
  s.scratch = [](const Node& n, const ir::LayoutQuery&) { return n.input(0)->meta().nbytes(); };  // the sorted values at::sort makes
  s.samples = {{"argsort", {{{4, 6, 8}}}, {{"dim", std::int64_t{1}}}, false},
               {"argsort_descending", {{{6, 8}}}, {{"descending", true}}, false},
               // expert ids with many ties: the stable order is the only right answer
               {"argsort_stable_ties", {{{4, 24}, Fill::indices, 3}}, {}, false}};
  op.rules = [](const Node& n, const std::vector<Shape>& in, const std::vector<Shape>& out, std::int64_t ranks) {
    return sharding::rule::same_dim(in, out, ranks, {wrap_dim(n.attr_int("dim"), static_cast<std::int64_t>(in[0].size()))}, in[0].size());
  };
  return op;
}())
SPMDX_KERNEL("argsort", [](const Node& n, const Tensors& x) {
  return one(at::argsort(x[0], n.attr_bool("stable"), n.attr_int("dim"), n.attr_bool("descending")));
})

// gather: (x, index i64) -> out[i][j] = x[index[i][j]][j] for dim 0 (and so on), the shape of
// index, as torch.gather(x, dim, index). The gradient adds each output's into the element it
// came from (derivatives.yaml: grad.new_zeros(x).scatter_add(dim, index, grad)).
SPMDX_OP([] {
  Op op;
  OpSchema& s = op.schema;
  s.name = "gather";
  s.min_inputs = s.max_inputs = 2;
  s.attrs = {{"dim", ir::AttrType::integer, true, {}}};
  s.infer = [](const Metas& in, const Attributes& a) {
    const std::int64_t dim = wrap_dim(std::get<std::int64_t>(a.at("dim")), in[0]->rank());
    check_index(*in[0], *in[1], dim, "x");
    return std::vector{like(*in[0], in[1]->shape, in[0]->requires_grad)};
  };
  s.vjp = [](Graph& g, const Node& n, const Grads& go) {
    Value* zeros = g.add("zeros_like", {n.input(0)});
    return Grads{g.add("scatter_add", {zeros, n.input(1), go[0]}, {{"dim", n.attr_int("dim")}}), nullptr};
  };
  s.samples = {{"gather", {{{4, 6}}, {{4, 3}, Fill::indices, 6}}, {{"dim", std::int64_t{1}}}},
               // rows picked more than once, as the dispatch picks a token for each of its experts
               {"gather_repeats", {{{5, 6}}, {{8, 6}, Fill::indices, 5}}, {{"dim", std::int64_t{0}}}}};
  // Another dim split alike on x and index (same size); index split along dim (its entries are
  // x's global positions, x whole); or linear in x.
  op.rules = [](const Node& n, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t ranks) {
    const Shape &x = in[0], &idx = in[1];
    const std::int64_t dim = index_dim(n);
    Strategies st{{{R(), R()}, {R()}}};
    for (std::size_t d = 0; d < idx.size(); ++d) {
      const auto sd = static_cast<std::int64_t>(d);
      if (idx[d] < ranks) continue;
      if (sd == dim) st.push_back({{R(), S(sd)}, {S(sd)}});
      else if (x[d] == idx[d]) st.push_back({{S(sd), S(sd)}, {S(sd)}});
    }
    st.push_back({{P(), R()}, {P()}});
    return st;
  };
  return op;
}())
SPMDX_KERNEL("gather", [](const Node& n, const Tensors& x) { return one(at::gather(x[0], n.attr_int("dim"), x[1])); })

// scatter_add: (x, index i64, src) -> x with src[i][j] added into row index[i][j] (dim 0, and so
// on), as torch.Tensor.scatter_add (out of place). index and src have one shape (a smaller index
// than src, which PyTorch allows, is refused). Gradients (derivatives.yaml): x's is the
// output's, src's the output's gathered at index.
SPMDX_OP([] {
  Op op;
  OpSchema& s = op.schema;
  s.name = "scatter_add";
  s.min_inputs = s.max_inputs = 3;
  s.attrs = {{"dim", ir::AttrType::integer, true, {}}};
  s.infer = [](const Metas& in, const Attributes& a) {
    const ir::TensorMeta &x = *in[0], &index = *in[1], &src = *in[2];
    const std::int64_t dim = wrap_dim(std::get<std::int64_t>(a.at("dim")), x.rank());
    if (src.dtype != x.dtype) fail("src " + src.str() + " and x " + x.str() + " must have the same dtype");
    check_index(x, index, dim, "x");
    if (index.shape != src.shape) fail("index " + index.str() + " and src " + src.str() + " must have the same shape");
    return std::vector{like(x, x.shape, x.requires_grad || src.requires_grad)};
  };
  s.vjp = [](Graph& g, const Node& n, const Grads& go) {
    return Grads{go[0], nullptr, g.add("gather", {go[0], n.input(1)}, {{"dim", n.attr_int("dim")}})};
  };
  // One addition per element of src.
  s.flops = [](const Node& n) { return static_cast<double>(n.input(2)->meta().numel()); };
  s.samples = {{"scatter_add", {{{5, 6}}, {{8, 6}, Fill::indices, 5}, {{8, 6}}}, {{"dim", std::int64_t{0}}}},
               {"scatter_add_last", {{{4, 6}}, {{4, 9}, Fill::indices, 6}, {{4, 9}}}, {{"dim", std::int64_t{-1}}}},
               // index smaller than x off dim: only x's first 4 columns take sums
               {"scatter_add_narrow", {{{5, 6}}, {{8, 4}, Fill::indices, 5}, {{8, 4}}}, {{"dim", std::int64_t{0}}}}};
  // Another dim split alike on all three (same size); linear in x and src together (both
  // Partial); and index and src split along dim with x Partial: each rank adds its slots into
  // its summand of x (the combine of rows a rank computed).
  op.rules = [](const Node& n, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t ranks) {
    const Shape &x = in[0], &idx = in[1];
    const std::int64_t dim = index_dim(n);
    Strategies st{{{R(), R(), R()}, {R()}}};
    for (std::size_t d = 0; d < x.size(); ++d) {
      const auto sd = static_cast<std::int64_t>(d);
      if (sd != dim && x[d] >= ranks && x[d] == idx[d]) st.push_back({{S(sd), S(sd), S(sd)}, {S(sd)}});
    }
    st.push_back({{P(), R(), P()}, {P()}});
    if (idx[static_cast<std::size_t>(dim)] >= ranks) st.push_back({{P(), S(dim), S(dim)}, {P()}});
    return st;
  };
  return op;
}())
SPMDX_KERNEL("scatter_add", [](const Node& n, const Tensors& x) { return one(at::scatter_add(x[0], n.attr_int("dim"), x[1], x[2])); })

// bincount: ids (i64 or i32) [n] -> i64 [minlength], how many ids equal each value, as
// torch.bincount(ids, minlength=minlength) with every id in [0, minlength): the tokens each
// expert receives (torchtitan counts them with torch.histc on float ids). ids [b, n] count each
// row apart -> [b, minlength] (expert parallelism's per-rank blocks). An id outside is refused
// when the kernel runs (the output's size is static). No gradient.
SPMDX_OP([] {
  Op op;
  OpSchema& s = op.schema;
  s.name = "bincount";
  s.min_inputs = s.max_inputs = 1;
  s.attrs = {{"minlength", ir::AttrType::integer, true, {}}};
  s.infer = [](const Metas& in, const Attributes& a) {
    const ir::TensorMeta& ids = *in[0];
    if ((ids.dtype != ir::DType::i64 && ids.dtype != ir::DType::i32) || ids.rank() < 1 || ids.rank() > 2) fail("ids must be i64 or i32 [n] or [b, n], got " + ids.str());
    const std::int64_t length = std::get<std::int64_t>(a.at("minlength"));
    if (length < 1) fail("minlength must be >= 1 (the number of bins), got " + std::to_string(length));
    return std::vector{ir::TensorMeta{ids.rank() == 1 ? Shape{length} : Shape{ids.shape[0], length}, ir::DType::i64, ids.device, false}};
  };
  s.flops = [](const Node& n) { return static_cast<double>(n.input(0)->meta().numel()); };  // one increment per id
  s.samples = {{"bincount", {{{20}, Fill::indices, 6}}, {{"minlength", std::int64_t{6}}}, false},
               {"bincount_empty_bins", {{{5}, Fill::indices, 3}}, {{"minlength", std::int64_t{8}}}, false},
               {"bincount_rows", {{{4, 10}, Fill::indices, 6}}, {{"minlength", std::int64_t{6}}}, false}};
  // ids split: each rank counts its own, the counts are partial sums; rows split: each rank
  // counts its rows.
  op.rules = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t ranks) {
    Strategies st{{{R()}, {R()}}};
    const std::size_t last = in[0].size() - 1;
    if (in[0][last] >= ranks) st.push_back({{S(static_cast<std::int64_t>(last))}, {P()}});
    if (in[0].size() == 2 && in[0][0] >= ranks) st.push_back({{S(0)}, {S(0)}});
    return st;
  };
  return op;
}())
SPMDX_KERNEL("bincount", [](const Node& n, const Tensors& x) {
  const std::int64_t length = n.attr_int("minlength");
  if (x[0].numel() > 0) {
    const std::int64_t lo = x[0].min().item<std::int64_t>(), hi = x[0].max().item<std::int64_t>();
    if (lo < 0 || hi >= length) {
      throw std::runtime_error("bincount: ids must lie in [0, " + std::to_string(length) + ") (minlength bins), got ids from " + std::to_string(lo) + " to " +
                               std::to_string(hi) + "; raise minlength to the number of experts");
    }
  }
  if (x[0].dim() == 1) return one(at::bincount(x[0], {}, length));
  // Each row's ids moved to bins of their own: row r counts into [r * length, (r + 1) * length).
  const std::int64_t rows = x[0].size(0);
  const at::Tensor shifted = x[0].to(at::kLong) + at::arange(rows, x[0].options().dtype(at::kLong)).unsqueeze(1) * length;
  return one(at::bincount(shifted.reshape({-1}), {}, rows * length).view({rows, length}));
})

// grouped_mm: x [tokens, k] with its rows sorted by group, w [groups, k, n], offs (i32 or i64)
// [groups] each group's end row (cumulative, as torch._grouped_mm's `offs`) -> [tokens, n]: rows
// [offs[g - 1], offs[g]) times w[g]; rows from offs[-1] on are zero. offs must be nondecreasing
// and at most tokens, checked when the kernel runs. The experts of a dropless MoE in one op
// (torchtitan's _run_experts_grouped_mm). Gradients: x's is grouped_mm(g, w[g]^T) (rows past
// offs[-1] zero), w's is grouped_mm_weight_grad.
SPMDX_OP([] {
  Op op;
  OpSchema& s = op.schema;
  s.name = "grouped_mm";
  s.min_inputs = s.max_inputs = 3;
  s.infer = [](const Metas& in, const Attributes&) {
    const ir::TensorMeta &x = *in[0], &w = *in[1];
    floating(x, "x");
    same_dtype(Metas(in.begin(), in.begin() + 2));
    const bool batched = x.rank() == 3;
    if (!((x.rank() == 2 && w.rank() == 3) || (batched && w.rank() == 4 && w.shape[0] > 0 && x.shape[0] % w.shape[0] == 0))) {
      fail("x must be [tokens, k] and w [groups, k, n] (or [b, tokens, k] and [c, groups, k, n], c dividing b: block i takes w[i % c]), got " + x.str() + " and " + w.str());
    }
    const std::size_t b = batched ? 1 : 0;
    if (x.shape[b + 1] != w.shape[b + 1]) fail("x " + x.str() + " and w " + w.str() + " differ in k (x's last dim, w's second last)");
    check_offs(*in[2], batched ? Shape{x.shape[0], w.shape[1]} : Shape{w.shape[0]});
    Shape out = x.shape;
    out.back() = w.shape.back();
    return std::vector{like(x, out, x.requires_grad || w.requires_grad)};
  };
  s.vjp = [](Graph& g, const Node& n, const Grads& go) {
    const std::int64_t r = n.input(1)->meta().rank();
    Value* wt = g.add("transpose", {n.input(1)}, {{"dim0", r - 2}, {"dim1", r - 1}});
    const ir::Attributes blocks{{"blocks", r == 4 ? n.input(1)->meta().shape[0] : std::int64_t{0}}};
    return Grads{g.add("grouped_mm", {go[0], wt, n.input(2)}), g.add("grouped_mm_weight_grad", {n.input(0), go[0], n.input(2)}, blocks), nullptr};
  };
  s.flops = [](const Node& n) {
    const ir::TensorMeta& x = n.input(0)->meta();
    return grouped_flops(x.numel_without(-1), x.shape.back(), n.output()->meta().shape.back());
  };
  // The groups' products before they are joined (the output's size); bf16 / f16 on a CPU: the
  // float32 copies of x, w and the result (as matmul's kernel).
  s.scratch = [](const Node& n, const ir::LayoutQuery&) {
    const ir::TensorMeta &x = n.input(0)->meta(), &w = n.input(1)->meta(), &out = n.output()->meta();
    const bool half = x.device == "cpu" && (x.dtype == ir::DType::bf16 || x.dtype == ir::DType::f16);
    return out.nbytes() + (half ? 2 * (x.nbytes() + w.nbytes() + 2 * out.nbytes()) : 0);
  };
  s.precision = ir::Precision::low;
  // Not kept by selective activation checkpointing: torchtitan's op SAC list (v0.2.x) holds
  // aten.mm but not aten._grouped_mm, so its MoE recomputes the experts.
  s.saved_by_selective = false;
  s.samples = {{"grouped_mm", {{{10, 4}}, {{3, 4, 5}}, {{3}, Fill::offsets, 10}}, {}},
               // i32 offs as torch._grouped_mm takes them; rows 7 to 9 in no group (zeros)
               {"grouped_mm_tail_i32", {{{10, 4}}, {{3, 4, 5}}, {{3}, Fill::offsets, 7, 0, ir::DType::i32}}, {}},
               // expert parallelism's blocks: each block's groups on its own rows
               {"grouped_mm_blocks", {{{2, 9, 4}}, {{2, 3, 4, 5}}, {{2, 3}, Fill::offsets, 7}}, {}},
               // 4 blocks on 2 blocks of weights (expert parallelism 2 in each of 2 replicas)
               {"grouped_mm_blocks_shared", {{{4, 9, 4}}, {{2, 3, 4, 5}}, {{4, 3}, Fill::offsets, 7}}, {}}};
  // w's columns give the output's; k split on both gives partial sums; linear in x and in w.
  // The rows cannot be split: offs name global rows. Blocks ([b, ...]) split alike on all three
  // when each has its own weights; blocks sharing c blocks of weights split as whole runs of c
  // (each rank all its blocks' weights).
  op.rules = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t ranks) {
    const Shape &x = in[0], &w = in[1];
    if (x.size() == 3) {
      Strategies st{{{R(), R(), R()}, {R()}}, {{P(), R(), R()}, {P()}}, {{R(), P(), R()}, {P()}}};
      if (x[0] >= ranks && x[0] == w[0]) st.push_back({{S(0), S(0), S(0)}, {S(0)}});
      if (x[0] != w[0] && x[0] % ranks == 0 && (x[0] / ranks) % w[0] == 0) st.push_back({{S(0), R(), S(0)}, {S(0)}});
      return st;
    }
    Strategies st{{{R(), R(), R()}, {R()}}};
    if (w[2] >= ranks) st.push_back({{R(), S(2), R()}, {S(1)}});
    if (x[1] >= ranks) st.push_back({{S(1), S(1), R()}, {P()}});
    st.push_back({{P(), R(), R()}, {P()}});
    st.push_back({{R(), P(), R()}, {P()}});
    return st;
  };
  return op;
}())

// grouped_mm_weight_grad: x [tokens, k], g [tokens, n], offs [groups] -> [groups, k, n], each
// group's x_g^T g_g (rows [offs[g - 1], offs[g])); an empty group's is zero. grouped_mm's
// weight gradient; a backward op: no VJP.
SPMDX_OP([] {
  Op op;
  OpSchema& s = op.schema;
  s.name = "grouped_mm_weight_grad";
  s.min_inputs = s.max_inputs = 3;
  // Blocks: the weights' blocks c (block i's product added into w[i % c]); 0: one a block.
  s.attrs = {{"blocks", ir::AttrType::integer, false, std::int64_t{0}}};
  s.infer = [](const Metas& in, const Attributes& attrs) {
    const ir::TensorMeta &x = *in[0], &g = *in[1], &offs = *in[2];
    floating(x, "x");
    same_dtype(Metas(in.begin(), in.begin() + 2));
    const bool batched = x.rank() == 3;
    if ((x.rank() != 2 && !batched) || g.rank() != x.rank() || Shape(x.shape.begin(), x.shape.end() - 1) != Shape(g.shape.begin(), g.shape.end() - 1)) {
      fail("x and g must be [tokens, k] and [tokens, n] (or [b, tokens, k] and [b, tokens, n]), got " + x.str() + " and " + g.str());
    }
    if (offs.rank() != x.rank() - 1 || (batched && offs.shape[0] != x.shape[0])) fail("offs must be i32 or i64 [groups] (or [b, groups]), got " + offs.str());
    check_offs(offs, offs.shape);
    Shape out = offs.shape;
    if (const std::int64_t c = std::get<std::int64_t>(attrs.at("blocks")); batched && c > 0) {
      if (x.shape[0] % c != 0) fail("blocks " + std::to_string(c) + " must divide x's " + std::to_string(x.shape[0]) + " blocks");
      out[0] = c;
    }
    out.push_back(x.shape.back());
    out.push_back(g.shape.back());
    return std::vector{like(x, out, x.requires_grad || g.requires_grad)};
  };
  s.flops = [](const Node& n) {
    const ir::TensorMeta &x = n.input(0)->meta(), &g = n.input(1)->meta();
    return grouped_flops(x.numel_without(-1), x.shape.back(), g.shape.back());
  };
  // bf16 / f16 on a CPU: the float32 copies of x, g and the result.
  s.scratch = [](const Node& n, const ir::LayoutQuery&) -> std::int64_t {
    const ir::TensorMeta &x = n.input(0)->meta(), &g = n.input(1)->meta(), &out = n.output()->meta();
    const bool half = x.device == "cpu" && (x.dtype == ir::DType::bf16 || x.dtype == ir::DType::f16);
    return half ? 2 * (x.nbytes() + g.nbytes() + 2 * out.nbytes()) : 0;
  };
  s.samples = {{"grouped_mm_weight_grad", {{{10, 4}}, {{10, 5}}, {{3}, Fill::offsets, 10}}, {}, false},
               {"grouped_mm_weight_grad_tail", {{{10, 4}}, {{10, 5}}, {{4}, Fill::offsets, 6, 0, ir::DType::i32}}, {}, false},
               {"grouped_mm_weight_grad_blocks", {{{2, 9, 4}}, {{2, 9, 5}}, {{2, 3}, Fill::offsets, 7}}, {}, false},
               {"grouped_mm_weight_grad_blocks_shared", {{{4, 9, 4}}, {{4, 9, 5}}, {{4, 3}, Fill::offsets, 7}}, {{"blocks", std::int64_t{2}}}, false}};
  // x's columns give the result's rows (dim 1), g's its columns (dim 2); linear in each. Blocks
  // split alike on all three when each has its own weights; blocks sharing c blocks of weights,
  // as whole runs of c, give partial sums.
  op.rules = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>& out, std::int64_t ranks) {
    if (in[0].size() == 3) {
      Strategies st{{{R(), R(), R()}, {R()}}, {{P(), R(), R()}, {P()}}, {{R(), P(), R()}, {P()}}};
      const std::int64_t b = in[0][0], c = out[0][0];
      if (b >= ranks && b == c) st.push_back({{S(0), S(0), S(0)}, {S(0)}});
      if (b != c && b % ranks == 0 && (b / ranks) % c == 0) st.push_back({{S(0), S(0), S(0)}, {P()}});
      return st;
    }
    Strategies st{{{R(), R(), R()}, {R()}}};
    if (in[0][1] >= ranks) st.push_back({{S(1), R(), R()}, {S(1)}});
    if (in[1][1] >= ranks) st.push_back({{R(), S(1), R()}, {S(2)}});
    st.push_back({{P(), R(), R()}, {P()}});
    st.push_back({{R(), P(), R()}, {P()}});
    return st;
  };
  // A rank's blocks of weights: its part of the output's.
  op.local_attrs = [](const Node& n, const std::vector<Shape>& local_out, std::int64_t) {
    Attributes a = n.attrs();
    if (n.attr_int("blocks") > 0) a["blocks"] = local_out[0][0];
    return a;
  };
  return op;
}())

// cumsum: x -> the running sums along `dim` (torch.cumsum(x, dim)); with `reverse`, from the
// end (out[i] = x[i] + x[i + 1] + ..., torch.flip(torch.cumsum(torch.flip(x, dim), dim), dim)).
// Integer x sums in int64, as torch.cumsum promotes it: the dispatch's group end rows from the
// tokens each expert receives (torchtitan's torch.cumsum(num_tokens_per_expert)). The gradient
// of a floating x is the running sum of the output's from the other end.
SPMDX_OP([] {
  Op op;
  OpSchema& s = op.schema;
  s.name = "cumsum";
  s.min_inputs = s.max_inputs = 1;
  s.attrs = {{"dim", ir::AttrType::integer, true, {}}, {"reverse", ir::AttrType::boolean, false, false}};
  s.infer = [](const Metas& in, const Attributes& a) {
    const ir::TensorMeta& x = *in[0];
    wrap_dim(std::get<std::int64_t>(a.at("dim")), x.rank());
    if (ir::is_floating(x.dtype)) return std::vector{like(x, x.shape, x.requires_grad)};
    if (x.dtype != ir::DType::i64 && x.dtype != ir::DType::i32) fail("x must be floating, i32 or i64, got " + x.str());
    return std::vector{ir::TensorMeta{x.shape, ir::DType::i64, x.device, false}};
  };
  s.vjp = [](Graph& g, const Node& n, const Grads& go) {
    return Grads{g.add("cumsum", {go[0]}, {{"dim", n.attr_int("dim")}, {"reverse", !n.attr_bool("reverse")}})};
  };
  s.samples = {{"cumsum", {{{4, 6}}}, {{"dim", std::int64_t{1}}}},
               {"cumsum_reverse", {{{5, 3}}}, {{"dim", std::int64_t{0}}, {"reverse", true}}},
               // the tokens each expert receives -> each group's end row
               {"cumsum_counts", {{{8}, Fill::indices, 5}}, {{"dim", std::int64_t{0}}}, false}};
  // Any other dim split; a floating x's Partial summands give the sums' summands.
  op.rules = [](const Node& n, const std::vector<Shape>& in, const std::vector<Shape>& out, std::int64_t ranks) {
    Strategies st = sharding::rule::same_dim(in, out, ranks, {wrap_dim(n.attr_int("dim"), static_cast<std::int64_t>(in[0].size()))}, in[0].size());
    if (ir::is_floating(n.input(0)->meta().dtype)) st.push_back({{P()}, {P()}});
    return st;
  };
  return op;
}())
SPMDX_KERNEL("cumsum", [](const Node& n, const Tensors& x) {
  const std::int64_t dim = n.attr_int("dim");
  const auto dtype = ir::is_floating(n.output()->meta().dtype) ? x[0].scalar_type() : at::kLong;
  if (!n.attr_bool("reverse")) return one(at::cumsum(x[0], dim, dtype));
  return one(at::flip(at::cumsum(at::flip(x[0], {dim}), dim, dtype), {dim}));
})

// floor_divide_scalar: integer x -> floor(x / value) for a positive integer `value`, as
// torch.div(x, value, rounding_mode="floor") (Python's //): a routed slot's token,
// slot // top_k (torchtitan's token_indices_experts_sorted // top_k). No gradient.
SPMDX_OP([] {
  Op op;
  OpSchema& s = op.schema;
  s.name = "floor_divide_scalar";
  s.min_inputs = s.max_inputs = 1;
  s.attrs = {{"value", ir::AttrType::integer, true, {}}};
  s.infer = [](const Metas& in, const Attributes& a) {
    const ir::TensorMeta& x = *in[0];
    if (x.dtype != ir::DType::i64 && x.dtype != ir::DType::i32) fail("x must be i32 or i64, got " + x.str());
    if (std::get<std::int64_t>(a.at("value")) < 1) fail("value must be a positive integer, got " + std::to_string(std::get<std::int64_t>(a.at("value"))));
    return std::vector{ir::TensorMeta{x.shape, x.dtype, x.device, false}};
  };
  s.elementwise = true;
  s.samples = {{"floor_divide_scalar", {{{4, 6}, Fill::indices, 24}}, {{"value", std::int64_t{3}}}, false}};
  op.rules = sharding::rule::nonlinear();
  return op;
}())
SPMDX_KERNEL("floor_divide_scalar", [](const Node& n, const Tensors& x) { return one(at::div(x[0], n.attr_int("value"), "floor")); })

#if defined(SPMDX_OPS_KERNELS)
namespace {

// The groups' end rows, read to the host and checked: nondecreasing from >= 0, the last at most
// `rows`.
std::vector<std::int64_t> group_ends(const at::Tensor& offs, std::int64_t rows, const char* op) {
  const at::Tensor host = offs.to(at::kCPU, at::kLong).contiguous();
  std::vector<std::int64_t> ends(host.data_ptr<std::int64_t>(), host.data_ptr<std::int64_t>() + host.numel());
  std::int64_t previous = 0;
  for (std::size_t g = 0; g < ends.size(); ++g) {
    if (ends[g] < previous || ends[g] > rows) {
      std::string shown;
      for (auto e : ends) shown += (shown.empty() ? "" : ", ") + std::to_string(e);
      throw std::runtime_error(std::string(op) + ": offs must be nondecreasing group end rows in [0, " + std::to_string(rows) + "], got [" + shown +
                               "] (group " + std::to_string(g) + ")");
    }
    previous = ends[g];
  }
  return ends;
}

// bf16 / f16 on a CPU without their dot products compute in float32 and round once, as
// matmul's kernel (exec::half_gemm: ATen's half GEMM there runs many times slower than float32).
bool half_on_cpu(const at::Tensor& x) { return exec::upcast_half_gemm(x); }

}  // namespace

// A loop of at::mm over the groups, joined by cat (autograd's reference differentiates it).
// This LibTorch's at::_grouped_mm on a CPU takes float32 / bf16 only, i32 offs, rows of a
// multiple of 16 bytes, and leaves the rows past offs[-1] unwritten.
namespace {
at::Tensor grouped_mm_2d(const Tensors& x);
at::Tensor grouped_mm_weight_grad_2d(const Tensors& x);

// Blocks ([b, ...]): each block's product on its own, block i on weights w[i % c] (grouped_mm's
// w of c blocks).
at::Tensor grouped_mm_blocks(const Tensors& x) {
  if (x[0].dim() == 2) return grouped_mm_2d(x);
  std::vector<at::Tensor> blocks;
  for (std::int64_t b = 0; b < x[0].size(0); ++b) blocks.push_back(grouped_mm_2d(Tensors{x[0][b], x[1][b % x[1].size(0)], x[2][b]}));
  return at::stack(blocks);
}

// Each block's weight gradient, added into block i % c of c (attr blocks; 0: c = b).
at::Tensor grouped_mm_weight_grad_blocks(const Node& n, const Tensors& x) {
  if (x[0].dim() == 2) return grouped_mm_weight_grad_2d(x);
  const std::int64_t b = x[0].size(0), c = n.attr_int("blocks") > 0 ? n.attr_int("blocks") : b;
  std::vector<at::Tensor> blocks;
  for (std::int64_t i = 0; i < b; ++i) {
    at::Tensor w = grouped_mm_weight_grad_2d(Tensors{x[0][i], x[1][i], x[2][i]});
    if (i < c) blocks.push_back(w);
    else blocks[static_cast<std::size_t>(i % c)] = blocks[static_cast<std::size_t>(i % c)] + w;
  }
  return at::stack(blocks);
}

SPMDX_KERNEL("grouped_mm", [](const Node&, const Tensors& x) { return one(grouped_mm_blocks(x)); })
SPMDX_KERNEL("grouped_mm_weight_grad", [](const Node& n, const Tensors& x) { return one(grouped_mm_weight_grad_blocks(n, x)); })

at::Tensor grouped_mm_2d(const Tensors& x) {
  const bool half = half_on_cpu(x[0]);
  const at::Tensor a = half ? x[0].to(at::kFloat) : x[0], w = half ? x[1].to(at::kFloat) : x[1];
  const std::int64_t rows = a.size(0);
  Tensors parts;
  std::int64_t start = 0, g = 0;
  for (const std::int64_t end : group_ends(x[2], rows, "grouped_mm")) {
    if (end > start) parts.push_back(at::mm(a.narrow(0, start, end - start), w.select(0, g)));
    start = end;
    ++g;
  }
  if (start < rows || parts.empty()) parts.push_back(at::zeros({rows - start, w.size(2)}, a.options()));
  at::Tensor out = parts.size() == 1 ? parts[0] : at::cat(parts);
  return half ? out.to(x[0].scalar_type()) : out;
}

at::Tensor grouped_mm_weight_grad_2d(const Tensors& x) {
  const bool half = half_on_cpu(x[0]);
  const at::Tensor a = half ? x[0].to(at::kFloat) : x[0], g = half ? x[1].to(at::kFloat) : x[1];
  const std::vector<std::int64_t> ends = group_ends(x[2], a.size(0), "grouped_mm_weight_grad");
  at::Tensor out = at::empty({static_cast<std::int64_t>(ends.size()), a.size(1), g.size(1)}, a.options());
  std::int64_t start = 0;
  for (std::size_t k = 0; k < ends.size(); ++k) {
    at::Tensor slot = out.select(0, static_cast<std::int64_t>(k));
    if (ends[k] == start) slot.zero_();  // an empty group
    else at::mm_out(slot, a.narrow(0, start, ends[k] - start).t(), g.narrow(0, start, ends[k] - start));
    start = ends[k];
  }
  return half ? out.to(x[0].scalar_type()) : out;
}

}  // namespace
#endif

}  // namespace spmdx::ops
