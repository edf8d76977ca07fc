// graphviz: DOT pictures of the logical graph (after propagation) and of each rank's graph
// (after rewriting), rendered to SVG with Graphviz's `dot` when it is installed. Nodes are
// coloured by the placements of their output (a legend lists them); collectives are red boxes
// labelled with their mesh dim and the bytes each rank sends. collapse_layers draws one box
// per layer ("layers.3": its ops, FLOPs and collectives) so a 6-layer model stays readable.
//
// Options ([hooks.graphviz]): collapse_layers (default false); format, "svg" or "dot"
// (default "svg"); ranks, "all" or a list such as "0,3" (default "all"); max_svg_nodes, above
// this many nodes the SVG is drawn by layer, since Graphviz's layout grows fast (default 300);
// svg_timeout_seconds, dot is stopped after this long (default 60).
// Output: <dump>/hooks/graphviz/logical.{dot,svg}, rank<R>.{dot,svg}; <stem>.layers.dot for
// the by-layer picture.
#include <spawn.h>
#include <sys/wait.h>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <algorithm>
#include <map>
#include <thread>
#include <set>
#include <sstream>

#include "spmdx/core/log.h"
#include "spmdx/files.h"
#include "spmdx/options.h"
#include "spmdx/plugin.h"
#include "spmdx/text.h"

extern char** environ;

namespace {

namespace fs = std::filesystem;

std::string escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

std::string shape_str(const std::vector<std::int64_t>& shape) {
  std::string s = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string placement_str(const std::vector<spmdx::Placement>& p) { return p.empty() ? "?" : spmdx::to_string(p); }

// Runs `dot -Tsvg in -o out`, killed after `timeout` seconds; "" on success, else why not.
std::string render_svg(const fs::path& dot, const fs::path& svg, double timeout) {
  std::vector<std::string> args = {"dot", "-Tsvg", dot.string(), "-o", svg.string()};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  if (posix_spawnp(&pid, "dot", nullptr, nullptr, argv.data(), environ) != 0) return "Graphviz's dot is not installed (apt install graphviz)";
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout);
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      return "dot took over svg_timeout_seconds = " + std::to_string(static_cast<int>(timeout)) + " s on " + dot.string() +
             " and was stopped (lower max_svg_nodes or set collapse_layers = true)";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return "dot failed on " + dot.string() + " (exit " + std::to_string(WEXITSTATUS(status)) + ")";
  return "";
}

class Graphviz final : public spmdx::Hook {
 public:
  explicit Graphviz(const spmdx::Options& options) {
    spmdx::OptionReader o("[hooks.graphviz]", options);
    collapse_ = o.get_bool("collapse_layers", false);
    svg_ = o.get_string("format", "svg", {"svg", "dot"}) == "svg";
    const std::string ranks = o.get_string("ranks", "all");
    max_svg_nodes_ = o.get_int("max_svg_nodes", 300, 1, 100'000'000);
    svg_timeout_ = o.get_double("svg_timeout_seconds", 60, 1, 86400);
    o.done();
    if (ranks.empty()) throw std::invalid_argument("[hooks.graphviz] ranks = \"\": expected \"all\" or rank numbers such as \"0,3\"");
    if (ranks != "all") {
      std::stringstream list(ranks);
      std::string item;
      while (std::getline(list, item, ',')) {
        try {
          std::size_t used = 0;
          ranks_.insert(std::stoi(item, &used));
          if (used != item.size()) throw std::invalid_argument(item);
        } catch (const std::logic_error&) {
          throw std::invalid_argument("[hooks.graphviz] ranks = \"" + ranks + "\": expected \"all\" or rank numbers such as \"0,3\"");
        }
      }
    }
  }

  void init(const spmdx::HookContext& context) override {
    context_ = context;
    for (int r : ranks_) {
      if (r < 0 || r >= context.world_size) {
        throw std::invalid_argument("[hooks.graphviz] ranks: " + std::to_string(r) + " is not a rank of this job (world_size " +
                                    std::to_string(context.world_size) + ")");
      }
    }
  }

  void on_compile_stage(const spmdx::GraphView& g) override {
    if (g.stage == spmdx::CompileStage::propagated) {
      write(g, "logical");
    } else if (g.stage == spmdx::CompileStage::rewritten && (ranks_.empty() || ranks_.count(g.rank) > 0)) {
      write(g, "rank" + std::to_string(g.rank));
    }
  }

