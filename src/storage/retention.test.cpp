#include "storage/retention.hpp"

#include <doctest/doctest.h>

#include <vector>

using namespace cmesh::storage;
using steps = std::vector<uint64_t>;

TEST_CASE("storage: retention keeps the newest N and every M-th step") {
  steps all{100, 20, 40, 60, 80, 120, 140};
  // The newest two, and the multiples of 50 (100); the rest go, ascending.
  CHECK(retention_plan(all, 2, 50) == steps{20, 40, 60, 80});
  // keep_every 0: only the newest N.
  CHECK(retention_plan(all, 3, 0) == steps{20, 40, 60, 80});
  // Every M-th older one kept.
  CHECK(retention_plan(all, 1, 40) == steps{20, 60, 100});
  // Fewer steps than N: nothing to delete.
  CHECK(retention_plan(all, 10, 0).empty());
  CHECK(retention_plan(steps{}, 2, 10).empty());
  // The newest is kept even when asked to keep none; repeats count once.
  CHECK(retention_plan(steps{5, 7, 7, 9}, 0, 0) == steps{5, 7});
  // Step 0 is a multiple of everything: kept with any keep_every.
  CHECK(retention_plan(steps{0, 10, 20}, 1, 1000) == steps{10});
}
