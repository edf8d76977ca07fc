// Every op's VJP rule against LibTorch autograd: the gradient graph the IR builds, run by the
// executor, equals autograd's gradients of the same forward kernel, on fresh random inputs.
// float64: relative error <= 1e-7; float32: <= 1e-5.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <limits>
#include <set>

#include "spmdx/exec/executor.h"
#include "spmdx/ir/autodiff.h"
#include "spmdx/ir/ops.h"

namespace spmdx {
namespace {

using ir::Attributes;
using Shape = std::vector<std::int64_t>;

// An input: its shape and fill (indices: i64 in [0, bound); constant: no gradient taken).
using InputSpec = ir::SampleInput;
using Fill = ir::SampleInput::Fill;

struct OpCase {
  std::string name;  // test label
  std::string op;
  std::vector<InputSpec> inputs;
  Attributes attrs;
};

std::vector<OpCase> cases() {
  return {
      // cast's record samples f64 only: a cast to f32 (f64 -> f32 in the float64 run) would put
      // its Partial strategy under sharding_rules_test's 1e-8, which rounding cannot meet.
      {"cast_f32", "cast", {{{2, 3}}}, {{"dtype", std::string("f32")}}},
      // sdpa with context parallelism's chunks and q_offset: context_parallel_test.cpp (its
      // kernel merges two flash calls by their logsumexp, which autograd does not differentiate).
  };
}

// The samples of every op's record (core/src/ops/) that has a VJP, with the cases above.
std::vector<OpCase> all_cases() {
  std::vector<OpCase> out = cases();
  for (const auto& op : ir::OpRegistry::global().names()) {
    const ir::OpSchema& s = *ir::OpRegistry::global().find(op);
    if (!s.defined_by_record || !s.vjp) continue;
    for (const auto& sample : s.samples) {
      if (sample.gradient) out.push_back({sample.label, op, sample.inputs, sample.attrs});
    }
  }
  return out;
}

at::Tensor make(const InputSpec& spec, at::ScalarType dtype, at::Generator& gen) {
  switch (spec.fill) {
    case Fill::indices: {
      at::Tensor t = at::randint(0, spec.bound, spec.shape, gen, at::TensorOptions().dtype(at::kLong));
      return t;
    }
    case Fill::offsets: {  // nondecreasing, the last = bound
      at::Tensor t = std::get<0>(at::randint(0, spec.bound + 1, spec.shape, gen, at::TensorOptions().dtype(at::kLong)).sort());
      if (t.numel() > 0) t.view({-1})[-1] = spec.bound;
      return t.to(spec.dtype ? exec::to_aten(*spec.dtype) : at::kLong);
    }
    case Fill::positive: return at::rand(spec.shape, gen, at::TensorOptions().dtype(dtype)) + 0.5;
    case Fill::value: return at::full(spec.shape, spec.value, at::TensorOptions().dtype(spec.dtype ? exec::to_aten(*spec.dtype) : dtype));
    case Fill::nonnegative: return at::relu(at::randn(spec.shape, gen, at::TensorOptions().dtype(dtype)));
    case Fill::normal:
    case Fill::constant: return at::randn(spec.shape, gen, at::TensorOptions().dtype(dtype));
    case Fill::nonfinite: {
      at::Tensor t = at::randn(spec.shape, gen, at::TensorOptions().dtype(dtype));
      t.view({-1})[t.numel() / 2] = std::numeric_limits<double>::infinity();
      return t;
    }
  }
  return {};
}

double rel_error(const at::Tensor& got, const at::Tensor& want) {
  const double scale = std::max(want.abs().max().item<double>(), 1e-12);
  return (got - want).abs().max().item<double>() / scale;
}

void check_case(const OpCase& c, at::ScalarType dtype, double tolerance) {
  SCOPED_TRACE(c.name + " " + c10::toString(dtype));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1234);
  ir::Graph g;
  std::vector<at::Tensor> values;
  std::vector<ir::Value*> args;
  std::vector<ir::Value*> wrt;
  std::vector<std::size_t> wrt_index;
  exec::TensorMap feed;
  for (std::size_t i = 0; i < c.inputs.size(); ++i) {
    at::Tensor t = make(c.inputs[i], dtype, gen);
    const std::string name = "in" + std::to_string(i);
    const bool differentiable = c.inputs[i].fill == Fill::normal || c.inputs[i].fill == Fill::positive || c.inputs[i].fill == Fill::nonnegative;
    ir::Value* v = g.add_input(name, {t.sizes().vec(), exec::from_aten(t.scalar_type()), "cpu", differentiable});
    args.push_back(v);
    values.push_back(t);
    feed[name] = t;
    if (differentiable) {
      wrt.push_back(v);
      wrt_index.push_back(i);
    }
  }
  ir::Node* node = g.add_node(c.op, args, c.attrs);
  // loss = sum(out * r), r random: every output element gets its own upstream gradient.
  // (in the output's dtype, which a cast changes)
  at::Tensor r = at::randn(node->output()->meta().shape, gen, at::TensorOptions().dtype(exec::to_aten(node->output()->meta().dtype)));
  ir::Value* rv = g.add_input("r", {r.sizes().vec(), node->output()->meta().dtype, "cpu", false});
  feed["r"] = r;
  g.add_output("loss", g.add("sum", {g.add("mul", {node->output(), rv})}));
  auto grads = ir::gradients(g, g.find_output("loss"), wrt);
  for (std::size_t i = 0; i < grads.size(); ++i) g.add_output("grad" + std::to_string(i), grads[i]);
  g.verify();
  exec::TensorMap out = exec::Executor(g).run(feed);

