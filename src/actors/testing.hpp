// Test helpers of the actors' unit tests.
#pragma once

#include "actors/optimizer.hpp"
#include "actors/trainer.hpp"

#include <random>
#include <vector>

namespace cmesh::actors::testing {

/// A shard's state stepped by the optimizer, as the trainer steps it, with
/// random weights and updates from `seed`.
struct fake_shard {
  model::train_config tc;
  std::vector<float> params, m, v, scalars{65536.0f, 0.0f};
  uint64_t step = 0;
  std::mt19937 rng;

  explicit fake_shard(size_t n, unsigned seed = 7)
      : params(n), m(n, 0.0f), v(n, 0.0f), rng(seed) {
    std::uniform_real_distribution<float> d(-1.0f, 1.0f);
    for (auto& p : params)
      p = d(rng);
  }
  train_state state() { return {step, params, m, v, scalars}; }
  /// Commits one step: returns its update.
  std::vector<float> commit() {
    std::vector<float> u(params.size());
    std::normal_distribution<float> d(0.0f, 0.01f);
    for (auto& x : u)
      x = d(rng);
    apply_committed(tc, state(), step, u);
    ++step;
    return u;
  }
  uint64_t hash() { return hash_state(params, m, v, scalars); }
};

} // namespace cmesh::actors::testing
