// GELU (tanh approximation) forward and backward (see kernels/cuda/ops.hpp).
// The expressions are the CPU's, operation for operation (this file is
// compiled with --fmad=false); only expf differs (a couple of ulp).
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.hpp"

namespace cmesh::kernels::cuda {

namespace {

constexpr float sqrt_2_over_pi = static_cast<float>(0.79788456080286535587989211986876);
constexpr float cubic = static_cast<float>(0.044715);

// (1 + tanh(u)) / 2 == 1 / (1 + exp(-2u)), as kernels/cpu/activation.cpp.
__device__ inline float half_one_plus_tanh(float v) {
  const float u = sqrt_2_over_pi * (v + cubic * v * v * v);
  return 1.0f / (1.0f + expf(-2.0f * u));
}

__global__ void gelu_forward_kernel(const float* x, float* y, std::size_t n) {
  for (std::size_t i = detail::thread_index(); i < n; i += detail::thread_stride()) {
    const float v = x[i];
    y[i] = v * half_one_plus_tanh(v);
  }
}

__global__ void gelu_backward_kernel(const float* x, const float* dy, float* dx,
                                     std::size_t n) {
  for (std::size_t i = detail::thread_index(); i < n; i += detail::thread_stride()) {
    const float v = x[i];
    const float s = half_one_plus_tanh(v);
    const float du = sqrt_2_over_pi * (1.0f + 3.0f * cubic * v * v);
    dx[i] = dy[i] * (s + 2.0f * v * s * (1.0f - s) * du);
  }
}

} // namespace

void gelu_forward(const float* x, float* y, std::size_t n, cudaStream_t stream) {
  if (n == 0)
    return;
  gelu_forward_kernel<<<detail::grid_for(n), detail::block_threads, 0, stream>>>(x, y, n);
  detail::check_launch();
}

void gelu_backward(const float* x, const float* dy, float* dx, std::size_t n,
                   cudaStream_t stream) {
  if (n == 0)
    return;
  gelu_backward_kernel<<<detail::grid_for(n), detail::block_threads, 0, stream>>>(x, dy, dx, n);
  detail::check_launch();
}

} // namespace cmesh::kernels::cuda
