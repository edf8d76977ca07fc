// The optimizer's update: adamw (torch.optim.AdamW, one parameter a node). Its kernel is ATen's
// fused AdamW; its in-place twin updates the parameter and its state where they are when the
// caller donates them (plan/memory_plan.h's donate_state).
#include "common.h"

namespace spmdx::ops {

// adamw: one AdamW update of one parameter (Loshchilov & Hutter 2019, as torch.optim.AdamW's
// single-tensor path): (param, grad, exp_avg, exp_avg_sq, lr [], step [] [, found_inf []]) ->
// (param', exp_avg', exp_avg_sq'). step is the 1-based count after this update. With
// found_inf (float16 loss scaling) the update is skipped, state unchanged, when it is nonzero
// (the fused kernels' found_inf, as GradScaler.step skips optimizer.step). No VJP.
SPMDX_OP([] {
  Op op;
  OpSchema& s = op.schema;
  s.name = "adamw";
  s.min_inputs = 6;
  s.max_inputs = 7;
  s.attrs = {{"beta1", ir::AttrType::floating, false, 0.9},
             {"beta2", ir::AttrType::floating, false, 0.999},
             {"eps", ir::AttrType::floating, false, 1e-8},
             {"weight_decay", ir::AttrType::floating, false, 0.01}};
  s.infer = [](const Metas& in, const Attributes&) {
    same_dtype({in[0], in[1], in[2], in[3]});
    for (int i = 1; i < 4; ++i) {
      if (in[static_cast<std::size_t>(i)]->shape != in[0]->shape) fail("grad and state must have the parameter's shape");
    }
    if (!in[4]->shape.empty() || !in[5]->shape.empty()) fail("lr and step must be scalars");
    if (in.size() > 6 && (!in[6]->shape.empty() || in[6]->dtype != ir::DType::f32)) fail("found_inf must be a float32 scalar");
    return std::vector{like(*in[0], in[0]->shape, false), like(*in[2], in[2]->shape, false), like(*in[3], in[3]->shape, false)};
  };
  s.in_place = {0, 2, 3};  // param, exp_avg, exp_avg_sq: one per output
  // exp_avg_sq >= 0; lr 1e-2 at step 3; found_inf 1 (the step skipped) or 0.
  const std::vector<ir::SampleInput> state{{{4, 6}}, {{4, 6}}, {{4, 6}}, {{4, 6}, Fill::positive},
                                           {.shape = {}, .fill = Fill::value, .value = 1e-2}, {.shape = {}, .fill = Fill::value, .value = 3.0}};
  auto with_found_inf = [&](double v) {
    auto in = state;
    in.push_back({.shape = {}, .fill = Fill::value, .value = v, .dtype = ir::DType::f32});
    return in;
  };
  const Attributes decay{{"weight_decay", 0.1}};
  // float16's loss scaling: adamw told of an inf (skips) or not.
  s.samples = {{"adamw", state, decay, false}, {"adamw_found_inf", with_found_inf(1.0), decay, false}, {"adamw_no_inf", with_found_inf(0.0), decay, false}};
  // Elementwise over the parameter: every dim split alike on param, grad and state; lr, step
  // and found_inf replicated scalars.
  op.rules = [](const Node&, const std::vector<Shape>& in, const std::vector<Shape>&, std::int64_t k) {
    Strategies st{{std::vector<Placement>(in.size(), R()), std::vector<Placement>(3, R())}};
    for (std::size_t d = 0; d < in[0].size(); ++d) {
      if (in[0][d] < k) continue;
      const Placement sd = S(static_cast<std::int64_t>(d));
      std::vector<Placement> inputs{sd, sd, sd, sd};
      inputs.resize(in.size(), R());  // lr, step, found_inf: replicated scalars
      st.push_back({inputs, {sd, sd, sd}});
    }
    return st;
  };
  return op;
}())

#if defined(SPMDX_OPS_KERNELS)
namespace {

using exec::AdamW;

// ATen's fused AdamW (torch.optim.AdamW's fused=True: aten/src/ATen/native/cpu/FusedAdamKernel.cpp
// on the CPU, native/cuda/FusedAdamWKernel.cu on CUDA) on one parameter, in place; step is the
// 1-based step as a float tensor, as torch.optim keeps state["step"]. On CUDA the tensor-lr form
// (torch.optim.AdamW(fused=True, capturable=True) with a tensor lr): lr and step are read on the
// device, so the host never waits and a CUDA graph replays each step's values; one kernel in
// place of adamw_on_device()'s twenty.
// found_inf (defined for float16 loss scaling): the kernel leaves everything as it is when it
// is nonzero.
void fused_adamw(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg, at::Tensor& exp_avg_sq, const at::Tensor& lr,
                 const at::Tensor& step, const AdamW& h, const at::Tensor& found_inf) {
  std::optional<at::Tensor> inf;
  if (found_inf.defined()) inf = found_inf;
  // The fused kernel walks each tensor's memory in order: every one must be contiguous.
  std::vector<at::Tensor> t{param, grad.contiguous(), exp_avg, exp_avg_sq};
  for (std::size_t i : {0, 2, 3}) {
    if (!t[i].is_contiguous()) t[i] = t[i].contiguous();
  }
  if (t[0].is_cuda()) {
    at::_fused_adamw_({t[0]}, {t[1]}, {t[2]}, {t[3]}, {}, {step}, lr, h.beta1, h.beta2, h.weight_decay, h.eps,
                      /*amsgrad=*/false, /*maximize=*/false, /*grad_scale=*/std::nullopt, inf);
  } else {
    at::_fused_adamw_({t[0]}, {t[1]}, {t[2]}, {t[3]}, {}, {step}, lr.item<double>(), h.beta1, h.beta2, h.weight_decay, h.eps,
                      /*amsgrad=*/false, /*maximize=*/false, /*grad_scale=*/std::nullopt, inf);
  }
  for (auto [i, dst] : {std::pair<std::size_t, at::Tensor*>{0, &param}, {2, &exp_avg}, {3, &exp_avg_sq}}) {
    if (!t[i].is_same(*dst)) dst->copy_(t[i]);
  }
}

at::Tensor found_inf_of(const Tensors& x) { return x.size() > 6 ? x[6] : at::Tensor(); }

AdamW hyper(const Node& n) { return {n.attr_float("beta1"), n.attr_float("beta2"), n.attr_float("eps"), n.attr_float("weight_decay")}; }

}  // namespace
#endif

// As torch.optim.AdamW(fused=True) on the CPU: ATen's fused kernel, one pass over each element
// (decoupled decay, bias corrections in double), on copies of the state. In place: the
// parameter and its AdamW state updated where they are (donated by the caller).
SPMDX_KERNEL(
    "adamw",
    [](const Node& n, const Tensors& x) {
      const AdamW h = hyper(n);
      if (!x[4].is_cpu() && !x[4].is_cuda()) return exec::adamw_on_device(x[0], x[1], x[2], x[3], x[4], x[5], h, found_inf_of(x));
      Tensors state{x[0].clone(at::MemoryFormat::Contiguous), x[2].clone(at::MemoryFormat::Contiguous), x[3].clone(at::MemoryFormat::Contiguous)};
      fused_adamw(state[0], x[1], state[1], state[2], x[4], x[5], h, found_inf_of(x));
      return state;
    },
    [](const Node& n, const Tensors& x, const std::vector<int>&) {
      Tensors state{x[0], x[2], x[3]};
      if (!x[4].is_cpu() && !x[4].is_cuda()) {  // neither fused kernel: the tensor-hyperparameter form, copied back
        const Tensors next = exec::adamw_on_device(x[0], x[1], x[2], x[3], x[4], x[5], hyper(n), found_inf_of(x));
        for (std::size_t i = 0; i < 3; ++i) state[i].copy_(next[i]);
        return state;
      }
      fused_adamw(state[0], x[1], state[1], state[2], x[4], x[5], hyper(n), found_inf_of(x));
      return state;
    })

}  // namespace spmdx::ops
