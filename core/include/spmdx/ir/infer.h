// Helpers of the ops' shape and dtype inference (ir::InferFn), shared by the op records of
// core/src/ops/. Each throws IrError with a message about shapes only; Graph adds the node's
// and op's names.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "spmdx/ir/graph.h"

namespace spmdx::ir::infer {

using Metas = std::vector<const TensorMeta*>;
using Shape = std::vector<std::int64_t>;

[[noreturn]] void fail(const std::string& why);

/// dim in [-rank, rank) (a scalar as rank 1, as ATen's maybe_wrap_dim) as a dim in [0, rank).
std::int64_t wrap_dim(std::int64_t dim, std::int64_t rank, const char* what = "dim");

/// Every input has input 0's dtype (ops here do no type promotion).
void same_dtype(const Metas& in);

/// m is a floating-point tensor; `what` names it in the error.
void floating(const TensorMeta& m, const char* what);

bool any_requires_grad(const Metas& in);

/// m with another shape and requires_grad.
TensorMeta like(const TensorMeta& m, Shape shape, bool requires_grad);

/// NumPy broadcasting, as torch.broadcast_shapes.
Shape broadcast(const Shape& a, const Shape& b);

/// The communication ops' `sizes` (each member's torch.chunk size along a dim) and `index`
/// (this rank's position): their sum, and this rank's entry of a[key] (checked against it).
std::int64_t sum_of(const Shape& sizes);
std::int64_t at_index(const Attributes& a, const char* key);

/// The inference of chunk and reduce_scatter: a full `dim` (the sum of sizes) becomes this
/// rank's piece of it (sizes[index]).
std::vector<TensorMeta> scatter_dim(const Metas& in, const Attributes& a);

/// A backward op's output (grad_out, saved...) -> grad_in: input `like_input`'s meta, once the
/// gradient (input 0) has its dtype and input `grad_input`'s shape.
std::vector<TensorMeta> grad_like(const Metas& in, std::size_t grad_input, std::size_t like_input);

}  // namespace spmdx::ir::infer
