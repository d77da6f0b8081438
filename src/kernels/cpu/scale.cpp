#include "kernels/scale.hpp"

namespace cmesh::kernels::cpu {

void scale_add(float* y, const float* x, float alpha, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i)
    y[i] += alpha * x[i];
}

} // namespace cmesh::kernels::cpu
