#include "spmdx/sharding/propagate.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <functional>
#include <set>
#include <sstream>
#include <stdexcept>

#include "spmdx/sharding/cost_model.h"
#include "spmdx/sharding/rules.h"
#include "spmdx/sharding/spec.h"

namespace spmdx::sharding {
namespace {

const Placement kR = Placement::replicate();

}  // namespace

namespace {
std::string segment_key(const Placements& placements, std::size_t segment) {
  return to_string(placements) + (segment == 0 ? "" : "#after-" + std::to_string(segment));
}
}  // namespace

std::string DistributedPlan::version_key(const ir::Value* v, const Placements& placements, const ir::Node* node) const {
  std::size_t segment = 0;
  if (node != nullptr && resharded.count(v) > 0) {
    segment = static_cast<std::size_t>(std::lower_bound(reshard_after.begin(), reshard_after.end(), node->id()) - reshard_after.begin());
  }
  return segment_key(placements, segment);
}

std::vector<std::string> DistributedPlan::resharded_keys(const Placements& placements) const {
  std::vector<std::string> keys;
  for (std::size_t s = 1; s <= reshard_after.size(); ++s) keys.push_back(segment_key(placements, s));
  return keys;
}

// The reshard points of a train step: the node before each backward's seed (autodiff's
// ones_like of a scalar loss, or of the loss times the loss scale), and the node before the first
// node computing the loss again after a backward (the next microbatch's forward).
std::vector<std::int64_t> reshard_points(const ir::Graph& graph, const ir::Value* loss) {
  const std::set<const ir::Node*> forward = ir::producers_of(loss);  // computes the loss
  std::vector<std::int64_t> points;
  bool backward = false;
  std::int64_t previous = -1;
  for (const auto& n : graph.nodes()) {
    const bool seed = n->op() == "ones_like" && forward.count(n.get()) == 0 && n->input(0)->meta().shape.empty();  // d loss / d loss
    if (seed && !backward) points.push_back(previous), backward = true;
    else if (backward && !seed && forward.count(n.get()) > 0) points.push_back(previous), backward = false;
    previous = n->id();
  }
  return points;
}

namespace {

// The values `of` names for each node of `ops` that computes the loss (the forward), of 3 or
// more dims [batch, seq, ...] with at least k positions.
std::set<const ir::Value*> forward_sequence_values(const ir::Graph& graph, std::int64_t k, const std::set<std::string>& ops,
                                                   const std::function<std::vector<const ir::Value*>(const ir::Node&)>& of) {
  std::set<const ir::Value*> out;
  const ir::Value* loss = graph.find_output("loss");
  if (loss == nullptr || loss->producer() == nullptr) return out;
  const std::set<const ir::Node*> forward = ir::producers_of(loss);
  for (const auto& node : graph.nodes()) {
    if (ops.count(node->op()) == 0 || forward.count(node.get()) == 0) continue;
    for (const ir::Value* v : of(*node)) {
      if (v->meta().shape.size() >= 3 && v->meta().shape[1] >= k) out.insert(v);
    }
  }
  return out;
}

}  // namespace

std::set<const ir::Value*> sequence_parallel_values(const ir::Graph& graph, std::int64_t k) {
  return forward_sequence_values(graph, k, {"rms_norm", "layer_norm"}, [](const ir::Node& n) { return std::vector<const ir::Value*>{n.input(0), n.output()}; });
}

std::set<const ir::Value*> context_parallel_values(const ir::Graph& graph, std::int64_t k) {
  return forward_sequence_values(graph, k, {"embedding"}, [](const ir::Node& n) { return std::vector<const ir::Value*>{n.output()}; });
}

namespace {

// propagate()'s state over one graph: the plan being filled, the values already redistributed
// (reusing one costs nothing), and the placements values are wanted in.
struct Propagator {
  Propagator(const ir::Graph& g, const DeviceMesh& m, DistributedPlan& p) : graph(g), mesh(m), plan(p) {}
  const ir::Graph& graph;
  const DeviceMesh& mesh;
  DistributedPlan& plan;
  int n = mesh.ndim();
  const ir::Node* reading = nullptr;  // the node whose inputs are being placed
  std::set<std::pair<const ir::Value*, std::string>> made;  // keyed by DistributedPlan::version_key
  std::map<const ir::Value*, std::vector<Placements>> made_in;  // the same, by placements
  // Placements to make a value in as soon as it exists: `use` for inputs, and for gradients
  // their parameter's placement (through the clipping multiply by a scalar).
  std::map<const ir::Value*, Placements> hint, use_of;
  // Addends of a hinted sum (find_hints): their producers choose the strategy that moves the
  // fewest input bytes first, the cheapest second.
  std::set<const ir::Value*> accumulating;
  // Sums of gradients wanted sharded, whose addends are reduce-scattered as they are made, the
  // addends' producers, and the multiplies by a scalar after the sums (1 / microbatches,
  // clipping): their outputs are made in the hint, and another placement costs the way back.
  std::set<const ir::Node*> sharded_chain;
  // Placements graph outputs must end in: a strategy that produces them otherwise pays for the
  // redistribution (so the optimizer's new state comes out as its input was).
  std::map<const ir::Value*, Placements> demand;
  // Casts that must run on their input as placed: a gradient's cast back to its parameter's
  // dtype (mixed precision), so its reduction happens after it, in the parameter's dtype, as
  // FSDP2's reduce_dtype = float32 does.
  std::set<const ir::Node*> in_place;
  // Sequence and context parallelism: forward values made Shard(1) (the sequence) on a mesh
  // dim as soon as they are produced (sequence_parallel_values on tp, context_parallel_values
  // on cp).
  std::vector<std::pair<int, std::map<const ir::Value*, Placement>>> sequence_sharded;
  // Context parallelism by all-gather: the mesh dim on which attention (sdpa, sdpa_backward)
  // takes only its query-row strategy (q Shard(2), k and v whole), where it has one.
  int query_rows_dim = -1;
  // Context parallelism: its mesh dim and the sequence length. There a value that has a dim
  // of the sequence's length is best split on it: where splitting another dim costs the same
  // now (a gradient's reduce_scatter), the sequence split is taken, and the tokens' values
  // stay split alike through the backward (split on the batch, the next linear's weight
  // gradient all_to_alls them back).
  int sequence_dim = -1;
  std::int64_t sequence_length = 0;
  std::vector<std::int64_t> zero = std::vector<std::int64_t>(static_cast<std::size_t>(n), 0);
  // propagate_optimal: per node and mesh dim, the strategy a planner chose (its signature), taken
  // where the node's candidates have it and the rules above allow it.
  const ForcedChoices* forced = nullptr;
  // Fault tolerance's mesh dim (dp_replicate): its members may be lost, so on it a value is only
  // summed (Partial -> Replicate, an all_reduce over the live ones) or split locally.
  int fault_domain_dim = -1;

