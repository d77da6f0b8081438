// CUDA gelu forward/backward against the CPU oracle. The expressions are the
// same operation for operation; only expf may differ by a couple of ulp.
#include "kernels/activation.hpp"
#include "kernels/cuda/ops.hpp"
#include "kernels/cuda/test_support.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <iterator>
#include <vector>

namespace {

namespace cpu = cmesh::kernels::cpu;
namespace gpu = cmesh::kernels::cuda;
using namespace cmesh::kernels::cuda_test;

constexpr std::size_t sizes[] = {1, 2, 3, 7, 31, 255, 256, 257, 1000, 4097, (1u << 18) + 5};

// Inputs over the interesting range, with the edges mixed in.
std::vector<float> inputs(std::size_t n, std::mt19937& rng) {
  auto x = uniform(n, rng, -8.0f, 8.0f);
  const float edges[] = {0.0f, -0.0f, 1e-20f, -1e-20f, 0.75f, -0.75f, 20.0f, -20.0f, 60.0f, -60.0f};
  for (std::size_t i = 0; i < n && i < std::size(edges); ++i)
    x[(i * 7919) % n] = edges[i];
  return x;
}

} // namespace

TEST_CASE("cuda gelu_forward and gelu_backward match the cpu oracle") {
  CMESH_CUDA_TEST_REQUIRE_DEVICE();
  stream s;
  auto rng = rng_for(1);
  for (const std::size_t n : sizes) {
    CAPTURE(n);
    const auto x = inputs(n, rng);
    const auto dy = uniform(n, rng, -2.0f, 2.0f);

    device_vector<float> dx_in(x), dy_out(n), ddy(dy), ddx(n), dinplace(x);
    gpu::gelu_forward(dx_in.get(), dy_out.get(), n, s);
    gpu::gelu_forward(dinplace.get(), dinplace.get(), n, s); // y may alias x
    gpu::gelu_backward(dx_in.get(), ddy.get(), ddx.get(), n, s);
    gpu::gelu_backward(dx_in.get(), ddy.get(), ddy.get(), n, s); // dx may alias dy
    s.sync();

    std::vector<float> y(n), dx(n);
    cpu::gelu_forward(x.data(), y.data(), n);
    cpu::gelu_backward(x.data(), dy.data(), dx.data(), n);

    // Forward: y = x * s(x), s relative error a few ulp.
    CHECK(count_outside(dy_out.download(), y, 2e-6, 1e-30, "gelu_forward") == 0);
    CHECK(count_different(dinplace.download(), dy_out.download(), "gelu_forward in place") == 0);
    // Backward: s + 2 x s (1 - s) u' can cancel; bound by the terms' size.
    std::vector<double> tol(n);
    for (std::size_t i = 0; i < n; ++i)
      tol[i] = 4e-6 * std::fabs(static_cast<double>(dy[i])) * (1.0 + std::fabs(x[i])) + 1e-37;
    CHECK(count_outside(ddx.download(), dx, tol, "gelu_backward") == 0);
    CHECK(count_different(ddy.download(), ddx.download(), "gelu_backward in place") == 0);
  }
}

TEST_CASE("cuda gelu: n == 0 touches nothing") {
  CMESH_CUDA_TEST_REQUIRE_DEVICE();
  stream s;
  gpu::gelu_forward(nullptr, nullptr, 0, s);
  gpu::gelu_backward(nullptr, nullptr, nullptr, 0, s);
  s.sync();
}
