// CMESH_CUDA_CHECK(expr): a failed CUDA runtime call becomes a thrown
// std::runtime_error naming the call, file:line and cudaGetErrorString.
// Only for builds with CMESH_HAVE_CUDA; also compiled by nvcc (C++17).
#pragma once

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

namespace cmesh::kernels::detail {

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* expr, const char* file,
                                          int line) {
  throw std::runtime_error(std::string(file) + ":" + std::to_string(line) + ": " + expr +
                           " failed: " + cudaGetErrorName(err) + ": " +
                           cudaGetErrorString(err));
}

} // namespace cmesh::kernels::detail

#define CMESH_CUDA_CHECK(expr)                                                      \
  do {                                                                              \
    const cudaError_t cmesh_cuda_err_ = (expr);                                     \
    if (cmesh_cuda_err_ != cudaSuccess)                                             \
      ::cmesh::kernels::detail::throw_cuda_error(cmesh_cuda_err_, #expr, __FILE__, \
                                                 __LINE__);                         \
  } while (false)
