// Row gathers and scatter-adds by index (see kernels/cuda/ops.hpp).
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.hpp"

namespace cmesh::kernels::cuda {

namespace {

__global__ void gather_rows_kernel(const float* __restrict__ table,
                                   const std::int32_t* __restrict__ index, std::size_t count,
                                   std::size_t width, float* __restrict__ out) {
  const std::size_t total = count * width;
  for (std::size_t e = detail::thread_index(); e < total; e += detail::thread_stride()) {
    const std::int32_t row = index[e / width];
    out[e] = row < 0 ? 0.0f : table[static_cast<std::size_t>(row) * width + e % width];
  }
}

// One thread per column walks the indices in order: table[index[i], j] gets
// rows[i, j] added in order of i, as on the CPU, whatever the repeats.
__global__ void scatter_add_ordered_kernel(const float* __restrict__ rows,
                                           const std::int32_t* __restrict__ index,
                                           std::size_t count, std::size_t width, float* table) {
  for (std::size_t j = detail::thread_index(); j < width; j += detail::thread_stride()) {
    for (std::size_t i = 0; i < count; ++i) {
      const std::int32_t row = index[i];
      if (row >= 0)
        table[static_cast<std::size_t>(row) * width + j] += rows[i * width + j];
    }
  }
}

__global__ void scatter_add_atomic_kernel(const float* __restrict__ rows,
                                          const std::int32_t* __restrict__ index,
                                          std::size_t count, std::size_t width, float* table) {
  const std::size_t total = count * width;
  for (std::size_t e = detail::thread_index(); e < total; e += detail::thread_stride()) {
    const std::int32_t row = index[e / width];
    if (row >= 0)
      atomicAdd(table + static_cast<std::size_t>(row) * width + e % width, rows[e]);
  }
}

} // namespace

void gather_rows(const float* table, const std::int32_t* index, std::size_t count,
                 std::size_t width, float* out, cudaStream_t stream) {
  if (count == 0 || width == 0)
    return;
  gather_rows_kernel<<<detail::grid_for(count * width), detail::block_threads, 0, stream>>>(
    table, index, count, width, out);
  detail::check_launch();
}

void scatter_add_rows(const float* rows, const std::int32_t* index, std::size_t count,
                      std::size_t width, float* table, cudaStream_t stream) {
  if (count == 0 || width == 0)
    return;
  // Small blocks: the parallelism is the width, spread it over the SMs.
  constexpr unsigned threads = 32;
  scatter_add_ordered_kernel<<<detail::grid_for(width, threads), threads, 0, stream>>>(
    rows, index, count, width, table);
  detail::check_launch();
}

void scatter_add_rows_atomic(const float* rows, const std::int32_t* index, std::size_t count,
                             std::size_t width, float* table, cudaStream_t stream) {
  if (count == 0 || width == 0)
    return;
  scatter_add_atomic_kernel<<<detail::grid_for(count * width), detail::block_threads, 0,
                              stream>>>(rows, index, count, width, table);
  detail::check_launch();
}

} // namespace cmesh::kernels::cuda
