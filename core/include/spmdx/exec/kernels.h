// ATen kernels for the IR's ops: one function per op name, no autograd at run time.
// The only place, with the executor, where the IR meets LibTorch.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "spmdx/exec/dtype.h"
#include "spmdx/ir/graph.h"

namespace spmdx::exec {

/// Computes a node's outputs from its input tensors (in the node's input order).
using Kernel = std::function<std::vector<at::Tensor>(const ir::Node& node, const std::vector<at::Tensor>& inputs)>;

/// Scaled dot-product attention, scale 1/sqrt(d), no dropout, with ATen's fused kernel for the
/// tensors' device, as torch.nn.functional.scaled_dot_product_attention picks (PyTorch 2.11's
/// sdp_utils): on the CPU _scaled_dot_product_flash_attention_for_cpu; on CUDA FlashAttention-2
/// (Dao 2023; _scaled_dot_product_flash_attention) for bfloat16 and float16, the memory-efficient
/// kernel (xFormers', Rabe & Staats 2021; _scaled_dot_product_efficient_attention) for float32;
/// where a CUDA kernel refuses the inputs (head_dim, alignment, GPU generation), attention()
/// below, said once on stderr. q [b, h, s, d], k and v [b, h, t, d] -> {out [b, h, s, d] in q's
/// dtype, the log-sum-exp of each row of scaled scores [b, h, s] (natural log; float32 for
/// half inputs on CUDA)}; every kernel's lse means the same, so a backward may use another.
/// causal (s == t): key j masked for query i < j (PyTorch's is_causal). The sdpa kernel.
std::vector<at::Tensor> sdpa(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal);
/// On the CPU, bfloat16/float16 attention runs ATen's float32 kernel on the upcast inputs
/// (results rounded back to their dtype once; lse float32 as the half kernel's) where this says
/// so: always where half_gemm is upcast (ATen's half kernel is slow without bf16/fp16
/// instructions); for the backward also below a head_dim of kCpuHalfAttentionHeadDim, where
/// ATen's half backward was measured 4.7x slower than float32's at head_dim 16 (Llama
/// debugmodel: 111 of a 262 ms bf16 step), 2.5x at 32 and 1.3x at 48, and faster only from 64
/// (0.92x at 64, 0.80x at 128; PyTorch 2.15, AMD EPYC with AVX512-BF16, one thread). The
/// forward stays ATen's half kernel where half_gemm is native, so a step's forward is PyTorch's
/// bit for bit there. Both kernels accumulate in float32.
bool cpu_attention_upcast(const at::Tensor& q, bool backward);
/// The head_dim from which the CPU's half attention backward runs native (where half_gemm is native).
constexpr std::int64_t kCpuHalfAttentionHeadDim = 64;
/// Its gradients {dq, dk, dv} from the forward's out and lse, by the same choice of kernel
/// (their backward; FlashAttention-2's and the memory-efficient one accumulate dq with atomics,
/// so two runs may differ in the last bits, as PyTorch's without torch.use_deterministic_algorithms).
std::vector<at::Tensor> sdpa_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                                      const at::Tensor& lse, bool causal);

/// Scaled dot-product attention with plain ATen ops, for devices without a fused kernel
/// (FlashAttention's outputs, Dao et al. 2022, with the [b, h, s, t] scores materialised): the
/// shapes and outputs of sdpa(), in q's dtype.
std::vector<at::Tensor> attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal);
/// Its gradients {dq, dk, dv} from the forward's out and lse (FlashAttention's backward:
/// probabilities recomputed from lse).
std::vector<at::Tensor> attention_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const at::Tensor& out, const at::Tensor& lse, bool causal);

/// The mask of tiled attention (the sdpa op's window, chunks, q_offset and documents inputs;
/// ir/ops.cpp says what each means): causal, within `window` tokens when > 0, within a
/// document when `documents` (i64 [b, t], laid out as k's rows) is defined.
struct AttentionMask {
  std::int64_t window = 0, chunks = 1, q_offset = 0;
  at::Tensor documents;
};
/// Attention by tiles of query rows (ir::attention_tiles) that visits only the key rows a tile
/// may see, so a window of W costs about s x (W + tile), not s x t / 2. On the CPU each tile is
/// one call of ATen's fused kernel (_scaled_dot_product_flash_attention_for_cpu, float32
/// accumulation) over its keys, the tile's mask given as an additive bias; elsewhere the tile's
/// scores (tile rows x keys) are materialised, masked and reduced in float32 (float64 for double
/// inputs). The outputs of sdpa(), laid out as the fused CPU kernel's (out as q, the log-sum-exp
/// [b, s, h] in memory).
std::vector<at::Tensor> tiled_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const AttentionMask& mask);
/// Its gradients {dq, dk, dv} ([b, s, h, d] in memory, as sdpa_backward()'s), from the
/// forward's out and lse, tile by tile over the same key rows (ATen's fused backward on the
/// CPU); dk and dv sum the tiles' parts in float32.
std::vector<at::Tensor> tiled_attention_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 const at::Tensor& out, const at::Tensor& lse, const AttentionMask& mask);

