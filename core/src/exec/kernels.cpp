#include "spmdx/exec/kernels.h"
#include "spmdx/ir/ops.h"
#include "spmdx/core/log.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <tuple>
#include <stdexcept>

namespace spmdx::exec {
namespace {

using Tensors = std::vector<at::Tensor>;
using ir::Node;

Tensors one(at::Tensor t) { return {std::move(t)}; }

// rms_norm(x) = x * rsqrt(mean(x^2, -1) + eps) * w  (Zhang & Sennrich 2019).
at::Tensor rms_inv(const at::Tensor& x, double eps) { return at::rsqrt(x.pow(2).mean(-1, true) + eps); }

// The causal mask of scores [.., s, t]: true above the diagonal (key after query), as
// PyTorch's is_causal (top-left aligned).
at::Tensor future(const at::Tensor& scores) {
  return at::ones({scores.size(-2), scores.size(-1)}, scores.options().dtype(at::kBool)).triu(1);
}

// Scaled scores q k^T / sqrt(d), masked: [b, h, s, t].
at::Tensor scores(const at::Tensor& q, const at::Tensor& k, bool causal) {
  at::Tensor s = at::matmul(q, k.transpose(-2, -1)).mul_(1.0 / std::sqrt(static_cast<double>(q.size(-1))));
  if (causal) s.masked_fill_(future(s), -std::numeric_limits<double>::infinity());
  return s;
}


// One attention call: ATen's fused kernel of the device (sdpa(), kernels.h).
Tensors attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal) { return sdpa(q, k, v, causal); }
Tensors attend_backward(const at::Tensor& g, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                        const at::Tensor& lse, bool causal) {
  return sdpa_backward(g, q, k, v, out, lse, causal);
}

bool half(const at::Tensor& x) { return x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf; }

// A fused CUDA kernel that refused its inputs (for attention: head_dim, alignment, an older
// GPU): said once per kernel, and the plain ATen ops run instead.
void fused_refused(const char* kernel, const c10::Error& e) {
  static std::mutex m;
  static std::set<std::string> said;
  const std::lock_guard<std::mutex> lock(m);
  if (!said.insert(kernel).second) return;
  SPMDX_WARN("ATen's " << kernel << " refused its inputs (" << e.what_without_backtrace() << "); plain ATen ops run instead");
}

// rms_norm with ATen's fused CUDA kernel (at::_fused_rms_norm, torch.nn.functional.rms_norm's
// on CUDA since PyTorch 2.8): {y, rstd [..., 1]}; nullopt where it refuses the inputs.
std::optional<std::tuple<at::Tensor, at::Tensor>> fused_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  try {
    return at::_fused_rms_norm(x, {x.size(-1)}, w, eps);
  } catch (const c10::Error& e) {
    fused_refused("fused RMSNorm", e);
    return std::nullopt;
  }
}

// The memory-efficient kernel pads its log-sum-exp's rows to a multiple of 32 (kAlignLSE, the
// backward's block of queries; PyTorch's mem_eff_attention kernel_forward.h); the sdpa op's
// is [b, h, s]. The backward reads rows < s only, at the strides it is given.
constexpr std::int64_t kEfficientLseAlign = 32;


// Causal attention of a block of query rows at known positions (context parallelism, the sdpa
// op's chunks and q_offset): the keys before the block's first position are all seen, the
// block's own positions causally. `rows` are the block's rows of the local q, `prefix` the key
// rows wholly seen (may be empty), `own` the first key row of the block's positions.
struct AttentionBlock {
  std::int64_t row0, rows;
  at::Tensor prefix;  // i64 key rows, or undefined when none
  std::int64_t own;
};