  static double bytes_of(const ir::Value* v, const Shape& seen) { return shape_bytes(seen, v->meta().dtype); }

  // Counts the bytes and time of redistributing v to `want`, once per placement it is made in.
  void make(const ir::Value* v, const Placements& want) {
    if (want != plan.placement.at(v) && made.insert({v, plan.version_key(v, want, reading)}).second) {
      made_in[v].push_back(want);
      for (const auto& step : redistribute_plan(mesh, v->meta(), plan.placement.at(v), want)) {
        plan.comm_bytes += step.bytes;
        plan.comm_seconds += step.seconds;
        plan.comm_bytes_by_dim.at(static_cast<std::size_t>(step.mesh_dim)) += step.bytes;
        plan.comm_messages_by_dim.at(static_cast<std::size_t>(step.mesh_dim)) += step.messages;
      }
    }
  }

  // A multiply by a scalar, which passes a gradient's hint through: mul_scalar, or mul by a 0-d tensor.
  static bool by_scalar(const ir::Node& node) {
    return node.op() == "mul_scalar" || (node.op() == "mul" && node.input(1)->meta().shape.empty());
  }

  void find_hints(const std::map<std::string, Placements>& use) {
    for (const auto& [name, pl] : use) {
      const ir::Value* v = graph.find_input(name);
      if (v == nullptr || static_cast<int>(pl.size()) != n) {
        throw std::invalid_argument("use placements for '" + name + "': not a graph input, or not one placement per mesh dim");
      }
      hint[v] = use_of[v] = pl;
      // A parameter read in another dtype (mixed precision) is redistributed after its cast, as
      // FSDP2 all-gathers param_dtype shards (half the bytes in bf16); the optimizer reads it
      // as stored.
      bool only_cast = false;
      for (const auto& u : v->uses()) {
        if (u.user->op() == "cast") {
          hint[u.user->output()] = use_of[u.user->output()] = pl;
          if (plan.resharded.count(v) > 0) plan.resharded.insert(u.user->output());
          only_cast = true;
        } else if (u.user->op() != "adamw") {
          only_cast = false;
          break;
        }
      }
      if (only_cast) hint.erase(v);
    }
    for (auto it = graph.nodes().rbegin(); it != graph.nodes().rend(); ++it) {
      const ir::Node& node = **it;
      if (node.op() == "adamw") hint.emplace(node.input(1), plan.placement.at(node.input(0)));
      // Through a multiply by a scalar (clipping's coefficient, gradient accumulation's 1 / microbatches).
      if (by_scalar(node) && hint.count(node.output())) {
        hint.emplace(node.input(0), hint.at(node.output()));
      }
      if (node.op() == "cast" && hint.count(node.output()) && node.input(0)->producer() != nullptr) in_place.insert(&node);
      // A gradient summed over microbatches (gradient accumulation) or over a parameter's uses
      // is redistributed once, where the sum is wanted: each addend is best made where it
      // stands, moving nothing (a Partial sum), however cheap moving its inputs looks for one
      // microbatch, as every microbatch would pay it again.
      //
      // Except where the sum is wanted sharded (FSDP): there each addend is reduce-scattered
      // as soon as it is made and the shards are summed, as FSDP2 reduce-scatters in every
      // microbatch's backward. Summing whole Partial gradients would hold the rank's unsharded
      // gradients through the step (for Llama 3 405B on dp_shard 128 x tp 8, 433 GiB a rank).
      if (node.op() == "add" && (hint.count(node.output()) > 0 || accumulating.count(node.output()) > 0)) {
        const auto h = hint.find(node.output());
        const bool sharded = h != hint.end() && std::any_of(h->second.begin(), h->second.end(), [](const Placement& p) { return p.is_shard(); });
        if (sharded) sharded_chain.insert(&node);
        for (const ir::Value* in : node.inputs()) {
          if (in->meta().shape != node.output()->meta().shape) continue;
          if (sharded) {
            hint.emplace(in, h->second);
            if (in->producer() != nullptr) sharded_chain.insert(in->producer());
          }
          else accumulating.insert(in);
        }
      }
    }
    for (const auto& node : graph.nodes()) {
      const ir::Node* from = node->input(0)->producer();
      if (by_scalar(*node) && hint.count(node->output()) > 0 && from != nullptr && sharded_chain.count(from) > 0) sharded_chain.insert(node.get());
    }
    for (const ir::Value* v : graph.inputs()) {
      if (auto h = hint.find(v); h != hint.end()) make(v, h->second);
    }
  }

  // The bytes mesh dim i sends to take a value from `current` to `target` there, as
  // redistribute_plan does it: a shard moved to another tensor dim that another mesh dim
  // also shards is gathered whole, not sent all_to_all (1/k of the bytes), and a Partial
  // scattered along a dim another mesh dim shards differently is all_reduced.
  double step_bytes(const Placements& current, const Placements& target, int i, double bytes) const {
    const Placement& from = current[static_cast<std::size_t>(i)];
    const Placement& to = target[static_cast<std::size_t>(i)];
    const std::int64_t k = mesh.size(i);
    auto others_shard = [&](std::int64_t d, bool outer_unchanged_ok) {
      for (int j = 0; j < n; ++j) {
        const Placement &cj = current[static_cast<std::size_t>(j)], &tj = target[static_cast<std::size_t>(j)];
        if (j == i || !((cj.is_shard() && cj.dim() == d) || (tj.is_shard() && tj.dim() == d))) continue;
        if (outer_unchanged_ok && j < i && cj == tj) continue;
        return true;
      }
      return false;
    };
    if (from.is_shard() && to.is_shard() && from != to && (others_shard(from.dim(), false) || others_shard(to.dim(), false))) {
      return redistribute_bytes(from, Placement::replicate(), bytes, k);
    }
    if (from.is_partial() && to.is_shard() && others_shard(to.dim(), true)) return redistribute_bytes(from, Placement::replicate(), bytes, k);
    // Cutting a tensor dim an inner mesh dim already shards: nested shards go outer to inner,
    // so the inner one is gathered first (HSDP's gradient, stored R x S(0), read S(0) x S(0)).
    if (from.is_replicate() && to.is_shard()) {
      double gathered = 0;
      for (int j = i + 1; j < n; ++j) {
        const Placement& cj = current[static_cast<std::size_t>(j)];
        if (cj.is_shard() && cj.dim() == to.dim()) gathered += redistribute_bytes(cj, Placement::replicate(), bytes, mesh.size(j));
      }
      if (gathered > 0) return gathered;
    }
    return redistribute_bytes(from, to, bytes, k);
  }

