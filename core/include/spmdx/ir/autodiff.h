// Reverse-mode automatic differentiation over the IR: appends to the graph the nodes that
// compute gradients (as torch.autograd does at run time, but once, ahead of time, in IR).
// Each forward op has a VJP rule (core/src/ir/autodiff.cpp) that emits IR for its input gradients.
#pragma once

#include <vector>

#include "spmdx/ir/graph.h"

namespace spmdx::ir {

/// Appends the nodes computing d(loss)/d(x) for each x in `wrt` and returns one gradient per
/// entry (same TensorMeta as x; zeros_like(x) where x does not reach the loss).
/// `loss` must be a floating scalar (shape []). Throws IrError naming the op when a node on a
/// path from `wrt` to `loss` has no VJP rule.
std::vector<Value*> gradients(Graph& graph, Value* loss, const std::vector<Value*>& wrt);

/// True when the op has a VJP rule.
bool has_vjp(const std::string& op);

}  // namespace spmdx::ir
