#include "spmdx/plan/diff.h"

#include <algorithm>
#include <climits>
#include <chrono>
#include <deque>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <thread>
#include <unordered_map>

// The JSON library's own errors (a structure the checks below do not cover) name the value's
// place ("(/nodes/3/inputs)"); the library tags its namespace with the setting, so this file's
// JSON type is its own.
// In this mode GCC 12 warns that std::map's tree, inlined here, reads past an object
// (-Warray-bounds); the same code without the mode does not: a false positive, silenced here.
#define JSON_DIAGNOSTICS 1
#pragma GCC diagnostic ignored "-Warray-bounds"
#include <nlohmann/json.hpp>

#include "spmdx/files.h"
#include "spmdx/sharding/redistribute.h"
#include "spmdx/sharding/spec.h"
#include "spmdx/text.h"

namespace spmdx::plan {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::uint64_t mix(std::uint64_t h, std::uint64_t v) {  // boost::hash_combine's 64-bit form
  return h ^ (v + 0x9e3779b97f4a7c15ULL + (h << 12) + (h >> 4));
}
std::uint64_t hash_text(const std::string& s) { return std::hash<std::string>{}(s); }

double dtype_bytes(const std::string& d) {
  if (d == "f64" || d == "i64") return 8;
  if (d == "f16" || d == "bf16" || d == "i16") return 2;
  if (d == "bool" || d == "u8" || d == "i8") return 1;
  return 4;
}

double meta_bytes(const json& meta) {
  double n = dtype_bytes(meta.value("dtype", "f32"));
  for (const auto& d : meta.at("shape")) n *= d.get<double>();
  return n;
}

std::string meta_str(const json& meta) {
  std::string s = meta.value("dtype", "?") + "[";
  bool first = true;
  for (const auto& d : meta.at("shape")) {
    s += (first ? "" : ", ") + std::to_string(d.get<long long>());
    first = false;
  }
  return s + "]";
}

using sharding::is_collective;

// The name of mesh dim d of `dims` (a plan's mesh), or "dim d" for one it does not have.
std::string dim_name(const std::vector<std::string>& dims, int d) {
  return d >= 0 && static_cast<std::size_t>(d) < dims.size() ? dims[static_cast<std::size_t>(d)] : "dim " + std::to_string(d);
}

// A plan's mesh dim names, in order; `ranks`: the mesh the rank graphs' collectives count in
// ("run_mesh", with pipeline stages: pp first).
std::vector<std::string> mesh_dims(const json& plan, bool ranks = false) {
  std::vector<std::string> d;
  for (const auto& x : plan.value(ranks && plan.contains("run_mesh") ? "run_mesh" : "mesh", json::array())) d.push_back(x.value("name", "?") + "");
  return d;
}

// A tensor meta's hash from its fields (no text made): dtype, shape, device, requires_grad.
std::uint64_t hash_meta(const json& meta) {
  std::uint64_t h = 0x6d657461;
  for (const auto& [k, v] : meta.items()) {
    h = mix(h, hash_text(k));
    if (v.is_string()) h = mix(h, hash_text(v.get_ref<const std::string&>()));
    else if (v.is_array()) {
      for (const auto& d : v) h = mix(h, static_cast<std::uint64_t>(d.get<long long>()));
      h = mix(h, v.size());
    } else h = mix(h, hash_text(v.dump()));
  }
  return h;
}

// The fields `spmdx diff` reads from a document, checked when it is parsed: one of the wrong
// type is refused naming the file and the field as a JSON pointer ("plan.json: /nodes/3/outputs/0
// is 5, not a string"), not met mid-comparison as the JSON library's error, which names neither.
// Absent optional fields are read with their defaults.
class Fields {
 public:
  explicit Fields(const std::string& what) : what_(what) {}

  [[noreturn]] void wrong(const std::string& at, const json& v, const char* want) const {
    std::string shown = v.dump();
    if (shown.size() > 60) shown = shown.substr(0, 57) + "...";
    throw DiffInputError(what_ + ": " + at + " is " + shown + ", not " + want + "; write it again with spmdx compile --dump");
  }
  const json& object(const json& v, const std::string& at) const {
    is(v, at, Kind::object);
    return v;
  }
  const json& array(const json& v, const std::string& at) const {
    is(v, at, Kind::array);
    return v;
  }
  // count: a whole number in [0, 2^63); bytes: a number in [0, 1e18]; placements: their
  // printed form ("S(0)R"); dtype: a name ir::parse_dtype knows ("f32", "bf16").
  enum class Kind { string, count, bytes, boolean, object, array, placements, dtype };
  // v, at `at`, is of the kind.
  void is(const json& v, const std::string& at, Kind kind) const {
    switch (kind) {
      case Kind::string: if (!v.is_string()) wrong(at, v, "a string"); break;
      case Kind::count:
        if (!v.is_number_integer() || (v.is_number_unsigned() ? v.get<std::uint64_t>() > std::uint64_t{INT64_MAX} : v.get<std::int64_t>() < 0)) {
          wrong(at, v, "a whole number from 0 to 2^63 - 1");
        }
        break;
      case Kind::bytes:
        if (!v.is_number() || !(v.get<double>() >= 0 && v.get<double>() <= 1e18)) wrong(at, v, "a byte count from 0 to 1e18");
        break;
      case Kind::boolean: if (!v.is_boolean()) wrong(at, v, "a boolean"); break;
      case Kind::object: if (!v.is_object()) wrong(at, v, "an object"); break;
      case Kind::array: if (!v.is_array()) wrong(at, v, "an array"); break;
      case Kind::placements:
        if (!v.is_string() || !sharding::parse_placements(v.get_ref<const std::string&>())) wrong(at, v, "placements (as \"S(0)R\" or \"P(sum)\")");
        break;
      case Kind::dtype:
        if (!v.is_string() || !ir::parse_dtype(v.get_ref<const std::string&>())) wrong(at, v, "a dtype (as \"f32\" or \"bf16\")");
        break;
    }
  }
  // x[key], when x has it, is of the kind.
  void optional(const json& x, const std::string& at, const char* key, Kind kind) const {
    if (x.contains(key)) is(x[key], at + "/" + key, kind);
  }
  // x[key], when x has it, is an array of the kind.
  void optional_array(const json& x, const std::string& at, const char* key, Kind kind) const {
    if (!x.contains(key)) return;
    const json& v = array(x[key], at + "/" + key);
    for (std::size_t i = 0; i < v.size(); ++i) is(v[i], at + "/" + key + "/" + std::to_string(i), kind);
  }
  // A tensor meta (ir::to_json's): {dtype, shape, device, requires_grad}.
  void meta(const json& m, const std::string& at) const {
    object(m, at);
    if (!m.contains("shape")) wrong(at, m, "a tensor meta with a shape");
    optional_array(m, at, "shape", Kind::count);
    optional(m, at, "dtype", Kind::dtype);
    optional(m, at, "device", Kind::string);
    optional(m, at, "requires_grad", Kind::boolean);
  }

