// CUDA optimizer kernels against the CPU oracle.
#include "kernels/cuda/ops.hpp"
#include "kernels/cuda/test_support.hpp"
#include "kernels/optim.hpp"

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

// Around the block size and the partial-sum sizes (256 threads x 8 items),
// and one that needs many partial blocks.
constexpr std::size_t sizes[] = {1, 2, 3, 7, 255, 256, 257, 2047, 2048, 2049, 100003,
                                 (1u << 21) + 7};

} // namespace

TEST_CASE("cuda adamw_step matches the cpu oracle over several steps") {
  CMESH_CUDA_TEST_REQUIRE_DEVICE();
  stream s;
  auto rng = rng_for(1);
  cpu::adamw_params hp;
  hp.lr = 0.01f;
  hp.beta1 = 0.9f;
  hp.beta2 = 0.95f;
  hp.eps = 1e-8f;
  hp.weight_decay = 0.1f;
  for (const std::size_t n : sizes) {
    CAPTURE(n);
    auto p = uniform(n, rng, -1.0f, 1.0f);
    std::vector<float> m(n, 0.0f), v(n, 0.0f);
    device_vector<float> dp(p), dm(m), dv(v), dg(n);
    for (std::uint64_t step = 1; step <= 4; ++step) {
      CAPTURE(step);
      auto g = uniform(n, rng, -2.0f, 2.0f);
      g[0] = 0.0f; // a zero gradient: only the decay moves the weight
      dg.upload(g);
      gpu::adamw_step(dp.get(), dg.get(), dm.get(), dv.get(), n, hp, step, s);
      s.sync();
      cpu::adamw_step(p.data(), g.data(), m.data(), v.data(), n, hp, step);
      // The same float operations in the same order, sqrt and division
      // correctly rounded on both: bit-identical unless the CPU build
      // contracts to FMA, so a tolerance of a few ulp.
      CHECK(count_outside(dm.download(), m, 1e-6, 1e-30, "m") == 0);
      CHECK(count_outside(dv.download(), v, 1e-6, 1e-30, "v") == 0);
      CHECK(count_outside(dp.download(), p, 1e-6, 1e-9, "params") == 0);
    }
  }
}

TEST_CASE("cuda scale_in_place, sum_of_squares and l2_norm match the cpu oracle") {
  CMESH_CUDA_TEST_REQUIRE_DEVICE();
  stream s;
  auto rng = rng_for(2);
  for (const std::size_t n : sizes) {
    CAPTURE(n);
    const auto x = uniform(n, rng, -3.0f, 3.0f);
    device_vector<float> dx(x);
    device_vector<double> dsum(1), dnorm(1), dacc(std::vector<double>{0.5});
    gpu::sum_of_squares(dx.get(), n, dsum.get(), s);
    gpu::l2_norm(dx.get(), n, dnorm.get(), s);
    gpu::sum_of_squares(dx.get(), n, dacc.get(), s, /*accumulate=*/true);
    gpu::sum_of_squares(dx.get(), n, dacc.get(), s, /*accumulate=*/true);
    const double again = [&] {
      device_vector<double> d(1);
      gpu::sum_of_squares(dx.get(), n, d.get(), s);
      s.sync();
      return d.download()[0];
    }();
    s.sync();
    const double want = cpu::sum_of_squares(x.data(), n);
    const double got = dsum.download()[0];
    // Exact squares summed in double in another order; the CPU's in-order
    // sum of n positive terms is itself off by up to about n ulp.
    const double rel = 1e-16 * static_cast<double>(n) + 1e-14;
    CHECK(got == doctest::Approx(want).epsilon(rel));
    CHECK(got == again); // deterministic: the same bits every time
    CHECK(dnorm.download()[0] == doctest::Approx(cpu::l2_norm(x.data(), n)).epsilon(rel));
    CHECK(dacc.download()[0] == doctest::Approx(0.5 + 2 * want).epsilon(rel));

    for (const float alpha : {0.0f, -1.0f, 0.37f, 1.0f / 65536.0f}) {
      CAPTURE(alpha);
      dx.upload(x);
      gpu::scale_in_place(dx.get(), alpha, n, s);
      s.sync();
      auto y = x;
      cpu::scale_in_place(y.data(), alpha, n);
      CHECK(count_different(dx.download(), y, "scale_in_place") == 0);
    }
  }
  // n == 0: the sum is 0.
  device_vector<double> dsum(std::vector<double>{7.0});
  gpu::sum_of_squares(nullptr, 0, dsum.get(), s);
  s.sync();
  CHECK(dsum.download()[0] == 0.0);
}

