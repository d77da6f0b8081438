#include "kernels/device.hpp"
#include "kernels/scale.hpp"
#ifdef CMESH_HAVE_CUDA
#include "kernels/cuda_check.hpp"
#endif

#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <vector>

namespace {

namespace k = cmesh::kernels;

// Sizes around the CUDA block size (256) and odd ones; 0 must be a no-op.
constexpr std::size_t sizes[] = {0, 1, 2, 3, 7, 31, 255, 256, 257, 1000, 4097, (1u << 20) + 3};

// Small integers and halves: every value below is exact in float, so the
// hand-computed reference needs no tolerance.
std::vector<float> make_x(std::size_t n) {
  std::vector<float> x(n);
  for (std::size_t i = 0; i < n; ++i)
    x[i] = static_cast<float>(static_cast<int>(i % 97) - 48); // -48 .. 48
  return x;
}

std::vector<float> make_y(std::size_t n) {
  std::vector<float> y(n);
  for (std::size_t i = 0; i < n; ++i)
    y[i] = static_cast<float>(i % 13) + 0.5f;
  return y;
}

} // namespace

TEST_CASE("cpu scale_add: small case by hand") {
  std::vector<float> y{1.0f, 2.0f, 3.0f};
  const std::vector<float> x{10.0f, -4.0f, 0.5f};
  k::cpu::scale_add(y.data(), x.data(), 2.0f, y.size());
  CHECK(y[0] == 21.0f); // 1 + 2*10
  CHECK(y[1] == -6.0f); // 2 + 2*-4
  CHECK(y[2] == 4.0f);  // 3 + 2*0.5
}

TEST_CASE("cpu scale_add: n == 0 touches nothing") {
  k::cpu::scale_add(nullptr, nullptr, 3.0f, 0);
  float y = 7.0f;
  const float x = 1.0f;
  k::cpu::scale_add(&y, &x, 3.0f, 0);
  CHECK(y == 7.0f);
}

TEST_CASE("cpu scale_add: matches the reference for many sizes and alphas") {
  for (const float alpha : {0.0f, 1.0f, -1.0f, 0.5f, -2.5f}) {
    for (const std::size_t n : sizes) {
      CAPTURE(n);
      CAPTURE(alpha);
      const auto x = make_x(n);
      auto y = make_y(n);
      k::cpu::scale_add(y.data(), x.data(), alpha, n);
      std::size_t bad = 0;
      for (std::size_t i = 0; i < n; ++i) {
        const double want =
          static_cast<double>(i % 13) + 0.5 + alpha * (static_cast<double>(i % 97) - 48.0);
        if (static_cast<double>(y[i]) != want)
          ++bad;
      }
      CHECK(bad == 0);
    }
  }
}

TEST_CASE("cpu scale_add: only the first n elements change") {
  std::vector<float> y(9, 1.0f);
  const std::vector<float> x(9, 1.0f);
  k::cpu::scale_add(y.data(), x.data(), 1.0f, 5);
  for (std::size_t i = 0; i < y.size(); ++i) {
    CAPTURE(i);
    CHECK(y[i] == (i < 5 ? 2.0f : 1.0f));
  }
}

#ifdef CMESH_HAVE_CUDA

namespace {

// Device buffer that frees itself; the test throws through CMESH_CUDA_CHECK.
struct device_buffer {
  float* ptr = nullptr;
  explicit device_buffer(std::size_t n) {
    if (n == 0)
      return;
    void* p = nullptr;
    CMESH_CUDA_CHECK(cudaMalloc(&p, n * sizeof(float)));
    ptr = static_cast<float*>(p);
  }
  ~device_buffer() {
    if (ptr)
      (void)cudaFree(ptr);
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
};

} // namespace

TEST_CASE("cuda scale_add: matches the cpu oracle") {
  const auto report = k::query_accelerators();
  if (report.devices.empty()) {
    MESSAGE("skipped: no CUDA device: " << report.note);
    return;
  }
  cudaStream_t stream = nullptr;
  CMESH_CUDA_CHECK(cudaStreamCreate(&stream));
  // Non-integer values so that the comparison exercises real rounding.
  for (const float alpha : {0.0f, 1.0f, -0.37f, 3.25f}) {
    for (const std::size_t n : sizes) {
      CAPTURE(n);
      CAPTURE(alpha);
      std::vector<float> x(n), y(n);
      for (std::size_t i = 0; i < n; ++i) {
        x[i] = std::sin(0.001f * static_cast<float>(i)) * 3.0f;
        y[i] = std::cos(0.002f * static_cast<float>(i)) - 0.25f;
      }
      device_buffer dx(n), dy(n);
      if (n > 0) {
        CMESH_CUDA_CHECK(cudaMemcpy(dx.ptr, x.data(), n * sizeof(float), cudaMemcpyHostToDevice));
        CMESH_CUDA_CHECK(cudaMemcpy(dy.ptr, y.data(), n * sizeof(float), cudaMemcpyHostToDevice));
      }
      k::cuda::scale_add(dy.ptr, dx.ptr, alpha, n, stream);
      CMESH_CUDA_CHECK(cudaStreamSynchronize(stream));
      std::vector<float> got(n);
      if (n > 0)
        CMESH_CUDA_CHECK(cudaMemcpy(got.data(), dy.ptr, n * sizeof(float), cudaMemcpyDeviceToHost));

      k::cpu::scale_add(y.data(), x.data(), alpha, n);
      // The GPU may fuse the multiply-add (one rounding instead of two).
      std::size_t bad = 0;
      for (std::size_t i = 0; i < n; ++i) {
        const float tol = 1e-6f * (std::fabs(y[i]) + std::fabs(alpha * x[i])) + 1e-7f;
        if (!(std::fabs(got[i] - y[i]) <= tol)) {
          if (bad == 0)
            MESSAGE("first mismatch at " << i << ": gpu " << got[i] << " cpu " << y[i]);
          ++bad;
        }
      }
      CHECK(bad == 0);
    }
  }
  CMESH_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST_CASE("CMESH_CUDA_CHECK throws with file, line and the CUDA error text") {
  // Needs no device: the macro only looks at the error code.
  try {
    CMESH_CUDA_CHECK(cudaErrorInvalidValue);
    FAIL("no exception");
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    CHECK(what.find("scale.test.cpp:") != std::string::npos);
    CHECK(what.find(cudaGetErrorString(cudaErrorInvalidValue)) != std::string::npos);
  }
}

#else

TEST_CASE("cuda scale_add: matches the cpu oracle") {
  MESSAGE("skipped: no CUDA device: built without CUDA");
}

#endif
