// The roster: what the coordinator knows of each rank, and the rank-level
// decisions made from it. Pure functions of (roster, epoch, now, options),
// like the quorum they feed; the epoch manager (actors/epoch_manager) keeps
// the roster up to date from the workers' registrations, beacons and closed
// connections, and acts on what these return.
//
// Ranks and groups. Group g is ranks g*S .. g*S+S-1; a rank's position in
// its group (rank mod S) is the shard it holds. The current epoch's members
// are groups; `member_ranks` lists their ranks with the incarnation each
// had when the epoch formed (a restarted rank has a new one, so its group
// is no longer the same member).
//
// Death by silence (silent_members). A member rank that still runs the
// incarnation it had in the epoch, is connected, and has not been found
// dead yet, is dead once its beacons stop for longer than the heartbeat
// timeout (health.hpp's heartbeat_expired). A closed connection is death
// at once; the epoch manager records that itself.
//
// A peer's report (weigh_peer_report). A worker whose transport found a
// peer lost (its endpoint failed, or its heartbeats stopped for the mesh's
// bound) reports it. A reporter that is not itself an attached member is
// not heard (a process resumed after SIGSTOP finds everyone silent). The
// coordinator believes the report only when its own
// view agrees: the suspect is a member with that incarnation and not yet
// found dead, and its connection is closed or it has been silent for at
// least `corroborate_ms`. A suspect the coordinator still hears from is
// alive as far as it knows (a slow peer, or a link between two workers
// that failed while each still reaches the coordinator): the report is
// logged, and its beacons or its connection decide.
//
// The observer's own stall (stall_credit). When every such member is
// silent at once, the likelier cause is the coordinator (its threads held
// up, the beacons queued unread) than all of them hanging together: they
// are credited (no death this tick) for up to `patience_ms` from when the
// silence of all began; when one of them is heard again, each gets one
// more timeout from now, since the others' beacons may still wait unread
// behind the first one's. And when the coordinator's own ticks stopped for
// more than half a timeout (its process stopped, or starved), it could
// not have read anyone's beacons meanwhile: each gets one more timeout
// from now, whoever was read first after the gap.
//
// Group aggregation (group_participants). One participant of the quorum
// per replica group, from its S ranks:
//   - a group every rank of which is a member with its epoch incarnation is
//     that member, its heartbeat the oldest of its ranks' (a rank found
//     dead counts as silent since then), with the earliest of its ranks'
//     reports that the current epoch broke, and how its dead ranks died;
//   - otherwise, a group every rank of which registered is a joiner once
//     each rank is `ready` (caught up, following its source's stream) and
//     joiners are admitted, or, before the first epoch, `fresh` at step 0;
//     its incarnation is the newest of its ranks', its join time the latest
//     of their ready times;
//   - otherwise, a complete group all of whose ranks are heard from
//     (connected, not dead, not silent) counts as heard from but not ready
//     (catching up): in the majority's denominator, never a member.
//
// Catch-up sources (catch_up_sources). Each rank that needs state copies
// it from the rank at its own position in a source group (it holds the
// same shard). The source groups are the member groups all of whose ranks
// are healthy (a group with a dead rank is about to be fenced, and its
// session would die with it); plan.hpp's plan_recovery spreads the
// (joiner, shard) pairs over them round-robin, starting at `rotation` (the
// caller passes a counter, so successive sessions rotate over the sources,
// and one that failed is not retried from the same source when another
// exists).
#pragma once

