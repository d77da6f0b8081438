// Dense matrix products and the row/column helpers around them. Every
// matrix product of the CPU path goes through gemm(), which calls OpenBLAS
// with a fixed thread count so that results are bit-reproducible run to run.
// Also compiled by nvcc (C++17): keep this header free of C++20.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace cmesh::kernels {

/// How a product takes its fp32 operands (model.products).
/// - fp32: as they are, products and sums in fp32.
/// - bf16_inputs: each operand rounded to bf16 (to nearest, ties to even),
///   the products accumulated in fp32: what tensor cores do with bf16
///   inputs (cuBLAS's CUBLAS_COMPUTE_32F_FAST_16BF on a GPU). Operands that
///   already hold bf16 values (bf16 weights and activations) go through
///   unchanged; what it rounds is the gradients flowing back.
enum class gemm_math { fp32, bf16_inputs };

} // namespace cmesh::kernels

namespace cmesh::kernels::cpu {

/// Threads OpenBLAS may use (default 1). A product's rounding depends on how
/// the work is split, so a fixed count keeps results bit-identical; set it
/// once, before training starts. n < 1 is taken as 1.
void set_blas_threads(int n);
int blas_threads();

/// Row-major C[m,n] = alpha * op(A) * op(B) + beta * C, where op(A) is
/// [m,k] (A stored [m,k] with leading dimension lda, or [k,m] when
/// trans_a) and op(B) is [k,n] (B stored [k,n], or [n,k] when trans_b).
/// beta == 0 overwrites C (NaN in C does not leak). Sizes of 0 are fine.
void gemm(bool trans_a, bool trans_b, std::size_t m, std::size_t n, std::size_t k, float alpha,
          const float* a, std::size_t lda, const float* b, std::size_t ldb, float beta, float* c,
          std::size_t ldc);
/// The same in double: the gradient checks run the network in double.
void gemm(bool trans_a, bool trans_b, std::size_t m, std::size_t n, std::size_t k, double alpha,
          const double* a, std::size_t lda, const double* b, std::size_t ldb, double beta,
          double* c, std::size_t ldc);

/// gemm() of the operands rounded to bf16 (gemm_math::bf16_inputs): the
/// used part of each operand is rounded into scratch of this thread's and
/// multiplied there, so the result is gemm() of the rounded operands, bit
/// for bit. a and b are left as they are.
void gemm_bf16_inputs(bool trans_a, bool trans_b, std::size_t m, std::size_t n, std::size_t k,
                      float alpha, const float* a, std::size_t lda, const float* b,
                      std::size_t ldb, float beta, float* c, std::size_t ldc);

/// What the float gemm() has done in this process since it started: the
/// products handed to OpenBLAS, their flops (2 m n k each) and the wall time
/// spent inside it. Relaxed atomic counters, cheap enough to stay on; the
/// worker prints them at the end of a run.
struct gemm_totals {
  std::uint64_t calls = 0;
  std::uint64_t flops = 0;
  std::uint64_t ns = 0;
};
gemm_totals gemm_counters();

/// The same per distinct product (transposes and sizes), for the first 256
/// distinct ones seen; products of a shape seen later count in the totals
/// only, as do those with m of 2^20 or more, or n or k of 2^21 or more. In
/// no particular order.
struct gemm_shape_totals {
  bool trans_a = false;
  bool trans_b = false;
  std::size_t m = 0, n = 0, k = 0;
  std::uint64_t calls = 0;
  std::uint64_t ns = 0;
};
std::vector<gemm_shape_totals> gemm_shape_counters();

/// y[r, j] += bias[j] for r < rows, j < cols (y is row-major [rows, cols]).
void add_row_bias(float* y, const float* bias, std::size_t rows, std::size_t cols);
void add_row_bias(double* y, const double* bias, std::size_t rows, std::size_t cols);

/// sums[j] += sum_r x[r, j]: the bias gradient. Rows are added in order, so
/// the result does not depend on anything but the inputs.
void add_column_sums(float* sums, const float* x, std::size_t rows, std::size_t cols);
void add_column_sums(double* sums, const double* x, std::size_t rows, std::size_t cols);

} // namespace cmesh::kernels::cpu
