#include "spmdx/exec/dtype.h"

#include <stdexcept>
#include <string>

namespace spmdx::exec {

at::ScalarType to_aten(ir::DType dtype) {
  switch (dtype) {
    case ir::DType::f32: return at::kFloat;
    case ir::DType::f64: return at::kDouble;
    case ir::DType::f16: return at::kHalf;
    case ir::DType::bf16: return at::kBFloat16;
    case ir::DType::i32: return at::kInt;
    case ir::DType::i64: return at::kLong;
    case ir::DType::u8: return at::kByte;
    case ir::DType::boolean: return at::kBool;
  }
  return at::kFloat;
}

ir::DType from_aten(at::ScalarType type) {
  for (auto d : {ir::DType::f32, ir::DType::f64, ir::DType::f16, ir::DType::bf16, ir::DType::i32, ir::DType::i64,
                 ir::DType::u8, ir::DType::boolean}) {
    if (to_aten(d) == type) return d;
  }
  throw std::invalid_argument(std::string("no IR dtype for ATen type ") + c10::toString(type));
}

}  // namespace spmdx::exec
