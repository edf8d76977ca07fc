// GraphBuilder: the small API models are written in. Each method appends one op to the graph
// and returns its output; shapes are checked as the graph is built (Graph::add_node).
#pragma once

#include <string>
#include <vector>

#include "spmdx/ir/graph.h"

namespace spmdx::ir {

class GraphBuilder {
 public:
  using Shape = std::vector<std::int64_t>;

  /// Builds into `graph`; parameters get `dtype`.
  explicit GraphBuilder(Graph& graph, DType dtype = DType::f32) : g_(graph), dtype_(dtype) {}

  Graph& graph() noexcept { return g_; }
  DType dtype() const noexcept { return dtype_; }

  /// A trainable parameter (graph input with requires_grad), recorded in params().
  Value* param(const std::string& name, Shape shape);
  /// A graph input that takes no gradient (batch, rope tables, ...).
  Value* input(const std::string& name, Shape shape, DType dtype);
  const std::vector<Value*>& params() const noexcept { return params_; }

  Value* add(Value* a, Value* b) { return g_.add("add", {a, b}); }
  Value* mul(Value* a, Value* b) { return g_.add("mul", {a, b}); }
  Value* linear(Value* x, Value* weight) { return g_.add("linear", {x, weight}); }
  Value* embedding(Value* weight, Value* indices) { return g_.add("embedding", {weight, indices}); }
  Value* relu(Value* x) { return g_.add("relu", {x}); }
  Value* silu(Value* x) { return g_.add("silu", {x}); }
  Value* rms_norm(Value* x, Value* weight, double eps) { return g_.add("rms_norm", {x, weight}, {{"eps", eps}}); }
  Value* reshape(Value* x, Shape shape) { return g_.add("reshape", {x}, {{"shape", std::move(shape)}}); }
  Value* transpose(Value* x, std::int64_t d0, std::int64_t d1) {
    return g_.add("transpose", {x}, {{"dim0", d0}, {"dim1", d1}});
  }
  Value* rotary(Value* x, Value* cos, Value* sin) { return g_.add("rotary_embedding", {x, cos, sin}); }
  Value* causal_attention(Value* q, Value* k, Value* v) { return g_.add("sdpa", {q, k, v}, {{"causal", true}}); }
  Value* cross_entropy(Value* logits, Value* targets) { return g_.add("cross_entropy", {logits, targets}); }

 private:
  Graph& g_;
  DType dtype_;
  std::vector<Value*> params_;
};

}  // namespace spmdx::ir
