#include "recovery/quorum.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <random>

using namespace cmesh;
using namespace cmesh::recovery;

namespace {

constexpr int64_t timeout = 800;

quorum_options opts(uint32_t min_replicas = 1, int64_t window = 500) {
  quorum_options o;
  o.min_replicas = min_replicas;
  o.join_window_ms = window;
  o.heartbeat_timeout_ms = timeout;
  return o;
}

epoch make_epoch(uint64_t id, std::vector<member> ms) {
  return {id, std::move(ms)};
}

/// A participant last heard `silence` ms before `now`, registered at `joined`.
participant hb(member m, int64_t now, int64_t silence = 10, int64_t joined = 0) {
  participant p;
  p.who = m;
  p.last_heartbeat_ms = now - silence;
  p.joined_ms = joined;
  return p;
}

} // namespace

TEST_CASE("quorum: fast path keeps the epoch without waiting") {
  const int64_t now = 10'000;
  quorum_state s;
  s.current = make_epoch(3, {{0, 1}, {1, 1}, {2, 1}});
  s.participants = {hb({2, 1}, now), hb({0, 1}, now, 700), hb({1, 1}, now)};
  auto d = compute_quorum(s, now, opts(2));
  CHECK(d.kind == decision_kind::keep);
  CHECK_FALSE(d.changed);
  CHECK(d.epoch == s.current);
  CHECK(d.reason == "epoch 3: all 3 groups live, nobody joining");
  CHECK_FALSE(d.retry_at_ms);
  CHECK(d.joined.empty());
  CHECK(d.left.empty());
  CHECK(d.pending.empty());
}

TEST_CASE("quorum: a dead group leaves; survivors form the next epoch, sorted") {
  const int64_t now = 10'000;
  quorum_state s;
  s.current = make_epoch(3, {{0, 1}, {1, 1}, {2, 1}, {3, 1}});
  s.participants = {hb({3, 1}, now), hb({1, 1}, now, timeout + 1), hb({2, 1}, now), hb({0, 1}, now)};
  auto d = compute_quorum(s, now, opts(2));
  CHECK(d.kind == decision_kind::new_epoch);
  CHECK(d.changed);
  CHECK(d.epoch == make_epoch(4, {{0, 1}, {2, 1}, {3, 1}}));
  CHECK(d.left == std::vector<member>{{1, 1}});
  CHECK(d.joined.empty());
  CHECK(d.reason == "epoch 4 [g0#1 g2#1 g3#1] replaces epoch 3; lost g1#1 (silent since t=9199 ms)");

  // Exactly at the timeout it is still alive.
  s.participants[1] = hb({1, 1}, now, timeout);
  CHECK(compute_quorum(s, now, opts(2)).kind == decision_kind::keep);

  // A group the coordinator stopped hearing from altogether is lost too.
  s.participants.erase(s.participants.begin() + 1);
  auto gone = compute_quorum(s, now, opts(2));
  CHECK(gone.kind == decision_kind::new_epoch);
  CHECK(gone.epoch.members == std::vector<member>{{0, 1}, {2, 1}, {3, 1}});
  CHECK(gone.reason.find("g1#1 (not reported)") != std::string::npos);
}

TEST_CASE("quorum: a restarted group is a new member: old incarnation out, new one after the window") {
  quorum_state s;
  s.current = make_epoch(7, {{0, 1}, {1, 1}, {2, 1}, {3, 1}});
  // Group 2 restarted as incarnation 2 at t=1000; the old one may still be
  // heard for a moment.
  auto at = [&](int64_t now) {
    s.participants = {hb({0, 1}, now), hb({1, 1}, now), hb({2, 1}, now), hb({3, 1}, now),
                      hb({2, 2}, now, 10, 1000)};
    return compute_quorum(s, now, opts(2, 500));
  };

  auto d = at(1100);
  CHECK(d.kind == decision_kind::new_epoch);
  CHECK(d.epoch == make_epoch(8, {{0, 1}, {1, 1}, {3, 1}}));
  CHECK(d.left == std::vector<member>{{2, 1}});
  CHECK(d.pending == std::vector<member>{{2, 2}});
  REQUIRE(d.retry_at_ms);
  CHECK(*d.retry_at_ms == 1500);
  CHECK(d.reason == "epoch 8 [g0#1 g1#1 g3#1] replaces epoch 7; lost g2#1 (superseded by g2#2); "
                    "joining [g2#2] wait for the join window until t=1500 ms");

  s.current = d.epoch;
  auto k = at(1499);
  CHECK(k.kind == decision_kind::keep); // the survivors' epoch trains on
  CHECK(k.pending == std::vector<member>{{2, 2}});
  CHECK(k.reason == "epoch 8 kept: joining [g2#2] wait for the join window until t=1500 ms");

  auto j = at(1500);
  CHECK(j.kind == decision_kind::new_epoch);
  CHECK(j.epoch == make_epoch(9, {{0, 1}, {1, 1}, {2, 2}, {3, 1}}));
  CHECK(j.joined == std::vector<member>{{2, 2}});
  CHECK(j.left.empty());
  CHECK(j.pending.empty());

  // Once in, the new incarnation is a member: fast path again, and the old
  // incarnation's lingering heartbeats are stale and ignored.
  s.current = j.epoch;
  CHECK(at(1600).kind == decision_kind::keep);
}

