// Losses: cross_entropy with its backward, and the ops of vocabulary-parallel cross entropy
// (Megatron-LM's, torchtitan's loss_parallel; train/loss_parallel.h), written so that shards of
// the logits' classes need no gathered logits: amax_rows, sum_exp_rows, pick (with their
// backward ops), valid_rows and count_valid. Autocast computes cross_entropy in float32.
#include "common.h"

namespace spmdx::ops {
namespace {

// The rows of x [n, ...] (every dim but the last), for the scratch of row-wise kernels.
[[maybe_unused]] std::int64_t rows_of(const Value* x) { return x->meta().shape.empty() ? 0 : x->meta().numel_without(-1); }

// A dtype attribute naming a floating type.
[[maybe_unused]] ir::DType floating_dtype(const Attributes& a) {
  auto dtype = ir::parse_dtype(std::get<std::string>(a.at("dtype")));
  if (!dtype || !ir::is_floating(*dtype)) fail("dtype must name a floating type");
  return *dtype;
}

}  // namespace

#if defined(SPMDX_OPS_KERNELS)
namespace {

// The rows whose target is one of this rank's columns (offset .. offset + columns) and not ignored.
std::pair<at::Tensor, at::Tensor> picked(const Node& n, const at::Tensor& targets, std::int64_t columns) {
  const std::int64_t offset = n.attr_int("offset");
  const at::Tensor valid = targets.ne(n.attr_int("ignore_index")).logical_and(targets.ge(offset)).logical_and(targets.lt(offset + columns));
  return std::pair{valid.unsqueeze(1), at::where(valid, targets - offset, at::zeros_like(targets)).unsqueeze(1)};
}

}  // namespace
#endif

// cross_entropy: logits[n, c], targets (i64)[n] -> scalar: the mean ("mean") or the sum
// ("sum") over targets != ignore_index, torch.nn.functional.cross_entropy. Sums over tokens
// split across ranks are partial sums; a mean is not (kept replicated).
SPMDX_OP([] {
  OpSchema s;
  s.name = "cross_entropy";
  s.min_inputs = s.max_inputs = 2;
  s.attrs = {{"ignore_index", ir::AttrType::integer, false, std::int64_t{-100}}, {"reduction", ir::AttrType::string, false, std::string("mean")}};
  s.infer = [](const Metas& in, const Attributes& a) {
    floating(*in[0], "logits");
    if (in[0]->rank() != 2 || in[1]->rank() != 1 || in[0]->shape[0] != in[1]->shape[0]) fail("needs logits [n, classes] and targets [n]");
    if (in[1]->dtype != ir::DType::i64) fail("targets must be i64");
    const auto& r = std::get<std::string>(a.at("reduction"));
    if (r != "mean" && r != "sum") fail("reduction must be \"mean\" or \"sum\", got \"" + r + "\"");
    return std::vector{like(*in[0], Shape{}, in[0]->requires_grad)};
  };
  s.vjp = [](Graph& g, const Node& n, const Grads& go) {
    return Grads{g.add("cross_entropy_backward", {go[0], n.input(0), n.input(1)},
                       {{"ignore_index", n.attr_int("ignore_index")}, {"reduction", n.attr_string("reduction")}}),
                 nullptr};
  };
  s.scratch = [](const Node& n, const ir::LayoutQuery&) { return n.input(0)->meta().nbytes(); };  // log_softmax of the logits
  s.precision = ir::Precision::float32;
  s.samples = {{"cross_entropy_mean", {{{6, 5}}, {{6}, Fill::indices}}, {{"ignore_index", std::int64_t{2}}}},
               {"cross_entropy_sum", {{{6, 5}}, {{6}, Fill::indices}}, {{"ignore_index", std::int64_t{2}}, {"reduction", std::string("sum")}}}};
  sharding::Rule rule = [](const Node& n, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t k) {
    Strategies st{sharding::rule::all(R(), 2, 1)};
    if (n.attr_string("reduction") == "sum" && in[0][0] >= k) st.push_back({{S(0), S(0)}, {P()}});
    return st;
  };
  return Op{std::move(s), std::move(rule), nullptr};
}())
SPMDX_KERNEL("cross_entropy", [](const Node& n, const Tensors& x) {
  const auto reduction = n.attr_string("reduction") == "sum" ? at::Reduction::Sum : at::Reduction::Mean;
  return one(at::cross_entropy_loss(x[0], x[1], {}, reduction, n.attr_int("ignore_index")));
})

// cross_entropy_backward: grad (scalar), logits[n, c], targets[n] -> grad_logits[n, c] =
// softmax(logits) - onehot(target), rows of ignored targets 0, divided by the count of the
// others for the mean (autograd's nll_loss_backward then _log_softmax_backward_data).
SPMDX_OP([] {
  OpSchema s;
  s.name = "cross_entropy_backward";
  s.min_inputs = s.max_inputs = 3;
  s.attrs = {{"ignore_index", ir::AttrType::integer, false, std::int64_t{-100}}, {"reduction", ir::AttrType::string, false, std::string("mean")}};
  s.infer = [](const Metas& in, const Attributes&) { return std::vector{like(*in[1], in[1]->shape, any_requires_grad(in))}; };
  s.scratch = [](const Node& n, const ir::LayoutQuery&) { return 2 * n.input(1)->meta().nbytes(); };  // log_softmax, nll_loss_backward
  s.samples = {{"cross_entropy_backward_sum", {{{}}, {{6, 5}}, {{6}, Fill::indices}}, {{"reduction", std::string("sum")}}, false}};
  sharding::Rule rule = [](const Node& n, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t k) {
    Strategies st{sharding::rule::all(R(), 3, 1)};
    if (n.attr_string("reduction") == "sum") {
      if (in[1][0] >= k) st.push_back({{R(), S(0), S(0)}, {S(0)}});
      st.push_back({{P(), R(), R()}, {P()}});
    }
    return st;
  };
  return Op{std::move(s), std::move(rule), nullptr};
}())
SPMDX_KERNEL("cross_entropy_backward", [](const Node& n, const Tensors& x) {
  // As autograd does for cross_entropy = nll_loss(log_softmax): ATen's two fused backward
  // kernels, softmax(x) - onehot(target) without materialising the one-hot [N, V] matrix.
  const std::int64_t ignore = n.attr_int("ignore_index");
  const at::Tensor logits = x[1].reshape({-1, x[1].size(-1)});
  const at::Tensor target = x[2].reshape({-1});
  const bool sum = n.attr_string("reduction") == "sum";
  at::Tensor lsm = at::log_softmax(logits, -1);
  at::Tensor total_weight = target.ne(ignore).sum().to(logits.scalar_type());
  at::Tensor g = at::nll_loss_backward(x[0], lsm, target, {}, sum ? at::Reduction::Sum : at::Reduction::Mean, ignore, total_weight);
  return one(at::_log_softmax_backward_data(g, lsm, -1, logits.scalar_type()).view(x[1].sizes()));
})

// amax_rows: x[n, c] -> its row maxima [n, 1], torch.amax(x, -1, keepdim=True), with no
// gradient: it only steadies a logsumexp, whose value and gradient do not depend on it. The
// classes split across ranks give partial maxima.
SPMDX_OP([] {
  OpSchema s;
  s.name = "amax_rows";
  s.min_inputs = s.max_inputs = 1;
  s.infer = [](const Metas& in, const Attributes&) {
    floating(*in[0], "x");
    if (in[0]->rank() != 2) fail("needs x [n, classes]");
    return std::vector{like(*in[0], Shape{in[0]->shape[0], 1}, false)};
  };
  s.vjp = [](Graph&, const Node&, const Grads&) { return Grads{nullptr}; };
  s.samples = {{"amax_rows", {{{6, 6}}}, {}, false}};
  sharding::Rule rule = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t k) {
    Strategies st{sharding::rule::all(R(), 1, 1)};
    if (in[0][0] >= k) st.push_back({{S(0)}, {S(0)}});
    if (in[0][1] >= k) st.push_back({{S(1)}, {Placement::partial(ReduceOp::max)}});
    return st;
  };
  return Op{std::move(s), std::move(rule), nullptr};
}())
SPMDX_KERNEL("amax_rows", [](const Node&, const Tensors& x) { return one(at::amax(x[0], {1}, true)); })