 private:
  const std::string& what_;
};
using Kind = Fields::Kind;

// One parsed graph document (ir::to_json's "spmdx.graph"): values by id, nodes in order.
struct Graph {
  struct Value {
    std::uint64_t sig = 0;
    std::string name;  // graph inputs only
    json meta;
    int producer = -1;  // node index
    std::vector<std::pair<int, int>> users;  // (node index, input position)
  };
  struct Node {
    int id = 0;
    std::string op;
    json attrs;
    std::vector<int> in, out;
    std::uint64_t sig = 0;
  };
  std::unordered_map<int, Value> values;
  std::vector<Node> nodes;
  std::unordered_map<int, int> node_of_id;
  std::map<std::string, int> inputs;  // name -> value id
  std::vector<std::string> input_order;  // names as the graph lists them
  std::vector<std::pair<std::string, int>> outputs;
  std::vector<std::string> labels;  // per node: its source (see label_nodes)
};

Graph parse_graph(const std::string& text, const std::string& what) {
  json j;
  try {
    check_json_nesting(text);
    j = json::parse(text);
  } catch (const std::exception& e) {
    throw DiffInputError(what + ": not JSON (" + e.what() + ")");
  }
  if (!j.is_object() || !j.contains("format") || j["format"] != "spmdx.graph") throw DiffInputError(what + ": not a graph document (\"format\": \"spmdx.graph\", as spmdx compile --dump writes)");
  Graph g;
  // A value id: a whole number in int's range (nlohmann's get<int> of 1e23 gave -2147483648).
  auto id_of = [&](const json& v) {
    if (!v.is_number_integer() || (v.is_number_unsigned() ? v.get<std::uint64_t>() > INT_MAX : (v.get<std::int64_t>() < INT_MIN || v.get<std::int64_t>() > INT_MAX))) {
      throw DiffInputError(what + ": malformed graph document (the id " + v.dump() + " is not a whole number that spmdx writes)");
    }
    return v.get<int>();
  };
  const Fields check(what);
  try {
    for (std::size_t i = 0; i < j.at("inputs").size(); ++i) {
      const json& in = j["inputs"][i];
      check.meta(in.at("meta"), "/inputs/" + std::to_string(i) + "/meta");
      Graph::Value v;
      v.name = in.at("name").get<std::string>();
      v.meta = in.at("meta");
      v.sig = mix(hash_text("input " + v.name), hash_meta(v.meta));
      const int id = id_of(in.at("id"));
      g.inputs[v.name] = id;
      g.input_order.push_back(v.name);
      g.values[id] = std::move(v);
    }
    for (std::size_t position = 0; position < j.at("nodes").size(); ++position) {
      const json& n = j["nodes"][position];
      const std::string at = "/nodes/" + std::to_string(position);
      check.optional(n, at, "attrs", Kind::object);
      if (n.contains("attrs")) {
        check.optional(n["attrs"], at + "/attrs", "mesh_dim", Kind::object);
        if (n["attrs"].contains("mesh_dim")) check.optional(n["attrs"]["mesh_dim"], at + "/attrs/mesh_dim", "i", Kind::count);
      }
      Graph::Node node;
      node.id = id_of(n.at("id"));
      node.op = n.at("op").get<std::string>();
      node.attrs = n.value("attrs", json::object());
      std::uint64_t h = mix(hash_text(node.op), hash_text(node.attrs.dump()));
      const int index = static_cast<int>(g.nodes.size());
      for (const auto& i : n.at("inputs")) {
        const int id = id_of(i);
        auto it = g.values.find(id);
        if (it == g.values.end()) throw DiffInputError(what + ": node %" + std::to_string(node.id) + " reads %" + std::to_string(id) + " before it is made");
        h = mix(h, it->second.sig);
        it->second.users.emplace_back(index, static_cast<int>(node.in.size()));
        node.in.push_back(id);
      }
      for (std::size_t o = 0; o < n.at("outputs").size(); ++o) {
        const json& meta = n["outputs"][o].at("meta");
        check.meta(meta, at + "/outputs/" + std::to_string(o) + "/meta");
        h = mix(h, hash_meta(meta));
      }
      node.sig = h;
      int k = 0;
      for (const auto& o : n.at("outputs")) {
        Graph::Value v;
        v.meta = o.at("meta");
        v.sig = mix(h, static_cast<std::uint64_t>(++k));
        v.producer = index;
        const int id = id_of(o.at("id"));
        node.out.push_back(id);
        g.values[id] = std::move(v);
      }
      g.node_of_id[node.id] = index;
      g.nodes.push_back(std::move(node));
    }
    for (const auto& o : j.at("outputs")) g.outputs.emplace_back(o.at("name").get<std::string>(), id_of(o.at("value")));
  } catch (const json::exception& e) {
    throw DiffInputError(what + ": malformed graph document (" + e.what() + ")");
  }
  return g;
}

std::string strip_weight(std::string name) {
  for (const char* suffix : {".weight", ".bias"}) {
    const std::string s(suffix);
    if (name.size() > s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0) return name.substr(0, name.size() - s.size());
  }
  return name;
}

bool is_parameter(const Graph::Value& v) { return !v.name.empty() && v.meta.value("requires_grad", false); }

// Each node's source, for people: the parameter whose gradient it makes or carries to AdamW
// ("X (gradient)": the chain from adamw's grad input up through clipping's scalar mul, casts
// and collectives, and the node that made it), else the parameter it reads (two hops up at
// most: a linear's weight, the all_gather of it), else the parameter whose update it feeds,
// else the nearest parameter above it, else its op.
void label_nodes(Graph& g) {
  g.labels.assign(g.nodes.size(), "");
  std::unordered_map<int, std::string> grad_of;  // value id -> parameter
  for (const auto& n : g.nodes) {
    if (n.op != "adamw" || n.in.size() < 2) continue;
    const std::string param = strip_weight(g.values.at(n.in[0]).name);
    if (param.empty()) continue;
    for (int v = n.in[1]; v >= 0;) {
      grad_of[v] = param;
      const int p = g.values.at(v).producer;
      if (p < 0) break;
      const Graph::Node& prod = g.nodes[static_cast<std::size_t>(p)];
      const bool scaled = prod.op == "mul" && prod.in.size() == 2 && g.values.at(prod.in[1]).meta.at("shape").empty();
      const bool passes = scaled || prod.op == "cast" || is_collective(prod.op) || prod.op == "reshape" || prod.op == "chunk";
      v = passes ? prod.in[0] : -1;
      if (!passes) g.labels[static_cast<std::size_t>(p)] = param + " (gradient)";
    }
  }
  auto up = [&](int start, int depth) -> std::string {
    std::deque<std::pair<int, int>> queue{{start, 0}};
    std::set<int> seen{start};
    while (!queue.empty()) {
      auto [n, d] = queue.front();
      queue.pop_front();
      for (int v : g.nodes[static_cast<std::size_t>(n)].in) {
        const Graph::Value& val = g.values.at(v);
        if (is_parameter(val)) return strip_weight(val.name);
        if (val.producer >= 0 && d + 1 < depth && seen.insert(val.producer).second) queue.emplace_back(val.producer, d + 1);
      }
    }
    return "";
  };
  std::unordered_map<int, std::string> output_name;
  for (const auto& [name, v] : g.outputs) output_name.emplace(v, name);
  auto to_output = [&](int start) -> std::string {  // the nearest graph output below: "loss", "grad_norm"
    std::deque<int> queue{start};
    std::set<int> seen{start};
    while (!queue.empty()) {
      const int n = queue.front();
      queue.pop_front();
      for (int v : g.nodes[static_cast<std::size_t>(n)].out) {
        if (auto it = output_name.find(v); it != output_name.end()) return it->second;
        for (const auto& [user, pos] : g.values.at(v).users) {
          if (seen.insert(user).second) queue.push_back(user);
        }
      }
    }
    return "";
  };
  for (std::size_t i = 0; i < g.nodes.size(); ++i) {
    if (!g.labels[i].empty()) continue;
    const Graph::Node& n = g.nodes[i];
    std::string label;
    for (int v : n.out) {
      if (auto it = grad_of.find(v); label.empty() && it != grad_of.end()) label = it->second + " (gradient)";
    }
    for (int v : n.in) {
      if (auto it = grad_of.find(v); label.empty() && it != grad_of.end()) label = it->second + " (gradient)";
    }
    if (label.empty()) label = up(static_cast<int>(i), n.op == "adamw" ? 1 : 2);
    if (label.empty()) label = up(static_cast<int>(i), 8);
    if (label.empty()) label = to_output(static_cast<int>(i));
    if (label.empty()) label = n.op + " %" + std::to_string(n.id);
    g.labels[i] = label;
  }
}

// Pairs each node of a with a node of b of the same signature, in graph order; -1: none.
std::vector<int> match_nodes(const Graph& a, const Graph& b) {
  std::unordered_map<std::uint64_t, std::deque<int>> free;
  for (std::size_t i = 0; i < b.nodes.size(); ++i) free[b.nodes[i].sig].push_back(static_cast<int>(i));
  std::vector<int> m(a.nodes.size(), -1);
  for (std::size_t i = 0; i < a.nodes.size(); ++i) {
    auto it = free.find(a.nodes[i].sig);
    if (it == free.end() || it->second.empty()) continue;
    m[i] = it->second.front();
    it->second.pop_front();
  }
  return m;
}

// Value ids of a mapped to b: graph inputs by name, node outputs through the node pairing.
std::unordered_map<int, int> map_values(const Graph& a, const Graph& b, const std::vector<int>& m) {
  std::unordered_map<int, int> v;
  for (const auto& [name, id] : a.inputs) {
    auto it = b.inputs.find(name);
    if (it != b.inputs.end()) v[id] = it->second;
  }
  for (std::size_t i = 0; i < m.size(); ++i) {
    if (m[i] < 0) continue;
    const auto& oa = a.nodes[i].out;
    const auto& ob = b.nodes[static_cast<std::size_t>(m[i])].out;
    for (std::size_t k = 0; k < oa.size() && k < ob.size(); ++k) v[oa[k]] = ob[k];
  }
  return v;
}

std::string node_str(const Graph& g, const Graph::Node& n) {
  std::string s = n.op + "(";
  for (std::size_t i = 0; i < n.in.size(); ++i) {
    const auto& v = g.values.at(n.in[i]);
    s += (i ? ", " : "") + (v.name.empty() ? "%" + std::to_string(n.in[i]) : "%" + v.name);
  }
  s += ")";
  if (!n.attrs.empty()) s += " " + n.attrs.dump();
  if (!n.out.empty()) s += " -> " + meta_str(g.values.at(n.out[0]).meta);
  return s;
}

// What differs between two nodes of one op reading corresponding inputs.
std::string node_change(const Graph& a, const Graph::Node& x, const Graph& b, const Graph::Node& y) {
  std::vector<std::string> parts;
  std::set<std::string> keys;
  for (const auto& [k, v] : x.attrs.items()) keys.insert(k);
  for (const auto& [k, v] : y.attrs.items()) keys.insert(k);
  for (const auto& k : keys) {
    const json va = x.attrs.value(k, json()), vb = y.attrs.value(k, json());
    if (va != vb) parts.push_back("attribute " + k + " " + va.dump() + " in A, " + vb.dump() + " in B");
  }
  for (std::size_t k = 0; k < x.out.size() && k < y.out.size(); ++k) {
    const json& ma = a.values.at(x.out[k]).meta;
    const json& mb = b.values.at(y.out[k]).meta;
    if (ma != mb) parts.push_back("output " + meta_str(ma) + " in A, " + meta_str(mb) + " in B");
  }
  return parts.empty() ? "an input differs" : join(parts, "; ");
}

// Graph-level differences: inputs by name, then the first unmatched nodes (whose inputs all
// have counterparts), each paired with B's node of the same op on the same inputs if any.
void diff_graphs(const std::string& level, const Graph& a, const Graph& b, const std::vector<int>& m, std::vector<Difference>& out) {
  for (const auto& [name, id] : a.inputs) {
    auto it = b.inputs.find(name);
    if (it == b.inputs.end()) {
      out.push_back({level, name, "input only in A (" + meta_str(a.values.at(id).meta) + ")"});
    } else if (a.values.at(id).meta != b.values.at(it->second).meta) {
      out.push_back({level, name, "input " + meta_str(a.values.at(id).meta) + " in A, " + meta_str(b.values.at(it->second).meta) + " in B"});
    }
  }
  for (const auto& [name, id] : b.inputs) {
    if (!a.inputs.count(name)) out.push_back({level, name, "input only in B (" + meta_str(b.values.at(id).meta) + ")"});
  }
  const auto vmap = map_values(a, b, m);
  std::vector<bool> b_matched(b.nodes.size(), false);
  for (int x : m) {
    if (x >= 0) b_matched[static_cast<std::size_t>(x)] = true;
  }
  std::vector<bool> b_reported(b.nodes.size(), false);
  for (std::size_t i = 0; i < a.nodes.size(); ++i) {
    if (m[i] >= 0) continue;
    const Graph::Node& x = a.nodes[i];
    bool frontier = true;
    std::vector<int> mapped;
    for (int v : x.in) {
      auto it = vmap.find(v);
      if (it == vmap.end()) frontier = false;
      else mapped.push_back(it->second);
    }
    if (!frontier) continue;  // downstream of a difference already reported
    int partner = -1;
    if (!mapped.empty()) {
      for (const auto& [user, pos] : b.values.at(mapped[0]).users) {
        const Graph::Node& y = b.nodes[static_cast<std::size_t>(user)];
        if (b_matched[static_cast<std::size_t>(user)] || b_reported[static_cast<std::size_t>(user)] || y.op != x.op || y.in.size() != mapped.size()) continue;
        if (std::equal(mapped.begin(), mapped.end(), y.in.begin())) {
          partner = user;
          break;
        }
      }
    }
    if (partner >= 0) {
      b_reported[static_cast<std::size_t>(partner)] = true;
      out.push_back({level, a.labels[i], x.op + ": " + node_change(a, x, b, b.nodes[static_cast<std::size_t>(partner)])});
    } else {
      out.push_back({level, a.labels[i], "only in A: " + node_str(a, x)});
    }
  }
  // B's own first differences: unmatched, unreported, reading only values A has too.
  std::unordered_map<int, int> vback;
  for (const auto& [va, vb] : vmap) vback[vb] = va;
  for (std::size_t i = 0; i < b.nodes.size(); ++i) {
    if (b_matched[i] || b_reported[i]) continue;
    const Graph::Node& y = b.nodes[i];
    const bool frontier = std::all_of(y.in.begin(), y.in.end(), [&](int v) { return vback.count(v) > 0; });
    if (frontier) out.push_back({level, b.labels[i], "only in B: " + node_str(b, y)});
  }
}

json parse_doc(const std::string& text, const std::string& what) {
  try {
    check_json_nesting(text);
    return json::parse(text);
  } catch (const std::exception& e) {
    throw DiffInputError(what + ": not JSON (" + e.what() + ")");
  }
}

// plan.json as DistributedPlan::to_json writes it: {mesh: [], inputs: {}, nodes: [], redistributions: []}.
json parse_plan(const std::string& text, const std::string& what) {
  json p = parse_doc(text, what);
  const bool ok = p.is_object() && p.contains("mesh") && p["mesh"].is_array() && p.contains("inputs") && p["inputs"].is_object() &&
                  p.contains("nodes") && p["nodes"].is_array() && (!p.contains("redistributions") || p["redistributions"].is_array());
  if (!ok) throw DiffInputError(what + ": not a sharding plan (an object with mesh, inputs, nodes and redistributions, as spmdx compile --dump writes)");
  const Fields check(what);
  for (const char* mesh : {"mesh", "run_mesh"}) {
    if (!p.contains(mesh)) continue;
    const std::string at = std::string("/") + mesh;
    for (std::size_t i = 0; i < check.array(p[mesh], at).size(); ++i) {
      const json& d = check.object(p[mesh][i], at + "/" + std::to_string(i));
      check.optional(d, at + "/" + std::to_string(i), "name", Kind::string);
      check.optional(d, at + "/" + std::to_string(i), "size", Kind::count);
    }
  }
  for (const char* placed : {"inputs", "outputs"}) {
    if (!p.contains(placed)) continue;
    for (const auto& [name, placement] : check.object(p[placed], std::string("/") + placed).items()) check.is(placement, std::string("/") + placed + "/" + name, Kind::placements);
  }
  for (std::size_t i = 0; i < p["nodes"].size(); ++i) {
    const std::string at = "/nodes/" + std::to_string(i);
    const json& n = check.object(p["nodes"][i], at);
    check.optional(n, at, "id", Kind::count);
    check.optional_array(n, at, "inputs", Kind::placements);
    check.optional_array(n, at, "outputs", Kind::placements);
  }
  for (std::size_t i = 0; p.contains("redistributions") && i < p["redistributions"].size(); ++i) {
    const std::string at = "/redistributions/" + std::to_string(i);
    const json& r = check.object(p["redistributions"][i], at);
    check.optional(r, at, "node", Kind::count);
    check.optional(r, at, "value", Kind::string);
    if (!r.contains("steps")) check.wrong(at, r, "a redistribution with steps");
    for (std::size_t k = 0; k < check.array(r["steps"], at + "/steps").size(); ++k) {
      const std::string step = at + "/steps/" + std::to_string(k);
      const json& x = check.object(r["steps"][k], step);
      for (const char* key : {"from", "to"}) check.optional(x, step, key, Kind::placements);
      check.optional(x, step, "op", Kind::string);
      check.optional(x, step, "mesh_dim", Kind::count);
      check.optional(x, step, "bytes", Kind::bytes);
    }
  }
  return p;
}

json parse_runtime_plan(const std::string& text, const std::string& what) {
  json p = parse_doc(text, what);
  if (!p.is_object() || !p.contains("format") || p["format"] != "spmdx.runtime_plan" || !p.contains("buckets") || !p["buckets"].is_array()) {
    throw DiffInputError(what + ": not a runtime plan (\"format\": \"spmdx.runtime_plan\", as spmdx compile --dump writes)");
  }
  const Fields check(what);
  for (std::size_t i = 0; i < p["buckets"].size(); ++i) {
    const std::string at = "/buckets/" + std::to_string(i);
    const json& b = check.object(p["buckets"][i], at);
    for (const char* key : {"op", "reduce_op", "mesh_dim_name"}) check.optional(b, at, key, Kind::string);
    check.optional(b, at, "bytes", Kind::bytes);
    check.optional_array(b, at, "members", Kind::count);
  }
  for (const char* key : {"issues", "collectives"}) check.optional(p, "", key, Kind::count);
  return p;
}

// A redistribution's steps as people read them: "P(sum)->S(0) reduce_scatter over tp (256.0 KiB)".
std::string steps_str(const json& r, const std::vector<std::string>& dims) {
  std::vector<std::string> parts;
  for (const auto& s : r.at("steps")) {
    parts.push_back(s.value("from", "?") + "->" + s.value("to", "?") + " " + s.value("op", "?") + " over " + dim_name(dims, s.value("mesh_dim", 0)) + " (" +
                    human_bytes(s.value("bytes", 0.0)) + ")");
  }
  return parts.empty() ? "a local step" : join(parts, ", ");
}

// "exp_avg.X" / "exp_avg_sq.X" -> "X"; "" for other names.
std::string state_of(const std::string& name) {
  for (const char* prefix : {"exp_avg.", "exp_avg_sq."}) {
    const std::string p(prefix);
    if (name.rfind(p, 0) == 0) return name.substr(p.size());
  }
  return "";
}

// Per graph input, in graph order, `change(name)` ("" when equal); AdamW state whose change is
// its parameter's is folded into the parameter's line.
void input_differences(const std::string& level, const Graph& a, const std::function<std::string(const std::string&)>& change,
                       std::vector<Difference>& out) {
  std::map<std::string, std::string> changes;
  for (const auto& name : a.input_order) changes[name] = change(name);
  for (const auto& name : a.input_order) {
    const std::string& c = changes[name];
    if (c.empty()) continue;
    const std::string param = state_of(name);
    if (!param.empty() && changes.count(param) && changes[param] == c) continue;
    bool state_alike = false;
    for (const char* prefix : {"exp_avg.", "exp_avg_sq."}) {
      auto it = changes.find(prefix + name);
      if (it != changes.end() && it->second == c) state_alike = true;
    }
    out.push_back({level, strip_weight(name), c + (state_alike ? " (its AdamW state alike)" : "")});
  }
}

// p[key], or an empty array: a reference into p (never a copy, pointers into it are kept).
const json& array_at(const json& p, const char* key) {
  static const json empty = json::array();
  return p.contains(key) && p.at(key).is_array() ? p.at(key) : empty;
}

// Level 2: placements and redistributions, through the logical node pairing.
void diff_plans(const json& pa, const json& pb, const Graph& a, const Graph& b, const std::vector<int>& m, std::vector<Difference>& out) {
  const auto da = mesh_dims(pa), db = mesh_dims(pb);
  auto mesh_str = [](const json& p) {
    std::string s;
    for (const auto& x : p.value("mesh", json::array())) s += (s.empty() ? "" : " x ") + x.value("name", "?") + "=" + std::to_string(x.value("size", 0));
    return s;
  };
  if (mesh_str(pa) != mesh_str(pb)) out.push_back({"plan", "mesh", mesh_str(pa) + " in A, " + mesh_str(pb) + " in B"});
  // Pipeline stages: their count, schedule, microbatches and where they begin.
  const json one_stage{{"stages", 1}};
  const json qa = pa.value("pipeline", one_stage), qb = pb.value("pipeline", one_stage);
  if (qa != qb) out.push_back({"plan", "pipeline", qa.dump() + " in A, " + qb.dump() + " in B"});
  // Context parallelism: its degree, load balancing and rotate method.
  const json no_cp{{"degree", 1}};
  const json ca = pa.value("context_parallel", no_cp), cb = pb.value("context_parallel", no_cp);
  if (ca != cb) out.push_back({"plan", "context_parallel", ca.dump() + " in A, " + cb.dump() + " in B"});
  const json ia = pa.value("inputs", json::object()), ib = pb.value("inputs", json::object());
  input_differences("plan", a, [&](const std::string& name) -> std::string {
    if (!ia.contains(name) || !ib.contains(name) || ia[name] == ib[name]) return "";
    return "input placement " + ia[name].get<std::string>() + " in A, " + ib[name].get<std::string>() + " in B";
  }, out);
  std::vector<Difference> placements;  // after the redistributions: mostly their consequences
  std::unordered_map<int, const json*> na, nb;
  for (const auto& n : array_at(pa, "nodes")) na[n.value("id", -1)] = &n;
  for (const auto& n : array_at(pb, "nodes")) nb[n.value("id", -1)] = &n;
  // Redistributions per consumer node, keyed by the input's position in that node.
  auto by_node = [](const json& p, const Graph& g) {
    std::unordered_map<int, std::map<int, const json*>> r;
    for (const auto& x : array_at(p, "redistributions")) {
      const int node = x.value("node", -1);
      auto it = g.node_of_id.find(node);
      if (it == g.node_of_id.end()) continue;
      const std::string ref = x.value("value", "");
      const Graph::Node& n = g.nodes[static_cast<std::size_t>(it->second)];
      for (std::size_t k = 0; k < n.in.size(); ++k) {
        const auto& v = g.values.at(n.in[k]);
        if (ref == "%" + (v.name.empty() ? std::to_string(n.in[k]) : v.name)) r[node][static_cast<int>(k)] = &x;
      }
    }
    return r;
  };
  const auto ra = by_node(pa, a), rb = by_node(pb, b);
  static const std::map<int, const json*> none;
  for (std::size_t i = 0; i < a.nodes.size(); ++i) {
    if (m[i] < 0) continue;
    const Graph::Node& x = a.nodes[i];
    const Graph::Node& y = b.nodes[static_cast<std::size_t>(m[i])];
    auto pxa = na.find(x.id);
    auto pyb = nb.find(y.id);
    if (pxa != na.end() && pyb != nb.end()) {
      const json& sa = *pxa->second;
      const json& sb = *pyb->second;
      if (sa.value("outputs", json()) != sb.value("outputs", json())) {
        placements.push_back({"plan", a.labels[i], x.op + " output placement " + join(sa.value("outputs", std::vector<std::string>{}), ",") + " in A, " +
                                               join(sb.value("outputs", std::vector<std::string>{}), ",") + " in B"});
      }
    }
    auto fa = ra.find(x.id);
    auto fb = rb.find(y.id);
    const auto& ma = fa == ra.end() ? none : fa->second;
    const auto& mb = fb == rb.end() ? none : fb->second;
    std::set<int> positions;
    for (const auto& [k, r] : ma) positions.insert(k);
    for (const auto& [k, r] : mb) positions.insert(k);
    for (int k : positions) {
      auto ka = ma.find(k);
      auto kb = mb.find(k);
      const std::string sa = ka == ma.end() ? "no redistribution" : steps_str(*ka->second, da);
      const std::string sb = kb == mb.end() ? "no redistribution" : steps_str(*kb->second, db);
      if (sa != sb) out.push_back({"plan", a.labels[i], x.op + " input " + std::to_string(k) + ": " + sa + " in A, " + sb + " in B"});
    }
  }
  // The step's outputs (loss, the updates): the placements they are returned in.
  const json oa = pa.value("outputs", json::object()), ob = pb.value("outputs", json::object());
  for (const auto& [name, placement] : oa.items()) {
    const std::string in_b = ob.contains(name) ? ob[name].get<std::string>() : "no output";
    if (placement.get<std::string>() != in_b) placements.push_back({"plan", "output " + name, "placement " + placement.get<std::string>() + " in A, " + in_b + " in B"});
  }
  for (const auto& [name, placement] : ob.items()) {
    if (!oa.contains(name)) placements.push_back({"plan", "output " + name, "placement no output in A, " + placement.get<std::string>() + " in B"});
  }
  out.insert(out.end(), placements.begin(), placements.end());
}

std::string collective_str(const Graph& g, const Graph::Node& n, const std::vector<std::string>& dims) {
  const std::string dim = dim_name(dims, n.attrs.contains("mesh_dim") ? n.attrs["mesh_dim"].value("i", 0) : 0);
  const double bytes = n.in.empty() ? 0 : meta_bytes(g.values.at(n.in[0]).meta);
  return n.op + " over " + dim + " (" + human_bytes(bytes) + ")";
}

// Level 3: a rank's local input shapes and its collectives, grouped by source (collectives
// are matched by source, op, mesh dim and bytes: a change upstream that moves every
// signature below it leaves the collectives it did not touch matched).
void diff_rank(int r, const Graph& a, const Graph& b, const std::vector<std::string>& da, const std::vector<std::string>& db,
               std::vector<Difference>& out) {
  const std::string level = "rank " + std::to_string(r);
  std::vector<Difference> inputs;  // after the collectives
  input_differences(level, a, [&](const std::string& name) -> std::string {
    auto it = b.inputs.find(name);
    const auto& ma = a.values.at(a.inputs.at(name)).meta;
    if (it == b.inputs.end() || ma == b.values.at(it->second).meta) return "";
    return "local input " + meta_str(ma) + " in A, " + meta_str(b.values.at(it->second).meta) + " in B";
  }, inputs);
  std::map<std::string, std::multiset<std::string>> ca, cb;
  for (std::size_t i = 0; i < a.nodes.size(); ++i) {
    if (is_collective(a.nodes[i].op)) ca[a.labels[i]].insert(collective_str(a, a.nodes[i], da));
  }
  for (std::size_t i = 0; i < b.nodes.size(); ++i) {
    if (is_collective(b.nodes[i].op)) cb[b.labels[i]].insert(collective_str(b, b.nodes[i], db));
  }
  std::set<std::string> labels;
  for (const auto& [l, s] : ca) labels.insert(l);
  for (const auto& [l, s] : cb) labels.insert(l);
  auto list = [](const std::multiset<std::string>* s) {
    if (s == nullptr || s->empty()) return std::string("none");
    std::vector<std::string> parts(s->begin(), s->end());
    return join(parts, ", ");
  };
  for (const auto& l : labels) {
    auto ia = ca.find(l);
    auto ib = cb.find(l);
    const auto* sa = ia == ca.end() ? nullptr : &ia->second;
    const auto* sb = ib == cb.end() ? nullptr : &ib->second;
    if (list(sa) != list(sb)) out.push_back({level, l, "collectives " + list(sa) + " in A, " + list(sb) + " in B"});
  }
  out.insert(out.end(), inputs.begin(), inputs.end());
}

// Level 4: the buckets, in order.
// `ga`, `gb`: the rank's graphs, whose nodes the buckets' members are (by id); `what_a`,
// `what_b`: the plan files, for a member that is not a node there.
void diff_runtime(int r, const json& a, const json& b, const Graph& ga, const Graph& gb, const std::string& what_a, const std::string& what_b,
                  std::vector<Difference>& out) {
  const std::string level = "runtime plan " + std::to_string(r);
  // A bucket's members by their sources, in bucket order: the gradients it carries.
  auto members = [&](const json& bucket, const Graph& g, const std::string& what, std::size_t index) {
    std::vector<std::string> labels;
    const json list = bucket.value("members", json::array());
    for (std::size_t k = 0; k < list.size(); ++k) {
      const auto it = g.node_of_id.find(static_cast<int>(std::min<std::int64_t>(list[k].get<std::int64_t>(), INT_MAX)));
      if (it == g.node_of_id.end()) {
        throw DiffInputError(what + ": /buckets/" + std::to_string(index) + "/members/" + std::to_string(k) + " is " + list[k].dump() +
                             ", not a node of its rank graph; write the dump again with spmdx compile --dump");
      }
      labels.push_back(g.labels[static_cast<std::size_t>(it->second)]);
    }
    return labels;
  };
  auto bucket_str = [](const json& x) {
    return x.value("op", "?") + "(" + x.value("reduce_op", "?") + ") over " + x.value("mesh_dim_name", "?") + ", " + human_bytes(x.value("bytes", 0.0)) +
           ", " + std::to_string(x.value("members", json::array()).size()) + " gradients";
  };
  const json ba = a.value("buckets", json::array()), bb = b.value("buckets", json::array());
  for (std::size_t i = 0; i < std::max(ba.size(), bb.size()); ++i) {
    const std::string sa = i < ba.size() ? bucket_str(ba[i]) : "no bucket";
    const std::string sb = i < bb.size() ? bucket_str(bb[i]) : "no bucket";
    if (sa != sb) {
      out.push_back({level, "bucket " + std::to_string(i), sa + " in A, " + sb + " in B"});
    } else if (i < ba.size()) {  // alike but for which gradients: the first member that differs
      const auto ma = members(ba[i], ga, what_a, i), mb = members(bb[i], gb, what_b, i);
      for (std::size_t k = 0; k < ma.size() && k < mb.size(); ++k) {
        if (ma[k] == mb[k]) continue;
        out.push_back({level, "bucket " + std::to_string(i), "member " + std::to_string(k) + " is " + ma[k] + " in A, " + mb[k] + " in B"});
        break;
      }
    }
  }
  for (const char* key : {"issues", "collectives"}) {
    if (a.value(key, 0) != b.value(key, 0)) {
      out.push_back({level, key, std::to_string(a.value(key, 0)) + " in A, " + std::to_string(b.value(key, 0)) + " in B" +
                                     (std::string(key) == "issues" ? " (backend calls per step)" : "")});
    }
  }
}

std::string read_text(const fs::path& p) {
  try {
    return read_file_bytes(p);
  } catch (const std::runtime_error& e) {
    throw DiffInputError(p.string() + ": " + e.what());
  }
}

}  // namespace

