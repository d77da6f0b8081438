#include "collectives/dtype.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <ios>
#include <limits>
#include <random>
#include <vector>

using namespace cmesh::coll;

namespace {

uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

bool same_bits(float a, float b) { return bits_of(a) == bits_of(b); }

// Reference bf16 rounding written differently from the implementation: via
// double arithmetic on the two neighbouring bf16 values.
uint16_t ref_bf16(float x) {
  if (std::isnan(x))
    return static_cast<uint16_t>((bits_of(x) >> 16) | 0x40);
  uint32_t u = bits_of(x);
  uint16_t lo = static_cast<uint16_t>(u >> 16); // truncated toward zero
  if ((u & 0xFFFF) == 0)
    return lo;
  uint16_t hi = static_cast<uint16_t>(lo + 1); // next away from zero (may be inf)
  double dx = std::fabs(static_cast<double>(x));
  double dlo = std::fabs(static_cast<double>(float_of(uint32_t{lo} << 16)));
  double dhi = std::fabs(static_cast<double>(float_of(uint32_t{hi} << 16)));
  if ((hi & 0x7FFF) == 0x7F80) // rounding up gives infinity: the midpoint is 2^128 - 2^119
    dhi = std::ldexp(1.0, 128);
  if (dx - dlo < dhi - dx)
    return lo;
  if (dx - dlo > dhi - dx)
    return hi;
  return (lo & 1) ? hi : lo;
}

const size_t kSizes[] = {0, 1, 7, 8, 9, 1000, 100003};

template <class T>
std::vector<T> random_values(std::mt19937_64& rng, size_t n);

template <>
std::vector<float> random_values<float>(std::mt19937_64& rng, size_t n) {
  std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
  std::uniform_int_distribution<int> expo(-20, 20);
  std::vector<float> v(n);
  for (auto& x : v)
    x = std::ldexp(mant(rng), expo(rng));
  return v;
}

template <>
std::vector<bf16> random_values<bf16>(std::mt19937_64& rng, size_t n) {
  auto f = random_values<float>(rng, n);
  std::vector<bf16> v(n);
  for (size_t i = 0; i < n; ++i)
    v[i] = to_bf16(f[i]);
  return v;
}

template <>
std::vector<int64_t> random_values<int64_t>(std::mt19937_64& rng, size_t n) {
  std::uniform_int_distribution<int64_t> d(-(int64_t{1} << 60), int64_t{1} << 60);
  std::vector<int64_t> v(n);
  for (auto& x : v)
    x = d(rng);
  return v;
}

float ref_op(float a, float b, reduce_op op) {
  if (op == reduce_op::max)
    return (std::isnan(a) || std::isnan(b)) ? (std::isnan(b) ? b : a) : (b > a ? b : a);
  return a + b;
}

bf16 ref_op(bf16 a, bf16 b, reduce_op op) {
  if (op == reduce_op::max)
    return from_bf16(b) > from_bf16(a) ? b : a;
  return to_bf16(from_bf16(a) + from_bf16(b));
}

int64_t ref_op(int64_t a, int64_t b, reduce_op op) {
  if (op == reduce_op::max)
    return std::max(a, b);
  return a + b;
}

bool equal_elem(float a, float b) { return same_bits(a, b); }
bool equal_elem(bf16 a, bf16 b) { return a == b; }
bool equal_elem(int64_t a, int64_t b) { return a == b; }

template <class T>
void check_against_reference(uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (auto op : {reduce_op::sum, reduce_op::avg, reduce_op::max})
    for (size_t n : kSizes)
      for (size_t offset : {size_t{0}, size_t{1}}) { // also misaligned buffers
        CAPTURE(to_string(dtype_of<T>()));
        CAPTURE(to_string(op));
        CAPTURE(n);
        CAPTURE(offset);
        auto d = random_values<T>(rng, n + offset);
        auto s = random_values<T>(rng, n + offset);
        std::vector<T> expect(n);
        for (size_t i = 0; i < n; ++i)
          expect[i] = ref_op(d[offset + i], s[offset + i], op);
        // reduce_to: the same result into a third buffer.
        std::vector<T> to(n + offset);
        CHECK(reduce_to(to.data() + offset, d.data() + offset, s.data() + offset, n,
                        dtype_of<T>(), op));
        bool ok = reduce_into(d.data() + offset, s.data() + offset, n, dtype_of<T>(), op);
        CHECK(ok);
        size_t mismatches = 0, mismatches_to = 0;
        for (size_t i = 0; i < n; ++i) {
          mismatches += !equal_elem(d[offset + i], expect[i]);
          mismatches_to += !equal_elem(to[offset + i], expect[i]);
        }
        CHECK(mismatches == 0);
        CHECK(mismatches_to == 0);
      }
}

} // namespace

