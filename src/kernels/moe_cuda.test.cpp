// CUDA MoE routing kernels against the CPU oracle: exact for the integer
// maps and for the kernels that repeat the CPU's float operations in the
// same order, a tolerance where the device reduces in a tree.
#include "kernels/cuda/ops.hpp"
#include "kernels/cuda/test_support.hpp"
#include "kernels/loss.hpp"
#include "kernels/moe.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace {

namespace cpu = cmesh::kernels::cpu;
namespace gpu = cmesh::kernels::cuda;
using namespace cmesh::kernels::cuda_test;
using ivec = std::vector<std::int32_t>;

struct shape {
  std::size_t tokens, experts, k;
};

constexpr shape shapes[] = {{1, 1, 1},     {5, 4, 2},   {33, 8, 2},  {257, 16, 4}, {1000, 64, 8},
                            {513, 7, 7},   {100, 3, 1}, {4099, 8, 2}, {2, 300, 3}};

// Router probabilities (softmax of random logits) with ties: every fourth
// token has all experts equal, every fourth+1 its first two experts equal.
std::vector<float> make_probs(const shape& sh, std::mt19937& rng) {
  auto logits = uniform(sh.tokens * sh.experts, rng, -3.0f, 3.0f);
  for (std::size_t t = 0; t < sh.tokens; ++t) {
    float* row = logits.data() + t * sh.experts;
    if (t % 4 == 0)
      for (std::size_t e = 0; e < sh.experts; ++e)
        row[e] = 0.5f;
    else if (t % 4 == 1 && sh.experts > 1)
      row[1] = row[0];
  }
  std::vector<float> probs(logits.size());
  cpu::softmax_rows(logits.data(), probs.data(), sh.tokens, sh.experts);
  return probs;
}

ivec download_prefix(const device_vector<std::int32_t>& d, std::size_t n) {
  auto v = d.download();
  v.resize(n);
  return v;
}

} // namespace

TEST_CASE("cuda top_k_gating: choices and gates bit-identical to the cpu oracle") {
  CMESH_CUDA_TEST_REQUIRE_DEVICE();
  stream s;
  auto rng = rng_for(1);
  for (const shape sh : shapes) {
    CAPTURE(sh.tokens);
    CAPTURE(sh.experts);
    CAPTURE(sh.k);
    const auto probs = make_probs(sh, rng);
    const std::size_t n = sh.tokens * sh.k;
    device_vector<float> dprobs(probs), dgates(n);
    device_vector<std::int32_t> dchosen(n);
    gpu::top_k_gating(dprobs.get(), sh.tokens, sh.experts, sh.k, dchosen.get(), dgates.get(), s);
    s.sync();
    ivec chosen(n);
    std::vector<float> gates(n);
    cpu::top_k_gating(probs.data(), sh.tokens, sh.experts, sh.k, chosen.data(), gates.data());
    CHECK(count_different(dchosen.download(), chosen, "chosen") == 0);
    CHECK(count_different(dgates.download(), gates, "gates") == 0);
  }
}

TEST_CASE("cuda top_k_gating: k outside [1, experts] throws") {
  CMESH_CUDA_TEST_REQUIRE_DEVICE();
  stream s;
  device_vector<float> dprobs(std::vector<float>{0.5f, 0.5f});
  device_vector<std::int32_t> dchosen(3);
  device_vector<float> dgates(3);
  CHECK_THROWS_AS(gpu::top_k_gating(dprobs.get(), 1, 2, 3, dchosen.get(), dgates.get(), s),
                  std::invalid_argument);
  CHECK_THROWS_AS(gpu::top_k_gating(dprobs.get(), 1, 2, 0, dchosen.get(), dgates.get(), s),
                  std::invalid_argument);
}

TEST_CASE("cuda top_k_gating_backward matches the cpu oracle") {
  CMESH_CUDA_TEST_REQUIRE_DEVICE();
  stream s;
  auto rng = rng_for(2);
  for (const shape sh : shapes) {
    CAPTURE(sh.tokens);
    CAPTURE(sh.experts);
    CAPTURE(sh.k);
    const auto probs = make_probs(sh, rng);
    const std::size_t n = sh.tokens * sh.k;
    ivec chosen(n);
    std::vector<float> gates(n);
    cpu::top_k_gating(probs.data(), sh.tokens, sh.experts, sh.k, chosen.data(), gates.data());
    const auto dgates = uniform(n, rng, -1.0f, 1.0f);
    const auto dprobs0 = uniform(probs.size(), rng, -0.5f, 0.5f);
    device_vector<float> dp(probs), dg(gates), ddg(dgates), ddp(dprobs0);
    device_vector<std::int32_t> dc(chosen);
    gpu::top_k_gating_backward(dp.get(), dc.get(), dg.get(), ddg.get(), sh.tokens, sh.experts,
                               sh.k, ddp.get(), s);
    s.sync();
    auto want = dprobs0;
    cpu::top_k_gating_backward(probs.data(), chosen.data(), gates.data(), dgates.data(), sh.tokens,
                               sh.experts, sh.k, want.data());
    // The same float operations in the same order (bit-identical unless the
    // CPU build contracts to FMA): a tolerance of a few ulp.
    CHECK(count_outside(ddp.download(), want, 1e-6, 1e-6, "dprobs") == 0);
  }
}