 private:
  const std::string& colour(const std::string& placement) {
    static const std::vector<std::string> palette = {"#8dd3c7", "#ffffb3", "#bebada", "#80b1d3", "#fdb462", "#b3de69",
                                                     "#fccde5", "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f", "#a6cee3"};
    auto it = colours_.find(placement);
    if (it == colours_.end()) it = colours_.emplace(placement, palette[colours_.size() % palette.size()]).first;
    return it->second;
  }

  std::string mesh_dim_name(const spmdx::GraphView& g, int d) const {
    return d >= 0 && d < static_cast<int>(g.mesh.size()) ? g.mesh[static_cast<std::size_t>(d)].name : "?";
  }

  void write(const spmdx::GraphView& g, const std::string& stem) {
    const fs::path dir(context_.output_dir);
    const bool big = g.nodes.size() + g.inputs.size() > static_cast<std::size_t>(max_svg_nodes_);
    if (!collapse_) spmdx::write_file_atomic(dir / (stem + ".dot"), dot_of(g, false));
    if (collapse_ || big) spmdx::write_file_atomic(dir / (stem + ".layers.dot"), dot_of(g, true));
    if (!svg_) return;
    // Graphviz's layout grows fast with the node count: a large graph is drawn by layer.
    const fs::path source = dir / (stem + (collapse_ || big ? ".layers.dot" : ".dot"));
    if (big && !collapse_ && !told_) {
      told_ = true;
      SPMDX_INFO("graphviz: " << stem << " has " << g.nodes.size() + g.inputs.size() << " nodes and inputs (> max_svg_nodes " << max_svg_nodes_
                              << "): its SVG shows one box per layer; the full graph is in " << (dir / (stem + ".dot")).string());
    }
    const std::string error = render_svg(source, dir / (stem + ".svg"), svg_timeout_);
    if (!error.empty() && !warned_) {
      warned_ = true;
      SPMDX_WARN("graphviz: " << error << "; the DOT files are in " << dir.string());
    }
  }

  std::string dot_of(const spmdx::GraphView& g, bool collapsed) {
    std::ostringstream dot;
    std::string mesh;
    for (const auto& d : g.mesh) mesh += (mesh.empty() ? "" : " x ") + d.name + "=" + std::to_string(d.size);
    const std::string title = (g.rank < 0 ? "logical graph" : "rank " + std::to_string(g.rank)) + " (" + spmdx::to_string(g.stage) + "), mesh " + mesh;
    dot << "digraph \"" << escape(title) << "\" {\n  label=\"" << escape(title) << "\"; labelloc=t; rankdir=TB;\n"
        << "  node [shape=box, style=filled, fontname=\"Helvetica\", fontsize=10];\n";
    std::set<std::string> used;
    if (collapsed) {
      write_collapsed(g, dot, used);
    } else {
      for (int v : g.inputs) {
        const auto& value = g.values[static_cast<std::size_t>(v)];
        const std::string pl = placement_str(value.placements);
        used.insert(pl);
        dot << "  v" << v << " [shape=ellipse, fillcolor=\"" << colour(pl) << "\", label=\"" << escape(value.name) << "\\n" << shape_str(value.shape)
            << " " << pl << "\"];\n";
      }
      for (std::size_t n = 0; n < g.nodes.size(); ++n) {
        const auto& node = g.nodes[n];
        const auto& out = g.values[static_cast<std::size_t>(node.outputs.empty() ? 0 : node.outputs[0])];
        const std::string pl = node.outputs.empty() ? "?" : placement_str(out.placements);
        if (node.collective) {
          dot << "  n" << n << " [shape=box, style=\"filled,bold\", penwidth=3, color=\"#b2182b\", fillcolor=\"#f4a582\", label=\"" << escape(node.op)
              << " (" << escape(mesh_dim_name(g, node.mesh_dim)) << ")\\n" << spmdx::human_bytes(static_cast<double>(node.comm_bytes)) << " sent\\n"
              << shape_str(out.shape) << " " << pl << "\"];\n";
        } else {
          used.insert(pl);
          dot << "  n" << n << " [fillcolor=\"" << colour(pl) << "\", label=\"" << escape(node.op) << "\\n" << shape_str(out.shape) << " " << pl << "\"];\n";
        }
        for (int v : node.inputs) {
          const int p = g.values[static_cast<std::size_t>(v)].producer;
          dot << "  " << (p < 0 ? "v" + std::to_string(v) : "n" + std::to_string(p)) << " -> n" << n << ";\n";
        }
      }
    }
    dot << "  subgraph cluster_legend { label=\"placements\"; fontsize=10;\n";
    int i = 0;
    for (const auto& pl : used) dot << "    legend" << i++ << " [shape=box, fillcolor=\"" << colour(pl) << "\", label=\"" << escape(pl) << "\"];\n";
    dot << "    legend_c [shape=box, style=\"filled,bold\", penwidth=3, color=\"#b2182b\", fillcolor=\"#f4a582\", label=\"collective\"];\n  }\n}\n";
    return dot.str();
  }

