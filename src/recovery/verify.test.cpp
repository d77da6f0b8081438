#include "recovery/verify.hpp"

#include <doctest/doctest.h>

#include <string>
#include <vector>

using namespace cmesh::recovery;

TEST_CASE("verify: replicas that agree, at one rank per group and several") {
  std::vector<uint32_t> groups{0, 1, 2};
  auto v = compare_replicas(groups, 1, std::vector<uint64_t>{7, 7, 7});
  CHECK(v.agree);
  CHECK(v.minority.empty());
  CHECK_FALSE(v.no_majority);
  CHECK(v.reason.empty());
  // Two positions: each position's hash is its own, the same in each group.
  auto w = compare_replicas(groups, 2, std::vector<uint64_t>{1, 2, 1, 2, 1, 2});
  CHECK(w.agree);
  // One group alone agrees with itself.
  CHECK(compare_replicas(std::vector<uint32_t>{4}, 2, std::vector<uint64_t>{5, 6}).agree);
}

TEST_CASE("verify: the group that differs from the majority is the minority") {
  std::vector<uint32_t> groups{0, 1, 2};
  auto v = compare_replicas(groups, 1, std::vector<uint64_t>{7, 9, 7});
  CHECK_FALSE(v.agree);
  CHECK_FALSE(v.no_majority);
  CHECK(v.minority == std::vector<uint32_t>{1});
  CHECK(v.positions == std::vector<uint32_t>{0});
  CHECK(v.reason == "shard 0: group 1 differs from the 2 of 3 groups that agree");
  // Groups in any order; the differing one named by id, at its position.
  std::vector<uint32_t> shuffled{5, 2, 8};
  auto w = compare_replicas(shuffled, 2, std::vector<uint64_t>{1, 2, 1, 3, 1, 2});
  CHECK(w.minority == std::vector<uint32_t>{2});
  CHECK(w.positions == std::vector<uint32_t>{1});
  // Two of five differ, at different positions: both are the minority.
  std::vector<uint32_t> five{0, 1, 2, 3, 4};
  auto x = compare_replicas(five, 2,
                            std::vector<uint64_t>{1, 2, 9, 2, 1, 2, 1, 8, 1, 2});
  CHECK(x.minority == std::vector<uint32_t>{1, 3});
  CHECK(x.reason == "shard 0: group 1 differs from the 4 of 5 groups that agree; "
                    "shard 1: group 3 differs from the 4 of 5 groups that agree");
  auto y = compare_replicas(five, 1, std::vector<uint64_t>{1, 2, 1, 2, 1});
  CHECK(y.minority == std::vector<uint32_t>{1, 3});
  CHECK(y.reason == "shard 0: groups 1,3 differ from the 3 of 5 groups that agree");
  CHECK(x.positions == std::vector<uint32_t>{0, 1});
  CHECK_FALSE(x.no_majority);
}

TEST_CASE("verify: no strict majority leaves nothing to trust") {
  // Two groups that differ: one against one.
  auto v = compare_replicas(std::vector<uint32_t>{0, 1}, 1, std::vector<uint64_t>{7, 9});
  CHECK_FALSE(v.agree);
  CHECK(v.no_majority);
  CHECK(v.minority.empty());
  CHECK(v.reason.find("no majority") != std::string::npos);
  CHECK(v.reason.find("g0 0000000000000007") != std::string::npos);
  CHECK(v.reason.find("g1 0000000000000009") != std::string::npos);
  // Two against two.
  CHECK(compare_replicas(std::vector<uint32_t>{0, 1, 2, 3}, 1,
                         std::vector<uint64_t>{1, 1, 2, 2})
          .no_majority);
  // Three that all differ.
  CHECK(compare_replicas(std::vector<uint32_t>{0, 1, 2}, 1, std::vector<uint64_t>{1, 2, 3})
          .no_majority);
  // A majority at one position does not rescue another that has none.
  auto w = compare_replicas(std::vector<uint32_t>{0, 1, 2, 3}, 2,
                            std::vector<uint64_t>{1, 5, 1, 5, 1, 6, 2, 6});
  CHECK(w.no_majority);
  CHECK(w.minority.empty());
}

TEST_CASE("verify: the segments that differ are named, at most a limit of them") {
  std::vector<std::string> names{"embed", "layer0.w", "layer0.b", "out"};
  std::vector<uint64_t> mine{1, 2, 3, 4}, theirs{1, 9, 3, 9};
  CHECK(differing_segments(names, mine, theirs) == "layer0.w, out");
  CHECK(differing_segments(names, mine, theirs, 1) == "layer0.w and 1 more");
  CHECK(differing_segments(names, mine, mine).empty());
}
