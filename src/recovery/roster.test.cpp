#include "recovery/roster.hpp"

#include "recovery/health.hpp"

#include <doctest/doctest.h>

using namespace cmesh;
using namespace cmesh::recovery;

namespace {

constexpr int64_t now = 100'000;
constexpr int64_t timeout = 1500;

/// A rank of incarnation `inc`, connected, heard `ago` ms before now, at
/// `step`, training.
rank_report live(incarnation_id inc, int64_t ago = 10, uint64_t step = 40) {
  rank_report w;
  w.incarnation = inc;
  w.connected = true;
  w.last_heartbeat_ms = now - ago;
  w.has_status = true;
  w.step = step;
  return w;
}

/// A rank caught up and following its source since `since`.
rank_report ready(incarnation_id inc, int64_t since) {
  auto w = live(inc);
  w.ready_since_ms = since;
  return w;
}

/// 2x2 (groups 0 and 1, S = 2), both groups members of epoch 3 with
/// incarnation 1 on every rank.
struct two_by_two {
  roster r{{0, live(1)}, {1, live(1)}, {2, live(1)}, {3, live(1)}};
  epoch e{3, {{0, 1}, {1, 1}}};
  member_ranks m = incarnations_of(ranks_of_members(e.members, 2), r);
  group_options o{.ranks_per_group = 2, .heartbeat_timeout_ms = timeout};
};

} // namespace

TEST_CASE("roster: the ranks of groups and members") {
  CHECK(ranks_of_groups({0, 2}, 3) == std::vector<uint32_t>{0, 1, 2, 6, 7, 8});
  CHECK(ranks_of_members({{1, 4}}, 2) == std::vector<uint32_t>{2, 3});
  roster r{{0, live(7)}};
  CHECK(incarnations_of({0, 1}, r) == member_ranks{{0, 7}, {1, 0}});
}

TEST_CASE("roster: death by silence takes only attached members silent past the timeout") {
  two_by_two t;
  CHECK(silent_members(t.r, t.m, now, timeout).empty());
  t.r[1].last_heartbeat_ms = now - timeout - 1; // silent past the timeout
  t.r[2].last_heartbeat_ms = now - timeout;     // exactly the timeout: alive
  CHECK(silent_members(t.r, t.m, now, timeout) == std::vector<uint32_t>{1});
  // Already found dead, disconnected, or restarted (a new incarnation):
  // not found dead again by silence.
  t.r[1].lost = true;
  t.r[3] = live(2, 5000);
  t.r[0].connected = false;
  t.r[0].last_heartbeat_ms = now - 5000;
  CHECK(silent_members(t.r, t.m, now, timeout).empty());
  CHECK_FALSE(attached_member(t.r, t.m, 3));
  CHECK(attached_member(t.r, t.m, 2));
  CHECK_FALSE(attached_member(t.r, t.m, 9)); // not a member
}

TEST_CASE("roster: a peer's report of a lost rank is believed only when the coordinator agrees") {
  two_by_two t;
  constexpr int64_t corroborate = 500;
  using v = peer_report_verdict;
  // Heard from 10 ms ago: a slow peer or a broken link between workers.
  CHECK(weigh_peer_report(t.r, t.m, 3, 1, 1, now, corroborate) == v::heard_from);
  // Silent for the corroboration bound (well under the heartbeat timeout).
  t.r[1].last_heartbeat_ms = now - corroborate;
  CHECK(weigh_peer_report(t.r, t.m, 3, 1, 1, now, corroborate) == v::lost);
  // Its connection closed: believed however recent its last beacon.
  t.r[2].connected = false;
  CHECK(weigh_peer_report(t.r, t.m, 3, 2, 1, now, corroborate) == v::lost);
  // Found dead already; another incarnation; not a member at all.
  t.r[1].lost = true;
  CHECK(weigh_peer_report(t.r, t.m, 3, 1, 1, now, corroborate) == v::known);
  CHECK(weigh_peer_report(t.r, t.m, 3, 3, 2, now, corroborate) == v::not_member);
  t.r[0] = live(2);
  CHECK(weigh_peer_report(t.r, t.m, 3, 0, 1, now, corroborate) == v::not_member);
  CHECK(weigh_peer_report(t.r, t.m, 3, 9, 1, now, corroborate) == v::not_member);
  // A reporter that is not an attached member itself is not heard (a
  // process resumed after SIGSTOP finds everyone silent).
  t.r[2] = live(1);
  t.r[2].last_heartbeat_ms = now - corroborate;
  t.r[3].lost = true;
  CHECK(weigh_peer_report(t.r, t.m, 3, 2, 1, now, corroborate) == v::stale_reporter);
  CHECK(weigh_peer_report(t.r, t.m, 9, 2, 1, now, corroborate) == v::stale_reporter);
}

