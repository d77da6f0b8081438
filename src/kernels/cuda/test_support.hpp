// Helpers for the kernels/*_cuda.test.cpp tests (host code, compiled by the
// C++ compiler; needs doctest and CMESH_HAVE_CUDA): device buffers, a
// stream, the skip when no device is visible, seeded inputs and comparisons
// that report the first mismatch.
#pragma once

#include "kernels/cuda_check.hpp"
#include "kernels/device.hpp"

#include <doctest/doctest.h>

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

/// Skips the rest of the test case (with a message saying why) when no CUDA
/// device is visible; on a machine with one, prints the seed the test uses.
#define CMESH_CUDA_TEST_REQUIRE_DEVICE()                                               \
  do {                                                                                 \
    const auto cmesh_report_ = ::cmesh::kernels::query_accelerators();                 \
    if (cmesh_report_.devices.empty()) {                                               \
      MESSAGE("skipped: no CUDA device: " << cmesh_report_.note);                      \
      return;                                                                          \
    }                                                                                  \
    MESSAGE("seed " << ::cmesh::kernels::cuda_test::seed()                             \
                    << " (set CMESH_TEST_SEED to change it)");                         \
  } while (false)

namespace cmesh::kernels::cuda_test {

/// The seed of the random inputs: CMESH_TEST_SEED when set, else a fixed one.
inline unsigned seed() {
  if (const char* s = std::getenv("CMESH_TEST_SEED"); s && *s)
    return static_cast<unsigned>(std::strtoul(s, nullptr, 10));
  return 20240917u;
}

/// A generator for one part of a test: the seed mixed with a per-part salt,
/// so that adding a case does not change the inputs of the others.
inline std::mt19937 rng_for(unsigned salt) {
  std::seed_seq seq{seed(), salt};
  return std::mt19937(seq);
}

inline std::vector<float> uniform(std::size_t n, std::mt19937& rng, float lo, float hi) {
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v)
    x = u(rng);
  return v;
}

inline std::vector<std::int32_t> uniform_int(std::size_t n, std::mt19937& rng, std::int32_t lo,
                                             std::int32_t hi) {
  std::uniform_int_distribution<std::int32_t> u(lo, hi);
  std::vector<std::int32_t> v(n);
  for (auto& x : v)
    x = u(rng);
  return v;
}

/// A device buffer of n T that frees itself.
template <class T>
class device_vector {
public:
  explicit device_vector(std::size_t n) : n_(n) {
    if (n == 0)
      return;
    void* p = nullptr;
    CMESH_CUDA_CHECK(cudaMalloc(&p, n * sizeof(T)));
    ptr_ = static_cast<T*>(p);
  }
  explicit device_vector(const std::vector<T>& host) : device_vector(host.size()) {
    upload(host);
  }
  ~device_vector() {
    if (ptr_)
      (void)cudaFree(ptr_);
  }
  device_vector(const device_vector&) = delete;
  device_vector& operator=(const device_vector&) = delete;

  T* get() const { return ptr_; }
  std::size_t size() const { return n_; }

  void upload(const std::vector<T>& host) {
    REQUIRE(host.size() == n_);
    if (n_ > 0)
      CMESH_CUDA_CHECK(cudaMemcpy(ptr_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
  }
  /// Call after synchronizing the stream that wrote it.
  std::vector<T> download() const {
    std::vector<T> host(n_);
    if (n_ > 0)
      CMESH_CUDA_CHECK(cudaMemcpy(host.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }

private:
  T* ptr_ = nullptr;
  std::size_t n_ = 0;
};

/// A created stream, destroyed at scope exit; sync() waits for its work.
struct stream {
  cudaStream_t s = nullptr;
  stream() { CMESH_CUDA_CHECK(cudaStreamCreate(&s)); }
  ~stream() { (void)cudaStreamDestroy(s); }
  stream(const stream&) = delete;
  stream& operator=(const stream&) = delete;
  operator cudaStream_t() const { return s; }
  void sync() const { CMESH_CUDA_CHECK(cudaStreamSynchronize(s)); }
};

inline std::uint32_t bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

/// How count_different compares NaNs: `exact` when the kernel only moves
/// bits (a NaN keeps its payload and sign), `any` after arithmetic, where the
/// GPU returns its canonical NaN and the CPU propagates the operand's.
enum class nan_bits { exact, any };

/// Elements that differ (bit for bit for floats; NaNs as `nans` says);
/// MESSAGEs the first one. Use inside CHECK(... == 0).
template <class T>
std::size_t count_different(const std::vector<T>& got, const std::vector<T>& want,
                            const char* what, nan_bits nans = nan_bits::exact) {
  REQUIRE(got.size() == want.size());
  std::size_t bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    bool same;
    if constexpr (std::is_same_v<T, float>)
      same = bits(got[i]) == bits(want[i])
          || (nans == nan_bits::any && std::isnan(got[i]) && std::isnan(want[i]));
    else
      same = got[i] == want[i];
    if (!same) {
      if (bad == 0)
        MESSAGE(std::string(what) << ": first difference at " << i << ": gpu " << +got[i] << " cpu "
                     << +want[i]);
      ++bad;
    }
  }
  return bad;
}

/// Elements with |got - want| > tol[i] (NaN matches NaN); MESSAGEs the first.
template <class T, class U>
std::size_t count_outside(const std::vector<T>& got, const std::vector<U>& want,
                          const std::vector<double>& tol, const char* what) {
  REQUIRE(got.size() == want.size());
  REQUIRE(tol.size() == want.size());
  std::size_t bad = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double g = static_cast<double>(got[i]), w = static_cast<double>(want[i]);
    const bool ok = (std::isnan(g) && std::isnan(w)) || std::fabs(g - w) <= tol[i];
    if (!ok) {
      if (bad == 0)
        MESSAGE(std::string(what) << ": first mismatch at " << i << ": gpu " << g << " cpu " << w
                     << " (tolerance " << tol[i] << ")");
      ++bad;
    }
  }
  return bad;
}

/// The same with tol[i] = rtol * |want[i]| + atol.
template <class T, class U>
std::size_t count_outside(const std::vector<T>& got, const std::vector<U>& want, double rtol,
                          double atol, const char* what) {
  std::vector<double> tol(want.size());
  for (std::size_t i = 0; i < want.size(); ++i)
    tol[i] = rtol * std::fabs(static_cast<double>(want[i])) + atol;
  return count_outside(got, want, tol, what);
}

} // namespace cmesh::kernels::cuda_test