TEST_CASE("quorum: two joiners within the window join in one epoch") {
  quorum_state s;
  s.current = make_epoch(2, {{0, 1}, {1, 1}});
  auto at = [&](int64_t now) {
    s.participants = {hb({0, 1}, now), hb({1, 1}, now), hb({3, 1}, now, 10, 1300),
                      hb({2, 4}, now, 10, 1000)};
    return compute_quorum(s, now, opts(1, 500));
  };
  auto wait = at(1400);
  CHECK(wait.kind == decision_kind::keep);
  CHECK(wait.pending == std::vector<member>{{2, 4}, {3, 1}});
  CHECK(*wait.retry_at_ms == 1500); // from the earliest pending join
  auto d = at(1500);
  CHECK(d.kind == decision_kind::new_epoch);
  CHECK(d.epoch == make_epoch(3, {{0, 1}, {1, 1}, {2, 4}, {3, 1}}));
  CHECK(d.joined == std::vector<member>{{2, 4}, {3, 1}});

  // With the job's group count known, the window closes once all are in.
  s.expected_groups = 4;
  auto early = at(1310);
  CHECK(early.kind == decision_kind::new_epoch);
  CHECK(early.epoch == d.epoch);
}

TEST_CASE("quorum: the first epoch forms from the joiners") {
  quorum_state s; // id 0, no members
  s.expected_groups = 3;
  CHECK(compute_quorum(s, 0, opts()).kind == decision_kind::wait);
  s.participants = {hb({1, 1}, 100, 0, 100)};
  auto one = compute_quorum(s, 100, opts(1, 1000));
  CHECK(one.kind == decision_kind::wait);
  CHECK(one.reason == "no majority: 1 of 3 groups live [g1#1]; waiting (a minority must not go on alone)");
  s.participants = {hb({1, 1}, 200, 0, 100), hb({0, 1}, 200, 0, 150)};
  auto two = compute_quorum(s, 200, opts(1, 1000));
  CHECK(two.kind == decision_kind::wait); // a majority, but the window is open
  CHECK(*two.retry_at_ms == 1100);
  s.participants.push_back(hb({2, 1}, 200, 0, 200));
  auto all = compute_quorum(s, 200, opts(1, 1000));
  CHECK(all.kind == decision_kind::new_epoch);
  CHECK(all.epoch == make_epoch(1, {{0, 1}, {1, 1}, {2, 1}}));
}

TEST_CASE("quorum: the majority is over the groups heard from, not the dead") {
  const int64_t now = 50'000;
  quorum_state s;
  s.current = make_epoch(5, {{0, 1}, {1, 1}, {2, 1}, {3, 1}});
  s.participants = {hb({0, 1}, now), hb({1, 1}, now), hb({2, 1}, now, 5000), hb({3, 1}, now, 5000)};
  // Two of four died: the two survivors are all the groups heard from.
  auto d = compute_quorum(s, now, opts(2));
  CHECK(d.kind == decision_kind::new_epoch);
  CHECK(d.epoch == make_epoch(6, {{0, 1}, {1, 1}}));
  CHECK(d.left == std::vector<member>{{2, 1}, {3, 1}});
  // ... unless the dead are already back and catching up: 2 of 4 heard from
  // is no majority, wait for them.
  s.heard_not_ready = 2;
  auto w = compute_quorum(s, now, opts(2));
  CHECK(w.kind == decision_kind::wait);
  CHECK_FALSE(w.changed);
  CHECK(w.epoch == s.current);
  CHECK(w.reason == "no majority: 2 of 4 groups live [g0#1 g1#1]; lost g2#1 (silent since t=45000 ms), "
                    "g3#1 (silent since t=45000 ms); waiting (a minority must not go on alone)");
  // 2 of 3 heard from is a majority.
  s.heard_not_ready = 1;
  CHECK(compute_quorum(s, now, opts(2)).kind == decision_kind::new_epoch);
  // Two groups of two: one dies, the other goes on alone (min_replicas 1).
  quorum_state two;
  two.current = make_epoch(1, {{0, 1}, {1, 1}});
  two.participants = {hb({0, 1}, now), hb({1, 1}, now, 5000)};
  auto alone = compute_quorum(two, now, opts(1));
  CHECK(alone.kind == decision_kind::new_epoch);
  CHECK(alone.epoch == make_epoch(2, {{0, 1}}));
}

