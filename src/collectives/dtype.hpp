// Element types and reductions of the collectives.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace cmesh::coll {

enum class dtype : uint8_t { float32 = 0, bfloat16 = 1, int64 = 2 };
enum class reduce_op : uint8_t { sum = 0, avg = 1, max = 2 };

constexpr size_t size_of(dtype t) {
  switch (t) {
    case dtype::float32: return 4;
    case dtype::bfloat16: return 2;
    case dtype::int64: return 8;
  }
  return 0;
}

std::string_view to_string(dtype t);
std::string_view to_string(reduce_op op);

/// bfloat16 stored as its 16 raw bits.
struct bf16 {
  uint16_t bits = 0;
  bool operator==(const bf16&) const = default;
};

/// Round-to-nearest-even conversion (NaN stays NaN).
bf16 to_bf16(float x);
float from_bf16(bf16 x);

template <class T>
constexpr dtype dtype_of();
template <>
constexpr dtype dtype_of<float>() { return dtype::float32; }
template <>
constexpr dtype dtype_of<bf16>() { return dtype::bfloat16; }
template <>
constexpr dtype dtype_of<int64_t>() { return dtype::int64; }

/// dst[i] = dst[i] (op) src[i] for i < count; avg accumulates as sum (the
/// caller divides once at the end). Vectorised by the compiler. int64 sums
/// are checked: an element that overflowed, or met the marker, becomes the
/// sticky marker INT64_MIN, and the call returns false (true otherwise), so
/// an overflow anywhere in a distributed sum reaches every member's result.
[[nodiscard]] bool reduce_into(void* dst, const void* src, size_t count, dtype t, reduce_op op);

/// dst[i] = a[i] (op) b[i] for i < count, in one pass: reduce_into with the
/// first operand elsewhere (the same bits, the same overflow rules). dst must
/// not overlap a or b.
[[nodiscard]] bool reduce_to(void* dst, const void* a, const void* b, size_t count, dtype t,
                             reduce_op op);

/// Divides each element by n (the end of an avg); int64 truncates toward zero.
void scale_down(void* buf, size_t count, dtype t, size_t n);

} // namespace cmesh::coll
