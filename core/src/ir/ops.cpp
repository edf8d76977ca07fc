// The op registry, which the records of core/src/ops/ fill at load time (one record per op), and
// the helpers those records share: shape and dtype inference (ir/infer.h) and attention's tiles.
#include <algorithm>
#include <numeric>

#include "spmdx/ir/ops.h"
#include "spmdx/ir/infer.h"

namespace spmdx::ir {

using namespace infer;

void OpRegistry::add(OpSchema schema) {
  const std::string name = schema.name;
  if (!ops_.emplace(name, std::move(schema)).second) throw std::invalid_argument("op '" + name + "' registered twice");
}

const OpSchema* OpRegistry::find(const std::string& name) const {
  auto it = ops_.find(name);
  return it == ops_.end() ? nullptr : &it->second;
}

std::vector<std::string> OpRegistry::names() const {
  std::vector<std::string> out;
  for (const auto& [name, schema] : ops_) out.push_back(name);
  return out;
}

std::int64_t balanced_piece(std::int64_t slot, std::int64_t chunks) { return slot % 2 == 0 ? slot / 2 : chunks - 1 - slot / 2; }

bool blocked_attention(const Node& node) {
  return !tiled_attention(node) && node.attr_bool("causal") && (node.attr_int("chunks") > 1 || node.attr_int("q_offset") > 0);
}

std::int64_t natural_position(std::int64_t row, std::int64_t total, std::int64_t chunks) {
  if (chunks <= 1) return row;
  const std::int64_t piece = total / chunks;
  return balanced_piece(row / piece, chunks) * piece + row % piece;
}

std::vector<AttentionTile> attention_tiles(std::int64_t q_rows, std::int64_t kv_rows, std::int64_t chunks, std::int64_t q_offset, std::int64_t window) {
  std::vector<AttentionTile> tiles;
  // Runs of rows at consecutive natural positions (a whole q, or one piece of the balanced
  // order), each cut into tiles of kAttentionTile rows.
  const std::int64_t run = chunks <= 1 ? std::max<std::int64_t>(q_rows, 1) : kv_rows / chunks;
  for (std::int64_t r0 = 0; r0 < q_rows; r0 += run) {
    const std::int64_t n = std::min(run, q_rows - r0), first = natural_position(q_offset + r0, kv_rows, chunks);
    for (std::int64_t t = 0; t < n; t += kAttentionTile) {
      const std::int64_t rows = std::min(kAttentionTile, n - t), position = first + t;
      const std::int64_t begin = window > 0 ? std::max<std::int64_t>(0, position - window + 1) : 0;
      tiles.push_back({r0 + t, rows, position, begin, std::min(position + rows, kv_rows)});
    }
  }
  return tiles;
}

bool tiled_attention(const Node& node) {
  const std::size_t documents = node.op() == "sdpa" ? 3 : 6;
  return node.attr_int("window") > 0 || node.inputs().size() > documents;
}

std::vector<AttentionTile> attention_tiles(const Node& node) {
  const bool forward = node.op() == "sdpa";
  const Shape &q = node.input(forward ? 0 : 1)->meta().shape, &k = node.input(forward ? 1 : 2)->meta().shape;
  return attention_tiles(q.at(2), k.at(2), node.attr_int("chunks"), node.attr_int("q_offset"), node.attr_int("window"));
}

namespace {
// Function-local, so that core/src/ops/'s definitions at load time find it constructed.
OpRegistry& mutable_global() {
  static OpRegistry registry;
  return registry;
}
}  // namespace

void OpRegistry::define(OpSchema schema) {
  schema.defined_by_record = true;
  mutable_global().add(std::move(schema));
}

const OpRegistry& OpRegistry::global() { return mutable_global(); }

std::vector<std::int64_t> dense_like(const std::vector<std::int64_t>& shape, const std::vector<std::int64_t>& like) {
  std::vector<std::size_t> dims(shape.size());
  std::iota(dims.begin(), dims.end(), 0);
  std::stable_sort(dims.begin(), dims.end(), [&](std::size_t a, std::size_t b) { return like[a] > like[b]; });
  std::vector<std::int64_t> s(shape.size(), 1);
  std::int64_t step = 1;
  for (std::size_t k = dims.size(); k-- > 0;) {
    s[dims[k]] = step;
    step *= std::max<std::int64_t>(shape[dims[k]], 1);
  }
  return s;
}

namespace infer {

[[noreturn]] void fail(const std::string& why) { throw IrError(why); }

std::int64_t wrap_dim(std::int64_t dim, std::int64_t rank, const char* what) {
  const std::int64_t r = std::max<std::int64_t>(rank, 1);
  if (dim < -r || dim >= r) {
    fail(std::string(what) + " " + std::to_string(dim) + " is out of range for a tensor of rank " + std::to_string(rank));
  }
  return dim < 0 ? dim + r : dim;
}

void same_dtype(const Metas& in) {
  for (const TensorMeta* m : in) {
    if (m->dtype != in[0]->dtype) fail("dtypes differ (" + in[0]->str() + " vs " + m->str() + "); cast explicitly");
  }
}

void floating(const TensorMeta& m, const char* what) {
  if (!is_floating(m.dtype)) fail(std::string(what) + " must be floating point, got " + m.str());
}

bool any_requires_grad(const Metas& in) {
  return std::any_of(in.begin(), in.end(), [](const TensorMeta* m) { return m->requires_grad; });
}

TensorMeta like(const TensorMeta& m, Shape shape, bool requires_grad) {
  TensorMeta out = m;
  out.shape = std::move(shape);
  out.requires_grad = requires_grad;
  return out;
}

// NumPy broadcasting, as torch.broadcast_shapes.
Shape broadcast(const Shape& a, const Shape& b) {
  const std::size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (std::size_t i = 0; i < n; ++i) {
    const std::int64_t x = i < n - a.size() ? 1 : a[i - (n - a.size())];
    const std::int64_t y = i < n - b.size() ? 1 : b[i - (n - b.size())];
    if (x != y && x != 1 && y != 1) fail("shapes " + shape_str(a) + " and " + shape_str(b) + " do not broadcast");
    out[i] = x == 1 ? y : x;
  }
  return out;
}

std::int64_t sum_of(const Shape& sizes) { return std::accumulate(sizes.begin(), sizes.end(), std::int64_t{0}); }

std::int64_t at_index(const Attributes& a, const char* key) {
  const Shape& sizes = std::get<Shape>(a.at(key));
  const auto index = std::get<std::int64_t>(a.at("index"));
  if (index < 0 || index >= static_cast<std::int64_t>(sizes.size())) fail("index " + std::to_string(index) + " outside " + key);
  return sizes[static_cast<std::size_t>(index)];
}

std::vector<TensorMeta> scatter_dim(const Metas& in, const Attributes& a) {
  Shape s = in[0]->shape;
  auto d = static_cast<std::size_t>(wrap_dim(std::get<std::int64_t>(a.at("dim")), in[0]->rank()));
  if (s[d] != sum_of(std::get<Shape>(a.at("sizes")))) fail("dim " + std::to_string(d) + " is not the sum of sizes");
  s[d] = at_index(a, "sizes");
  return std::vector{like(*in[0], s, in[0]->requires_grad)};
}

std::vector<TensorMeta> grad_like(const Metas& in, std::size_t grad_input, std::size_t like_input) {
  same_dtype({in[0], in[like_input]});
  if (in[0]->shape != in[grad_input]->shape) fail("grad and input shapes differ");
  return std::vector{like(*in[like_input], in[like_input]->shape, any_requires_grad(in))};
}

}  // namespace infer

}  // namespace spmdx::ir