/// The mask of a tiled sdpa (documents: input 3) or sdpa_backward (input 6) node.
AttentionMask attention_mask(const ir::Node& node, const std::vector<at::Tensor>& inputs, std::size_t documents);
/// Causal attention of an sdpa node whose query rows sit at known positions (context
/// parallelism: ir::blocked_attention): per block of rows, the keys before it (wholly seen) and
/// its own (causally) in two fused calls merged by their log-sum-exp (ring attention's and
/// FlashAttention's split-KV merge). The outputs of sdpa(), laid out as the fused kernel's.
std::vector<at::Tensor> blocked_attention(const ir::Node& node, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);
/// Its gradients {dq, dk, dv} ([b, s, h, d] in memory), each part's backward from the merged
/// out and lse.
std::vector<at::Tensor> blocked_attention_backward(const ir::Node& node, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                                                   const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse);
/// The document of each position of tokens (i64 [b, s]): how many `eos` tokens come before it
/// in its row (torchtitan's get_document_mask_mod), counted in natural order when the rows are
/// in context parallelism's load-balanced order of `chunks` pieces; laid out as tokens.
at::Tensor document_ids(const at::Tensor& tokens, std::int64_t eos, std::int64_t chunks);

/// AdamW's hyperparameters (the adamw node's attributes).
struct AdamW {
  double beta1, beta2, eps, weight_decay;
};
/// One AdamW update (torch.optim.AdamW; on the CPU the adamw kernel runs ATen's fused CPU
/// kernel, _fused_adamw_, as torch.optim.AdamW(fused=True)) with lr and step as 0-d tensors on the
/// parameters' device, so that neither is read by the host (no synchronisation, and CUDA graph
/// replays see each step's values): {param, exp_avg, exp_avg_sq} after the step. Bias
/// corrections in f64 as the CPU kernel's. `found_inf` (a 0-d float tensor, or undefined):
/// when nonzero, the inputs come back unchanged (GradScaler's skipped step). The adamw kernel
/// uses it off the CPU.
std::vector<at::Tensor> adamw_on_device(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
                                        const at::Tensor& lr, const at::Tensor& step, const AdamW& h, const at::Tensor& found_inf = {});

/// The library that float32 matmuls on the CPU run on (training.cpu_matmul): the linear op
/// (x W^T) and matmul by a whole 2-D right operand (x W, the linear's input gradient). Other
/// matmuls (batched, strided operands, a weight's gradient, other dtypes) always take ATen's.
/// Measured on this project's AMD EPYC (Zen 4) runners, one intra-op thread: the forward
/// linears of Llama debugmodel 1.1 to 1.4x faster with oneDNN than with the wheel's MKL (which
/// takes a generic path on non-Intel CPUs), the x W products 1.03 to 1.25x; the weight
/// gradients (transposed operands) slower, hence ATen's. Results differ from ATen's in the
/// last bits (another summation order), never between two calls of the same shapes.
enum class CpuMatmul {
  onednn,  ///< oneDNN's inner product (ATen's mkldnn::_linear_pointwise, torch.ops.mkldnn._linear_pointwise)
  aten,    ///< at::linear / at::matmul: ATen's BLAS (MKL in the x86 PyTorch wheels)
};
/// Sets it for this process (default: onednn where this LibTorch has it, else aten). Throws
/// std::runtime_error for onednn in a LibTorch built without oneDNN.
void set_cpu_matmul(CpuMatmul library);
/// The library in use.
CpuMatmul cpu_matmul();
/// The library training.cpu_matmul names: "onednn", "aten", or "auto" (onednn where this
/// LibTorch has it, else aten). Throws std::runtime_error naming the key for any other name.
CpuMatmul cpu_matmul_named(const std::string& name);
/// For logs: "oneDNN" or "ATen's BLAS".
const char* library_name(CpuMatmul library);
/// Whether this LibTorch has oneDNN's linear (at::hasMKLDNN() and its op registered).
bool onednn_linear_available();
/// The linear op's kernel: x [..., in] times w^T for w [out, in] -> [..., out], on the library
/// cpu_matmul() names when x and w are float32 CPU tensors, x contiguous and neither requiring
/// grad (oneDNN's op has no autograd); bfloat16/float16 CPU tensors whose GEMMs run upcast
/// (upcast_half_gemm) as that float32 linear of their float32 copies, rounded back;
/// at::linear otherwise.
at::Tensor cpu_linear(const at::Tensor& x, const at::Tensor& w);

