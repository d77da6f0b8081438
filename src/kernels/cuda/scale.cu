#include "kernels/cuda_check.hpp"
#include "kernels/scale.hpp"

#include <algorithm>

namespace cmesh::kernels::cuda {

namespace {

__global__ void scale_add_kernel(float* __restrict__ y, const float* __restrict__ x, float alpha,
                                 std::size_t n) {
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride)
    y[i] += alpha * x[i];
}

} // namespace

void scale_add(float* y, const float* x, float alpha, std::size_t n, cudaStream_t stream) {
  if (n == 0)
    return;
  constexpr unsigned threads = 256;
  // A grid-stride loop: enough blocks to fill the device, no more.
  constexpr std::size_t max_blocks = 65535;
  const auto blocks =
    static_cast<unsigned>(std::min<std::size_t>((n + threads - 1) / threads, max_blocks));
  scale_add_kernel<<<blocks, threads, 0, stream>>>(y, x, alpha, n);
  CMESH_CUDA_CHECK(cudaGetLastError());
}

} // namespace cmesh::kernels::cuda
