#include "kernels/optim.hpp"

#include <cmath>
#include <cstring>

namespace cmesh::kernels::cpu {

void adamw_step(float* params, const float* grads, float* m, float* v, std::size_t n,
                const adamw_params& hp, std::uint64_t step) {
  // Bias corrections in double: b^step underflows gracefully and 1 - b^step
  // is exact enough even for small steps.
  const double s = static_cast<double>(step);
  const float c1 = static_cast<float>(1.0 / (1.0 - std::pow(static_cast<double>(hp.beta1), s)));
  const float c2 = static_cast<float>(1.0 / (1.0 - std::pow(static_cast<double>(hp.beta2), s)));
  const float decay = 1.0f - hp.lr * hp.weight_decay;
  for (std::size_t i = 0; i < n; ++i) {
    const float g = grads[i];
    m[i] = hp.beta1 * m[i] + (1.0f - hp.beta1) * g;
    v[i] = hp.beta2 * v[i] + (1.0f - hp.beta2) * g * g;
    const float update = (m[i] * c1) / (std::sqrt(v[i] * c2) + hp.eps);
    params[i] = params[i] * decay - hp.lr * update;
  }
}

void scale_in_place(float* x, float alpha, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i)
    x[i] *= alpha;
}

double sum_of_squares(const float* x, std::size_t n) {
  double s = 0;
  for (std::size_t i = 0; i < n; ++i)
    s += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  return s;
}

double l2_norm(const float* x, std::size_t n) { return std::sqrt(sum_of_squares(x, n)); }

float clip_to_norm(float* x, std::size_t n, double norm, double max_norm) {
  if (max_norm <= 0 || !(norm > max_norm))
    return 1.0f;
  // The small epsilon keeps the clipped norm just under max_norm.
  const float factor = static_cast<float>(max_norm / (norm + 1e-6));
  scale_in_place(x, factor, n);
  return factor;
}

std::size_t pack_ranges(const float* src, const std::size_t* offsets, const std::size_t* sizes,
                        std::size_t count, float* dst) {
  std::size_t at = 0;
  for (std::size_t i = 0; i < count; ++i) {
    if (sizes[i] > 0)
      std::memcpy(dst + at, src + offsets[i], sizes[i] * sizeof(float));
    at += sizes[i];
  }
  return at;
}

std::size_t unpack_ranges(const float* packed, const std::size_t* offsets,
                          const std::size_t* sizes, std::size_t count, float* dst) {
  std::size_t at = 0;
  for (std::size_t i = 0; i < count; ++i) {
    if (sizes[i] > 0)
      std::memcpy(dst + offsets[i], packed + at, sizes[i] * sizeof(float));
    at += sizes[i];
  }
  return at;
}

} // namespace cmesh::kernels::cpu