// The blocks of an sdpa node's local q: one block at q_offset in natural order (chunks = 1),
// else one a piece of the load-balanced order (ir::balanced_piece), with the pieces before it
// in natural order.
std::vector<AttentionBlock> attention_blocks(const Node& n, std::int64_t q_rows, std::int64_t kv_rows, const at::Device& device) {
  const std::int64_t chunks = n.attr_int("chunks"), offset = n.attr_int("q_offset");
  auto rows_of = [&](std::vector<std::int64_t> r) { return at::tensor(r, at::TensorOptions().dtype(at::kLong)).to(device); };
  std::vector<AttentionBlock> blocks;
  if (chunks == 1) {
    std::vector<std::int64_t> prefix(static_cast<std::size_t>(offset));
    for (std::int64_t i = 0; i < offset; ++i) prefix[static_cast<std::size_t>(i)] = i;
    blocks.push_back({0, q_rows, offset > 0 ? rows_of(prefix) : at::Tensor(), offset});
    return blocks;
  }
  const std::int64_t piece = kv_rows / chunks;
  if (offset % piece != 0 || q_rows % piece != 0) {
    throw std::invalid_argument("sdpa: q's rows from " + std::to_string(offset) + " (" + std::to_string(q_rows) + " of them) are not whole pieces of " +
                                std::to_string(piece) + " positions of the load-balanced sequence");
  }
  for (std::int64_t b = 0; b < q_rows / piece; ++b) {
    const std::int64_t slot = offset / piece + b, position = ir::balanced_piece(slot, chunks);
    std::vector<std::int64_t> prefix;
    for (std::int64_t j = 0; j < chunks; ++j) {
      if (ir::balanced_piece(j, chunks) >= position) continue;
      for (std::int64_t i = 0; i < piece; ++i) prefix.push_back(j * piece + i);
    }
    blocks.push_back({b * piece, piece, prefix.empty() ? at::Tensor() : rows_of(prefix), slot * piece});
  }
  return blocks;
}

// sdpa with context parallelism's positions: each block's two parts merged by their
// log-sum-exp, as ring attention and FlashAttention's split-KV do (out = sum of each part's
// out x exp(lse_part - lse), lse = logaddexp of the parts').
// The outputs are laid out as the fused kernel's: out as q, the log-sum-exp [b, s, h] in memory
// (the memory plan's layouts; a contiguous out would make the reshape after it copy).
Tensors blocked_attention(const Node& n, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const auto lse_type = to_aten(n.output(1)->meta().dtype);
  at::Tensor out = at::empty_like(q), lse = at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(lse_type)).transpose(1, 2);
  for (const auto& b : attention_blocks(n, q.size(2), k.size(2), q.device())) {
    const at::Tensor qb = q.narrow(2, b.row0, b.rows).contiguous();
    Tensors own = attend(qb, k.narrow(2, b.own, b.rows).contiguous(), v.narrow(2, b.own, b.rows).contiguous(), true);
    if (!b.prefix.defined()) {
      out.narrow(2, b.row0, b.rows).copy_(own[0]);
      lse.narrow(2, b.row0, b.rows).copy_(own[1]);
      continue;
    }
    Tensors seen = attend(qb, k.index_select(2, b.prefix), v.index_select(2, b.prefix), false);
    const at::Tensor merged = at::logaddexp(seen[1], own[1]);
    out.narrow(2, b.row0, b.rows)
        .copy_(seen[0].to(merged.scalar_type()) * at::exp(seen[1] - merged).unsqueeze(-1) + own[0].to(merged.scalar_type()) * at::exp(own[1] - merged).unsqueeze(-1));
    lse.narrow(2, b.row0, b.rows).copy_(merged);
  }
  return Tensors{out, lse};
}

// Its gradients: each part's backward from the merged out and lse (the probabilities it
// recomputes are then the merged softmax's), dq summed, dk and dv added at the key rows.
Tensors blocked_attention_backward(const Node& n, const at::Tensor& g, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   const at::Tensor& out, const at::Tensor& lse) {
  // [b, s, h, d] in memory, as the fused kernel's gradients (the memory plan's layout).
  auto bshd = [](const at::Tensor& like) { return at::zeros({like.size(0), like.size(2), like.size(1), like.size(3)}, like.options()).transpose(1, 2); };
  at::Tensor gq = bshd(q), gk = bshd(k), gv = bshd(v);
  for (const auto& b : attention_blocks(n, q.size(2), k.size(2), q.device())) {
    const at::Tensor gb = g.narrow(2, b.row0, b.rows).contiguous(), qb = q.narrow(2, b.row0, b.rows).contiguous();
    const at::Tensor ob = out.narrow(2, b.row0, b.rows).contiguous(), lb = lse.narrow(2, b.row0, b.rows).contiguous();
    Tensors own = attend_backward(gb, qb, k.narrow(2, b.own, b.rows).contiguous(), v.narrow(2, b.own, b.rows).contiguous(), ob, lb, true);
    at::Tensor dq = own[0];
    gk.narrow(2, b.own, b.rows).add_(own[1]);
    gv.narrow(2, b.own, b.rows).add_(own[2]);
    if (b.prefix.defined()) {
      Tensors seen = attend_backward(gb, qb, k.index_select(2, b.prefix), v.index_select(2, b.prefix), ob, lb, false);
      dq = dq + seen[0];
      gk.index_add_(2, b.prefix, seen[1]);
      gv.index_add_(2, b.prefix, seen[2]);
    }
    gq.narrow(2, b.row0, b.rows).copy_(dq);
  }
  return Tensors{gq, gk, gv};
}

}  // namespace

