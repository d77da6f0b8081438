// bf16 casts and the finite check (see kernels/cuda/ops.hpp). The casts are
// the CPU's bit manipulations, so they agree bit for bit, NaN included.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.hpp"

namespace cmesh::kernels::cuda {

namespace {

// As to_bf16 in kernels/cpu/precision.cpp.
__device__ inline std::uint16_t to_bf16(float f) {
  const std::uint32_t u = __float_as_uint(f);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu) != 0)
    return static_cast<std::uint16_t>((u >> 16) | 0x0040u); // NaN stays NaN: the quiet bit
  const std::uint32_t rounding = 0x7fffu + ((u >> 16) & 1u); // ties to even
  return static_cast<std::uint16_t>((u + rounding) >> 16);
}

__device__ inline float widen(std::uint16_t b) {
  return __uint_as_float(static_cast<std::uint32_t>(b) << 16);
}

__global__ void float_to_bf16_kernel(const float* __restrict__ x, std::uint16_t* __restrict__ y,
                                     std::size_t n) {
  for (std::size_t i = detail::thread_index(); i < n; i += detail::thread_stride())
    y[i] = to_bf16(x[i]);
}

__global__ void bf16_to_float_kernel(const std::uint16_t* __restrict__ x, float* __restrict__ y,
                                     std::size_t n) {
  for (std::size_t i = detail::thread_index(); i < n; i += detail::thread_stride())
    y[i] = widen(x[i]);
}

__global__ void round_to_bf16_kernel(float* x, std::size_t n) {
  for (std::size_t i = detail::thread_index(); i < n; i += detail::thread_stride())
    x[i] = widen(to_bf16(x[i]));
}

__global__ void set_flag_kernel(int* flag, int value) { *flag = value; }

// *flag = value when some x[i] is inf or NaN (all exponent bits set). The
// writers all write the same value, so the result does not depend on order.
__global__ void flag_nonfinite_kernel(const float* __restrict__ x, std::size_t n, int* flag,
                                      int value) {
  bool bad = false;
  for (std::size_t i = detail::thread_index(); i < n; i += detail::thread_stride())
    bad |= (__float_as_uint(x[i]) & 0x7f800000u) == 0x7f800000u;
  if (bad)
    *flag = value;
}

// A stream-ordered device int, freed on the stream when it goes out of scope.
struct stream_int {
  int* ptr = nullptr;
  cudaStream_t stream;
  explicit stream_int(cudaStream_t s) : stream(s) {
    void* p = nullptr;
    CMESH_CUDA_CHECK(cudaMallocAsync(&p, sizeof(int), stream));
    ptr = static_cast<int*>(p);
  }
  ~stream_int() { (void)cudaFreeAsync(ptr, stream); }
  stream_int(const stream_int&) = delete;
  stream_int& operator=(const stream_int&) = delete;
};

int read_flag(const int* flag, cudaStream_t stream) {
  int host = 0;
  CMESH_CUDA_CHECK(cudaMemcpyAsync(&host, flag, sizeof host, cudaMemcpyDeviceToHost, stream));
  CMESH_CUDA_CHECK(cudaStreamSynchronize(stream));
  return host;
}

} // namespace

void float_to_bf16(const float* x, std::uint16_t* y, std::size_t n, cudaStream_t stream) {
  if (n == 0)
    return;
  float_to_bf16_kernel<<<detail::grid_for(n), detail::block_threads, 0, stream>>>(x, y, n);
  detail::check_launch();
}

void bf16_to_float(const std::uint16_t* x, float* y, std::size_t n, cudaStream_t stream) {
  if (n == 0)
    return;
  bf16_to_float_kernel<<<detail::grid_for(n), detail::block_threads, 0, stream>>>(x, y, n);
  detail::check_launch();
}

void round_to_bf16(float* x, std::size_t n, cudaStream_t stream) {
  if (n == 0)
    return;
  round_to_bf16_kernel<<<detail::grid_for(n), detail::block_threads, 0, stream>>>(x, n);
  detail::check_launch();
}

void all_finite(const float* x, std::size_t n, int* finite, cudaStream_t stream) {
  set_flag_kernel<<<1, 1, 0, stream>>>(finite, 1);
  detail::check_launch();
  if (n == 0)
    return;
  flag_nonfinite_kernel<<<detail::grid_for(n), detail::block_threads, 0, stream>>>(x, n, finite,
                                                                                   0);
  detail::check_launch();
}

void mark_nonfinite(const float* x, std::size_t n, int* found, cudaStream_t stream) {
  if (n == 0 || found == nullptr)
    return;
  flag_nonfinite_kernel<<<detail::grid_for(n), detail::block_threads, 0, stream>>>(x, n, found,
                                                                                   1);
  detail::check_launch();
}

bool check_gradients(cpu::loss_scaler& s, const float* grads, std::size_t n,
                     cudaStream_t stream) {
  const stream_int finite(stream);
  all_finite(grads, n, finite.ptr, stream);
  return cpu::update_loss_scale(s, read_flag(finite.ptr, stream) == 0);
}

bool update_loss_scale(cpu::loss_scaler& s, const int* found_nonfinite, cudaStream_t stream) {
  return cpu::update_loss_scale(s, read_flag(found_nonfinite, stream) != 0);
}

} // namespace cmesh::kernels::cuda
