#include "recovery/health.hpp"

#include <doctest/doctest.h>

using namespace cmesh;
using namespace cmesh::recovery;

TEST_CASE("health: heartbeat silence makes a member suspect, then dead") {
  health_options o;
  o.heartbeat_timeout_ms = 800;
  o.suspect_fraction = 0.5;
  const int64_t now = 10'000;
  auto at = [&](int64_t silence) {
    return assess({{2, 5}, now - silence, 17}, now, o);
  };
  CHECK(at(0).state == health::healthy);
  CHECK(at(400).state == health::healthy); // not more than half the timeout
  CHECK(at(401).state == health::suspect);
  CHECK(at(800).state == health::suspect); // not more than the timeout
  CHECK(at(801).state == health::dead);
  CHECK(at(-50).state == health::healthy); // stamped after now: silence 0
  auto d = at(900);
  CHECK(d.who == member{2, 5});
  CHECK(d.reason == "g2#5 dead: last heartbeat 900 ms ago, step 17 (timeout 800 ms)");
  CHECK(at(500).reason == "g2#5 suspect: last heartbeat 500 ms ago, step 17 (suspect after 400 ms)");
  CHECK(heartbeat_expired(0, 801, 800));
  CHECK_FALSE(heartbeat_expired(0, 800, 800));
}

TEST_CASE("health: a newer incarnation supersedes the old one; the step watchdog") {
  health_options o;
  o.heartbeat_timeout_ms = 1000;
  o.max_step_lag = 3;
  const int64_t now = 5'000;
  std::vector<member_report> rs = {
    {{1, 2}, now - 10, 40}, // restarted group 1, catching up: behind, but new
    {{0, 1}, now - 10, 50},
    {{1, 1}, now - 10, 50}, // old incarnation, still heartbeating
    {{2, 1}, now - 10, 46}, // 4 behind
    {{3, 1}, now - 2000, 10},
  };
  auto hs = assess_all(rs, now, o);
  REQUIRE(hs.size() == 5);
  // sorted by (group, incarnation)
  CHECK(hs[0].who == member{0, 1});
  CHECK(hs[0].state == health::healthy);
  CHECK(hs[1].who == member{1, 1});
  CHECK(hs[1].state == health::dead);
  CHECK(hs[1].reason == "g1#1 dead: superseded by incarnation 2");
  CHECK(hs[2].who == member{1, 2});
  CHECK(hs[2].state == health::suspect); // 10 behind
  CHECK(hs[3].who == member{2, 1});
  CHECK(hs[3].state == health::suspect);
  CHECK(hs[3].reason == "g2#1 suspect: at step 46, 4 steps behind step 50 (max_step_lag 3)");
  CHECK(hs[4].state == health::dead); // its old step does not count
}

TEST_CASE("health: options are validated") {
  CHECK_FALSE(validate(health_options{}));
  CHECK(code_of(validate(health_options{0, 0.5, 0})) == errc::invalid_argument);
  CHECK(code_of(validate(health_options{800, 0.0, 0})) == errc::invalid_argument);
  CHECK(code_of(validate(health_options{800, 1.5, 0})) == errc::invalid_argument);
  CHECK(code_of(validate(health_options{800, 1.0, -1})) == errc::invalid_argument);
  CHECK_FALSE(validate(health_options{800, 1.0, 0}));
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
