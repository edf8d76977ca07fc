#include "spmdx/ir/graph.h"
#include "spmdx/text.h"

#include <algorithm>
#include <cstdio>
#include <set>
#include <sstream>
#include <unordered_map>

#include "spmdx/ir/ops.h"

namespace spmdx::ir {

std::string attribute_str(const Attribute& value) {
  struct Printer {
    std::string operator()(std::int64_t v) const { return std::to_string(v); }
    std::string operator()(double v) const {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.17g", v);
      std::string s = buf;
      if (s.find_first_of(".eEn") == std::string::npos) s += ".0";  // keep floats visibly floats
      return s;
    }
    std::string operator()(bool v) const { return v ? "true" : "false"; }
    std::string operator()(const std::string& v) const { return "\"" + v + "\""; }
    std::string operator()(const std::vector<std::int64_t>& v) const { return shape_str(v); }
  };
  return std::visit(Printer{}, value);
}

std::string Value::ref() const { return producer_ == nullptr && !name_.empty() ? "%" + name_ : "%" + std::to_string(id_); }

const std::string& Node::op() const noexcept { return schema_->name; }

template <class T>
const T& Node::attr(const std::string& name, const char* type) const {
  auto it = attrs_.find(name);
  if (it == attrs_.end()) throw IrError("node %" + std::to_string(id_) + " (" + op() + ") has no attribute '" + name + "'");
  if (const T* v = std::get_if<T>(&it->second)) return *v;
  throw IrError("node %" + std::to_string(id_) + " (" + op() + "): attribute '" + name + "' is not " + type);
}
std::int64_t Node::attr_int(const std::string& name) const { return attr<std::int64_t>(name, "an int"); }
double Node::attr_float(const std::string& name) const { return attr<double>(name, "a float"); }
bool Node::attr_bool(const std::string& name) const { return attr<bool>(name, "a bool"); }
const std::string& Node::attr_string(const std::string& name) const { return attr<std::string>(name, "a string"); }
const std::vector<std::int64_t>& Node::attr_ints(const std::string& name) const {
  return attr<std::vector<std::int64_t>>(name, "a list of ints");
}

void Node::set_input(int i, Value* value) {
  Value* old = inputs_.at(static_cast<std::size_t>(i));
  if (old->meta() != value->meta()) {
    throw IrError("node %" + std::to_string(id_) + " (" + op() + "): input " + std::to_string(i) + " is " +
                  old->meta().str() + ", cannot replace it with " + value->ref() + ": " + value->meta().str());
  }
  auto& uses = old->uses_;
  uses.erase(std::find(uses.begin(), uses.end(), Use{this, i}));
  inputs_[static_cast<std::size_t>(i)] = value;
  value->uses_.push_back({this, i});
}

Value* Graph::new_value(const std::string& name, const TensorMeta& meta, Node* producer, int index) {
  auto v = std::make_unique<Value>();
  v->id_ = next_id_++;
  v->name_ = name;
  v->meta_ = meta;
  v->producer_ = producer;
  v->output_index_ = index;
  values_.push_back(std::move(v));
  return values_.back().get();
}

Value* Graph::add_input(const std::string& name, const TensorMeta& meta) {
  if (name.empty()) throw IrError("graph input without a name");
  if (find_input(name) != nullptr) throw IrError("graph input '" + name + "' added twice");
  Value* v = new_value(name, meta, nullptr, 0);
  inputs_.push_back(v);
  return v;
}

namespace {

bool attr_has_type(const Attribute& a, AttrType t) {
  switch (t) {
    case AttrType::integer: return std::holds_alternative<std::int64_t>(a);
    case AttrType::floating: return std::holds_alternative<double>(a);
    case AttrType::boolean: return std::holds_alternative<bool>(a);
    case AttrType::string: return std::holds_alternative<std::string>(a);
    case AttrType::ints: return std::holds_alternative<std::vector<std::int64_t>>(a);
  }
  return false;
}

const char* attr_type_name(AttrType t) {
  switch (t) {
    case AttrType::integer: return "int";
    case AttrType::floating: return "float";
    case AttrType::boolean: return "bool";
    case AttrType::string: return "string";
    case AttrType::ints: return "list of ints";
  }
  return "?";
}

std::string describe_inputs(const std::vector<Value*>& inputs) {
  std::string out;
  for (const Value* v : inputs) out += (out.empty() ? "" : ", ") + v->ref() + ": " + v->meta().str();
  return out.empty() ? "no inputs" : out;
}

// Checks arity and attributes against the schema, fills defaults, runs inference.
std::vector<TensorMeta> check_and_infer(const OpSchema& schema, const std::string& where,
                                        const std::vector<Value*>& inputs, Attributes& attrs) {
  const int n = static_cast<int>(inputs.size());
  if (n < schema.min_inputs || (schema.max_inputs >= 0 && n > schema.max_inputs)) {
    std::string want = schema.max_inputs < 0 ? "at least " + std::to_string(schema.min_inputs)
                       : schema.min_inputs == schema.max_inputs
                           ? std::to_string(schema.min_inputs)
                           : std::to_string(schema.min_inputs) + " to " + std::to_string(schema.max_inputs);
    throw IrError(where + " takes " + want + " inputs, got " + std::to_string(n) + " (" + describe_inputs(inputs) + ")");
  }
  for (const auto& [name, value] : attrs) {
    auto spec = std::find_if(schema.attrs.begin(), schema.attrs.end(), [&](const AttrSpec& s) { return s.name == name; });
    if (spec == schema.attrs.end()) {
      std::vector<std::string> names;
      for (const auto& s : schema.attrs) names.push_back(s.name);
      const std::string known = join(names);
      throw IrError(where + " has no attribute '" + name + "' (attributes: " + (known.empty() ? "none" : known) + ")");
    }
    if (!attr_has_type(value, spec->type)) {
      throw IrError(where + ": attribute '" + name + "' must be a " + attr_type_name(spec->type) + ", got " +
                    attribute_str(value));
    }
  }
  for (const auto& spec : schema.attrs) {
    if (attrs.count(spec.name)) continue;
    if (spec.required) throw IrError(where + " needs attribute '" + spec.name + "' (" + attr_type_name(spec.type) + ")");
    attrs.emplace(spec.name, spec.default_value);
  }
  std::vector<const TensorMeta*> metas;
  for (const Value* v : inputs) metas.push_back(&v->meta());
  try {
    return schema.infer(metas, attrs);
  } catch (const IrError& e) {
    throw IrError(where + " with " + describe_inputs(inputs) + ": " + e.what());
  }
}

}  // namespace

Node* Graph::add_node(const std::string& op, const std::vector<Value*>& inputs, const Attributes& attrs) {
  const std::string where = "node %" + std::to_string(next_id_) + " (" + op + ")";
  const OpSchema* schema = OpRegistry::global().find(op);
  if (schema == nullptr) throw IrError(where + ": unknown op '" + op + "'");
  for (const Value* v : inputs) {
    if (v == nullptr) throw IrError(where + ": an input is null");
  }
  Attributes filled = attrs;
  std::vector<TensorMeta> out_metas = check_and_infer(*schema, where, inputs, filled);

  auto node = std::make_unique<Node>();
  node->id_ = next_id_;
  node->schema_ = schema;
  node->inputs_ = inputs;
  node->attrs_ = std::move(filled);
  Node* raw = node.get();
  for (std::size_t i = 0; i < inputs.size(); ++i) inputs[i]->uses_.push_back({raw, static_cast<int>(i)});
  for (std::size_t i = 0; i < out_metas.size(); ++i) {
    raw->outputs_.push_back(new_value("", out_metas[i], raw, static_cast<int>(i)));
  }
  if (out_metas.empty()) ++next_id_;  // keep node ids unique even for ops without outputs
  nodes_.push_back(std::move(node));
  return raw;
}

Value* Graph::add(const std::string& op, const std::vector<Value*>& inputs, const Attributes& attrs) {
  return add_node(op, inputs, attrs)->output(0);
}

void Graph::add_output(const std::string& name, Value* value) {
  if (find_output(name) != nullptr) throw IrError("graph output '" + name + "' added twice");
  if (value == nullptr) throw IrError("graph output '" + name + "' is null");
  outputs_.emplace_back(name, value);
}

void Graph::set_output(const std::string& name, Value* value) {
  for (auto& [n, v] : outputs_) {
    if (n == name) {
      v = value;
      return;
    }
  }
  add_output(name, value);
}

Value* Graph::find_input(const std::string& name) const {
  for (Value* v : inputs_) {
    if (v->name() == name) return v;
  }
  return nullptr;
}

Value* Graph::find_output(const std::string& name) const {
  for (const auto& [n, v] : outputs_) {
    if (n == name) return v;
  }
  return nullptr;
}

void Graph::replace_all_uses(Value* from, Value* to) {
  if (from == to) return;
  const auto uses = from->uses();  // set_input edits the list we walk
  for (const Use& u : uses) u.user->set_input(u.input_index, to);
  for (auto& [name, v] : outputs_) {
    if (v == from) v = to;
  }
}

void Graph::erase(Node* node) {
  for (const Value* out : node->outputs()) {
    if (!out->uses().empty()) {
      throw IrError("cannot erase node %" + std::to_string(node->id()) + " (" + node->op() + "): " + out->ref() +
                    " still has " + std::to_string(out->uses().size()) + " use(s)");
    }
    for (const auto& [name, v] : outputs_) {
      if (v == out) throw IrError("cannot erase node %" + std::to_string(node->id()) + ": it computes output '" + name + "'");
    }
  }
  for (std::size_t i = 0; i < node->inputs_.size(); ++i) {
    auto& uses = node->inputs_[i]->uses_;
    uses.erase(std::find(uses.begin(), uses.end(), Use{node, static_cast<int>(i)}));
  }
  auto it = std::find_if(nodes_.begin(), nodes_.end(), [&](const auto& n) { return n.get() == node; });
  if (it == nodes_.end()) throw IrError("node %" + std::to_string(node->id()) + " is not in this graph");
  nodes_.erase(it);
}

void Graph::erase(const std::vector<Node*>& doomed) {
  const std::set<const Node*> set(doomed.begin(), doomed.end());
  std::set<const Value*> computed;
  for (const auto& [name, v] : outputs_) computed.insert(v);
  for (const Node* node : doomed) {
    for (const Value* out : node->outputs()) {
      for (const Use& use : out->uses()) {
        if (set.count(use.user) == 0) {
          throw IrError("cannot erase node %" + std::to_string(node->id()) + " (" + node->op() + "): " + out->ref() + " is still read by node %" +
                        std::to_string(use.user->id()));
        }
      }
      if (computed.count(out) > 0) throw IrError("cannot erase node %" + std::to_string(node->id()) + ": it computes a graph output");
    }
  }
  std::size_t found = 0;
  for (const auto& n : nodes_) found += set.count(n.get());
  if (found != set.size()) throw IrError("erase: " + std::to_string(set.size() - found) + " of the nodes are not in this graph");
  for (Node* node : doomed) {
    for (std::size_t i = 0; i < node->inputs_.size(); ++i) {
      auto& uses = node->inputs_[i]->uses_;
      uses.erase(std::find(uses.begin(), uses.end(), Use{node, static_cast<int>(i)}));
    }
  }
  nodes_.erase(std::remove_if(nodes_.begin(), nodes_.end(), [&](const auto& n) { return set.count(n.get()) > 0; }), nodes_.end());
}

void Graph::verify() const {
  std::set<const Value*> defined(inputs_.begin(), inputs_.end());
  std::map<const Value*, std::vector<Use>> expected_uses;
  for (const auto& node : nodes_) {
    const std::string where = "node %" + std::to_string(node->id()) + " (" + node->op() + ")";
    if (OpRegistry::global().find(node->op()) != &node->schema()) throw IrError("verify: " + where + ": op not registered");
    for (std::size_t i = 0; i < node->inputs().size(); ++i) {
      const Value* v = node->inputs()[i];
      if (!defined.count(v)) {
        throw IrError("verify: " + where + ": input " + std::to_string(i) + " " + v->ref() +
                      " is not defined before it (graph not in topological order, or a value from another graph)");
      }
      expected_uses[v].push_back({node.get(), static_cast<int>(i)});
    }
    Attributes attrs = node->attrs();
    std::vector<TensorMeta> metas = check_and_infer(node->schema(), "verify: " + where, node->inputs(), attrs);
    if (metas.size() != node->outputs().size()) throw IrError("verify: " + where + ": output count differs from its schema");
    for (std::size_t i = 0; i < metas.size(); ++i) {
      const Value* out = node->outputs()[i];
      if (out->producer() != node.get() || out->output_index() != static_cast<int>(i)) {
        throw IrError("verify: " + where + ": output " + std::to_string(i) + " does not point back to its node");
      }
      if (metas[i] != out->meta()) {
        throw IrError("verify: " + where + ": output " + out->ref() + " is recorded as " + out->meta().str() +
                      " but its inputs give " + metas[i].str());
      }
      if (!defined.insert(out).second) throw IrError("verify: " + where + ": output " + out->ref() + " defined twice");
    }
  }
  auto check_uses = [&](const Value* v) {
    auto want = expected_uses[v];
    auto have = v->uses();
    auto order = [](const Use& a, const Use& b) {
      return a.user->id() != b.user->id() ? a.user->id() < b.user->id() : a.input_index < b.input_index;
    };
    std::sort(want.begin(), want.end(), order);
    std::sort(have.begin(), have.end(), order);
    if (want != have) {
      throw IrError("verify: the use list of " + v->ref() + " has " + std::to_string(have.size()) +
                    " entries, its users say " + std::to_string(want.size()));
    }
  };
  for (const Value* v : inputs_) check_uses(v);
  for (const auto& node : nodes_) {
    for (const Value* v : node->outputs()) check_uses(v);
  }
  for (const auto& [name, v] : outputs_) {
    if (!defined.count(v)) throw IrError("verify: graph output '" + name + "' is not computed by this graph");
  }
}

std::string Graph::str() const {
  std::ostringstream out;
  out << "graph(";
  for (std::size_t i = 0; i < inputs_.size(); ++i) out << (i ? ", " : "") << inputs_[i]->ref() << ": " << inputs_[i]->meta().str();
  out << "):\n";
  for (const auto& node : nodes_) {
    out << "  ";
    for (std::size_t i = 0; i < node->outputs().size(); ++i) {
      out << (i ? ", " : "") << node->outputs()[i]->ref() << ": " << node->outputs()[i]->meta().str();
    }
    out << (node->outputs().empty() ? "" : " = ") << node->op() << "(";
    for (std::size_t i = 0; i < node->inputs().size(); ++i) out << (i ? ", " : "") << node->inputs()[i]->ref();
    out << ")";
    if (!node->attrs().empty()) {
      out << " {";
      bool first = true;
      for (const auto& [k, v] : node->attrs()) {
        out << (first ? "" : ", ") << k << "=" << attribute_str(v);
        first = false;
      }
      out << "}";
    }
    out << "\n";
  }
  out << "  return (";
  for (std::size_t i = 0; i < outputs_.size(); ++i) out << (i ? ", " : "") << outputs_[i].first << "=" << outputs_[i].second->ref();
  out << ")\n";
  return out.str();
}

std::vector<std::vector<const Value*>> release_after(const Graph& graph, const std::vector<int>& order) {
  std::vector<const Node*> nodes;
  for (const auto& n : graph.nodes()) nodes.push_back(n.get());
  std::unordered_map<const Value*, std::size_t> last;  // value -> position of its last reader
  for (std::size_t p = 0; p < order.size(); ++p) {
    const Node* n = nodes.at(static_cast<std::size_t>(order[p]));
    for (const Value* v : n->inputs()) last[v] = p;
    for (const Value* v : n->outputs()) last.emplace(v, p);  // unread outputs go at once
  }
  for (const auto& [name, v] : graph.outputs()) last.erase(v);
  std::vector<std::vector<const Value*>> out(order.size());
  for (const auto& [v, p] : last) out[p].push_back(v);
  return out;
}

std::set<const Node*> producers_of(const Value* value) {
  std::set<const Node*> reach;
  std::vector<const Value*> stack{value};
  while (!stack.empty()) {
    const Value* v = stack.back();
    stack.pop_back();
    if (v == nullptr || v->producer() == nullptr || !reach.insert(v->producer()).second) continue;
    for (const Value* in : v->producer()->inputs()) stack.push_back(in);
  }
  return reach;
}

}  // namespace spmdx::ir