  // Each node's box in the by-layer picture: "optimizer" for the gradient norm, the clipping
  // and AdamW (the nodes of the norm's scalar chain, from each gradient's square to the
  // grad_norm output, everything computed from it, and every adamw); else the node's layer
  // (the parameter it reads, else its input made last: graph_view.h); else the box of its
  // first reader that has one (a batch's reshape, the rope tables' redistributions, the count
  // of valid labels); else "(no layer)".
  static std::vector<std::string> boxes_of(const spmdx::GraphView& g) {
    const std::size_t n = g.nodes.size();
    std::vector<char> optimizer(n, 0);
    auto producer = [&](int v) { return g.values[static_cast<std::size_t>(v)].producer; };
    for (const auto& [name, v] : g.outputs) {
      if (name != "grad_norm" || producer(v) < 0) continue;
      std::vector<int> stack{producer(v)};  // the scalar chain: sqrt <- add <- sum <- mul(g, g)
      while (!stack.empty()) {
        const int p = stack.back();
        stack.pop_back();
        if (optimizer[static_cast<std::size_t>(p)]) continue;
        optimizer[static_cast<std::size_t>(p)] = 1;
        const auto& node = g.nodes[static_cast<std::size_t>(p)];
        for (int in : node.inputs) {
          const int q = producer(in);
          if (q < 0) continue;
          const bool scalar = g.values[static_cast<std::size_t>(in)].shape.empty();
          if (scalar || (node.op == "sum" && g.nodes[static_cast<std::size_t>(q)].op == "mul")) stack.push_back(q);
        }
      }
    }
    for (std::size_t i = 0; i < n; ++i) {  // what the norm feeds (the clip coefficient, clipped gradients), and AdamW
      if (g.nodes[i].op == "adamw") optimizer[i] = 1;
      for (int in : g.nodes[i].inputs) {
        const int p = producer(in);
        if (p >= 0 && optimizer[static_cast<std::size_t>(p)] && g.values[static_cast<std::size_t>(in)].shape.empty()) optimizer[i] = 1;
      }
    }
    std::vector<std::string> box(n);
    for (std::size_t i = 0; i < n; ++i) box[i] = optimizer[i] ? "optimizer" : g.nodes[i].layer;
    std::vector<std::vector<int>> readers(n);
    for (std::size_t i = 0; i < n; ++i) {
      for (int in : g.nodes[i].inputs) {
        if (const int p = producer(in); p >= 0) readers[static_cast<std::size_t>(p)].push_back(static_cast<int>(i));
      }
    }
    for (std::size_t k = n; k-- > 0;) {  // readers come later: one backward pass settles chains
      if (!box[k].empty()) continue;
      for (int r : readers[k]) {
        if (!box[static_cast<std::size_t>(r)].empty()) {
          box[k] = box[static_cast<std::size_t>(r)];
          break;
        }
      }
    }
    for (auto& b : box) {
      if (b.empty()) b = "(no layer)";
    }
    return box;
  }

  // "layers.10" -> ("layers.", 10); a name without a number after its last dot -> ("", -1).
  static std::pair<std::string, long long> numbered(const std::string& box) {
    const auto dot = box.rfind('.');
    if (dot == std::string::npos || dot + 1 == box.size() || box.find_first_not_of("0123456789", dot + 1) != std::string::npos) return {"", -1};
    return {box.substr(0, dot + 1), std::stoll(box.substr(dot + 1))};
  }

  // The boxes in the order a step runs them: those first met before the first numbered block
  // (the embedding), the blocks by number (layers.2 before layers.10), the others in the order
  // met (the final norm, the output and the loss), the optimizer last.
  static std::vector<std::string> box_order(const spmdx::GraphView& g, const std::vector<std::string>& box) {
    std::vector<std::string> before, blocks, after;
    std::set<std::string> seen;
    bool block_met = false, optimizer = false;
    for (std::size_t i = 0; i < box.size(); ++i) {
      const std::string& b = box[i];
      if (!seen.insert(b).second) {
        continue;
      }
      if (b == "optimizer") {
        optimizer = true;
      } else if (numbered(b).second >= 0) {
        block_met = true;
        blocks.push_back(b);
      } else {
        (block_met ? after : before).push_back(b);
      }
    }
    (void)g;
    std::stable_sort(blocks.begin(), blocks.end(), [](const std::string& a, const std::string& b) { return numbered(a) < numbered(b); });
    std::vector<std::string> order = before;
    order.insert(order.end(), blocks.begin(), blocks.end());
    order.insert(order.end(), after.begin(), after.end());
    if (optimizer) order.push_back("optimizer");
    return order;
  }

