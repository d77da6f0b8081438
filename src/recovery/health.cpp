#include "recovery/health.hpp"

namespace cmesh::recovery {

std::optional<int64_t> credit_when_all_silent(std::span<const int64_t> last_heartbeat_ms,
                                              int64_t now_ms, int64_t timeout_ms,
                                              int64_t all_silent_since_ms, int64_t patience_ms) {
  if (last_heartbeat_ms.empty())
    return std::nullopt;
  for (auto t : last_heartbeat_ms)
    if (!heartbeat_expired(t, now_ms, timeout_ms))
      return std::nullopt; // someone is heard: silence is theirs
  if (all_silent_since_ms != 0 && now_ms - all_silent_since_ms >= patience_ms)
    return std::nullopt;
  return now_ms - timeout_ms;
}

} // namespace cmesh::recovery
