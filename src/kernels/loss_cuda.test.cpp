// CUDA softmax cross-entropy and row softmax against the CPU oracle.
//
// Where the tolerances come from: both sides evaluate exp at the same float
// argument, but the device expf may be a couple of ulp off the CPU's; and
// where the shift is the log-sum-exp (backward, softmax), a log-sum-exp that
// differs in its last bits can round the float argument x - lse to the
// neighbouring float, a relative change of up to ulp(|x - lse|) in the
// result. Hence a relative tolerance that grows with |x - lse|.
#include "kernels/cuda/ops.hpp"
#include "kernels/cuda/test_support.hpp"
#include "kernels/loss.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

namespace cpu = cmesh::kernels::cpu;
namespace gpu = cmesh::kernels::cuda;
using namespace cmesh::kernels::cuda_test;

struct shape {
  std::size_t rows, cols;
};

// Odd sizes around the block sizes (32..256 threads per row); more rows than
// the grid limit (65535) exercise the grid-stride loop.
constexpr shape shapes[] = {{1, 1},    {1, 2},     {3, 7},    {5, 33},     {16, 256}, {7, 257},
                            {33, 1000}, {2, 5003}, {1000, 17}, {70001, 3}};

// Logits in [-10, 10]; every fifth row shifted by +-1000 (stability).
std::vector<float> make_logits(const shape& sh, std::mt19937& rng) {
  auto x = uniform(sh.rows * sh.cols, rng, -10.0f, 10.0f);
  for (std::size_t r = 0; r < sh.rows; r += 5)
    for (std::size_t i = 0; i < sh.cols; ++i)
      x[r * sh.cols + i] += (r / 5) % 2 == 0 ? 1000.0f : -1000.0f;
  return x;
}

// log-sum-exp of each row, in double on the host.
std::vector<double> row_lse(const std::vector<float>& x, const shape& sh) {
  std::vector<double> lse(sh.rows);
  for (std::size_t r = 0; r < sh.rows; ++r) {
    const float* row = x.data() + r * sh.cols;
    double m = row[0];
    for (std::size_t i = 1; i < sh.cols; ++i)
      m = std::fmax(m, static_cast<double>(row[i]));
    double s = 0;
    for (std::size_t i = 0; i < sh.cols; ++i)
      s += std::exp(static_cast<double>(row[i]) - m);
    lse[r] = m + std::log(s);
  }
  return lse;
}

// Relative tolerance of exp(x - lse) evaluated in float on both sides.
double exp_rel_tol(double arg) { return 2e-6 + 2.5e-7 * std::fabs(arg); }

} // namespace

TEST_CASE("cuda softmax_cross_entropy_forward: per-row losses and mean match the cpu oracle") {
  CMESH_CUDA_TEST_REQUIRE_DEVICE();
  stream s;
  auto rng = rng_for(1);
  for (const shape sh : shapes) {
    CAPTURE(sh.rows);
    CAPTURE(sh.cols);
    const auto logits = make_logits(sh, rng);
    const auto targets = uniform_int(sh.rows, rng, 0, static_cast<std::int32_t>(sh.cols) - 1);
    device_vector<float> dlogits(logits);
    device_vector<std::int32_t> dtargets(targets);
    device_vector<double> drow(sh.rows), dmean(1);
    gpu::softmax_cross_entropy_forward(dlogits.get(), dtargets.get(), sh.rows, sh.cols,
                                       drow.get(), dmean.get(), s);
    s.sync();

    std::vector<double> want_rows(sh.rows);
    for (std::size_t r = 0; r < sh.rows; ++r)
      want_rows[r] = cpu::softmax_cross_entropy_forward(logits.data() + r * sh.cols,
                                                        targets.data() + r, 1, sh.cols);
    const double want_mean =
      cpu::softmax_cross_entropy_forward(logits.data(), targets.data(), sh.rows, sh.cols);
    // The shift is the row maximum on both sides, so only expf differs.
    CHECK(count_outside(drow.download(), want_rows, 1e-9, 2e-6, "row loss") == 0);
    CHECK(count_outside(dmean.download(), std::vector<double>{want_mean}, 1e-9, 2e-6, "mean") ==
          0);
  }
}

TEST_CASE("cuda softmax_cross_entropy_forward: edge cases") {
  CMESH_CUDA_TEST_REQUIRE_DEVICE();
  stream s;
  // A target outside [0, vocab) gives NaN for its row (and the mean).
  const std::vector<float> logits{1.0f, 2.0f, 3.0f, 0.0f, 0.0f, 0.0f, 5.0f, 5.0f, 5.0f};
  const std::vector<std::int32_t> targets{2, 3, -1};
  device_vector<float> dlogits(logits);
  device_vector<std::int32_t> dtargets(targets);
  device_vector<double> drow(3), dmean(std::vector<double>{123.0});
  gpu::softmax_cross_entropy_forward(dlogits.get(), dtargets.get(), 3, 3, drow.get(), dmean.get(),
                                     s);
  s.sync();
  const auto rows = drow.download();
  CHECK(rows[0] == doctest::Approx(cpu::softmax_cross_entropy_forward(logits.data(),
                                                                        targets.data(), 1, 3)));
  CHECK(std::isnan(rows[1]));
  CHECK(std::isnan(rows[2]));
  CHECK(std::isnan(dmean.download()[0]));
  // rows == 0: the mean is 0. A null mean pointer is allowed.
  gpu::softmax_cross_entropy_forward(nullptr, nullptr, 0, 3, nullptr, dmean.get(), s);
  gpu::softmax_cross_entropy_forward(dlogits.get(), dtargets.get(), 1, 3, drow.get(), nullptr, s);
  s.sync();
  CHECK(dmean.download()[0] == 0.0);
}

