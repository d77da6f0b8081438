#include "kernels/gemm.hpp"
#include "kernels/precision.hpp"

#include <cblas.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <vector>

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

// Counters of the float products (see gemm_counters()).
std::atomic<std::uint64_t> total_calls{0}, total_flops{0}, total_ns{0};

// Per shape: an open-addressed table of 256 slots keyed by the packed shape
// (never 0: sizes are at least 1). A slot is claimed once, by compare and
// swap, and never freed, so a lookup needs no lock. (Expert products alone
// come in a shape per token count an expert receives.)
constexpr int shape_slot_bits = 8;
constexpr std::size_t shape_slots = std::size_t(1) << shape_slot_bits;
constexpr int m_bits = 20, nk_bits = 21;
struct shape_slot {
  std::atomic<std::uint64_t> key{0}, calls{0}, ns{0};
};
shape_slot shapes[shape_slots];

std::uint64_t shape_key(bool ta, bool tb, std::size_t m, std::size_t n, std::size_t k) {
  if (m >> m_bits || n >> nk_bits || k >> nk_bits)
    return 0;
  return (std::uint64_t(ta) << 63) | (std::uint64_t(tb) << 62)
         | (std::uint64_t(m) << (2 * nk_bits)) | (std::uint64_t(n) << nk_bits) | k;
}

void count_product(bool ta, bool tb, std::size_t m, std::size_t n, std::size_t k,
                   std::uint64_t ns) {
  constexpr auto relaxed = std::memory_order_relaxed;
  total_calls.fetch_add(1, relaxed);
  total_flops.fetch_add(2 * std::uint64_t(m) * n * k, relaxed);
  total_ns.fetch_add(ns, relaxed);
  const std::uint64_t key = shape_key(ta, tb, m, n, k);
  if (key == 0)
    return;
  const auto home =
    static_cast<std::size_t>((key * 0x9E3779B97F4A7C15ull) >> (64 - shape_slot_bits));
  for (std::size_t probe = 0; probe < shape_slots; ++probe) {
    auto& s = shapes[(home + probe) % shape_slots];
    std::uint64_t seen = s.key.load(relaxed);
    if (seen == 0 && s.key.compare_exchange_strong(seen, key, relaxed))
      seen = key;
    if (seen == key) {
      s.calls.fetch_add(1, relaxed);
      s.ns.fetch_add(ns, relaxed);
      return;
    }
  }
}

} // namespace

gemm_totals gemm_counters() {
  constexpr auto relaxed = std::memory_order_relaxed;
  gemm_totals t;
  t.calls = total_calls.load(relaxed);
  t.flops = total_flops.load(relaxed);
  t.ns = total_ns.load(relaxed);
  return t;
}

std::vector<gemm_shape_totals> gemm_shape_counters() {
  constexpr auto relaxed = std::memory_order_relaxed;
  constexpr std::uint64_t nk_mask = (std::uint64_t(1) << nk_bits) - 1;
  std::vector<gemm_shape_totals> out;
  for (auto& s : shapes) {
    const std::uint64_t key = s.key.load(relaxed);
    if (key == 0)
      continue;
    gemm_shape_totals t;
    t.trans_a = (key >> 63) & 1;
    t.trans_b = (key >> 62) & 1;
    t.m = static_cast<std::size_t>((key >> (2 * nk_bits)) & ((std::uint64_t(1) << m_bits) - 1));
    t.n = static_cast<std::size_t>((key >> nk_bits) & nk_mask);
    t.k = static_cast<std::size_t>(key & nk_mask);
    t.calls = s.calls.load(relaxed);
    t.ns = s.ns.load(relaxed);
    out.push_back(t);
  }
  return out;
}

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
  const auto t0 = std::chrono::steady_clock::now();
  cblas_sgemm(CblasRowMajor, op(trans_a), op(trans_b), i(m), i(n), i(k), alpha, a, i(lda), b,
              i(ldb), beta, c, i(ldc));
  const auto dt = std::chrono::steady_clock::now() - t0;
  count_product(trans_a, trans_b, m, n, k,
                static_cast<std::uint64_t>(
                  std::chrono::duration_cast<std::chrono::nanoseconds>(dt).count()));
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

namespace {

// The [rows, cols] block of a row-major matrix with leading dimension ld,
// rounded to bf16, packed (leading dimension cols) into out.
const float* rounded_block(const float* x, std::size_t rows, std::size_t cols, std::size_t ld,
                           std::vector<float>& out) {
  out.resize(rows * cols);
  for (std::size_t r = 0; r < rows; ++r)
    std::copy_n(x + r * ld, cols, out.data() + r * cols);
  round_to_bf16(out.data(), out.size());
  return out.data();
}

} // namespace

void gemm_bf16_inputs(bool trans_a, bool trans_b, std::size_t m, std::size_t n, std::size_t k,
                      float alpha, const float* a, std::size_t lda, const float* b,
                      std::size_t ldb, float beta, float* c, std::size_t ldc) {
  if (m == 0 || n == 0 || k == 0)
    return gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  thread_local std::vector<float> ra, rb;
  // As stored: A is [m, k] ([k, m] when transposed), B [k, n] ([n, k]).
  const std::size_t a_cols = trans_a ? m : k, b_cols = trans_b ? k : n;
  const float* a16 = rounded_block(a, trans_a ? k : m, a_cols, lda, ra);
  const float* b16 = rounded_block(b, trans_b ? n : k, b_cols, ldb, rb);
  gemm(trans_a, trans_b, m, n, k, alpha, a16, a_cols, b16, b_cols, beta, c, ldc);
}

} // namespace cmesh::kernels::cpu