TEST_CASE("dtype and reduce_op names and sizes") {
  CHECK(to_string(dtype::float32) == "float32");
  CHECK(to_string(dtype::bfloat16) == "bfloat16");
  CHECK(to_string(dtype::int64) == "int64");
  CHECK(to_string(reduce_op::sum) == "sum");
  CHECK(to_string(reduce_op::avg) == "avg");
  CHECK(to_string(reduce_op::max) == "max");
  CHECK(size_of(dtype::float32) == 4);
  CHECK(size_of(dtype::bfloat16) == 2);
  CHECK(size_of(dtype::int64) == 8);
}

TEST_CASE("bf16: exact values convert both ways unchanged") {
  for (float x : {0.0f, 1.0f, -1.0f, 2.0f, 0.5f, 3.0f, -1.5f, 256.0f, 1.0f / 1024, 65280.0f}) {
    CAPTURE(x);
    CHECK(from_bf16(to_bf16(x)) == x);
  }
  CHECK(to_bf16(1.0f).bits == 0x3F80);
  CHECK(to_bf16(-2.0f).bits == 0xC000);
  CHECK(to_bf16(0.0f).bits == 0x0000);
  // Every bf16 bit pattern that is not a NaN survives float and back.
  size_t bad = 0;
  for (uint32_t b = 0; b <= 0xFFFF; ++b) {
    bf16 h{static_cast<uint16_t>(b)};
    float f = from_bf16(h);
    CHECK_MESSAGE(bits_of(f) == b << 16, "widening is exact");
    if (!std::isnan(f))
      bad += !(to_bf16(f) == h);
  }
  CHECK(bad == 0);
}

TEST_CASE("bf16: rounding is to nearest, ties to even") {
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
  CHECK(to_bf16(1.0f + std::ldexp(1.0f, -8)).bits == 0x3F80);
  // 1 + 3 * 2^-8 is halfway between 1 + 2^-7 (odd) and 1 + 2^-6: goes up.
  CHECK(to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)).bits == 0x3F82);
  // Just above the tie rounds up, just below rounds down.
  CHECK(to_bf16(std::nextafter(1.0f + std::ldexp(1.0f, -8), 2.0f)).bits == 0x3F81);
  CHECK(to_bf16(std::nextafter(1.0f + std::ldexp(1.0f, -8), 0.0f)).bits == 0x3F80);
  CHECK(to_bf16(-(1.0f + std::ldexp(1.0f, -8))).bits == 0xBF80);
  CHECK(to_bf16(-(1.0f + 3 * std::ldexp(1.0f, -8))).bits == 0xBF82);
  // Carry into the exponent: 2 - 2^-9 rounds to 2.
  CHECK(to_bf16(2.0f - std::ldexp(1.0f, -9)).bits == 0x4000);
  // Beyond the largest bf16 (0x7F7F) by half an ulp or more: infinity.
  CHECK(to_bf16(std::numeric_limits<float>::max()).bits == 0x7F80);
  CHECK(to_bf16(float_of(0x7F7F7FFF)).bits == 0x7F7F);
  CHECK(to_bf16(float_of(0x7F7F8000)).bits == 0x7F80);
  // Subnormals round the same way.
  CHECK(to_bf16(float_of(0x00008000)).bits == 0x0000);
  CHECK(to_bf16(float_of(0x00018000)).bits == 0x0002);
  CHECK(to_bf16(float_of(0x00008001)).bits == 0x0001);

  // Against an independent reference on many random and edge bit patterns.
  std::mt19937_64 rng(20240611);
  size_t bad = 0;
  for (int i = 0; i < 1000000; ++i) {
    uint32_t u = static_cast<uint32_t>(rng());
    if (i % 4 == 0)
      u = (u & 0xFFFF0000u) | 0x8000u; // exact ties
    float x = float_of(u);
    uint16_t got = to_bf16(x).bits, want = ref_bf16(x);
    if (got != want && bad++ < 5)
      MESSAGE("bits " << std::hex << u << ": got " << got << " want " << want);
  }
  CHECK(bad == 0);
}

