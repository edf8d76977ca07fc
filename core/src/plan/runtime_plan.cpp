#include "spmdx/plan/runtime_plan.h"

#include <algorithm>
#include <map>
#include <sstream>
#include <tuple>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "spmdx/text.h"
#include "spmdx/models/model.h"
#include "spmdx/sharding/rewriter.h"

namespace spmdx::plan {
namespace {

// make_runtime_plan's passes over one rank's graph, each a method, sharing the graph's nodes
// in graph order and the plan they fill in.
struct PlanBuilder {
  const PlanOptions& options;
  RuntimePlan plan;
  std::vector<const ir::Node*> nodes;
  std::unordered_map<const ir::Node*, int> index;
  int n_nodes = 0;
  std::vector<int> chain_of;          // prefetch chain root node per node, or -1
  std::map<int, int> chain_first;     // chain root -> first outside reader
  std::vector<std::vector<int>> groups;       // prefetch groups (by layer), nodes in graph order
  std::multimap<int, std::size_t> groups_at;  // anchor node -> group issued just before it
  std::multimap<int, int> after;              // producer -> collectives issued right after it
  std::vector<bool> hoisted;                  // issued early, after its producer
  std::vector<int> pos;                       // node -> position in plan.order

  PlanBuilder(const ir::Graph& graph, const PlanOptions& o) : options(o) {
    plan.options = o;
    for (const auto& n : graph.nodes()) {
      index[n.get()] = static_cast<int>(nodes.size());
      nodes.push_back(n.get());
    }
    n_nodes = static_cast<int>(nodes.size());
    chain_of.assign(static_cast<std::size_t>(n_nodes), -1);
  }

  // The first node (by `at`: a position per node) reading any output of node n.
  int first_reader(int n, const std::vector<int>& at) const {
    int best = static_cast<int>(at.size());
    for (const ir::Value* out : nodes[static_cast<std::size_t>(n)]->outputs()) {
      for (const auto& use : out->uses()) best = std::min(best, at[static_cast<std::size_t>(index.at(use.user))]);
    }
    return best;
  }

  // The graph input a chain's root all_gather moves: its input, or the input of the cast
  // that feeds it (a parameter in mixed precision); nullptr for neither.
  static const ir::Value* gathered_param(const ir::Node* n) {
    const ir::Value* in = n->input(0);
    if (in->producer() == nullptr) return in;
    const ir::Node* c = in->producer();
    return c->op() == "cast" && c->input(0)->producer() == nullptr ? c->input(0) : nullptr;
  }

  // Prefetch: the parameters' redistributions (an all_gather of a graph input, and the
  // communication nodes fed only by it: TP's steps after FSDP's all_gather) form chains. In
  // mixed precision the all_gather reads the parameter's cast: the cast joins the chain of its
  // first all_gather (FSDP2 casts as it unshards).
  void find_chains() {
    if (options.prefetch) {
      for (int i = 0; i < n_nodes; ++i) {
        const ir::Node* n = nodes[static_cast<std::size_t>(i)];
        if (!sharding::is_communication(n->op())) continue;
        const ir::Value* in = n->input(0);
        if (n->op() == "all_gather" && gathered_param(n) != nullptr) {
          chain_of[static_cast<std::size_t>(i)] = i;
          if (in->producer() != nullptr && chain_of[static_cast<std::size_t>(index.at(in->producer()))] < 0) {
            chain_of[static_cast<std::size_t>(index.at(in->producer()))] = i;
          }
        } else if (in->producer() != nullptr && !(in->producer()->op() == "cast" && gathered_param(n) != nullptr)) {
          chain_of[static_cast<std::size_t>(i)] = chain_of[static_cast<std::size_t>(index.at(in->producer()))];
        }
      }
      for (int i = 0; i < n_nodes; ++i) {
        const int root = chain_of[static_cast<std::size_t>(i)];
        if (root < 0) continue;
        for (const ir::Value* out : nodes[static_cast<std::size_t>(i)]->outputs()) {
          for (const auto& use : out->uses()) {
            const int u = index.at(use.user);
            if (chain_of[static_cast<std::size_t>(u)] == root) continue;
            auto [it, fresh] = chain_first.emplace(root, u);
            if (!fresh) it->second = std::min(it->second, u);
          }
        }
      }
      for (int i = 0; i < n_nodes; ++i) {  // a chain nobody reads stays where it is
        if (chain_of[static_cast<std::size_t>(i)] >= 0 && chain_first.count(chain_of[static_cast<std::size_t>(i)]) == 0) chain_of[static_cast<std::size_t>(i)] = -1;
      }
  }
  }

