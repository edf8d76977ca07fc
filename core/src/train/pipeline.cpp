#include "spmdx/train/pipeline.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <map>
#include <queue>
#include <set>
#include <stdexcept>
#include <tuple>
#include <unordered_map>

#include "spmdx/models/model.h"
#include "spmdx/train/train_step.h"

namespace spmdx::train {

using ir::Node;
using ir::Value;

int PipelineSpec::chunk_of_layer(std::int64_t layer) const {
  const auto it = std::upper_bound(first_layer.begin(), first_layer.end(), layer);
  return static_cast<int>(std::max<std::ptrdiff_t>(0, (it - first_layer.begin()) - 1));
}

std::int64_t layer_of(const std::string& name) {
  const std::string prefix = models::layer_of(name);  // "layers.3", "model.layers.3", "transformer.h.3"; "tok_embeddings"
  const std::string last = prefix.substr(prefix.rfind('.') == std::string::npos ? 0 : prefix.rfind('.') + 1);
  if (last.empty() || last.size() > 9 || last.find_first_not_of("0123456789") != std::string::npos) return -1;
  return std::stoll(last);
}

std::vector<std::vector<PipelineAction>> pipeline_schedule(const PipelineSpec& spec) {
  const std::int64_t p = spec.stages, m = spec.microbatches, v = spec.virtual_stages;
  std::vector<std::vector<PipelineAction>> out(static_cast<std::size_t>(p));
  for (std::int64_t s = 0; s < p; ++s) {
    auto& a = out[static_cast<std::size_t>(s)];
    if (spec.schedule == "GPipe") {
      for (std::int64_t k = 0; k < m; ++k) a.push_back({true, k, s});
      for (std::int64_t k = 0; k < m; ++k) a.push_back({false, k, s});
      continue;
    }
    if (v > 1) {  // Interleaved1F1B (Narayanan et al. 2021, Megatron-LM's interleaved schedule)
      // The k-th forward: microbatches in groups of p, each group through chunk 0, 1, ... of
      // this rank (chunk s, s + p, ...); backwards the same with the chunks reversed.
      auto nth = [&](std::int64_t k, bool forward) {
        const std::int64_t within = k % (p * v), local = within / p;
        return PipelineAction{forward, (k / (p * v)) * p + within % p, (forward ? local : v - 1 - local) * p + s};
      };
      const std::int64_t total = m * v;
      const std::int64_t warmup = std::min((p - s - 1) * 2 + (v - 1) * p, total);
      for (std::int64_t k = 0; k < warmup; ++k) a.push_back(nth(k, true));
      for (std::int64_t k = warmup; k < total; ++k) a.push_back(nth(k, true)), a.push_back(nth(k - warmup, false));
      for (std::int64_t k = total - warmup; k < total; ++k) a.push_back(nth(k, false));
      continue;
    }
    const std::int64_t warmup = std::min(p - 1 - s, m);
    for (std::int64_t k = 0; k < warmup; ++k) a.push_back({true, k, s});
    for (std::int64_t k = warmup; k < m; ++k) a.push_back({true, k, s}), a.push_back({false, k - warmup, s});
    for (std::int64_t k = m - warmup; k < m; ++k) a.push_back({false, k, s});
  }
  return out;
}

double bubble_fraction(const PipelineSpec& spec) {
  return static_cast<double>(spec.stages - 1) / static_cast<double>(spec.virtual_stages * spec.microbatches + spec.stages - 1);
}

std::string stage_layers(const PipelineSpec& spec, std::int64_t stage) {
  std::string out;
  for (std::int64_t c = stage; c < spec.chunks(); c += spec.stages) {
    const std::int64_t first = spec.first_layer.at(static_cast<std::size_t>(c));
    const std::int64_t end = c + 1 < spec.chunks() ? spec.first_layer.at(static_cast<std::size_t>(c + 1)) : -1;
    out += (out.empty() ? "" : ", ") + (end < 0 ? "layers " + std::to_string(first) + " on"
                                        : end - 1 == first ? "layer " + std::to_string(first)
                                                           : "layers " + std::to_string(first) + " to " + std::to_string(end - 1));
  }
  return out;
}

std::string schedule_table(const PipelineSpec& spec, std::int64_t stage) {
  const auto actions = pipeline_schedule(spec);
  const std::size_t p = actions.size();
  const auto chunks = static_cast<std::size_t>(spec.chunks()), m = static_cast<std::size_t>(spec.microbatches);
  // When each action ends: a forward needs the previous chunk's forward of its microbatch, a
  // backward the next chunk's backward and its own forward; a stage runs its actions in order.
  std::vector<std::vector<std::int64_t>> f_end(chunks, std::vector<std::int64_t>(m, -1)), b_end = f_end;
  std::vector<std::vector<std::pair<std::int64_t, std::int64_t>>> spans(p);  // per stage, per action: [start, end)
  std::vector<std::size_t> next(p, 0);
  std::vector<std::int64_t> clock(p, 0);
  for (bool progressed = true; progressed;) {
    progressed = false;
    for (std::size_t s = 0; s < p; ++s) {
      while (next[s] < actions[s].size()) {
        const PipelineAction a = actions[s][next[s]];
        const auto k = static_cast<std::size_t>(a.microbatch), c = static_cast<std::size_t>(a.chunk);
        std::int64_t ready = clock[s];
        if (a.forward && c > 0) {
          if (f_end[c - 1][k] < 0) break;
          ready = std::max(ready, f_end[c - 1][k]);
        }
        if (!a.forward && c + 1 < chunks) {
          if (b_end[c + 1][k] < 0) break;
          ready = std::max(ready, b_end[c + 1][k]);
        }
        const std::int64_t end = ready + (a.forward ? 1 : 2);
        (a.forward ? f_end : b_end)[c][k] = end;
        spans[s].emplace_back(ready, end);
        clock[s] = end;
        ++next[s];
        progressed = true;
      }
    }
  }
  const std::int64_t total = *std::max_element(clock.begin(), clock.end());
  const bool virtual_stages = spec.virtual_stages > 1;
  auto label = [&](const PipelineAction& a) {  // "F3"; with virtual stages "F3.1": microbatch 3 on the stage's chunk 1
    return (a.forward ? "F" : "B") + std::to_string(a.microbatch) + (virtual_stages ? "." + std::to_string(a.chunk / spec.stages) : std::string());
  };
  std::string out = "# pipeline schedule " + spec.schedule + ": " + std::to_string(spec.stages) + " stages" +
                    (virtual_stages ? " of " + std::to_string(spec.virtual_stages) + " chunks each" : std::string()) + ", " + std::to_string(spec.microbatches) +
                    " microbatches; a forward (F<microbatch>" + (virtual_stages ? ".<chunk>, the stage's chunk 0, 1, ... (stage s's chunk i holds model chunk i x stages + s)" : "") +
                    ") takes 1 tick, a backward (B...) 2; '.' is idle\n";
  char buf[200];
  std::snprintf(buf, sizeof buf, "# theoretical bubble (stages - 1) / (%smicrobatches + stages - 1) = %.3f; %lld ticks\n", virtual_stages ? "chunks x " : "",
                bubble_fraction(spec), static_cast<long long>(total));
  out += buf;
  out += "# this rank runs stage " + std::to_string(stage) + " (marked *)\n";
  const std::size_t width = virtual_stages ? 6 : 3;
  for (std::size_t s = 0; s < p; ++s) {
    std::vector<std::string> cells(static_cast<std::size_t>(total), ".");
    std::int64_t busy = 0;
    for (std::size_t i = 0; i < spans[s].size(); ++i) {
      const auto [a, b] = spans[s][i];
      busy += b - a;
      for (std::int64_t t = a; t < b; ++t) cells[static_cast<std::size_t>(t)] = label(actions[s][i]);
    }
    std::snprintf(buf, sizeof buf, "%sstage %zu (idle %.3f) |", static_cast<std::int64_t>(s) == stage ? "*" : " ", s,
                  total > 0 ? static_cast<double>(total - busy) / static_cast<double>(total) : 0.0);
    out += buf;
    for (const auto& c : cells) out += " " + c + std::string(c.size() < width ? width - c.size() : 0, ' ');
    while (out.back() == ' ') out.pop_back();
    out += "\n";
  }
  out += "# order of stage " + std::to_string(stage) + ":";
  for (const auto& a : actions[static_cast<std::size_t>(stage)]) out += " " + label(a);
  return out + "\n";
}

namespace {

// The parameter a graph input belongs to: itself, or P for "exp_avg.P" / "exp_avg_sq.P"; "" for
// other inputs.
std::string owner_of(const std::string& name, const std::set<std::string>& params) {
  if (params.count(name) > 0) return name;
  for (const char* prefix : {"exp_avg.", "exp_avg_sq."}) {
    const std::string p = prefix;
    if (name.compare(0, p.size(), p) == 0 && params.count(name.substr(p.size())) > 0) return name.substr(p.size());
  }
  return "";
}

// The microbatch of a batch input: K of "tokens.K", 0 of "tokens"; -1 for other names.
std::int64_t microbatch_of(const std::string& name) {
  if (!is_batch_input(name)) return -1;
  const auto dot = name.find('.');
  return dot == std::string::npos ? 0 : std::stoll(name.substr(dot + 1));
}

// The stage of each graph input that is a parameter or its AdamW state: its layer's; outside the
// layers, stage 0 when the forward reads it before any layer's parameter, else the last stage.
std::unordered_map<const Value*, int> input_stages(const ir::Graph& graph, const PipelineSpec& spec, const std::vector<std::string>& params) {
  const int last = static_cast<int>(spec.chunks()) - 1;
  const std::set<std::string> param_set(params.begin(), params.end());
  const Value* loss = graph.find_output("loss");
  if (loss == nullptr) throw std::invalid_argument("pipeline stages: the train step has no output 'loss'");
  const std::set<const Node*> forward = ir::producers_of(loss);
  std::map<std::string, int> stage_of;
  for (const auto& p : params) {
    if (const auto layer = layer_of(p); layer >= 0) stage_of[p] = spec.chunk_of_layer(layer);
  }
  bool layer_read = false;
  for (const auto& n : graph.nodes()) {
    if (forward.count(n.get()) == 0) continue;
    for (const Value* v : n->inputs()) {
      if (v->producer() != nullptr || param_set.count(v->name()) == 0) continue;
      if (layer_of(v->name()) >= 0) layer_read = true;
      else stage_of.emplace(v->name(), layer_read ? last : 0);
    }
  }
  std::unordered_map<const Value*, int> at;
  for (const Value* in : graph.inputs()) {
    const std::string owner = owner_of(in->name(), param_set);
    if (!owner.empty()) at[in] = stage_of.count(owner) > 0 ? stage_of.at(owner) : last;
  }
  return at;
}

}  // namespace

std::vector<int> node_stages(const ir::Graph& graph, const PipelineSpec& spec, const std::vector<std::string>& params) {
  const Value* loss = graph.find_output("loss");
  if (loss == nullptr) throw std::invalid_argument("pipeline stages: the train step has no output 'loss'");
  const std::set<const Node*> forward = ir::producers_of(loss);
  std::unordered_map<const Value*, int> at = input_stages(graph, spec, params);
  // Pass 1, in graph order: forward nodes, and backward or optimizer nodes that read a parameter
  // or a value computed from parameters and the batch alone (a forward value, a view of one the
  // backward makes): their stage is the latest of those. Nodes that read only gradients (values
  // that depend on the seed ir::gradients starts from, ones_like of a loss) wait (kPending);
  // nodes that read nothing staged are free (-1).
  constexpr int kPending = -2;
  std::vector<const Node*> nodes;
  for (const auto& n : graph.nodes()) nodes.push_back(n.get());
  std::unordered_map<const Node*, std::size_t> index;
  for (std::size_t i = 0; i < nodes.size(); ++i) index[nodes[i]] = i;
  std::vector<int> out(nodes.size(), -1);
  std::set<const Value*> gradient;  // values that depend on a gradient seed
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    const Node* n = nodes[i];
    const bool is_forward = forward.count(n) > 0;
    bool is_gradient = !is_forward && n->op() == "ones_like";
    int s = -1;
    bool waits = false;
    for (const Value* v : n->inputs()) {
      if (gradient.count(v) > 0) {
        is_gradient = true;
        waits = true;
        continue;
      }
      if (const auto it = at.find(v); it != at.end()) s = std::max(s, it->second);
    }
    if (is_gradient) {
      for (const Value* o : n->outputs()) gradient.insert(o);
    }
    if (s < 0 && waits) {
      out[i] = kPending;
      continue;
    }
    out[i] = s;
    if (s >= 0) {
      for (const Value* o : n->outputs()) at[o] = s;
    }
  }
  // Pass 2, in reverse: a gradient-only node with one input (a view, a scale) goes where its
  // readers are, the earliest of them: gradients flow back through the stages, and the one
  // value it reads has crossed there anyway. Others wait for pass 3, as do nodes whose readers
  // are not placed yet. A forward cast that widens (mixed precision's bf16 residual to float32
  // for the next layer's norm) whose readers are all on later stages goes there too: its
  // narrower input crosses instead of its output (the bf16 residual crossed anyway, so the
  // float32 copy was a third of the bytes again for nothing).
  auto scalar = [](const Node* n) { return n->output()->meta().numel() <= 1; };
  auto one_input = [](const Node* n) {
    std::set<const Value*> distinct(n->inputs().begin(), n->inputs().end());
    return distinct.size() == 1;
  };
  auto widening_cast = [&](const Node* n) {
    return n->op() == "cast" && forward.count(n) > 0 && n->input(0)->producer() != nullptr &&
           n->output()->meta().nbytes() >= n->input(0)->meta().nbytes();
  };
  std::vector<int> readers_at(nodes.size(), std::numeric_limits<int>::max());
  for (std::size_t i = nodes.size(); i-- > 0;) {
    const Node* n = nodes[i];
    if (out[i] == kPending && one_input(n) && !scalar(n) && readers_at[i] != std::numeric_limits<int>::max()) out[i] = readers_at[i];
    if (out[i] >= 0 && widening_cast(n) && readers_at[i] != std::numeric_limits<int>::max() && readers_at[i] > out[i]) out[i] = readers_at[i];
    if (out[i] < 0) continue;
    for (const Value* v : n->inputs()) {
      if (v->producer() != nullptr) readers_at[index.at(v->producer())] = std::min(readers_at[index.at(v->producer())], out[i]);
    }
  }
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    if (out[i] >= 0) {
      for (const Value* o : nodes[i]->outputs()) at[o] = out[i];
    }
  }
  // Pass 3, in graph order: a gradient-only tensor (a sum of branches' gradients) goes to the
  // earliest stage of its inputs, the way gradients flow; a scalar (a squared norm, their sum,
  // the clip coefficient) to the latest, so that the norm's partial sums cross each stage once
  // and the last stage sends the coefficient back.
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    if (out[i] != kPending) continue;
    int s = -1;
    for (const Value* v : nodes[i]->inputs()) {
      const auto it = at.find(v);
      if (it == at.end()) continue;
      s = s < 0 ? it->second : scalar(nodes[i]) ? std::max(s, it->second) : std::min(s, it->second);
    }
    out[i] = s;
    if (s >= 0) {
      for (const Value* o : nodes[i]->outputs()) at[o] = s;
    }
  }
  return out;
}

