#include "spmdx/sharding/cost_model.h"

#include "spmdx/ir/ops.h"
#include "spmdx/sharding/spec.h"

namespace spmdx::sharding {

double node_flops(const ir::Node& node) {
  if (const ir::OpSchema* s = ir::OpRegistry::global().find(node.op()); s != nullptr && s->flops) return s->flops(node);
  const std::string& op = node.op();
  double out = 0;
  for (const ir::Value* v : node.outputs()) out += static_cast<double>(v->meta().numel());
  if (op == "sdpa" || op == "sdpa_backward") {
    const auto& q = node.input(op == "sdpa" ? 0 : 1)->meta().shape;  // [B, H, S, D]
    if (q.size() != 4) return out;
    double f = 4.0 * static_cast<double>(q[0] * q[1]) * static_cast<double>(q[2]) * static_cast<double>(q[2]) * static_cast<double>(q[3]);
    if (ir::tiled_attention(node)) {  // the visited tiles only (query rows x key rows each)
      double pairs = 0;
      for (const auto& t : ir::attention_tiles(node)) pairs += static_cast<double>(t.rows) * static_cast<double>(t.key_end - t.key_begin);
      f = 4.0 * static_cast<double>(q[0] * q[1]) * pairs * static_cast<double>(q[3]);
    }
    return op == "sdpa" ? f : 2 * f;
  }
  return out;
}

double node_seconds(const ir::Node& node, double flops_per_second, double bytes_per_second) {
  double elements = 0, traffic = 0;
  for (const ir::Value* o : node.outputs()) elements += static_cast<double>(o->meta().numel()), traffic += shape_bytes(o->meta().shape, o->meta().dtype);
  for (const ir::Value* in : node.inputs()) traffic += shape_bytes(in->meta().shape, in->meta().dtype);
  const double flops = node_flops(node);
  return flops > elements ? flops / flops_per_second : traffic / bytes_per_second;
}

}  // namespace spmdx::sharding
