#include "spmdx/ir/serialize.h"

#include <nlohmann/json.hpp>

#include <map>

#include "spmdx/ir/ops.h"
#include "spmdx/text.h"

namespace spmdx::ir {
namespace {

using nlohmann::json;

}  // namespace

// Reading restores the written value ids, so that writing again gives the same text even when
// passes left gaps in the ids.
class GraphReader {
 public:
  static void next_id(Graph& graph, std::int64_t id) {
    if (id < graph.next_id_) throw IrError("value id " + std::to_string(id) + " is not increasing");
    graph.next_id_ = id;
  }
};

namespace {

json meta_json(const TensorMeta& m) {
  return {{"shape", m.shape}, {"dtype", to_string(m.dtype)}, {"device", m.device}, {"requires_grad", m.requires_grad}};
}

// Attributes carry their type, so 1 and 1.0 stay distinct: {"i": 1}, {"f": 1.0}, ...
json attr_json(const Attribute& a) {
  struct V {
    json operator()(std::int64_t v) const { return {{"i", v}}; }
    json operator()(double v) const { return {{"f", v}}; }
    json operator()(bool v) const { return {{"b", v}}; }
    json operator()(const std::string& v) const { return {{"s", v}}; }
    json operator()(const std::vector<std::int64_t>& v) const { return {{"ints", v}}; }
  };
  return std::visit(V{}, a);
}

}  // namespace

std::string to_json(const Graph& graph, int indent) {
  json j;
  j["format"] = "spmdx.graph";
  j["version"] = kGraphJsonVersion;
  j["inputs"] = json::array();
  for (const Value* v : graph.inputs()) j["inputs"].push_back({{"id", v->id()}, {"name", v->name()}, {"meta", meta_json(v->meta())}});
  j["nodes"] = json::array();
  for (const auto& node : graph.nodes()) {
    json n{{"id", node->id()}, {"op", node->op()}, {"inputs", json::array()}, {"outputs", json::array()}, {"attrs", json::object()}};
    for (const Value* v : node->inputs()) n["inputs"].push_back(v->id());
    for (const Value* v : node->outputs()) n["outputs"].push_back({{"id", v->id()}, {"meta", meta_json(v->meta())}});
    for (const auto& [k, a] : node->attrs()) n["attrs"][k] = attr_json(a);
    j["nodes"].push_back(std::move(n));
  }
  j["outputs"] = json::array();
  for (const auto& [name, v] : graph.outputs()) j["outputs"].push_back({{"name", name}, {"value", v->id()}});
  return j.dump(indent);
}

Graph from_json(const std::string& text, const std::string& source) {
  auto fail = [&](const std::string& why) -> IrError { return IrError(source + ": " + why); };
  json j;
  try {
    check_json_nesting(text);
    j = json::parse(text);
  } catch (const std::exception& e) {
    throw fail(std::string("not valid JSON: ") + e.what());
  }
  if (!j.is_object() || j.value("format", "") != "spmdx.graph") {
    throw fail("not a spmdx graph (expected \"format\": \"spmdx.graph\")");
  }
  if (!j.contains("version") || !j["version"].is_number_integer()) throw fail("no integer \"version\"");
  const int version = j["version"].get<int>();
  if (version > kGraphJsonVersion) {
    throw fail("graph schema version " + std::to_string(version) + " is newer than this spmdx reads (up to " +
               std::to_string(kGraphJsonVersion) + "): upgrade spmdx, or write the graph with this version");
  }
  try {
    auto read_meta = [&](const json& m) {
      TensorMeta meta;
      meta.shape = m.at("shape").get<std::vector<std::int64_t>>();
      const auto dtype_text = m.at("dtype").get<std::string>();
      auto dtype = parse_dtype(dtype_text);
      if (!dtype) throw fail("unknown dtype '" + dtype_text + "'");
      meta.dtype = *dtype;
      meta.device = m.value("device", "cpu");
      meta.requires_grad = m.value("requires_grad", false);
      return meta;
    };
    Graph graph;
    std::map<std::int64_t, Value*> by_id;
    auto lookup = [&](std::int64_t id) {
      auto it = by_id.find(id);
      if (it == by_id.end()) throw fail("value id " + std::to_string(id) + " is used before it is defined");
      return it->second;
    };
    for (const auto& in : j.at("inputs")) {
      GraphReader::next_id(graph, in.at("id").get<std::int64_t>());
      by_id[in.at("id").get<std::int64_t>()] = graph.add_input(in.at("name").get<std::string>(), read_meta(in.at("meta")));
    }
    for (const auto& n : j.at("nodes")) {
      const auto op = n.at("op").get<std::string>();
      if (OpRegistry::global().find(op) == nullptr) {
        throw fail("node " + std::to_string(n.value("id", -1)) + ": unknown op '" + op + "' (written by a newer spmdx, or a plugin op not loaded)");
      }
      std::vector<Value*> inputs;
      for (const auto& id : n.at("inputs")) inputs.push_back(lookup(id.get<std::int64_t>()));
      Attributes attrs;
      for (const auto& [k, a] : n.at("attrs").items()) {
        if (a.contains("i")) attrs[k] = a["i"].get<std::int64_t>();
        else if (a.contains("f")) attrs[k] = a["f"].get<double>();
        else if (a.contains("b")) attrs[k] = a["b"].get<bool>();
        else if (a.contains("s")) attrs[k] = a["s"].get<std::string>();
        else if (a.contains("ints")) attrs[k] = a["ints"].get<std::vector<std::int64_t>>();
        else throw fail("node " + std::to_string(n.value("id", -1)) + ": attribute '" + k + "' has no known type");
      }
      GraphReader::next_id(graph, n.at("id").get<std::int64_t>());
      Node* node = graph.add_node(op, inputs, attrs);
      const auto& outs = n.at("outputs");
      if (outs.size() != node->outputs().size()) throw fail("node " + std::to_string(n.value("id", -1)) + ": wrong output count");
      for (std::size_t i = 0; i < outs.size(); ++i) {
        const TensorMeta recorded = read_meta(outs[i].at("meta"));
        if (recorded != node->output(static_cast<int>(i))->meta()) {
          throw fail("node " + std::to_string(n.value("id", -1)) + " (" + op + "): output recorded as " + recorded.str() +
                     " but its inputs give " + node->output(static_cast<int>(i))->meta().str());
        }
        by_id[outs[i].at("id").get<std::int64_t>()] = node->output(static_cast<int>(i));
      }
    }
    for (const auto& o : j.at("outputs")) graph.add_output(o.at("name").get<std::string>(), lookup(o.at("value").get<std::int64_t>()));
    graph.verify();
    return graph;
  } catch (const json::exception& e) {
    throw fail(std::string("malformed graph: ") + e.what());
  } catch (const IrError& e) {
    const std::string what = e.what();
    if (what.rfind(source + ": ", 0) == 0) throw;
    throw fail(what);
  }
}

}  // namespace spmdx::ir