  // The cost of strategy c for mesh dim i of `node`, the dims before i already chosen (in_pl):
  // the bytes its inputs' redistribution sends, plus the bytes of the outputs the rank computes.
  // With moves_only: the bytes its inputs' redistribution sends alone.
  double cost(const ir::Node& node, int i, const OpStrategy& c, const std::vector<Placements>& in_pl, const std::vector<Shape>& seen_in,
              const std::vector<Shape>& seen_out, bool moves_only = false) const {
    const std::size_t n_in = node.inputs().size(), n_out = node.outputs().size();
    double total = 0;
    std::set<std::pair<const ir::Value*, std::string>> counted;
    for (std::size_t a = 0; a < n_in; ++a) {
      const ir::Value* v = node.inputs()[a];
      const Placements& current = plan.placement.at(v);
      if (!counted.insert({v, c.inputs[a].str()}).second) continue;  // the same operand twice moves once
      Placements target = current;
      for (int j = 0; j < i; ++j) target[static_cast<std::size_t>(j)] = in_pl[a][static_cast<std::size_t>(j)];
      target[static_cast<std::size_t>(i)] = c.inputs[a];
      // A parameter is read only as used (FSDP gathers, TP computes on its shard): the
      // strategy chose how it is computed, the cost model does not overrule it. As stored
      // too, where that is how it is used (TP), and by the optimizer and the casts of mixed
      // precision; not by the model where FSDP gathers it: with one row a rank, gathering the
      // activations instead looked cheaper op by op, and held them gathered from the forward
      // to the backward (27 GiB a rank for Llama 3 8B at sequence 512 on HSDP 4 x 8).
      if (auto u = use_of.find(v); u != use_of.end() && c.inputs[a] != u->second[static_cast<std::size_t>(i)]) {
        const bool stored = c.inputs[a] == current[static_cast<std::size_t>(i)];
        const bool state_reader = node.op() == "adamw" || node.op() == "cast";
        if (!stored || !state_reader) {
          total += 1e30;
          continue;
        }
      }
      if (target == current || made.count({v, plan.version_key(v, target, &node)})) continue;
      if (i == fault_domain_dim) {
        const Placement& from = current[static_cast<std::size_t>(i)];
        const Placement& to = c.inputs[a];
        if (!(from == to || (from.is_partial() && to.is_replicate()) || (from.is_replicate() && to.is_shard()))) {
          total += 1e30;
          continue;
        }
      }
      // A version already made that agrees on mesh dims 0..i (a gradient made in its
      // parameter's placement as soon as it was produced) is free to read, as the later dims
      // can choose it too: without this, dims still as produced (Partial) made the clipping's
      // reads of an HSDP gradient all_reduce twice instead of reusing its reduce_scatter.
      if (const auto m = made_in.find(v); m != made_in.end() && i + 1 < n &&
          std::any_of(m->second.begin(), m->second.end(), [&](const Placements& pl) {
            return std::equal(pl.begin(), pl.begin() + i + 1, target.begin()) && made.count({v, plan.version_key(v, pl, &node)}) > 0;
          })) {
        continue;
      }
      if (in_place.count(&node) > 0) {
        total += 1e30;
        continue;
      }
      total += step_bytes(current, target, i, bytes_of(v, seen_in[a]));
      // Splitting a replicated input saves work now, but its result is often wanted whole
      // later: an all_gather, whose latency (alpha, in bytes at beta) the greedy choice
      // cannot see. So a split must save more than that message costs (a rope table's
      // neg, 1,024 elements, was split and gathered back on every layer).
      if (current[static_cast<std::size_t>(i)].is_replicate() && c.inputs[a].is_shard()) {
        const CostModel m;
        total += m.alpha * m.beta;
      }
    }
    if (moves_only) return total;
    // Work: what the rank computes, as the bytes of the local outputs it produces. A
    // strategy that replicates an output this mesh dim could split makes every rank of the
    // dim do the same work; comm bytes alone would favour it when the input it gathers is
    // small.
    for (std::size_t a = 0; a < n_out; ++a) {
      const double out_bytes = bytes_of(node.outputs()[a], seen_out[a]);
      if (auto d = demand.find(node.outputs()[a]); d != demand.end()) {
        total += redistribute_bytes(c.outputs[a], d->second[static_cast<std::size_t>(i)], out_bytes, mesh.size(i));
      }
      // A sum of sharded gradients (FSDP's accumulation, find_hints) is made in its hint right
      // away: what that costs from here (made more sharded than its parameter, an HSDP sum was
      // gathered back over both dims for AdamW).
      if (auto h = hint.find(node.outputs()[a]); h != hint.end() && sharded_chain.count(&node) > 0) {
        total += redistribute_bytes(c.outputs[a], h->second[static_cast<std::size_t>(i)], out_bytes, mesh.size(i));
      }
      // A value sequence parallelism keeps sharded: what getting it there costs from here (the
      // row-parallel matmul's Partial output is reduce-scattered into the residual stream).
      for (const auto& [dim, values] : sequence_sharded) {
        const auto it = values.find(node.outputs()[a]);
        if (i == dim && it != values.end()) total += redistribute_bytes(c.outputs[a], it->second, out_bytes, mesh.size(i));
      }
      total += c.outputs[a].is_shard() ? out_bytes / static_cast<double>(mesh.size(i)) : out_bytes;  // a Partial is full size
      if (i == sequence_dim && c.outputs[a].is_shard()) {
        const Shape& full = node.outputs()[a]->meta().shape;
        if (full.at(static_cast<std::size_t>(c.outputs[a].dim())) != sequence_length &&
            std::find(full.begin(), full.end(), sequence_length) != full.end()) {
          total += out_bytes / static_cast<double>(mesh.size(i)) * 0.01;  // a tie-break, less than any message
        }
      }
    }
    return total;
  }

