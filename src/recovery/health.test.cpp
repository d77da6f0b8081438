#include "recovery/health.hpp"

#include <doctest/doctest.h>

#include <vector>

using namespace cmesh;
using namespace cmesh::recovery;

TEST_CASE("health: silence longer than the timeout is death") {
  CHECK(heartbeat_expired(0, 801, 800));
  CHECK_FALSE(heartbeat_expired(0, 800, 800));
  CHECK_FALSE(heartbeat_expired(1000, 900, 800)); // stamped after now
}

TEST_CASE("health: every connected member silent at once is credited, for a while") {
  const int64_t now = 10'000, timeout = 800, patience = 8000;
  // One of them heard: the silent one's silence is its own.
  std::vector<int64_t> one_heard{now - 900, now - 50};
  CHECK_FALSE(credit_when_all_silent(one_heard, now, timeout, 0, patience));
  // All silent: credited with now - timeout, so none expires this tick.
  std::vector<int64_t> all{now - 3000, now - 2900};
  auto c = credit_when_all_silent(all, now, timeout, 0, patience);
  REQUIRE(c);
  CHECK(*c == now - timeout);
  CHECK_FALSE(heartbeat_expired(*c, now, timeout));
  // Still within the patience since the silence of all began.
  CHECK(credit_when_all_silent(all, now, timeout, now - patience + 1, patience));
  // Past it: they are silent for real.
  CHECK_FALSE(credit_when_all_silent(all, now, timeout, now - patience, patience));
  // Nobody connected: nothing to credit.
  CHECK_FALSE(credit_when_all_silent({}, now, timeout, 0, patience));
}