sharding::DeviceMesh pipeline_mesh(const sharding::DeviceMesh& mesh, std::int64_t stages) {
  std::vector<MeshDim> dims{{"pp", stages}};
  if (mesh.size() > 1) dims.insert(dims.end(), mesh.dims().begin(), mesh.dims().end());  // one rank a stage: no collectives, no dims to keep
  return sharding::DeviceMesh(dims, stages * mesh.size());
}

namespace {

// The graph cut into stages: each node's stage (node_stages), each value's (graph inputs: their
// parameter's; -1: free), and the metric outputs every stage returns.
struct Cut {
  std::vector<const Node*> nodes;
  std::unordered_map<const Node*, std::size_t> index;
  std::int64_t ranks_stages = 1;  // PipelineSpec::stages: chunk c runs on stage c % this
  std::vector<int> chunks;        // per node: node_stages (-1: free)
  std::unordered_map<const Value*, int> at;  // per value: its chunk
  std::vector<std::pair<std::string, const Value*>> metrics;  // "loss", "grad_norm", "found_inf"
  int stage_of(int chunk) const { return chunk < 0 ? -1 : static_cast<int>(chunk % ranks_stages); }
  // The stage (ranks) that computes or holds `v`, -1 for a free value.
  int stage_at(const Value* v) const {
    const auto it = at.find(v);
    return it == at.end() ? -1 : stage_of(it->second);
  }
};

Cut cut(const ir::Graph& graph, const PipelineSpec& spec, const std::vector<std::string>& params) {
  Cut c;
  c.ranks_stages = spec.stages;
  c.chunks = node_stages(graph, spec, params);
  for (const auto& n : graph.nodes()) c.index[n.get()] = c.nodes.size(), c.nodes.push_back(n.get());
  c.at = input_stages(graph, spec, params);
  for (std::size_t i = 0; i < c.nodes.size(); ++i) {
    if (c.chunks[i] >= 0) {
      for (const Value* o : c.nodes[i]->outputs()) c.at[o] = c.chunks[i];
    }
  }
  for (int s = 0; s < spec.chunks(); ++s) {
    if (std::none_of(c.at.begin(), c.at.end(), [&](const auto& e) { return e.first->producer() == nullptr && e.second == s; })) {
      throw std::invalid_argument("pipeline stage " + std::to_string(s) + " holds no parameter: use fewer stages or other split points");
    }
  }
  for (const auto& [name, v] : graph.outputs()) {
    if (name.compare(0, 5, "next.") != 0) c.metrics.emplace_back(name, v);
  }
  return c;
}

// The nodes stage `stage` runs: its own, and the free ones they (or its metric outputs) read.
std::vector<bool> nodes_of(const Cut& c, int stage) {
  std::vector<bool> mine(c.nodes.size(), false);
  std::set<const Value*> wanted;  // free values the stage computes
  for (const auto& [name, v] : c.metrics) {
    if (c.stage_at(v) < 0) wanted.insert(v);
  }
  for (std::size_t i = c.nodes.size(); i-- > 0;) {
    bool take = c.stage_of(c.chunks[i]) == stage;
    if (c.chunks[i] < 0) {
      for (const Value* o : c.nodes[i]->outputs()) take = take || wanted.count(o) > 0;
    }
    if (!take) continue;
    mine[i] = true;
    for (const Value* v : c.nodes[i]->inputs()) {
      if (c.stage_at(v) < 0 && v->producer() != nullptr) wanted.insert(v);
    }
  }
  return mine;
}

// Whether stage `stage` holds graph input `in` (stage_graph's inputs): its own parameters and
// state, and the free inputs its nodes or metric outputs read.
bool holds(const Cut& c, const std::vector<bool>& mine, int stage, const Value* in) {
  if (c.stage_at(in) >= 0) return c.stage_at(in) == stage;
  for (const auto& u : in->uses()) {
    if (mine[c.index.at(u.user)]) return true;
  }
  return std::any_of(c.metrics.begin(), c.metrics.end(), [&](const auto& m) { return m.second == in; });
}

}  // namespace