  const std::string* forced_choice(const ir::Node& node, int i) const {
    if (forced == nullptr) return nullptr;
    const auto f = forced->find(&node);
    if (f == forced->end()) return nullptr;
    const auto g = f->second.find(i);
    return g == f->second.end() ? nullptr : &g->second;
  }

  // The candidates of `node` on mesh dim i as place() sees them, the node's placements on the
  // dims before i being `in_pl` and `out_pl` (their first i entries).
  std::vector<OpStrategy> candidates_of(const ir::Node& node, int i, const std::vector<Placements>& in_pl, const std::vector<Placements>& out_pl,
                                        std::vector<Shape>& seen_in, std::vector<Shape>& seen_out) const {
    seen_in.clear(), seen_out.clear();
    for (std::size_t a = 0; a < node.inputs().size(); ++a) {
      Placements sofar(in_pl[a].begin(), in_pl[a].begin() + std::min<std::ptrdiff_t>(i, static_cast<std::ptrdiff_t>(in_pl[a].size())));
      sofar.resize(static_cast<std::size_t>(n), kR);
      seen_in.push_back(shape_after(mesh, sofar, node.inputs()[a]->meta().shape, zero, i));
    }
    for (std::size_t a = 0; a < node.outputs().size(); ++a) {
      Placements sofar(out_pl[a].begin(), out_pl[a].begin() + std::min<std::ptrdiff_t>(i, static_cast<std::ptrdiff_t>(out_pl[a].size())));
      sofar.resize(static_cast<std::size_t>(n), kR);
      seen_out.push_back(shape_after(mesh, sofar, node.outputs()[a]->meta().shape, zero, i));
    }
    auto candidates = op_strategies(node, seen_in, seen_out, mesh.size(i));
    if ((node.op() == "expert_dispatch" || node.op() == "expert_combine") && node.attr_string("expert_dim") == mesh.dims()[static_cast<std::size_t>(i)].name) {
      // Expert parallelism: each rank its block, the rows exchanged (rank_graph's all_to_all_v).
      candidates = {{{Placement::shard(0), Placement::shard(0)}, {Placement::shard(0)}}};
    }
    if (i == query_rows_dim && (node.op() == "sdpa" || node.op() == "sdpa_backward")) {
      const std::size_t q = node.op() == "sdpa" ? 0 : 1;
      std::vector<OpStrategy> rows;
      for (const auto& c : candidates) {
        if (c.inputs[q] == Placement::shard(2) && c.inputs[q + 1].is_replicate()) rows.push_back(c);
      }
      if (!rows.empty()) candidates = std::move(rows);
    }
    return candidates;
  }

  // Per mesh dim, the strategy of the node's rule table with the least cost (or the one a
  // planner chose); then its inputs' redistributions and its outputs' placements.
  void place(const ir::Node& node) {
    const std::size_t n_in = node.inputs().size(), n_out = node.outputs().size();
    std::vector<Placements> in_pl(n_in), out_pl(n_out);
    for (int i = 0; i < n; ++i) {
      std::vector<Shape> seen_in, seen_out;
      const auto candidates = candidates_of(node, i, in_pl, out_pl, seen_in, seen_out);
      const bool addend = std::any_of(node.outputs().begin(), node.outputs().end(), [&](const ir::Value* o) { return accumulating.count(o) > 0; });
      double best_cost = -1, best_moves = 0;
      const OpStrategy* best = nullptr;
      if (const std::string* want = forced_choice(node, i)) {
        for (const auto& c : candidates) {
          if (signature(c) == *want && cost(node, i, c, in_pl, seen_in, seen_out) < 1e29) best = &c;
        }
      }
      if (best == nullptr) {  // no choice of the planner's to take: greedy
        for (const auto& c : candidates) {
          const double cost_c = cost(node, i, c, in_pl, seen_in, seen_out);
          const double moves = addend ? cost(node, i, c, in_pl, seen_in, seen_out, true) : 0;
          if (best == nullptr || moves < best_moves || (moves == best_moves && cost_c < best_cost)) best = &c, best_cost = cost_c, best_moves = moves;
        }
      }
      for (std::size_t a = 0; a < n_in; ++a) in_pl[a].push_back(best->inputs[a]);
      for (std::size_t a = 0; a < n_out; ++a) out_pl[a].push_back(best->outputs[a]);
    }
    reading = &node;
    for (std::size_t a = 0; a < n_in; ++a) make(node.inputs()[a], in_pl[a]);
    for (std::size_t a = 0; a < n_out; ++a) {
      plan.placement[node.outputs()[a]] = out_pl[a];
      if (auto h = hint.find(node.outputs()[a]); h != hint.end()) make(node.outputs()[a], h->second);
      Placements want = out_pl[a];
      for (const auto& [dim, values] : sequence_sharded) {
        if (const auto it = values.find(node.outputs()[a]); it != values.end()) want[static_cast<std::size_t>(dim)] = it->second;
      }
      if (want != out_pl[a]) make(node.outputs()[a], want);
    }
    plan.inputs[&node] = std::move(in_pl);
  }

  // Seconds to take a value of `bytes` (as mesh dim i sees it) from `current` to `target` on
  // mesh dim i over `link`: the ring's messages and bytes (redistribute_plan's counts), plus
  // `fixed` (a collective's cost beyond them) when anything moves.
  double move_seconds(const Placements& current, const Placements& target, int i, double bytes, const CostModel& link, double fixed) const {
    const double moved = step_bytes(current, target, i, bytes);
    if (moved <= 0) return 0;
    const Placement& from = current[static_cast<std::size_t>(i)];
    const Placement& to = target[static_cast<std::size_t>(i)];
    const double messages = static_cast<double>(mesh.size(i) - 1) * (from.is_partial() && !to.is_shard() ? 2 : 1);
    return fixed + messages * link.alpha + moved / link.beta;
  }