TEST_CASE("quorum: min_replicas not met: wait while someone joins, else fail") {
  const int64_t now = 20'000;
  quorum_state s;
  s.current = make_epoch(4, {{0, 1}, {1, 1}, {2, 1}});
  s.participants = {hb({0, 1}, now), hb({1, 1}, now), hb({2, 1}, now, 900)};
  auto f = compute_quorum(s, now, opts(3));
  CHECK(f.kind == decision_kind::fail);
  CHECK(f.reason == "only 2 live groups [g0#1 g1#1], min_replicas 3 and none joining; lost g2#1 "
                    "(silent since t=19100 ms); restart from checkpoint needed");
  CHECK(f.left == std::vector<member>{{2, 1}});

  // Group 1 died too, but is restarting: wait for it.
  s.participants = {hb({0, 1}, now), hb({1, 1}, now, 900), hb({2, 1}, now, 900),
                    hb({1, 2}, now, 10, now - 100)};
  auto w = compute_quorum(s, now, opts(3));
  CHECK(w.kind == decision_kind::wait);
  CHECK(w.reason.find("min_replicas 3, joining [g1#2]") != std::string::npos);
  CHECK(w.reason.find("waiting for more groups") != std::string::npos);

  // With min_replicas 2 the survivor and the joiner are enough, and the
  // lone survivor is not: the epoch forms at once with the joiner, not at
  // the join window's close (the survivor is stalled until it forms).
  auto before = compute_quorum(s, now, opts(2, 500));
  CHECK(before.kind == decision_kind::new_epoch);
  CHECK(before.epoch == make_epoch(5, {{0, 1}, {1, 2}}));
  CHECK(before.joined == std::vector<member>{{1, 2}});
  CHECK(before.pending.empty());
  CHECK(before.reason.find("joining [g1#2] admitted at once") != std::string::npos);
  auto after = compute_quorum(s, now + 400, opts(2, 500));
  CHECK(after.kind == decision_kind::new_epoch);
  CHECK(after.epoch == before.epoch);
}

TEST_CASE("quorum: a loss that leaves no majority admits the ready joiners at once; one that "
          "leaves a majority forms without them and keeps the window") {
  const int64_t now = 10'000;
  quorum_state s;
  s.current = make_epoch(3, {{0, 1}, {1, 1}});
  // g2 (a restarted group) is ready since t=9900 (the window runs to
  // 10400), and g0 dies now: the lone survivor g1 is 1 of 2 groups heard
  // from (g1, g2), no majority alone; with g2 it is.
  s.participants = {hb({0, 1}, now, 2000), hb({1, 1}, now), hb({2, 1}, now, 10, now - 100)};
  auto d = compute_quorum(s, now, opts(1, 500));
  CHECK(d.kind == decision_kind::new_epoch);
  CHECK(d.epoch == make_epoch(4, {{1, 1}, {2, 1}}));
  CHECK(d.left == std::vector<member>{{0, 1}});
  CHECK(d.joined == std::vector<member>{{2, 1}});
  CHECK_FALSE(d.retry_at_ms);
  // Three members, one lost: the two survivors are a majority of the three
  // heard from (with the joiner); they go on alone and the joiner waits
  // for the window, as before.
  s.current = make_epoch(3, {{0, 1}, {1, 1}, {3, 1}});
  s.participants.push_back(hb({3, 1}, now));
  auto m = compute_quorum(s, now, opts(1, 500));
  CHECK(m.kind == decision_kind::new_epoch);
  CHECK(m.epoch == make_epoch(4, {{1, 1}, {3, 1}}));
  CHECK(m.pending == std::vector<member>{{2, 1}});
  REQUIRE(m.retry_at_ms);
  CHECK(*m.retry_at_ms == now + 400);
}

