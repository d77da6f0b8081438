// Element types and reductions of the collectives.
//
// Every reduction is elementwise: dst[i] = dst[i] (op) src[i], never a
// reassociation across elements, so the vectorised loops give the same bits
// as a plain scalar loop.
//
// Vectorisation: GCC 12 at -O2 uses the "very cheap" cost model, which does
// not vectorise a loop whose trip count is unknown (it would need a scalar
// epilogue). So every kernel walks the buffer in blocks of kBlock elements
// with a fixed-count inner loop (vectorised at -O2 and -O3, by GCC and
// Clang), then finishes the tail with a scalar loop. The pointers are
// __restrict: dst and src must not overlap.
#include "collectives/dtype.hpp"

#include <cstring>

namespace cmesh::coll {

std::string_view to_string(dtype t) {
  switch (t) {
    case dtype::float32: return "float32";
    case dtype::bfloat16: return "bfloat16";
    case dtype::int64: return "int64";
  }
  return "unknown_dtype";
}

std::string_view to_string(reduce_op op) {
  switch (op) {
    case reduce_op::sum: return "sum";
    case reduce_op::avg: return "avg";
    case reduce_op::max: return "max";
  }
  return "unknown_reduce_op";
}

namespace {

constexpr size_t kBlock = 16;

inline uint32_t float_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

inline float bits_float(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// Branch-free so that the bf16 loops vectorise.
inline uint16_t bf16_round(float x) {
  uint32_t u = float_bits(x);
  // Round to nearest, ties to even: add 0x7FFF plus the lowest kept bit.
  // Finite values that round past the largest bf16 carry into the exponent
  // and become infinity, which is the correct rounding; infinities have a
  // zero low half and stay as they are.
  uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  // NaN: keep the sign and the top of the payload, force the quiet bit so a
  // payload living only in the dropped low bits cannot turn into infinity.
  uint32_t quiet_nan = (u >> 16) | 0x0040u;
  bool is_nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return static_cast<uint16_t>(is_nan ? quiet_nan : rounded);
}

inline float bf16_widen(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

// max that propagates NaN from either side (so the result does not depend on
// the order of the members when one of them holds a NaN).
inline float max_nan(float a, float b) { return (b > a || b != b) ? b : a; }

struct f32_add { float operator()(float a, float b) const { return a + b; } };
struct f32_max { float operator()(float a, float b) const { return max_nan(a, b); } };
struct bf16_add {
  uint16_t operator()(uint16_t a, uint16_t b) const {
    return bf16_round(bf16_widen(a) + bf16_widen(b));
  }
};
struct bf16_max {
  // The larger of two bf16 values is one of them: no rounding needed.
  uint16_t operator()(uint16_t a, uint16_t b) const {
    float fa = bf16_widen(a), fb = bf16_widen(b);
    return (fb > fa || fb != fb) ? b : a;
  }
};
struct i64_max {
  int64_t operator()(int64_t a, int64_t b) const { return b > a ? b : a; }
};

template <class T, class Op>
void apply(T* __restrict d, const T* __restrict s, size_t n, Op op) {
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock)
    for (size_t j = 0; j < kBlock; ++j)
      d[i + j] = op(d[i + j], s[i + j]);
  for (; i < n; ++i)
    d[i] = op(d[i], s[i]);
}

template <class T, class Op>
void apply_to(T* __restrict d, const T* __restrict a, const T* __restrict b, size_t n, Op op) {
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock)
    for (size_t j = 0; j < kBlock; ++j)
      d[i + j] = op(a[i + j], b[i + j]);
  for (; i < n; ++i)
    d[i] = op(a[i], b[i]);
}

// Checked int64 sum with a sticky overflow marker: an element whose sum
// overflowed, or either of whose operands is the marker (INT64_MIN), becomes
// INT64_MIN. So an overflow anywhere in a distributed reduction shows in the
// final data on every member, whoever detected it. The test is
// __builtin_add_overflow written on the bits (overflow iff both operands
// have the sign opposite to the wrapped result) as a branch-free select,
// because GCC does not vectorise the builtin.
bool add_checked(int64_t* __restrict d, const int64_t* __restrict s, size_t n) {
  constexpr uint64_t marker = uint64_t{1} << 63;
  auto step = [](uint64_t a, uint64_t b) {
    uint64_t r = a + b;
    uint64_t bad = static_cast<uint64_t>(static_cast<int64_t>((a ^ r) & (b ^ r)) >> 63)
                   | (uint64_t{0} - static_cast<uint64_t>(a == marker))
                   | (uint64_t{0} - static_cast<uint64_t>(b == marker));
    return (r & ~bad) | (marker & bad);
  };
  uint64_t lane_flags[kBlock] = {};
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock)
    for (size_t j = 0; j < kBlock; ++j) {
      uint64_t r = step(static_cast<uint64_t>(d[i + j]), static_cast<uint64_t>(s[i + j]));
      lane_flags[j] |= static_cast<uint64_t>(r == marker);
      d[i + j] = static_cast<int64_t>(r);
    }
  uint64_t flags = 0;
  for (size_t j = 0; j < kBlock; ++j)
    flags |= lane_flags[j];
  for (; i < n; ++i) {
    uint64_t r = step(static_cast<uint64_t>(d[i]), static_cast<uint64_t>(s[i]));
    flags |= static_cast<uint64_t>(r == marker);
    d[i] = static_cast<int64_t>(r);
  }
  return flags == 0;
}

void div_f32(float* __restrict d, size_t n, float q) {
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock)
    for (size_t j = 0; j < kBlock; ++j)
      d[i + j] = d[i + j] / q;
  for (; i < n; ++i)
    d[i] = d[i] / q;
}

