#include "kernels/precision.hpp"

#include <cmath>
#include <cstring>

namespace cmesh::kernels::cpu {

namespace {

std::uint32_t bits_of(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

float float_of(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Branch-free, so the loops below vectorise.
std::uint16_t to_bf16(float f) {
  const std::uint32_t u = bits_of(f);
  // Keep a NaN a NaN: its top half with the quiet bit set.
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  // Add half an ulp of bf16, plus one when the kept part is odd (ties to
  // even); a carry into the exponent is the correct rounding up, up to inf.
  const std::uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<std::uint16_t>(nan ? (u >> 16) | 0x0040u : rounded);
}

} // namespace

void float_to_bf16(const float* x, std::uint16_t* y, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i)
    y[i] = to_bf16(x[i]);
}

void bf16_to_float(const std::uint16_t* x, float* y, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i)
    y[i] = float_of(static_cast<std::uint32_t>(x[i]) << 16);
}

void round_to_bf16(float* x, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i)
    x[i] = float_of(static_cast<std::uint32_t>(to_bf16(x[i])) << 16);
}

bool all_finite(const float* x, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i]))
      return false;
  return true;
}

bool update_loss_scale(loss_scaler& s, bool found_overflow) {
  if (found_overflow) {
    s.scale = std::fmax(s.scale * s.backoff_factor, s.min_scale);
    s.good_steps = 0;
    return true;
  }
  if (++s.good_steps >= s.growth_interval) {
    s.scale = std::fmin(s.scale * s.growth_factor, s.max_scale);
    s.good_steps = 0;
  }
  return false;
}

bool check_gradients(loss_scaler& s, const float* grads, std::size_t n) {
  return update_loss_scale(s, !all_finite(grads, n));
}

} // namespace cmesh::kernels::cpu
