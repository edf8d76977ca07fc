// What the IR knows of a tensor without its data: shape, dtype, device, requires_grad
// (as FX's `meta["val"]` fake tensors). No LibTorch here: the executor maps DType to ATen.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace spmdx::ir {

/// Element types, with the names PyTorch prints in short form (torch.float32 -> "f32").
enum class DType : std::uint8_t { f32, f64, f16, bf16, i32, i64, u8, boolean };

/// "f32", "f64", "f16", "bf16", "i32", "i64", "u8", "bool".
const char* to_string(DType dtype) noexcept;
/// The inverse of to_string; nullopt for anything else.
std::optional<DType> parse_dtype(std::string_view text) noexcept;
/// Bytes per element: 4, 8, 2, 2, 4, 8, 1, 1.
std::size_t element_size(DType dtype) noexcept;
bool is_floating(DType dtype) noexcept;

struct TensorMeta {
  std::vector<std::int64_t> shape;  ///< sizes in elements; empty for a scalar
  DType dtype = DType::f32;
  std::string device = "cpu";       ///< "cpu" or "cuda"
  bool requires_grad = false;

  std::int64_t rank() const noexcept { return static_cast<std::int64_t>(shape.size()); }
  std::int64_t numel() const noexcept;
  std::int64_t nbytes() const noexcept { return numel() * static_cast<std::int64_t>(element_size(dtype)); }
  /// The product of every size but dim's (negative dims count from the end): the rows of a
  /// tensor reduced over its last dim, or the inner elements of one index along dim. Not
  /// numel() / shape[dim], which divides by zero for a zero-size dim (PyTorch allows them:
  /// Phi3's full-rotary slice is [b, h, s, 0]). Throws std::out_of_range for a dim outside.
  std::int64_t numel_without(std::int64_t dim) const;
  /// "f32[8, 64]"; "f32[]" for a scalar; device and requires_grad are not printed.
  std::string str() const;

  friend bool operator==(const TensorMeta&, const TensorMeta&) = default;
};

/// "[8, 64]".
std::string shape_str(const std::vector<std::int64_t>& shape);

}  // namespace spmdx::ir
