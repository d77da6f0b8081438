// The checkpoint shadow against a trainer's state stepped here with the same
// optimizer: it follows the announced commits bit for bit, takes the state
// again after a gap, and never holds the trainer up (a full queue drops).
// End to end (real workers, a kill, catch-up): tests/supervision.test.cpp.
#include "actors/checkpoint.hpp"
#include "actors/optimizer.hpp"
#include "actors/testing.hpp"

#include "storage/paths.hpp"
#include "storage/reader.hpp"

#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <random>
#include <vector>

using namespace cmesh;
using namespace cmesh::actors;

namespace {

using fake_trainer = testing::fake_shard;

} // namespace

TEST_CASE("checkpoint shadow: follows every commit bit for bit, re-seeds after a gap") {
  caf::actor_system_config cfg;
  caf::actor_system sys{cfg};
  fake_trainer t(10000);
  shadow_feed feed(sys, {t.tc, 64, true, {}, {}});
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
  shadow_feed feed(sys, {t.tc, 0, false, {}, {}});
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
  shadow_feed f2(sys, {a.tc, 16, true, {}, {}});
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

namespace {

/// A scratch directory, removed at the end.
struct scratch_dir {
  std::string path;
  scratch_dir()
      : path("/tmp/cmesh_shadow_test_" + std::to_string(::getpid()) + "_"
             + std::to_string(counter()++)) {
    std::filesystem::remove_all(path);
  }
  ~scratch_dir() { std::filesystem::remove_all(path); }
  static int& counter() {
    static int n = 0;
    return n;
  }
};

checkpoint_target target_for(const std::string& root, uint32_t rank, uint32_t S, uint64_t n) {
  checkpoint_target t;
  t.roots = {root};
  t.every = 4;
  t.keep_last = 2;
  t.rank = rank;
  t.replicas = 1;
  t.ranks_per_group = S;
  t.elements = n;
  t.tensors = {{"a", {n / 2}, 0, n / 2}, {"b", {n - n / 2}, n / 2, n - n / 2}};
  t.config = {{"model.test", "1"}};
  t.assemble_timeout = std::chrono::seconds(20);
  return t;
}

} // namespace

TEST_CASE("checkpoint shadow: writes every K steps and at the last, through retention; the "
          "checkpoint holds the trainer's state") {
  caf::actor_system_config cfg;
  caf::actor_system sys{cfg};
  scratch_dir d;
  fake_trainer t(6000);
  t.tc.steps = 10;
  shadow_feed feed(sys, {t.tc, 64, false, target_for(d.path, 0, 1, 6000), {}});
  std::vector<float> at8;
  for (int k = 0; k < 10; ++k) {
    feed.at_boundary(t.state());
    auto u = t.commit();
    feed.committed(t.step - 1, u, t.state());
    if (t.step == 8) {
      REQUIRE(feed.drain(8, std::chrono::seconds(30)));
      at8 = t.params;
    }
  }
  feed.at_boundary(t.state());
  auto s = feed.drain(10, std::chrono::seconds(30));
  REQUIRE(s);
  CHECK(s->written == 3); // steps 4, 8 and 10 (the last)
  CHECK(s->write_failures == 0);
  CHECK(s->last_written == 10);
  // Retention: the newest two.
  auto all = storage::list_checkpoints(d.path, true);
  REQUIRE(all);
  REQUIRE(all->size() == 2);
  CHECK((*all)[0].step == 8);
  CHECK((*all)[1].step == 10);
  auto c = storage::checkpoint::open((*all)[0].dir);
  REQUIRE(c);
  std::vector<float> w(6000);
  REQUIRE(!c->read_range<float>("weights", 0, w));
  CHECK(w == at8);
  c = storage::checkpoint::open((*all)[1].dir);
  REQUIRE(c);
  REQUIRE(!c->read_range<float>("adam_v", 0, w));
  CHECK(w == t.v);
  CHECK(c->info().meta.loss_scale == t.scalars[0]);
}

TEST_CASE("checkpoint shadow: the ranks of a group write one checkpoint together, each its "
          "shard") {
  caf::actor_system_config cfg;
  caf::actor_system sys{cfg};
  scratch_dir d;
  constexpr size_t n = 3 * norm_block + 100;
  const auto split = split_shards(n, 2, norm_block);
  fake_trainer t0(split.counts[0]), t1(split.counts[1]);
  t0.tc.steps = t1.tc.steps = 4;
  shadow_feed f0(sys, {t0.tc, 64, false, target_for(d.path, 0, 2, n), {}});
  shadow_feed f1(sys, {t1.tc, 64, false, target_for(d.path, 1, 2, n), {}});
  for (int k = 0; k < 4; ++k) {
    f0.at_boundary(t0.state());
    f1.at_boundary(t1.state());
    auto u0 = t0.commit();
    auto u1 = t1.commit();
    f0.committed(t0.step - 1, u0, t0.state());
    f1.committed(t1.step - 1, u1, t1.state());
  }
  REQUIRE(f1.drain(4, std::chrono::seconds(30)));
  auto s = f0.drain(4, std::chrono::seconds(30));
  REQUIRE(s);
  CHECK(s->written == 1);
  auto c = storage::checkpoint::open(d.path + "/" + storage::step_dir_name(4));
  REQUIRE(c);
  REQUIRE(!c->verify());
  std::vector<float> whole(n);
  REQUIRE(!c->read_range<float>("adam_m", 0, whole));
  CHECK(std::equal(t0.m.begin(), t0.m.end(), whole.begin()));
  CHECK(std::equal(t1.m.begin(), t1.m.end(), whole.begin() + static_cast<long>(split.offsets[1])));
}

TEST_CASE("checkpoint shadow: a write that fails is counted and said; the shadow goes on") {
  caf::actor_system_config cfg;
  caf::actor_system sys{cfg};
  scratch_dir d;
  std::filesystem::create_directories(d.path);
  const auto not_a_dir = d.path + "/file";
  std::ofstream(not_a_dir) << "x";
  fake_trainer t(2000);
  t.tc.steps = 8;
  shadow_feed feed(sys, {t.tc, 64, false, target_for(not_a_dir, 0, 1, 2000), {}});
  for (int k = 0; k < 8; ++k) {
    feed.at_boundary(t.state());
    auto u = t.commit();
    feed.committed(t.step - 1, u, t.state());
  }
  auto s = feed.drain(8, std::chrono::seconds(30));
  REQUIRE(s);
  CHECK(s->step == 8);
  CHECK(s->state_hash == t.hash());
  CHECK(s->written == 0);
  CHECK(s->write_failures == 2); // steps 4 and 8
}
