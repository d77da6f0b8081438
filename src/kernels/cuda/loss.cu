// Softmax cross-entropy and row softmax (see kernels/cuda/ops.hpp). One
// block per row: the row maximum and the sum of exponentials (in double, as
// the CPU) are block reductions in a fixed order; exp is expf of the same
// float argument as on the CPU.
//
// Outputs may alias inputs: each thread writes only the elements it read
// itself, after the block has finished the reductions over the row.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.hpp"

#include <algorithm>

namespace cmesh::kernels::cuda {

namespace {

__device__ inline double quiet_nan() { return __longlong_as_double(0x7ff8000000000000LL); }

// exp(v - shift) with the exponent rounded to float first, as exp_shifted in
// kernels/cpu/loss.cpp.
__device__ inline double exp_shifted(float v, double shift) {
  return static_cast<double>(expf(static_cast<float>(static_cast<double>(v) - shift)));
}

// log(sum exp(row)) around the row maximum; every thread of the block gets it.
__device__ double log_sum_exp(const float* row, std::size_t n, float* fscratch,
                              double* dscratch) {
  float m = -INFINITY;
  for (std::size_t i = threadIdx.x; i < n; i += blockDim.x) {
    const float v = row[i];
    m = v > m ? v : m;
  }
  const double shift = detail::block_reduce(m, -INFINITY, detail::max_op{}, fscratch);
  double s = 0;
  for (std::size_t i = threadIdx.x; i < n; i += blockDim.x)
    s += exp_shifted(row[i], shift);
  s = detail::block_reduce(s, 0.0, detail::sum_op{}, dscratch);
  return shift + log(s);
}

__global__ void ce_rows_kernel(const float* logits, const std::int32_t* targets,
                               std::size_t rows, std::size_t vocab, double* row_loss) {
  __shared__ float fscratch[32];
  __shared__ double dscratch[32];
  for (std::size_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* row = logits + r * vocab;
    const double lse = log_sum_exp(row, vocab, fscratch, dscratch);
    if (threadIdx.x == 0) {
      const std::int32_t t = targets[r];
      row_loss[r] = t >= 0 && static_cast<std::size_t>(t) < vocab
                      ? lse - static_cast<double>(row[t])
                      : quiet_nan();
    }
  }
}

// One block: *out = mean of v[0, n), n > 0.
__global__ void mean_kernel(const double* v, std::size_t n, double* out) {
  __shared__ double scratch[32];
  double s = 0;
  for (std::size_t i = threadIdx.x; i < n; i += blockDim.x)
    s += v[i];
  s = detail::block_reduce(s, 0.0, detail::sum_op{}, scratch);
  if (threadIdx.x == 0)
    *out = s / static_cast<double>(n);
}

__global__ void ce_backward_kernel(const float* logits, const std::int32_t* targets,
                                   std::size_t rows, std::size_t vocab, double per_row,
                                   float* dlogits) {
  __shared__ float fscratch[32];
  __shared__ double dscratch[32];
  for (std::size_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* row = logits + r * vocab;
    float* out = dlogits + r * vocab;
    const double lse = log_sum_exp(row, vocab, fscratch, dscratch);
    const std::int32_t t = targets[r];
    for (std::size_t i = threadIdx.x; i < vocab; i += blockDim.x) {
      const double p = exp_shifted(row[i], lse);
      const double hot = static_cast<std::int32_t>(i) == t ? 1.0 : 0.0;
      out[i] = static_cast<float>(per_row * (p - hot));
    }
  }
}

__global__ void softmax_rows_kernel(const float* logits, float* probs, std::size_t rows,
                                    std::size_t cols) {
  __shared__ float fscratch[32];
  __shared__ double dscratch[32];
  for (std::size_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* in = logits + r * cols;
    float* out = probs + r * cols;
    const double lse = log_sum_exp(in, cols, fscratch, dscratch);
    for (std::size_t i = threadIdx.x; i < cols; i += blockDim.x)
      out[i] = static_cast<float>(exp_shifted(in[i], lse));
  }
}

__global__ void softmax_rows_backward_kernel(const float* probs, const float* dprobs,
                                             float* dlogits, std::size_t rows,
                                             std::size_t cols) {
  __shared__ double scratch[32];
  for (std::size_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* p = probs + r * cols;
    const float* dp = dprobs + r * cols;
    float* out = dlogits + r * cols;
    double dot = 0;
    for (std::size_t i = threadIdx.x; i < cols; i += blockDim.x)
      dot += static_cast<double>(p[i]) * static_cast<double>(dp[i]);
    dot = detail::block_reduce(dot, 0.0, detail::sum_op{}, scratch);
    for (std::size_t i = threadIdx.x; i < cols; i += blockDim.x)
      out[i] = static_cast<float>(static_cast<double>(p[i]) * (static_cast<double>(dp[i]) - dot));
  }
}

unsigned row_grid(std::size_t rows) {
  return static_cast<unsigned>(std::min<std::size_t>(rows, detail::max_grid));
}

} // namespace

void softmax_cross_entropy_forward(const float* logits, const std::int32_t* targets,
                                   std::size_t rows, std::size_t vocab, double* row_loss,
                                   double* mean_loss, cudaStream_t stream) {
  if (rows == 0 || vocab == 0) {
    // All-zero bits are 0.0 in IEEE double.
    if (rows > 0)
      CMESH_CUDA_CHECK(cudaMemsetAsync(row_loss, 0, rows * sizeof(double), stream));
    if (mean_loss)
      CMESH_CUDA_CHECK(cudaMemsetAsync(mean_loss, 0, sizeof(double), stream));
    return;
  }
  ce_rows_kernel<<<row_grid(rows), detail::row_threads(vocab), 0, stream>>>(logits, targets, rows,
                                                                           vocab, row_loss);
  detail::check_launch();
  if (mean_loss) {
    mean_kernel<<<1, detail::block_threads, 0, stream>>>(row_loss, rows, mean_loss);
    detail::check_launch();
  }
}

void softmax_cross_entropy_backward(const float* logits, const std::int32_t* targets,
                                    std::size_t rows, std::size_t vocab, float dloss,
                                    float* dlogits, cudaStream_t stream) {
  if (rows == 0 || vocab == 0)
    return;
  const double per_row = static_cast<double>(dloss) / static_cast<double>(rows);
  ce_backward_kernel<<<row_grid(rows), detail::row_threads(vocab), 0, stream>>>(
    logits, targets, rows, vocab, per_row, dlogits);
  detail::check_launch();
}

void softmax_rows(const float* logits, float* probs, std::size_t rows, std::size_t cols,
                  cudaStream_t stream) {
  if (rows == 0 || cols == 0)
    return;
  softmax_rows_kernel<<<row_grid(rows), detail::row_threads(cols), 0, stream>>>(logits, probs,
                                                                               rows, cols);
  detail::check_launch();
}

void softmax_rows_backward(const float* probs, const float* dprobs, float* dlogits,
                           std::size_t rows, std::size_t cols, cudaStream_t stream) {
  if (rows == 0 || cols == 0)
    return;
  softmax_rows_backward_kernel<<<row_grid(rows), detail::row_threads(cols), 0, stream>>>(
    probs, dprobs, dlogits, rows, cols);
  detail::check_launch();
}

} // namespace cmesh::kernels::cuda