TEST_CASE("cuda capacity, permutation, permute and unpermute (+ backward) match the cpu oracle") {
  CMESH_CUDA_TEST_REQUIRE_DEVICE();
  stream s;
  auto rng = rng_for(3);
  for (const shape sh : shapes) {
    for (const double factor : {0.0, 0.5, 1.0, 1.25, 4.0}) {
      const std::size_t tokens = sh.tokens, experts = sh.experts, k = sh.k;
      const std::size_t width = 1 + (tokens * 7 + experts) % 70; // odd widths, 1 .. 70
      CAPTURE(tokens);
      CAPTURE(experts);
      CAPTURE(k);
      CAPTURE(factor);
      CAPTURE(width);
      const auto probs = make_probs(sh, rng);
      const std::size_t n = tokens * k;
      ivec chosen(n);
      std::vector<float> gates(n);
      cpu::top_k_gating(probs.data(), tokens, experts, k, chosen.data(), gates.data());
      const std::size_t capacity = cpu::expert_capacity(factor, tokens, experts, k);
      CAPTURE(capacity);

      // CPU oracle.
      ivec slots(n), counts(experts), offsets(experts + 1), row_of(n), token_of(n, -7);
      const std::size_t dropped = cpu::assign_capacity(chosen.data(), tokens, experts, k,
                                                       capacity, slots.data(), counts.data());
      const std::size_t rows =
        cpu::build_permutation(chosen.data(), slots.data(), counts.data(), tokens, experts, k,
                               offsets.data(), row_of.data(), token_of.data());
      token_of.resize(rows);

      // Device.
      device_vector<std::int32_t> dchosen(chosen), dslots(n), dcounts(experts),
        ddropped(ivec{-5}), doffsets(experts + 1), drow_of(n), dtoken_of(n);
      gpu::assign_capacity(dchosen.get(), tokens, experts, k, capacity, dslots.get(),
                           dcounts.get(), ddropped.get(), s);
      gpu::build_permutation(dchosen.get(), dslots.get(), dcounts.get(), tokens, experts, k,
                             doffsets.get(), drow_of.get(), dtoken_of.get(), s);
      s.sync();
      CHECK(count_different(dslots.download(), slots, "slots") == 0);
      CHECK(count_different(dcounts.download(), counts, "counts") == 0);
      CHECK(ddropped.download()[0] == static_cast<std::int32_t>(dropped));
      CHECK(count_different(doffsets.download(), offsets, "offsets") == 0);
      CHECK(count_different(drow_of.download(), row_of, "row_of") == 0);
      CHECK(count_different(download_prefix(dtoken_of, rows), token_of, "token_of") == 0);

      // permute_tokens and its backward: a gather and an ordered scatter.
      const auto x = uniform(tokens * width, rng, -1.0f, 1.0f);
      const auto dout = uniform(rows * width, rng, -1.0f, 1.0f);
      const auto dx0 = uniform(tokens * width, rng, -1.0f, 1.0f);
      device_vector<float> dx_in(x), dpermuted(rows * width), ddout(dout), ddx(dx0);
      gpu::permute_tokens(dx_in.get(), dtoken_of.get(), rows, width, dpermuted.get(), s);
      gpu::permute_tokens_backward(ddout.get(), dtoken_of.get(), rows, width, ddx.get(), s);
      s.sync();
      std::vector<float> permuted(rows * width);
      cpu::permute_tokens(x.data(), token_of.data(), rows, width, permuted.data());
      auto dx = dx0;
      cpu::permute_tokens_backward(dout.data(), token_of.data(), rows, width, dx.data());
      CHECK(count_different(dpermuted.download(), permuted, "permute_tokens") == 0);
      CHECK(count_different(ddx.download(), dx, "permute_tokens_backward") == 0);

      // unpermute_tokens: the same float operations in the same order.
      const auto expert_out = uniform(rows * width, rng, -1.0f, 1.0f);
      const auto y0 = uniform(tokens * width, rng, -1.0f, 1.0f);
      device_vector<float> dexpert_out(expert_out), dgates(gates), dy_acc(y0);
      gpu::unpermute_tokens(dexpert_out.get(), drow_of.get(), dgates.get(), tokens, k, width,
                            dy_acc.get(), s);
      s.sync();
      auto y = y0;
      cpu::unpermute_tokens(expert_out.data(), row_of.data(), gates.data(), tokens, k, width,
                            y.data());
      CHECK(count_outside(dy_acc.download(), y, 1e-6, 1e-7, "unpermute_tokens") == 0);

      // unpermute_tokens_backward: dexpert_out is a product (exact), dgates
      // a dot product reduced in a tree.
      const auto dy = uniform(tokens * width, rng, -1.0f, 1.0f);
      device_vector<float> ddy(dy), ddexpert(rows * width), ddgates(uniform(n, rng, 7.0f, 8.0f));
      gpu::unpermute_tokens_backward(ddy.get(), dexpert_out.get(), drow_of.get(), dgates.get(),
                                     tokens, k, width, ddexpert.get(), ddgates.get(), s);
      s.sync();
      std::vector<float> dexpert(rows * width), dgate(n);
      cpu::unpermute_tokens_backward(dy.data(), expert_out.data(), row_of.data(), gates.data(),
                                     tokens, k, width, dexpert.data(), dgate.data());
      CHECK(count_different(ddexpert.download(), dexpert, "dexpert_out") == 0);
      std::vector<double> tol(n, 0.0);
      for (std::size_t a = 0; a < n; ++a) {
        if (row_of[a] < 0)
          continue; // exactly 0
        double abs_dot = 0;
        for (std::size_t i = 0; i < width; ++i)
          abs_dot += std::fabs(static_cast<double>(dy[(a / k) * width + i]) *
                               expert_out[static_cast<std::size_t>(row_of[a]) * width + i]);
        tol[a] = 2.0 * static_cast<double>(width + 1) * 1.2e-7 * abs_dot + 1e-37;
      }
      CHECK(count_outside(ddgates.download(), dgate, tol, "dgates") == 0);
    }
  }
}

