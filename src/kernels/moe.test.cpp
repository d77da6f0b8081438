#include "kernels/loss.hpp"
#include "kernels/moe.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace {

namespace k = cmesh::kernels::cpu;
using ivec = std::vector<std::int32_t>;

std::vector<double> random_values(std::size_t n, unsigned seed, double scale) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u(-scale, scale);
  std::vector<double> v(n);
  for (auto& x : v)
    x = u(rng);
  return v;
}

// Central difference of f at v[i].
template <class F>
double central(std::vector<double>& v, std::size_t i, F f, double h = 1e-6) {
  const double keep = v[i];
  v[i] = keep + h;
  const double up = f();
  v[i] = keep - h;
  const double down = f();
  v[i] = keep;
  return (up - down) / (2 * h);
}

} // namespace

TEST_CASE("top_k_gating: order, ties to the lower index, normalised gates") {
  const std::vector<double> probs{
    0.1, 0.4, 0.2, 0.3,   // clear order
    0.25, 0.25, 0.25, 0.25, // all tied: 0 then 1
    0.1, 0.35, 0.2, 0.35, // tie for first between 1 and 3
  };
  ivec chosen(6);
  std::vector<double> gates(6);
  k::top_k_gating(probs.data(), 3, 4, 2, chosen.data(), gates.data());
  CHECK(chosen == ivec{1, 3, 0, 1, 1, 3});
  CHECK(gates[0] == doctest::Approx(0.4 / 0.7));
  CHECK(gates[1] == doctest::Approx(0.3 / 0.7));
  CHECK(gates[2] == 0.5);
  CHECK(gates[4] == 0.5);
  // k == experts takes everything, gates are then the probabilities.
  ivec all(4);
  std::vector<double> g(4);
  k::top_k_gating(probs.data(), 1, 4, 4, all.data(), g.data());
  CHECK(all == ivec{1, 3, 2, 0});
  CHECK(g[0] == doctest::Approx(0.4));
}

TEST_CASE("expert_capacity rounds up, exactly on integers") {
  CHECK(k::expert_capacity(1.25, 256, 4, 2) == 160);
  CHECK(k::expert_capacity(1.0, 10, 4, 1) == 3); // 2.5 -> 3
  CHECK(k::expert_capacity(1.1, 256, 4, 2) == 141); // 140.8 -> 141
  CHECK(k::expert_capacity(1.0, 8, 4, 2) == 4);
  CHECK(k::expert_capacity(0.0, 8, 4, 2) == 0);
  CHECK(k::expert_capacity(1.0, 8, 0, 2) == 0);
}

TEST_CASE("assign_capacity drops in token order and build_permutation maps rows") {
  // 4 tokens, k = 2, 3 experts, capacity 2.
  const ivec chosen{0, 1, 0, 2, 0, 1, 1, 0};
  ivec slots(8), counts(3);
  const std::size_t dropped = k::assign_capacity(chosen.data(), 4, 3, 2, 2, slots.data(),
                                                 counts.data());
  // Expert 0 fills with tokens 0 and 1, so tokens 2 and 3 lose it; expert 1
  // fills with tokens 0 and 2, so token 3 loses it too.
  CHECK(dropped == 3);
  CHECK(slots == ivec{0, 0, 1, 0, -1, 1, -1, -1});
  CHECK(counts == ivec{2, 2, 1});
  ivec offsets(4), row_of(8), token_of(5);
  const std::size_t rows = k::build_permutation(chosen.data(), slots.data(), counts.data(), 4, 3,
                                                2, offsets.data(), row_of.data(),
                                                token_of.data());
  CHECK(rows == 5);
  CHECK(offsets == ivec{0, 2, 4, 5});
  CHECK(row_of == ivec{0, 2, 1, 4, -1, 3, -1, -1});
  CHECK(token_of == ivec{0, 1, 0, 2, 1});
}

