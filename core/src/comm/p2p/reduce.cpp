// The engine's reductions (spmdx/comm/reduce.h): IEEE half and bfloat16 conversions and the
// vectorised hot loop of float all_reduce and reduce_scatter.
#include "spmdx/comm/reduce.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace spmdx::comm {
namespace {

void copy_bytes(void* dst, const void* src, std::size_t n) {
  if (n > 0) std::memcpy(dst, src, n);
}

// IEEE half and bfloat16 <-> float.
float half_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000) << 16;
  std::uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal
      exp = 127 - 15 + 1;
      while (!(mant & 0x400)) mant <<= 1, --exp;
      bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000 | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  copy_bytes(&f, &bits, 4);
  return f;
}

std::uint16_t float_to_half(float f) {
  std::uint32_t x;
  copy_bytes(&x, &f, 4);
  const std::uint32_t sign = (x >> 16) & 0x8000;
  const int exp = static_cast<int>((x >> 23) & 0xff) - 127 + 15;
  std::uint32_t mant = x & 0x7fffff;
  if (((x >> 23) & 0xff) == 0xff) return static_cast<std::uint16_t>(sign | 0x7c00 | (mant ? 0x200 : 0));
  if (exp >= 31) return static_cast<std::uint16_t>(sign | 0x7c00);
  if (exp <= 0) {
    if (exp < -10) return static_cast<std::uint16_t>(sign);
    mant |= 0x800000;
    const int shift = 14 - exp;
    std::uint32_t h = mant >> shift;
    if ((mant >> (shift - 1)) & 1) ++h;  // round half up
    return static_cast<std::uint16_t>(sign | h);
  }
  std::uint32_t h = sign | (static_cast<std::uint32_t>(exp) << 10) | (mant >> 13);
  if ((mant & 0x1fff) > 0x1000 || ((mant & 0x1fff) == 0x1000 && (h & 1))) ++h;  // round to nearest even
  return static_cast<std::uint16_t>(h);
}

float bf16_to_float(std::uint16_t b) {
  const std::uint32_t bits = static_cast<std::uint32_t>(b) << 16;
  float f;
  copy_bytes(&f, &bits, 4);
  return f;
}

std::uint16_t float_to_bf16(float f) {
  std::uint32_t x;
  copy_bytes(&x, &f, 4);
  if ((x & 0x7fffffff) > 0x7f800000) return static_cast<std::uint16_t>((x >> 16) | 0x40);  // NaN stays NaN
  x += 0x7fff + ((x >> 16) & 1);  // round to nearest even
  return static_cast<std::uint16_t>(x >> 16);
}

template <class T>
T apply(T a, T b, ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg: return static_cast<T>(a + b);
    case ReduceOp::max: return std::max(a, b);
    case ReduceOp::min: return std::min(a, b);
    case ReduceOp::prod: return static_cast<T>(a * b);
  }
  return a;
}

// The hot loop of float all_reduce and reduce_scatter, compiled for AVX-512, AVX2 and the
// baseline, picked at load time (GCC's function multiversioning).
__attribute__((target_clones("avx512f", "avx2", "default"))) void sum_f32(float* __restrict d, const float* __restrict s, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) d[i] += s[i];
}

template <class T>
void reduce_typed(void* dst, const void* src, std::size_t n, ReduceOp op) {
  if constexpr (std::is_same_v<T, float>) {
    if (op == ReduceOp::sum || op == ReduceOp::avg) return sum_f32(static_cast<float*>(dst), static_cast<const float*>(src), n);
  }
  T* __restrict d = static_cast<T*>(dst);
  const T* __restrict s = static_cast<const T*>(src);
  // One loop per op, so that the compiler vectorises each.
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      for (std::size_t i = 0; i < n; ++i) d[i] = static_cast<T>(d[i] + s[i]);
      break;
    case ReduceOp::max:
      for (std::size_t i = 0; i < n; ++i) d[i] = d[i] < s[i] ? s[i] : d[i];
      break;
    case ReduceOp::min:
      for (std::size_t i = 0; i < n; ++i) d[i] = s[i] < d[i] ? s[i] : d[i];
      break;
    case ReduceOp::prod:
      for (std::size_t i = 0; i < n; ++i) d[i] = static_cast<T>(d[i] * s[i]);
      break;
  }
}

template <float (*To)(std::uint16_t), std::uint16_t (*From)(float)>
void reduce_16(void* dst, const void* src, std::size_t n, ReduceOp op) {
  auto* d = static_cast<std::uint16_t*>(dst);
  const auto* s = static_cast<const std::uint16_t*>(src);
  for (std::size_t i = 0; i < n; ++i) d[i] = From(apply(To(d[i]), To(s[i]), op));
}

}  // namespace

void reduce_into(void* dst, const void* src, std::size_t count, CommDType dtype, ReduceOp op) {
  switch (dtype) {
    case CommDType::f32: reduce_typed<float>(dst, src, count, op); break;
    case CommDType::f64: reduce_typed<double>(dst, src, count, op); break;
    case CommDType::i32: reduce_typed<std::int32_t>(dst, src, count, op); break;
    case CommDType::i64: reduce_typed<std::int64_t>(dst, src, count, op); break;
    case CommDType::u8: reduce_typed<std::uint8_t>(dst, src, count, op); break;
    case CommDType::f16: reduce_16<half_to_float, float_to_half>(dst, src, count, op); break;
    case CommDType::bf16: reduce_16<bf16_to_float, float_to_bf16>(dst, src, count, op); break;
  }
}

void divide(void* data, std::size_t n, CommDType dtype, double divisor) {
  auto div = [&](auto* p) {
    for (std::size_t i = 0; i < n; ++i) p[i] = static_cast<std::remove_reference_t<decltype(*p)>>(p[i] / divisor);
  };
  switch (dtype) {
    case CommDType::f32: div(static_cast<float*>(data)); break;
    case CommDType::f64: div(static_cast<double*>(data)); break;
    case CommDType::i32: div(static_cast<std::int32_t*>(data)); break;
    case CommDType::i64: div(static_cast<std::int64_t*>(data)); break;
    case CommDType::u8: div(static_cast<std::uint8_t*>(data)); break;
    case CommDType::f16: {
      auto* p = static_cast<std::uint16_t*>(data);
      for (std::size_t i = 0; i < n; ++i) p[i] = float_to_half(static_cast<float>(half_to_float(p[i]) / divisor));
      break;
    }
    case CommDType::bf16: {
      auto* p = static_cast<std::uint16_t*>(data);
      for (std::size_t i = 0; i < n; ++i) p[i] = float_to_bf16(static_cast<float>(bf16_to_float(p[i]) / divisor));
      break;
    }
  }
}
}  // namespace spmdx::comm