TEST_CASE("cuda assign_capacity: edge cases") {
  CMESH_CUDA_TEST_REQUIRE_DEVICE();
  stream s;
  // An expert index outside [0, experts) gets slot -1 and is not counted.
  const ivec chosen{0, 2, -1, 1, 0, 5, 0, 0};
  device_vector<std::int32_t> dchosen(chosen), dslots(8), dcounts(3), ddropped(1);
  gpu::assign_capacity(dchosen.get(), 4, 3, 2, 2, dslots.get(), dcounts.get(), ddropped.get(), s);
  s.sync();
  CHECK(dslots.download() == ivec{0, 0, -1, 0, 1, -1, -1, -1});
  CHECK(dcounts.download() == ivec{2, 1, 1});
  CHECK(ddropped.download()[0] == 2);
  // No assignments: counts and dropped are zeroed; a null `dropped` is fine.
  device_vector<std::int32_t> dcounts2(ivec{9, 9, 9});
  gpu::assign_capacity(nullptr, 0, 3, 2, 5, nullptr, dcounts2.get(), ddropped.get(), s);
  gpu::assign_capacity(dchosen.get(), 4, 3, 2, 2, dslots.get(), dcounts.get(), nullptr, s);
  s.sync();
  CHECK(dcounts2.download() == ivec{0, 0, 0});
  CHECK(ddropped.download()[0] == 0);
}

TEST_CASE("cuda load_balancing_loss and load_balancing_backward match the cpu oracle") {
  CMESH_CUDA_TEST_REQUIRE_DEVICE();
  stream s;
  auto rng = rng_for(4);
  for (const shape sh : shapes) {
    CAPTURE(sh.tokens);
    CAPTURE(sh.experts);
    CAPTURE(sh.k);
    const auto probs = make_probs(sh, rng);
    const std::size_t n = sh.tokens * sh.k;
    ivec chosen(n);
    std::vector<float> gates(n);
    cpu::top_k_gating(probs.data(), sh.tokens, sh.experts, sh.k, chosen.data(), gates.data());
    device_vector<float> dprobs(probs);
    device_vector<std::int32_t> dchosen(chosen);
    device_vector<double> dloss(1);
    gpu::load_balancing_loss(dprobs.get(), dchosen.get(), sh.tokens, sh.experts, sh.k,
                             dloss.get(), s);
    s.sync();
    const double want =
      cpu::load_balancing_loss(probs.data(), chosen.data(), sh.tokens, sh.experts, sh.k);
    // The probability sums are in double, in another order.
    CHECK(count_outside(dloss.download(), std::vector<double>{want}, 1e-11, 1e-15, "loss") == 0);

    for (const float weight : {1.0f, 0.01f}) {
      CAPTURE(weight);
      const auto d0 = uniform(probs.size(), rng, -1.0f, 1.0f);
      device_vector<float> dd(d0);
      gpu::load_balancing_backward(dchosen.get(), sh.tokens, sh.experts, sh.k, weight, dd.get(),
                                   s);
      s.sync();
      auto d = d0;
      cpu::load_balancing_backward(chosen.data(), sh.tokens, sh.experts, sh.k, weight, d.data());
      CHECK(count_different(dd.download(), d, "load_balancing_backward") == 0);
    }
  }
  // No tokens: a loss of 0.
  device_vector<double> dloss(std::vector<double>{3.0});
  gpu::load_balancing_loss(nullptr, nullptr, 0, 4, 1, dloss.get(), s);
  s.sync();
  CHECK(dloss.download()[0] == 0.0);
}
