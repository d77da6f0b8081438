// Internal helpers of the CUDA kernels in kernels/cuda/*.cu (nvcc only):
// launch shapes and fixed-tree reductions. A launch shape depends only on
// the sizes, and every reduction here combines values in a fixed order, so
// results are bit-identical run to run.
#pragma once

#include "kernels/cuda_check.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>

namespace cmesh::kernels::cuda::detail {

constexpr unsigned block_threads = 256;
constexpr std::size_t max_grid = 65535; // grid-stride loops cover the rest

/// Blocks for a grid-stride loop over n items (at least 1).
inline unsigned grid_for(std::size_t n, unsigned threads = block_threads) {
  const std::size_t want = (n + threads - 1) / threads;
  return static_cast<unsigned>(std::clamp<std::size_t>(want, 1, max_grid));
}

/// Threads for one block per row of `cols`: a power of two in [32, 256].
inline unsigned row_threads(std::size_t cols) {
  unsigned t = 32;
  while (t < 256 && t < cols)
    t <<= 1;
  return t;
}

inline void check_launch() { CMESH_CUDA_CHECK(cudaGetLastError()); }

__device__ inline std::size_t thread_index() {
  return static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ inline std::size_t thread_stride() {
  return static_cast<std::size_t>(gridDim.x) * blockDim.x;
}

struct sum_op {
  template <class T>
  __device__ T operator()(T a, T b) const {
    return a + b;
  }
};

// a > b ? a : b, as the CPU's row maximum.
struct max_op {
  __device__ float operator()(float a, float b) const { return b > a ? b : a; }
};

/// Lane 0 receives op over the 32 lanes (a fixed tree, shuffle
/// offsets 16, 8, 4, 2, 1). The whole warp must call it.
template <class T, class Op>
__device__ T warp_reduce(T v, Op op) {
  for (int offset = 16; offset > 0; offset >>= 1)
    v = op(v, __shfl_down_sync(0xffffffffu, v, offset));
  return v;
}

/// Every thread of the block receives op over the block's values: each warp
/// reduces, then warp 0 reduces the per-warp results. blockDim.x must be a
/// multiple of 32; every thread must call it (it synchronizes the block).
/// `scratch` is __shared__ T[32]; it may be reused once this returns.
template <class T, class Op>
__device__ T block_reduce(T v, T identity, Op op, T* scratch) {
  const unsigned lane = threadIdx.x & 31u;
  const unsigned warp = threadIdx.x >> 5;
  const unsigned warps = blockDim.x >> 5;
  v = warp_reduce(v, op);
  if (lane == 0)
    scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < warps ? scratch[lane] : identity;
    v = warp_reduce(v, op);
    if (lane == 0)
      scratch[0] = v;
  }
  __syncthreads();
  const T total = scratch[0];
  __syncthreads();
  return total;
}

} // namespace cmesh::kernels::cuda::detail