JobDump read_dump(const fs::path& folder) {
  std::error_code ec;
  if (!fs::is_directory(folder, ec)) throw DiffInputError(folder.string() + ": not a folder (give a spmdx compile --dump folder or a config .toml)");
  JobDump d;
  d.label = folder.string();
  for (const char* name : {"logical.json", "plan.json"}) {
    if (!fs::exists(folder / name, ec)) {
      throw DiffInputError((folder / name).string() + ": missing; is " + folder.string() + " a spmdx compile --dump folder?");
    }
  }
  d.logical = read_text(folder / "logical.json");
  d.plan = read_text(folder / "plan.json");
  for (int r = 0; fs::exists(folder / ("rank" + std::to_string(r) + ".json"), ec); ++r) {
    d.ranks.push_back(read_text(folder / ("rank" + std::to_string(r) + ".json")));
    const fs::path plan = folder / ("rank" + std::to_string(r) + ".plan.json");
    if (!fs::exists(plan, ec)) {
      throw DiffInputError(plan.string() + ": missing beside rank" + std::to_string(r) + ".json; write the dump again with this spmdx (spmdx compile --dump)");
    }
    d.rank_plans.push_back(read_text(plan));
  }
  // Rank graphs past a missing one would go uncompared, the gap read as a job of fewer ranks.
  for (const auto& e : fs::directory_iterator(folder, ec)) {
    const std::string n = e.path().filename().string();
    if (n.size() < 10 || n.rfind("rank", 0) != 0 || n.compare(n.size() - 5, 5, ".json") != 0) continue;
    const bool plan = n.size() > 14 && n.compare(n.size() - 10, 10, ".plan.json") == 0;
    const std::string digits = n.substr(4, n.size() - (plan ? 14 : 9));
    if (digits.empty() || digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos) continue;  // rankR.memory.txt and others
    if (std::stoll(digits) >= static_cast<long long>(d.ranks.size())) {
      const std::string missing = "rank" + std::to_string(d.ranks.size()) + ".json";
      throw DiffInputError((folder / missing).string() + ": missing, but " + n + " is there; write the dump again (spmdx compile --dump)");
    }
  }
  return d;
}

