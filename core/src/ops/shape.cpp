// Shape and view ops: reshape, transpose, permute, expand, slice (and its gradient), cat, chunk
// and context parallelism's seq_permute. The kernels are ATen's Tensor methods of the same name,
// so most outputs are views of their input (the layout fns say which, as the memory plan needs);
// every one moves elements without arithmetic, so a Partial sum stays one.
#include <algorithm>
#include <utility>

#include "common.h"

namespace spmdx::ops {
namespace {

const ir::AttrSpec kShape{"shape", ir::AttrType::ints, true, {}};

// The rule of an op whose only attribute that follows the shards is "shape": the rank's output.
[[maybe_unused]] ir::Attributes local_shape(const Node& n, const std::vector<Shape>& local_out, std::int64_t) {
  ir::Attributes a = n.attrs();
  a["shape"] = local_out.at(0);
  return a;
}

// Python-style clamped slice bounds of a slice node over a dim of `size`, as its inference.
[[maybe_unused]] std::pair<std::int64_t, std::int64_t> slice_bounds(const Node& n, std::int64_t size) {
  auto clamp = [&](std::int64_t i) { return std::clamp<std::int64_t>(i < 0 ? i + size : i, 0, size); };
  const std::int64_t start = clamp(n.attr_int("start"));
  return {start, std::max(start, clamp(n.attr_int("end")))};
}

// Maps a shard of input dim `d` through a reshape, or -1 when the shard does not stay a
// contiguous shard of one output dim. Groups of dims with equal products: only the outermost
// non-1 dim of a group may be sharded, evenly unless the group is a single dim on each side.
[[maybe_unused]] std::int64_t reshape_dim(const Shape& in, const Shape& out, std::int64_t d, std::int64_t k) {
  std::size_t i = 0, j = 0;
  while (i < in.size() || j < out.size()) {
    while (i < in.size() && in[i] == 1 && static_cast<std::int64_t>(i) != d) ++i;
    while (j < out.size() && out[j] == 1) ++j;
    if (i >= in.size() || j >= out.size()) break;
    const std::size_t i0 = i, j0 = j;
    std::int64_t a = in[i++], b = out[j++];
    while (a != b) {
      if (a < b) {
        if (i >= in.size()) return -1;
        a *= in[i++];
      } else {
        if (j >= out.size()) return -1;
        b *= out[j++];
      }
    }
    if (static_cast<std::int64_t>(i0) == d) {
      const bool single = i - i0 == 1 && j - j0 == 1;
      if (single || (in[i0] % k == 0 && out[j0] % k == 0)) return static_cast<std::int64_t>(j0);
      return -1;
    }
    if (static_cast<std::int64_t>(i0) < d && d < static_cast<std::int64_t>(i)) return -1;  // an inner dim of a group
  }
  return -1;
}

// transpose's and permute's rule: output dim i comes from input dim perm[i].
[[maybe_unused]] sharding::Rule permutation_rule() {
  return [](const Node& n, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t k) {
    const std::size_t rank = in[0].size();
    std::vector<std::int64_t> perm(rank);
    for (std::size_t i = 0; i < rank; ++i) perm[i] = static_cast<std::int64_t>(i);
    const auto r = static_cast<std::int64_t>(rank);
    if (n.op() == "transpose") {
      std::swap(perm[static_cast<std::size_t>(wrap_dim(n.attr_int("dim0"), r))], perm[static_cast<std::size_t>(wrap_dim(n.attr_int("dim1"), r))]);
    } else {
      for (std::size_t i = 0; i < rank; ++i) perm[i] = wrap_dim(n.attr_ints("dims")[i], r);
    }
    Strategies s{{{R()}, {R()}}};
    for (std::size_t i = 0; i < perm.size(); ++i) {
      if (in[0][static_cast<std::size_t>(perm[i])] >= k) s.push_back({{S(perm[i])}, {S(static_cast<std::int64_t>(i))}});
    }
    s.push_back({{P()}, {P()}});
    return s;
  };
}

// A view of input 0 with these strides.
[[maybe_unused]] ir::OutputLayout view(std::vector<std::int64_t> strides) { return {std::move(strides), true}; }

// The rule of an op that moves elements along its "dim" (slice and its gradient, cat,
// seq_permute): any other dim sharded alike on every input and the output, and Partial inputs
// giving a Partial output.
[[maybe_unused]] Strategies along_dim(const Node& n, const std::vector<Shape>& in, const std::vector<Shape>& out, std::int64_t k) {
  const std::size_t rank = out[0].size();
  Strategies st = sharding::rule::same_dim(in, out, k, {wrap_dim(n.attr_int("dim"), static_cast<std::int64_t>(rank))}, rank);
  st.push_back({std::vector<Placement>(in.size(), P()), {P()}});
  return st;
}

}  // namespace

// reshape: one entry may be -1, as torch.reshape; a view where ATen's computeStride finds one.
SPMDX_OP([] {
  OpSchema s;
  s.name = "reshape";
  s.min_inputs = s.max_inputs = 1;
  s.attrs = {kShape};
  s.infer = [](const Metas& in, const Attributes& a) {
    Shape shape = std::get<Shape>(a.at("shape"));
    std::int64_t known = 1;
    int infer_at = -1;
    for (std::size_t i = 0; i < shape.size(); ++i) {
      if (shape[i] == -1) {
        if (infer_at >= 0) fail("only one -1 allowed in shape " + ir::shape_str(shape));
        infer_at = static_cast<int>(i);
      } else if (shape[i] < 0) {
        fail("negative size in shape " + ir::shape_str(shape));
      } else {
        known *= shape[i];
      }
    }
    const std::int64_t n = in[0]->numel();
    if (infer_at >= 0) {
      if (known == 0 || n % known != 0) fail("cannot reshape " + ir::shape_str(in[0]->shape) + " to " + ir::shape_str(shape));
      shape[static_cast<std::size_t>(infer_at)] = n / known;
    } else if (known != n) {
      fail("cannot reshape " + ir::shape_str(in[0]->shape) + " (" + std::to_string(n) + " elements) to " + ir::shape_str(shape));
    }
    return std::vector{like(*in[0], shape, in[0]->requires_grad)};
  };
  s.vjp = [](Graph& g, const Node& n, const Grads& go) { return Grads{g.add("reshape", {go[0]}, {{"shape", n.input(0)->meta().shape}})}; };
  s.layout = [](const Node& n, std::size_t, const ir::LayoutQuery& q) -> std::optional<ir::OutputLayout> {
    const Shape& shape = n.output()->meta().shape;
    if (auto st = ir::view_strides(n.input(0)->meta().shape, q.strides(0), shape)) return view(std::move(*st));
    return ir::OutputLayout{ir::contiguous_strides(shape), false};
  };
  s.samples = {{"reshape_split", {{{4, 12}}}, {{"shape", Shape{4, 4, 3}}}},
               {"reshape_merge", {{{4, 6, 2}}}, {{"shape", Shape{24, 2}}}},
               {"reshape_flat", {{{4, 6}}}, {{"shape", Shape{-1}}}},
               {"reshape", {{{2, 3, 4}}}, {{"shape", Shape{6, -1}}}}};
  sharding::Rule rules = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>& out, std::int64_t k) {
    Strategies st{{{R()}, {R()}}};
    for (std::size_t d = 0; d < in[0].size(); ++d) {
      if (in[0][d] < k) continue;
      const std::int64_t to = reshape_dim(in[0], out[0], static_cast<std::int64_t>(d), k);
      if (to >= 0) st.push_back({{S(static_cast<std::int64_t>(d))}, {S(to)}});
    }
    st.push_back({{P()}, {P()}});
    return st;
  };
  return Op{std::move(s), std::move(rules), local_shape};
}())
SPMDX_KERNEL("reshape", [](const Node& n, const Tensors& x) { return one(x[0].reshape(n.output()->meta().shape)); })