TEST_CASE("bf16: NaN stays a quiet NaN, infinities and signed zero are kept") {
  float inf = std::numeric_limits<float>::infinity();
  CHECK(to_bf16(inf).bits == 0x7F80);
  CHECK(to_bf16(-inf).bits == 0xFF80);
  CHECK(std::isinf(from_bf16(to_bf16(inf))));
  CHECK(to_bf16(-0.0f).bits == 0x8000);
  CHECK(std::signbit(from_bf16(to_bf16(-0.0f))));
  CHECK(from_bf16(to_bf16(-0.0f)) == 0.0f);
  // A NaN whose payload is only in the low 16 bits must not become infinity.
  for (uint32_t u : {0x7FC00000u, 0x7F800001u, 0x7F80FFFFu, 0xFF800001u, 0x7FFFFFFFu}) {
    CAPTURE(u);
    bf16 h = to_bf16(float_of(u));
    CHECK(std::isnan(from_bf16(h)));
    CHECK((h.bits & 0x0040) != 0); // quiet
    CHECK((h.bits & 0x8000) == ((u >> 16) & 0x8000)); // sign kept
  }
  CHECK(to_bf16(std::numeric_limits<float>::quiet_NaN()).bits == 0x7FC0);
}

TEST_CASE("reduce_into float32 matches a scalar reference bit for bit") {
  check_against_reference<float>(1);
}

TEST_CASE("reduce_into bfloat16 matches a scalar reference bit for bit") {
  check_against_reference<bf16>(2);
}

TEST_CASE("reduce_into int64 matches a scalar reference") {
  check_against_reference<int64_t>(3);
}

TEST_CASE("reduce_into float32 max propagates NaN from either side") {
  float nan = std::numeric_limits<float>::quiet_NaN();
  for (size_t n : kSizes) {
    if (n == 0)
      continue;
    std::vector<float> a(n, 1.0f), b(n, 2.0f);
    a[n - 1] = nan;
    b[0] = nan;
    REQUIRE(reduce_into(a.data(), b.data(), n, dtype::float32, reduce_op::max));
    CHECK(std::isnan(a[0]));
    CHECK(std::isnan(a[n - 1]));
    if (n > 2)
      CHECK(a[1] == 2.0f);
  }
}

