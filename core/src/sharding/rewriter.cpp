#include "spmdx/sharding/rewriter.h"

#include <map>
#include <stdexcept>

#include "spmdx/sharding/rules.h"
#include "spmdx/sharding/spec.h"

namespace spmdx::sharding {

DistributedGraph rank_graph(const DistributedPlan& plan, std::int64_t rank) {
  const DeviceMesh& mesh = plan.mesh;
  const auto coord = mesh.coordinate(rank);
  ir::Graph g;
  std::map<std::pair<const ir::Value*, std::string>, ir::Value*> versions;  // by DistributedPlan::version_key
  auto local_meta = [&](const ir::TensorMeta& meta, const Placements& pl) {
    ir::TensorMeta m = meta;
    m.shape = ShardingSpec{pl, meta}.local_shape(mesh, coord);
    return m;
  };
  for (const ir::Value* v : plan.graph->inputs()) {
    const Placements& pl = plan.placement.at(v);
    ir::Value* local = g.add_input(v->name(), local_meta(v->meta(), pl));
    versions[{v, plan.version_key(v, pl, nullptr)}] = local;
    for (const auto& key : plan.resharded_keys(pl)) versions[{v, key}] = local;  // its own placement needs no redistribution
  }
  // The local value of `v` in placements `want`, adding the redistribution's nodes once.
  auto get = [&](const ir::Value* v, const Placements& want, const ir::Node* reader) -> ir::Value* {
    if (auto it = versions.find({v, plan.version_key(v, want, reader)}); it != versions.end()) return it->second;
    Placements state = plan.placement.at(v);
    ir::Value* cur = versions.at({v, plan.version_key(v, state, reader)});
    for (const auto& step : redistribute_plan(mesh, v->meta(), state, want)) {
      const int i = step.mesh_dim;
      const std::int64_t k = mesh.size(i), index = coord[static_cast<std::size_t>(i)];
      const Shape level = shape_after(mesh, state, v->meta().shape, coord, i);  // the extent this mesh dim splits
      auto sizes_of = [&](int d) { return chunk_sizes(level[static_cast<std::size_t>(d)], k); };
      const std::int64_t mi = i;
      if (step.op == "all_reduce") {
        cur = g.add("all_reduce", {cur}, {{"mesh_dim", mi}, {"op", std::string(spmdx::to_string(step.from.reduce_op()))}});
      } else if (step.op == "reduce_scatter") {
        cur = g.add("reduce_scatter", {cur}, {{"mesh_dim", mi}, {"dim", std::int64_t{step.to.dim()}},
                                              {"op", std::string(spmdx::to_string(step.from.reduce_op()))}, {"sizes", sizes_of(step.to.dim())}, {"index", index}});
      } else if (step.op == "all_gather") {
        cur = g.add("all_gather", {cur}, {{"mesh_dim", mi}, {"dim", std::int64_t{step.from.dim()}}, {"sizes", sizes_of(step.from.dim())}, {"index", index}});
      } else if (step.op == "all_to_all") {
        cur = g.add("all_to_all", {cur}, {{"mesh_dim", mi}, {"gather_dim", std::int64_t{step.from.dim()}}, {"scatter_dim", std::int64_t{step.to.dim()}},
                                          {"gather_sizes", sizes_of(step.from.dim())}, {"scatter_sizes", sizes_of(step.to.dim())}, {"index", index}});
      } else if (step.op == "chunk") {
        cur = g.add("chunk", {cur}, {{"dim", std::int64_t{step.to.dim()}}, {"sizes", sizes_of(step.to.dim())}, {"index", index}});
      } else if (step.op == "to_partial") {
        cur = g.add("to_partial", {cur}, {{"index", index}});
      }
      state[static_cast<std::size_t>(i)] = step.to;
      versions[{v, plan.version_key(v, state, reader)}] = cur;
    }
    return cur;
  };
  for (const auto& node : plan.graph->nodes()) {
    const auto& in_pl = plan.inputs.at(node.get());
    std::vector<ir::Value*> args;
    for (std::size_t a = 0; a < in_pl.size(); ++a) args.push_back(get(node->inputs()[a], in_pl[a], node.get()));
    std::vector<Shape> local_out;
    for (const ir::Value* o : node->outputs()) local_out.push_back(local_meta(o->meta(), plan.placement.at(o)).shape);
    // A rank's classes of vocabulary-parallel cross entropy start where its columns of the logits do.
    const Placements& logits = node->op() == "pick" ? in_pl.at(0) : plan.placement.at(node->outputs()[0]);
    ir::Attributes attrs = local_attrs(*node, local_out, column_offset_of(*node, mesh, logits, coord));
    std::string op = node->op();
    if (op == "expert_dispatch" || op == "expert_combine") {  // blocks over the expert dim: the exchange itself
      const int i = mesh.dim_index(node->attr_string("expert_dim"));
      if (i >= 0 && in_pl[0][static_cast<std::size_t>(i)] == Placement::shard(0)) {
        attrs = {{"mesh_dim", std::int64_t{i}}, {"direction", std::string(op == "expert_dispatch" ? "dispatch" : "combine")}, {"members", mesh.size(i)}};
        op = "all_to_all_v";
      }
    }
    ir::Node* ln = g.add_node(op, args, attrs);
    for (std::size_t a = 0; a < local_out.size(); ++a) {
      const ir::Value* o = node->outputs()[a];
      if (ln->output(static_cast<int>(a))->meta().shape != local_out[a]) {
        throw ir::IrError("rank " + std::to_string(rank) + ": node %" + std::to_string(node->id()) + " (" + node->op() + ") computes " +
                          ln->output(static_cast<int>(a))->meta().str() + " locally, its placement " +
                          to_string(plan.placement.at(o)) + " says " + ir::shape_str(local_out[a]));
      }
      versions[{o, plan.version_key(o, plan.placement.at(o), nullptr)}] = ln->output(static_cast<int>(a));
      // A resharded node output (a parameter's mixed-precision cast) in its own placement
      // needs no redistribution after the forward either.
      for (const auto& key : plan.resharded_keys(plan.placement.at(o))) versions[{o, key}] = ln->output(static_cast<int>(a));
    }
  }
  for (const auto& [name, v] : plan.graph->outputs()) g.add_output(name, get(v, plan.outputs.at(name), nullptr));
  g.verify();
  return g;
}

}  // namespace spmdx::sharding