// transpose: dims dim0 and dim1 swapped, as torch.transpose (a view).
SPMDX_OP([] {
  OpSchema s;
  s.name = "transpose";
  s.min_inputs = s.max_inputs = 1;
  s.attrs = {{"dim0", ir::AttrType::integer, true, {}}, {"dim1", ir::AttrType::integer, true, {}}};
  s.infer = [](const Metas& in, const Attributes& a) {
    Shape sh = in[0]->shape;
    auto d0 = wrap_dim(std::get<std::int64_t>(a.at("dim0")), in[0]->rank());
    auto d1 = wrap_dim(std::get<std::int64_t>(a.at("dim1")), in[0]->rank());
    std::swap(sh[static_cast<std::size_t>(d0)], sh[static_cast<std::size_t>(d1)]);
    return std::vector{like(*in[0], sh, in[0]->requires_grad)};
  };
  s.vjp = [](Graph& g, const Node& n, const Grads& go) {
    return Grads{g.add("transpose", {go[0]}, {{"dim0", n.attr_int("dim0")}, {"dim1", n.attr_int("dim1")}})};
  };
  s.layout = [](const Node& n, std::size_t, const ir::LayoutQuery& q) -> std::optional<ir::OutputLayout> {
    Shape st = q.strides(0);
    const auto r = static_cast<std::int64_t>(st.size());
    std::swap(st[static_cast<std::size_t>(wrap_dim(n.attr_int("dim0"), r))], st[static_cast<std::size_t>(wrap_dim(n.attr_int("dim1"), r))]);
    return view(std::move(st));
  };
  s.samples = {{"transpose", {{{4, 6, 5}}}, {{"dim0", std::int64_t{0}}, {"dim1", std::int64_t{2}}}}};
  return Op{std::move(s), permutation_rule(), nullptr};
}())
SPMDX_KERNEL("transpose", [](const Node& n, const Tensors& x) { return one(x[0].transpose(n.attr_int("dim0"), n.attr_int("dim1"))); })

