// GELU, tanh approximation: gelu(x) = x/2 * (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
// Float for training, double for the gradient checks.
// Also compiled by nvcc (C++17): keep this header free of C++20.
#pragma once

#include <cstddef>

namespace cmesh::kernels::cpu {

/// y[i] = gelu(x[i]) for i < n. y may alias x.
void gelu_forward(const float* x, float* y, std::size_t n);
void gelu_forward(const double* x, double* y, std::size_t n);

/// dx[i] = dy[i] * gelu'(x[i]), from the pre-activation x. dx may alias dy.
void gelu_backward(const float* x, const float* dy, float* dx, std::size_t n);
void gelu_backward(const double* x, const double* dy, double* dx, std::size_t n);

} // namespace cmesh::kernels::cpu