TEST_CASE("quorum: every group dead: fail, restart from checkpoint") {
  const int64_t now = 30'000;
  quorum_state s;
  s.current = make_epoch(9, {{0, 3}, {1, 2}});
  s.participants = {hb({0, 3}, now, 1000), hb({1, 2}, now, 2000)};
  auto d = compute_quorum(s, now, opts());
  CHECK(d.kind == decision_kind::fail);
  CHECK(d.reason == "every replica group of epoch 9 is dead: g0#3 (silent since t=29000 ms), g1#2 "
                    "(silent since t=28000 ms); restart from checkpoint needed");
  // Where the caller knows how a member died, the reason says so.
  s.participants[0].lost_reason = "rank 0 disconnected at t=29000 ms";
  auto told = compute_quorum(s, now, opts());
  CHECK(told.reason == "every replica group of epoch 9 is dead: g0#3 (rank 0 disconnected at "
                       "t=29000 ms), g1#2 (silent since t=28000 ms); restart from checkpoint "
                       "needed");
  // A live member's reason is never read.
  s.participants = {hb({0, 3}, now), hb({1, 2}, now)};
  s.participants[0].lost_reason = "stale";
  CHECK(compute_quorum(s, now, opts()).kind == decision_kind::keep);
  s.participants.clear();
  CHECK(compute_quorum(s, now, opts()).kind == decision_kind::fail);
}

TEST_CASE("quorum: stale incarnations are ignored") {
  const int64_t now = 1000;
  quorum_state s;
  s.current = make_epoch(2, {{0, 5}, {1, 5}});
  s.participants = {hb({0, 5}, now), hb({1, 5}, now), hb({1, 4}, now, 0, 0)};
  CHECK(compute_quorum(s, now, opts()).kind == decision_kind::keep);
}

TEST_CASE("quorum: the decision does not depend on the participants' order") {
  const int64_t now = 5000;
  quorum_state s;
  s.current = make_epoch(11, {{0, 1}, {1, 1}, {2, 1}, {3, 1}, {4, 1}});
  s.participants = {hb({0, 1}, now),          hb({1, 1}, now, 2000), hb({2, 1}, now),
                    hb({3, 1}, now),          hb({4, 1}, now),       hb({1, 2}, now, 0, 4000),
                    hb({6, 1}, now, 0, 4200), hb({5, 1}, now, 0, 4900)};
  const auto o = opts(2, 1000);
  const auto ref = compute_quorum(s, now, o);
  CHECK(ref.kind == decision_kind::new_epoch);
  CHECK(ref.epoch == make_epoch(12, {{0, 1}, {1, 2}, {2, 1}, {3, 1}, {4, 1}, {5, 1}, {6, 1}}));
  std::mt19937 rng(42);
  for (int i = 0; i < 50; ++i) {
    std::shuffle(s.participants.begin(), s.participants.end(), rng);
    const auto d = compute_quorum(s, now, o);
    CHECK(d.kind == ref.kind);
    CHECK(d.epoch == ref.epoch);
    CHECK(d.reason == ref.reason);
    CHECK(d.joined == ref.joined);
  }
}

