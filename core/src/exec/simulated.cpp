#include "spmdx/exec/simulated.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <functional>
#include <list>
#include <stdexcept>
#include <unordered_map>

#include "spmdx/exec/shards.h"
#include "spmdx/sharding/spec.h"

namespace spmdx::exec {
namespace {

using sharding::DeviceMesh;

// The outputs of one collective node for the ranks of one group (in group order).
std::vector<at::Tensor> collective(const std::vector<const ir::Node*>& nodes, const std::vector<at::Tensor>& x) {
  const ir::Node& n = *nodes[0];
  const std::string& op = n.op();
  std::vector<at::Tensor> out;
  if (op == "all_reduce") {
    at::Tensor r = reduce_tensors(x, n.attr_string("op"));
    for (std::size_t i = 0; i < x.size(); ++i) out.push_back(r);
  } else if (op == "all_gather") {
    at::Tensor r = at::cat(x, n.attr_int("dim"));
    for (std::size_t i = 0; i < x.size(); ++i) out.push_back(r);
  } else if (op == "reduce_scatter") {
    at::Tensor r = reduce_tensors(x, n.attr_string("op"));
    const auto& sizes = n.attr_ints("sizes");
    for (std::size_t i = 0; i < x.size(); ++i) {
      out.push_back(r.narrow(n.attr_int("dim"), chunk_offset(sizes, static_cast<std::int64_t>(i)), sizes[i]).contiguous());
    }
  } else if (op == "all_to_all") {
    const auto& sizes = n.attr_ints("scatter_sizes");
    for (std::size_t r = 0; r < x.size(); ++r) {
      std::vector<at::Tensor> pieces;
      for (const auto& t : x) pieces.push_back(t.narrow(n.attr_int("scatter_dim"), chunk_offset(sizes, static_cast<std::int64_t>(r)), sizes[r]));
      out.push_back(at::cat(pieces, n.attr_int("gather_dim")));
    }
  } else {
    throw std::invalid_argument("not a collective: " + op);
  }
  return out;
}

bool is_collective(const std::string& op) {
  return op == "all_reduce" || op == "all_gather" || op == "reduce_scatter" || op == "all_to_all";
}

}  // namespace

SimulatedRun::SimulatedRun(const DeviceMesh& mesh, std::vector<ir::Graph> graphs) : mesh_(mesh), graphs_(std::move(graphs)) {
  if (static_cast<std::int64_t>(graphs_.size()) != mesh_.size()) {
    throw std::invalid_argument("SimulatedRun: " + std::to_string(graphs_.size()) + " graphs for a mesh of " + std::to_string(mesh_.size()) + " ranks");
  }
  for (std::size_t r = 1; r < graphs_.size(); ++r) {
    auto a = graphs_[0].nodes().begin();
    auto b = graphs_[r].nodes().begin();
    if (graphs_[0].num_nodes() != graphs_[r].num_nodes()) throw std::invalid_argument("rank graphs differ in length");
    for (; a != graphs_[0].nodes().end(); ++a, ++b) {
      if ((*a)->op() != (*b)->op()) throw std::invalid_argument("rank graphs differ: " + (*a)->op() + " vs " + (*b)->op());
    }
  }
  for (const auto& node : graphs_[0].nodes()) {
    if (!is_collective(node->op()) && find_kernel(node->op()) == nullptr) {
      throw std::invalid_argument("op '" + node->op() + "' has no kernel");
    }
  }
}

std::vector<TensorMap> SimulatedRun::run(const std::vector<TensorMap>& inputs) {
  c10::InferenceMode no_autograd;
  const std::size_t world = graphs_.size();
  std::vector<std::unordered_map<const ir::Value*, at::Tensor>> live(world);
  std::vector<std::list<std::unique_ptr<ir::Node>>::const_iterator> at_node(world);
  for (std::size_t r = 0; r < world; ++r) {
    for (const ir::Value* v : graphs_[r].inputs()) {
      auto it = inputs.at(r).find(v->name());
      if (it == inputs.at(r).end()) throw std::invalid_argument("rank " + std::to_string(r) + ": missing input '" + v->name() + "'");
      if (it->second.sizes().vec() != v->meta().shape) {
        throw std::invalid_argument("rank " + std::to_string(r) + ": input '" + v->name() + "' is " + ir::shape_str(it->second.sizes().vec()) +
                                    ", the rank's graph expects " + v->meta().str());
      }
      live[r][v] = it->second;
    }
    at_node[r] = graphs_[r].nodes().begin();
  }
  for (std::size_t step = 0; step < graphs_[0].num_nodes(); ++step) {
    const std::string& op = (*at_node[0])->op();
    if (is_collective(op)) {
      const int mesh_dim = static_cast<int>((*at_node[0])->attr_int("mesh_dim"));
      std::vector<bool> done(world, false);
      for (std::size_t r = 0; r < world; ++r) {
        if (done[r]) continue;
        const auto group = mesh_.group(static_cast<std::int64_t>(r), mesh_dim);
        std::vector<const ir::Node*> nodes;
        std::vector<at::Tensor> xs;
        for (auto m : group) {
          const ir::Node* n = at_node[static_cast<std::size_t>(m)]->get();
          nodes.push_back(n);
          xs.push_back(live[static_cast<std::size_t>(m)].at(n->input(0)));
        }
        auto out = collective(nodes, xs);
        for (std::size_t i = 0; i < group.size(); ++i) {
          const auto m = static_cast<std::size_t>(group[i]);
          live[m][nodes[i]->output()] = out[i];
          done[m] = true;
        }
      }
    } else {
      for (std::size_t r = 0; r < world; ++r) {
        const ir::Node& n = **at_node[r];
        std::vector<at::Tensor> args;
        for (const ir::Value* v : n.inputs()) args.push_back(live[r].at(v));
        auto out = (*find_kernel(n.op()))(n, args);
        for (std::size_t i = 0; i < out.size(); ++i) live[r][n.outputs()[i]] = out[i];
      }
    }
    for (std::size_t r = 0; r < world; ++r) ++at_node[r];
  }
  std::vector<TensorMap> result(world);
  for (std::size_t r = 0; r < world; ++r) {
    for (const auto& [name, v] : graphs_[r].outputs()) result[r][name] = live[r].at(v);
  }
  return result;
}

}  // namespace spmdx::exec
