// Member health: is a replica group healthy, suspect or dead, and why.
//
// A pure function of (reports, now, options): no clock of its own, so tests
// back-date heartbeats instead of sleeping. Times are milliseconds on one
// monotonic clock (the coordinator's steady clock), passed in as int64.
//
// Rules, per report (one incarnation of one group):
//   silence = now - last heartbeat (a heartbeat stamped after `now` counts as
//   silence 0);
//   dead     when silence >  heartbeat_timeout_ms;
//   suspect  when silence >  suspect_fraction * heartbeat_timeout_ms;
//   healthy  otherwise.
// assess_all() adds two rules that need the other reports:
//   an incarnation of a group for which a newer incarnation reported is dead
//   (superseded: a restarted group is a new member, the old one is out);
//   with max_step_lag > 0, a live member whose last reported step is more
//   than max_step_lag behind the highest step reported by a live member is
//   suspect (the step watchdog: it heartbeats but does not make progress).
// Suspect is a warning; only dead takes a group out of the quorum.
#pragma once

#include "core/error.hpp"
#include "recovery/member.hpp"

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace cmesh::recovery {

enum class health : uint8_t { healthy, suspect, dead };

std::string_view to_string(health h);

struct health_options {
  /// Silence longer than this is death.
  int64_t heartbeat_timeout_ms = 800;
  /// Silence longer than this fraction of the timeout is suspect; in (0, 1].
  double suspect_fraction = 0.5;
  /// Steps a live member may be behind the most advanced one before it is
  /// suspect; 0 turns the rule off.
  int64_t max_step_lag = 0;
};

/// errc::invalid_argument naming the bad field, or no error.
caf::error validate(const health_options& o);

/// What the coordinator last heard from one incarnation of a group.
struct member_report {
  member who;
  int64_t last_heartbeat_ms = 0;
  int64_t last_step = 0;
};

struct member_health {
  member who;
  health state = health::healthy;
  std::string reason;
};

/// True when a member last heard at `last_heartbeat_ms` is dead at `now_ms`
/// (silent for more than `timeout_ms`). The one liveness rule, shared with
/// the quorum.
constexpr bool heartbeat_expired(int64_t last_heartbeat_ms, int64_t now_ms, int64_t timeout_ms) {
  return now_ms - last_heartbeat_ms > timeout_ms;
}

/// The observer's own silence. When every connected member has been silent
/// at once, the likelier cause is the observer (its threads held up, its
/// beacons unread) rather than all of them hanging together. While that
/// began (`all_silent_since_ms`, 0: not yet) less than `patience_ms` ago,
/// returns the heartbeat time to credit each with (now - timeout: none
/// expires this tick); otherwise, or when one of them was heard, nullopt.
/// `last_heartbeat_ms` holds the connected members' last beacons.
std::optional<int64_t> credit_when_all_silent(std::span<const int64_t> last_heartbeat_ms,
                                              int64_t now_ms, int64_t timeout_ms,
                                              int64_t all_silent_since_ms, int64_t patience_ms);

/// One report on its own (heartbeat rules only). `o` must be valid.
member_health assess(const member_report& r, int64_t now_ms, const health_options& o);

/// Every report, sorted by (group, incarnation), with the superseded and
/// step-lag rules too. `o` must be valid.
std::vector<member_health> assess_all(std::span<const member_report> reports, int64_t now_ms,
                                      const health_options& o);

} // namespace cmesh::recovery