TEST_CASE("permute then unpermute with gates 1 and k = 1 is the identity") {
  const std::size_t tokens = 5, width = 3;
  const auto x = random_values(tokens * width, 21, 1.0);
  const ivec chosen{2, 0, 2, 1, 0};
  ivec slots(tokens), counts(3), offsets(4), row_of(tokens), token_of(tokens);
  CHECK(k::assign_capacity(chosen.data(), tokens, 3, 1, 10, slots.data(), counts.data()) == 0);
  const std::size_t rows = k::build_permutation(chosen.data(), slots.data(), counts.data(), tokens,
                                                3, 1, offsets.data(), row_of.data(),
                                                token_of.data());
  REQUIRE(rows == tokens);
  std::vector<double> permuted(rows * width), back(tokens * width, 0.0);
  k::permute_tokens(x.data(), token_of.data(), rows, width, permuted.data());
  // Expert 0's rows come first: tokens 1 and 4.
  CHECK(permuted[0] == x[1 * width]);
  CHECK(permuted[width] == x[4 * width]);
  const std::vector<double> ones(tokens, 1.0);
  k::unpermute_tokens(permuted.data(), row_of.data(), ones.data(), tokens, 1, width, back.data());
  CHECK(back == x);
}

TEST_CASE("permute and unpermute backward match central differences (double)") {
  const std::size_t tokens = 4, width = 3, experts = 3, kk = 2;
  const ivec chosen{0, 1, 2, 0, 0, 2, 1, 0};
  ivec slots(8), counts(3), offsets(4), row_of(8), token_of(8);
  const std::size_t dropped =
    k::assign_capacity(chosen.data(), tokens, experts, kk, 2, slots.data(), counts.data());
  CHECK(dropped == 2); // some assignments are dropped: their gradients must be zero
  const std::size_t rows = k::build_permutation(chosen.data(), slots.data(), counts.data(),
                                                tokens, experts, kk, offsets.data(),
                                                row_of.data(), token_of.data());
  auto x = random_values(tokens * width, 22, 1.0);
  auto expert_out = random_values(rows * width, 23, 1.0);
  auto gates = random_values(tokens * kk, 24, 1.0);
  const auto w = random_values(tokens * width, 25, 1.0);  // loss weights on y
  const auto wp = random_values(rows * width, 26, 1.0);   // loss weights on permuted x

  // Unpermute: loss = sum w .* y(expert_out, gates).
  auto unpermute_loss = [&] {
    std::vector<double> y(tokens * width, 0.0);
    k::unpermute_tokens(expert_out.data(), row_of.data(), gates.data(), tokens, kk, width,
                        y.data());
    double s = 0;
    for (std::size_t i = 0; i < y.size(); ++i)
      s += w[i] * y[i];
    return s;
  };
  std::vector<double> d_out(rows * width), d_gates(tokens * kk);
  k::unpermute_tokens_backward(w.data(), expert_out.data(), row_of.data(), gates.data(), tokens,
                               kk, width, d_out.data(), d_gates.data());
  for (std::size_t i = 0; i < expert_out.size(); ++i)
    CHECK(std::fabs(central(expert_out, i, unpermute_loss) - d_out[i]) < 1e-8);
  for (std::size_t i = 0; i < gates.size(); ++i) {
    CHECK(std::fabs(central(gates, i, unpermute_loss) - d_gates[i]) < 1e-8);
    if (row_of[i] < 0)
      CHECK(d_gates[i] == 0.0);
  }

  // Permute: loss = sum wp .* permute(x).
  auto permute_loss = [&] {
    std::vector<double> p(rows * width);
    k::permute_tokens(x.data(), token_of.data(), rows, width, p.data());
    double s = 0;
    for (std::size_t i = 0; i < p.size(); ++i)
      s += wp[i] * p[i];
    return s;
  };
  std::vector<double> dx(tokens * width, 0.0);
  k::permute_tokens_backward(wp.data(), token_of.data(), rows, width, dx.data());
  for (std::size_t i = 0; i < x.size(); ++i)
    CHECK(std::fabs(central(x, i, permute_loss) - dx[i]) < 1e-8);
}

TEST_CASE("top_k_gating_backward matches central differences through the gates (double)") {
  const std::size_t tokens = 3, experts = 5, kk = 2;
  auto logits = random_values(tokens * experts, 31, 2.0);
  const auto w = random_values(tokens * kk, 32, 1.0);
  std::vector<double> probs(tokens * experts), gates(tokens * kk);
  ivec chosen(tokens * kk);
  k::softmax_rows(logits.data(), probs.data(), tokens, experts);
  k::top_k_gating(probs.data(), tokens, experts, kk, chosen.data(), gates.data());
  const ivec fixed = chosen;
  auto loss = [&] {
    std::vector<double> p(tokens * experts), g(tokens * kk);
    ivec c(tokens * kk);
    k::softmax_rows(logits.data(), p.data(), tokens, experts);
    k::top_k_gating(p.data(), tokens, experts, kk, c.data(), g.data());
    REQUIRE(c == fixed); // the perturbation must not change the choice
    double s = 0;
    for (std::size_t i = 0; i < g.size(); ++i)
      s += w[i] * g[i];
    return s;
  };
  std::vector<double> dprobs(tokens * experts, 0.0), dlogits(tokens * experts);
  k::top_k_gating_backward(probs.data(), chosen.data(), gates.data(), w.data(), tokens, experts,
                           kk, dprobs.data());
  k::softmax_rows_backward(probs.data(), dprobs.data(), dlogits.data(), tokens, experts);
  for (std::size_t i = 0; i < logits.size(); ++i)
    CHECK(std::fabs(central(logits, i, loss) - dlogits[i]) < 1e-8);
}

