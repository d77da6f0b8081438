// Reduced precision: bf16 casts (round to nearest, ties to even) and
// dynamic loss scaling, which keeps small bf16 gradients from flushing to
// zero and backs off when a scaled gradient overflows.
// Also compiled by nvcc (C++17): keep this header free of C++20.
#pragma once

#include <cstddef>
#include <cstdint>

namespace cmesh::kernels::cpu {

/// bf16 bits of each float: the top 16 bits, rounded to nearest even. NaN
/// stays a (quiet) NaN of the same sign; infinities and overflow to
/// infinity behave as IEEE rounding says.
void float_to_bf16(const float* x, std::uint16_t* y, std::size_t n);

/// Exact widening of bf16 bits to float.
void bf16_to_float(const std::uint16_t* x, float* y, std::size_t n);

/// x[i] = float(bf16(x[i])): what a bf16 round trip does, in place.
void round_to_bf16(float* x, std::size_t n);

/// True when every x[i] is finite (no inf, no NaN).
bool all_finite(const float* x, std::size_t n);

/// Dynamic loss scale: multiply the loss by `scale` before backward, divide
/// the gradients by it after. An overflowed step is skipped and the scale
/// backs off; after growth_interval good steps in a row it grows.
struct loss_scaler {
  float scale = 65536.0f;
  float growth_factor = 2.0f;
  float backoff_factor = 0.5f;
  std::uint32_t growth_interval = 2000;
  float min_scale = 1.0f;
  float max_scale = 16777216.0f; // 2^24
  std::uint32_t good_steps = 0;  // finite steps since the last change
};

/// Records a step's outcome and adjusts the scale. Returns true when the step
/// must be skipped (its gradients overflowed).
bool update_loss_scale(loss_scaler& s, bool found_overflow);

/// Checks the (still scaled) gradients for inf/NaN and updates the scale:
/// returns true when the step must be skipped.
bool check_gradients(loss_scaler& s, const float* grads, std::size_t n);

} // namespace cmesh::kernels::cpu