TEST_CASE("roster: every member silent at once is credited, and the end of it re-arms all") {
  two_by_two t;
  for (auto& [rank, w] : t.r)
    w.last_heartbeat_ms = now - 3000;
  auto v = stall_credit(t.r, t.m, now, timeout, 0, 10 * timeout);
  REQUIRE(v.credit);
  CHECK(*v.credit == now - timeout);
  CHECK(v.began);
  CHECK(v.all_silent_since_ms == now);
  // Still silent, within the patience: credited, not begun again.
  v = stall_credit(t.r, t.m, now + 100, timeout, now, 10 * timeout);
  CHECK(v.credit);
  CHECK_FALSE(v.began);
  // Past the patience: silent for real, no credit.
  v = stall_credit(t.r, t.m, now + 10 * timeout, timeout, now, 10 * timeout);
  CHECK_FALSE(v.credit);
  CHECK(v.all_silent_since_ms == now);
  // One heard again: every one gets a full timeout from now.
  t.r[0].last_heartbeat_ms = now + 200;
  v = stall_credit(t.r, t.m, now + 200, timeout, now, 10 * timeout);
  REQUIRE(v.credit);
  CHECK(*v.credit == now + 200);
  CHECK(v.all_silent_since_ms == 0);
  // Heard, with no stall before: nothing to credit.
  v = stall_credit(t.r, t.m, now + 200, timeout, 0, 10 * timeout);
  CHECK_FALSE(v.credit);
}

TEST_CASE("roster: a gap in the coordinator's own ticks credits every member from now") {
  two_by_two t;
  // Stopped for three timeouts; one beacon read already since it resumed:
  // the others' wait unread, so each gets one more timeout.
  for (auto& [rank, w] : t.r)
    w.last_heartbeat_ms = now - 3 * timeout;
  t.r[2].last_heartbeat_ms = now;
  auto v = stall_credit(t.r, t.m, now, timeout, 0, 10 * timeout, now - 3 * timeout);
  REQUIRE(v.credit);
  CHECK(*v.credit == now);
  CHECK(v.gap);
  CHECK(v.all_silent_since_ms == 0);
  // Ticks at their pace (under half a timeout apart): the silence rules.
  v = stall_credit(t.r, t.m, now, timeout, 0, 10 * timeout, now - timeout / 2);
  CHECK_FALSE(v.credit);
  CHECK_FALSE(v.gap);
  CHECK(silent_members(t.r, t.m, now, timeout) == std::vector<uint32_t>{0, 1, 3});
}

TEST_CASE("roster: a group of members is one participant with its oldest beacon") {
  two_by_two t;
  t.r[1].last_heartbeat_ms = now - 700;
  auto g = group_participants(t.r, t.e, t.m, now, t.o);
  REQUIRE(g.participants.size() == 2);
  CHECK(g.heard_not_ready == 0);
  CHECK(g.participants[0].who == member{0, 1});
  CHECK(g.participants[0].last_heartbeat_ms == now - 700);
  CHECK(g.participants[1].who == member{1, 1});
}

TEST_CASE("roster: a dead rank counts as silent since it was found dead, and says how") {
  two_by_two t;
  t.r[3].connected = false;
  t.r[3].lost = true;
  t.r[3].lost_ms = now - 20;
  t.r[3].lost_why = "disconnected";
  auto g = group_participants(t.r, t.e, t.m, now, t.o);
  REQUIRE(g.participants.size() == 2);
  auto& p = g.participants[1];
  CHECK(p.who == member{1, 1});
  CHECK(heartbeat_expired(p.last_heartbeat_ms, now, timeout));
  CHECK(p.lost_reason == "rank 3 disconnected at t=99980 ms");
}