std::vector<at::Tensor> sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal) {
  if (q.is_cpu()) {
    auto [out, lse] = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal);
    return {out, lse};
  }
  if (q.is_cuda()) {
    try {
      if (half(q)) {
        auto r = at::_scaled_dot_product_flash_attention(q, k, v, 0.0, causal, /*return_debug_mask=*/false);
        return {std::get<0>(r), std::get<1>(r)};
      }
      auto [out, lse, seed, offset] = at::_scaled_dot_product_efficient_attention(q, k, v, std::nullopt, /*compute_log_sumexp=*/true, 0.0, causal);
      return {out, lse.narrow(2, 0, q.size(2))};
    } catch (const c10::Error& e) {
      fused_refused(half(q) ? "FlashAttention-2 kernel" : "memory-efficient attention kernel", e);
    }
  }
  return attention(q, k, v, causal);
}

std::vector<at::Tensor> sdpa_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                                      const at::Tensor& lse, bool causal) {
  if (q.is_cpu()) {
    auto [gq, gk, gv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(grad_out, q, k, v, out, lse, 0.0, causal);
    return {gq, gk, gv};
  }
  if (q.is_cuda()) {
    // Dropout 0: the kernels read no philox seed or offset (undefined tensors here).
    try {
      if (half(q)) {
        auto [gq, gk, gv] = at::_scaled_dot_product_flash_attention_backward(grad_out, q, k, v, out, lse.contiguous(), at::Tensor(), at::Tensor(), q.size(2),
                                                                             k.size(2), 0.0, causal, at::Tensor(), at::Tensor());
        return {gq, gk, gv};
      }
      const std::int64_t rows = (q.size(2) + kEfficientLseAlign - 1) / kEfficientLseAlign * kEfficientLseAlign;
      at::Tensor padded = at::empty({lse.size(0), lse.size(1), rows}, lse.options().dtype(at::kFloat));
      padded.narrow(2, 0, q.size(2)).copy_(lse);
      auto [gq, gk, gv, gb] = at::_scaled_dot_product_efficient_attention_backward(grad_out, q, k, v, at::Tensor(), out, padded, at::Tensor(), at::Tensor(), 0.0,
                                                                                  {true, true, true, false}, causal);
      return {gq, gk, gv};
    } catch (const c10::Error& e) {
      fused_refused(half(q) ? "FlashAttention-2 backward" : "memory-efficient attention backward", e);
    }
  }
  return attention_backward(grad_out, q, k, v, out, lse, causal);
}

std::vector<at::Tensor> attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal) {
  const at::Tensor s = scores(q, k, causal);
  at::Tensor lse = at::logsumexp(s, -1);
  at::Tensor out = at::matmul(at::exp(s - lse.unsqueeze(-1)), v);
  return {out, lse};
}

std::vector<at::Tensor> attention_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const at::Tensor& out, const at::Tensor& lse, bool causal) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  const at::Tensor p = at::exp(scores(q, k, causal) - lse.unsqueeze(-1));  // the forward's probabilities, recomputed
  at::Tensor grad_v = at::matmul(p.transpose(-2, -1), grad_out);
  const at::Tensor dp = at::matmul(grad_out, v.transpose(-2, -1));
  const at::Tensor ds = p * (dp - (grad_out * out).sum(-1, true));  // softmax's backward: rowsum(dO * O) = rowsum(P * dP)
  at::Tensor grad_q = at::matmul(ds, k).mul_(scale);
  at::Tensor grad_k = at::matmul(ds.transpose(-2, -1), q).mul_(scale);
  return {grad_q, grad_k, grad_v};
}