#include "recovery/member.hpp"
#include "recovery/quorum.hpp"

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace cmesh::recovery {

/// What the coordinator knows of one rank's newest incarnation.
struct rank_report {
  /// 0: the rank never registered.
  incarnation_id incarnation = 0;
  /// Its connection to the coordinator is open.
  bool connected = false;
  /// Its last beacon (or registration).
  int64_t last_heartbeat_ms = 0;
  /// Found dead (connection closed, silent, or diverged): when and how.
  bool lost = false;
  int64_t lost_ms = 0;
  std::string lost_why;
  /// At least one beacon of this incarnation was read; the fields below
  /// are its latest.
  bool has_status = false;
  uint64_t step = 0;
  /// It holds no state yet (a fresh start, or a catch-up that failed).
  bool fresh = false;
  /// Caught up and following its source's stream, since (0: not ready).
  int64_t ready_since_ms = 0;
  /// The epoch it last reported broken (0: none), when that report first
  /// came, and why.
  uint64_t broken_epoch = 0;
  int64_t broken_since_ms = 0;
  std::string broken_reason;
};

/// Rank -> what is known of its newest incarnation.
using roster = std::map<uint32_t, rank_report>;

/// The current epoch's ranks -> the incarnation each had in it.
using member_ranks = std::map<uint32_t, incarnation_id>;

/// The ranks of groups `groups` (S ranks each).
std::vector<uint32_t> ranks_of_groups(const std::vector<group_id>& groups, uint32_t S);

/// The ranks of the groups of `members`.
std::vector<uint32_t> ranks_of_members(const std::vector<member>& members, uint32_t S);

/// `ranks` with their incarnations in `r` (0 for a rank never registered).
member_ranks incarnations_of(const std::vector<uint32_t>& ranks, const roster& r);

/// True when `rank` is a member at incarnation `inc`.
bool is_member(const member_ranks& members, uint32_t rank, incarnation_id inc);

/// True when `rank` runs, as far as is known, the incarnation it had in the
/// epoch, with its connection open and not found dead (its silence is not
/// looked at).
bool attached_member(const roster& r, const member_ranks& members, uint32_t rank);

/// The member ranks dead by silence at `now_ms`, ascending.
std::vector<uint32_t> silent_members(const roster& r, const member_ranks& members, int64_t now_ms,
                                     int64_t timeout_ms);

/// What a peer's report of a lost rank amounts to.
enum class peer_report_verdict : uint8_t {
  lost,        // believed: the suspect is dead from now
  known,       // it was found dead already
  not_member,  // not a member with that incarnation (a stale or superseded process)
  heard_from,  // the coordinator still hears it: not believed
  stale_reporter, // the reporter is not an attached member itself
};

/// Weighs `reporter`'s report that member `suspect` (incarnation `inc`) is
/// lost, at `now_ms`.
peer_report_verdict weigh_peer_report(const roster& r, const member_ranks& members,
                                      uint32_t reporter, uint32_t suspect, incarnation_id inc,
                                      int64_t now_ms, int64_t corroborate_ms);

/// What stall_credit decided.
struct stall_verdict {
  /// Raise each attached member's last heartbeat to at least this (none:
  /// leave them).
  std::optional<int64_t> credit;
  /// The new value of the caller's "every member silent since" (0: not).
  int64_t all_silent_since_ms = 0;
  /// The silence of all began at this tick (say so, once).
  bool began = false;
  /// The ticks stopped for longer than half a timeout before this one.
  bool gap = false;
};

/// The observer's stall rules above, for the attached members of
/// `members`. `last_tick_ms`: the coordinator's previous tick (0: none).
stall_verdict stall_credit(const roster& r, const member_ranks& members, int64_t now_ms,
                           int64_t timeout_ms, int64_t all_silent_since_ms, int64_t patience_ms,
                           int64_t last_tick_ms = 0);

struct group_options {
  uint32_t ranks_per_group = 1;
  int64_t heartbeat_timeout_ms = 1500;
  /// Whether ready groups may join (no: the run reached its last step).
  bool admit_ready = true;
};

struct group_view {
  std::vector<participant> participants;
  /// Complete groups heard from that are not ready to join.
  uint32_t heard_not_ready = 0;
};

/// The quorum's participants from the ranks, as above. `current` is the
/// epoch (its members are groups) and `members` its ranks.
group_view group_participants(const roster& r, const epoch& current, const member_ranks& members,
                              int64_t now_ms, const group_options& o);

/// One catch-up to start: `joiner` copies its shard from `source`.
struct catch_up_source {
  uint32_t joiner = 0;
  uint32_t source = 0;

  bool operator==(const catch_up_source&) const = default;
};

/// Sources for `joiners` (ranks needing state; any order), as above, in
/// (joiner group, position) order. Joiners with no healthy source group are
/// left out (they wait for one).
std::vector<catch_up_source> catch_up_sources(const roster& r, const member_ranks& members,
                                              const std::vector<uint32_t>& joiners,
                                              int64_t now_ms, const group_options& o,
                                              uint64_t rotation);

} // namespace cmesh::recovery