  // Mesh dim i's choice problem over the plan as propagated (the other dims as they are):
  // every node's candidates (place()'s; the graph's nodes first, in order, then one a value read by several), each priced by its share of the node's work and
  // what its graph-input reads and pinned outputs cost; every edge by the move of the value
  // between the producer's candidate and the consumer's. `start`: the plan's own choices.
  spmdx::PlannerProblem problem(int i, const IntraOpCostModel& model, std::vector<std::vector<OpStrategy>>& candidates) const {
    const CostModel link = static_cast<std::size_t>(i) < model.links.size() ? model.links[static_cast<std::size_t>(i)] : CostModel{};
    spmdx::PlannerProblem out;
    out.mesh_dim = mesh.dims().at(static_cast<std::size_t>(i)).name;
    out.ranks = mesh.size(i);
    const double forbidden = out.forbidden;
    std::map<const ir::Node*, std::int32_t> index;
    for (const auto& node : graph.nodes()) index.emplace(node.get(), static_cast<std::int32_t>(index.size()));
    candidates.assign(index.size(), {});
    out.node_cost.assign(index.size(), {});
    out.start.assign(index.size(), 0);
    // What a value placed `pl` weighs as mesh dim i sees it (the other dims' shards applied).
    auto seen_bytes = [&](const ir::Value* v, const Placements& pl) {
      Placements others = pl;
      others[static_cast<std::size_t>(i)] = kR;
      return bytes_of(v, shape_after(mesh, others, v->meta().shape, zero, n));
    };
    for (const auto& node_ptr : graph.nodes()) {
      const ir::Node& node = *node_ptr;
      const std::int32_t v = index.at(&node);
      const auto& in_pl = plan.inputs.at(&node);
      std::vector<Placements> out_pl;
      for (const ir::Value* o : node.outputs()) out_pl.push_back(plan.placement.at(o));
      std::vector<Shape> seen_in, seen_out;
      auto& cands = candidates[static_cast<std::size_t>(v)];
      cands = candidates_of(node, i, in_pl, out_pl, seen_in, seen_out);
      // The node's work on this rank before dim i splits it, divided by the other dims it is split on.
      double work = node_seconds(node, model.flops_per_second, model.bytes_per_second);
      for (int j = 0; j < n; ++j) {
        if (j == i) continue;
        const bool split = std::any_of(out_pl.begin(), out_pl.end(), [&](const Placements& pl) { return !pl[static_cast<std::size_t>(j)].is_replicate(); });
        if (split) work /= static_cast<double>(mesh.size(j));
      }
      const bool state_reader = node.op() == "adamw" || node.op() == "cast";
      for (std::size_t s = 0; s < cands.size(); ++s) {
        const OpStrategy& c = cands[s];
        const bool splits = std::any_of(c.outputs.begin(), c.outputs.end(), [](const Placement& p) { return !p.is_replicate(); });
        double cost_s = splits ? work / static_cast<double>(mesh.size(i)) : work;
        std::set<std::pair<const ir::Value*, std::string>> counted;
        for (std::size_t a = 0; a < node.inputs().size(); ++a) {
          const ir::Value* u = node.inputs()[a];
          if (!counted.insert({u, c.inputs[a].str()}).second) continue;
          if (auto w = use_of.find(u); w != use_of.end() && c.inputs[a] != w->second[static_cast<std::size_t>(i)] &&
                                         !(state_reader && c.inputs[a] == plan.placement.at(u)[static_cast<std::size_t>(i)])) {
            cost_s += forbidden;
            continue;
          }
          if (u->producer() != nullptr) continue;  // an edge
          Placements target = in_pl[a];
          target[static_cast<std::size_t>(i)] = c.inputs[a];
          const Placements& current = plan.placement.at(u);
          if (target == current || made.count({u, plan.version_key(u, target, &node)}) > 0) continue;
          cost_s += move_seconds(current, target, i, seen_bytes(u, current), link, model.collective_seconds);
        }
        for (std::size_t a = 0; a < node.outputs().size(); ++a) {
          const ir::Value* o = node.outputs()[a];
          Placements made_as = out_pl[a];
          made_as[static_cast<std::size_t>(i)] = c.outputs[a];
          const double b = seen_bytes(o, made_as);
          auto to = [&](const Placement& want) {
            Placements target = made_as;
            target[static_cast<std::size_t>(i)] = want;
            return move_seconds(made_as, target, i, b, link, model.collective_seconds);
          };
          if (auto d = demand.find(o); d != demand.end()) cost_s += to(d->second[static_cast<std::size_t>(i)]);
          for (const auto& [dim, values] : sequence_sharded) {
            if (const auto it = values.find(o); dim == i && it != values.end()) cost_s += to(it->second);
          }
        }
        out.node_cost[static_cast<std::size_t>(v)].push_back(cost_s);
        bool as_planned = true;
        for (std::size_t a = 0; a < node.inputs().size(); ++a) as_planned = as_planned && c.inputs[a] == in_pl[a][static_cast<std::size_t>(i)];
        for (std::size_t a = 0; a < node.outputs().size(); ++a) as_planned = as_planned && c.outputs[a] == out_pl[a][static_cast<std::size_t>(i)];
        if (as_planned) out.start[static_cast<std::size_t>(v)] = static_cast<std::int32_t>(s);
      }
    }
    // Edges: each input of a node that another node produced. A value read by several nodes
    // goes through a node of its own (Alpa's trick for fan-out): its candidates are the
    // placements its readers may want on this dim, the producer's edge pays for making it there
    // once, and each reader pays only for moving it on from there (nothing where it reads that
    // placement), as propagation makes a redistribution once and reuses it.
    struct Read {
      const ir::Node* node;
      std::size_t operand;
    };
    std::map<const ir::Value*, std::vector<Read>> readers;
    for (const auto& node_ptr : graph.nodes()) {
      for (std::size_t a = 0; a < node_ptr->inputs().size(); ++a) {
        const ir::Value* u = node_ptr->inputs()[a];
        if (u->producer() != nullptr) readers[u].push_back({node_ptr.get(), a});
      }
    }
    for (const auto& [u, reads] : readers) {
      const ir::Node& producer = *u->producer();
      const std::int32_t from = index.at(&producer);
      std::size_t j = 0;
      while (producer.outputs()[j] != u) ++j;
      const auto& from_cands = candidates[static_cast<std::size_t>(from)];
      const Placements& stored = plan.placement.at(u);
      const double b = seen_bytes(u, stored);
      auto made_as = [&](const Placements& others, const Placement& p) {
        Placements pl = others;
        pl[static_cast<std::size_t>(i)] = p;
        return pl;
      };
      // One reader's edge from candidates `from_pl` (a placement per candidate of the node at
      // `from_index`) to its own candidates.
      auto edge = [&](std::int32_t from_index, const std::vector<Placement>& from_pl, const Placements& others, const Read& r, bool in_place_ok,
                      const Placements* made_already = nullptr) {
        const std::int32_t to = index.at(r.node);
        const auto& to_cands = candidates[static_cast<std::size_t>(to)];
        const Placements& want = plan.inputs.at(r.node)[r.operand];
        std::size_t first = 0;  // the node's first operand that is this value
        while (r.node->inputs()[first] != u) ++first;
        spmdx::PlannerProblem::Edge e{from_index, to, std::vector<double>(from_pl.size() * to_cands.size(), 0.0)};
        bool any = false;
        for (std::size_t x = 0; x < from_pl.size(); ++x) {
          const Placements current = made_as(others, from_pl[x]);
          for (std::size_t y = 0; y < to_cands.size(); ++y) {
            if (first < r.operand && to_cands[y].inputs[first] == to_cands[y].inputs[r.operand]) continue;  // read twice alike: moved once
            const Placements target = made_as(want, to_cands[y].inputs[r.operand]);
            double c = 0;
            if (made_already != nullptr && target == *made_already) continue;
            if (current != target) c = !in_place_ok && in_place.count(r.node) > 0 ? forbidden : move_seconds(current, target, i, b, link, model.collective_seconds);
            e.cost[x * to_cands.size() + y] = c;
            any = any || c > 0;
          }
        }
        if (any) out.edges.push_back(std::move(e));
      };
      std::vector<Placement> produced;
      for (const auto& c : from_cands) produced.push_back(c.outputs[j]);
      // A value propagation makes in a placement as soon as it exists (a gradient in its
      // parameter's: hint) goes through a node of that one candidate: its readers find it made.
      const auto h = hint.find(u);
      if (reads.size() < 2 && h == hint.end()) {
        edge(from, produced, stored, reads.front(), false);
        continue;
      }
      std::vector<Placement> wanted;  // the fan-out node's candidates
      if (h != hint.end()) {
        wanted.push_back(h->second[static_cast<std::size_t>(i)]);
      } else {
        for (const Read& r : reads) {
          for (const auto& c : candidates[static_cast<std::size_t>(index.at(r.node))]) {
            if (std::find(wanted.begin(), wanted.end(), c.inputs[r.operand]) == wanted.end()) wanted.push_back(c.inputs[r.operand]);
          }
        }
      }
      const auto fan = static_cast<std::int32_t>(out.node_cost.size());
      out.node_cost.emplace_back(wanted.size(), 0.0);
      const Placement first = h != hint.end() ? wanted.front() : plan.inputs.at(reads.front().node)[reads.front().operand][static_cast<std::size_t>(i)];
      out.start.push_back(static_cast<std::int32_t>(std::find(wanted.begin(), wanted.end(), first) - wanted.begin()));
      const Placements others = h != hint.end() ? h->second : plan.inputs.at(reads.front().node)[reads.front().operand];
      spmdx::PlannerProblem::Edge make{from, fan, std::vector<double>(produced.size() * wanted.size(), 0.0)};
      for (std::size_t x = 0; x < produced.size(); ++x) {
        for (std::size_t t = 0; t < wanted.size(); ++t) {
          const Placements current = made_as(stored, produced[x]), target = made_as(others, wanted[t]);
          make.cost[x * wanted.size() + t] = current == target ? 0 : move_seconds(current, target, i, b, link, model.collective_seconds);
        }
      }
      out.edges.push_back(std::move(make));
      for (const Read& r : reads) {
        // Made in its hint: free to read so, else moved from where it was produced (the
        // rewriter redistributes from the producer's placement).
        if (h != hint.end()) edge(from, produced, stored, r, false, &h->second);
        else if (in_place.count(r.node) > 0) edge(from, produced, stored, r, false);  // reads it as produced, or not at all
        else edge(fan, wanted, others, r, true);
      }
    }
    return out;
  }
};

}  // namespace

std::string signature(const OpStrategy& strategy) {
  std::string out;
  for (const auto& p : strategy.inputs) out += (out.empty() ? "" : ",") + p.str();
  out += "->";
  for (std::size_t a = 0; a < strategy.outputs.size(); ++a) out += (a ? "," : "") + strategy.outputs[a].str();
  return out;
}

std::string taken_signature(const DistributedPlan& plan, const ir::Node& node, int mesh_dim) {
  OpStrategy took;
  for (const auto& pl : plan.inputs.at(&node)) took.inputs.push_back(pl[static_cast<std::size_t>(mesh_dim)]);
  for (const ir::Value* o : node.outputs()) took.outputs.push_back(plan.placement.at(o)[static_cast<std::size_t>(mesh_dim)]);
  return signature(took);
}

namespace {

// propagate() with the planner's choices `forced` (may be null); `after` sees the propagator
// once every node is placed (propagate_optimal builds its problems there).
DistributedPlan run_propagation(const ir::Graph& graph, const DeviceMesh& mesh, const std::map<std::string, Placements>& inputs,
                                const std::map<std::string, Placements>& outputs, const std::map<std::string, Placements>& use,
                                bool reshard_after_forward, int sequence_parallel_dim, int context_parallel_dim, bool context_parallel_allgather,
                                const ForcedChoices* forced, const std::function<void(const Propagator&)>& after, int fault_domain_dim = -1) {
  DistributedPlan plan{mesh, &graph, {}, {}, {}, 0, 0, std::vector<double>(static_cast<std::size_t>(mesh.ndim()), 0.0),
                       std::vector<double>(static_cast<std::size_t>(mesh.ndim()), 0.0), {}, {}};
  if (reshard_after_forward) {
    if (const ir::Value* loss = graph.find_output("loss"); loss != nullptr && loss->producer() != nullptr) {
      plan.reshard_after = reshard_points(graph, loss);
      for (const auto& [name, pl] : use) {
        if (const ir::Value* v = graph.find_input(name)) plan.resharded.insert(v);
      }
    }
  }
  const int n = mesh.ndim();
  const Placements all_r(static_cast<std::size_t>(n), kR);
  for (const auto& [name, pl] : inputs) {
    if (graph.find_input(name) == nullptr) throw std::invalid_argument("placement given for '" + name + "', which is not a graph input");
    if (static_cast<int>(pl.size()) != n) {
      throw std::invalid_argument("input '" + name + "' has " + std::to_string(pl.size()) + " placements for a mesh of " +
                                  std::to_string(n) + " dims (" + mesh.str() + ")");
    }
  }
  for (const ir::Value* v : graph.inputs()) {
    auto it = inputs.find(v->name());
    plan.placement[v] = it == inputs.end() ? all_r : it->second;
  }
  if (sequence_parallel_dim >= mesh.ndim()) {
    throw std::invalid_argument("sequence parallelism on mesh dim " + std::to_string(sequence_parallel_dim) + ", which the mesh " + mesh.str() + " has not");
  }
  if (context_parallel_dim >= mesh.ndim()) {
    throw std::invalid_argument("context parallelism on mesh dim " + std::to_string(context_parallel_dim) + ", which the mesh " + mesh.str() + " has not");
  }
  Propagator p(graph, mesh, plan);
  p.forced = forced;
  p.fault_domain_dim = fault_domain_dim;
  auto on_sequence = [](const std::set<const ir::Value*>& values) {
    std::map<const ir::Value*, Placement> out;
    for (const ir::Value* v : values) out.emplace(v, Placement::shard(1));
    return out;
  };
  if (sequence_parallel_dim >= 0 && mesh.size(sequence_parallel_dim) > 1) {
    p.sequence_sharded.emplace_back(sequence_parallel_dim, on_sequence(sequence_parallel_values(graph, mesh.size(sequence_parallel_dim))));
  }
  if (context_parallel_dim >= 0 && mesh.size(context_parallel_dim) > 1) {
    // The embeddings on the sequence, and the rotary tables [seq, d] on their rows: split once
    // as made, they are free to read in every layer (split at each read, a table's split
    // looked dearer than moving the layer's q and k to a batch split).
    const std::set<const ir::Value*> embeddings = context_parallel_values(graph, mesh.size(context_parallel_dim));
    auto pinned = on_sequence(embeddings);
    for (const auto& node : graph.nodes()) {
      if (node->op() != "rotary_embedding") continue;
      for (int t : {1, 2}) {
        if (node->input(t)->meta().shape.at(0) >= mesh.size(context_parallel_dim)) pinned.emplace(node->input(t), Placement::shard(0));
      }
    }
    p.sequence_sharded.emplace_back(context_parallel_dim, std::move(pinned));
    if (context_parallel_allgather) p.query_rows_dim = context_parallel_dim;
    if (!embeddings.empty()) p.sequence_dim = context_parallel_dim, p.sequence_length = (*embeddings.begin())->meta().shape[1];
  }
  p.find_hints(use);
  for (const auto& [dim, values] : p.sequence_sharded) {  // pinned graph inputs (a rotary table with no seq_permute) are split at once
    for (const auto& [v, pl] : values) {
      if (v->producer() != nullptr) continue;
      Placements want = plan.placement.at(v);
      want[static_cast<std::size_t>(dim)] = pl;
      p.make(v, want);
    }
  }
  for (const auto& [name, pl] : outputs) {
    if (const ir::Value* v = graph.find_output(name)) p.demand.emplace(v, pl);
  }
  for (const auto& node : graph.nodes()) p.place(*node);
  for (const auto& [name, pl] : outputs) {
    if (graph.find_output(name) == nullptr) throw std::invalid_argument("placement required for '" + name + "', which is not a graph output");
    if (static_cast<int>(pl.size()) != n) throw std::invalid_argument("output '" + name + "' needs one placement per mesh dim");
  }
  p.reading = nullptr;
  for (const auto& [name, v] : graph.outputs()) {
    auto it = outputs.find(name);
    Placements want = plan.placement.at(v);
    if (it != outputs.end()) {
      want = it->second;
    } else {
      for (auto& pl : want) {
        if (pl.is_partial()) pl = kR;
      }
    }
    p.make(v, want);
    plan.outputs[name] = want;
  }
  if (after) after(p);
  return plan;
}

}  // namespace

DistributedPlan propagate(const ir::Graph& graph, const DeviceMesh& mesh, const std::map<std::string, Placements>& inputs,
                          const std::map<std::string, Placements>& outputs, const std::map<std::string, Placements>& use,
                          bool reshard_after_forward, int sequence_parallel_dim, int context_parallel_dim, bool context_parallel_allgather,
                          const ForcedChoices* forced, int fault_domain_dim) {
  return run_propagation(graph, mesh, inputs, outputs, use, reshard_after_forward, sequence_parallel_dim, context_parallel_dim,
                         context_parallel_allgather, forced, {}, fault_domain_dim);
}

DistributedPlan propagate_optimal(const ir::Graph& graph, const DeviceMesh& mesh, const std::map<std::string, Placements>& inputs,
                                  const std::map<std::string, Placements>& outputs, const std::map<std::string, Placements>& use,
                                  bool reshard_after_forward, int sequence_parallel_dim, int context_parallel_dim, bool context_parallel_allgather,
                                  const spmdx::Planner& planner, const IntraOpCostModel& cost, std::vector<IntraOpDim>* report) {
  ForcedChoices forced;
  auto again = [&](const std::function<void(const Propagator&)>& after) {
    return run_propagation(graph, mesh, inputs, outputs, use, reshard_after_forward, sequence_parallel_dim, context_parallel_dim,
                           context_parallel_allgather, &forced, after);
  };
  DistributedPlan plan = again({});
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < mesh.ndim(); ++i) {
    if (mesh.size(i) < 2) continue;
    const double left = cost.time_limit_seconds - std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (left <= 0) break;  // the later dims keep propagation's choices
    std::vector<std::vector<OpStrategy>> candidates;
    spmdx::PlannerProblem problem;
    std::vector<const ir::Node*> nodes;
    again([&](const Propagator& p) {
      problem = p.problem(i, cost, candidates);
      for (const auto& node : graph.nodes()) nodes.push_back(node.get());
    });
    problem.time_limit_seconds = left;
    const spmdx::PlannerSolution solution = planner.solve(problem);
    if (solution.choice.size() != problem.node_cost.size()) {
      throw std::invalid_argument("the planner returned " + std::to_string(solution.choice.size()) + " choices for mesh dim " + problem.mesh_dim +
                                  "'s " + std::to_string(problem.node_cost.size()) + " nodes");
    }
    IntraOpDim dim{problem.mesh_dim, spmdx::planner_cost(problem, problem.start), solution.objective, solution.bound, solution.optimal,
                   solution.seconds, 0, 0, solution.solver};
    for (std::size_t v = 0; v < nodes.size(); ++v) {
      const auto c = static_cast<std::size_t>(solution.choice[v]);
      if (c >= candidates[v].size()) throw std::invalid_argument("the planner chose candidate " + std::to_string(c) + " of " + std::to_string(candidates[v].size()) + " for a node");
      if (solution.choice[v] != problem.start[v]) ++dim.changed;
      forced[nodes[v]][i] = signature(candidates[v][c]);
    }
    plan = again({});
    for (const ir::Node* node : nodes) {  // what the propagation took
      if (taken_signature(plan, *node, i) == forced[node][i]) ++dim.forced_kept;
    }
    if (report != nullptr) report->push_back(std::move(dim));
  }
  return plan;
}