TEST_CASE("quorum: reason_changed logs a situation once") {
  quorum_state s;
  s.current = make_epoch(1, {{0, 1}, {1, 1}, {2, 1}, {3, 1}});
  quorum_decision logged; // nothing logged yet
  int logs = 0;
  for (int64_t now = 10'000; now < 12'000; now += 100) {
    // Groups 2 and 3 went silent at t=9000 and two groups are catching up:
    // no majority, tick after tick.
    s.heard_not_ready = 2;
    s.participants = {hb({0, 1}, now), hb({1, 1}, now), hb({2, 1}, 9000, 0), hb({3, 1}, 9000, 0)};
    auto d = compute_quorum(s, now, opts(2));
    CHECK(d.kind == decision_kind::wait);
    if (reason_changed(logged, d)) {
      ++logs;
      logged = d;
    }
  }
  CHECK(logs == 1);
  // Group 2 comes back as a new incarnation: the situation, and the reason, change.
  s.participants.push_back(hb({2, 2}, 12'000, 0, 12'000));
  auto d = compute_quorum(s, 12'000, opts(2));
  CHECK(reason_changed(logged, d));
}

TEST_CASE("quorum: options are validated") {
  CHECK_FALSE(validate(quorum_options{}));
  CHECK(code_of(validate(quorum_options{0, 0, 800})) == errc::invalid_argument);
  CHECK(code_of(validate(quorum_options{1, -1, 800})) == errc::invalid_argument);
  CHECK(code_of(validate(quorum_options{1, 0, 0})) == errc::invalid_argument);
}

namespace {

/// A live member that reported the current epoch broken at `since`.
participant broke(member m, int64_t now, int64_t since, std::string why = "injected fault") {
  auto p = hb(m, now);
  p.broken_since_ms = since;
  p.broken_reason = std::move(why);
  return p;
}

} // namespace

TEST_CASE("quorum: an epoch broken while every member lives is re-formed after the grace") {
  const int64_t now = 10'000;
  quorum_state s;
  s.current = make_epoch(5, {{0, 1}, {1, 1}, {2, 1}});
  auto o = opts(1);
  o.broken_grace_ms = 500;

  SUBCASE("within the grace: kept, with the time it is due") {
    s.participants = {hb({0, 1}, now), broke({1, 1}, now, now - 100), hb({2, 1}, now)};
    auto d = compute_quorum(s, now, o);
    CHECK(d.kind == decision_kind::keep);
    CHECK_FALSE(d.changed);
    REQUIRE(d.retry_at_ms);
    CHECK(*d.retry_at_ms == now + 400);
    CHECK(d.reason.find("epoch 5 broke at g1#1 (injected fault)") != std::string::npos);
    // The same situation a tick later gives the same text (nothing to log).
    CHECK_FALSE(reason_changed(d, compute_quorum(s, now + 50, o)));
  }
  SUBCASE("past the grace: the same members in a new epoch that aborts the running one") {
    s.participants = {hb({0, 1}, now), broke({1, 1}, now, now - 500, "a collective timed out"),
                      broke({2, 1}, now, now - 20)};
    auto d = compute_quorum(s, now, o);
    CHECK(d.kind == decision_kind::new_epoch);
    CHECK(d.reform);
    CHECK(d.abort_running);
    CHECK(d.epoch == make_epoch(6, s.current.members));
    CHECK(d.joined.empty());
    CHECK(d.left.empty());
    CHECK(d.reason.find("epoch 5 broke at g1#1 (a collective timed out), g2#1 (injected fault)")
          != std::string::npos);
    CHECK(d.reason.find("re-formed") != std::string::npos);
  }
  SUBCASE("a death explains it: the survivors' epoch as usual, aborting the running one") {
    s.participants = {hb({0, 1}, now), broke({1, 1}, now, now - 10), hb({2, 1}, now, timeout + 1)};
    auto d = compute_quorum(s, now, o);
    CHECK(d.kind == decision_kind::new_epoch);
    CHECK_FALSE(d.reform);
    CHECK(d.abort_running);
    CHECK(d.epoch == make_epoch(6, {{0, 1}, {1, 1}}));
    CHECK(d.left == std::vector<member>{{2, 1}});
  }
  SUBCASE("joiners in an open window stay pending while the broken epoch is re-formed") {
    s.participants = {hb({0, 1}, now), broke({1, 1}, now, now - 600), hb({2, 1}, now),
                      hb({3, 1}, now, 10, now - 100)};
    auto d = compute_quorum(s, now, o);
    CHECK(d.kind == decision_kind::new_epoch);
    CHECK(d.reform);
    CHECK(d.epoch == make_epoch(6, s.current.members));
    CHECK(d.pending == std::vector<member>{{3, 1}});
  }
  SUBCASE("a report by a member that is not a survivor counts for nothing") {
    // Group 1's old incarnation broke; its new incarnation supersedes it.
    auto old = broke({1, 1}, now, now - 600);
    old.last_heartbeat_ms = now - timeout - 1;
    s.participants = {hb({0, 1}, now), old, hb({2, 1}, now)};
    auto d = compute_quorum(s, now, o);
    CHECK(d.kind == decision_kind::new_epoch);
    CHECK_FALSE(d.reform);
    CHECK_FALSE(d.abort_running);
    CHECK(d.left == std::vector<member>{{1, 1}});
  }
  SUBCASE("too many re-forms in a row: a clear failure") {
    s.participants = {hb({0, 1}, now), broke({1, 1}, now, now - 600), hb({2, 1}, now)};
    s.reforms_in_a_row = 3;
    o.max_reforms = 3;
    auto d = compute_quorum(s, now, o);
    CHECK(d.kind == decision_kind::fail);
    CHECK(d.reason.find("re-formed 3 times in a row with no step committed") != std::string::npos);
    CHECK(d.reason.find("restart from checkpoint needed") != std::string::npos);
    s.reforms_in_a_row = 2;
    CHECK(compute_quorum(s, now, o).kind == decision_kind::new_epoch);
  }
  SUBCASE("a negative grace is a bad option") {
    o.broken_grace_ms = -1;
    CHECK(code_of(validate(o)) == errc::invalid_argument);
  }
}
