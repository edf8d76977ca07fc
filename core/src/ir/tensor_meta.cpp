#include "spmdx/ir/tensor_meta.h"

#include <stdexcept>

namespace spmdx::ir {

const char* to_string(DType dtype) noexcept {
  switch (dtype) {
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::f16: return "f16";
    case DType::bf16: return "bf16";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::u8: return "u8";
    case DType::boolean: return "bool";
  }
  return "?";
}

std::optional<DType> parse_dtype(std::string_view text) noexcept {
  for (DType d : {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i32, DType::i64, DType::u8, DType::boolean}) {
    if (text == to_string(d)) return d;
  }
  return std::nullopt;
}

std::size_t element_size(DType dtype) noexcept {
  switch (dtype) {
    case DType::f64:
    case DType::i64: return 8;
    case DType::f32:
    case DType::i32: return 4;
    case DType::f16:
    case DType::bf16: return 2;
    case DType::u8:
    case DType::boolean: return 1;
  }
  return 0;
}

bool is_floating(DType dtype) noexcept {
  return dtype == DType::f32 || dtype == DType::f64 || dtype == DType::f16 || dtype == DType::bf16;
}

std::int64_t TensorMeta::numel() const noexcept {
  std::int64_t n = 1;
  for (auto s : shape) n *= s;
  return n;
}

std::int64_t TensorMeta::numel_without(std::int64_t dim) const {
  const std::int64_t r = rank();
  if (dim < -r || dim >= r) {
    throw std::out_of_range("dim " + std::to_string(dim) + " is outside a tensor of shape " + shape_str(shape));
  }
  if (dim < 0) dim += r;
  std::int64_t n = 1;
  for (std::int64_t i = 0; i < r; ++i) {
    if (i != dim) n *= shape[static_cast<std::size_t>(i)];
  }
  return n;
}

std::string shape_str(const std::vector<std::int64_t>& shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

std::string TensorMeta::str() const { return std::string(to_string(dtype)) + shape_str(shape); }

}  // namespace spmdx::ir
