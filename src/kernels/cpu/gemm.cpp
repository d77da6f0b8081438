#include "kernels/gemm.hpp"

#include <cblas.h>

#include <atomic>
#include <mutex>

namespace cmesh::kernels::cpu {

namespace {

std::atomic<int> wanted_threads{1};
std::atomic<int> applied_threads{0}; // 0: OpenBLAS still has its own default

// OpenBLAS starts with as many threads as cores (or OPENBLAS_NUM_THREADS);
// the first product, and the first after a change, pins the count we want.
void apply_threads() {
  const int want = wanted_threads.load(std::memory_order_relaxed);
  if (applied_threads.load(std::memory_order_acquire) == want)
    return;
  static std::mutex m;
  std::lock_guard lock(m);
  openblas_set_num_threads(want);
  applied_threads.store(want, std::memory_order_release);
}

// An empty inner dimension leaves C = beta * C; BLAS would reject lda = 0.
template <class T>
void scale_only(std::size_t m, std::size_t n, T beta, T* c, std::size_t ldc) {
  for (std::size_t r = 0; r < m; ++r)
    for (std::size_t j = 0; j < n; ++j)
      c[r * ldc + j] = beta == T(0) ? T(0) : beta * c[r * ldc + j];
}

CBLAS_TRANSPOSE op(bool t) { return t ? CblasTrans : CblasNoTrans; }

int i(std::size_t v) { return static_cast<int>(v); }

} // namespace

void set_blas_threads(int n) {
  wanted_threads.store(n < 1 ? 1 : n, std::memory_order_relaxed);
  apply_threads();
}

int blas_threads() { return wanted_threads.load(std::memory_order_relaxed); }

void gemm(bool trans_a, bool trans_b, std::size_t m, std::size_t n, std::size_t k, float alpha,
          const float* a, std::size_t lda, const float* b, std::size_t ldb, float beta, float* c,
          std::size_t ldc) {
  if (m == 0 || n == 0)
    return;
  if (k == 0)
    return scale_only(m, n, beta, c, ldc);
  apply_threads();
  cblas_sgemm(CblasRowMajor, op(trans_a), op(trans_b), i(m), i(n), i(k), alpha, a, i(lda), b,
              i(ldb), beta, c, i(ldc));
}

void gemm(bool trans_a, bool trans_b, std::size_t m, std::size_t n, std::size_t k, double alpha,
          const double* a, std::size_t lda, const double* b, std::size_t ldb, double beta,
          double* c, std::size_t ldc) {
  if (m == 0 || n == 0)
    return;
  if (k == 0)
    return scale_only(m, n, beta, c, ldc);
  apply_threads();
  cblas_dgemm(CblasRowMajor, op(trans_a), op(trans_b), i(m), i(n), i(k), alpha, a, i(lda), b,
              i(ldb), beta, c, i(ldc));
}

namespace {

template <class T>
void add_row_bias_t(T* y, const T* bias, std::size_t rows, std::size_t cols) {
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t j = 0; j < cols; ++j)
      y[r * cols + j] += bias[j];
}

template <class T>
void add_column_sums_t(T* sums, const T* x, std::size_t rows, std::size_t cols) {
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t j = 0; j < cols; ++j)
      sums[j] += x[r * cols + j];
}

} // namespace

void add_row_bias(float* y, const float* bias, std::size_t rows, std::size_t cols) {
  add_row_bias_t(y, bias, rows, cols);
}
void add_row_bias(double* y, const double* bias, std::size_t rows, std::size_t cols) {
  add_row_bias_t(y, bias, rows, cols);
}
void add_column_sums(float* sums, const float* x, std::size_t rows, std::size_t cols) {
  add_column_sums_t(sums, x, rows, cols);
}
void add_column_sums(double* sums, const double* x, std::size_t rows, std::size_t cols) {
  add_column_sums_t(sums, x, rows, cols);
}

} // namespace cmesh::kernels::cpu