std::vector<at::Tensor> adamw_on_device(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                                        const at::Tensor& lr, const at::Tensor& step, const AdamW& h, const at::Tensor& found_inf) {
  const at::Tensor lr64 = lr.to(at::kDouble), step64 = step.to(at::kDouble);
  const at::Tensor bc1 = 1.0 - at::pow(h.beta1, step64), bc2 = 1.0 - at::pow(h.beta2, step64);
  at::Tensor next_param = param * (1.0 - lr64 * h.weight_decay).to(param.scalar_type());
  at::Tensor next_avg = exp_avg * h.beta1;
  next_avg.add_(grad, 1.0 - h.beta1);
  at::Tensor next_avg_sq = exp_avg_sq * h.beta2;
  next_avg_sq.addcmul_(grad, grad, 1.0 - h.beta2);
  at::Tensor denom = (next_avg_sq.sqrt() / at::sqrt(bc2).to(param.scalar_type())).add_(h.eps);
  next_param.sub_((next_avg / denom) * (lr64 / bc1).to(param.scalar_type()));
  if (found_inf.defined()) {  // skipped on the device, without the host reading found_inf
    const at::Tensor skip = found_inf.ne(0);
    return {at::where(skip, param, next_param), at::where(skip, exp_avg, next_avg), at::where(skip, exp_avg_sq, next_avg_sq)};
  }
  return {next_param, next_avg, next_avg_sq};
}

namespace {

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

// oneDNN's linear, looked up in the dispatcher once (nullopt: this LibTorch lacks it).
using OneDnnLinear = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, c10::string_view,
                                c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>);
const std::optional<c10::TypedOperatorHandle<OneDnnLinear>>& onednn_linear_op() {
  static const std::optional<c10::TypedOperatorHandle<OneDnnLinear>> op = []() -> std::optional<c10::TypedOperatorHandle<OneDnnLinear>> {
    if (!at::hasMKLDNN()) return std::nullopt;
    const auto handle = c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
    if (!handle || !handle->hasKernelForDispatchKey(c10::DispatchKey::CPU)) return std::nullopt;
    return handle->typed<OneDnnLinear>();
  }();
  return op;
}

std::atomic<CpuMatmul>& cpu_matmul_setting() {
  static std::atomic<CpuMatmul> library{onednn_linear_op() ? CpuMatmul::onednn : CpuMatmul::aten};
  return library;
}

// A bfloat16 or float16 matmul on a CPU: ATen's kernel for them runs up to 50 times slower than
// its float32 GEMM where the CPU lacks bf16/fp16 instructions (AVX2), worst with a transposed
// operand, as the backward's are (1.2 of 1.4 s of a debugmodel bf16 step here). It accumulates
// in float32 and rounds once; so does a float32 GEMM of the upcast inputs rounded back, which
// the matmul kernel runs instead (the same bits but for the order of the sums). linear (the
// forward's) keeps ATen's kernel, so the forward is PyTorch's bit for bit.
bool half_on_cpu(const at::Tensor& x) { return x.is_cpu() && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf); }

AdamW hyper(const Node& n) { return {n.attr_float("beta1"), n.attr_float("beta2"), n.attr_float("eps"), n.attr_float("weight_decay")}; }

