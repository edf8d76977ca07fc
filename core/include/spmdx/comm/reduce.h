// Elementwise reductions of communication buffers, as the collective engine and test oracles
// run them: the same code, so an oracle's bits are the engine's.
#pragma once

#include <cstddef>

#include "spmdx/comm.h"

namespace spmdx::comm {

/// dst[i] = dst[i] op src[i] for `count` elements of `dtype` (avg sums; divide afterwards).
/// f16 and bf16 are reduced in float and rounded back to nearest (ties to even for normal
/// values), as NCCL and gloo reduce half types.
void reduce_into(void* dst, const void* src, std::size_t count, CommDType dtype, ReduceOp op);
/// data[i] /= divisor, for `count` elements of `dtype` (integers truncate toward zero).
void divide(void* data, std::size_t count, CommDType dtype, double divisor);

}  // namespace spmdx::comm
