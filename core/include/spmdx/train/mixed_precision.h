// Mixed precision as a pass over the forward graph (FSDP2's MixedPrecisionPolicy, torchtitan's
// training.mixed_precision_param / mixed_precision_reduce): parameters and optimizer state stay
// float32 graph inputs; the forward computes in the param dtype through cast nodes, so
// sharding sees them (FSDP all-gathers the cast shards: half the bytes), and autodiff sends the
// gradients back through the casts to float32, where they are reduced.
#pragma once

#include <cstdint>
#include <string>

#include "spmdx/ir/graph.h"

namespace spmdx::train {

/// [training] mixed_precision_param and mixed_precision_reduce, as torchtitan names them.
struct MixedPrecision {
  std::string param = "float32";   ///< "float32" (off), "bfloat16" or "float16": the forward's and backward's dtype
  std::string reduce = "float32";  ///< gradients are reduced in float32 (torchtitan's only choice)
  double init_scale = 65536.0;          ///< float16: training.grad_scaler_init_scale
  std::int64_t growth_interval = 2000;  ///< float16: training.grad_scaler_growth_interval
};

/// float16's dynamic loss scale, updated on the host after each step as
/// torch.amp.GradScaler.update (_amp_update_scale_): a step whose gradients overflowed (its
/// update skipped) multiplies the scale by backoff_factor (0.5) and restarts the count;
/// growth_interval steps in a row without overflow multiply it by growth_factor (2.0).
struct GradScaler {
  double scale = 65536.0;
  std::int64_t growth_interval = 2000;
  std::int64_t growth_tracker = 0;  ///< steps without overflow since the scale last changed
  double growth_factor = 2.0, backoff_factor = 0.5;

  /// After a step: found_inf says its gradients overflowed. Returns the new scale.
  double update(bool found_inf) {
    if (found_inf) {
      scale *= backoff_factor;
      growth_tracker = 0;
    } else if (++growth_tracker == growth_interval) {
      scale *= growth_factor;
      growth_tracker = 0;
    }
    return scale;
  }
};

/// Rewrites a forward graph (inputs in float32, output "loss") to compute in `compute` (bf16,
/// f16) where PyTorch does under FSDP2 mixed precision and torchtitan's model code:
/// - matmul, linear, sdpa and embedding read their floating inputs cast to `compute` (a
///   parameter is cast once, where it is read; a value once per dtype);
/// - rms_norm, layer_norm, softmax, log_softmax, cross_entropy, sum and mean read theirs in
///   float32 (torchtitan's RMSNorm normalises x.float(); its loss upcasts the logits), so the
///   loss is float32;
/// - every other op runs in its inputs' dtype, the widest when they differ (autocast's promote).
/// Returns the new graph (same inputs and outputs by name). Throws ir::IrError from shape
/// inference when an op does not take the dtype.
ir::Graph cast_for_mixed_precision(const ir::Graph& forward, ir::DType compute);

}  // namespace spmdx::train