// sum_exp_rows: x[n, c], m[n, 1] -> [n, 1]: sum over each row of exp(x - m),
// torch.exp(x - m).sum(-1, keepdim=True), its gradient to x alone (m is amax_rows'). Classes
// split across ranks give partial sums.
SPMDX_OP([] {
  OpSchema s;
  s.name = "sum_exp_rows";
  s.min_inputs = s.max_inputs = 2;
  s.infer = [](const Metas& in, const Attributes&) {
    floating(*in[0], "x");
    if (in[0]->rank() != 2 || in[1]->shape != Shape{in[0]->shape[0], 1}) fail("needs x [n, classes] and m [n, 1]");
    return std::vector{like(*in[0], Shape{in[0]->shape[0], 1}, in[0]->requires_grad)};
  };
  s.vjp = [](Graph& g, const Node& n, const Grads& go) {
    return Grads{g.add("sum_exp_rows_backward", {go[0], n.input(0), n.input(1)}), nullptr};
  };
  s.scratch = [](const Node& n, const ir::LayoutQuery&) { return n.input(0)->meta().nbytes(); };  // exp(x - m) before the row sums
  s.samples = {{"sum_exp_rows", {{{6, 6}}, {{6, 1}, Fill::constant}}, {}}};
  sharding::Rule rule = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t k) {
    Strategies st{sharding::rule::all(R(), 2, 1)};
    if (in[0][0] >= k) st.push_back({{S(0), S(0)}, {S(0)}});
    if (in[0][1] >= k) st.push_back({{S(1), R()}, {P()}});
    return st;
  };
  return Op{std::move(s), std::move(rule), nullptr};
}())
SPMDX_KERNEL("sum_exp_rows", [](const Node&, const Tensors& x) {
  at::Tensor e = x[0] - x[1];  // the one temporary (the record's scratch)
  return one(e.exp_().sum(1, true));
})

