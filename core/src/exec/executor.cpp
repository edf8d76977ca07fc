#include "spmdx/exec/executor.h"

#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <unordered_map>

namespace spmdx::exec {

Executor::Executor(const ir::Graph& graph) : graph_(graph) {
  std::unordered_map<const ir::Value*, int> slot;  // every value's index into run()'s tensors
  auto slot_of = [&](const ir::Value* v) { return slot.emplace(v, static_cast<int>(slot.size())).first->second; };
  for (const ir::Value* v : graph.inputs()) slot_of(v);
  for (const auto& node : graph.nodes()) {
    const Kernel* kernel = find_kernel(node->op());
    if (kernel == nullptr) {
      throw std::invalid_argument("node %" + std::to_string(node->id()) + ": op '" + node->op() + "' has no ATen kernel");
    }
    kernels_.push_back(kernel);
    Step step;
    for (const ir::Value* v : node->inputs()) step.inputs.push_back(slot_of(v));
    for (const ir::Value* v : node->outputs()) step.outputs.push_back(slot_of(v));
    steps_.push_back(std::move(step));
  }
  slots_ = slot.size();
  std::vector<int> order(graph.num_nodes());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  const auto dead = ir::release_after(graph, order);
  for (std::size_t i = 0; i < dead.size(); ++i) {
    for (const ir::Value* v : dead[i]) {  // inputs belong to the caller and are not counted in peak_bytes
      if (v->producer() != nullptr) steps_[i].release.push_back(slot.at(v));
    }
  }
  for (const auto& [name, v] : graph.outputs()) outputs_.emplace_back(name, slot.at(v));
}

TensorMap Executor::run(const TensorMap& inputs) {
  c10::InferenceMode no_autograd;
  std::vector<at::Tensor> live(slots_);
  std::size_t input_slot = 0;
  for (const ir::Value* v : graph_.inputs()) {
    auto it = inputs.find(v->name());
    if (it == inputs.end()) throw std::invalid_argument("missing input '" + v->name() + "' (" + v->meta().str() + ")");
    const at::Tensor& t = it->second;
    if (t.sizes().vec() != v->meta().shape || t.scalar_type() != to_aten(v->meta().dtype)) {
      throw std::invalid_argument("input '" + v->name() + "' is " + c10::toString(t.scalar_type()) + " " +
                                  ir::shape_str(t.sizes().vec()) + ", the graph expects " + v->meta().str());
    }
    live[input_slot++] = t;
  }
  std::int64_t held = 0;
  peak_bytes_ = 0;
  std::size_t index = 0;
  std::vector<at::Tensor> args;
  for (const auto& node : graph_.nodes()) {
    const Step& step = steps_[index];
    args.clear();
    for (int i : step.inputs) args.push_back(live[static_cast<std::size_t>(i)]);
    std::vector<at::Tensor> out;
    const auto start = profiling_ ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
    try {
      out = (*kernels_[index])(*node, args);
    } catch (const c10::Error& e) {  // LibTorch's message, without its 20-frame backtrace (an allocation that fails)
      throw std::runtime_error("node %" + std::to_string(node->id()) + " (" + node->op() + ") failed: " + e.what_without_backtrace());
    } catch (const std::exception& e) {
      throw std::runtime_error("node %" + std::to_string(node->id()) + " (" + node->op() + ") failed: " + e.what());
    }
    if (profiling_) {
      op_seconds_[node->op()] += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    for (std::size_t i = 0; i < out.size(); ++i) {
      held += static_cast<std::int64_t>(out[i].nbytes());
      live[static_cast<std::size_t>(step.outputs[i])] = std::move(out[i]);
    }
    peak_bytes_ = std::max(peak_bytes_, held);
    for (int i : step.release) {
      at::Tensor& t = live[static_cast<std::size_t>(i)];
      held -= static_cast<std::int64_t>(t.nbytes());
      t.reset();
    }
    ++index;
  }
  TensorMap result;
  for (const auto& [name, i] : outputs_) result.emplace(name, live[static_cast<std::size_t>(i)]);
  return result;
}

}  // namespace spmdx::exec
