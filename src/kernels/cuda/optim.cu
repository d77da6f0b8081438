// Optimizer-side kernels over flat fp32 buffers (see kernels/cuda/ops.hpp).
// AdamW, scaling and clipping repeat the CPU's float operations one for one
// (this file is compiled with --fmad=false; sqrtf and '/' are IEEE-rounded
// by default), with the per-step constants computed on the host by the same
// code as the CPU's.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.hpp"

#include <algorithm>
#include <cmath>

namespace cmesh::kernels::cuda {

namespace {

__global__ void adamw_kernel(float* params, const float* __restrict__ grads, float* m, float* v,
                             std::size_t n, float lr, float beta1, float beta2, float eps,
                             float c1, float c2, float decay) {
  for (std::size_t i = detail::thread_index(); i < n; i += detail::thread_stride()) {
    const float g = grads[i];
    const float mi = beta1 * m[i] + (1.0f - beta1) * g;
    const float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    const float update = (mi * c1) / (sqrtf(vi * c2) + eps);
    params[i] = params[i] * decay - lr * update;
  }
}

__global__ void scale_kernel(float* x, float alpha, std::size_t n) {
  for (std::size_t i = detail::thread_index(); i < n; i += detail::thread_stride())
    x[i] *= alpha;
}

// dst[blockIdx.x] = this block's sum of x[i]^2 (double), or, with a single
// block and `accumulate`, *dst += the whole sum.
__global__ void sum_squares_kernel(const float* __restrict__ x, std::size_t n, double* dst,
                                   bool accumulate) {
  __shared__ double scratch[32];
  double s = 0;
  for (std::size_t i = detail::thread_index(); i < n; i += detail::thread_stride()) {
    const double v = x[i];
    s += v * v; // exact: a float squared fits in a double
  }
  s = detail::block_reduce(s, 0.0, detail::sum_op{}, scratch);
  if (threadIdx.x == 0)
    dst[blockIdx.x] = accumulate ? dst[blockIdx.x] + s : s;
}

// One block: *out (+)= the sum of the per-block partials.
__global__ void sum_partials_kernel(const double* __restrict__ partials, std::size_t count,
                                    double* out, bool accumulate) {
  __shared__ double scratch[32];
  double s = 0;
  for (std::size_t i = threadIdx.x; i < count; i += blockDim.x)
    s += partials[i];
  s = detail::block_reduce(s, 0.0, detail::sum_op{}, scratch);
  if (threadIdx.x == 0)
    *out = accumulate ? *out + s : s;
}

__global__ void sqrt_kernel(double* v) { *v = sqrt(*v); }

// The clipping decision and factor from a norm on the device, as
// cpu::clip_to_norm; every thread computes the same factor.
__global__ void clip_kernel(float* x, std::size_t n, const double* norm, double max_norm,
                            float* factor_out) {
  const double nv = *norm;
  const bool clip = max_norm > 0 && nv > max_norm;
  const float factor = clip ? static_cast<float>(max_norm / (nv + 1e-6)) : 1.0f;
  if (factor_out && detail::thread_index() == 0)
    *factor_out = factor;
  if (!clip)
    return;
  for (std::size_t i = detail::thread_index(); i < n; i += detail::thread_stride())
    x[i] *= factor;
}

// Partial sums for sum_of_squares: a function of n only, so the tree (and the
// rounding) is the same on every run and every device.
constexpr std::size_t max_partials = 1024;
constexpr std::size_t items_per_thread = 8;

unsigned partial_blocks(std::size_t n) {
  const std::size_t per_block = detail::block_threads * items_per_thread;
  return static_cast<unsigned>(std::clamp<std::size_t>((n + per_block - 1) / per_block, 1,
                                                       max_partials));
}

} // namespace

void adamw_step(float* params, const float* grads, float* m, float* v, std::size_t n,
                const cpu::adamw_params& hp, std::uint64_t step, cudaStream_t stream) {
  if (n == 0)
    return;
  // The same host arithmetic as cpu::adamw_step.
  const double s = static_cast<double>(step);
  const float c1 = static_cast<float>(1.0 / (1.0 - std::pow(static_cast<double>(hp.beta1), s)));
  const float c2 = static_cast<float>(1.0 / (1.0 - std::pow(static_cast<double>(hp.beta2), s)));
  const float decay = 1.0f - hp.lr * hp.weight_decay;
  adamw_kernel<<<detail::grid_for(n), detail::block_threads, 0, stream>>>(
    params, grads, m, v, n, hp.lr, hp.beta1, hp.beta2, hp.eps, c1, c2, decay);
  detail::check_launch();
}

void scale_in_place(float* x, float alpha, std::size_t n, cudaStream_t stream) {
  if (n == 0)
    return;
  scale_kernel<<<detail::grid_for(n), detail::block_threads, 0, stream>>>(x, alpha, n);
  detail::check_launch();
}

void sum_of_squares(const float* x, std::size_t n, double* out, cudaStream_t stream,
                    bool accumulate) {
  const unsigned blocks = partial_blocks(n);
  if (blocks == 1) {
    sum_squares_kernel<<<1, detail::block_threads, 0, stream>>>(x, n, out, accumulate);
    detail::check_launch();
    return;
  }
  void* scratch = nullptr;
  CMESH_CUDA_CHECK(cudaMallocAsync(&scratch, blocks * sizeof(double), stream));
  auto* partials = static_cast<double*>(scratch);
  sum_squares_kernel<<<blocks, detail::block_threads, 0, stream>>>(x, n, partials, false);
  const cudaError_t launched = cudaGetLastError();
  if (launched == cudaSuccess)
    sum_partials_kernel<<<1, detail::block_threads, 0, stream>>>(partials, blocks, out,
                                                                 accumulate);
  const cudaError_t summed = launched == cudaSuccess ? cudaGetLastError() : launched;
  (void)cudaFreeAsync(scratch, stream);
  CMESH_CUDA_CHECK(summed);
}

void l2_norm(const float* x, std::size_t n, double* out, cudaStream_t stream) {
  sum_of_squares(x, n, out, stream);
  sqrt_in_place(out, stream);
}

void sqrt_in_place(double* v, cudaStream_t stream) {
  sqrt_kernel<<<1, 1, 0, stream>>>(v);
  detail::check_launch();
}

float clip_to_norm(float* x, std::size_t n, double norm, double max_norm, cudaStream_t stream) {
  if (max_norm <= 0 || !(norm > max_norm))
    return 1.0f;
  const float factor = static_cast<float>(max_norm / (norm + 1e-6));
  scale_in_place(x, factor, n, stream);
  return factor;
}

void clip_to_norm(float* x, std::size_t n, const double* norm, double max_norm, float* factor,
                  cudaStream_t stream) {
  // At least one block, so that *factor is written even when n == 0.
  clip_kernel<<<detail::grid_for(n), detail::block_threads, 0, stream>>>(x, n, norm, max_norm,
                                                                         factor);
  detail::check_launch();
}

std::size_t pack_ranges(const float* src, const std::size_t* offsets, const std::size_t* sizes,
                        std::size_t count, float* dst, cudaStream_t stream) {
  std::size_t at = 0;
  for (std::size_t i = 0; i < count; ++i) {
    if (sizes[i] > 0)
      CMESH_CUDA_CHECK(cudaMemcpyAsync(dst + at, src + offsets[i], sizes[i] * sizeof(float),
                                       cudaMemcpyDeviceToDevice, stream));
    at += sizes[i];
  }
  return at;
}

std::size_t unpack_ranges(const float* packed, const std::size_t* offsets,
                          const std::size_t* sizes, std::size_t count, float* dst,
                          cudaStream_t stream) {
  std::size_t at = 0;
  for (std::size_t i = 0; i < count; ++i) {
    if (sizes[i] > 0)
      CMESH_CUDA_CHECK(cudaMemcpyAsync(dst + offsets[i], packed + at, sizes[i] * sizeof(float),
                                       cudaMemcpyDeviceToDevice, stream));
    at += sizes[i];
  }
  return at;
}

} // namespace cmesh::kernels::cuda