const std::map<std::string, Kernel>& kernels() {
  static const std::map<std::string, Kernel> table = [] {
    std::map<std::string, Kernel> k;
    k["add"] = [](const Node&, const Tensors& x) { return one(at::add(x[0], x[1])); };
    k["sub"] = [](const Node&, const Tensors& x) { return one(at::sub(x[0], x[1])); };
    k["mul"] = [](const Node&, const Tensors& x) { return one(at::mul(x[0], x[1])); };
    k["div"] = [](const Node&, const Tensors& x) { return one(at::div(x[0], x[1])); };
    k["cast"] = [](const Node& n, const Tensors& x) { return one(x[0].to(to_aten(n.output()->meta().dtype))); };
    k["add_scalar"] = [](const Node& n, const Tensors& x) { return one(at::add(x[0], n.attr_float("value"))); };
    k["mul_scalar"] = [](const Node& n, const Tensors& x) { return one(at::mul(x[0], n.attr_float("value"))); };
    k["pow_scalar"] = [](const Node& n, const Tensors& x) { return one(at::pow(x[0], n.attr_float("value"))); };
    k["rdiv_scalar"] = [](const Node& n, const Tensors& x) { return one(at::reciprocal(x[0]) * n.attr_float("value")); };
    k["rpow_scalar"] = [](const Node& n, const Tensors& x) { return one(at::pow(n.attr_float("value"), x[0])); };
    k["clamp_max_scalar"] = [](const Node& n, const Tensors& x) { return one(at::clamp_max(x[0], n.attr_float("value"))); };
    k["zeros_like"] = [](const Node&, const Tensors& x) { return one(at::zeros_like(x[0])); };
    k["ones_like"] = [](const Node&, const Tensors& x) { return one(at::ones_like(x[0])); };
    k["sum"] = [](const Node& n, const Tensors& x) {
      const auto& dims = n.attr_ints("dims");
      return one(dims.empty() && !n.attr_bool("keepdim") ? at::sum(x[0]) : at::sum(x[0], dims, n.attr_bool("keepdim")));
    };
    k["mean"] = [](const Node& n, const Tensors& x) {
      const auto& dims = n.attr_ints("dims");
      return one(dims.empty() && !n.attr_bool("keepdim") ? at::mean(x[0]) : at::mean(x[0], dims, n.attr_bool("keepdim")));
    };
    k["softmax"] = [](const Node& n, const Tensors& x) { return one(at::softmax(x[0], n.attr_int("dim"))); };
    k["log_softmax"] = [](const Node& n, const Tensors& x) { return one(at::log_softmax(x[0], n.attr_int("dim"))); };
    k["matmul"] = [](const Node&, const Tensors& x) {
      if (half_on_cpu(x[0])) return one(at::matmul(x[0].to(at::kFloat), x[1].to(at::kFloat)).to(x[0].scalar_type()));
      // x [..., k] times a whole weight w [k, n] (the linear's input gradient) is x (w^T)^T.
      if (x[1].dim() == 2 && x[1].is_contiguous() && x[0].dim() >= 2) return one(cpu_linear(x[0], x[1].t()));
      return one(at::matmul(x[0], x[1]));
    };
    k["linear"] = [](const Node&, const Tensors& x) { return one(cpu_linear(x[0], x[1])); };
    k["sum_to"] = [](const Node& n, const Tensors& x) { return one(at::sum_to(x[0], n.attr_ints("shape"))); };
    // (x * rsqrt(mean(x^2) + eps)) * w, the product by w in place: no temporary beside the output.
    k["rms_norm"] = [](const Node& n, const Tensors& x) {
      if (x[0].is_cuda()) {
        if (auto r = fused_rms_norm(x[0], x[1], n.attr_float("eps"))) return one(std::get<0>(*r));
      }
      return one((x[0] * rms_inv(x[0], n.attr_float("eps"))).mul_(x[1]));
    };
    k["layer_norm"] = [](const Node& n, const Tensors& x) {
      return one(at::layer_norm(x[0], {x[0].size(-1)}, x[1], x[2], n.attr_float("eps")));
    };
    // ATen's fused attention of the device (sdpa(), kernels.h): no [s, t] matrix kept.
    k["sdpa"] = [](const Node& n, const Tensors& x) {
      if (x[0].numel() == 0 || x[1].numel() == 0) {  // an empty shard: ATen's kernel divides by zero
        return Tensors{at::zeros_like(x[0]), at::zeros(n.output(1)->meta().shape, x[0].options().dtype(to_aten(n.output(1)->meta().dtype)))};
      }
      if (ir::blocked_attention(n)) return blocked_attention(n, x[0], x[1], x[2]);
      return attend(x[0], x[1], x[2], n.attr_bool("causal"));
    };
    k["linear_weight_grad"] = [](const Node&, const Tensors& x) {
      std::int64_t rows = 1;  // explicit: a shard may hold 0 columns, which -1 cannot infer rows from
      for (std::int64_t d = 0; d + 1 < x[0].dim(); ++d) rows *= x[0].size(d);
      return one(at::mm(x[0].reshape({rows, x[0].size(-1)}).t(), x[1].reshape({rows, x[1].size(-1)})));
    };
    k["cross_entropy"] = [](const Node& n, const Tensors& x) {
      const auto reduction = n.attr_string("reduction") == "sum" ? at::Reduction::Sum : at::Reduction::Mean;
      return one(at::cross_entropy_loss(x[0], x[1], {}, reduction, n.attr_int("ignore_index")));
    };
    k["found_inf"] = [](const Node&, const Tensors& x) { return one(at::isfinite(x[0]).all().logical_not().to(at::kFloat)); };
    k["amax_rows"] = [](const Node&, const Tensors& x) { return one(at::amax(x[0], {1}, true)); };
    k["sum_exp_rows"] = [](const Node&, const Tensors& x) {
      at::Tensor e = x[0] - x[1];  // the one temporary (memory_plan's scratch)
      return one(e.exp_().sum(1, true));
    };
    k["sum_exp_rows_backward"] = [](const Node&, const Tensors& x) {
      at::Tensor e = x[1] - x[2];  // becomes the output
      return one(e.exp_().mul_(x[0]));
    };
    // The rows whose target is one of this rank's columns (offset .. offset + columns) and not ignored.
    auto picked = [](const Node& n, const at::Tensor& targets, std::int64_t columns) {
      const std::int64_t offset = n.attr_int("offset");
      const at::Tensor valid = targets.ne(n.attr_int("ignore_index")).logical_and(targets.ge(offset)).logical_and(targets.lt(offset + columns));
      return std::pair{valid.unsqueeze(1), at::where(valid, targets - offset, at::zeros_like(targets)).unsqueeze(1)};
    };
    k["pick"] = [picked](const Node& n, const Tensors& x) {
      const auto [valid, index] = picked(n, x[1], x[0].size(1));
      return one(at::where(valid, x[0].gather(1, index), at::zeros({}, x[0].options())));
    };
    k["pick_backward"] = [picked](const Node& n, const Tensors& x) {
      const std::int64_t columns = n.attr_int("num_classes");
      const auto [valid, index] = picked(n, x[1], columns);
      at::Tensor out = at::zeros({x[0].size(0), columns}, x[0].options());
      return one(out.scatter_(1, index, at::where(valid, x[0], at::zeros({}, x[0].options()))));
    };
    k["valid_rows"] = [](const Node& n, const Tensors& x) {
      return one(x[0].ne(n.attr_int("ignore_index")).to(to_aten(n.output()->meta().dtype)).unsqueeze(1));
    };
    k["count_valid"] = [](const Node& n, const Tensors& x) {
      return one(x[0].ne(n.attr_int("ignore_index")).sum().to(to_aten(n.output()->meta().dtype)));
    };

    // ---- backward ops ----
    k["relu_backward"] = [](const Node&, const Tensors& x) { return one(at::threshold_backward(x[0], x[1], 0)); };
    k["silu_backward"] = [](const Node&, const Tensors& x) { return one(at::silu_backward(x[0], x[1])); };
    k["gelu_backward"] = [](const Node& n, const Tensors& x) { return one(at::gelu_backward(x[0], x[1], n.attr_string("approximate"))); };
    k["softmax_backward"] = [](const Node& n, const Tensors& x) {
      return one(at::_softmax_backward_data(x[0], x[1], n.attr_int("dim"), x[1].scalar_type()));
    };
    k["log_softmax_backward"] = [](const Node& n, const Tensors& x) {
      return one(at::_log_softmax_backward_data(x[0], x[1], n.attr_int("dim"), x[1].scalar_type()));
    };
    // d(CE)/d(logits) = softmax(logits) - onehot(target), rows of ignored targets 0, divided by
    // the count of the others for the mean.
    k["cross_entropy_backward"] = [](const Node& n, const Tensors& x) {
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
    };
    // gx = r * (g w - xhat * mean(g w * xhat)), gw = sum(g * xhat); the subtraction and the
    // product by r in place in g w (the same elementwise operations): at most two temporaries
    // of x's size beside the outputs, not five.
    k["rms_norm_backward"] = [](const Node& n, const Tensors& x) {
      const at::Tensor &g = x[0], &in = x[1], &w = x[2];
      if (in.is_cuda()) {
        // The forward's rstd again (one fused pass), then ATen's fused backward.
        if (auto r = fused_rms_norm(in, w, n.attr_float("eps"))) {
          try {
            auto [gx, gw] = at::_fused_rms_norm_backward(g, in, {in.size(-1)}, std::get<1>(*r), w, {true, true});
            return Tensors{gx, gw};
          } catch (const c10::Error& e) {
            fused_refused("fused RMSNorm backward", e);
          }
        }
      }
      const at::Tensor r = rms_inv(in, n.attr_float("eps"));
      const at::Tensor xhat = in * r;
      at::Tensor gx = g * w;
      const at::Tensor dot = (gx * xhat).mean(-1, true);
      gx.sub_(xhat * dot).mul_(r);
      std::vector<std::int64_t> batch_dims;
      for (std::int64_t i = 0; i + 1 < in.dim(); ++i) batch_dims.push_back(i);
      return Tensors{gx, (g * xhat).sum(batch_dims)};
    };
    k["layer_norm_backward"] = [](const Node& n, const Tensors& x) {
      const std::vector<std::int64_t> shape{x[1].size(-1)};
      auto [out, mean, rstd] = at::native_layer_norm(x[1], shape, x[2], x[3], n.attr_float("eps"));
      auto [gx, gw, gb] = at::native_layer_norm_backward(x[0], x[1], shape, mean, rstd, x[2], x[3], {true, true, true});
      return Tensors{gx, gw, gb};
    };
    k["sdpa_backward"] = [](const Node& n, const Tensors& x) {
      if (x[1].numel() == 0 || x[2].numel() == 0) return Tensors{at::zeros_like(x[1]), at::zeros_like(x[2]), at::zeros_like(x[3])};
      if (ir::blocked_attention(n)) return blocked_attention_backward(n, x[0], x[1], x[2], x[3], x[4], x[5]);
      return attend_backward(x[0], x[1], x[2], x[3], x[4], x[5], n.attr_bool("causal"));
    };
    // As torch.optim.AdamW(fused=True) on the CPU: ATen's fused kernel, one pass over each
    // element (decoupled decay, bias corrections in double), on copies of the state.
    k["adamw"] = [](const Node& n, const Tensors& x) {
      const AdamW h = hyper(n);
      if (!x[4].is_cpu() && !x[4].is_cuda()) return adamw_on_device(x[0], x[1], x[2], x[3], x[4], x[5], h, found_inf_of(x));
      Tensors state{x[0].clone(at::MemoryFormat::Contiguous), x[2].clone(at::MemoryFormat::Contiguous), x[3].clone(at::MemoryFormat::Contiguous)};
      fused_adamw(state[0], x[1], state[1], state[2], x[4], x[5], h, found_inf_of(x));
      return state;
    };
    // Local halves of redistribution (the collectives run in the comm layer, not here).
    k["to_partial"] = [](const Node& n, const Tensors& x) { return one(n.attr_int("index") == 0 ? x[0] : at::zeros_like(x[0])); };
    return k;
  }();
  return table;
}

}  // namespace