TEST_CASE("roster: broken reports of the current epoch, the earliest first") {
  two_by_two t;
  t.r[0].broken_epoch = 3;
  t.r[0].broken_since_ms = now - 50;
  t.r[0].broken_reason = "step failed";
  t.r[1].broken_epoch = 3;
  t.r[1].broken_since_ms = now - 80;
  t.r[1].broken_reason = "peer aborted";
  t.r[2].broken_epoch = 2; // an older epoch's: not this one's
  t.r[2].broken_since_ms = now - 90;
  auto g = group_participants(t.r, t.e, t.m, now, t.o);
  CHECK(g.participants[0].broken_since_ms == now - 80);
  CHECK(g.participants[0].broken_reason == "rank 0: step failed; rank 1: peer aborted");
  CHECK(g.participants[1].broken_since_ms == 0);
}

TEST_CASE("roster: a restarted group joins once every rank is ready, else is heard, not ready") {
  two_by_two t;
  // Group 1's rank 3 restarted: a new incarnation, catching up.
  t.r[3] = live(2);
  t.r[3].fresh = true;
  auto g = group_participants(t.r, t.e, t.m, now, t.o);
  REQUIRE(g.participants.size() == 1); // group 1 is no longer the member
  CHECK(g.participants[0].who == member{0, 1});
  CHECK(g.heard_not_ready == 1);
  // Rank 2 (fenced, restarted too) and rank 3 both ready: a joiner with the
  // newest incarnation and the latest ready time.
  t.r[2] = ready(3, now - 40);
  t.r[3] = ready(2, now - 30);
  g = group_participants(t.r, t.e, t.m, now, t.o);
  REQUIRE(g.participants.size() == 2);
  CHECK(g.participants[1].who == member{1, 3});
  CHECK(g.participants[1].joined_ms == now - 30);
  CHECK(g.heard_not_ready == 0);
  // The run reached its last step: ready groups are not admitted.
  auto closed = t.o;
  closed.admit_ready = false;
  g = group_participants(t.r, t.e, t.m, now, closed);
  CHECK(g.participants.size() == 1);
  CHECK(g.heard_not_ready == 1);
}

TEST_CASE("roster: a group with a rank never registered is nobody; the first epoch takes fresh groups") {
  roster r{{0, live(1, 10, 0)}, {1, live(1, 10, 0)}, {2, live(1, 10, 0)}};
  for (auto& [rank, w] : r)
    w.fresh = true;
  group_options o{.ranks_per_group = 2, .heartbeat_timeout_ms = timeout};
  auto g = group_participants(r, epoch{}, {}, now, o);
  REQUIRE(g.participants.size() == 1); // group 1 lacks rank 3
  CHECK(g.participants[0].who == member{0, 1});
  CHECK(g.heard_not_ready == 0);
  // Fresh but past step 0 (a resumed state is not fresh at step 0): heard only.
  r[0].step = 5;
  g = group_participants(r, epoch{}, {}, now, o);
  CHECK(g.participants.empty());
  CHECK(g.heard_not_ready == 1);
}

TEST_CASE("roster: catch-up sources at the joiner's position, rotating over healthy groups") {
  // 3x2: groups 0 and 1 members; group 2's ranks 4 and 5 restarted.
  roster r{{0, live(1)}, {1, live(1)}, {2, live(1)}, {3, live(1)}, {4, live(2)}, {5, live(2)}};
  epoch e{5, {{0, 1}, {1, 1}}};
  auto m = incarnations_of(ranks_of_members(e.members, 2), r);
  group_options o{.ranks_per_group = 2, .heartbeat_timeout_ms = timeout};
  auto s = catch_up_sources(r, m, {5, 4}, now, o, 0);
  CHECK(s == std::vector<catch_up_source>{{4, 0}, {5, 3}});
  s = catch_up_sources(r, m, {5}, now, o, 1);
  CHECK(s == std::vector<catch_up_source>{{5, 3}});
  s = catch_up_sources(r, m, {5}, now, o, 2);
  CHECK(s == std::vector<catch_up_source>{{5, 1}});
  // A member group with a silent or dead rank serves nobody: it is about
  // to be fenced.
  r[2].last_heartbeat_ms = now - timeout - 1;
  s = catch_up_sources(r, m, {4, 5}, now, o, 1);
  CHECK(s == std::vector<catch_up_source>{{4, 0}, {5, 1}});
  r[0].lost = true;
  CHECK(catch_up_sources(r, m, {4, 5}, now, o, 0).empty());
  CHECK(catch_up_sources(r, m, {}, now, o, 0).empty());
}
