// Op schemas: for each IR op, its inputs, attributes and shape/dtype inference.
// Kernels (ATen) and VJP rules are registered elsewhere against the same names, so the IR
// needs neither LibTorch nor autodiff.
#pragma once

#include <functional>
#include <map>
#include <optional>
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

/// A VJP rule: for a forward node and the gradients of its outputs (zeros_like where an output
/// reaches no loss), appends IR computing the gradients of its inputs; nullptr for an input that
/// takes none (indices). The rules follow PyTorch's tools/autograd/derivatives.yaml.
using VjpRule = std::function<std::vector<Value*>(Graph& graph, const Node& node, const std::vector<Value*>& grad_outputs)>;

/// Floating-point operations of one node (2MNK per matmul, one per output element for
/// elementwise ops), what the cost model (sharding/cost_model.h) and MFU count.
using FlopsFn = std::function<double(const Node& node)>;

/// What the memory plan (plan/memory_plan.h) knows of a node's inputs as it simulates a step:
/// each one's strides (in elements, as ATen's kernels give them), and whether it is contiguous
/// or dense (non-overlapping and without gaps, in some order).
struct LayoutQuery {
  std::function<std::vector<std::int64_t>(int input)> strides;
  std::function<bool(int input)> contiguous;
  std::function<bool(int input)> dense;
};

/// Bytes a kernel allocates beyond its outputs while it runs (ATen temporaries, contiguous()
/// copies of strided inputs).
using ScratchFn = std::function<std::int64_t(const Node& node, const LayoutQuery& inputs)>;

/// The layout of output k as the op's kernel makes it: its strides, and whether it is a view of
/// input 0's storage (transpose, a reshape that can view). nullopt: the default, which is
/// TensorIterator's for an elementwise op (the strides of its first dense input of the output's
/// shape) and contiguous for any other.
struct OutputLayout {
  std::vector<std::int64_t> strides;
  bool view = false;
};
using LayoutFn = std::function<std::optional<OutputLayout>(const Node& node, std::size_t k, const LayoutQuery& inputs)>;
/// Dense strides for `shape` laid out in the order of `like`'s strides (outermost = largest),
/// as ATen's TensorIterator and empty_like give an elementwise output of a permuted input.
std::vector<std::int64_t> dense_like(const std::vector<std::int64_t>& shape, const std::vector<std::int64_t>& like);

/// How mixed precision (train/mixed_precision.h, torch.autocast's CPU/CUDA lists and
/// torchtitan's FSDP2 MixedPrecisionPolicy) casts the op's floating inputs.
enum class Precision {
  promote,           ///< as it comes: the widest floating dtype among the inputs, when they differ
  low,               ///< the compute dtype (autocast's lower-precision list: matmuls, attention)
  float32,           ///< float32 (autocast's float32 list: reductions, softmax, losses)
  float32_cast_back  ///< float32, the output cast back to input 0's dtype (RMSNorm's type_as(x))
};

/// One input of a conformance sample: its shape and how random values fill it.
struct SampleInput {
  enum class Fill {
    normal,    ///< N(0, 1)
    positive,  ///< >= 0.5 (log, sqrt, divisors)
    indices,   ///< int64 in [0, bound)
    constant,  ///< N(0, 1), no gradient taken (a mask, a saved value)
    value,     ///< every element `value`, no gradient taken (a hyperparameter: adamw's lr, step, found_inf)
    nonfinite, ///< N(0, 1) with one +inf, at flat element numel / 2 (found_inf); no gradient taken
    nonnegative,  ///< max(N(0, 1), 0): a relu's output (relu_backward's saved y)
    offsets,   ///< nondecreasing ints in [0, bound], the last = bound: grouped_mm's offs (each group's end row); int64 unless `dtype`
  };
  std::vector<std::int64_t> shape;
  Fill fill = Fill::normal;
  std::int64_t bound = 5;  ///< indices: the exclusive upper bound; offsets: the last offset
  double value = 0;        ///< value: the elements' value
  std::optional<DType> dtype = std::nullopt;  ///< the input's dtype where it is not the test's floating dtype (adamw's found_inf: f32; offsets: i32)
};

/// A small instance of the op for the conformance test (tests/ops_conformance_test.cpp), as
/// PyTorch's OpInfo sample_inputs: its gradient against LibTorch autograd of its kernel, its
/// sharding rules run on 2, 3 and 2 x 2 ranks.
struct Sample {
  std::string label;
  std::vector<SampleInput> inputs;
  Attributes attrs;
  bool gradient = true;  ///< false: rules only (a backward op, or one without a VJP)
};

/// One op, one record (issue 45): everything the passes need to know about an op, defined in
/// one place (core/src/ops/, each family's file) and read by each layer through
/// OpRegistry::global(). Sharding rules and the ATen kernel, which need types from the layers
/// above the IR, are defined next to the record in the same file (sharding::define_rules,
/// exec::define_kernel).
struct OpSchema {
  std::string name;
  int min_inputs = 0;
  int max_inputs = 0;  ///< -1: any number (cat)
  std::vector<AttrSpec> attrs;
  InferFn infer;
  VjpRule vjp;                 ///< empty: not differentiable (a backward op, integer outputs)
  FlopsFn flops;               ///< empty: one per output element (CostModel's default)
  std::vector<int> in_place;   ///< inputs the output may be written into, in preference order (plan/memory_plan.h); adamw: one per output
  ScratchFn scratch;           ///< empty: none
  LayoutFn layout;             ///< empty: the default (OutputLayout)
  bool elementwise = false;    ///< each output element from the same element of each input (memory plan, fusion)
  Precision precision = Precision::promote;
  bool saved_by_selective = false;  ///< selective activation checkpointing keeps its output (torchtitan's op SAC list)
  std::vector<Sample> samples;
  bool defined_by_record = false;  ///< set by OpRegistry::define (core/src/ops/); ops_conformance_test checks every op has it
};

class OpRegistry {
 public:
  /// The registry with every op: the records of core/src/ops/, defined at load time.
  static const OpRegistry& global();

  /// Throws std::invalid_argument when the name is taken.
  void add(OpSchema schema);
  /// Adds one op's record to the global registry (core/src/ops/ at load time). Throws
  /// std::invalid_argument when the name is taken.
  static void define(OpSchema schema);
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