void set_cpu_matmul(CpuMatmul library) {
  if (library == CpuMatmul::onednn && !onednn_linear_op())
    throw std::runtime_error("training.cpu_matmul = \"onednn\": this LibTorch has no oneDNN linear (mkldnn::_linear_pointwise); use \"aten\"");
  cpu_matmul_setting().store(library);
}
CpuMatmul cpu_matmul() { return cpu_matmul_setting().load(); }
bool onednn_linear_available() { return onednn_linear_op().has_value(); }
CpuMatmul cpu_matmul_named(const std::string& name) {
  if (name == "onednn") return CpuMatmul::onednn;
  if (name == "aten") return CpuMatmul::aten;
  if (name == "auto") return onednn_linear_available() ? CpuMatmul::onednn : CpuMatmul::aten;
  throw std::runtime_error("training.cpu_matmul = \"" + name + "\": use \"auto\", \"onednn\" or \"aten\"");
}
const char* library_name(CpuMatmul library) { return library == CpuMatmul::onednn ? "oneDNN" : "ATen's BLAS"; }

at::Tensor cpu_linear(const at::Tensor& x, const at::Tensor& w) {
  if (cpu_matmul_setting().load(std::memory_order_relaxed) == CpuMatmul::onednn && x.is_cpu() && x.scalar_type() == at::kFloat &&
      w.scalar_type() == at::kFloat && w.dim() == 2 && x.dim() >= 2 && x.is_contiguous() && x.numel() > 0 && w.numel() > 0 &&
      !(x.requires_grad() || w.requires_grad())) {
    return onednn_linear_op()->call(x, w, std::nullopt, "none", c10::List<std::optional<at::Scalar>>(), c10::string_view(""));
  }
  return at::linear(x, w);
}