void div_bf16(uint16_t* __restrict d, size_t n, float q) {
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock)
    for (size_t j = 0; j < kBlock; ++j)
      d[i + j] = bf16_round(bf16_widen(d[i + j]) / q);
  for (; i < n; ++i)
    d[i] = bf16_round(bf16_widen(d[i]) / q);
}

void div_i64(int64_t* __restrict d, size_t n, int64_t q) {
  for (size_t i = 0; i < n; ++i)
    d[i] /= q; // C++ division truncates toward zero
}

} // namespace

bf16 to_bf16(float x) { return bf16{bf16_round(x)}; }

float from_bf16(bf16 x) { return bf16_widen(x.bits); }

// bf16 buffers are handled as their raw uint16_t bits (bf16 is a standard
// layout struct holding exactly one uint16_t).
static_assert(sizeof(bf16) == sizeof(uint16_t) && alignof(bf16) == alignof(uint16_t));

bool reduce_into(void* dst, const void* src, size_t count, dtype t, reduce_op op) {
  // avg accumulates as a sum; the caller divides once at the end.
  bool is_max = op == reduce_op::max;
  if (op != reduce_op::sum && op != reduce_op::avg && !is_max)
    return true; // not a reduce_op: nothing to do
  switch (t) {
    case dtype::float32: {
      auto* d = static_cast<float*>(dst);
      auto* s = static_cast<const float*>(src);
      if (is_max)
        apply(d, s, count, f32_max{});
      else
        apply(d, s, count, f32_add{});
      return true;
    }
    case dtype::bfloat16: {
      auto* d = static_cast<uint16_t*>(dst);
      auto* s = static_cast<const uint16_t*>(src);
      if (is_max)
        apply(d, s, count, bf16_max{});
      else
        apply(d, s, count, bf16_add{});
      return true;
    }
    case dtype::int64: {
      auto* d = static_cast<int64_t*>(dst);
      auto* s = static_cast<const int64_t*>(src);
      if (is_max) {
        apply(d, s, count, i64_max{});
        return true;
      }
      return add_checked(d, s, count);
    }
  }
  return true;
}

namespace {

template <class T, class Add, class Max>
void apply_to_typed(void* dst, const void* a, const void* b, size_t count, bool is_max) {
  auto* d = static_cast<T*>(dst);
  auto* x = static_cast<const T*>(a);
  auto* y = static_cast<const T*>(b);
  if (is_max)
    apply_to(d, x, y, count, Max{});
  else
    apply_to(d, x, y, count, Add{});
}

} // namespace

bool reduce_to(void* dst, const void* a, const void* b, size_t count, dtype t, reduce_op op) {
  bool is_max = op == reduce_op::max;
  if (op != reduce_op::sum && op != reduce_op::avg && !is_max)
    return true; // not a reduce_op: nothing to do
  switch (t) {
    case dtype::float32:
      apply_to_typed<float, f32_add, f32_max>(dst, a, b, count, is_max);
      return true;
    case dtype::bfloat16:
      apply_to_typed<uint16_t, bf16_add, bf16_max>(dst, a, b, count, is_max);
      return true;
    case dtype::int64:
      if (is_max) {
        apply_to(static_cast<int64_t*>(dst), static_cast<const int64_t*>(a),
                 static_cast<const int64_t*>(b), count, i64_max{});
        return true;
      }
      // The checked sum keeps its one loop: a copy, then the sum in place.
      if (count > 0)
        std::memcpy(dst, a, count * sizeof(int64_t));
      return add_checked(static_cast<int64_t*>(dst), static_cast<const int64_t*>(b), count);
  }
  return true;
}

// n == 0 and n == 1 leave the buffer as it is. float32 divides by (float)n,
// exactly what a serial `sum / n` would do (multiplying by 1/n would not give
// the same bits); bf16 divides in float and rounds back once.
void scale_down(void* buf, size_t count, dtype t, size_t n) {
  if (n <= 1)
    return;
  switch (t) {
    case dtype::float32:
      div_f32(static_cast<float*>(buf), count, static_cast<float>(n));
      return;
    case dtype::bfloat16:
      div_bf16(static_cast<uint16_t*>(buf), count, static_cast<float>(n));
      return;
    case dtype::int64:
      div_i64(static_cast<int64_t*>(buf), count, static_cast<int64_t>(n));
      return;
  }
}

} // namespace cmesh::coll