TEST_CASE("cuda clip_to_norm (host and device norm) matches the cpu oracle") {
  CMESH_CUDA_TEST_REQUIRE_DEVICE();
  stream s;
  auto rng = rng_for(3);
  for (const std::size_t n : {std::size_t{1}, std::size_t{257}, std::size_t{100003}}) {
    CAPTURE(n);
    const auto x = uniform(n, rng, -1.0f, 1.0f);
    const double norm = cpu::l2_norm(x.data(), n);
    for (const double max_norm : {0.0, -1.0, norm * 2, norm, norm * 0.5, 1e-3}) {
      CAPTURE(max_norm);
      auto want = x;
      const float want_factor = cpu::clip_to_norm(want.data(), n, norm, max_norm);

      device_vector<float> dx(x), dx2(x);
      const float factor = gpu::clip_to_norm(dx.get(), n, norm, max_norm, s);
      device_vector<double> dnorm(std::vector<double>{norm});
      device_vector<float> dfactor(std::vector<float>{-3.0f});
      gpu::clip_to_norm(dx2.get(), n, dnorm.get(), max_norm, dfactor.get(), s);
      s.sync();
      CHECK(factor == want_factor);
      CHECK(dfactor.download()[0] == want_factor);
      CHECK(count_different(dx.download(), want, "clip (host norm)") == 0);
      CHECK(count_different(dx2.download(), want, "clip (device norm)") == 0);
    }
  }
  // The device variant writes the factor even for n == 0, and a null factor is fine.
  device_vector<double> dnorm(std::vector<double>{10.0});
  device_vector<float> dfactor(1);
  gpu::clip_to_norm(nullptr, 0, dnorm.get(), 5.0, dfactor.get(), s);
  s.sync();
  CHECK(dfactor.download()[0] == static_cast<float>(5.0 / (10.0 + 1e-6)));
  device_vector<float> one(std::vector<float>{2.0f});
  gpu::clip_to_norm(one.get(), 1, dnorm.get(), 5.0, nullptr, s);
  s.sync();
  CHECK(one.download()[0] == 2.0f * static_cast<float>(5.0 / (10.0 + 1e-6)));
  // A global norm over two buffers: accumulate, take the root, clip both.
  const std::vector<float> a{3.0f}, b{4.0f};
  device_vector<float> da(a), db(b);
  device_vector<double> dglobal(1);
  gpu::sum_of_squares(da.get(), 1, dglobal.get(), s);
  gpu::sum_of_squares(db.get(), 1, dglobal.get(), s, /*accumulate=*/true);
  gpu::sqrt_in_place(dglobal.get(), s);
  gpu::clip_to_norm(da.get(), 1, dglobal.get(), 2.5, nullptr, s);
  gpu::clip_to_norm(db.get(), 1, dglobal.get(), 2.5, nullptr, s);
  s.sync();
  CHECK(dglobal.download()[0] == 5.0);
  CHECK(da.download()[0] == doctest::Approx(1.5));
  CHECK(db.download()[0] == doctest::Approx(2.0));
}

TEST_CASE("cuda pack_ranges and unpack_ranges match the cpu oracle") {
  CMESH_CUDA_TEST_REQUIRE_DEVICE();
  stream s;
  auto rng = rng_for(4);
  const auto flat = uniform(1000, rng, -1.0f, 1.0f);
  const std::size_t offsets[] = {700, 0, 400, 999, 3};
  const std::size_t sizes_[] = {299, 3, 0, 1, 397};
  device_vector<float> dflat(flat), dpacked(700), dback(std::vector<float>(1000, 9.0f));
  const std::size_t packed_n =
    gpu::pack_ranges(dflat.get(), offsets, sizes_, 5, dpacked.get(), s);
  const std::size_t read_n =
    gpu::unpack_ranges(dpacked.get(), offsets, sizes_, 5, dback.get(), s);
  s.sync();
  std::vector<float> packed(700), back(1000, 9.0f);
  CHECK(packed_n == cpu::pack_ranges(flat.data(), offsets, sizes_, 5, packed.data()));
  CHECK(read_n == cpu::unpack_ranges(packed.data(), offsets, sizes_, 5, back.data()));
  CHECK(count_different(dpacked.download(), packed, "pack_ranges") == 0);
  CHECK(count_different(dback.download(), back, "unpack_ranges") == 0);
}