DiffResult diff_jobs(const JobDump& a, const JobDump& b) {
  const auto start = std::chrono::steady_clock::now();
  DiffResult d;
  d.a_label = a.label;
  d.b_label = b.label;
  Graph la = parse_graph(a.logical, a.label + "/logical.json"), lb = parse_graph(b.logical, b.label + "/logical.json");
  label_nodes(la);
  label_nodes(lb);
  const auto m = match_nodes(la, lb);
  d.logical_nodes_a = static_cast<long long>(la.nodes.size());
  d.logical_nodes_b = static_cast<long long>(lb.nodes.size());
  d.unmatched_logical = std::count(m.begin(), m.end(), -1) + std::max<long long>(0, d.logical_nodes_b - d.logical_nodes_a);
  diff_graphs("logical", la, lb, m, d.differences);
  const json pa = parse_plan(a.plan, a.label + "/plan.json"), pb = parse_plan(b.plan, b.label + "/plan.json");
  try {
    diff_plans(pa, pb, la, lb, m, d.differences);
  } catch (const json::exception& e) {
    throw DiffInputError(a.label + "/plan.json or " + b.label + "/plan.json: malformed (" + e.what() + ")");
  }
  const auto da = mesh_dims(pa, true), db = mesh_dims(pb, true);
  const std::size_t ranks = std::min(a.ranks.size(), b.ranks.size());
  if (a.ranks.size() != b.ranks.size()) {
    d.differences.push_back({"rank graphs", "ranks", std::to_string(a.ranks.size()) + " rank graphs in A, " + std::to_string(b.ranks.size()) + " in B"});
  }
  d.ranks_compared = static_cast<long long>(ranks);
  std::map<std::pair<std::string, std::string>, CollectiveCount> summary;
  auto same_as_rank0 = [](const std::vector<Difference>& x, const std::vector<Difference>& y) {
    return x.size() == y.size() && std::equal(x.begin(), x.end(), y.begin(), [](const Difference& p, const Difference& q) { return p.where == q.where && p.what == q.what; });
  };
  // Each rank's graphs and plans on their own (a thread per core), merged in rank order.
  struct RankResult {
    std::vector<Difference> graph, runtime;
    std::map<std::pair<std::string, std::string>, CollectiveCount> counts;
    std::string error;
  };
  std::vector<RankResult> results(ranks);
  auto work = [&](std::size_t r) {
    RankResult& out = results[r];
    try {
      Graph ga = parse_graph(a.ranks[r], a.label + "/rank" + std::to_string(r) + ".json");
      Graph gb = parse_graph(b.ranks[r], b.label + "/rank" + std::to_string(r) + ".json");
      label_nodes(ga);
      label_nodes(gb);
      diff_rank(static_cast<int>(r), ga, gb, da, db, out.graph);
      auto count = [&](const Graph& g, const std::vector<std::string>& dims, bool is_a) {
        for (const auto& n : g.nodes) {
          if (!is_collective(n.op)) continue;
          const std::string dim = dim_name(dims, n.attrs.contains("mesh_dim") ? n.attrs["mesh_dim"].value("i", 0) : 0);
          CollectiveCount& c = out.counts[{n.op, dim}];
          c.op = n.op;
          c.mesh_dim = dim;
          const double bytes = n.in.empty() ? 0 : meta_bytes(g.values.at(n.in[0]).meta);
          (is_a ? c.count_a : c.count_b) += 1;
          (is_a ? c.bytes_a : c.bytes_b) += bytes;
        }
      };
      if (r == 0) count(ga, da, true), count(gb, db, false);
      if (r < a.rank_plans.size() && r < b.rank_plans.size()) {
        const std::string what_a = a.label + "/rank" + std::to_string(r) + ".plan.json", what_b = b.label + "/rank" + std::to_string(r) + ".plan.json";
        diff_runtime(static_cast<int>(r), parse_runtime_plan(a.rank_plans[r], what_a), parse_runtime_plan(b.rank_plans[r], what_b), ga, gb, what_a, what_b,
                     out.runtime);
      }
    } catch (const json::exception& e) {
      out.error = a.label + " or " + b.label + ", rank " + std::to_string(r) + "'s graph or plan: malformed (" + e.what() + ")";
    } catch (const std::exception& e) {
      out.error = e.what();
    }
  };
  const std::size_t threads = std::max<std::size_t>(1, std::min<std::size_t>(ranks, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (std::size_t t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (std::size_t r = t; r < ranks; r += threads) work(r);
    });
  }
  for (auto& t : pool) t.join();
  for (std::size_t r = 0; r < ranks; ++r) {
    RankResult& x = results[r];
    if (!x.error.empty()) throw DiffInputError(x.error);
    if (r > 0 && !x.graph.empty() && same_as_rank0(x.graph, results[0].graph)) {
      x.graph = {{"rank " + std::to_string(r), "all", "the same " + std::to_string(x.graph.size()) + " difference(s) as rank 0"}};
    }
    if (r > 0 && !x.runtime.empty() && same_as_rank0(x.runtime, results[0].runtime)) {
      x.runtime = {{"runtime plan " + std::to_string(r), "all", "the same " + std::to_string(x.runtime.size()) + " difference(s) as rank 0's"}};
    }
  }
  for (auto& x : results) d.differences.insert(d.differences.end(), x.graph.begin(), x.graph.end());
  for (auto& x : results) d.differences.insert(d.differences.end(), x.runtime.begin(), x.runtime.end());
  if (!results.empty()) summary = results[0].counts;
  for (auto& [k, c] : summary) d.summary.push_back(c);
  d.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return d;
}