// permute: output dim i is input dim dims[i], as torch.permute (a view).
SPMDX_OP([] {
  OpSchema s;
  s.name = "permute";
  s.min_inputs = s.max_inputs = 1;
  s.attrs = {{"dims", ir::AttrType::ints, true, {}}};
  s.infer = [](const Metas& in, const Attributes& a) {
    const Shape& dims = std::get<Shape>(a.at("dims"));
    if (static_cast<std::int64_t>(dims.size()) != in[0]->rank()) {
      fail("dims " + ir::shape_str(dims) + " do not match rank " + std::to_string(in[0]->rank()));
    }
    Shape out;
    std::vector<bool> seen(dims.size(), false);
    for (auto d : dims) {
      auto w = static_cast<std::size_t>(wrap_dim(d, in[0]->rank()));
      if (seen[w]) fail("dims " + ir::shape_str(dims) + " repeat a dim");
      seen[w] = true;
      out.push_back(in[0]->shape[w]);
    }
    return std::vector{like(*in[0], out, in[0]->requires_grad)};
  };
  s.vjp = [](Graph& g, const Node& n, const Grads& go) {
    const Shape& dims = n.attr_ints("dims");
    Shape inverse(dims.size());
    const auto rank = static_cast<std::int64_t>(dims.size());
    for (std::size_t i = 0; i < dims.size(); ++i) {
      inverse[static_cast<std::size_t>(dims[i] < 0 ? dims[i] + rank : dims[i])] = static_cast<std::int64_t>(i);
    }
    return Grads{g.add("permute", {go[0]}, {{"dims", inverse}})};
  };
  s.layout = [](const Node& n, std::size_t, const ir::LayoutQuery& q) -> std::optional<ir::OutputLayout> {
    const Shape in = q.strides(0);
    Shape st;
    for (auto d : n.attr_ints("dims")) st.push_back(in[static_cast<std::size_t>(wrap_dim(d, static_cast<std::int64_t>(in.size())))]);
    return view(std::move(st));
  };
  s.samples = {{"permute", {{{4, 6, 5}}}, {{"dims", Shape{2, 0, 1}}}}};
  return Op{std::move(s), permutation_rule(), nullptr};
}())
SPMDX_KERNEL("permute", [](const Node& n, const Tensors& x) { return one(x[0].permute(n.attr_ints("dims"))); })

