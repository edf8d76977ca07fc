// Reductions: sums and means over dims, the squared L2 norm, sum_to (broadcasting's reverse), softmax and
// log_softmax over one dim with their backward ops, and found_inf. Kernels are ATen's ops of the
// same name (squared_norm: ATen's vector_norm by rows); VJPs follow PyTorch's derivatives.yaml. Autocast computes the reductions, softmax
// and log_softmax in float32.
#include <numeric>
#include <set>

#include "common.h"

namespace spmdx::ops {
namespace {

// sum and mean: `dims` (empty: every dim), `keepdim`, as torch.sum / torch.mean.
[[maybe_unused]] OpSchema reduction(const std::string& name, bool mean) {
  OpSchema s;
  s.name = name;
  s.min_inputs = s.max_inputs = 1;
  s.attrs = {{"dims", ir::AttrType::ints, false, Shape{}}, {"keepdim", ir::AttrType::boolean, false, false}};
  s.infer = [](const Metas& in, const Attributes& a) {
    const Shape& x = in[0]->shape;
    Shape dims = std::get<Shape>(a.at("dims"));
    if (dims.empty()) {  // all dims, as torch.sum(x)
      dims.resize(x.size());
      std::iota(dims.begin(), dims.end(), 0);
    }
    std::vector<bool> reduced(x.size(), false);
    for (auto d : dims) {
      auto w = wrap_dim(d, static_cast<std::int64_t>(x.size()));
      if (reduced[w]) fail("dim " + std::to_string(d) + " appears twice in dims");
      reduced[w] = true;
    }
    const bool keep = std::get<bool>(a.at("keepdim"));
    Shape out;
    for (std::size_t i = 0; i < x.size(); ++i) {
      if (!reduced[i]) out.push_back(x[i]);
      else if (keep) out.push_back(1);
    }
    return std::vector{like(*in[0], out, in[0]->requires_grad)};
  };
  // The gradient broadcast back over the reduced dims (divided by their count for the mean).
  s.vjp = [mean](Graph& g, const Node& n, const Grads& go) {
    const Shape& x = n.input(0)->meta().shape;
    Shape dims = n.attr_ints("dims");
    if (dims.empty()) {
      for (std::size_t i = 0; i < x.size(); ++i) dims.push_back(static_cast<std::int64_t>(i));
    }
    Shape kept = x;
    std::int64_t count = 1;
    for (auto d : dims) {
      const auto w = static_cast<std::size_t>(d < 0 ? d + static_cast<std::int64_t>(x.size()) : d);
      count *= x[w];
      kept[w] = 1;
    }
    Value* grad = go[0];
    if (grad->meta().shape != kept) grad = g.add("reshape", {grad}, {{"shape", kept}});
    grad = g.add("expand", {grad}, {{"shape", x}});
    if (mean) grad = g.add("mul_scalar", {grad}, float_attr(1.0 / static_cast<double>(count)));
    return Grads{grad};
  };
  s.precision = ir::Precision::float32;
  return s;
}

// A reduced dim sharded gives partial sums (or, split evenly, partial averages for the mean);
// any other dim stays sharded.
[[maybe_unused]] sharding::Rule reduction_rule(bool mean) {
  return [mean](const Node& n, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t k) {
    Strategies s{sharding::rule::all(R(), 1, 1)};
    const Shape& x = in[0];
    std::set<std::int64_t> reduced;
    for (auto d : n.attr_ints("dims")) reduced.insert(d < 0 ? d + static_cast<std::int64_t>(x.size()) : d);
    if (reduced.empty()) {
      for (std::size_t d = 0; d < x.size(); ++d) reduced.insert(static_cast<std::int64_t>(d));
    }
    const bool keep = n.attr_bool("keepdim");
    std::int64_t out_dim = 0;
    for (std::size_t d = 0; d < x.size(); ++d) {
      const bool is_reduced = reduced.count(static_cast<std::int64_t>(d)) > 0;
      if (x[d] >= k) {
        if (!is_reduced) s.push_back({{S(static_cast<std::int64_t>(d))}, {S(out_dim)}});
        else if (!mean) s.push_back({{S(static_cast<std::int64_t>(d))}, {P()}});
        else if (x[d] % k == 0) s.push_back({{S(static_cast<std::int64_t>(d))}, {Placement::partial(ReduceOp::avg)}});
      }
      if (!is_reduced || keep) ++out_dim;
    }
    s.push_back({{P()}, {P()}});
    return s;
  };
}

// softmax and log_softmax over `dim`: floating x -> the same shape, autocast's float32; ATen's
// kernel copies a strided input contiguous first.
[[maybe_unused]] OpSchema softmax_like(const std::string& name, const std::string& backward) {
  OpSchema s;
  s.name = name;
  s.min_inputs = s.max_inputs = 1;
  s.attrs = {{"dim", ir::AttrType::integer, false, std::int64_t{-1}}};
  s.infer = [](const Metas& in, const Attributes& a) {
    floating(*in[0], "the input");
    wrap_dim(std::get<std::int64_t>(a.at("dim")), in[0]->rank());
    return std::vector{like(*in[0], in[0]->shape, in[0]->requires_grad)};
  };
  s.vjp = [backward](Graph& g, const Node& n, const Grads& go) {
    return Grads{g.add(backward, {go[0], n.output()}, {{"dim", n.attr_int("dim")}})};
  };
  s.scratch = [](const Node& n, const ir::LayoutQuery& q) { return q.contiguous(0) ? 0 : n.input(0)->meta().nbytes(); };
  s.precision = ir::Precision::float32;
  return s;
}

// Along the softmax's dim only whole rows: any other dim sharded alike.
[[maybe_unused]] Strategies softmax_strategies(const Node& n, const std::vector<Shape>& in, const std::vector<Shape>& out, std::int64_t k) {
  return sharding::rule::same_dim(in, out, k, {wrap_dim(n.attr_int("dim"), static_cast<std::int64_t>(in[0].size()))}, in[0].size());
}

// (grad, output) -> grad_in, as ATen's _softmax_backward_data / _log_softmax_backward_data.
[[maybe_unused]] OpSchema softmax_backward_like(const std::string& name) {
  OpSchema s;
  s.name = name;
  s.min_inputs = s.max_inputs = 2;
  s.attrs = {{"dim", ir::AttrType::integer, false, std::int64_t{-1}}};
  s.infer = [](const Metas& in, const Attributes&) {
    same_dtype({in[0], in[1]});
    if (in[0]->shape != in[1]->shape) fail("grad and input shapes differ");
    return std::vector{like(*in[1], in[1]->shape, any_requires_grad(in))};
  };
  return s;
}

// The backward is linear in the incoming gradient: Partial grad -> Partial grad_in.
[[maybe_unused]] Strategies softmax_backward_strategies(const Node& n, const std::vector<Shape>& in, const std::vector<Shape>& out, std::int64_t k) {
  Strategies s = softmax_strategies(n, in, out, k);
  s.push_back({{P(), R()}, {P()}});
  return s;
}

}  // namespace

// sum: torch.sum(x, dims, keepdim).
SPMDX_OP([] {
  Op op{reduction("sum", false), reduction_rule(false), nullptr};
  op.schema.samples = {{"sum_dim", {{{4, 6, 5}}}, {{"dims", Shape{1}}}}, {"sum_all", {{{4, 6}}}, {}}};
  return op;
}())
SPMDX_KERNEL("sum", [](const Node& n, const Tensors& x) {
  const auto& dims = n.attr_ints("dims");
  return one(dims.empty() && !n.attr_bool("keepdim") ? at::sum(x[0]) : at::sum(x[0], dims, n.attr_bool("keepdim")));
})

// squared_norm: x -> the sum of the squares of all its elements, a scalar of x's dtype
// (torch.linalg.vector_norm(x) ** 2), in one pass over x where sum(mul(x, x)) writes x's size
// and reads it again. The gradient norm's term per parameter: torch.nn.utils.clip_grad_norm_
// takes each gradient's vector_norm (torch._foreach_norm) and the norm of those norms, the same
// sum. Autocast's float32. A sharded x gives partial sums; a Partial x is not squared piecewise.
SPMDX_OP([] {
  OpSchema s;
  s.name = "squared_norm";
  s.min_inputs = s.max_inputs = 1;
  s.infer = [](const Metas& in, const Attributes&) {
    floating(*in[0], "x");
    return std::vector{like(*in[0], Shape{}, in[0]->requires_grad)};
  };
  // d/dx sum(x^2) = 2 x, times the incoming scalar gradient.
  s.vjp = [](Graph& g, const Node& n, const Grads& go) {
    const Shape& x = n.input(0)->meta().shape;
    Value* grad = g.add("expand", {g.add("reshape", {go[0]}, {{"shape", Shape(x.size(), 1)}})}, {{"shape", x}});
    return Grads{g.add("mul", {n.input(0), g.add("mul_scalar", {grad}, float_attr(2.0))})};
  };
  s.flops = [](const Node& n) { return 2 * static_cast<double>(n.input(0)->meta().numel()); };
  s.precision = ir::Precision::float32;
  s.samples = {{"squared_norm", {{{4, 6, 5}}}, {}}};
  // The sharded reads first: the cost model prices an op's work by its outputs' bytes, the
  // same scalar either way, and takes the first of equals. A gradient kept sharded (an
  // embedding's split by columns) is then summed where it is, as sum(mul(g, g)) was, instead of
  // read through the replicated copy that AdamW wants (one more all_gather).
  sharding::Rule rule = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t k) {
    Strategies st;
    for (std::size_t d = 0; d < in[0].size(); ++d) {
      if (in[0][d] >= k) st.push_back({{S(static_cast<std::int64_t>(d))}, {P()}});
    }
    st.push_back(sharding::rule::all(R(), 1, 1));
    return st;
  };
  return Op{std::move(s), std::move(rule), nullptr};
}())
#if defined(SPMDX_OPS_KERNELS)
namespace {

// In rows of kSquaredNormRow elements: each row's L2 norm by ATen's vector_norm (one pass over
// memory, no temporary), the rows' squares summed in double. The whole tensor's vector_norm
// accumulates 11.5M float32 squares 9e-4 off (measured, f32[5632, 2048], against float64);
// by rows 3e-9 to 9e-9, no less exact than at::sum(x * x)'s cascade sum (8e-9 to 4e-8), at a
// quarter of its time (Intel Xeon, one thread: 1.9 ms against 7.8 ms for the mul and the sum
// on reused memory).
constexpr std::int64_t kSquaredNormRow = 4096;

at::Tensor squared_norm(const at::Tensor& x) {
  if (!x.is_cpu()) return at::sum(x * x);  // CUDA: temporaries are cheap there, and it is the tested path
  const at::Tensor flat = x.reshape(-1);
  const std::int64_t rows = flat.numel() / kSquaredNormRow, rest = flat.numel() % kSquaredNormRow;
  at::Tensor total = at::zeros({}, x.options().dtype(at::kDouble));
  if (rows > 0) total.add_(at::linalg_vector_norm(flat.narrow(0, 0, rows * kSquaredNormRow).view({rows, kSquaredNormRow}), 2, {1}).to(at::kDouble).square().sum());
  if (rest > 0) total.add_(at::linalg_vector_norm(flat.narrow(0, rows * kSquaredNormRow, rest), 2).to(at::kDouble).square());
  return total.to(x.scalar_type());
}

}  // namespace
#endif
SPMDX_KERNEL("squared_norm", [](const Node&, const Tensors& x) { return one(squared_norm(x[0])); })

