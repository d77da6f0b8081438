// The checkpointer against two feeds in this process, over real transports
// (UCX) and a real coordinator's store: its shadows move by whole steps
// only, so a checkpoint is written where every shard stands, never where
// only one does. End to end (real workers, the checkpointer killed, every
// worker killed): tests/durable.test.cpp.
#include "actors/checkpointer.hpp"
#include "actors/testing.hpp"

#include "storage/paths.hpp"
#include "storage/reader.hpp"

#include <doctest/doctest.h>

#include <unistd.h>

#include <filesystem>
#include <random>
#include <thread>

using namespace cmesh;
using namespace cmesh::actors;
using namespace std::chrono_literals;

namespace {

using testing::fake_shard;

/// One step of a shard: its boundary, and its commit announced to `f`.
void step(fake_shard& s, checkpointer_feed* f) {
  if (f)
    f->at_boundary(s.state());
  auto u = s.commit();
  if (f)
    f->committed(s.step - 1, u, s.state());
}

template <class F>
bool eventually(F&& ok, std::chrono::milliseconds within = 20s) {
  const auto until = std::chrono::steady_clock::now() + within;
  while (!ok()) {
    if (std::chrono::steady_clock::now() > until)
      return false;
    std::this_thread::sleep_for(10ms);
  }
  return true;
}

} // namespace

TEST_CASE("checkpointer: two positions fed over UCX; only whole steps are written, and a "
          "position that runs ahead is held back") {
  const std::string root =
    "/tmp/cmesh_checkpointer_test_" + std::to_string(::getpid());
  std::filesystem::remove_all(root);
  coordinator coord(coordinator_options{"127.0.0.1", 0, 1});
  REQUIRE(!coord.start());
  const host_port at{"127.0.0.1", coord.port()};

  caf::actor_system_config cfg;
  caf::actor_system sys{cfg};
  constexpr size_t n = 3 * norm_block + 100;
  const auto split = split_shards(n, 2, norm_block);
  fake_shard s0(split.counts[0], 1), s1(split.counts[1], 2);
  s0.tc.steps = s1.tc.steps = 10;

  checkpointer_options co;
  co.train = s0.tc;
  co.target.roots = {root};
  co.target.every = 4;
  co.target.keep_last = 5;
  co.target.replicas = 1;
  co.target.ranks_per_group = 2;
  co.target.elements = n;
  co.target.tensors = {{"a", {n / 2}, 0, n / 2}, {"b", {n - n / 2}, n / 2, n - n / 2}};
  co.target.config = {{"model.test", "1"}};
  co.target.assemble_timeout = 20s;
  co.coordinator = at;
  auto c = checkpointer::start(sys, co);
  REQUIRE(c);
  std::atomic<bool> stop{false};
  std::thread poller([&] {
    while (!stop) {
      CHECK(!(*c)->poll_links());
      std::this_thread::sleep_for(20ms);
    }
  });

  auto feed_for = [&](uint32_t rank) {
    checkpointer_feed_options fo;
    fo.train = s0.tc;
    fo.coordinator = at;
    fo.rank = rank;
    fo.ranks_per_group = 2;
    fo.queue_max = 64;
    fo.check = true;
    return std::make_unique<checkpointer_feed>(sys, fo);
  };
  auto f0 = feed_for(0), f1 = feed_for(1);
  const std::vector<uint32_t> members{0, 1};
  f0->entered_epoch(members, 2);
  f1->entered_epoch(members, 2);
  REQUIRE(eventually([&] { return f0->stats().linked && f1->stats().linked; }));
  CHECK((*c)->links_made() == 2);

  // Position 1 joins at step 5: step 4 is not whole (only position 0 has
  // it) and must not be written; 8 and 10 (the last) are.
  for (int k = 0; k < 10; ++k) {
    step(s0, f0.get());
    step(s1, k >= 5 ? f1.get() : nullptr);
  }
  f0->at_boundary(s0.state());
  f1->at_boundary(s1.state());
  REQUIRE(!f0->drain(20s));
  REQUIRE(!f1->drain(20s));
  auto flushed = (*c)->flush(30s);
  REQUIRE(flushed);
  CHECK(*flushed == 10);
  auto all = storage::list_checkpoints(root, true);
  REQUIRE(all);
  REQUIRE(all->size() == 2);
  CHECK((*all)[0].step == 8);
  CHECK((*all)[1].step == 10);
  auto ck = storage::checkpoint::open((*all)[1].dir);
  REQUIRE(ck);
  std::vector<float> whole(n);
  REQUIRE(!ck->read_range<float>("adam_v", 0, whole));
  CHECK(std::equal(s0.v.begin(), s0.v.end(), whole.begin()));
  CHECK(std::equal(s1.v.begin(), s1.v.end(), whole.begin() + static_cast<long>(split.offsets[1])));
  REQUIRE(!ck->read_range<float>("weights", 0, whole));
  CHECK(std::equal(s1.params.begin(), s1.params.end(),
                   whole.begin() + static_cast<long>(split.offsets[1])));
  for (auto& st : (*c)->status(10s)) {
    REQUIRE(st);
    CHECK(st->step == 10);
    CHECK(st->mismatches == 0);
    CHECK(st->checked > 0);
  }

  // Position 1's stream ends (its rank died): position 0 runs on alone,
  // and its shadow is held at the last whole step.
  for (int k = 0; k < 3; ++k)
    step(s0, f0.get());
  std::this_thread::sleep_for(200ms);
  auto again = (*c)->flush(30s);
  REQUIRE(again);
  CHECK(*again == 10);
  for (auto& st : (*c)->status(10s)) {
    REQUIRE(st);
    CHECK(st->step == 10);
  }
  CHECK(f0->stats().refused == 0);

  stop = true;
  poller.join();
  f0.reset();
  f1.reset();
  c->reset();
  coord.stop();
  std::filesystem::remove_all(root);
}
