// The spmdx IR: one static graph for a whole train step (forward, loss, backward, clipping,
// optimizer), in the spirit of torch.fx: a Node has an op, inputs, outputs and attributes;
// Values know their producer and their uses, and setting an input keeps use lists right.
// Nodes are kept in topological order; Graph::verify() checks it (as FX's Graph.lint()).
//
// No LibTorch and no JSON library in this header: the executor, the serializer and the
// passes depend on the IR, never the other way round.
#pragma once

#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

#include "spmdx/ir/tensor_meta.h"

namespace spmdx::ir {

class Graph;
class Node;
struct OpSchema;

/// An attribute value: int, float, bool, string or a list of ints (dims, shapes).
using Attribute = std::variant<std::int64_t, double, bool, std::string, std::vector<std::int64_t>>;
using Attributes = std::map<std::string, Attribute>;

/// "3", "0.5", "true", "\"mean\"", "[0, 2, 1]".
std::string attribute_str(const Attribute& value);

/// Thrown when building or checking a graph goes wrong; the message names the node, the op and
/// the shapes involved.
class IrError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Use {
  Node* user = nullptr;
  int input_index = 0;
  friend bool operator==(const Use&, const Use&) = default;
};

class Value {
 public:
  std::int64_t id() const noexcept { return id_; }
  /// A name given by the builder ("tokens", "layers.0.attention.wq.weight"); may be empty.
  const std::string& name() const noexcept { return name_; }
  /// "%tokens" for a named graph input, "%12" otherwise.
  std::string ref() const;
  const TensorMeta& meta() const noexcept { return meta_; }
  /// The node that computes it; nullptr for a graph input.
  Node* producer() const noexcept { return producer_; }
  int output_index() const noexcept { return output_index_; }
  const std::vector<Use>& uses() const noexcept { return uses_; }

 private:
  friend class Graph;
  friend class Node;
  std::int64_t id_ = 0;
  std::string name_;
  TensorMeta meta_;
  Node* producer_ = nullptr;
  int output_index_ = 0;
  std::vector<Use> uses_;
};

class Node {
 public:
  const std::string& op() const noexcept;
  const OpSchema& schema() const noexcept { return *schema_; }
  std::int64_t id() const noexcept { return id_; }
  const std::vector<Value*>& inputs() const noexcept { return inputs_; }
  const std::vector<Value*>& outputs() const noexcept { return outputs_; }
  Value* input(int i) const { return inputs_.at(static_cast<std::size_t>(i)); }
  Value* output(int i = 0) const { return outputs_.at(static_cast<std::size_t>(i)); }
  const Attributes& attrs() const noexcept { return attrs_; }

  /// Typed attribute access; throws IrError naming the node when missing or of another type.
  std::int64_t attr_int(const std::string& name) const;
  double attr_float(const std::string& name) const;
  bool attr_bool(const std::string& name) const;
  const std::string& attr_string(const std::string& name) const;
  const std::vector<std::int64_t>& attr_ints(const std::string& name) const;

  /// Replaces input i, keeping both values' use lists right. The new value must have the
  /// same TensorMeta as the old one (the outputs' shapes depend on it).
  void set_input(int i, Value* value);

 private:
  friend class Graph;
  template <class T>
  const T& attr(const std::string& name, const char* type) const;
  std::int64_t id_ = 0;
  const OpSchema* schema_ = nullptr;
  std::vector<Value*> inputs_;
  std::vector<Value*> outputs_;
  Attributes attrs_;
};

class Graph {
 public:
  Graph() = default;
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  Graph(Graph&&) noexcept = default;
  Graph& operator=(Graph&&) noexcept = default;

  /// A new graph input (parameter, optimizer state, batch tensor, step). Names are unique.
  Value* add_input(const std::string& name, const TensorMeta& meta);
  /// Appends a node of a registered op. Fills attribute defaults, checks attribute names and
  /// types, and infers the outputs' TensorMeta. Throws IrError naming the node, the op and the
  /// input shapes when the op does not exist, an attribute is wrong or the shapes do not fit.
  Node* add_node(const std::string& op, const std::vector<Value*>& inputs, const Attributes& attrs = {});
  /// add_node(...)->output(0).
  Value* add(const std::string& op, const std::vector<Value*>& inputs, const Attributes& attrs = {});

  /// Named graph outputs ("loss", "new.layers.0.attention.wq.weight", ...), in order.
  void add_output(const std::string& name, Value* value);
  void set_output(const std::string& name, Value* value);

  const std::vector<Value*>& inputs() const noexcept { return inputs_; }
  const std::vector<std::pair<std::string, Value*>>& outputs() const noexcept { return outputs_; }
  const std::list<std::unique_ptr<Node>>& nodes() const noexcept { return nodes_; }
  std::size_t num_nodes() const noexcept { return nodes_.size(); }
  /// The input of that name, or nullptr.
  Value* find_input(const std::string& name) const;
  /// The output of that name, or nullptr.
  Value* find_output(const std::string& name) const;

  /// Every use of `from` (node inputs and graph outputs) becomes a use of `to`.
  void replace_all_uses(Value* from, Value* to);
  /// Removes a node whose outputs have no uses; throws IrError otherwise.
  void erase(Node* node);
  /// Removes several such nodes in one pass over the graph (erase(Node*) searches the nodes
  /// each time: erasing k of n nodes one by one costs k x n). A node's outputs may be read
  /// only by other nodes in `nodes`, erased with it. Throws IrError as erase(Node*) does, or
  /// for a node not in this graph, before removing any.
  void erase(const std::vector<Node*>& nodes);

  /// Checks: every node's inputs are graph inputs or outputs of earlier nodes (topological
  /// order), use lists match inputs exactly, the op is registered, the input count fits the
  /// schema, and re-running shape inference gives the recorded output metas. Throws IrError
  /// naming the first node that fails.
  void verify() const;

  /// Readable, stable text, one line per node:
  ///   graph(%x: f32[4, 8], %w: f32[8, 3]):
  ///     %2: f32[4, 3] = matmul(%x, %w)
  ///     %3: f32[] = sum(%2) {dims=[], keepdim=false}
  ///     return (loss=%3)
  std::string str() const;

 private:
  friend class GraphReader;
  Value* new_value(const std::string& name, const TensorMeta& meta, Node* producer, int index);
  std::int64_t next_id_ = 0;
  std::vector<std::unique_ptr<Value>> values_;
  std::list<std::unique_ptr<Node>> nodes_;
  std::vector<Value*> inputs_;
  std::vector<std::pair<std::string, Value*>> outputs_;
};

/// Liveness for executors. `order` lists indices into graph.nodes() in execution order (each
/// node once). Returns, per position p of `order`, the values an executor may release after
/// running the node at p: those whose last reader it is, and its own outputs that nothing
/// reads. Graph inputs are listed at their last reader; graph outputs never.
std::vector<std::vector<const Value*>> release_after(const Graph& graph, const std::vector<int>& order);

/// Every node `value` is computed from: its producer, and theirs, transitively (empty for a
/// graph input or null). A train step's forward is producers_of its "loss".
std::set<const Node*> producers_of(const Value* value);

}  // namespace spmdx::ir
