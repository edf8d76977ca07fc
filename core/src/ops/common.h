// What the op records of core/src/ops/ share: the inference helpers (ir/infer.h), the VJP
// helpers, the sharding rule builders and notation, and, in the kernels' compile, ATen's.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "spmdx/ir/graph.h"
#include "spmdx/ir/infer.h"
#include "spmdx/ir/ops.h"
#include "spmdx/ir/strides.h"
#include "spmdx/ops/define.h"
#include "spmdx/sharding/rules.h"

namespace spmdx::ops {

using ir::Attributes;
using ir::Graph;
using ir::Node;
using ir::OpSchema;
using ir::Value;
using namespace ir::infer;
using Grads = std::vector<Value*>;
using Fill = ir::SampleInput::Fill;
using sharding::OpStrategy;
using Strategies = std::vector<OpStrategy>;

// VJP: g reduced to the shape of x when broadcasting made it larger.
inline Value* reduce_to(Graph& g, Value* grad, const Value* x) {
  if (grad->meta().shape == x->meta().shape) return grad;
  return g.add("sum_to", {grad}, {{"shape", x->meta().shape}});
}

inline Attributes float_attr(double v) { return {{"value", v}}; }

// Sharding notation: R = Replicate, P = Partial(sum), S(d) = Shard(d).
inline Placement R() { return Placement::replicate(); }
inline Placement P() { return Placement::partial(ReduceOp::sum); }
inline Placement S(std::int64_t d) { return Placement::shard(static_cast<int>(d)); }

// A unary floating op of any shape: the output is the input's meta.
inline ir::InferFn same_as_input() {
  return [](const Metas& in, const Attributes&) {
    floating(*in[0], "the input");
    return std::vector{like(*in[0], in[0]->shape, in[0]->requires_grad)};
  };
}

// gelu's and gelu_backward's `approximate`: "none" (x * Phi(x)) or "tanh", as
// torch.nn.functional.gelu.
inline ir::AttrSpec gelu_approximate() { return {"approximate", ir::AttrType::string, false, std::string("none")}; }
inline void check_gelu_approximate(const Attributes& a) {
  const auto& v = std::get<std::string>(a.at("approximate"));
  if (v != "none" && v != "tanh") fail("approximate must be \"none\" or \"tanh\", got \"" + v + "\"");
}

// A 1-output elementwise op's record with one sample of these inputs.
inline OpSchema elementwise(const std::string& name, int inputs, ir::InferFn infer, std::vector<ir::SampleInput> sample,
                            std::vector<ir::AttrSpec> attrs = {}) {
  OpSchema s;
  s.name = name;
  s.min_inputs = s.max_inputs = inputs;
  s.attrs = std::move(attrs);
  s.infer = std::move(infer);
  s.elementwise = true;
  s.samples.push_back({name, std::move(sample), {}});
  return s;
}

}  // namespace spmdx::ops

#if defined(SPMDX_OPS_KERNELS)
namespace spmdx::ops {
using Tensors = std::vector<at::Tensor>;
inline Tensors one(at::Tensor t) { return {std::move(t)}; }

// The in-place twin of a unary kernel: f writes the op's result into its input.
template <typename F>
exec::InPlaceKernel unary_in_place(F f) {
  return [f](const Node& n, const Tensors& x, const std::vector<int>&) {
    at::Tensor t = x[0];
    f(n, t);
    return Tensors{t};
  };
}
// The in-place twin of a binary kernel: f writes into the input the plan chose (into[0]).
template <typename F>
exec::InPlaceKernel binary_in_place(F f) {
  return [f](const Node& n, const Tensors& x, const std::vector<int>& into) {
    at::Tensor out = x[static_cast<std::size_t>(into.at(0))];
    f(n, out, x[0], x[1]);
    return Tensors{out};
  };
}
}  // namespace spmdx::ops
#endif
