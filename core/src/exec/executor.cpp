#include "spmdx/exec/executor.h"

#include <c10/core/InferenceMode.h>

#include <chrono>
#include <stdexcept>
#include <unordered_map>

namespace spmdx::exec {

Executor::Executor(const ir::Graph& graph) : graph_(graph) {
  std::unordered_map<const ir::Value*, std::size_t> last_use;  // value -> index of its last user
  std::size_t index = 0;
  for (const auto& node : graph.nodes()) {
    const Kernel* kernel = find_kernel(node->op());
    if (kernel == nullptr) {
      throw std::invalid_argument("node %" + std::to_string(node->id()) + ": op '" + node->op() + "' has no ATen kernel");
    }
    kernels_.push_back(kernel);
    for (const ir::Value* v : node->inputs()) last_use[v] = index;
    for (const ir::Value* v : node->outputs()) last_use.emplace(v, index);  // unused outputs die at once
    ++index;
  }
  for (const auto& [name, v] : graph.outputs()) last_use[v] = graph.num_nodes();  // kept to the end
  dead_.resize(graph.num_nodes());
  for (const auto& [value, at] : last_use) {
    if (at < dead_.size() && value->producer() != nullptr) dead_[at].push_back(value);
  }
}

TensorMap Executor::run(const TensorMap& inputs) {
  c10::InferenceMode no_autograd;
  std::unordered_map<const ir::Value*, at::Tensor> live;
  for (const ir::Value* v : graph_.inputs()) {
    auto it = inputs.find(v->name());
    if (it == inputs.end()) throw std::invalid_argument("missing input '" + v->name() + "' (" + v->meta().str() + ")");
    const at::Tensor& t = it->second;
    if (t.sizes().vec() != v->meta().shape || t.scalar_type() != to_aten(v->meta().dtype)) {
      throw std::invalid_argument("input '" + v->name() + "' is " + c10::toString(t.scalar_type()) + " " +
                                  ir::shape_str(t.sizes().vec()) + ", the graph expects " + v->meta().str());
    }
    live.emplace(v, t);
  }
  std::int64_t held = 0;
  peak_bytes_ = 0;
  std::size_t index = 0;
  std::vector<at::Tensor> args;
  for (const auto& node : graph_.nodes()) {
    args.clear();
    for (const ir::Value* v : node->inputs()) args.push_back(live.at(v));
    std::vector<at::Tensor> out;
    const auto start = profiling_ ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
    try {
      out = (*kernels_[index])(*node, args);
    } catch (const std::exception& e) {
      throw std::runtime_error("node %" + std::to_string(node->id()) + " (" + node->op() + ") failed: " + e.what());
    }
    if (profiling_) {
      op_seconds_[node->op()] += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    for (std::size_t i = 0; i < out.size(); ++i) {
      held += static_cast<std::int64_t>(out[i].nbytes());
      live[node->outputs()[i]] = std::move(out[i]);
    }
    peak_bytes_ = std::max(peak_bytes_, held);
    for (const ir::Value* v : dead_[index]) {
      auto it = live.find(v);
      held -= static_cast<std::int64_t>(it->second.nbytes());
      live.erase(it);
    }
    ++index;
  }
  TensorMap result;
  for (const auto& [name, v] : graph_.outputs()) result.emplace(name, live.at(v));
  return result;
}

}  // namespace spmdx::exec
