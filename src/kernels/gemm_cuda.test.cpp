// CUDA gemm (cuBLAS), add_row_bias and add_column_sums against the CPU oracle.
#include "kernels/cuda/ops.hpp"
#include "kernels/cuda/test_support.hpp"
#include "kernels/gemm.hpp"
#include "kernels/precision.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

namespace {

namespace cpu = cmesh::kernels::cpu;
namespace gpu = cmesh::kernels::cuda;
using namespace cmesh::kernels::cuda_test;

struct shape {
  std::size_t m, n, k;
};

std::vector<float> abs_of(std::vector<float> v) {
  for (auto& x : v)
    x = std::fabs(x);
  return v;
}

} // namespace

TEST_CASE("cuBLAS is opened on demand, with every symbol the gemm needs") {
  // No device needed: the library and its symbols load without a driver.
  // Before it, a process has not mapped it (CPU runs never do).
  CHECK_NOTHROW(gpu::load_cublas());
}

TEST_CASE("cuda gemm: every transpose combination matches the cpu oracle") {
  CMESH_CUDA_TEST_REQUIRE_DEVICE();
  const shape shapes[] = {{1, 1, 1},   {3, 5, 7},   {2, 1, 9},    {17, 31, 13}, {64, 64, 64},
                          {127, 65, 257}, {1, 300, 2}, {200, 1, 99}, {33, 129, 1}};
  struct scalars {
    float alpha, beta;
  };
  const scalars coefficients[] = {{1.0f, 0.0f}, {0.5f, -1.25f}, {-2.0f, 1.0f}};
  gpu::cublas_handle handle;
  stream s;
  auto rng = rng_for(1);
  const float eps = std::numeric_limits<float>::epsilon();
  for (const shape sh : shapes) {
    for (const bool ta : {false, true}) {
      for (const bool tb : {false, true}) {
        for (const scalars co : coefficients) {
          for (const std::size_t pad : {std::size_t{0}, std::size_t{3}}) {
            const std::size_t m = sh.m, n = sh.n, k = sh.k;
            CAPTURE(m);
            CAPTURE(n);
            CAPTURE(k);
            CAPTURE(ta);
            CAPTURE(tb);
            CAPTURE(co.alpha);
            CAPTURE(co.beta);
            CAPTURE(pad);
            const std::size_t rows_a = ta ? k : m, lda = (ta ? m : k) + pad;
            const std::size_t rows_b = tb ? n : k, ldb = (tb ? k : n) + pad;
            const std::size_t ldc = n + pad;
            const auto a = uniform(rows_a * lda, rng, -1.0f, 1.0f);
            const auto b = uniform(rows_b * ldb, rng, -1.0f, 1.0f);
            auto c0 = uniform(m * ldc, rng, -1.0f, 1.0f);
            if (co.beta == 0.0f) // beta == 0 must overwrite, NaN included
              for (std::size_t i = 0; i < c0.size(); i += 3)
                c0[i] = std::numeric_limits<float>::quiet_NaN();

            device_vector<float> da(a), db(b), dc(c0);
            gpu::gemm(handle, ta, tb, m, n, k, co.alpha, da.get(), lda, db.get(), ldb, co.beta,
                      dc.get(), ldc, s);
            s.sync();
            const auto got = dc.download();

            auto want = c0;
            cpu::gemm(ta, tb, m, n, k, co.alpha, a.data(), lda, b.data(), ldb, co.beta,
                      want.data(), ldc);
            // Error bound of a k-term dot product, from both sides: the sum of
            // |alpha a b| and |beta c|. Padding columns must stay untouched.
            const auto abs_a = abs_of(a), abs_b = abs_of(b);
            std::vector<float> scale(m * ldc, 0.0f);
            cpu::gemm(ta, tb, m, n, k, std::fabs(co.alpha), abs_a.data(), lda, abs_b.data(), ldb,
                      0.0f, scale.data(), ldc);
            std::vector<double> tol(m * ldc, 0.0);
            for (std::size_t r = 0; r < m; ++r)
              for (std::size_t j = 0; j < n; ++j) {
                const std::size_t e = r * ldc + j;
                const double beta_c = co.beta == 0.0f ? 0.0 : std::fabs(co.beta * c0[e]);
                tol[e] = 2.0 * static_cast<double>(k + 2) * eps * (scale[e] + beta_c) + 1e-30;
              }
            CHECK(count_outside(got, want, tol, "gemm") == 0);
          }
        }
      }
    }
  }
}