TEST_CASE("cuda softmax_cross_entropy_backward matches the cpu oracle (also in place)") {
  CMESH_CUDA_TEST_REQUIRE_DEVICE();
  stream s;
  auto rng = rng_for(2);
  for (const float dloss : {1.0f, 0.37f, 65536.0f}) {
    for (const shape sh : shapes) {
      CAPTURE(sh.rows);
      CAPTURE(sh.cols);
      CAPTURE(dloss);
      const auto logits = make_logits(sh, rng);
      const auto targets = uniform_int(sh.rows, rng, 0, static_cast<std::int32_t>(sh.cols) - 1);
      device_vector<float> dlogits(logits), dgrad(sh.rows * sh.cols), dinplace(logits);
      device_vector<std::int32_t> dtargets(targets);
      gpu::softmax_cross_entropy_backward(dlogits.get(), dtargets.get(), sh.rows, sh.cols, dloss,
                                          dgrad.get(), s);
      gpu::softmax_cross_entropy_backward(dinplace.get(), dtargets.get(), sh.rows, sh.cols, dloss,
                                          dinplace.get(), s);
      s.sync();

      std::vector<float> want(sh.rows * sh.cols);
      cpu::softmax_cross_entropy_backward(logits.data(), targets.data(), sh.rows, sh.cols, dloss,
                                          want.data());
      const auto lse = row_lse(logits, sh);
      const double per_row = static_cast<double>(dloss) / static_cast<double>(sh.rows);
      std::vector<double> tol(want.size());
      for (std::size_t r = 0; r < sh.rows; ++r)
        for (std::size_t i = 0; i < sh.cols; ++i) {
          const std::size_t e = r * sh.cols + i;
          const double arg = static_cast<double>(logits[e]) - lse[r];
          tol[e] = std::fabs(per_row) * std::exp(arg) * exp_rel_tol(arg) +
                   2.5e-7 * std::fabs(static_cast<double>(want[e])) + 1e-37;
        }
      const auto got = dgrad.download();
      CHECK(count_outside(got, want, tol, "dlogits") == 0);
      CHECK(count_different(dinplace.download(), got, "dlogits in place") == 0);
    }
  }
}

TEST_CASE("cuda softmax_rows and softmax_rows_backward match the cpu oracle (also in place)") {
  CMESH_CUDA_TEST_REQUIRE_DEVICE();
  stream s;
  auto rng = rng_for(3);
  for (const shape sh : shapes) {
    CAPTURE(sh.rows);
    CAPTURE(sh.cols);
    const std::size_t n = sh.rows * sh.cols;
    const auto logits = make_logits(sh, rng);
    device_vector<float> dlogits(logits), dprobs(n), dinplace(logits);
    gpu::softmax_rows(dlogits.get(), dprobs.get(), sh.rows, sh.cols, s);
    gpu::softmax_rows(dinplace.get(), dinplace.get(), sh.rows, sh.cols, s);
    s.sync();
    std::vector<float> probs(n);
    cpu::softmax_rows(logits.data(), probs.data(), sh.rows, sh.cols);
    const auto lse = row_lse(logits, sh);
    std::vector<double> tol(n);
    for (std::size_t r = 0; r < sh.rows; ++r)
      for (std::size_t i = 0; i < sh.cols; ++i) {
        const double arg = static_cast<double>(logits[r * sh.cols + i]) - lse[r];
        tol[r * sh.cols + i] = std::exp(arg) * exp_rel_tol(arg) + 1e-37;
      }
    const auto got = dprobs.download();
    CHECK(count_outside(got, probs, tol, "softmax_rows") == 0);
    CHECK(count_different(dinplace.download(), got, "softmax_rows in place") == 0);

    // Backward from the CPU's probabilities, so that only the kernel differs.
    const auto dp = uniform(n, rng, -1.0f, 1.0f);
    device_vector<float> dp_probs(probs), ddp(dp), dgrad(n), dgrad_inplace(dp);
    gpu::softmax_rows_backward(dp_probs.get(), ddp.get(), dgrad.get(), sh.rows, sh.cols, s);
    gpu::softmax_rows_backward(dp_probs.get(), dgrad_inplace.get(), dgrad_inplace.get(), sh.rows,
                               sh.cols, s);
    s.sync();
    std::vector<float> want(n);
    cpu::softmax_rows_backward(probs.data(), dp.data(), want.data(), sh.rows, sh.cols);
    // The dot product is summed in double in another order: the results can
    // round to neighbouring floats.
    std::vector<double> btol(n);
    for (std::size_t r = 0; r < sh.rows; ++r) {
      double abs_dot = 0;
      for (std::size_t i = 0; i < sh.cols; ++i)
        abs_dot += std::fabs(static_cast<double>(probs[r * sh.cols + i]) * dp[r * sh.cols + i]);
      for (std::size_t i = 0; i < sh.cols; ++i) {
        const std::size_t e = r * sh.cols + i;
        btol[e] = 2.5e-7 * std::fabs(static_cast<double>(want[e])) +
                  1e-13 * probs[e] * (std::fabs(dp[e]) + abs_dot) + 1e-37;
      }
    }
    const auto bgot = dgrad.download();
    CHECK(count_outside(bgot, want, btol, "softmax_rows_backward") == 0);
    CHECK(count_different(dgrad_inplace.download(), bgot, "softmax_rows_backward in place") == 0);
  }
}
