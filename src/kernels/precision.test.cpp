#include "kernels/precision.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

namespace k = cmesh::kernels::cpu;

float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

std::uint16_t bf16(float f) {
  std::uint16_t h;
  k::float_to_bf16(&f, &h, 1);
  return h;
}

} // namespace

TEST_CASE("bf16: round to nearest, ties to even") {
  CHECK(bf16(1.0f) == 0x3f80);
  CHECK(bf16(-2.0f) == 0xc000);
  CHECK(bf16(0.0f) == 0x0000);
  CHECK(bf16(-0.0f) == 0x8000);
  CHECK(bf16(from_bits(0x3f808000u)) == 0x3f80); // tie, kept part even: down
  CHECK(bf16(from_bits(0x3f818000u)) == 0x3f82); // tie, kept part odd: up
  CHECK(bf16(from_bits(0x3f808001u)) == 0x3f81); // above the tie: up
  CHECK(bf16(from_bits(0x3f807fffu)) == 0x3f80); // below the tie: down
  CHECK(bf16(from_bits(0x3fffffffu)) == 0x4000); // carry into the exponent
  CHECK(bf16(std::numeric_limits<float>::max()) == 0x7f80); // overflows to inf
  CHECK(bf16(std::numeric_limits<float>::infinity()) == 0x7f80);
  CHECK(bf16(-std::numeric_limits<float>::infinity()) == 0xff80);
  CHECK(bf16(from_bits(0x00010000u)) == 0x0001); // subnormals round like the rest
}

TEST_CASE("bf16: NaN stays NaN (even a payload only in the low bits)") {
  const float nan_low = from_bits(0x7f800001u); // would truncate to inf
  const std::uint16_t h = bf16(nan_low);
  float back;
  k::bf16_to_float(&h, &back, 1);
  CHECK(std::isnan(back));
  const float neg_nan = from_bits(0xffc00000u);
  CHECK(bf16(neg_nan) == 0xffc0);
}

TEST_CASE("bf16: widening is exact and a round trip is idempotent") {
  std::vector<float> x;
  for (int i = -1000; i <= 1000; ++i)
    x.push_back(0.0137f * static_cast<float>(i) * static_cast<float>(i % 7 + 1));
  std::vector<std::uint16_t> h(x.size());
  std::vector<float> y(x.size());
  k::float_to_bf16(x.data(), h.data(), x.size());
  k::bf16_to_float(h.data(), y.data(), y.size());
  auto r = x;
  k::round_to_bf16(r.data(), r.size());
  CHECK(r == y);
  for (std::size_t i = 0; i < x.size(); ++i) {
    // Relative error at most half a bf16 ulp (2^-8 relative).
    CHECK(std::fabs(y[i] - x[i]) <= std::fabs(x[i]) * (1.0f / 256.0f));
  }
  auto again = y;
  k::round_to_bf16(again.data(), again.size());
  CHECK(again == y);
}

TEST_CASE("loss scaling: backoff on overflow, growth after the interval") {
  k::loss_scaler s;
  s.scale = 1024.0f;
  s.growth_interval = 3;
  std::vector<float> good{1.0f, -2.0f}, bad{1.0f, std::numeric_limits<float>::infinity()},
    nan{std::numeric_limits<float>::quiet_NaN()};
  CHECK(k::all_finite(good.data(), 2));
  CHECK_FALSE(k::all_finite(bad.data(), 2));
  CHECK_FALSE(k::all_finite(nan.data(), 1));

  CHECK(k::check_gradients(s, bad.data(), 2)); // skip
  CHECK(s.scale == 512.0f);
  CHECK(k::check_gradients(s, nan.data(), 1));
  CHECK(s.scale == 256.0f);
  CHECK_FALSE(k::check_gradients(s, good.data(), 2));
  CHECK_FALSE(k::check_gradients(s, good.data(), 2));
  CHECK(s.scale == 256.0f);
  CHECK_FALSE(k::check_gradients(s, good.data(), 2)); // third good step in a row
  CHECK(s.scale == 512.0f);
  CHECK(s.good_steps == 0);

  // Bounds.
  s.scale = 1.0f;
  CHECK(k::update_loss_scale(s, true));
  CHECK(s.scale == 1.0f);
  s.scale = s.max_scale;
  for (int i = 0; i < 3; ++i)
    k::update_loss_scale(s, false);
  CHECK(s.scale == s.max_scale);
}
