// Op schemas: for each IR op, its inputs, attributes and shape/dtype inference.
// Kernels (ATen) and VJP rules are registered elsewhere against the same names, so the IR
// needs neither LibTorch nor autodiff.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "spmdx/ir/graph.h"

namespace spmdx::ir {

enum class AttrType { integer, floating, boolean, string, ints };

struct AttrSpec {
  std::string name;
  AttrType type = AttrType::integer;
  bool required = false;
  Attribute default_value = std::int64_t{0};  ///< used when not required and not given
};

/// Inference: the input metas and the (defaults-filled) attributes give the output metas.
/// Throws IrError with a message about shapes only; Graph adds the node and op names.
using InferFn = std::function<std::vector<TensorMeta>(const std::vector<const TensorMeta*>&, const Attributes&)>;

struct OpSchema {
  std::string name;
  int min_inputs = 0;
  int max_inputs = 0;  ///< -1: any number (cat)
  std::vector<AttrSpec> attrs;
  InferFn infer;
};

class OpRegistry {
 public:
  /// The registry with every built-in op (core/src/ir/ops.cpp).
  static const OpRegistry& global();

  /// Throws std::invalid_argument when the name is taken.
  void add(OpSchema schema);
  /// nullptr when no op has that name.
  const OpSchema* find(const std::string& name) const;
  std::vector<std::string> names() const;

 private:
  std::map<std::string, OpSchema> ops_;
};

/// Context parallelism's load-balanced order (seq_permute, sdpa's `chunks`): the piece of the
/// natural order that slot `slot` of `chunks` holds: 0, chunks - 1, 1, chunks - 2, ... (with
/// chunks = 2 cp, rank r of cp holds pieces r and 2 cp - 1 - r).
std::int64_t balanced_piece(std::int64_t slot, std::int64_t chunks);

/// Whether an sdpa or sdpa_backward node attends by blocks of query rows at known positions:
/// causal, with a load-balanced sequence (chunks > 1) or a rank's rows (q_offset > 0). The
/// kernel (exec/kernels.cpp) and the memory plan both ask.
bool blocked_attention(const Node& node);

/// The natural-order position of row `row` of a sequence of `total` rows held in context
/// parallelism's load-balanced order of `chunks` pieces (chunks = 1: the row itself).
std::int64_t natural_position(std::int64_t row, std::int64_t total, std::int64_t chunks);

/// Query rows per tile of the tiled attention kernel (exec/kernels.h, tiled_attention).
constexpr std::int64_t kAttentionTile = 64;

/// One tile of tiled attention: `rows` query rows from local row `row0`, at the consecutive
/// natural positions from `position`, and the natural key positions [key_begin, key_end) the
/// kernel visits for them (every other key is masked for every row of the tile).
struct AttentionTile {
  std::int64_t row0, rows, position, key_begin, key_end;
};

/// The tiles of q's `q_rows` rows (sdpa's chunks and q_offset place them, as the causal path)
/// over `kv_rows` keys, causal within a window of `window` tokens (0: none): a query at
/// position i sees keys i - window < j <= i, as transformers' sliding_window_causal_mask.
/// The kernel, the memory plan and the cost model all walk these.
std::vector<AttentionTile> attention_tiles(std::int64_t q_rows, std::int64_t kv_rows, std::int64_t chunks, std::int64_t q_offset, std::int64_t window);

/// Whether an sdpa or sdpa_backward node runs the tiled kernel: a sliding window (window > 0)
/// or document masking (a fourth input of document ids, block_causal).
bool tiled_attention(const Node& node);

/// The tiles of a tiled sdpa or sdpa_backward node, from its shapes and attributes.
std::vector<AttentionTile> attention_tiles(const Node& node);

}  // namespace spmdx::ir