  // Chains are grouped by layer in the order they are first read (a parameter gathered again
  // in the backward is another chain), and group k+1 is issued just before group k's first reader.
  void group_chains() {
    std::vector<std::pair<int, int>> roots;  // (first reader, root)
    for (const auto& [root, first] : chain_first) roots.emplace_back(first, root);
    std::sort(roots.begin(), roots.end());
    std::vector<int> group_of_root(static_cast<std::size_t>(n_nodes), -1);
    std::vector<int> group_first;  // per group: its first reader
    std::string layer;
    for (const auto& [first, root] : roots) {
      const std::string l = models::layer_of(gathered_param(nodes[static_cast<std::size_t>(root)])->name());
      if (group_first.empty() || l != layer) {
        group_first.push_back(first);
        layer = l;
      }
      group_of_root[static_cast<std::size_t>(root)] = static_cast<int>(group_first.size()) - 1;
  }
  groups.assign(group_first.size(), {});
  for (int i = 0; i < n_nodes; ++i) {
    const int root = chain_of[static_cast<std::size_t>(i)];
    if (root >= 0) groups[static_cast<std::size_t>(group_of_root[static_cast<std::size_t>(root)])].push_back(i);
  }
  for (std::size_t k = 0; k < groups.size(); ++k) groups_at.emplace(group_first[k == 0 ? 0 : k - 1], k);
  }

  // Issue early: every other collective right after the kernel that produces its input (one
  // whose input comes from a collective stays before its reader: issuing it means waiting).
  void issue_early() {
    hoisted.assign(static_cast<std::size_t>(n_nodes), false);
    if (options.overlap) {
      for (int i = 0; i < n_nodes; ++i) {
        const ir::Node* n = nodes[static_cast<std::size_t>(i)];
        if (!sharding::is_collective(n->op()) || chain_of[static_cast<std::size_t>(i)] >= 0) continue;
        const ir::Node* producer = n->input(0)->producer();
        if (producer == nullptr || sharding::is_collective(producer->op())) continue;
        after.emplace(index.at(producer), i);
        hoisted[static_cast<std::size_t>(i)] = true;
      }
  }
  }

  // The execution order: graph order, with prefetch groups and early collectives moved.
  void order() {
    for (int i = 0; i < n_nodes; ++i) {
      auto [lo, hi] = groups_at.equal_range(i);
      for (auto it = lo; it != hi; ++it) {
        for (int g : groups[it->second]) {
          plan.order.push_back(g);
          if (it->second > 0 && nodes[static_cast<std::size_t>(g)]->op() == "all_gather") plan.prefetched.push_back(g);
        }
      }
      if (chain_of[static_cast<std::size_t>(i)] >= 0 || hoisted[static_cast<std::size_t>(i)]) continue;
      plan.order.push_back(i);
      auto [a, b] = after.equal_range(i);
      for (auto it = a; it != b; ++it) plan.order.push_back(it->second);
  }
  }

  // The plan's verifier: the order is still topological; then each node's first reader.
  void verify_and_index() {
      pos.assign(static_cast<std::size_t>(n_nodes), 0);
    for (int p = 0; p < n_nodes; ++p) pos[static_cast<std::size_t>(plan.order[static_cast<std::size_t>(p)])] = p;
    for (int p = 0; p < n_nodes; ++p) {  // the new order must still be topological
      for (const ir::Value* v : nodes[static_cast<std::size_t>(plan.order[static_cast<std::size_t>(p)])]->inputs()) {
        if (v->producer() != nullptr && pos[static_cast<std::size_t>(index.at(v->producer()))] >= p) {
          throw ir::IrError("RuntimePlan: node %" + std::to_string(nodes[static_cast<std::size_t>(plan.order[static_cast<std::size_t>(p)])]->id()) +
                            " would run before its input " + v->ref());
        }
      }
  }
  plan.first_use.assign(static_cast<std::size_t>(n_nodes), 0);
  for (int i = 0; i < n_nodes; ++i) plan.first_use[static_cast<std::size_t>(i)] = first_reader(i, pos);
  }

