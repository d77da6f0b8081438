// Liveness: the one rule that makes a silent member dead, and the
// observer's own stall.
//
// Pure functions: no clock of their own, so tests back-date heartbeats
// instead of sleeping. Times are milliseconds on one monotonic clock (the
// coordinator's steady clock), passed in as int64.
#pragma once

#include <cstdint>
#include <optional>
#include <span>

namespace cmesh::recovery {

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

} // namespace cmesh::recovery