  // One box per layer, stacked in box_order's order (an invisible chain keeps graphviz from
  // reordering them; an edge going back up, the backward's, does not rank them); returns the
  // boxes drawn.
  std::size_t write_collapsed(const spmdx::GraphView& g, std::ostringstream& dot, std::set<std::string>& used) {
    struct Group {
      std::size_t ops = 0, collectives = 0;
      double flops = 0, comm = 0;
      std::map<std::string, std::size_t> placements;
      bool loss = false;
    };
    const std::vector<std::string> box = boxes_of(g);
    int loss_node = -1;
    for (const auto& [name, v] : g.outputs) {
      if (name == "loss") loss_node = g.values[static_cast<std::size_t>(v)].producer;
    }
    std::map<std::string, Group> groups;
    for (std::size_t i = 0; i < g.nodes.size(); ++i) {
      const auto& n = g.nodes[i];
      Group& gr = groups[box[i]];
      ++gr.ops;
      gr.flops += n.flops;
      gr.loss = gr.loss || static_cast<int>(i) == loss_node;
      if (n.collective) ++gr.collectives, gr.comm += static_cast<double>(n.comm_bytes);
      if (!n.outputs.empty()) ++gr.placements[placement_str(g.values[static_cast<std::size_t>(n.outputs[0])].placements)];
    }
    const std::vector<std::string> order = box_order(g, box);
    std::map<std::string, int> id;
    for (const auto& k : order) {
      const Group& gr = groups[k];
      std::string main_pl = "?";
      std::size_t best = 0;
      for (const auto& [pl, c] : gr.placements) {
        if (c > best) best = c, main_pl = pl;
      }
      used.insert(main_pl);
      const int i = static_cast<int>(id.size());
      id[k] = i;
      std::ostringstream flops;
      flops.precision(3);
      flops << gr.flops / 1e9;
      dot << "  g" << i << " [fillcolor=\"" << colour(main_pl) << "\"" << (gr.collectives ? ", style=\"filled,bold\", penwidth=3, color=\"#b2182b\"" : "")
          << ", label=\"" << escape(k) << (gr.loss && k != "loss" ? " + loss" : "") << "\\n" << gr.ops << " ops, " << flops.str() << " GFLOP, mostly " << main_pl;
      if (gr.collectives) dot << "\\n" << gr.collectives << " collectives, " << spmdx::human_bytes(gr.comm) << " sent";
      dot << "\"];\n";
    }
    for (std::size_t i = 0; i + 1 < order.size(); ++i) dot << "  g" << i << " -> g" << i + 1 << " [style=invis, weight=100];\n";
    std::map<std::pair<int, int>, double> edges;
    for (std::size_t c = 0; c < g.nodes.size(); ++c) {
      for (int v : g.nodes[c].inputs) {
        const int p = g.values[static_cast<std::size_t>(v)].producer;
        if (p < 0) continue;
        const int from = id[box[static_cast<std::size_t>(p)]], to = id[box[c]];
        if (from != to) edges[{from, to}] += static_cast<double>(g.values[static_cast<std::size_t>(v)].bytes);
      }
    }
    for (const auto& [e, bytes] : edges) {
      dot << "  g" << e.first << " -> g" << e.second << " [label=\"" << spmdx::human_bytes(bytes) << "\", fontsize=8" << (e.first > e.second ? ", constraint=false" : "") << "];\n";
    }
    return order.size();
  }

  bool collapse_ = false, svg_ = true, warned_ = false, told_ = false;
  std::int64_t max_svg_nodes_ = 300;
  double svg_timeout_ = 60;
  std::set<int> ranks_;
  std::map<std::string, std::string> colours_;
  spmdx::HookContext context_;
};

void register_graphviz(spmdx::Registrar& r) {
  r.add_hook("graphviz", [](const spmdx::Options& o) { return std::make_unique<Graphviz>(o); });
}

}  // namespace

SPMDX_PLUGIN("graphviz", hook, "0.1.0", "DOT and SVG of the logical and per-rank graphs, coloured by placement, collectives highlighted",
             register_graphviz)
