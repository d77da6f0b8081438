// y += alpha * x over n floats. The CPU version is the oracle for the CUDA one.
// Also compiled by nvcc (C++17): keep this header free of C++20.
#pragma once

#include <cstddef>

#ifdef CMESH_HAVE_CUDA
#include <cuda_runtime_api.h> // cudaStream_t
#endif

namespace cmesh::kernels::cpu {

/// y[i] += alpha * x[i] for i < n. n == 0 touches nothing (null pointers are fine).
void scale_add(float* y, const float* x, float alpha, std::size_t n);

} // namespace cmesh::kernels::cpu

#ifdef CMESH_HAVE_CUDA
namespace cmesh::kernels::cuda {

/// y[i] += alpha * x[i] for i < n, with x and y in device memory, enqueued on
/// `stream` (asynchronous: synchronize before reading y). Throws
/// std::runtime_error when the launch fails. n == 0 enqueues nothing.
/// The GPU may fuse the multiply-add, so results can differ from the CPU
/// version by one rounding.
void scale_add(float* y, const float* x, float alpha, std::size_t n, cudaStream_t stream);

} // namespace cmesh::kernels::cuda
#endif