/// How a bfloat16 or float16 GEMM (matmul, linear, a weight's gradient, grouped_mm) runs on
/// the CPU. Both accumulate in float32 and round the result once, as PyTorch's bfloat16 kernel
/// does; they differ in the order of the sums (the last bits), never between two calls.
enum class HalfGemm {
  native,  ///< ATen's kernel of the dtype: oneDNN with the CPU's bf16/fp16 dot products (vdpbf16ps, AMX tdpbf16ps), about 2x float32's rate
  upcast,  ///< a float32 GEMM of the operands converted to float32, rounded back: ATen's half kernel runs up to 50x slower than float32 without those instructions (AVX2)
};
/// The choice for `dtype` (kBFloat16 or kHalf) on this CPU, decided at run time from what ATen's
/// cpuinfo reads (at::cpu::get_cpu_capabilities): native for bfloat16 where the CPU has
/// AVX512-BF16 or AMX-BF16, for float16 where it has AVX512-FP16 or AMX-FP16; upcast otherwise.
/// The environment variable SPMDX_HALF_GEMM=native|upcast overrides the CPU's choice for both
/// dtypes (to measure or test the other path on one machine); set_half_gemm overrides both.
/// Other dtypes: native (nothing to choose).
HalfGemm half_gemm(at::ScalarType dtype);
/// Forces the choice for every half dtype (tests run both paths on any CPU); nullopt: the CPU's.
void set_half_gemm(std::optional<HalfGemm> forced);
/// What the CPU has, for logs: "bfloat16 GEMMs native (AVX512-BF16)", or "... upcast to float32 (no AVX512-BF16 or AMX-BF16)".
std::string half_gemm_summary(at::ScalarType dtype);
/// a @ b as torch.matmul, where a and b are bfloat16/float16 CPU tensors and half_gemm says
/// upcast: matmul of the float32 copies, rounded back to a's dtype. A native half a that is a
/// strided 2-D view (strided_half_operand) is copied row-major first. Else at::matmul.
at::Tensor cpu_half_aware_matmul(const at::Tensor& a, const at::Tensor& b);
/// Whether a is a bfloat16/float16 2-D CPU view that is not row-major (a weight's gradient
/// g^T x reads g transposed), which cpu_half_aware_matmul copies before ATen's half GEMM.
bool strided_half_operand(const at::Tensor& a);
/// Whether x is a bfloat16/float16 CPU tensor whose GEMMs run upcast (half_gemm).
bool upcast_half_gemm(const at::Tensor& x);

/// The kernel of an op, or nullptr.
const Kernel* find_kernel(const std::string& op);

/// A kernel that writes output k into the storage of input into[k] (-1: a new tensor) and
/// returns those inputs as its outputs, computing exactly what the op's Kernel computes (the
/// same ATen loops, bit for bit). The caller guarantees that nothing else reads those inputs
/// afterwards (plan::plan_memory's decisions, checked by the executor).
using InPlaceKernel = std::function<std::vector<at::Tensor>(const ir::Node& node, const std::vector<at::Tensor>& inputs, const std::vector<int>& into)>;
/// The in-place kernel of an op of plan::in_place_ops(), or nullptr.
const InPlaceKernel* find_in_place_kernel(const std::string& op);

/// Registers an op's kernel (and its in-place twin, for an op whose record lists in_place
/// inputs), next to the op's record in core/src/ops/ (compiled into this library with
/// SPMDX_OPS_KERNELS). Throws std::invalid_argument when the op has one already.
void define_kernel(const std::string& op, Kernel kernel, InPlaceKernel in_place = nullptr);

/// A fused CUDA kernel that refused its inputs (for attention: head_dim, alignment, an older
/// GPU; RMSNorm): said once per kernel on stderr, and the caller runs plain ATen ops instead.
void fused_refused(const char* kernel, const c10::Error& e);

}  // namespace spmdx::exec