// sum_exp_rows_backward: grad[n, 1], x[n, c], m[n, 1] -> grad x exp(x - m), [n, c].
SPMDX_OP([] {
  OpSchema s;
  s.name = "sum_exp_rows_backward";
  s.min_inputs = s.max_inputs = 3;
  s.infer = [](const Metas& in, const Attributes&) { return std::vector{like(*in[1], in[1]->shape, any_requires_grad(in))}; };
  s.samples = {{"sum_exp_rows_backward", {{{6, 1}}, {{6, 6}}, {{6, 1}}}, {}, false}};
  sharding::Rule rule = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t k) {
    Strategies st{sharding::rule::all(R(), 3, 1)};
    if (in[1][1] >= k) st.push_back({{R(), S(1), R()}, {S(1)}});  // first: at equal cost, the columns the logits have
    if (in[1][0] >= k) st.push_back({{S(0), S(0), S(0)}, {S(0)}});
    st.push_back({{P(), R(), R()}, {P()}});
    return st;
  };
  return Op{std::move(s), std::move(rule), nullptr};
}())
SPMDX_KERNEL("sum_exp_rows_backward", [](const Node&, const Tensors& x) {
  at::Tensor e = x[1] - x[2];  // becomes the output
  return one(e.exp_().mul_(x[0]));
})