namespace {

// Which of a plan's per-operand redistributions run, as rank_graph (rewriter.cpp) makes them: a
// value's version in given placements (version_key) is made once and reused by every later
// reader, also a version passed on the way to another (`mul(%x, %x)` reading %x Replicate
// twice all_reduces it once). first() is true for the reads that make one.
class MadeOnce {
 public:
  explicit MadeOnce(const DistributedPlan& plan) : plan_(plan) {
    for (const ir::Value* v : plan.graph->inputs()) have(v, plan.placement.at(v));
  }
  bool first(const ir::Value* v, const Placements& want, const ir::Node* reader) {
    if (made_.count({v, plan_.version_key(v, want, reader)}) != 0) return false;
    Placements state = plan_.placement.at(v);
    for (const auto& step : redistribute_plan(plan_.mesh, v->meta(), state, want)) {
      state[static_cast<std::size_t>(step.mesh_dim)] = step.to;
      made_.insert({v, plan_.version_key(v, state, reader)});
    }
    return true;
  }
  void outputs_of(const ir::Node& node) {
    for (const ir::Value* o : node.outputs()) have(o, plan_.placement.at(o));
  }

 private:
  void have(const ir::Value* v, const Placements& pl) {
    made_.insert({v, plan_.version_key(v, pl, nullptr)});
    for (const auto& key : plan_.resharded_keys(pl)) made_.insert({v, key});
  }
  const DistributedPlan& plan_;
  std::set<std::pair<const ir::Value*, std::string>> made_;
};

}  // namespace