  // Autograd through the same forward kernel.
  std::vector<at::Tensor> leaves;
  for (auto& t : values) leaves.push_back(t.detach().clone());
  for (std::size_t i : wrt_index) leaves[i].set_requires_grad(true);
  const exec::Kernel* forward = exec::find_kernel(c.op);
  at::Tensor loss = ((*forward)(*node, leaves)[0] * r).sum();
  loss.backward();
  EXPECT_LE(rel_error(out.at("loss"), loss.detach()), tolerance);
  for (std::size_t j = 0; j < wrt_index.size(); ++j) {
    const at::Tensor& want = leaves[wrt_index[j]].grad();
    const at::Tensor& got = out.at("grad" + std::to_string(j));
    ASSERT_EQ(got.sizes(), want.sizes()) << "input " << wrt_index[j];
    EXPECT_LE(rel_error(got, want), tolerance) << "input " << wrt_index[j];
  }
}

TEST(Vjp, EveryForwardOpMatchesAutogradInFloat64) {
  std::set<std::string> covered;
  for (const auto& c : all_cases()) {
    check_case(c, at::kDouble, 1e-7);
    covered.insert(c.op);
  }
  // Every op with a VJP rule is covered here; zeros_like's and ones_like's give no gradient (their
  // value does not read x's), which autograd, whose results of them need none, cannot compare.
  for (const auto& op : ir::OpRegistry::global().names()) {
    if (ir::has_vjp(op)) {
      EXPECT_TRUE(covered.count(op) || op == "amax_rows" || op == "zeros_like" || op == "ones_like") << "no gradient test for op " << op;
    }
  }
  for (const char* op : {"zeros_like", "ones_like"}) {
    ir::Graph g;
    ir::Value* x = g.add_input("x", {{4, 5}, ir::DType::f64, "cpu", true});
    ir::Value* y = g.add(op, {x});
    const std::vector<ir::Value*> back = ir::OpRegistry::global().find(op)->vjp(g, *y->producer(), {g.add("ones_like", {y})});
    ASSERT_EQ(back.size(), 1U);
    EXPECT_EQ(back[0], nullptr) << op << "'s VJP gives x a gradient";
  }
  std::printf("checked %zu op cases (%zu ops) against autograd\n", all_cases().size(), covered.size());
}

TEST(Vjp, EveryForwardOpMatchesAutogradInFloat32) {
  for (const auto& c : all_cases()) check_case(c, at::kFloat, 1e-5);
}

// amax_rows passes no gradient, which is exact where it only steadies a logsumexp, as
// vocab_parallel_cross_entropy uses it: log(sum_exp_rows(x, m)) + m with m = amax_rows(x) has
// autograd's gradient of torch.logsumexp, softmax(x) (the paths through m cancel: -1 + 1).
TEST(Vjp, LogsumexpThroughAmaxRowsHasSoftmaxAsItsGradient) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const at::Tensor x = at::randn({6, 5}, gen, at::TensorOptions().dtype(at::kDouble)) * 4;
  const at::Tensor r = at::randn({6, 1}, gen, at::TensorOptions().dtype(at::kDouble));
  ir::Graph g;
  ir::Value* xv = g.add_input("x", {{6, 5}, ir::DType::f64, "cpu", true});
  ir::Value* rv = g.add_input("r", {{6, 1}, ir::DType::f64, "cpu", false});
  ir::Value* m = g.add("amax_rows", {xv});
  ir::Value* lse = g.add("add", {g.add("log", {g.add("sum_exp_rows", {xv, m})}), m});
  g.add_output("loss", g.add("sum", {g.add("mul", {lse, rv})}));
  g.add_output("grad", ir::gradients(g, g.find_output("loss"), {xv})[0]);
  const exec::TensorMap out = exec::Executor(g).run({{"x", x}, {"r", r}});
  at::Tensor leaf = x.clone().requires_grad_(true);
  const at::Tensor want_loss = (at::logsumexp(leaf, {1}, true) * r).sum();
  want_loss.backward();
  EXPECT_LE(rel_error(out.at("loss"), want_loss.detach()), 1e-12);
  EXPECT_LE(rel_error(out.at("grad"), leaf.grad()), 1e-12);
  EXPECT_LE(rel_error(out.at("grad"), at::softmax(x, 1) * r), 1e-12);
}

TEST(Vjp, OpWithoutRuleOnThePathIsNamed) {
  ir::Graph g;
  ir::Value* x = g.add_input("x", {{3}, ir::DType::f32, "cpu", true});
  ir::Value* y = g.add("clamp_max_scalar", {x}, {{"value", 1.0}});
  try {
    ir::gradients(g, g.add("sum", {y}), {x});
    FAIL();
  } catch (const ir::IrError& e) {
    EXPECT_NE(std::string(e.what()).find("(clamp_max_scalar) lies between the parameters and the loss but the op has no VJP rule"),
              std::string::npos)
        << e.what();
  }
}

TEST(Vjp, UnreachedParameterGetsZeros) {
  ir::Graph g;
  ir::Value* x = g.add_input("x", {{3}, ir::DType::f64, "cpu", true});
  ir::Value* unused = g.add_input("unused", {{2}, ir::DType::f64, "cpu", true});
  ir::Value* loss = g.add("sum", {g.add("mul", {x, x})});
  auto grads = ir::gradients(g, loss, {x, unused});
  g.add_output("gx", grads[0]);
  g.add_output("gu", grads[1]);
  at::Tensor xv = at::arange(3, at::kDouble);
  auto out = exec::Executor(g).run({{"x", xv}, {"unused", at::ones({2}, at::kDouble)}});
  EXPECT_TRUE(at::equal(out.at("gx"), xv * 2));
  EXPECT_TRUE(at::equal(out.at("gu"), at::zeros({2}, at::kDouble)));
}

}  // namespace
}  // namespace spmdx