  // Buckets: greedy in execution order, per (mesh dim, reduce op, dtype, fed by a collective).
  void make_buckets() {
    plan.buckets.clear();
    plan.collectives = 0;
    // (mesh dim, op/reduce op, dtype, fed by a collective) -> bucket: one fed by another
    // collective waits for it when issued, so it does not join (and hold back) the others
    std::map<std::tuple<std::int64_t, std::string, int, bool>, int> open;
    std::map<std::tuple<std::int64_t, std::string, int, bool>, int> made;  // key -> buckets opened so far
    std::vector<double> caps;
    for (int p = 0; p < n_nodes; ++p) {
      const int i = plan.order[static_cast<std::size_t>(p)];
      const ir::Node* n = nodes[static_cast<std::size_t>(i)];
      if (!sharding::is_collective(n->op())) continue;
      ++plan.collectives;
      if ((n->op() != "all_reduce" && n->op() != "reduce_scatter") || options.bucket_bytes <= 0 || n->input(0)->meta().numel() == 0) continue;
      const ir::Node* producer = n->input(0)->producer();
      const bool fed = producer != nullptr && sharding::is_collective(producer->op());
      const auto key = std::make_tuple(n->attr_int("mesh_dim"), n->op() + "/" + n->attr_string("op"), static_cast<int>(n->input(0)->meta().dtype), fed);
      const std::int64_t bytes = n->input(0)->meta().nbytes();
      const int reader = plan.first_use[static_cast<std::size_t>(i)];
      // Read at once (a forward all_reduce): nothing to fuse it with, and joining a bucket would
      // hold the bucket back. The last of a run of collectives fed by one bucket still joins
      // that run's bucket, but starts none.
      const bool read_at_once = reader == p + 1;
      if (read_at_once && !fed) continue;
      auto it = open.find(key);
      if (it != open.end()) {
        Bucket& b = plan.buckets[static_cast<std::size_t>(it->second)];
        if (static_cast<double>(b.bytes + bytes) <= caps[static_cast<std::size_t>(it->second)] && b.first_use > p) {
          b.members.push_back(i);
          b.bytes += bytes;
          b.first_use = std::min(b.first_use, reader);
          b.issue_after = p;
          continue;
        }
      }
      if (read_at_once) continue;
      Bucket b;
      b.members = {i};
      b.op = n->op();
      b.mesh_dim = static_cast<int>(n->attr_int("mesh_dim"));
      b.reduce_op = n->attr_string("op");
      b.bytes = bytes;
      b.issue_after = p;
      b.first_use = reader;
      b.cap = made[key]++ == 0 ? options.first_bucket_bytes : options.bucket_bytes;
      caps.push_back(b.cap);
      open[key] = static_cast<int>(plan.buckets.size());
      plan.buckets.push_back(std::move(b));
  }
  // A bucket of one is a plain collective.
  plan.bucket_of.assign(static_cast<std::size_t>(n_nodes), -1);
  std::vector<Bucket> kept;
  for (auto& b : plan.buckets) {
    if (b.members.size() < 2) continue;
    for (int m : b.members) plan.bucket_of[static_cast<std::size_t>(m)] = static_cast<int>(kept.size());
    kept.push_back(std::move(b));
  }
  plan.buckets = std::move(kept);
  }

  // Collectives fed by a bucket's members (FSDP x TP: a norm weight's gradient reduce_scatter
  // over dp_shard after its all_reduce over tp) can only be issued once that bucket is waited
  // for; left before their readers, each is issued and read at once. Moved together to where
  // the bucket is waited for, they become a bucket of their own: one backend call, not one each.
  void chain_buckets() {
    if (!options.overlap || options.bucket_bytes <= 0) return;
    std::map<int, std::vector<int>> moved;  // position of the node they go before -> collectives, in order
    std::vector<bool> moving(static_cast<std::size_t>(n_nodes), false);
    for (int p = 0; p < n_nodes; ++p) {
      const int i = plan.order[static_cast<std::size_t>(p)];
      const ir::Node* n = nodes[static_cast<std::size_t>(i)];
      if (!sharding::is_collective(n->op()) || n->input(0)->producer() == nullptr) continue;
      const int b = plan.bucket_of[static_cast<std::size_t>(index.at(n->input(0)->producer()))];
      if (b < 0) continue;
      const int at = plan.buckets[static_cast<std::size_t>(b)].first_use;
      if (at >= p) continue;  // it is the bucket's first reader already
      moved[at].push_back(i);
      moving[static_cast<std::size_t>(i)] = true;
    }
    if (!moved.empty()) {
      std::vector<int> order;
      order.reserve(plan.order.size());
      for (int p = 0; p < n_nodes; ++p) {
        if (auto it = moved.find(p); it != moved.end()) order.insert(order.end(), it->second.begin(), it->second.end());
        const int i = plan.order[static_cast<std::size_t>(p)];
        if (!moving[static_cast<std::size_t>(i)]) order.push_back(i);
      }
      plan.order = std::move(order);
      verify_and_index();
      make_buckets();
    }
  }

