// The coordinator's epoch manager: decides the epochs and pushes them.
//
// It listens to the coordinator's worker events (registrations, status
// beacons, disconnects) and, on every change and every tick, asks
// recovery::compute_quorum what the next epoch is, with the replica groups
// as members (group g is ranks g*S .. g*S+S-1; its incarnation is the
// newest of its ranks', so a restarted rank makes the group a new member):
//   - a rank is live while its connection is open and its beacons keep
//     coming (heartbeat_timeout_ms of silence is death: a SIGSTOPped rank);
//     a closed connection (SIGKILL) is death at once; a group lives while
//     all its ranks do with the incarnations they had in the epoch;
//   - a non-member group counts as a joiner only once every rank of it is
//     `ready` (caught up and following its source's stream), or, before the
//     first epoch, `fresh`;
//   - a new epoch is pushed at once to every connected worker
//     (epoch_notice); a `fail` decision is pushed too, and failure() says
//     why (every group dead, or too few left: a restart from a checkpoint
//     is needed).
// Catch-up: a restarted rank (non-member, `fresh` after the first epoch) is
// given a source among the live members at its own position in their
// groups (they hold the same shard), rotating over them session by
// session, and both are sent a catchup_assign. A joiner whose session
// failed reports `fresh` with that session again and gets a new one.
//
// Replica verification: a member's replica_divergence report takes the
// minority groups' ranks out as lost (they are fenced by the next epoch and
// catch up from the majority), or, with no majority, fails the job.
//
// Every failure, epoch change, catch-up start and end, divergence, and the
// first commit of each epoch goes to the event log (events.hpp).
#pragma once

#include "actors/events.hpp"
#include "recovery/health.hpp"
#include "recovery/quorum.hpp"
#include "transport/bootstrap.hpp"

#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace cmesh::actors {

struct epoch_manager_options {
  uint32_t groups = 1;          // replica groups R
  uint32_t ranks_per_group = 1; // S: group g is ranks g*S .. g*S+S-1
  /// The run's last step: once a member reached it, no joiner is admitted.
  uint64_t target_step = 0;
  recovery::quorum_options quorum{.min_replicas = 1, .join_window_ms = 500, .heartbeat_timeout_ms = 1500};
  std::chrono::milliseconds tick{20};
  /// A broken epoch that cannot be replaced for this long (no quorum, and
  /// none formed by returning groups) fails the job: restart from checkpoint.
  int64_t quorum_wait_ms = 120000;
  /// Print a line on stdout for each loss, epoch, catch-up and first commit.
  bool print = false;
};

class epoch_manager {
public:
  /// Hooks into `coord`'s events; `coord` must outlive it.
  epoch_manager(coordinator& coord, epoch_manager_options o, std::shared_ptr<event_log> log);
  ~epoch_manager();

  void start();
  /// Stops the decision thread; idempotent.
  void stop();

  /// The reason of a `fail` decision, once one was made.
  std::optional<std::string> failure() const;

  /// The ranks of the current epoch (empty before the first one).
  std::vector<uint32_t> members() const;
  uint64_t epoch() const;

  /// What the epoch manager knows, for the launcher (job end, chaos triggers).
  struct rank_view {
    uint32_t rank = 0;
    uint64_t incarnation = 0;
    bool member = false;
    bool live = false;
    uint8_t state = 0; // wire::worker_status::state_t
    uint64_t step = 0;
  };
  struct view {
    uint64_t epoch = 0;
    std::vector<rank_view> ranks;
    uint64_t max_member_step = 0;
    /// The source of the newest catch-up whose joiner is not a member yet.
    std::optional<uint32_t> catchup_source;
  };
  view snapshot() const;

  /// What recovery cost over the job so far: the launcher's last line, and
  /// the event log's last event ("recovery_summary", written at stop).
  struct recovery_summary {
    uint64_t epochs = 0;     // epochs announced, the first one included
    uint64_t ranks_lost = 0; // members found dead (connection closed, or silent)
    uint64_t reforms = 0;    // epochs re-formed with every process alive (a failed step)
    uint64_t catchups = 0;   // catch-up sessions assigned
    uint64_t divergences = 0; // replica divergences reported (verification)
    /// From each failure (a member lost, a step failed) that no commit
    /// followed yet to the survivors' next committed step.
    std::vector<int64_t> failure_to_commit_ms;
    /// From a rank's registration (its restart) to the epoch that admits
    /// it after it caught up.
    std::vector<int64_t> rejoin_ms;
    /// One line for the user ("" when nothing failed and nobody rejoined).
    std::string describe() const;
  };
  recovery_summary summary() const;

  /// Writes an event of the caller's (the launcher's restarts) to the same log.
  void note(std::string_view event, const event_fields& fields);

  struct impl;

private:
  std::unique_ptr<impl> impl_;
};

} // namespace cmesh::actors
