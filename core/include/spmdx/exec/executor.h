// Runs a Graph on one rank with ATen kernels: no autograd bookkeeping (the backward pass is
// already in the graph), each intermediate tensor released right after its last use.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "spmdx/exec/kernels.h"
#include "spmdx/ir/graph.h"

namespace spmdx::exec {

using TensorMap = std::map<std::string, at::Tensor>;

class Executor {
 public:
  /// Keeps a reference to `graph`, which must outlive the executor. Throws
  /// std::invalid_argument naming the first op without a kernel.
  explicit Executor(const ir::Graph& graph);

  /// Runs the graph. `inputs` holds one tensor per graph input, by name, with the input's
  /// shape and dtype. Returns the graph outputs by name. Throws std::invalid_argument naming a
  /// missing input or one whose shape or dtype differs from the graph's, and
  /// std::runtime_error naming the node whose kernel failed.
  TensorMap run(const TensorMap& inputs);

  /// Of the last run: the most bytes held at once by node outputs (inputs not counted; a view
  /// counts as its own size), in bytes.
  std::int64_t peak_bytes() const noexcept { return peak_bytes_; }

  /// When on, run() adds each node's kernel time to op_seconds(), keyed by op (seconds of
  /// wall time on the calling thread, summed over runs).
  void set_profiling(bool on) { profiling_ = on; }
  const std::map<std::string, double>& op_seconds() const noexcept { return op_seconds_; }

 private:
  const ir::Graph& graph_;
  struct Step {                 // per node: slots of run()'s tensors (values, numbered once)
    std::vector<int> inputs, outputs;
    std::vector<int> release;    // values whose last use this node is
  };
  std::vector<const Kernel*> kernels_;  // per node, in order
  std::vector<Step> steps_;
  std::size_t slots_ = 0;
  std::vector<std::pair<std::string, int>> outputs_;
  std::int64_t peak_bytes_ = 0;
  bool profiling_ = false;
  std::map<std::string, double> op_seconds_;
};

}  // namespace spmdx::exec
