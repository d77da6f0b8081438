#include "kernels/optim.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <vector>

namespace {
namespace k = cmesh::kernels::cpu;
}

TEST_CASE("adamw: the first step moves each weight by about lr against its gradient") {
  std::vector<float> p{1.0f, -2.0f, 0.5f}, g{0.3f, -4.0f, 0.0f}, m(3), v(3);
  k::adamw_params hp;
  hp.lr = 0.1f;
  k::adamw_step(p.data(), g.data(), m.data(), v.data(), 3, hp, 1);
  // Bias correction makes m_hat = g and v_hat = g^2: the update is sign(g).
  CHECK(p[0] == doctest::Approx(0.9).epsilon(1e-6));
  CHECK(p[1] == doctest::Approx(-1.9).epsilon(1e-6));
  CHECK(p[2] == 0.5f); // zero gradient, no decay: unchanged
}

TEST_CASE("adamw: several steps match a double-precision reference, decay included") {
  const std::size_t n = 4;
  k::adamw_params hp;
  hp.lr = 0.01f;
  hp.beta1 = 0.9f;
  hp.beta2 = 0.95f;
  hp.eps = 1e-8f;
  hp.weight_decay = 0.1f;
  std::vector<float> p{1.0f, -1.0f, 0.25f, 3.0f}, m(n), v(n);
  std::vector<double> rp(p.begin(), p.end()), rm(n), rv(n);
  for (std::uint64_t step = 1; step <= 20; ++step) {
    std::vector<float> g(n);
    for (std::size_t i = 0; i < n; ++i)
      g[i] = std::sin(0.7f * static_cast<float>(step) + static_cast<float>(i));
    k::adamw_step(p.data(), g.data(), m.data(), v.data(), n, hp, step);
    for (std::size_t i = 0; i < n; ++i) {
      const double gi = g[i];
      rm[i] = 0.9 * rm[i] + 0.1 * gi;
      rv[i] = 0.95 * rv[i] + 0.05 * gi * gi;
      const double mh = rm[i] / (1 - std::pow(0.9, static_cast<double>(step)));
      const double vh = rv[i] / (1 - std::pow(0.95, static_cast<double>(step)));
      rp[i] = rp[i] * (1 - 0.01 * 0.1) - 0.01 * mh / (std::sqrt(vh) + 1e-8);
    }
  }
  for (std::size_t i = 0; i < n; ++i)
    CHECK(p[i] == doctest::Approx(rp[i]).epsilon(1e-5));
}

TEST_CASE("scale, norm and clipping") {
  std::vector<float> x{3.0f, 4.0f};
  CHECK(k::sum_of_squares(x.data(), 2) == 25.0);
  CHECK(k::l2_norm(x.data(), 2) == 5.0);
  k::scale_in_place(x.data(), 0.5f, 2);
  CHECK(x == std::vector<float>{1.5f, 2.0f});

  std::vector<float> y{3.0f, 4.0f};
  CHECK(k::clip_to_norm(y.data(), 2, 5.0, 10.0) == 1.0f); // within bounds
  CHECK(k::clip_to_norm(y.data(), 2, 5.0, 0.0) == 1.0f);  // clipping off
  CHECK(y == std::vector<float>{3.0f, 4.0f});
  const float f = k::clip_to_norm(y.data(), 2, 5.0, 1.0);
  CHECK(f == doctest::Approx(0.2));
  CHECK(k::l2_norm(y.data(), 2) <= 1.0);
  CHECK(k::l2_norm(y.data(), 2) == doctest::Approx(1.0));
  // A global norm from two buffers: each clipped by the same factor.
  std::vector<float> a{3.0f}, b{4.0f};
  const double global = std::sqrt(k::sum_of_squares(a.data(), 1) + k::sum_of_squares(b.data(), 1));
  k::clip_to_norm(a.data(), 1, global, 2.5);
  k::clip_to_norm(b.data(), 1, global, 2.5);
  CHECK(a[0] == doctest::Approx(1.5));
  CHECK(b[0] == doctest::Approx(2.0));
}

TEST_CASE("pack_ranges and unpack_ranges round-trip a tensor list") {
  std::vector<float> flat(10);
  for (std::size_t i = 0; i < flat.size(); ++i)
    flat[i] = static_cast<float>(i);
  const std::size_t offsets[] = {7, 0, 4, 9};
  const std::size_t sizes[] = {2, 3, 0, 1};
  std::vector<float> packed(6, -1.0f);
  CHECK(k::pack_ranges(flat.data(), offsets, sizes, 4, packed.data()) == 6);
  CHECK(packed == std::vector<float>{7, 8, 0, 1, 2, 9});
  std::vector<float> back(10, -1.0f);
  CHECK(k::unpack_ranges(packed.data(), offsets, sizes, 4, back.data()) == 6);
  CHECK(back == std::vector<float>{0, 1, 2, -1, -1, -1, -1, 7, 8, 9});
}