TEST_CASE("cuda gemm with bf16 inputs: the cpu's bf16-input product, up to the sums' order") {
  CMESH_CUDA_TEST_REQUIRE_DEVICE();
  // Operands that hold bf16 values lose nothing to the rounding: the bound
  // is the fp32 sums'. Others may be rounded another way by the library:
  // one bf16 step (2^-8 relative) per operand on top.
  const shape shapes[] = {{3, 5, 7}, {17, 31, 13}, {64, 64, 64}, {127, 65, 257}, {200, 1, 99}};
  gpu::cublas_handle handle;
  stream s;
  auto rng = rng_for(4);
  const float eps = std::numeric_limits<float>::epsilon();
  for (const bool bf16_values : {true, false}) {
    for (const shape sh : shapes) {
      for (const bool ta : {false, true}) {
        for (const bool tb : {false, true}) {
          const std::size_t m = sh.m, n = sh.n, k = sh.k, pad = 2;
          CAPTURE(bf16_values);
          CAPTURE(m);
          CAPTURE(n);
          CAPTURE(k);
          CAPTURE(ta);
          CAPTURE(tb);
          const std::size_t rows_a = ta ? k : m, lda = (ta ? m : k) + pad;
          const std::size_t rows_b = tb ? n : k, ldb = (tb ? k : n) + pad;
          const std::size_t ldc = n + pad;
          auto a = uniform(rows_a * lda, rng, -1.0f, 1.0f);
          auto b = uniform(rows_b * ldb, rng, -1.0f, 1.0f);
          if (bf16_values) {
            cpu::round_to_bf16(a.data(), a.size());
            cpu::round_to_bf16(b.data(), b.size());
          }
          const auto c0 = uniform(m * ldc, rng, -1.0f, 1.0f);
          device_vector<float> da(a), db(b), dc(c0);
          gpu::gemm(handle, ta, tb, m, n, k, 0.5f, da.get(), lda, db.get(), ldb, 1.0f, dc.get(),
                    ldc, s, cmesh::kernels::gemm_math::bf16_inputs);
          s.sync();
          const auto got = dc.download();
          auto want = c0;
          cpu::gemm_bf16_inputs(ta, tb, m, n, k, 0.5f, a.data(), lda, b.data(), ldb, 1.0f,
                                want.data(), ldc);
          const auto abs_a = abs_of(a), abs_b = abs_of(b);
          std::vector<float> scale(m * ldc, 0.0f);
          cpu::gemm(ta, tb, m, n, k, 0.5f, abs_a.data(), lda, abs_b.data(), ldb, 0.0f,
                    scale.data(), ldc);
          const double rounding = bf16_values ? 0.0 : 2.0 * std::ldexp(1.0, -8);
          std::vector<double> tol(m * ldc, 0.0);
          for (std::size_t r = 0; r < m; ++r)
            for (std::size_t j = 0; j < n; ++j) {
              const std::size_t e = r * ldc + j;
              tol[e] = (4.0 * static_cast<double>(k + 2) * eps + rounding) *
                         (scale[e] + std::fabs(c0[e])) + 1e-30;
            }
          CHECK(count_outside(got, want, tol, "gemm bf16 inputs") == 0);
        }
      }
    }
  }
}

TEST_CASE("cuda gemm: k == 0 scales C, beta 0 clears NaN; m or n == 0 is a no-op") {
  CMESH_CUDA_TEST_REQUIRE_DEVICE();
  gpu::cublas_handle handle;
  stream s;
  const std::size_t m = 5, n = 7, ldc = 9;
  auto rng = rng_for(2);
  auto c0 = uniform(m * ldc, rng, -3.0f, 3.0f);
  c0[4] = std::numeric_limits<float>::quiet_NaN();
  for (const float beta : {0.0f, 1.0f, -0.5f}) {
    CAPTURE(beta);
    device_vector<float> dc(c0);
    gpu::gemm(handle, false, false, m, n, 0, 1.0f, nullptr, 1, nullptr, 1, beta, dc.get(), ldc, s);
    s.sync();
    auto want = c0;
    cpu::gemm(false, false, m, n, 0, 1.0f, nullptr, 1, nullptr, 1, beta, want.data(), ldc);
    // beta * NaN is a NaN on both, though not the same bits (the GPU's is canonical).
    CHECK(count_different(dc.download(), want, "k == 0", nan_bits::any) == 0);
  }
  device_vector<float> dc(c0);
  gpu::gemm(handle, false, false, 0, n, 3, 1.0f, nullptr, 3, nullptr, n, 0.0f, dc.get(), ldc, s);
  gpu::gemm(handle, true, true, m, 0, 3, 1.0f, nullptr, m, nullptr, 3, 0.0f, dc.get(), ldc, s);
  s.sync();
  CHECK(count_different(dc.download(), c0, "empty") == 0);
}

TEST_CASE("cuda add_row_bias and add_column_sums: bit-identical to the cpu oracle") {
  CMESH_CUDA_TEST_REQUIRE_DEVICE();
  stream s;
  auto rng = rng_for(3);
  const shape sizes[] = {{1, 1, 0}, {1, 5, 0}, {7, 1, 0}, {3, 257, 0}, {1000, 33, 0},
                         {4099, 129, 0}, {2, 70001, 0}};
  for (const shape sh : sizes) {
    const std::size_t rows = sh.m, cols = sh.n;
    CAPTURE(rows);
    CAPTURE(cols);
    const auto x = uniform(rows * cols, rng, -2.0f, 2.0f);
    const auto bias = uniform(cols, rng, -1.0f, 1.0f);
    const auto sums0 = uniform(cols, rng, -1.0f, 1.0f);

    device_vector<float> dy(x), dbias(bias), dsums(sums0), dx(x);
    gpu::add_row_bias(dy.get(), dbias.get(), rows, cols, s);
    gpu::add_column_sums(dsums.get(), dx.get(), rows, cols, s);
    s.sync();

    auto y = x;
    cpu::add_row_bias(y.data(), bias.data(), rows, cols);
    auto sums = sums0;
    cpu::add_column_sums(sums.data(), x.data(), rows, cols);
    CHECK(count_different(dy.download(), y, "add_row_bias") == 0);
    CHECK(count_different(dsums.download(), sums, "add_column_sums") == 0);
  }
}