// expand: broadcast to `shape`, as torch.Tensor.expand (a view, stride 0 on the new dims); the
// gradient sums them away (sum_to).
SPMDX_OP([] {
  OpSchema s;
  s.name = "expand";
  s.min_inputs = s.max_inputs = 1;
  s.attrs = {kShape};
  s.infer = [](const Metas& in, const Attributes& a) {
    const Shape& shape = std::get<Shape>(a.at("shape"));
    if (broadcast(in[0]->shape, shape) != shape) fail("cannot expand " + ir::shape_str(in[0]->shape) + " to " + ir::shape_str(shape));
    return std::vector{like(*in[0], shape, in[0]->requires_grad)};
  };
  s.vjp = [](Graph& g, const Node& n, const Grads& go) { return Grads{reduce_to(g, go[0], n.input(0))}; };
  s.layout = [](const Node& n, std::size_t, const ir::LayoutQuery& q) -> std::optional<ir::OutputLayout> {
    const Shape& shape = n.output()->meta().shape;
    const Shape& in_shape = n.input(0)->meta().shape;
    const Shape in = q.strides(0);
    Shape st(shape.size(), 0);
    const std::size_t lead = shape.size() - in_shape.size();
    for (std::size_t d = 0; d < in_shape.size(); ++d) st[lead + d] = in_shape[d] == shape[lead + d] ? in[d] : 0;
    return view(std::move(st));
  };
  s.samples = {{"expand", {{{4, 1}}}, {{"shape", Shape{3, 4, 6}}}}};
  sharding::Rule rules = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>& out, std::int64_t k) {
    Strategies st{{{R()}, {R()}}};
    const Shape &x = in[0], &o = out[0];
    for (std::size_t d = 0; d < x.size(); ++d) {
      const std::size_t od = d + (o.size() - x.size());
      if (x[d] >= k && x[d] == o[od]) st.push_back({{S(static_cast<std::int64_t>(d))}, {S(static_cast<std::int64_t>(od))}});
    }
    st.push_back({{P()}, {P()}});
    return st;
  };
  return Op{std::move(s), std::move(rules), local_shape};
}())
SPMDX_KERNEL("expand", [](const Node& n, const Tensors& x) { return one(x[0].expand(n.attr_ints("shape"))); })

// slice: [start, end) with step along dim, start and end clamped as Python slicing (a view), as
// torch.Tensor.__getitem__ / aten.slice.Tensor; the gradient through slice_backward.
SPMDX_OP([] {
  OpSchema s;
  s.name = "slice";
  s.min_inputs = s.max_inputs = 1;
  s.attrs = {{"dim", ir::AttrType::integer, true, {}},
             {"start", ir::AttrType::integer, false, std::int64_t{0}},
             {"end", ir::AttrType::integer, true, {}},
             {"step", ir::AttrType::integer, false, std::int64_t{1}}};
  s.infer = [](const Metas& in, const Attributes& a) {
    Shape sh = in[0]->shape;
    if (sh.empty()) fail("cannot slice a scalar");
    auto d = static_cast<std::size_t>(wrap_dim(std::get<std::int64_t>(a.at("dim")), in[0]->rank()));
    const std::int64_t size = sh[d];
    auto clamp = [&](std::int64_t i) { return std::clamp<std::int64_t>(i < 0 ? i + size : i, 0, size); };
    const std::int64_t start = clamp(std::get<std::int64_t>(a.at("start")));
    const std::int64_t end = clamp(std::get<std::int64_t>(a.at("end")));
    const std::int64_t step = std::get<std::int64_t>(a.at("step"));
    if (step <= 0) fail("step must be positive, got " + std::to_string(step));
    sh[d] = end > start ? (end - start + step - 1) / step : 0;
    return std::vector{like(*in[0], sh, in[0]->requires_grad)};
  };
  s.vjp = [](Graph& g, const Node& n, const Grads& go) {
    Attributes a = n.attrs();
    a["input_shape"] = n.input(0)->meta().shape;
    return Grads{g.add("slice_backward", {go[0]}, a)};
  };
  s.layout = [](const Node& n, std::size_t, const ir::LayoutQuery& q) -> std::optional<ir::OutputLayout> {
    Shape st = q.strides(0);
    st[static_cast<std::size_t>(wrap_dim(n.attr_int("dim"), static_cast<std::int64_t>(st.size())))] *= n.attr_int("step");
    return view(std::move(st));
  };
  s.samples = {{"slice", {{{4, 7}}}, {{"dim", std::int64_t{1}}, {"start", std::int64_t{1}}, {"end", std::int64_t{6}}, {"step", std::int64_t{2}}}}};
  sharding::Rule rules = along_dim;
  return Op{std::move(s), std::move(rules), nullptr};
}())
SPMDX_KERNEL("slice", [](const Node& n, const Tensors& x) {
  const auto dim = wrap_dim(n.attr_int("dim"), x[0].dim());
  auto [start, end] = slice_bounds(n, x[0].size(dim));
  return one(x[0].slice(dim, start, end, n.attr_int("step")));
})