StageGraph stage_graph(const ir::Graph& graph, const PipelineSpec& spec, const std::vector<std::string>& params, std::int64_t rank,
                       std::int64_t ranks_per_stage) {
  const int stage = static_cast<int>(rank / ranks_per_stage);
  const Cut c = cut(graph, spec, params);
  const std::vector<const Node*>& nodes = c.nodes;
  const std::vector<int>& chunks = c.chunks;
  const auto& metrics = c.metrics;
  auto stage_at = [&](const Value* v) { return c.stage_at(v); };
  // Every value that crosses stages, with the stage that reads it, in one walk of the graph that
  // every rank makes alike: its position is the pair's tag.
  std::map<std::pair<const Value*, int>, int> tag;
  auto cross = [&](const Value* v, int to) {
    const int from = stage_at(v);
    if (from >= 0 && from != to) tag.emplace(std::pair{v, to}, static_cast<int>(tag.size()));
  };
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    if (chunks[i] < 0) continue;
    for (const Value* v : nodes[i]->inputs()) cross(v, c.stage_of(chunks[i]));
  }
  for (const auto& [name, v] : metrics) {
    for (int s = 0; s < spec.stages; ++s) cross(v, s);
  }
  if (tag.size() >= (1u << 24)) throw std::invalid_argument("pipeline stages: more than 2^24 values cross stages");
  std::vector<bool> mine;
  StageGraph out;
  for (int s = 0; s < spec.stages; ++s) {
    std::vector<bool> of = nodes_of(c, s);
    for (const Value* in : graph.inputs()) {
      if (out.input_stage.count(in->name()) == 0 && holds(c, of, s, in)) out.input_stage[in->name()] = s;
    }
    if (s == stage) mine = std::move(of);
  }
  // The schedule's key of each node: the position of its chunk's forward or backward of its
  // microbatch in this stage's actions; nodes of no microbatch or chunk (a parameter's
  // all_gather, a free value) take their first reader's, so that they run just before it.
  const std::vector<PipelineAction> actions = pipeline_schedule(spec)[static_cast<std::size_t>(stage)];
  const std::set<const Node*> forward = ir::producers_of(graph.find_output("loss"));
  // The microbatches a value depends on, as [first, last]. A backward node that depends on all
  // of them (the last gradient accumulation, clipping, AdamW) runs after every action: clipping
  // sums over every chunk, which with virtual stages are not done in stage order.
  std::unordered_map<const Value*, std::pair<std::int64_t, std::int64_t>> microbatch;
  for (const Value* in : graph.inputs()) {
    if (const auto k = microbatch_of(in->name()); k >= 0) microbatch[in] = {k, k};
  }
  constexpr std::int64_t kNone = std::numeric_limits<std::int64_t>::max();
  std::vector<std::int64_t> key(nodes.size(), kNone);
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    std::int64_t lo = kNone, hi = -1;
    for (const Value* v : nodes[i]->inputs()) {
      if (const auto it = microbatch.find(v); it != microbatch.end()) lo = std::min(lo, it->second.first), hi = std::max(hi, it->second.second);
    }
    if (hi < 0) continue;
    for (const Value* o : nodes[i]->outputs()) microbatch[o] = {lo, hi};
    if (!mine[i] || chunks[i] < 0) continue;
    const bool is_forward = forward.count(nodes[i]) > 0;
    if (!is_forward && spec.microbatches > 1 && lo == 0 && hi == spec.microbatches - 1) {
      key[i] = static_cast<std::int64_t>(actions.size());
      continue;
    }
    const PipelineAction want{is_forward, hi, chunks[i]};
    key[i] = std::find(actions.begin(), actions.end(), want) - actions.begin();
  }
  std::vector<std::int64_t> first_read(nodes.size(), kNone);  // per node: the smallest key of its readers here
  for (std::size_t i = nodes.size(); i-- > 0;) {
    if (!mine[i]) continue;
    if (key[i] == kNone) key[i] = first_read[i] == kNone ? 0 : first_read[i];
    for (const Value* v : nodes[i]->inputs()) {
      if (v->producer() != nullptr) {
        const std::size_t j = c.index.at(v->producer());
        first_read[j] = std::min(first_read[j], key[i]);
      }
    }
  }
  // A received value's key: its first reader's (it is posted as that action starts).
  std::map<const Value*, std::pair<std::int64_t, std::size_t>> received;  // value -> (key, first reader)
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    if (!mine[i]) continue;
    for (const Value* v : nodes[i]->inputs()) {
      if (tag.count({v, stage}) > 0) received.emplace(v, std::pair{key[i], i});
    }
  }
  for (const auto& [name, v] : metrics) {
    if (tag.count({v, stage}) > 0) received.emplace(v, std::pair{static_cast<std::int64_t>(actions.size()), nodes.size()});
  }

  // The stage's graph, built in schedule order (Kahn's algorithm, smallest key first).
  out.stage = stage;
  ir::Graph& g = out.graph;
  std::unordered_map<const Value*, Value*> map;
  for (const Value* in : graph.inputs()) {
    if (holds(c, mine, stage, in)) map[in] = g.add_input(in->name(), in->meta());  // another stage's parameter: received where read
  }
  auto send_from_here = [&](const Value* v) {
    for (int to = 0; to < spec.stages; ++to) {
      const auto it = tag.find({v, to});
      if (it == tag.end() || stage_at(v) != stage) continue;
      const std::int64_t peer = rank + static_cast<std::int64_t>(to - stage) * ranks_per_stage;
      g.add_node("send", {map.at(v)}, {{"peer", peer}, {"tag", static_cast<std::int64_t>(it->second)}});
      ++out.sends;
      out.bytes_sent += v->meta().nbytes();
    }
  };
  for (const Value* in : graph.inputs()) {
    if (map.count(in) > 0) send_from_here(in);
  }
  using Item = std::tuple<std::int64_t, int, std::size_t, const Value*>;  // key, 0 recv / 1 node, node index, received value
  std::priority_queue<Item, std::vector<Item>, std::greater<>> ready;
  std::vector<int> waiting(nodes.size(), 0);
  std::unordered_map<const Value*, std::vector<std::size_t>> readers;
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    if (!mine[i]) continue;
    for (const Value* v : nodes[i]->inputs()) {
      if (map.count(v) > 0) continue;  // a graph input here
      ++waiting[i];
      readers[v].push_back(i);
    }
    if (waiting[i] == 0) ready.emplace(key[i], 1, i, nullptr);
  }
  for (const auto& [v, first] : received) ready.emplace(first.first, 0, first.second, v);
  auto made = [&](const Value* v) {
    const auto it = readers.find(v);
    if (it == readers.end()) return;
    for (std::size_t j : it->second) {
      if (--waiting[j] == 0) ready.emplace(key[j], 1, j, nullptr);
    }
  };
  while (!ready.empty()) {
    const auto [k, kind, i, v] = ready.top();
    ready.pop();
    if (kind == 0) {
      const int from = stage_at(v);
      const ir::TensorMeta& m = v->meta();
      map[v] = g.add(
          "recv", {},
          {{"peer", rank + static_cast<std::int64_t>(from - stage) * ranks_per_stage}, {"tag", static_cast<std::int64_t>(tag.at({v, stage}))},
           {"shape", m.shape}, {"dtype", std::string(ir::to_string(m.dtype))}, {"device", m.device}});
      ++out.recvs;
      made(v);
      continue;
    }
    const Node* n = nodes[i];
    std::vector<Value*> in;
    for (const Value* x : n->inputs()) in.push_back(map.at(x));
    ir::Attributes attrs = n->attrs();
    if (const auto it = attrs.find("mesh_dim"); it != attrs.end()) it->second = std::get<std::int64_t>(it->second) + 1;
    const Node* copy = g.add_node(n->op(), in, attrs);
    for (std::size_t o = 0; o < n->outputs().size(); ++o) {
      map[n->outputs()[o]] = copy->outputs()[o];
      send_from_here(n->outputs()[o]);
      made(n->outputs()[o]);
    }
  }
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    if (mine[i] && waiting[i] > 0) throw std::logic_error("stage_graph: node " + std::to_string(i) + " (" + nodes[i]->op() + ") never became ready");
  }
  for (const auto& [name, v] : graph.outputs()) {
    if (name.compare(0, 5, "next.") == 0 && stage_at(v) != stage) continue;
    g.add_output(name, map.at(v));
  }
  return out;
}

}  // namespace spmdx::train
