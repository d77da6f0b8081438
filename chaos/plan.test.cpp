#include "chaos/plan.hpp"

#include <doctest/doctest.h>

using namespace cmesh::chaos;

TEST_CASE("chaos plans: the text form parses, sorts by step and prints back") {
  auto p = parse_plan("stop@8:2:3000,kill@5:1,kill-source@9,hang@12:3,fault@14:0,fault@15:2:3", 4);
  REQUIRE(p);
  REQUIRE(p->size() == 6);
  CHECK((*p)[3] == action{action_kind::hang, 12, 3, 0});
  CHECK((*p)[4] == action{action_kind::fault, 14, 0, 0});
  CHECK((*p)[5] == action{action_kind::fault, 15, 2, 0, false, 3});
  CHECK((*p)[0] == action{action_kind::kill, 5, 1, 0});
  CHECK((*p)[1] == action{action_kind::stop, 8, 2, 3000});
  CHECK((*p)[2].kind == action_kind::kill_source);
  CHECK(to_string(*p) == "kill@5:1,stop@8:2:3000,kill-source@9,hang@12:3,fault@14:0,fault@15:2:3");
  auto again = parse_plan(to_string(*p), 4);
  REQUIRE(again);
  CHECK(*again == *p);
  // A trailing '?' makes a kill or a stop survivable.
  auto s = parse_plan("stop@8:2:3000?,kill@5:1?", 4);
  REQUIRE(s);
  CHECK((*s)[1] == action{action_kind::stop, 8, 2, 3000, true});
  CHECK((*s)[0] == action{action_kind::kill, 5, 1, 0, true});
  CHECK(to_string(*s) == "kill@5:1?,stop@8:2:3000?");
  // A flip: a bit of rank R's weights, never survivable-marked.
  auto f = parse_plan("flip@7:2", 4);
  REQUIRE(f);
  CHECK((*f)[0] == action{action_kind::flip, 7, 2, 0});
  CHECK(to_string(*f) == "flip@7:2");
  // A crash of rank R's trainer actor.
  auto x = parse_plan("crash@9:1", 4);
  REQUIRE(x);
  CHECK((*x)[0] == action{action_kind::crash, 9, 1, 0});
  CHECK(to_string(*x) == "crash@9:1");
  auto xs = parse_plan("crash-shadow@9:3", 4);
  REQUIRE(xs);
  CHECK((*xs)[0] == action{action_kind::crash_shadow, 9, 3, 0});
  CHECK(to_string(*xs) == "crash-shadow@9:3");
  // Every worker at once, and a byte of the newest checkpoint.
  auto k = parse_plan("corrupt@30,kill-all@20", 4);
  REQUIRE(k);
  CHECK((*k)[0] == action{action_kind::kill_all, 20, 0, 0});
  CHECK((*k)[1] == action{action_kind::corrupt, 30, 0, 0});
  CHECK(to_string(*k) == "kill-all@20,corrupt@30");
  CHECK(!parse_plan("kill-all@20:1", 4));
  auto c = parse_plan("kill-checkpointer@12", 4);
  REQUIRE(c);
  CHECK((*c)[0] == action{action_kind::kill_checkpointer, 12, 0, 0});
  CHECK(to_string(*c) == "kill-checkpointer@12");
  CHECK(!parse_plan("kill-checkpointer@12:0", 4));
  CHECK(!parse_plan("corrupt@x", 4));
  auto empty = parse_plan("", 4);
  REQUIRE(empty);
  CHECK(empty->empty());
}

TEST_CASE("chaos plans: bad actions are typed errors naming the action") {
  for (const char* bad : {"kill@5", "kill@x:1", "kill@5:9", "stop@5:1", "stop@5:1:0", "stop@5:1?:9",
                          "fault@3:1?", "kill@5?:1",
                          "boom@3:1", "kill5:1", "kill-source@3:1", "kill@5:1,", "hang@3",
                          "hang@3:7", "fault@3", "fault@3:9", "fault@3:1:0", "fault@3:1:101",
                          "fault@3:1:2:2", "flip@3", "flip@3:4", "flip@3:1?", "flip@3:1:2",
                          "crash@3", "crash@3:4", "crash@3:1?", "crash@3:1:2",
                          "crash-shadow@3", "crash-shadow@3:4"}) {
    auto p = parse_plan(bad, 4);
    CAPTURE(bad);
    REQUIRE_FALSE(p);
    CHECK(cmesh::code_of(p.error()) == cmesh::errc::invalid_argument);
  }
}