  // FSDP2's bound on reduce_scatters in flight: a reduce_scatter call (a plain one or a
  // bucket) read later than the next reduce_scatter call of its mesh dim starts is waited for
  // just before that call's first member (where a bucket's staging buffer is made), so that its
  // input, whole gradients, is freed first: one reduce_scatter's buffers at a time.
  void bound_reduce_scatters() {
    plan.wait_before.assign(plan.order.size(), {});
    plan.bound_wait.assign(static_cast<std::size_t>(n_nodes), -1);
    if (!options.overlap) return;
    struct Call {
      int start;               // position of its first member (a bucket's staging buffer is made there)
      int issue;               // position
      int first_use;           // position
      std::vector<int> nodes;  // node indices
    };
    std::map<std::int64_t, std::vector<Call>> calls;  // mesh dim -> its reduce_scatter calls in issue order
    std::vector<bool> seen(plan.buckets.size(), false);
    for (int p = 0; p < n_nodes; ++p) {
      const int i = plan.order[static_cast<std::size_t>(p)];
      const ir::Node* n = nodes[static_cast<std::size_t>(i)];
      if (n->op() != "reduce_scatter") continue;
      const int b = plan.bucket_of[static_cast<std::size_t>(i)];
      if (b < 0) {
        calls[n->attr_int("mesh_dim")].push_back({p, p, plan.first_use[static_cast<std::size_t>(i)], {i}});
      } else if (!seen[static_cast<std::size_t>(b)]) {
        seen[static_cast<std::size_t>(b)] = true;
        const Bucket& bucket = plan.buckets[static_cast<std::size_t>(b)];
        calls[n->attr_int("mesh_dim")].push_back({p, bucket.issue_after, bucket.first_use, bucket.members});
      }
    }
    for (auto& [dim, list] : calls) {
      std::sort(list.begin(), list.end(), [](const Call& a, const Call& b) { return a.issue < b.issue; });
      for (std::size_t k = 1; k < list.size(); ++k) {
        const Call& prev = list[k - 1];
        // Before the next call's first member (its bucket's staging buffer), when the previous
        // call is issued by then; else before the next call's issue.
        const int at_pos = prev.issue < list[k].start ? list[k].start : list[k].issue;
        if (prev.first_use <= at_pos || prev.first_use >= n_nodes) continue;  // read before, or never read
        auto& at = plan.wait_before[static_cast<std::size_t>(at_pos)];
        at.insert(at.end(), prev.nodes.begin(), prev.nodes.end());
        for (int m : prev.nodes) plan.bound_wait[static_cast<std::size_t>(m)] = at_pos;
      }
    }
  }
};

}  // namespace

RuntimePlan make_runtime_plan(const ir::Graph& graph, const sharding::DeviceMesh& mesh, const PlanOptions& options) {
  (void)mesh;
  PlanBuilder b(graph, options);
  b.find_chains();
  b.group_chains();
  b.issue_early();
  b.order();
  b.verify_and_index();
  b.make_buckets();
  b.chain_buckets();
  b.bound_reduce_scatters();
  RuntimePlan& plan = b.plan;
  plan.issues = plan.collectives;
  for (const auto& bucket : plan.buckets) plan.issues -= static_cast<std::int64_t>(bucket.members.size()) - 1;
  return std::move(plan);
}

int RuntimePlan::waited_at(int node) const {
  const std::size_t i = static_cast<std::size_t>(node);
  const int b = bucket_of.at(i);
  int at = b >= 0 ? buckets.at(static_cast<std::size_t>(b)).first_use : first_use.at(i);
  if (!options.overlap) {
    if (b >= 0) return buckets.at(static_cast<std::size_t>(b)).issue_after;
    return static_cast<int>(std::find(order.begin(), order.end(), node) - order.begin());
  }
  if (i < bound_wait.size() && bound_wait[i] >= 0 && bound_wait[i] < at) return bound_wait[i];
  return at;
}

std::string RuntimePlan::str(const ir::Graph& graph, const sharding::DeviceMesh& mesh) const {
  std::vector<const ir::Node*> nodes;
  for (const auto& n : graph.nodes()) nodes.push_back(n.get());
  std::ostringstream out;
  out << "RuntimePlan: " << order.size() << " nodes, " << collectives << " collectives in " << issues << " backend calls ("
      << buckets.size() << " buckets), " << prefetched.size() << " parameter all_gathers prefetched; bucket cap "
      << human_bytes(options.bucket_bytes) << " (first " << human_bytes(options.first_bucket_bytes) << "), overlap "
      << (options.overlap ? "on" : "off") << "\n"
      << "([n]: position in execution order; %v: values as in the rank's graph; one line per backend call)\n";
  for (int d = 0; d < mesh.ndim(); ++d) {
    std::int64_t stride = 1;
    for (int e = d + 1; e < mesh.ndim(); ++e) stride *= mesh.size(e);
    out << "mesh dim " << d << " " << mesh.dims()[static_cast<std::size_t>(d)].name << ": groups of " << mesh.size(d) << " ranks " << stride
        << " apart" << (d == mesh.ndim() - 1 ? " (innermost: consecutive ranks, one host under torchrun's numbering)" : "") << "\n";
  }
  std::vector<bool> printed(buckets.size(), false);
  for (std::size_t p = 0; p < order.size(); ++p) {
    const ir::Node* n = nodes[static_cast<std::size_t>(order[p])];
    if (!sharding::is_collective(n->op())) continue;
    const int b = bucket_of[static_cast<std::size_t>(order[p])];
    const std::string dim = mesh.dims()[static_cast<std::size_t>(n->attr_int("mesh_dim"))].name;
    if (b >= 0) {
      const Bucket& bucket = buckets[static_cast<std::size_t>(b)];
      if (static_cast<int>(p) != bucket.issue_after || printed[static_cast<std::size_t>(b)]) continue;
      printed[static_cast<std::size_t>(b)] = true;
      out << "[" << p << "] bucket " << b << ": " << bucket.op << "(" << bucket.reduce_op << ") on " << dim << ", " << human_bytes(static_cast<double>(bucket.bytes))
          << ", " << bucket.members.size() << " gradients (";
      for (std::size_t m = 0; m < bucket.members.size(); ++m) out << (m ? " " : "") << nodes[static_cast<std::size_t>(bucket.members[m])]->output()->ref();
      out << "); waited at [" << waited_at(bucket.members.front()) << "]" << (waited_at(bucket.members.front()) < bucket.first_use && options.overlap ? " (bound: one reduce_scatter in flight)" : "") << "\n";
    } else {
      const int w = first_use[static_cast<std::size_t>(order[p])];
      const bool pre = std::find(prefetched.begin(), prefetched.end(), order[p]) != prefetched.end();
      out << "[" << p << "] " << n->op() << " on " << dim << ", " << human_bytes(static_cast<double>(n->input(0)->meta().nbytes())) << " in -> "
          << n->output()->ref() << (pre ? " (prefetched)" : "") << "; waited at [" << (options.overlap ? waited_at(order[p]) : static_cast<int>(p)) << "]"
          << (options.overlap && waited_at(order[p]) < w ? " (bound: one reduce_scatter in flight)" : "") << "\n";
    }
  }
  return out.str();
}

std::string RuntimePlan::to_json(const ir::Graph& graph, const sharding::DeviceMesh& mesh) const {
  std::vector<const ir::Node*> nodes;
  for (const auto& n : graph.nodes()) nodes.push_back(n.get());
  auto id = [&](int node) { return nodes.at(static_cast<std::size_t>(node))->output()->id(); };
  nlohmann::json j{{"format", "spmdx.runtime_plan"},
                   {"version", 1},
                   {"options",
                    {{"bucket_bytes", options.bucket_bytes}, {"first_bucket_bytes", options.first_bucket_bytes}, {"prefetch", options.prefetch},
                     {"overlap", options.overlap}, {"donate_state", options.donate_state}, {"in_place", options.in_place}}},
                   {"nodes", order.size()},
                   {"collectives", collectives},
                   {"issues", issues}};
  j["prefetched"] = nlohmann::json::array();
  for (int n : prefetched) j["prefetched"].push_back(id(n));
  j["buckets"] = nlohmann::json::array();
  for (const Bucket& b : buckets) {
    nlohmann::json members = nlohmann::json::array();
    for (int m : b.members) members.push_back(id(m));
    j["buckets"].push_back({{"op", b.op},
                            {"reduce_op", b.reduce_op},
                            {"mesh_dim", b.mesh_dim},
                            {"mesh_dim_name", mesh.dims().at(static_cast<std::size_t>(b.mesh_dim)).name},
                            {"bytes", b.bytes},
                            {"cap", b.cap},
                            {"members", members},
                            {"issue_after", b.issue_after},
                            {"first_use", b.first_use}});
  }
  return j.dump(1) + "\n";
}

}  // namespace spmdx::plan