std::string to_text(const DiffResult& d, std::size_t max_differences) {
  std::ostringstream out;
  out << "A: " << d.a_label << "\nB: " << d.b_label << "\n";
  out << "logical graph: " << d.logical_nodes_a << " nodes in A, " << d.logical_nodes_b << " in B, "
      << (d.unmatched_logical == 0 ? std::string("all matched") : std::to_string(d.unmatched_logical) + " without a counterpart") << "; "
      << d.ranks_compared << " rank graph(s) compared\n";
  std::map<std::string, int> per_level;
  for (const auto& x : d.differences) per_level[x.level.rfind("rank ", 0) == 0 ? "rank graphs" : x.level.rfind("runtime plan", 0) == 0 ? "runtime plans" : x.level]++;
  if (d.equivalent()) {
    out << "equivalent: no difference in the graphs, placements, collectives or buckets\n";
  } else {
    std::vector<std::string> counts;
    for (const auto& [level, n] : per_level) counts.push_back(level + " " + std::to_string(n));
    out << d.differences.size() << " difference(s) (" << join(counts, ", ") << "); per level, the first " << max_differences << ":\n";
    std::map<std::string, std::size_t> shown;
    for (const auto& x : d.differences) {
      const std::string group = x.level.rfind("rank ", 0) == 0 ? "rank graphs" : x.level.rfind("runtime plan", 0) == 0 ? "runtime plans" : x.level;
      if (shown[group]++ < max_differences) out << "  [" << x.level << "] " << x.where << ": " << x.what << "\n";
    }
    for (const auto& [group, n] : shown) {
      if (n > max_differences) out << "  ... " << n - max_differences << " more in " << group << " (--max, or --json for all)\n";
    }
  }
  if (!d.summary.empty()) {
    out << "collectives per step on rank 0 (count, input bytes):\n";
    for (const auto& c : d.summary) {
      out << "  " << c.op << " over " << c.mesh_dim << ": " << c.count_a << " (" << human_bytes(c.bytes_a) << ") in A, " << c.count_b << " ("
          << human_bytes(c.bytes_b) << ") in B\n";
    }
  }
  return out.str();
}

std::string to_json(const DiffResult& d) {
  json j{{"schema", "spmdx.diff/1"}, {"a", d.a_label}, {"b", d.b_label}, {"equivalent", d.equivalent()}, {"seconds", d.seconds},
         {"logical_nodes", {d.logical_nodes_a, d.logical_nodes_b}}, {"unmatched_logical_nodes", d.unmatched_logical}, {"ranks_compared", d.ranks_compared}};
  j["differences"] = json::array();
  for (const auto& x : d.differences) j["differences"].push_back({{"level", x.level}, {"where", x.where}, {"what", x.what}});
  j["summary"] = json::array();
  for (const auto& c : d.summary) {
    j["summary"].push_back({{"op", c.op}, {"mesh_dim", c.mesh_dim}, {"count", {c.count_a, c.count_b}}, {"bytes", {c.bytes_a, c.bytes_b}}});
  }
  return j.dump(2) + "\n";
}

}  // namespace spmdx::plan