TEST_CASE("chaos plans: a seeded random plan is deterministic, distinct and in range") {
  auto a = random_plan(42, 2, 30, 4, {.kills = 5});
  auto b = random_plan(42, 2, 30, 4, {.kills = 5});
  auto c = random_plan(43, 2, 30, 4, {.kills = 5});
  CHECK(a == b);
  CHECK(a != c);
  REQUIRE(a.size() == 5);
  for (size_t i = 0; i < a.size(); ++i) {
    CHECK(a[i].at_step >= 2);
    CHECK(a[i].at_step <= 30);
    CHECK(a[i].rank < 4);
    if (i > 0)
      CHECK(a[i].at_step > a[i - 1].at_step);
  }
  CHECK(random_plan(1, 5, 6, 2, {.kills = 10}).size() == 2); // only two steps to pick from
  // Faults: at steps of their own; the kills stay those of the seed.
  auto f = random_plan(42, 2, 30, 4, {.kills = 5, .faults = 3});
  REQUIRE(f.size() == 8);
  std::vector<action> kills_of_f;
  size_t faults = 0;
  for (size_t i = 0; i < f.size(); ++i) {
    if (i > 0)
      CHECK(f[i].at_step > f[i - 1].at_step);
    if (f[i].kind == action_kind::kill)
      kills_of_f.push_back(f[i]);
    faults += f[i].kind == action_kind::fault ? 1 : 0;
  }
  CHECK(faults == 3);
  CHECK(kills_of_f == a);
  CHECK(random_plan(1, 5, 6, 2, {.kills = 1, .faults = 5}).size() == 2);
  auto fb = parse_plan(to_string(f), 4);
  REQUIRE(fb);
  CHECK(*fb == f);
  // Random kills are survivable, and say so in the text form.
  CHECK(a[0].survivable);
  auto back = parse_plan(to_string(a), 4);
  REQUIRE(back);
  CHECK(*back == a);
}

TEST_CASE("chaos plans: random stops take steps of their own, span the given lengths and leave "
          "the kills and faults of the seed alone") {
  const auto kf = random_plan(42, 2, 60, 4, {.kills = 5, .faults = 3});
  const random_counts draw{
    .kills = 5, .faults = 3, .stops = 12, .stop_min_ms = 750, .stop_max_ms = 3000};
  const auto p = random_plan(42, 2, 60, 4, draw);
  CHECK(p == random_plan(42, 2, 60, 4, draw));
  REQUIRE(p.size() == 20);
  std::vector<action> others;
  size_t stops = 0, short_ones = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    if (i > 0)
      CHECK(p[i].at_step > p[i - 1].at_step); // every action at a step of its own
    CHECK(p[i].at_step >= 2);
    CHECK(p[i].at_step <= 60);
    CHECK(p[i].rank < 4);
    if (p[i].kind != action_kind::stop) {
      others.push_back(p[i]);
      continue;
    }
    ++stops;
    CHECK(p[i].survivable);
    CHECK(p[i].stop_ms >= 750);
    CHECK(p[i].stop_ms <= 3000);
    short_ones += p[i].stop_ms < 1500 ? 1 : 0;
  }
  CHECK(stops == 12);
  CHECK(others == kf);
  // Twelve draws over [750, 3000]: both sides of a 1500 ms timeout (for
  // this seed; the draw is deterministic).
  CHECK(short_ones > 0);
  CHECK(short_ones < stops);
  auto back = parse_plan(to_string(p), 4);
  REQUIRE(back);
  CHECK(*back == p);
  // No room left: the stops give way.
  CHECK(random_plan(1, 5, 7, 2, {.kills = 1, .faults = 1, .stops = 5, .stop_min_ms = 10,
                                 .stop_max_ms = 20})
          .size()
        == 3);
  // A degenerate range is one length.
  for (auto& a : random_plan(3, 1, 40, 2, {.stops = 6, .stop_min_ms = 900, .stop_max_ms = 900}))
    CHECK(a.stop_ms == 900);
}

TEST_CASE("chaos plans: random hangs are survivable, at steps of their own, after the rest") {
  const random_counts before{
    .kills = 4, .faults = 2, .stops = 3, .stop_min_ms = 750, .stop_max_ms = 3000};
  auto with = before;
  with.hangs = 5;
  const auto a = random_plan(9, 2, 80, 4, before);
  const auto b = random_plan(9, 2, 80, 4, with);
  REQUIRE(b.size() == a.size() + 5);
  std::vector<action> rest;
  for (auto& x : b) {
    if (x.kind == action_kind::hang)
      CHECK(x.survivable);
    else
      rest.push_back(x);
  }
  CHECK(rest == a); // the hangs leave every other action of the seed alone
  auto back = parse_plan(to_string(b), 4);
  REQUIRE(back);
  CHECK(*back == b);
  CHECK(to_string(b).find("hang@") != std::string::npos);
  // Written by hand: "?" is allowed on a hang too, and kept.
  auto h = parse_plan("hang@7:2?", 4);
  REQUIRE(h);
  CHECK((*h)[0].survivable);
  CHECK(to_string(*h) == "hang@7:2?");
}
