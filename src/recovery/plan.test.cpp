#include "recovery/plan.hpp"

#include <doctest/doctest.h>

#include <map>

using namespace cmesh;
using namespace cmesh::recovery;

TEST_CASE("plan: one joiner's shards round-robin over the healthy groups, sorted by id") {
  const std::vector<group_id> healthy = {5, 1, 3}; // any order
  auto p = plan_recovery(healthy, joiner_shards{2, {}}, 7);
  REQUIRE(p);
  REQUIRE(p->sources.size() == 7);
  const group_id expect[] = {1, 3, 5, 1, 3, 5, 1};
  for (uint32_t s = 0; s < 7; ++s) {
    CHECK(p->sources[s].joiner == 2);
    CHECK(p->sources[s].shard == s);
    CHECK(p->sources[s].source == expect[s]);
  }
  CHECK(p->reason == "7 shard copies for joiner groups [2] round-robin over healthy groups [1 3 5]");
  // Same inputs in another order: same plan.
  const std::vector<group_id> again = {3, 5, 1, 3};
  auto q = plan_recovery(again, joiner_shards{2, {6, 0, 1, 2, 3, 4, 5}}, 7);
  REQUIRE(q);
  CHECK(q->sources == p->sources);
}

TEST_CASE("plan: several joiners continue the rotation, so every source carries its share") {
  const std::vector<group_id> healthy = {0, 1};
  const std::vector<joiner_shards> joiners = {{7, {1, 3}}, {4, {}}};
  // shard 3 >= shard_count 3
  auto bad = plan_recovery(healthy, joiners, 3);
  REQUIRE_FALSE(bad);
  CHECK(code_of(bad.error()) == errc::invalid_argument);
  auto ok = plan_recovery(healthy, joiners, 4);
  REQUIRE(ok);
  const std::vector<shard_source> expect4 = {
    {4, 0, 0}, {4, 1, 1}, {4, 2, 0}, {4, 3, 1}, {7, 1, 0}, {7, 3, 1},
  };
  CHECK(ok->sources == expect4);
  std::map<group_id, int> per_source;
  for (const auto& s : ok->sources)
    ++per_source[s.source];
  CHECK(per_source[0] == 3);
  CHECK(per_source[1] == 3);
}

TEST_CASE("plan: bad inputs are errors") {
  const std::vector<group_id> none;
  const std::vector<group_id> healthy = {0, 1};
  CHECK(code_of(plan_recovery(none, joiner_shards{2, {}}, 4).error()) == errc::invalid_argument);
  CHECK(code_of(plan_recovery(healthy, joiner_shards{2, {}}, 0).error()) == errc::invalid_argument);
  CHECK(code_of(plan_recovery(healthy, joiner_shards{1, {}}, 4).error()) == errc::invalid_argument);
  const std::vector<joiner_shards> twice = {{2, {0}}, {2, {1}}};
  CHECK(code_of(plan_recovery(healthy, twice, 4).error()) == errc::invalid_argument);
}

TEST_CASE("plan: a rotation shifts the start, so one joiner at a time still rotates") {
  std::vector<group_id> healthy{0, 1, 2};
  joiner_shards j{3, {1}};
  std::vector<group_id> got;
  for (uint64_t rot = 0; rot < 4; ++rot) {
    auto p = plan_recovery(healthy, j, 2, rot);
    REQUIRE(p);
    REQUIRE(p->sources.size() == 1);
    got.push_back(p->sources[0].source);
  }
  CHECK(got == std::vector<group_id>{0, 1, 2, 0});
  // Several pairs continue from the shifted start.
  std::vector<joiner_shards> two{{3, {0, 1}}, {4, {0}}};
  auto p = plan_recovery(healthy, two, 2, 2);
  REQUIRE(p);
  CHECK(p->sources == std::vector<shard_source>{{3, 0, 2}, {3, 1, 0}, {4, 0, 1}});
}
