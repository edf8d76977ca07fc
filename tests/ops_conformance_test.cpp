// One op, one record (issue 45, item 4): every op defined in core/src/ops/ is complete. Its
// gradient against LibTorch autograd is checked by vjp_test (Vjp.EveryForwardOp*), its sharding
// rules on 2, 3 and 2 x 2 ranks by sharding_rules_test (ShardingRules.EveryClaimedStrategy*),
// both from the record's samples; here, that each record has what those tests and the passes
// need: samples, a kernel, an in-place kernel exactly when it says it writes in place, sharding
// rules that answer for its samples, and a cost, a scratch and a layout the planner can ask for.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>

#include "spmdx/exec/kernels.h"
#include "spmdx/ir/ops.h"
#include "spmdx/plan/memory_plan.h"
#include "spmdx/sharding/cost_model.h"
#include "spmdx/sharding/redistribute.h"
#include "spmdx/sharding/rules.h"

namespace spmdx {
namespace {

// A graph holding one node of the sample.
const ir::Node& sample_node(ir::Graph& g, const std::string& op, const ir::Sample& s) {
  std::vector<ir::Value*> in;
  for (std::size_t i = 0; i < s.inputs.size(); ++i) {
    const auto dtype = s.inputs[i].dtype ? *s.inputs[i].dtype : s.inputs[i].fill == ir::SampleInput::Fill::indices ? ir::DType::i64 : ir::DType::f32;
    in.push_back(g.add_input("in" + std::to_string(i), {s.inputs[i].shape, dtype, "cpu", false}));
  }
  return *g.add_node(op, in, s.attrs);
}

TEST(OpsConformance, EveryRecordIsComplete) {
  int records = 0;
  for (const auto& op : ir::OpRegistry::global().names()) {
    const ir::OpSchema& s = *ir::OpRegistry::global().find(op);
    ++records;
    SCOPED_TRACE("op " + op);
    EXPECT_TRUE(s.defined_by_record) << "every op of the registry is a record of core/src/ops/ (SPMDX_OP)";
    // The collectives and send / recv run in the comm layer (exec/distributed.cpp), without a kernel.
    const bool comm_layer = sharding::is_collective(op) || op == "send" || op == "recv";
    EXPECT_EQ(exec::find_kernel(op) != nullptr, !comm_layer) << "a kernel (SPMDX_KERNEL) for each op but those of the comm layer";
    EXPECT_EQ(exec::find_in_place_kernel(op) != nullptr, !s.in_place.empty()) << "in_place inputs and an in-place kernel go together";
    EXPECT_EQ(plan::in_place_ops().count(op) > 0, !s.in_place.empty());
    if (sharding::is_communication(op) || comm_layer) continue;  // placed by the rewriter, checked by the comm tests
    ASSERT_FALSE(s.samples.empty()) << "no conformance sample";
    for (const auto& sample : s.samples) {
      ir::Graph g;
      const ir::Node& n = sample_node(g, op, sample);
      std::vector<sharding::Shape> in, out;
      for (const ir::Value* v : n.inputs()) in.push_back(v->meta().shape);
      for (const ir::Value* v : n.outputs()) out.push_back(v->meta().shape);
      const auto strategies = sharding::op_strategies(n, in, out, 2);
      ASSERT_FALSE(strategies.empty()) << sample.label;
      EXPECT_TRUE(strategies[0].inputs.size() == in.size() && strategies[0].outputs.size() == out.size()) << sample.label;
      const double flops = sharding::node_flops(n);
      EXPECT_TRUE(std::isfinite(flops) && flops >= 0) << sample.label << ": " << flops << " FLOPs";
      EXPECT_EQ(sample.gradient && s.vjp != nullptr, sample.gradient) << sample.label << " asks for a gradient test but the op has no VJP";
    }
  }
  std::printf("%d op records checked\n", records);
  EXPECT_GT(records, 0);
}

}  // namespace
}  // namespace spmdx