std::string DistributedPlan::str() const {
  MadeOnce runs(*this);
  std::ostringstream out;
  out << "mesh " << mesh.str() << "; " << static_cast<std::int64_t>(comm_bytes) << " bytes sent per rank per run, about "
      << comm_seconds * 1e3 << " ms of communication (alpha-beta estimate)\n";
  for (const ir::Value* v : graph->inputs()) out << "  input " << v->ref() << ": " << to_string(placement.at(v)) << " " << v->meta().str() << "\n";
  for (const auto& node : graph->nodes()) {
    const auto& in = inputs.at(node.get());
    for (std::size_t a = 0; a < in.size(); ++a) {
      const ir::Value* v = node->inputs()[a];
      if (in[a] != placement.at(v) && runs.first(v, in[a], node.get())) {  // what runs: one line per redistribution the ranks make
        out << "  redistribute " << v->ref() << " " << to_string(placement.at(v)) << " -> " << to_string(in[a]) << ": "
            << to_string(redistribute_plan(mesh, v->meta(), placement.at(v), in[a])) << "\n";
      }
    }
    runs.outputs_of(*node);
    out << "  ";
    for (std::size_t a = 0; a < node->outputs().size(); ++a) {
      out << (a ? ", " : "") << node->outputs()[a]->ref() << ": " << to_string(placement.at(node->outputs()[a]));
    }
    out << " = " << node->op() << "(";
    for (std::size_t a = 0; a < in.size(); ++a) out << (a ? ", " : "") << node->inputs()[a]->ref() << ": " << to_string(in[a]);
    out << ")\n";
  }
  for (const auto& [name, v] : graph->outputs()) out << "  output " << name << ": " << to_string(outputs.at(name)) << "\n";
  return out.str();
}