// mean: torch.mean(x, dims, keepdim).
SPMDX_OP([] {
  Op op{reduction("mean", true), reduction_rule(true), nullptr};
  op.schema.samples = {{"mean_keepdim", {{{4, 6, 5}}}, {{"dims", Shape{0, 2}}, {"keepdim", true}}}};
  return op;
}())
SPMDX_KERNEL("mean", [](const Node& n, const Tensors& x) {
  const auto& dims = n.attr_ints("dims");
  return one(dims.empty() && !n.attr_bool("keepdim") ? at::mean(x[0]) : at::mean(x[0], dims, n.attr_bool("keepdim")));
})

// sum_to: x summed down to `shape`, the broadcast dims away (at::sum_to, broadcasting's
// reverse); the gradient expands back.
SPMDX_OP([] {
  OpSchema s;
  s.name = "sum_to";
  s.min_inputs = s.max_inputs = 1;
  s.attrs = {{"shape", ir::AttrType::ints, true, {}}};
  s.infer = [](const Metas& in, const Attributes& a) {
    const Shape& shape = std::get<Shape>(a.at("shape"));
    if (broadcast(shape, in[0]->shape) != in[0]->shape) fail("cannot sum " + ir::shape_str(in[0]->shape) + " to " + ir::shape_str(shape));
    return std::vector{like(*in[0], shape, in[0]->requires_grad)};
  };
  s.vjp = [](Graph& g, const Node& n, const Grads& go) { return Grads{g.add("expand", {go[0]}, {{"shape", n.input(0)->meta().shape}})}; };
  s.samples = {{"sum_to", {{{4, 6, 5}}}, {{"shape", Shape{6, 1}}}}};
  // A kept dim stays sharded; a dim summed away gives partial sums.
  sharding::Rule rule = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>& out, std::int64_t k) {
    Strategies st{sharding::rule::all(R(), 1, 1)};
    const Shape &x = in[0], &o = out[0];
    for (std::size_t d = 0; d < x.size(); ++d) {
      if (x[d] < k) continue;
      const auto od = static_cast<std::int64_t>(d) - static_cast<std::int64_t>(x.size() - o.size());
      if (od >= 0 && o[static_cast<std::size_t>(od)] == x[d]) st.push_back({{S(static_cast<std::int64_t>(d))}, {S(od)}});
      else st.push_back({{S(static_cast<std::int64_t>(d))}, {P()}});  // summed away
    }
    st.push_back({{P()}, {P()}});
    return st;
  };
  // A rank sums its shard down to its local shape.
  sharding::LocalAttrsFn local = [](const Node& n, const std::vector<Shape>& local_out, std::int64_t) {
    Attributes a = n.attrs();
    a["shape"] = local_out.at(0);
    return a;
  };
  return Op{std::move(s), std::move(rule), std::move(local)};
}())
SPMDX_KERNEL("sum_to", [](const Node& n, const Tensors& x) { return one(at::sum_to(x[0], n.attr_ints("shape"))); })