// pick: logits[n, c], targets (i64)[n] -> [n, 1]: logits[i, targets[i] - offset] where that is
// one of the c columns and targets[i] != ignore_index, else 0 (torch.gather of the targets'
// column; `offset`: the first class a rank's columns hold, set by the rewriter). Classes split
// across ranks give partial picks (a rank's pick is 0 where the target is another's).
SPMDX_OP([] {
  OpSchema s;
  s.name = "pick";
  s.min_inputs = s.max_inputs = 2;
  s.attrs = {{"ignore_index", ir::AttrType::integer, false, std::int64_t{-100}}, {"offset", ir::AttrType::integer, false, std::int64_t{0}}};
  s.infer = [](const Metas& in, const Attributes&) {
    floating(*in[0], "logits");
    if (in[0]->rank() != 2 || in[1]->rank() != 1 || in[0]->shape[0] != in[1]->shape[0]) fail("needs logits [n, classes] and targets [n]");
    if (in[1]->dtype != ir::DType::i64) fail("targets must be i64");
    return std::vector{like(*in[0], Shape{in[0]->shape[0], 1}, in[0]->requires_grad)};
  };
  s.vjp = [](Graph& g, const Node& n, const Grads& go) {
    return Grads{g.add("pick_backward", {go[0], n.input(1)},
                       {{"num_classes", n.input(0)->meta().shape[1]}, {"ignore_index", n.attr_int("ignore_index")}, {"offset", n.attr_int("offset")}}),
                 nullptr};
  };
  s.scratch = [](const Node& n, const ir::LayoutQuery&) { return rows_of(n.input(0)) * 40; };  // the targets' masks and column indices (bool and i64 a row)
  s.samples = {{"pick", {{{6, 6}}, {{6}, Fill::indices, 6}}, {{"ignore_index", std::int64_t{2}}}}};
  sharding::Rule rule = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t k) {
    Strategies st{sharding::rule::all(R(), 2, 1)};
    if (in[0][0] >= k) st.push_back({{S(0), S(0)}, {S(0)}});
    if (in[0][1] >= k) st.push_back({{S(1), R()}, {P()}});
    st.push_back({{P(), R()}, {P()}});
    return st;
  };
  // A rank's columns start at class offset + column_offset.
  sharding::LocalAttrsFn local = [](const Node& n, const std::vector<Shape>&, std::int64_t column_offset) {
    Attributes a = n.attrs();
    a["offset"] = n.attr_int("offset") + column_offset;
    return a;
  };
  return Op{std::move(s), std::move(rule), std::move(local)};
}())
SPMDX_KERNEL("pick", [](const Node& n, const Tensors& x) {
  const auto [valid, index] = picked(n, x[1], x[0].size(1));
  return one(at::where(valid, x[0].gather(1, index), at::zeros({}, x[0].options())));
})

// pick_backward: grad[n, 1], targets (i64)[n] -> [n, num_classes]: zero but grad[i] at the
// column pick read (torch.scatter).
SPMDX_OP([] {
  OpSchema s;
  s.name = "pick_backward";
  s.min_inputs = s.max_inputs = 2;
  s.attrs = {{"num_classes", ir::AttrType::integer, true, {}},
             {"ignore_index", ir::AttrType::integer, false, std::int64_t{-100}},
             {"offset", ir::AttrType::integer, false, std::int64_t{0}}};
  s.infer = [](const Metas& in, const Attributes& a) {
    if (in[0]->rank() != 2 || in[1]->rank() != 1 || in[0]->shape[0] != in[1]->shape[0]) fail("needs grad [n, 1] and targets [n]");
    return std::vector{like(*in[0], Shape{in[0]->shape[0], std::get<std::int64_t>(a.at("num_classes"))}, in[0]->requires_grad)};
  };
  s.scratch = [](const Node& n, const ir::LayoutQuery&) { return rows_of(n.input(0)) * 40; };  // the targets' masks and column indices (bool and i64 a row)
  s.samples = {{"pick_backward", {{{6, 1}}, {{6}, Fill::indices, 6}}, {{"num_classes", std::int64_t{6}}, {"ignore_index", std::int64_t{2}}}, false}};
  sharding::Rule rule = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>& out, std::int64_t k) {
    Strategies st{sharding::rule::all(R(), 2, 1)};
    if (out[0][1] >= k) st.push_back({{R(), R()}, {S(1)}});  // first: at equal cost, the columns the logits' gradient has
    if (in[0][0] >= k) st.push_back({{S(0), S(0)}, {S(0)}});
    st.push_back({{P(), R()}, {P()}});
    return st;
  };
  // A rank writes its num_classes columns, from class offset + column_offset.
  sharding::LocalAttrsFn local = [](const Node& n, const std::vector<Shape>& local_out, std::int64_t column_offset) {
    Attributes a = n.attrs();
    a["num_classes"] = local_out.at(0).at(1);
    a["offset"] = n.attr_int("offset") + column_offset;
    return a;
  };
  return Op{std::move(s), std::move(rule), std::move(local)};
}())
SPMDX_KERNEL("pick_backward", [](const Node& n, const Tensors& x) {
  const std::int64_t columns = n.attr_int("num_classes");
  const auto [valid, index] = picked(n, x[1], columns);
  at::Tensor out = at::zeros({x[0].size(0), columns}, x[0].options());
  return one(out.scatter_(1, index, at::where(valid, x[0], at::zeros({}, x[0].options()))));
})

