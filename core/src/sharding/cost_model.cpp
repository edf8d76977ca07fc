#include "spmdx/sharding/cost_model.h"

#include "spmdx/ir/ops.h"
#include "spmdx/sharding/spec.h"

namespace spmdx::sharding {

double node_flops(const ir::Node& node) {
  if (const ir::OpSchema* s = ir::OpRegistry::global().find(node.op()); s != nullptr && s->flops) return s->flops(node);
  double out = 0;  // one per output element
  for (const ir::Value* v : node.outputs()) out += static_cast<double>(v->meta().numel());
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