// softmax: exp(x) / sum(exp(x)) over `dim`, torch.softmax; the gradient through softmax_backward.
SPMDX_OP([] {
  Op op{softmax_like("softmax", "softmax_backward"), softmax_strategies, nullptr};
  op.schema.samples = {{"softmax", {{{4, 6}}}, {{"dim", std::int64_t{1}}}}};
  return op;
}())
SPMDX_KERNEL("softmax", [](const Node& n, const Tensors& x) { return one(at::softmax(x[0], n.attr_int("dim"))); })

// log_softmax: x - logsumexp(x) over `dim`, torch.log_softmax; the gradient through log_softmax_backward.
SPMDX_OP([] {
  Op op{softmax_like("log_softmax", "log_softmax_backward"), softmax_strategies, nullptr};
  op.schema.samples = {{"log_softmax", {{{4, 6}}}, {{"dim", std::int64_t{-1}}}}};
  return op;
}())
SPMDX_KERNEL("log_softmax", [](const Node& n, const Tensors& x) { return one(at::log_softmax(x[0], n.attr_int("dim"))); })

// softmax_backward: (grad, y) -> y * (grad - sum(grad * y, dim)), ATen's _softmax_backward_data.
SPMDX_OP([] {
  Op op{softmax_backward_like("softmax_backward"), softmax_backward_strategies, nullptr};
  op.schema.samples = {{"softmax_backward", {{{4, 6}}, {{4, 6}}}, {{"dim", std::int64_t{1}}}, false}};
  return op;
}())
SPMDX_KERNEL("softmax_backward", [](const Node& n, const Tensors& x) {
  return one(at::_softmax_backward_data(x[0], x[1], n.attr_int("dim"), x[1].scalar_type()));
})