// valid_rows: targets (i64)[n] -> [n, 1] of `dtype`: 1 where targets[i] != ignore_index, else 0
// ((targets != ignore_index).to(dtype).unsqueeze(1)).
SPMDX_OP([] {
  OpSchema s;
  s.name = "valid_rows";
  s.min_inputs = s.max_inputs = 1;
  s.attrs = {{"ignore_index", ir::AttrType::integer, false, std::int64_t{-100}}, {"dtype", ir::AttrType::string, false, std::string("f32")}};
  s.infer = [](const Metas& in, const Attributes& a) {
    const ir::DType dtype = floating_dtype(a);
    if (in[0]->dtype != ir::DType::i64 || in[0]->rank() != 1) fail("targets must be i64 [n]");
    return std::vector{ir::TensorMeta{{in[0]->shape[0], 1}, dtype, in[0]->device, false}};
  };
  s.samples = {{"valid_rows", {{{6}, Fill::indices, 6}}, {{"ignore_index", std::int64_t{2}}}, false}};
  sharding::Rule rule = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t k) {
    Strategies st{sharding::rule::all(R(), 1, 1)};
    if (in[0][0] >= k) st.push_back({{S(0)}, {S(0)}});
    return st;
  };
  return Op{std::move(s), std::move(rule), nullptr};
}())
SPMDX_KERNEL("valid_rows", [](const Node& n, const Tensors& x) {
  return one(x[0].ne(n.attr_int("ignore_index")).to(exec::to_aten(n.output()->meta().dtype)).unsqueeze(1));
})

// count_valid: targets (i64)[...] -> the number of entries != ignore_index, a scalar of `dtype`
// ((targets != ignore_index).sum(); the denominator of a mean loss, kept apart so that it can
// be summed across ranks: any dim split gives partial counts).
SPMDX_OP([] {
  OpSchema s;
  s.name = "count_valid";
  s.min_inputs = s.max_inputs = 1;
  s.attrs = {{"ignore_index", ir::AttrType::integer, false, std::int64_t{-100}}, {"dtype", ir::AttrType::string, false, std::string("f32")}};
  s.infer = [](const Metas& in, const Attributes& a) {
    const ir::DType dtype = floating_dtype(a);
    if (in[0]->dtype != ir::DType::i64) fail("targets must be i64");
    return std::vector{ir::TensorMeta{{}, dtype, in[0]->device, false}};
  };
  s.samples = {{"count_valid", {{{4, 6}, Fill::indices}}, {{"ignore_index", std::int64_t{2}}}, false}};
  sharding::Rule rule = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t k) {
    Strategies st{sharding::rule::all(R(), 1, 1)};
    for (std::size_t d = 0; d < in[0].size(); ++d) {
      if (in[0][d] >= k) st.push_back({{S(static_cast<std::int64_t>(d))}, {P()}});
    }
    return st;
  };
  return Op{std::move(s), std::move(rule), nullptr};
}())
SPMDX_KERNEL("count_valid", [](const Node& n, const Tensors& x) {
  return one(x[0].ne(n.attr_int("ignore_index")).sum().to(exec::to_aten(n.output()->meta().dtype)));
})

}  // namespace spmdx::ops