TEST_CASE("load-balancing loss: 1 when balanced, E when collapsed") {
  const std::size_t experts = 4;
  std::vector<double> uniform(4 * experts, 0.25);
  const ivec spread{0, 1, 2, 3}; // k = 1
  CHECK(k::load_balancing_loss(uniform.data(), spread.data(), 4, experts, 1) ==
        doctest::Approx(1.0));
  std::vector<double> one_hot(4 * experts, 0.0);
  for (std::size_t t = 0; t < 4; ++t)
    one_hot[t * experts + 2] = 1.0;
  const ivec collapsed{2, 2, 2, 2};
  CHECK(k::load_balancing_loss(one_hot.data(), collapsed.data(), 4, experts, 1) ==
        doctest::Approx(4.0));
  CHECK(k::load_balancing_loss(one_hot.data(), collapsed.data(), 0, experts, 1) == 0.0);
}

TEST_CASE("load-balancing gradient wrt router logits matches central differences (double)") {
  const std::size_t tokens = 6, experts = 4, kk = 2;
  auto logits = random_values(tokens * experts, 41, 2.0);
  const double weight = 0.3;
  std::vector<double> probs(tokens * experts), gates(tokens * kk);
  ivec chosen(tokens * kk);
  k::softmax_rows(logits.data(), probs.data(), tokens, experts);
  k::top_k_gating(probs.data(), tokens, experts, kk, chosen.data(), gates.data());
  const ivec fixed = chosen;
  auto loss = [&] {
    std::vector<double> p(tokens * experts), g(tokens * kk);
    ivec c(tokens * kk);
    k::softmax_rows(logits.data(), p.data(), tokens, experts);
    k::top_k_gating(p.data(), tokens, experts, kk, c.data(), g.data());
    REQUIRE(c == fixed);
    return weight * k::load_balancing_loss(p.data(), c.data(), tokens, experts, kk);
  };
  std::vector<double> dprobs(tokens * experts, 0.0), dlogits(tokens * experts);
  k::load_balancing_backward(chosen.data(), tokens, experts, kk, weight, dprobs.data());
  k::softmax_rows_backward(probs.data(), dprobs.data(), dlogits.data(), tokens, experts);
  double worst = 0;
  for (std::size_t i = 0; i < logits.size(); ++i)
    worst = std::fmax(worst, std::fabs(central(logits, i, loss) - dlogits[i]));
  CHECK(worst < 1e-9);
}

TEST_CASE("moe kernels: float and double agree") {
  const std::size_t tokens = 8, experts = 4, kk = 2;
  const auto ld = random_values(tokens * experts, 51, 2.0);
  const std::vector<float> lf(ld.begin(), ld.end());
  std::vector<double> pd(ld.size()), gd(tokens * kk);
  std::vector<float> pf(ld.size()), gf(tokens * kk);
  ivec cd(tokens * kk), cf(tokens * kk);
  k::softmax_rows(ld.data(), pd.data(), tokens, experts);
  k::softmax_rows(lf.data(), pf.data(), tokens, experts);
  k::top_k_gating(pd.data(), tokens, experts, kk, cd.data(), gd.data());
  k::top_k_gating(pf.data(), tokens, experts, kk, cf.data(), gf.data());
  CHECK(cd == cf);
  for (std::size_t i = 0; i < gd.size(); ++i)
    CHECK(std::fabs(gd[i] - gf[i]) < 1e-6);
  CHECK(k::load_balancing_loss(pf.data(), cf.data(), tokens, experts, kk) ==
        doctest::Approx(k::load_balancing_loss(pd.data(), cd.data(), tokens, experts, kk))
          .epsilon(1e-6));
}