namespace {

struct Defined {
  Kernel kernel;
  InPlaceKernel in_place;
};

// The kernels core/src/ops/ defines next to each op's record (at load time: function-local).
std::map<std::string, Defined>& defined() {
  static std::map<std::string, Defined> table;
  return table;
}

}  // namespace

void define_kernel(const std::string& op, Kernel kernel, InPlaceKernel in_place) {
  if (!defined().emplace(op, Defined{std::move(kernel), std::move(in_place)}).second) throw std::invalid_argument("kernel for op '" + op + "' defined twice");
}

const Kernel* find_kernel(const std::string& op) {
  if (auto d = defined().find(op); d != defined().end()) return &d->second.kernel;
  auto it = kernels().find(op);
  return it == kernels().end() ? nullptr : &it->second;
}

namespace {

// The in-place twins of the elementwise kernels above: ATen's in-place and out= forms of the
// same ops, whose loops compute each element as the functional forms do.
const std::map<std::string, InPlaceKernel>& in_place_kernels() {
  static const std::map<std::string, InPlaceKernel> table = [] {
    std::map<std::string, InPlaceKernel> k;
    using Unary = void (*)(const Node&, at::Tensor&);
    auto unary = [&](const char* op, Unary f) {
      k[op] = [f](const Node& n, const Tensors& x, const std::vector<int>&) {
        at::Tensor t = x[0];
        f(n, t);
        return Tensors{t};
      };
    };
    unary("add_scalar", [](const Node& n, at::Tensor& t) { t.add_(n.attr_float("value")); });
    unary("mul_scalar", [](const Node& n, at::Tensor& t) { t.mul_(n.attr_float("value")); });
    unary("pow_scalar", [](const Node& n, at::Tensor& t) { t.pow_(n.attr_float("value")); });
    unary("rdiv_scalar", [](const Node& n, at::Tensor& t) { t.reciprocal_().mul_(n.attr_float("value")); });
    unary("clamp_max_scalar", [](const Node& n, at::Tensor& t) { t.clamp_max_(n.attr_float("value")); });
    using Binary = void (*)(const Node&, at::Tensor&, const at::Tensor&, const at::Tensor&);
    auto binary = [&](const char* op, Binary f) {
      k[op] = [f](const Node& n, const Tensors& x, const std::vector<int>& into) {
        at::Tensor out = x[static_cast<std::size_t>(into.at(0))];
        f(n, out, x[0], x[1]);
        return Tensors{out};
      };
    };
    binary("add", [](const Node&, at::Tensor& o, const at::Tensor& a, const at::Tensor& b) { at::add_out(o, a, b); });
    binary("sub", [](const Node&, at::Tensor& o, const at::Tensor& a, const at::Tensor& b) { at::sub_out(o, a, b); });
    binary("mul", [](const Node&, at::Tensor& o, const at::Tensor& a, const at::Tensor& b) { at::mul_out(o, a, b); });
    binary("div", [](const Node&, at::Tensor& o, const at::Tensor& a, const at::Tensor& b) { at::div_out(o, a, b); });
    binary("silu_backward", [](const Node&, at::Tensor& o, const at::Tensor& g, const at::Tensor& x) { at::silu_backward_out(o, g, x); });
    binary("relu_backward", [](const Node&, at::Tensor& o, const at::Tensor& g, const at::Tensor& y) { at::threshold_backward_out(o, g, y, 0); });
    binary("gelu_backward", [](const Node& n, at::Tensor& o, const at::Tensor& g, const at::Tensor& x) {
      at::gelu_backward_out(o, g, x, n.attr_string("approximate"));
    });
    // The parameter and its AdamW state updated where they are (donated by the caller).
    k["adamw"] = [](const Node& n, const Tensors& x, const std::vector<int>&) {
      Tensors state{x[0], x[2], x[3]};
      if (!x[4].is_cpu() && !x[4].is_cuda()) {  // neither fused kernel: the tensor-hyperparameter form, copied back
        const Tensors next = adamw_on_device(x[0], x[1], x[2], x[3], x[4], x[5], hyper(n), found_inf_of(x));
        for (std::size_t i = 0; i < 3; ++i) state[i].copy_(next[i]);
        return state;
      }
      fused_adamw(state[0], x[1], state[1], state[2], x[4], x[5], hyper(n), found_inf_of(x));
      return state;
    };
    return k;
  }();
  return table;
}

}  // namespace

const InPlaceKernel* find_in_place_kernel(const std::string& op) {
  if (auto d = defined().find(op); d != defined().end()) return d->second.in_place ? &d->second.in_place : nullptr;
  auto it = in_place_kernels().find(op);
  return it == in_place_kernels().end() ? nullptr : &it->second;
}

}  // namespace spmdx::exec
