// CUDA bf16 casts and the finite check against the CPU oracle (all exact).
#include "kernels/cuda/ops.hpp"
#include "kernels/cuda/test_support.hpp"
#include "kernels/precision.hpp"

#include <doctest/doctest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <limits>
#include <vector>

namespace {

namespace cpu = cmesh::kernels::cpu;
namespace gpu = cmesh::kernels::cuda;
using namespace cmesh::kernels::cuda_test;
using u16vec = std::vector<std::uint16_t>;

float from_bits(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Random bit patterns (every class: NaNs with any payload, infinities,
// subnormals, ties), plus the edges by hand.
std::vector<float> make_floats(std::size_t n, std::mt19937& rng) {
  std::vector<float> x(n);
  for (auto& v : x)
    v = from_bits(static_cast<std::uint32_t>(rng()));
  const std::uint32_t edges[] = {
    0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, // zeros, infinities
    0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, // quiet and signalling NaNs
    0x7f7fffffu, 0xff7fffffu,                           // largest: rounds to inf
    0x3f808000u, 0x3f818000u,                           // ties: to even (down, up)
    0x3f808001u, 0x3f807fffu,                           // just above and below a tie
    0x00000001u, 0x807fffffu, 0x00008000u, 0x00018000u, // subnormals and their ties
  };
  for (std::size_t i = 0; i < n && i < std::size(edges); ++i)
    x[i] = from_bits(edges[i]);
  return x;
}

constexpr std::size_t sizes[] = {1, 3, 17, 256, 257, 4099, (1u << 20) + 1};

} // namespace

TEST_CASE("cuda float_to_bf16 and round_to_bf16 are bit-identical to the cpu oracle") {
  CMESH_CUDA_TEST_REQUIRE_DEVICE();
  stream s;
  auto rng = rng_for(1);
  for (const std::size_t n : sizes) {
    CAPTURE(n);
    const auto x = make_floats(n, rng);
    device_vector<float> dx(x), dround(x);
    device_vector<std::uint16_t> dy(n);
    gpu::float_to_bf16(dx.get(), dy.get(), n, s);
    gpu::round_to_bf16(dround.get(), n, s);
    s.sync();
    u16vec y(n);
    cpu::float_to_bf16(x.data(), y.data(), n);
    auto rounded = x;
    cpu::round_to_bf16(rounded.data(), n);
    CHECK(count_different(dy.download(), y, "float_to_bf16") == 0);
    CHECK(count_different(dround.download(), rounded, "round_to_bf16") == 0);
  }
}

TEST_CASE("cuda bf16_to_float widens every bf16 pattern exactly") {
  CMESH_CUDA_TEST_REQUIRE_DEVICE();
  stream s;
  u16vec all(1u << 16);
  for (std::size_t i = 0; i < all.size(); ++i)
    all[i] = static_cast<std::uint16_t>(i);
  device_vector<std::uint16_t> dx(all);
  device_vector<float> dy(all.size());
  gpu::bf16_to_float(dx.get(), dy.get(), all.size(), s);
  s.sync();
  std::vector<float> want(all.size());
  cpu::bf16_to_float(all.data(), want.data(), all.size());
  CHECK(count_different(dy.download(), want, "bf16_to_float") == 0);
}

TEST_CASE("cuda all_finite and mark_nonfinite agree with the cpu oracle") {
  CMESH_CUDA_TEST_REQUIRE_DEVICE();
  stream s;
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float max = std::numeric_limits<float>::max();
  for (const std::size_t n : sizes) {
    for (const float bad : {inf, -inf, nan, -nan}) {
      for (const std::size_t at : {std::size_t{0}, n / 2, n - 1, n /* none */}) {
        CAPTURE(n);
        CAPTURE(bad);
        CAPTURE(at);
        std::vector<float> x(n, max); // the largest finite is finite
        if (at < n)
          x[at] = bad;
        device_vector<float> dx(x);
        device_vector<int> finite(std::vector<int>{-1}), found(std::vector<int>{0});
        gpu::all_finite(dx.get(), n, finite.get(), s);
        gpu::mark_nonfinite(dx.get(), n, found.get(), s);
        s.sync();
        const bool want = cpu::all_finite(x.data(), n);
        CHECK(finite.download()[0] == (want ? 1 : 0));
        CHECK(found.download()[0] == (want ? 0 : 1));
      }
    }
  }
  // n == 0 is finite; mark_nonfinite leaves a set flag alone.
  device_vector<int> finite(std::vector<int>{0}), found(std::vector<int>{1});
  device_vector<float> ok(std::vector<float>{1.0f, 2.0f});
  gpu::all_finite(nullptr, 0, finite.get(), s);
  gpu::mark_nonfinite(ok.get(), 2, found.get(), s);
  s.sync();
  CHECK(finite.download()[0] == 1);
  CHECK(found.download()[0] == 1);
}

TEST_CASE("cuda check_gradients and update_loss_scale drive the host scaler like the cpu") {
  CMESH_CUDA_TEST_REQUIRE_DEVICE();
  stream s;
  cpu::loss_scaler gpu_scaler, cpu_scaler;
  gpu_scaler.growth_interval = cpu_scaler.growth_interval = 3;
  const float inf = std::numeric_limits<float>::infinity();
  // good, good, good (grows), bad (backs off), good, bad, good x3 (grows)
  const bool overflow[] = {false, false, false, true, false, true, false, false, false};
  for (const bool o : overflow) {
    CAPTURE(o);
    std::vector<float> g(1001, 0.5f);
    if (o)
      g[777] = inf;
    device_vector<float> dg(g);
    const bool skip_gpu = gpu::check_gradients(gpu_scaler, dg.get(), g.size(), s);
    const bool skip_cpu = cpu::check_gradients(cpu_scaler, g.data(), g.size());
    CHECK(skip_gpu == skip_cpu);
    CHECK(gpu_scaler.scale == cpu_scaler.scale);
    CHECK(gpu_scaler.good_steps == cpu_scaler.good_steps);
  }
  // From a flag set across several buffers.
  device_vector<int> found(std::vector<int>{0});
  device_vector<float> a(std::vector<float>{1.0f}), b(std::vector<float>{inf});
  gpu::mark_nonfinite(a.get(), 1, found.get(), s);
  CHECK_FALSE(gpu::update_loss_scale(gpu_scaler, found.get(), s));
  gpu::mark_nonfinite(b.get(), 1, found.get(), s);
  CHECK(gpu::update_loss_scale(gpu_scaler, found.get(), s));
  CHECK(cpu::update_loss_scale(cpu_scaler, false) == false);
  CHECK(cpu::update_loss_scale(cpu_scaler, true) == true);
  CHECK(gpu_scaler.scale == cpu_scaler.scale);
}
