// Quorum: which replica groups form the next epoch, decided as a pure
// function of (state, now, options). No sockets, threads or clocks: the
// coordinator hands in what it knows and the time, and gets back a decision
// with its reason.
//
// Inputs. The current epoch (id + members, sorted by group, one incarnation
// per group; id 0 with no members before the first epoch) and the
// participants: every incarnation the coordinator hears from, with its last
// heartbeat and the time it first registered (asked to join).
//
// Classification. For each group, only its newest known incarnation counts.
//   - live: its last heartbeat is within heartbeat_timeout_ms of now
//     (health.hpp's heartbeat_expired, the one liveness rule);
//   - survivor: a member of the current epoch whose SAME incarnation is live;
//   - lost: a member of the current epoch that is not a survivor: silent for
//     too long, no longer reported, or superseded by a newer incarnation of
//     its group (a restarted group is a new member; its old incarnation is out);
//   - joiner: a live incarnation that is not a member: a new group, or the
//     new incarnation of a member group.
//   Incarnations older than the epoch's member of the same group are stale
//   and ignored.
// live = survivors plus joiners; known = the groups heard from: live plus
// heard_not_ready (groups heartbeating that are still catching up), and for
// the first epoch at least expected_groups when that is set. The dead do not
// count: the survivors of a failure go on as long as they are more than half
// of the groups still heard from (and at least min_replicas); the
// coordinator is the one decider and fences whoever it no longer hears, so
// a silent group cannot form an epoch of its own.
//
// Rules, in order:
//   1. nothing lost and nobody joining: KEEP (the fast path; no waiting).
//      Before the first epoch, with nobody live: WAIT.
//   2. nobody live at all, though the epoch had members: FAIL, every group
//      is dead: restart from checkpoint needed.
//   3. live < min_replicas: WAIT while somebody is joining (more may come),
//      otherwise FAIL: fewer than min_replicas groups can be reached and
//      none is on its way: restart from checkpoint needed.
//   4. 2 * live <= known: WAIT (no majority of the groups heard from: a
//      minority must not go on alone while the rest are on their way back).
//   5. the join window: joiners are admitted together once join_window_ms
//      have passed since the earliest pending join (or at once when every
//      expected group is live), so several groups join in one epoch. While
//      the window is open:
//        - nothing lost: KEEP the current epoch (it still trains), the
//          joiners are pending;
//        - members lost and the survivors alone meet rules 3 and 4 (against
//          every group heard from, joiners included): NEW EPOCH of the
//          survivors now (do not stall training), the joiners stay pending;
//        - otherwise WAIT for the window.
//      retry_at_ms says when the window closes.
//   6. otherwise NEW EPOCH: id + 1, the live groups sorted by group id.
//
// A broken epoch. A survivor may report that the current epoch broke at it
// (a step that failed, or an epoch it could not build) though nobody died:
// a transport error, a collective that timed out, an injected fault. Its
// peers then wait in a collective that will never complete. The report is
// acted on once it is broken_grace_ms old (a death that explains it is
// normally seen first, and then the rules above replace the epoch anyway):
// where rule 1 or rule 5 would KEEP the epoch, a NEW EPOCH of the same
// survivors re-forms it instead (`reform`; joiners in an open window stay
// pending), and every new epoch formed while such a report stands asks its
// members to abort the running one at once (`abort_running`). After
// max_reforms re-forms in a row with no step committed between them, the
// failure is not transient: FAIL, restart from checkpoint needed.
// Reason texts hold no `now`-dependent numbers (times are absolute), so the
// same situation gives the same text tick after tick and reason_changed()
// lets a caller log it only when it changes.
#pragma once

#include "core/error.hpp"
#include "recovery/member.hpp"

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace cmesh::recovery {

/// An epoch: its id and its members, sorted by group id, one per group.
struct epoch {
  uint64_t id = 0;
  std::vector<member> members;

  bool operator==(const epoch&) const = default;
};

/// One incarnation the coordinator hears from.
struct participant {
  member who;
  int64_t last_heartbeat_ms = 0;
  /// When this incarnation registered (asked to join); read for joiners only.
  int64_t joined_ms = 0;
  /// Members only: when it reported that the current epoch broke at it
  /// (0: no report), and why.
  int64_t broken_since_ms = 0;
  std::string broken_reason;
  /// Why it is known dead, when the caller knows ("rank 1 disconnected at
  /// t=..."); empty: a lost member is described by its silence.
  std::string lost_reason;
};

struct quorum_state {
  epoch current;
  /// In any order; several incarnations of one group may appear.
  std::vector<participant> participants;
  /// The job's replica group count R, when known (0: unknown). Closes the
  /// join window early once every expected group is live, and is the
  /// majority's denominator for the first epoch.
  uint32_t expected_groups = 0;
  /// Groups heard from (heartbeating) that cannot join yet: restarted
  /// groups still catching up. They count in the majority's denominator.
  uint32_t heard_not_ready = 0;
  /// Epochs re-formed in a row (`reform`) with no step committed since.
  uint32_t reforms_in_a_row = 0;
};

struct quorum_options {
  /// Groups a new epoch needs at least.
  uint32_t min_replicas = 1;
  /// How long joiners wait, from the earliest pending join, for others to
  /// join with them.
  int64_t join_window_ms = 0;
  /// Silence longer than this is death.
  int64_t heartbeat_timeout_ms = 800;
  /// How long a member's report of a broken epoch waits for a death that
  /// would explain it before the epoch is re-formed.
  int64_t broken_grace_ms = 200;
  /// Re-forms in a row without a committed step before the job fails.
  uint32_t max_reforms = 3;
};

/// errc::invalid_argument naming the bad field, or no error.
caf::error validate(const quorum_options& o);

enum class decision_kind : uint8_t {
  keep,      // the current epoch stands (training goes on)
  new_epoch, // switch to `epoch`
  wait,      // the current epoch is broken or absent and no new one can form yet
  fail,      // no epoch can form without a restart from checkpoint
};

std::string_view to_string(decision_kind k);

struct quorum_decision {
  decision_kind kind = decision_kind::keep;
  /// new_epoch: the new epoch; otherwise the current one.
  recovery::epoch epoch;
  std::string reason;
  /// True when `epoch` differs from the current one (kind == new_epoch).
  bool changed = false;
  /// Members of `epoch` that were not in the current epoch.
  std::vector<member> joined;
  /// Members of the current epoch that are not in `epoch` (new_epoch), or
  /// that are lost (wait, fail).
  std::vector<member> left;
  /// Live joiners not in `epoch`, waiting for their window.
  std::vector<member> pending;
  /// When a join window closes, or a broken epoch's grace ends, and the
  /// decision may change by itself.
  std::optional<int64_t> retry_at_ms;
  /// new_epoch: it re-forms a broken epoch whose members all live.
  bool reform = false;
  /// new_epoch: a member reported the current epoch broken; the members
  /// abort it at once rather than at their next step boundary.
  bool abort_running = false;
};

/// The decision for `state` at `now_ms`. Preconditions (checked): valid
/// options; the current epoch's members sorted by group, one per group.
quorum_decision compute_quorum(const quorum_state& state, int64_t now_ms, const quorum_options& o);

/// True when `next` should be logged after `prev`: its kind or reason
/// differs. A default-constructed `prev` (nothing logged yet) differs from
/// every decision compute_quorum returns.
bool reason_changed(const quorum_decision& prev, const quorum_decision& next);

} // namespace cmesh::recovery