// slice_backward: a slice's gradient, zeros of input_shape with grad written into the slice
// (ATen's slice_backward).
SPMDX_OP([] {
  OpSchema s;
  s.name = "slice_backward";
  s.min_inputs = s.max_inputs = 1;
  s.attrs = {{"input_shape", ir::AttrType::ints, true, {}},
             {"dim", ir::AttrType::integer, true, {}},
             {"start", ir::AttrType::integer, false, std::int64_t{0}},
             {"end", ir::AttrType::integer, true, {}},
             {"step", ir::AttrType::integer, false, std::int64_t{1}}};
  s.infer = [](const Metas& in, const Attributes& a) {
    return std::vector{like(*in[0], std::get<Shape>(a.at("input_shape")), in[0]->requires_grad)};
  };
  s.samples = {{"slice_backward",
                {{{4, 3}}},
                {{"input_shape", Shape{4, 7}}, {"dim", std::int64_t{1}}, {"start", std::int64_t{1}}, {"end", std::int64_t{6}}, {"step", std::int64_t{2}}},
                false}};
  sharding::Rule rules = along_dim;
  sharding::LocalAttrsFn local = [](const Node& n, const std::vector<Shape>& local_out, std::int64_t) {
    Attributes a = n.attrs();
    a["input_shape"] = local_out.at(0);
    return a;
  };
  return Op{std::move(s), std::move(rules), std::move(local)};
}())
SPMDX_KERNEL("slice_backward", [](const Node& n, const Tensors& x) {
  const auto& shape = n.attr_ints("input_shape");
  const auto dim = wrap_dim(n.attr_int("dim"), static_cast<std::int64_t>(shape.size()));
  auto [start, end] = slice_bounds(n, shape[static_cast<std::size_t>(dim)]);
  return one(at::slice_backward(x[0], shape, dim, start, end, n.attr_int("step")));
})

// cat: the inputs joined along dim, as torch.cat; the gradient is a slice of it per input.
SPMDX_OP([] {
  OpSchema s;
  s.name = "cat";
  s.min_inputs = 1;
  s.max_inputs = -1;
  s.attrs = {{"dim", ir::AttrType::integer, false, std::int64_t{0}}};
  s.infer = [](const Metas& in, const Attributes& a) {
    same_dtype(in);
    Shape out = in[0]->shape;
    auto d = wrap_dim(std::get<std::int64_t>(a.at("dim")), in[0]->rank());
    for (std::size_t i = 1; i < in.size(); ++i) {
      const Shape& sh = in[i]->shape;
      for (std::size_t j = 0; j < out.size(); ++j) {
        if (sh.size() != out.size() || (static_cast<std::int64_t>(j) != d && sh[j] != out[j])) {
          fail("input " + std::to_string(i) + " " + ir::shape_str(sh) + " does not match " + ir::shape_str(in[0]->shape) + " outside dim " +
               std::to_string(d));
        }
      }
      out[static_cast<std::size_t>(d)] += sh[static_cast<std::size_t>(d)];
    }
    return std::vector{like(*in[0], out, any_requires_grad(in))};
  };
  s.vjp = [](Graph& g, const Node& n, const Grads& go) {
    Grads out;
    std::int64_t dim = n.attr_int("dim");
    if (dim < 0) dim += n.input(0)->meta().rank();
    std::int64_t offset = 0;
    for (const Value* x : n.inputs()) {
      const std::int64_t size = x->meta().shape[static_cast<std::size_t>(dim)];
      out.push_back(g.add("slice", {go[0]}, {{"dim", dim}, {"start", offset}, {"end", offset + size}}));
      offset += size;
    }
    return out;
  };
  s.samples = {{"cat", {{{4, 3}}, {{4, 1}}, {{4, 2}}}, {{"dim", std::int64_t{1}}}}};
  sharding::Rule rules = along_dim;
  return Op{std::move(s), std::move(rules), nullptr};
}())
SPMDX_KERNEL("cat", [](const Node& n, const Tensors& x) { return one(at::cat(x, n.attr_int("dim"))); })

