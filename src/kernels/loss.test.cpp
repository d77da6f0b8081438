#include "kernels/loss.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace {

namespace k = cmesh::kernels::cpu;

std::vector<double> random_values(std::size_t n, unsigned seed, double scale) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u(-scale, scale);
  std::vector<double> v(n);
  for (auto& x : v)
    x = u(rng);
  return v;
}

} // namespace

TEST_CASE("softmax cross-entropy: uniform logits give log(vocab)") {
  const std::size_t rows = 3, vocab = 256;
  std::vector<float> logits(rows * vocab, 0.25f);
  const std::vector<std::int32_t> targets{0, 17, 255};
  CHECK(k::softmax_cross_entropy_forward(logits.data(), targets.data(), rows, vocab) ==
        doctest::Approx(std::log(256.0)).epsilon(1e-12));
  CHECK(k::softmax_cross_entropy_forward(logits.data(), targets.data(), 0, vocab) == 0.0);
}

TEST_CASE("softmax cross-entropy: a small case by hand, and huge logits stay finite") {
  const std::vector<double> logits{1.0, 2.0, 3.0};
  const std::int32_t target = 1;
  const double want = -std::log(std::exp(2.0) / (std::exp(1.0) + std::exp(2.0) + std::exp(3.0)));
  CHECK(k::softmax_cross_entropy_forward(logits.data(), &target, 1, 3) ==
        doctest::Approx(want).epsilon(1e-14));

  const std::vector<float> big{1e4f, -1e4f, 0.0f, 1e4f};
  const std::int32_t t2 = 1;
  const double loss = k::softmax_cross_entropy_forward(big.data(), &t2, 1, 4);
  CHECK(loss == doctest::Approx(2e4 + std::log(2.0)));
  std::vector<float> d(4);
  k::softmax_cross_entropy_backward(big.data(), &t2, 1, 4, 1.0f, d.data());
  CHECK(d[0] == doctest::Approx(0.5));
  CHECK(d[1] == doctest::Approx(-1.0));
  CHECK(d[2] == 0.0f);
  CHECK(d[3] == doctest::Approx(0.5));
}

TEST_CASE("softmax cross-entropy backward: matches central differences (double)") {
  const std::size_t rows = 4, vocab = 7;
  auto logits = random_values(rows * vocab, 11, 3.0);
  const std::vector<std::int32_t> targets{3, 0, 6, 3};
  const double dloss = 1.7;
  std::vector<double> d(rows * vocab);
  k::softmax_cross_entropy_backward(logits.data(), targets.data(), rows, vocab, dloss, d.data());
  const double h = 1e-6;
  double worst = 0;
  for (std::size_t i = 0; i < logits.size(); ++i) {
    const double keep = logits[i];
    logits[i] = keep + h;
    const double up = k::softmax_cross_entropy_forward(logits.data(), targets.data(), rows, vocab);
    logits[i] = keep - h;
    const double down =
      k::softmax_cross_entropy_forward(logits.data(), targets.data(), rows, vocab);
    logits[i] = keep;
    worst = std::fmax(worst, std::fabs(dloss * (up - down) / (2 * h) - d[i]));
  }
  CHECK(worst < 1e-8);
  // Rows of the gradient sum to zero (softmax minus a one-hot).
  for (std::size_t r = 0; r < rows; ++r) {
    double s = 0;
    for (std::size_t i = 0; i < vocab; ++i)
      s += d[r * vocab + i];
    CHECK(std::fabs(s) < 1e-12);
  }
}

TEST_CASE("softmax_rows and its backward (double, central differences)") {
  const std::size_t rows = 3, cols = 5;
  auto logits = random_values(rows * cols, 12, 2.0);
  const auto weights = random_values(rows * cols, 13, 1.0); // loss = sum w .* softmax
  std::vector<double> p(rows * cols);
  k::softmax_rows(logits.data(), p.data(), rows, cols);
  for (std::size_t r = 0; r < rows; ++r) {
    double s = 0;
    for (std::size_t i = 0; i < cols; ++i)
      s += p[r * cols + i];
    CHECK(s == doctest::Approx(1.0).epsilon(1e-14));
  }
  std::vector<double> d(rows * cols);
  k::softmax_rows_backward(p.data(), weights.data(), d.data(), rows, cols);
  auto loss = [&] {
    std::vector<double> q(rows * cols);
    k::softmax_rows(logits.data(), q.data(), rows, cols);
    double s = 0;
    for (std::size_t i = 0; i < q.size(); ++i)
      s += weights[i] * q[i];
    return s;
  };
  const double h = 1e-6;
  for (std::size_t i = 0; i < logits.size(); ++i) {
    const double keep = logits[i];
    logits[i] = keep + h;
    const double up = loss();
    logits[i] = keep - h;
    const double down = loss();
    logits[i] = keep;
    CHECK(std::fabs((up - down) / (2 * h) - d[i]) < 1e-8);
  }
}