TEST_CASE("reduce_into int64 sum detects overflow") {
  const int64_t big = std::numeric_limits<int64_t>::max();
  const int64_t small = std::numeric_limits<int64_t>::min();
  for (size_t n : kSizes) {
    if (n == 0)
      continue;
    for (size_t at : {size_t{0}, n / 2, n - 1}) { // in the vector body and in the tail
      CAPTURE(n);
      CAPTURE(at);
      std::vector<int64_t> d(n, 1), s(n, 2);
      d[at] = big;
      std::vector<int64_t> to(n);
      CHECK_FALSE(reduce_to(to.data(), d.data(), s.data(), n, dtype::int64, reduce_op::sum));
      CHECK(to[at] == small);
      CHECK_FALSE(reduce_into(d.data(), s.data(), n, dtype::int64, reduce_op::sum));
      CHECK(d[at] == small); // the marker, sticky for every later sum
      CHECK_FALSE(reduce_into(d.data(), s.data(), n, dtype::int64, reduce_op::sum));
      CHECK(d[at] == small);
      std::vector<int64_t> d2(n, -1), s2(n, 0);
      d2[at] = small;
      s2[at] = -1;
      CHECK_FALSE(reduce_into(d2.data(), s2.data(), n, dtype::int64, reduce_op::avg));
    }
    // Right at the limits, without overflowing.
    std::vector<int64_t> d(n, big - 5), s(n, 5);
    CHECK(reduce_into(d.data(), s.data(), n, dtype::int64, reduce_op::sum));
    CHECK(d[n - 1] == big);
    std::vector<int64_t> d2(n, small + 2), s2(n, -1);
    CHECK(reduce_into(d2.data(), s2.data(), n, dtype::int64, reduce_op::sum));
    CHECK(d2[0] == small + 1);
    // INT64_MIN is the sticky overflow marker: reaching it, or adding to it,
    // reports an overflow and keeps the marker.
    std::vector<int64_t> d3(n, small), s3(n, big);
    CHECK_FALSE(reduce_into(d3.data(), s3.data(), n, dtype::int64, reduce_op::sum));
    CHECK(d3[n / 2] == small);
    std::vector<int64_t> d5(n, small + 1), s5(n, -1);
    CHECK_FALSE(reduce_into(d5.data(), s5.data(), n, dtype::int64, reduce_op::sum));
    CHECK(d5[0] == small);
    // max never overflows.
    std::vector<int64_t> d4(n, big), s4(n, small);
    CHECK(reduce_into(d4.data(), s4.data(), n, dtype::int64, reduce_op::max));
    CHECK(d4[0] == big);
  }
}

TEST_CASE("scale_down divides like a serial sum / n") {
  std::mt19937_64 rng(4);
  for (size_t n : kSizes) {
    CAPTURE(n);
    for (size_t members : {size_t{2}, size_t{3}, size_t{7}, size_t{10}}) {
      CAPTURE(members);
      auto f = random_values<float>(rng, n);
      auto fr = f;
      scale_down(f.data(), n, dtype::float32, members);
      size_t bad = 0;
      for (size_t i = 0; i < n; ++i)
        bad += !same_bits(f[i], fr[i] / static_cast<float>(members));
      CHECK(bad == 0);

      auto h = random_values<bf16>(rng, n);
      auto hr = h;
      scale_down(h.data(), n, dtype::bfloat16, members);
      bad = 0;
      for (size_t i = 0; i < n; ++i)
        bad += !(h[i] == to_bf16(from_bf16(hr[i]) / static_cast<float>(members)));
      CHECK(bad == 0);

      auto q = random_values<int64_t>(rng, n);
      auto qr = q;
      scale_down(q.data(), n, dtype::int64, members);
      bad = 0;
      for (size_t i = 0; i < n; ++i)
        bad += q[i] != qr[i] / static_cast<int64_t>(members);
      CHECK(bad == 0);
    }
  }
  // Truncation toward zero, and the values where 1/n would differ.
  int64_t q[] = {7, -7, 5, -5, -1};
  scale_down(q, 5, dtype::int64, 2);
  CHECK(q[0] == 3);
  CHECK(q[1] == -3);
  CHECK(q[2] == 2);
  CHECK(q[3] == -2);
  CHECK(q[4] == 0);
  // 3 * (1/3) is not 1 in float, but 3 / 3 is.
  float third[] = {3.0f, 0.3f * 3.0f};
  scale_down(third, 2, dtype::float32, 3);
  CHECK(third[0] == 1.0f);
  CHECK(same_bits(third[1], (0.3f * 3.0f) / 3.0f));
  // n = 1 (and 0) leave the buffer alone.
  float one[] = {1.5f};
  scale_down(one, 1, dtype::float32, 1);
  scale_down(one, 1, dtype::float32, 0);
  CHECK(one[0] == 1.5f);
}
