#include "kernels/gemm.hpp"
#include "kernels/precision.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace {

namespace k = cmesh::kernels::cpu;

template <class T>
std::vector<T> random_matrix(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<T> m(n);
  for (auto& x : m)
    x = static_cast<T>(u(rng));
  return m;
}

// op(A)[i,p] of a row-major matrix stored [m,k] (or [k,m] when transposed).
template <class T>
double at(const std::vector<T>& a, bool trans, std::size_t i, std::size_t p, std::size_t ld) {
  return static_cast<double>(trans ? a[p * ld + i] : a[i * ld + p]);
}

} // namespace

TEST_CASE("gemm: a 2x3 by 3x2 product by hand") {
  const std::vector<float> a{1, 2, 3, 4, 5, 6};    // [2,3]
  const std::vector<float> b{7, 8, 9, 10, 11, 12}; // [3,2]
  std::vector<float> c(4, 1.0f);
  k::gemm(false, false, 2, 2, 3, 1.0f, a.data(), 3, b.data(), 2, 1.0f, c.data(), 2);
  CHECK(c[0] == 59.0f); // 1 + 1*7 + 2*9 + 3*11
  CHECK(c[1] == 65.0f);
  CHECK(c[2] == 140.0f);
  CHECK(c[3] == 155.0f);
}

TEST_CASE("gemm: every transpose combination matches a naive product") {
  const std::size_t m = 5, n = 7, kk = 3;
  for (const bool ta : {false, true}) {
    for (const bool tb : {false, true}) {
      CAPTURE(ta);
      CAPTURE(tb);
      // Padded leading dimensions: the wrapper must honour them.
      const std::size_t lda = (ta ? m : kk) + 2, ldb = (tb ? kk : n) + 1, ldc = n + 3;
      const auto a = random_matrix<float>((ta ? kk : m) * lda, 1);
      const auto b = random_matrix<float>((tb ? n : kk) * ldb, 2);
      auto c = random_matrix<float>(m * ldc, 3);
      const auto c0 = c;
      k::gemm(ta, tb, m, n, kk, 0.5f, a.data(), lda, b.data(), ldb, -2.0f, c.data(), ldc);
      double worst = 0;
      for (std::size_t i = 0; i < m; ++i)
        for (std::size_t j = 0; j < n; ++j) {
          double want = -2.0 * c0[i * ldc + j];
          for (std::size_t p = 0; p < kk; ++p)
            want += 0.5 * at(a, ta, i, p, lda) * at(b, tb, p, j, ldb);
          worst = std::fmax(worst, std::fabs(want - c[i * ldc + j]));
        }
      CHECK(worst < 1e-5);
      // Padding columns of C are untouched.
      for (std::size_t i = 0; i < m; ++i)
        for (std::size_t j = n; j < ldc; ++j)
          CHECK(c[i * ldc + j] == c0[i * ldc + j]);
    }
  }
}

TEST_CASE("gemm with bf16 inputs: the product of the operands rounded to bf16, bit for bit") {
  const std::size_t m = 6, n = 5, kk = 9;
  for (const bool ta : {false, true}) {
    for (const bool tb : {false, true}) {
      CAPTURE(ta);
      CAPTURE(tb);
      const std::size_t lda = (ta ? m : kk) + 3, ldb = (tb ? kk : n) + 2, ldc = n + 1;
      const auto a = random_matrix<float>((ta ? kk : m) * lda, 5);
      const auto b = random_matrix<float>((tb ? n : kk) * ldb, 6);
      const auto c0 = random_matrix<float>(m * ldc, 7);
      auto a16 = a, b16 = b;
      k::round_to_bf16(a16.data(), a16.size());
      k::round_to_bf16(b16.data(), b16.size());
      auto want = c0, got = c0, full = c0;
      k::gemm(ta, tb, m, n, kk, 0.75f, a16.data(), lda, b16.data(), ldb, 0.5f, want.data(), ldc);
      const auto a_in = a, b_in = b;
      k::gemm_bf16_inputs(ta, tb, m, n, kk, 0.75f, a.data(), lda, b.data(), ldb, 0.5f,
                           got.data(), ldc);
      CHECK(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)) == 0);
      CHECK(a == a_in); // the operands are left as they are
      CHECK(b == b_in);
      // Random fp32 operands are not bf16 values: the rounding shows, and
      // stays within two bf16 steps of each term.
      k::gemm(ta, tb, m, n, kk, 0.75f, a.data(), lda, b.data(), ldb, 0.5f, full.data(), ldc);
      CHECK(got != full);
      for (std::size_t e = 0; e < got.size(); ++e)
        CHECK(std::fabs(got[e] - full[e]) <= 0.75 * kk * 2.0 * std::ldexp(1.0, -8) + 1e-6);
    }
  }
  // Operands that hold bf16 values multiply as they are.
  auto a = random_matrix<float>(m * kk, 8), b = random_matrix<float>(kk * n, 9);
  k::round_to_bf16(a.data(), a.size());
  k::round_to_bf16(b.data(), b.size());
  std::vector<float> x(m * n, 0.0f), y(m * n, 0.0f);
  k::gemm(false, false, m, n, kk, 1.0f, a.data(), kk, b.data(), n, 0.0f, x.data(), n);
  k::gemm_bf16_inputs(false, false, m, n, kk, 1.0f, a.data(), kk, b.data(), n, 0.0f, y.data(), n);
  CHECK(x == y);
}