// chunk (the local half of redistribution, Replicate -> Shard): this rank's torch.chunk piece
// of `dim`, sizes[index] long, made contiguous (narrow(...).contiguous(): a view when the
// narrowed block is contiguous). Placed by the rewriter, so no rules.
SPMDX_OP([] {
  OpSchema s;
  s.name = "chunk";
  s.min_inputs = s.max_inputs = 1;
  s.attrs = {{"dim", ir::AttrType::integer, true, {}}, {"sizes", ir::AttrType::ints, true, {}}, {"index", ir::AttrType::integer, true, {}}};
  s.infer = scatter_dim;
  s.layout = [](const Node& n, std::size_t, const ir::LayoutQuery& q) -> std::optional<ir::OutputLayout> {
    const Shape& shape = n.output()->meta().shape;
    return ir::OutputLayout{ir::contiguous_strides(shape), q.contiguous(0) && ir::front_is_view(n.input(0)->meta().shape, n.attr_int("dim"))};
  };
  return Op{std::move(s), nullptr, nullptr};
}())
SPMDX_KERNEL("chunk", [](const Node& n, const Tensors& x) {
  const auto& sizes = n.attr_ints("sizes");
  const auto index = static_cast<std::size_t>(n.attr_int("index"));
  std::int64_t start = 0;
  for (std::size_t i = 0; i < index; ++i) start += sizes[i];
  return one(x[0].narrow(wrap_dim(n.attr_int("dim"), x[0].dim()), start, sizes[index]).contiguous());
})

// seq_permute: x with dim `dim` cut into `chunks` equal pieces put in load-balanced order for
// causal attention: piece 0, chunks - 1, 1, chunks - 2, ... (Llama 3's context parallelism,
// torch's _HeadTailLoadBalancer: with chunks = 2 cp, rank r of cp holds pieces r and
// 2 cp - 1 - r of the sequence, as much work as any other rank); inverse = true puts them back.
// The kernel is an index_select; the gradient is the inverse permutation.
SPMDX_OP([] {
  OpSchema s;
  s.name = "seq_permute";
  s.min_inputs = s.max_inputs = 1;
  s.attrs = {{"dim", ir::AttrType::integer, true, std::int64_t{0}},
             {"chunks", ir::AttrType::integer, true, std::int64_t{2}},
             {"inverse", ir::AttrType::boolean, false, false}};
  s.infer = [](const Metas& in, const Attributes& a) {
    const std::int64_t dim = wrap_dim(std::get<std::int64_t>(a.at("dim")), in[0]->rank());
    const std::int64_t chunks = std::get<std::int64_t>(a.at("chunks"));
    if (chunks < 1 || in[0]->shape[static_cast<std::size_t>(dim)] % chunks != 0) {
      fail("chunks " + std::to_string(chunks) + " does not divide dim " + std::to_string(dim) + " of " + in[0]->str());
    }
    return std::vector{*in[0]};
  };
  s.vjp = [](Graph& g, const Node& n, const Grads& go) {  // the pieces put back
    return Grads{g.add("seq_permute", {go[0]}, {{"dim", n.attr_int("dim")}, {"chunks", n.attr_int("chunks")}, {"inverse", !n.attr_bool("inverse")}})};
  };
  s.samples = {{"seq_permute", {{{4, 8, 3}}}, {{"dim", std::int64_t{1}}, {"chunks", std::int64_t{4}}}},
               {"seq_permute_inverse", {{{4, 8, 3}}}, {{"dim", std::int64_t{1}}, {"chunks", std::int64_t{4}}, {"inverse", true}}}};
  // Along the permuted dim only whole tensors (pieces move).
  sharding::Rule rules = along_dim;
  return Op{std::move(s), std::move(rules), nullptr};
}())
SPMDX_KERNEL("seq_permute", [](const Node& n, const Tensors& x) {
  const std::int64_t dim = wrap_dim(n.attr_int("dim"), x[0].dim()), chunks = n.attr_int("chunks");
  const std::int64_t piece = x[0].size(dim) / chunks;
  std::vector<std::int64_t> index(static_cast<std::size_t>(x[0].size(dim)));
  for (std::int64_t j = 0; j < chunks; ++j) {
    for (std::int64_t i = 0; i < piece; ++i) {
      const std::int64_t to = j * piece + i, from = ir::balanced_piece(j, chunks) * piece + i;
      if (n.attr_bool("inverse")) index[static_cast<std::size_t>(from)] = to;
      else index[static_cast<std::size_t>(to)] = from;
    }
  }
  return one(x[0].index_select(dim, at::tensor(index, at::TensorOptions().dtype(at::kLong)).to(x[0].device())));
})

}  // namespace spmdx::ops