// log_softmax_backward: (grad, y) -> grad - exp(y) * sum(grad, dim), ATen's _log_softmax_backward_data.
SPMDX_OP([] {
  Op op{softmax_backward_like("log_softmax_backward"), softmax_backward_strategies, nullptr};
  op.schema.samples = {{"log_softmax_backward", {{{4, 6}}, {{4, 6}}}, {{"dim", std::int64_t{-1}}}, false}};
  return op;
}())
SPMDX_KERNEL("log_softmax_backward", [](const Node& n, const Tensors& x) {
  return one(at::_log_softmax_backward_data(x[0], x[1], n.attr_int("dim"), x[1].scalar_type()));
})

// found_inf: x (floating) -> 1.0 when any element of x is inf or nan, else 0.0, a float32
// scalar (torch.amp.GradScaler's found_inf, from _amp_foreach_non_finite_check_and_unscale_).
// Its input is a replicated value (the global gradient norm): all-Replicate only.
SPMDX_OP([] {
  OpSchema s;
  s.name = "found_inf";
  s.min_inputs = s.max_inputs = 1;
  s.infer = [](const Metas& in, const Attributes&) {
    floating(*in[0], "found_inf's input");
    return std::vector{ir::TensorMeta{{}, ir::DType::f32, in[0]->device, false}};
  };
  s.samples = {{"found_inf", {{{4, 5}, Fill::nonfinite}}, {}, false}};
  sharding::Rule rule = [](const Node&, const std::vector<Shape>&, const std::vector<Shape>&, std::int64_t) {
    return Strategies{sharding::rule::all(R(), 1, 1)};
  };
  return Op{std::move(s), std::move(rule), nullptr};
}())
SPMDX_KERNEL("found_inf", [](const Node&, const Tensors& x) { return one(at::isfinite(x[0]).all().logical_not().to(at::kFloat)); })

}  // namespace spmdx::ops