TEST_CASE("gemm: beta 0 overwrites NaN; k == 0 scales C; empty sizes are no-ops") {
  const std::vector<float> a{1, 2}, b{3, 4};
  std::vector<float> c{std::numeric_limits<float>::quiet_NaN()};
  k::gemm(false, false, 1, 1, 2, 1.0f, a.data(), 2, b.data(), 1, 0.0f, c.data(), 1);
  CHECK(c[0] == 11.0f);
  std::vector<float> d{3.0f, 4.0f};
  k::gemm(false, false, 1, 2, 0, 1.0f, nullptr, 1, nullptr, 2, 2.0f, d.data(), 2);
  CHECK(d[0] == 6.0f);
  CHECK(d[1] == 8.0f);
  k::gemm(false, false, 1, 2, 0, 1.0f, nullptr, 1, nullptr, 2, 0.0f, d.data(), 2);
  CHECK(d[0] == 0.0f);
  k::gemm(false, false, 0, 2, 2, 1.0f, nullptr, 2, nullptr, 2, 0.0f, nullptr, 2);
}

TEST_CASE("gemm: the backward products of y = x W match finite differences (double)") {
  // loss = sum(R .* (X W)); dX = R W^T, dW = X^T R.
  const std::size_t rows = 4, in = 3, out = 5;
  auto x = random_matrix<double>(rows * in, 4);
  auto w = random_matrix<double>(in * out, 5);
  const auto r = random_matrix<double>(rows * out, 6);
  auto loss = [&] {
    std::vector<double> y(rows * out);
    k::gemm(false, false, rows, out, in, 1.0, x.data(), in, w.data(), out, 0.0, y.data(), out);
    double s = 0;
    for (std::size_t i = 0; i < y.size(); ++i)
      s += r[i] * y[i];
    return s;
  };
  std::vector<double> dx(rows * in), dw(in * out);
  k::gemm(false, true, rows, in, out, 1.0, r.data(), out, w.data(), out, 0.0, dx.data(), in);
  k::gemm(true, false, in, out, rows, 1.0, x.data(), in, r.data(), out, 0.0, dw.data(), out);
  const double h = 1e-6;
  auto check = [&](std::vector<double>& p, const std::vector<double>& grad) {
    for (std::size_t i = 0; i < p.size(); ++i) {
      const double keep = p[i];
      p[i] = keep + h;
      const double up = loss();
      p[i] = keep - h;
      const double down = loss();
      p[i] = keep;
      CHECK(std::fabs((up - down) / (2 * h) - grad[i]) < 1e-8);
    }
  };
  check(x, dx);
  check(w, dw);
}

TEST_CASE("gemm: repeated products are bit-identical at a fixed thread count") {
  k::set_blas_threads(1);
  CHECK(k::blas_threads() == 1);
  const std::size_t m = 64, n = 96, kk = 128;
  const auto a = random_matrix<float>(m * kk, 7);
  const auto b = random_matrix<float>(kk * n, 8);
  std::vector<float> c1(m * n), c2(m * n);
  k::gemm(false, false, m, n, kk, 1.0f, a.data(), kk, b.data(), n, 0.0f, c1.data(), n);
  k::gemm(false, false, m, n, kk, 1.0f, a.data(), kk, b.data(), n, 0.0f, c2.data(), n);
  CHECK(c1 == c2);
  k::set_blas_threads(0); // clamped to 1
  CHECK(k::blas_threads() == 1);
}

TEST_CASE("add_row_bias and add_column_sums") {
  std::vector<float> y{1, 2, 3, 4, 5, 6}; // [2,3]
  const std::vector<float> bias{10, 20, 30};
  k::add_row_bias(y.data(), bias.data(), 2, 3);
  CHECK(y == std::vector<float>{11, 22, 33, 14, 25, 36});
  std::vector<float> sums{1, 1, 1};
  k::add_column_sums(sums.data(), y.data(), 2, 3);
  CHECK(sums == std::vector<float>{26, 48, 70});
}