std::string DistributedPlan::to_json() const {
  using nlohmann::json;
  json j;
  j["mesh"] = json::array();
  for (const auto& d : mesh.dims()) j["mesh"].push_back({{"name", d.name}, {"size", d.size}});
  j["comm_bytes"] = comm_bytes;
  j["comm_seconds"] = comm_seconds;
  j["comm_bytes_by_dim"] = json::object();
  for (std::size_t d = 0; d < comm_bytes_by_dim.size(); ++d) j["comm_bytes_by_dim"][mesh.dims().at(d).name] = comm_bytes_by_dim[d];
  j["inputs"] = json::object();
  for (const ir::Value* v : graph->inputs()) j["inputs"][v->name()] = to_string(placement.at(v));
  j["nodes"] = json::array();
  j["redistributions"] = json::array();
  MadeOnce runs(*this);
  for (const auto& node : graph->nodes()) {
    json n{{"id", node->id()}, {"op", node->op()}, {"inputs", json::array()}, {"outputs", json::array()}};
    const auto& in = inputs.at(node.get());
    for (std::size_t a = 0; a < in.size(); ++a) {
      n["inputs"].push_back(to_string(in[a]));
      const ir::Value* v = node->inputs()[a];
      if (in[a] == placement.at(v)) continue;
      json r{{"value", v->ref()}, {"node", node->id()}, {"from", to_string(placement.at(v))}, {"to", to_string(in[a])},
             {"runs", runs.first(v, in[a], node.get())}, {"steps", json::array()}};
      for (const auto& step : redistribute_plan(mesh, v->meta(), placement.at(v), in[a])) {
        r["steps"].push_back({{"mesh_dim", step.mesh_dim}, {"op", step.op}, {"from", step.from.str()}, {"to", step.to.str()},
                              {"bytes", step.bytes}, {"seconds", step.seconds}});
      }
      j["redistributions"].push_back(std::move(r));
    }
    runs.outputs_of(*node);
    for (const ir::Value* o : node->outputs()) n["outputs"].push_back(to_string(placement.at(o)));
    j["nodes"].push_back(std::move(n));
  }
  j["outputs"] = json::object();
  for (const auto& [name, pl] : outputs) j["outputs"][name] = to_string(pl);
  return j.dump(1);
}

}  // namespace spmdx::sharding
