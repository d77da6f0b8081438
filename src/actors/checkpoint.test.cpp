// The checkpoint shadow against a trainer's state stepped here with the same
// optimizer: it follows the announced commits bit for bit, takes the state
// again after a gap, and never holds the trainer up (a full queue drops).
// End to end (real workers, a kill, catch-up): tests/supervision.test.cpp.
#include "actors/checkpoint.hpp"
#include "actors/optimizer.hpp"

#include <doctest/doctest.h>

#include <random>
#include <vector>

using namespace cmesh;
using namespace cmesh::actors;

namespace {

/// A shard's state stepped by the optimizer, as the trainer steps it.
struct fake_trainer {
  model::train_config tc;
  std::vector<float> params, m, v, scalars{65536.0f, 0.0f};
  uint64_t step = 0;
  std::mt19937 rng{7};

  explicit fake_trainer(size_t n) : params(n), m(n, 0.0f), v(n, 0.0f) {
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

} // namespace

TEST_CASE("checkpoint shadow: follows every commit bit for bit, re-seeds after a gap") {
  caf::actor_system_config cfg;
  caf::actor_system sys{cfg};
  fake_trainer t(10000);
  shadow_feed feed(sys, {t.tc, 64, true});
  for (int k = 0; k < 20; ++k) {
    feed.at_boundary(t.state());
    auto u = t.commit();
    feed.committed(t.step - 1, u, t.state());
  }
  auto s = feed.status(std::chrono::seconds(10));
  REQUIRE(s);
  CHECK(s->seeded);
  CHECK(s->step == 20);
  CHECK(s->state_hash == t.hash());
  CHECK(s->applied == 20);
  CHECK(s->seeds == 1);
  CHECK(s->checked == 20);
  CHECK(s->mismatches == 0);
  // Two steps the trainer applied without announcing them (a
  // reconciliation's replay): the shadow is seeded again at the boundary.
  t.commit();
  t.commit();
  feed.at_boundary(t.state());
  auto u = t.commit();
  feed.committed(t.step - 1, u, t.state());
  s = feed.status(std::chrono::seconds(10));
  REQUIRE(s);
  CHECK(s->step == 23);
  CHECK(s->state_hash == t.hash());
  CHECK(s->seeds == 2);
  CHECK(s->mismatches == 0);
  CHECK(feed.dropped() == 0);
}

TEST_CASE("checkpoint shadow: a full queue drops updates rather than wait, and catches up") {
  caf::actor_system_config cfg;
  caf::actor_system sys{cfg};
  fake_trainer t(5000);
  // No room for an update: each is dropped and the shadow is seeded at the
  // next boundary instead.
  shadow_feed feed(sys, {t.tc, 0, false});
  for (int k = 0; k < 5; ++k) {
    feed.at_boundary(t.state());
    auto u = t.commit();
    feed.committed(t.step - 1, u, t.state());
  }
  feed.at_boundary(t.state());
  CHECK(feed.dropped() == 5);
  auto s = feed.status(std::chrono::seconds(10));
  REQUIRE(s);
  CHECK(s->step == 5);
  CHECK(s->state_hash == t.hash());
  CHECK(s->applied == 0);
  CHECK(s->seeds == 6);
}

TEST_CASE("checkpoint shadow: bf16's loss scale is stepped too") {
  caf::actor_system_config cfg;
  caf::actor_system sys{cfg};
  // Step 3 overflowed: its update is every element NaN, which moves only
  // the loss scale.
  fake_trainer a(4096);
  a.tc.precision = "bf16";
  shadow_feed f2(sys, {a.tc, 16, true});
  for (int k = 0; k < 6; ++k) {
    f2.at_boundary(a.state());
    std::vector<float> u;
    if (k == 3) {
      u.assign(a.params.size(), std::nanf(""));
      apply_committed(a.tc, a.state(), a.step, u);
      ++a.step;
    } else {
      u = a.commit();
    }
    f2.committed(a.step - 1, u, a.state());
  }
  auto s = f2.status(std::chrono::seconds(10));
  REQUIRE(s);
  CHECK(s->step == 6);
  CHECK(s->state_hash == a.hash());
  CHECK(s->mismatches == 0);
  CHECK(a.scalars[0] == doctest::Approx(32768.0f)); // backed off once by the skip
}
