#include "kernels/activation.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <vector>

namespace {
namespace k = cmesh::kernels::cpu;
}

TEST_CASE("gelu: known values") {
  const std::vector<double> x{0.0, 1.0, -1.0, 2.0, 10.0, -10.0};
  std::vector<double> y(x.size());
  k::gelu_forward(x.data(), y.data(), x.size());
  CHECK(y[0] == 0.0);
  // 0.5 x (1 + tanh(sqrt(2/pi)(x + 0.044715 x^3))), evaluated independently.
  CHECK(y[1] == doctest::Approx(0.8411919906082768).epsilon(1e-12));
  CHECK(y[2] == doctest::Approx(-0.15880800939172324).epsilon(1e-12));
  CHECK(y[3] == doctest::Approx(1.954597694087775).epsilon(1e-12));
  CHECK(y[4] == doctest::Approx(10.0).epsilon(1e-12)); // identity far right
  CHECK(std::fabs(y[5]) < 1e-12);                      // zero far left
}

TEST_CASE("gelu: float agrees with double; the output may alias the input") {
  std::vector<float> xf;
  std::vector<double> xd;
  for (int i = -60; i <= 60; ++i) {
    xf.push_back(0.1f * static_cast<float>(i));
    xd.push_back(static_cast<double>(xf.back()));
  }
  std::vector<double> yd(xd.size());
  k::gelu_forward(xd.data(), yd.data(), xd.size());
  k::gelu_forward(xf.data(), xf.data(), xf.size());
  for (std::size_t i = 0; i < xf.size(); ++i)
    CHECK(std::fabs(xf[i] - yd[i]) < 1e-6);
}

TEST_CASE("gelu backward: matches central differences (double)") {
  std::vector<double> x, dy;
  for (int i = -40; i <= 40; ++i) {
    x.push_back(0.137 * i);
    dy.push_back(1.0 + 0.01 * i);
  }
  std::vector<double> dx(x.size());
  k::gelu_backward(x.data(), dy.data(), dx.data(), x.size());
  const double h = 1e-6;
  double worst = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    double p[2] = {x[i] + h, x[i] - h}, y[2];
    k::gelu_forward(p, y, 2);
    const double fd = dy[i] * (y[0] - y[1]) / (2 * h);
    worst = std::fmax(worst, std::fabs(fd - dx[i]));
  }
  CHECK(worst < 1e-8);
  // And in float, against the double derivative.
  std::vector<float> xf(x.begin(), x.end()), dyf(dy.begin(), dy.end()), dxf(x.size());
  k::gelu_backward(xf.data(), dyf.data(), dxf.data(), xf.size());
  for (std::size_t i = 0; i < x.size(); ++i)
    CHECK(std::fabs(dxf[i] - dx[i]) < 1e-5);
}
