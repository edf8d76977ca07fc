// Running one op's kernel on tensors, for the tests of kernels (attention, context parallelism).
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "spmdx/exec/dtype.h"
#include "spmdx/exec/kernels.h"
#include "spmdx/ir/graph.h"

namespace spmdx::test {

// Runs op's kernel on `x` as a node with `attrs` (inputs of x's shapes and dtypes, on the CPU).
inline std::vector<at::Tensor> run_op(const std::string& op, const std::vector<at::Tensor>& x, const ir::Attributes& attrs) {
  ir::Graph g;
  std::vector<ir::Value*> in;
  for (std::size_t i = 0; i < x.size(); ++i) {
    in.push_back(g.add_input("in" + std::to_string(i), {x[i].sizes().vec(), exec::from_aten(x[i].scalar_type()), "cpu", false}));
  }
  const ir::Node* node = g.add_node(op, in, attrs);
  return (*exec::find_kernel(op))(*node, x);
}

}  // namespace spmdx::test
