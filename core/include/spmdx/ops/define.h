// One op, one record (issue 45): each op of the IR is defined in one place, a family's file in
// core/src/ops/ (elementwise.cpp, ...), with everything the layers need to know of it:
//   SPMDX_OP(record)           its ir::OpSchema: inputs, attributes, shape and dtype inference,
//                              VJP, FLOPs, memory behaviour (in place, views, scratch),
//                              mixed-precision and recompute policy, conformance samples; and
//                              its sharding rules (sharding::Rule, local attributes);
//   SPMDX_KERNEL(name, ...)    its ATen kernel (exec::Kernel) and in-place twin.
// Each file is compiled twice: into libspmdx_core (the records; LibTorch-free, as the IR must
// be) and into libspmdx_exec with SPMDX_OPS_KERNELS (the kernels). Each macro expands to a
// registration at load time in its library and to nothing in the other, so neither library sees
// the other's half. tests/ops_conformance_test.cpp walks every record.
#pragma once

#include <string>

#include "spmdx/ir/ops.h"
#include "spmdx/sharding/rules.h"

#if defined(SPMDX_OPS_KERNELS)
#include <ATen/ATen.h>

#include "spmdx/exec/kernels.h"
#endif

namespace spmdx::ops {

/// An op's record: the IR's part and its sharding rules.
struct Op {
  ir::OpSchema schema;
  sharding::Rule rules;                    ///< empty: the rewriter places it (communication ops)
  sharding::LocalAttrsFn local_attrs;      ///< empty: a rank's node keeps the attributes
};

/// Registers the record with ir::OpRegistry::define and sharding::define_rules.
inline bool define(Op op) {
  if (op.rules) sharding::define_rules(op.schema.name, std::move(op.rules), std::move(op.local_attrs));
  ir::OpRegistry::define(std::move(op.schema));
  return true;
}

}  // namespace spmdx::ops

#define SPMDX_OPS_CAT2(a, b) a##b
#define SPMDX_OPS_CAT(a, b) SPMDX_OPS_CAT2(a, b)

#if defined(SPMDX_OPS_KERNELS)
#define SPMDX_OP(...)
#define SPMDX_KERNEL(name, ...) \
  [[maybe_unused]] static const bool SPMDX_OPS_CAT(spmdx_kernel_, __LINE__) = (::spmdx::exec::define_kernel(name, __VA_ARGS__), true);
#else
#define SPMDX_OP(...) [[maybe_unused]] static const bool SPMDX_OPS_CAT(spmdx_op_, __LINE__) = ::spmdx::ops::define(__VA_ARGS__);
#define SPMDX_KERNEL(name, ...)
#endif
