#include "spmdx/plan/memory_plan.h"

#include <algorithm>
#include <numeric>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>

#include "spmdx/ir/ops.h"
#include "spmdx/ir/strides.h"
#include "spmdx/sharding/redistribute.h"
#include "spmdx/text.h"

namespace spmdx::plan {
namespace {

using ir::Node;
using ir::Value;
using Shape = std::vector<std::int64_t>;
using Strides = std::vector<std::int64_t>;

// What a buffer holds, for the breakdown at the peak; a later kind outranks an earlier one.
enum class Kind { activation, communication, gradient, optimizer_state, parameter };

Strides contiguous(const Shape& shape) { return ir::contiguous_strides(shape); }

using ir::dense_like;

bool is_contiguous(const Shape& shape, const Strides& strides) {
  std::int64_t expected = 1;
  for (std::size_t d = shape.size(); d-- > 0;) {
    if (shape[d] == 1) continue;
    if (strides[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

// Covers its storage once, with no gaps and no element twice (ATen's
// is_non_overlapping_and_dense): a permutation of contiguous strides.
bool is_dense(const Shape& shape, const Strides& strides) {
  std::vector<std::size_t> dims;
  for (std::size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] != 1) dims.push_back(d);
  }
  std::sort(dims.begin(), dims.end(), [&](std::size_t a, std::size_t b) { return strides[a] < strides[b]; });
  std::int64_t expected = 1;
  for (std::size_t d : dims) {
    if (strides[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

using ir::front_is_view;  // the collectives' movedim(dim, 0).contiguous()

std::int64_t elem_bytes(const Value* v) { return static_cast<std::int64_t>(ir::element_size(v->meta().dtype)); }

bool is_elementwise(const std::string& op) {
  const ir::OpSchema* s = ir::OpRegistry::global().find(op);
  return s != nullptr && s->elementwise;
}

// The executor's step, replayed on buffers: who holds each one (values, calls in flight,
// pending outputs, the caller, the step's bucket slots), in the executor's order of events,
// with each value's strides as ATen's kernels give them (which decides what is a view).
class Simulation {
 public:
  Simulation(const ir::Graph& graph, const RuntimePlan& plan) : plan_(plan) {
    for (const auto& n : graph.nodes()) nodes_.push_back(n.get());
    if (plan.order.size() != nodes_.size()) {
      throw std::invalid_argument("plan_memory: the plan orders " + std::to_string(plan.order.size()) + " nodes, the graph has " +
                                  std::to_string(nodes_.size()));
    }
    dead_ = ir::release_after(graph, plan.order);
    for (const auto& [name, v] : graph.outputs()) outputs_.insert(v);
    for (const auto& n : graph.nodes()) {
      if (sharding::is_collective(n->op())) kind_[n->output()] = Kind::communication;
    }
    for (const auto& n : graph.nodes()) {
      if (n->op() != "adamw") continue;
      kind_[n->input(0)] = kind_[n->output(0)] = Kind::parameter;
      for (int i : {2, 3}) kind_[n->input(i)] = Kind::optimizer_state;
      for (int i : {1, 2}) kind_[n->output(i)] = Kind::optimizer_state;
      // The gradient adamw reads, and what it was made from on its way from the backward:
      // clipping's mul, its reduction (a bucket's output, too) and casts; with gradient
      // accumulation, the 1 / microbatches scale and the sum of every microbatch's gradient.
      for (std::vector<const Value*> todo{n->input(1)}; !todo.empty();) {
        const Value* g = todo.back();
        todo.pop_back();
        if (kind_.count(g) > 0 && kind_.at(g) == Kind::gradient) continue;
        kind_[g] = Kind::gradient;
        const Node* p = g->producer();
        if (p == nullptr) continue;
        const bool scaled = (p->op() == "mul" && p->input(1)->meta().shape.empty()) || p->op() == "mul_scalar";  // by the clip coefficient, 1 / loss scale, 1 / microbatches
        if (scaled || p->op() == "cast" || sharding::is_communication(p->op())) todo.push_back(p->input(0));
        if (p->op() == "add" && p->input(0)->meta().shape == g->meta().shape && p->input(1)->meta().shape == g->meta().shape) {
          todo.push_back(p->input(0));  // a sum of gradients: each addend is one
          todo.push_back(p->input(1));
        }
      }
    }
    result_.in_place.resize(nodes_.size());
    for (std::size_t i = 0; i < nodes_.size(); ++i) result_.in_place[i].assign(nodes_[i]->outputs().size(), -1);
    for (const Value* v : graph.inputs()) {
      const int b = make(v->meta().nbytes(), v);
      bind(v, b);
      hold(b);  // the caller's reference
    }
  }

  // Runs the step; with `stop_at` >= 0, stops at that event (the peak's) with its buffers held.
  void run(std::int64_t stop_at = -1) {
    stop_at_ = stop_at;
    for (std::size_t p = 0; p < plan_.order.size() && !stopped_; ++p) {
      pos_ = static_cast<int>(p);
      const std::size_t i = static_cast<std::size_t>(plan_.order[p]);
      const Node& n = *nodes_[i];
      if (p < plan_.wait_before.size()) {  // collectives bounded in flight, waited for early
        for (int w : plan_.wait_before[p]) fetch(nodes_[static_cast<std::size_t>(w)]->output());
      }
      for (const Value* v : n.inputs()) fetch(v);
      if (!sharding::is_collective(n.op())) {
        kernel(n, i);
      } else if (plan_.bucket_of[i] >= 0) {
        bucket_member(n, i);
      } else {
        collective(n);
      }
      if (stopped_) break;
      result_.held.push_back(held_);
      for (const Value* v : dead_[p]) {
        if (pending_.count(v) == 0) release(v);
      }
    }
    if (stopped_) return;
    pos_ = static_cast<int>(plan_.order.size());
    for (const Value* v : outputs_) fetch(v);
  }

  std::int64_t peak() const { return peak_; }
  int peak_position() const { return peak_pos_; }
  std::int64_t peak_event() const { return peak_event_; }
  MemoryPlan& result() { return result_; }

  // The buffers held at the stop: the breakdown and the largest ones. From the copy taken at
  // the stop itself: the node being simulated goes on releasing after it (a pending output
  // let go of its source), and the parts then summed to less than the peak.
  void describe(MemoryPlan& m) const {
    const std::vector<Buffer>& buffers_ = at_stop_;
    std::vector<int> live;
    for (std::size_t b = 0; b < buffers_.size(); ++b) {
      if (buffers_[b].holders > 0) live.push_back(static_cast<int>(b));
    }
    for (int b : live) {
      const Buffer& buf = buffers_[static_cast<std::size_t>(b)];
      switch (buf.kind) {
        case Kind::parameter: m.parameters += buf.bytes; break;
        case Kind::gradient: m.gradients += buf.bytes; break;
        case Kind::optimizer_state: m.optimizer_state += buf.bytes; break;
        case Kind::communication: m.communication += buf.bytes; break;
        case Kind::activation: m.activations += buf.bytes; break;
      }
    }
    m.activations += scratch_at_stop_;
    std::sort(live.begin(), live.end(), [&](int a, int b) {
      const Buffer &x = buffers_[static_cast<std::size_t>(a)], &y = buffers_[static_cast<std::size_t>(b)];
      return x.bytes != y.bytes ? x.bytes > y.bytes : a < b;
    });
    for (std::size_t k = 0; k < live.size() && k < 8; ++k) {
      const Buffer& buf = buffers_[static_cast<std::size_t>(live[k])];
      const Value* v = buf.made_for;
      if (!buf.what.empty()) {  // a bucket or a staging buffer
        m.largest.push_back({buf.what, "", buf.bytes});
        continue;
      }
      m.largest.push_back({v->producer() == nullptr ? v->name() : v->ref() + " (" + v->producer()->op() + ")", v->meta().str(), buf.bytes});
    }
  }

 private:
  struct Buffer {
    std::int64_t bytes = 0;
    int holders = 0;  // values bound to it, calls in flight, pending outputs, the caller, the step's bucket slots
    int values = 0;   // of the holders, the values
    Kind kind = Kind::activation;
    const Value* made_for = nullptr;
    std::string what;  // for a staging buffer: what it is
  };
  // A collective's output to come: the buffers its call holds until completion, and the one
  // its output will be (or, for a copy, the one the copy is made from).
  struct Pending {
    std::vector<int> in_flight;  // released at completion (a bucket's: by the bucket)
    int source = -1;
    bool copy = false;  // the output is a new buffer (a contiguous() copy of `source`)
    int bucket = -1;
  };

  int make(std::int64_t bytes, const Value* v, Kind kind = Kind::activation, std::string what = "") {
    Buffer b;
    b.bytes = bytes;
    b.made_for = v;
    auto it = kind_.find(v);
    b.kind = std::max(kind, it == kind_.end() ? Kind::activation : it->second);
    b.what = std::move(what);
    buffers_.push_back(std::move(b));
    return static_cast<int>(buffers_.size()) - 1;
  }
  void hold(int b) {
    Buffer& buf = buffers_[static_cast<std::size_t>(b)];
    if (buf.holders++ == 0) {
      held_ += buf.bytes;
      note();
    }
  }
  void let_go(int b) {
    Buffer& buf = buffers_[static_cast<std::size_t>(b)];
    if (--buf.holders == 0) held_ -= buf.bytes;
  }
  void bind(const Value* v, int b, std::optional<Strides> strides = std::nullopt) {
    buffer_of_[v] = b;
    strides_[v] = strides ? std::move(*strides) : contiguous(v->meta().shape);
    Buffer& buf = buffers_[static_cast<std::size_t>(b)];
    ++buf.values;
    if (auto it = kind_.find(v); it != kind_.end()) buf.kind = std::max(buf.kind, it->second);
    hold(b);
  }
  void release(const Value* v) {
    auto it = buffer_of_.find(v);
    if (it == buffer_of_.end()) return;
    --buffers_[static_cast<std::size_t>(it->second)].values;
    let_go(it->second);
    buffer_of_.erase(it);
  }
  // A moment the held bytes may peak, `extra` transient bytes on top.
  void note(std::int64_t extra = 0) {
    if (stopped_) return;
    if (event_ == stop_at_) {
      stopped_ = true;
      scratch_at_stop_ = extra;
      at_stop_ = buffers_;
      return;
    }
    if (held_ + extra > peak_) {
      peak_ = held_ + extra;
      peak_pos_ = pos_;
      peak_event_ = event_;
    }
    ++event_;
  }

  const Strides& strides(const Value* v) const { return strides_.at(v); }
  bool contiguous_value(const Value* v) const { return is_contiguous(v->meta().shape, strides(v)); }
  bool dense_value(const Value* v) const { return is_dense(v->meta().shape, strides(v)); }

  // The executor's value(): a pending collective output is waited for and made.
  void fetch(const Value* v) {
    auto it = pending_.find(v);
    if (it == pending_.end()) return;
    const Pending p = it->second;
    pending_.erase(it);
    if (p.bucket >= 0) {
      for (int b : bucket_in_flight_[p.bucket]) let_go(b);  // the bucket's call is done: it lets go of its buffers
      bucket_in_flight_[p.bucket].clear();
    } else {
      for (int b : p.in_flight) let_go(b);
    }
    bind(v, p.copy ? make(v->meta().nbytes(), v) : p.source);
    let_go(p.source);  // the pending output's hold on its source
  }

  // The strides of output k of a kernel node (ATen's), and whether it is a view of input 0.
  // What an op's record (ir::OpSchema's scratch and layout) may ask of n's inputs.
  ir::LayoutQuery query(const Node& n) const {
    return {[this, &n](int i) { return strides(n.input(i)); }, [this, &n](int i) { return contiguous_value(n.input(i)); },
            [this, &n](int i) { return dense_value(n.input(i)); }};
  }

  std::pair<Strides, bool> output_layout(const Node& n, std::size_t k) const {
    const std::string& op = n.op();
    const Shape& shape = n.output(static_cast<int>(k))->meta().shape;
    if (const ir::OpSchema* r = ir::OpRegistry::global().find(op); r != nullptr && r->layout) {
      if (auto l = r->layout(n, k, query(n))) return {l->strides, l->view};
    }
    if (is_elementwise(op)) {  // TensorIterator: the first dense input of the output's shape
      for (const Value* in : n.inputs()) {
        if (in->meta().shape == shape && dense_value(in)) return {dense_like(shape, strides(in)), false};
      }
    }
    return {contiguous(shape), false};
  }

  // Bytes of temporaries a kernel allocates beyond its outputs while it runs (exec/kernels.cpp):
  // each ATen intermediate of the composite kernels, and the contiguous() copies ATen makes of
  // strided inputs.
  std::int64_t scratch(const Node& n) const {
    const ir::OpSchema* s = ir::OpRegistry::global().find(n.op());
    return s != nullptr && s->scratch ? s->scratch(n, query(n)) : 0;
  }

  // A kernel node: in place where it can, views, new buffers; its scratch while it runs.
  void kernel(const Node& n, std::size_t i) {
    const std::vector<int> into = plan_.options.in_place ? in_place_inputs(n) : std::vector<int>(n.outputs().size(), -1);
    for (std::size_t k = 0; k < n.outputs().size(); ++k) {
      const Value* v = n.output(static_cast<int>(k));
      if (into[k] >= 0) {
        const Value* donor = n.input(into[k]);
        result_.in_place[i][k] = into[k];
        result_.in_place_bytes += v->meta().nbytes();
        bind(v, buffer_of_.at(donor), strides(donor));
        continue;
      }
      auto [s, view] = output_layout(n, k);
      bind(v, view ? buffer_of_.at(n.input(0)) : make(v->meta().nbytes(), v), std::move(s));
    }
    if (const std::int64_t extra = scratch(n); extra > 0) note(extra);
  }

  // Which input each output writes into (-1: none), by memory_plan.h's rules; the executor
  // checks the same at run time (the storage has one tensor, held by this value alone).
  std::vector<int> in_place_inputs(const Node& n) const {
    std::vector<int> none(n.outputs().size(), -1);
    auto it = in_place_ops().find(n.op());
    if (it == in_place_ops().end()) return none;
    const auto& dying = dead_[static_cast<std::size_t>(pos_)];
    auto dies_here = [&](const Value* v) { return outputs_.count(v) == 0 && std::find(dying.begin(), dying.end(), v) != dying.end(); };
    auto only_holder = [&](const Value* v, int others) {
      const Buffer& buf = buffers_[static_cast<std::size_t>(buffer_of_.at(v))];
      return buf.values == 1 && buf.holders == 1 + others && buf.bytes == v->meta().nbytes() && dense_value(v);
    };
    if (n.op() == "adamw") {  // param, exp_avg, exp_avg_sq: donated graph inputs, each dying here
      if (!plan_.options.donate_state) return none;
      for (int j : it->second) {
        const Value* v = n.input(j);
        if (v->producer() != nullptr || !dies_here(v) || !only_holder(v, 1)) return none;
      }
      return {0, 2, 3};
    }
    const Value* out = n.output();
    for (int j : it->second) {
      if (j >= static_cast<int>(n.inputs().size())) continue;
      const Value* v = n.input(j);
      if (v->producer() == nullptr || !dies_here(v)) continue;
      if (v->meta().dtype != out->meta().dtype || v->meta().shape != out->meta().shape) continue;
      if (!only_holder(v, 0)) continue;
      std::vector<int> into = none;
      into[0] = j;
      return into;
    }
    return none;
  }

  // A collective of its own (comm_lowering.cpp): what it allocates at its issue.
  void collective(const Node& n) {
    const Value* x = n.input(0);
    const Value* y = n.output();
    const std::string& op = n.op();
    Pending p;
    if (op == "all_reduce") {  // a contiguous clone of the input, reduced in place: the output
      p.source = make(x->meta().nbytes(), y, Kind::communication);
      p.in_flight = {p.source};
    } else if (op == "all_gather" || op == "reduce_scatter") {
      const std::int64_t dim = n.attr_int("dim");
      const int in = front_is_view(x->meta().shape, dim) && contiguous_value(x)
                         ? buffer_of_.at(x)
                         : make(x->meta().nbytes(), x, Kind::communication, "staging of " + x->ref() + " for " + op);
      p.source = make(y->meta().nbytes(), y, Kind::communication);
      p.in_flight = {in, p.source};
      p.copy = !front_is_view(y->meta().shape, dim);
    } else {  // all_to_all: its blocks cat'ed into a send buffer; a receive buffer; a cat at the end
      p.source = make(y->meta().nbytes(), y, Kind::communication);
      p.in_flight = {make(x->meta().nbytes(), x, Kind::communication, "send buffer of " + x->ref() + " for all_to_all"), p.source};
      p.copy = true;
    }
    for (int b : p.in_flight) hold(b);
    hold(p.source);  // the pending output's
    if (op == "all_to_all") note(x->meta().nbytes());  // the blocks, while they are cat'ed
    pending_[y] = p;
    if (!plan_.options.overlap) fetch(y);
  }

  // A bucket member: the bucket's buffers at its first member, the call at its last.
  void bucket_member(const Node& n, std::size_t i) {
    const int b = plan_.bucket_of[i];
    const Bucket& bucket = plan_.buckets.at(static_cast<std::size_t>(b));
    const Value* x = n.input(0);
    const Value* y = n.output();
    auto slot = bucket_buffers_.find(b);
    if (slot == bucket_buffers_.end()) {  // the step's slots hold them until the bucket is issued
      std::int64_t in_numel = 0, out_numel = 0;
      for (int m : bucket.members) {
        in_numel += nodes_[static_cast<std::size_t>(m)]->input(0)->meta().numel();
        out_numel += nodes_[static_cast<std::size_t>(m)]->output()->meta().numel();
      }
      const std::string what = "bucket " + std::to_string(b) + " (" + bucket.op + " of " + std::to_string(bucket.members.size()) + " tensors, last " +
                               nodes_[static_cast<std::size_t>(bucket.members.back())]->output()->ref() + ")";
      const int flat = make(in_numel * elem_bytes(x), y, Kind::communication, what);
      hold(flat);
      int out = flat;
      if (bucket.op != "all_reduce") {
        out = make(out_numel * elem_bytes(x), y, Kind::communication, "output of " + what);
        hold(out);
      }
      slot = bucket_buffers_.emplace(b, std::pair<int, int>{flat, out}).first;
    }
    const auto [flat, out] = slot->second;
    Pending p;
    p.bucket = b;
    if (bucket.op == "all_reduce") {  // the member's output: a view of the flat buffer
      p.source = flat;
    } else {
      const std::int64_t dim = n.attr_int("dim");
      if (!front_is_view(x->meta().shape, dim) || !contiguous_value(x)) note(x->meta().nbytes());  // moved to dim 0 to be packed
      p.source = out;
      p.copy = !front_is_view(y->meta().shape, dim);
    }
    hold(p.source);
    pending_[y] = p;
    if (pos_ == bucket.issue_after) {  // issued: the call holds the buffers until it is done
      auto& in_flight = bucket_in_flight_[b];
      in_flight = {flat};
      if (out != flat) in_flight.push_back(out);
      for (int buf : in_flight) hold(buf);
      for (int buf : in_flight) let_go(buf);  // the step's slots
      if (!plan_.options.overlap) {
        for (int m : bucket.members) fetch(nodes_[static_cast<std::size_t>(m)]->output());
      }
    }
  }

  const RuntimePlan& plan_;
  std::vector<const Node*> nodes_;
  std::vector<std::vector<const Value*>> dead_;
  std::unordered_set<const Value*> outputs_;
  std::unordered_map<const Value*, Kind> kind_;
  std::vector<Buffer> buffers_;
  std::unordered_map<const Value*, int> buffer_of_;
  std::unordered_map<const Value*, Strides> strides_;
  std::unordered_map<const Value*, Pending> pending_;
  std::unordered_map<int, std::pair<int, int>> bucket_buffers_;  // bucket -> (flat, output)
  std::unordered_map<int, std::vector<int>> bucket_in_flight_;
  MemoryPlan result_;
  std::int64_t held_ = 0, peak_ = 0, event_ = 0, peak_event_ = -1, stop_at_ = -1, scratch_at_stop_ = 0;
  std::vector<Buffer> at_stop_;  // buffers_ as they were at the stop
  int pos_ = -1, peak_pos_ = -1;
  bool stopped_ = false;
};

}  // namespace

const std::map<std::string, std::vector<int>>& in_place_ops() {
  static const std::map<std::string, std::vector<int>> ops = [] {
    std::map<std::string, std::vector<int>> m;
    for (const auto& name : ir::OpRegistry::global().names()) {  // the records of core/src/ops/
      const ir::OpSchema& s = *ir::OpRegistry::global().find(name);
      if (!s.in_place.empty()) m[name] = s.in_place;
    }
    return m;
  }();
  return ops;
}

MemoryPlan plan_memory(const ir::Graph& graph, const RuntimePlan& plan) {
  Simulation full(graph, plan);
  full.run();
  MemoryPlan m = std::move(full.result());
  m.peak_bytes = full.peak();
  m.peak_position = full.peak_position();
  if (full.peak_event() >= 0) {  // again, up to the peak, to see what is held there
    Simulation at_peak(graph, plan);
    at_peak.run(full.peak_event());
    at_peak.describe(m);
  }
  return m;
}

std::string MemoryPlan::report(const ir::Graph& graph, const RuntimePlan& plan) const {
  std::vector<const ir::Node*> nodes;
  for (const auto& n : graph.nodes()) nodes.push_back(n.get());
  std::ostringstream out;
  out << "planned peak " << str() << ", at [" << peak_position << "]";
  if (peak_position >= 0 && static_cast<std::size_t>(peak_position) < plan.order.size()) {
    const ir::Node* n = nodes.at(static_cast<std::size_t>(plan.order[static_cast<std::size_t>(peak_position)]));
    out << " " << n->op() << " -> " << n->output()->ref();
  }
  out << "\n" << human_bytes(static_cast<double>(in_place_bytes)) << " written in place per step instead of allocated\nlargest buffers held at the peak:\n";
  for (const auto& h : largest) out << "  " << human_bytes(static_cast<double>(h.bytes)) << "  " << h.what << (h.type.empty() ? "" : " " + h.type) << "\n";
  out << "([n]: position in execution order, as rankR.plan.txt; held: bytes after the node, before its values go; ip: written into input k)\n";
  for (std::size_t p = 0; p < plan.order.size() && p < held.size(); ++p) {
    const auto i = static_cast<std::size_t>(plan.order[p]);
    const ir::Node* n = nodes.at(i);
    out << "[" << p << "] " << n->op() << " -> " << n->output()->ref() << "  held " << human_bytes(static_cast<double>(held[p]));
    for (std::size_t k = 0; k < in_place.at(i).size(); ++k) {
      if (in_place[i][k] >= 0) out << "  ip " << in_place[i][k];
    }
    if (static_cast<int>(p) == peak_position) out << "  <- peak";
    out << "\n";
  }
  return out.str();
}

std::string MemoryPlan::str() const {
  std::ostringstream out;
  out << human_bytes(static_cast<double>(peak_bytes)) << " (parameters " << human_bytes(static_cast<double>(parameters)) << ", gradients "
      << human_bytes(static_cast<double>(gradients)) << ", AdamW state " << human_bytes(static_cast<double>(optimizer_state)) << ", activations "
      << human_bytes(static_cast<double>(activations)) << ", communication " << human_bytes(static_cast<double>(communication))
      << (state_copy > 0 ? ", state copy to run a failed step again " + human_bytes(static_cast<double>(state_copy)) : std::string()) << ")";
  return out.str();
}

}  // namespace spmdx::plan
