#include "recovery/health.hpp"

#include "core/check.hpp"

#include <algorithm>
#include <map>

namespace cmesh::recovery {

std::string_view to_string(health h) {
  switch (h) {
    case health::healthy:
      return "healthy";
    case health::suspect:
      return "suspect";
    case health::dead:
      return "dead";
  }
  return "unknown";
}

caf::error validate(const health_options& o) {
  if (o.heartbeat_timeout_ms <= 0)
    return make_error(errc::invalid_argument,
                      "heartbeat_timeout_ms must be > 0, got " + std::to_string(o.heartbeat_timeout_ms));
  if (!(o.suspect_fraction > 0.0 && o.suspect_fraction <= 1.0))
    return make_error(errc::invalid_argument,
                      "suspect_fraction must be in (0, 1], got " + std::to_string(o.suspect_fraction));
  if (o.max_step_lag < 0)
    return make_error(errc::invalid_argument,
                      "max_step_lag must be >= 0, got " + std::to_string(o.max_step_lag));
  return {};
}

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

member_health assess(const member_report& r, int64_t now_ms, const health_options& o) {
  CMESH_CHECK(!validate(o));
  const int64_t silence = std::max<int64_t>(0, now_ms - r.last_heartbeat_ms);
  const auto suspect_after = static_cast<double>(o.heartbeat_timeout_ms) * o.suspect_fraction;
  const std::string who = to_string(r.who);
  const std::string said = "last heartbeat " + std::to_string(silence) + " ms ago, step " +
                           std::to_string(r.last_step);
  if (heartbeat_expired(r.last_heartbeat_ms, now_ms, o.heartbeat_timeout_ms))
    return {r.who, health::dead,
            who + " dead: " + said + " (timeout " + std::to_string(o.heartbeat_timeout_ms) + " ms)"};
  if (static_cast<double>(silence) > suspect_after)
    return {r.who, health::suspect,
            who + " suspect: " + said + " (suspect after " +
                std::to_string(static_cast<int64_t>(suspect_after)) + " ms)"};
  return {r.who, health::healthy, who + " healthy: " + said};
}

std::vector<member_health> assess_all(std::span<const member_report> reports, int64_t now_ms,
                                      const health_options& o) {
  CMESH_CHECK(!validate(o));
  std::vector<member_report> sorted(reports.begin(), reports.end());
  std::sort(sorted.begin(), sorted.end(),
            [](const member_report& a, const member_report& b) { return a.who < b.who; });

  std::map<group_id, incarnation_id> newest;
  for (const auto& r : sorted) {
    auto [it, fresh] = newest.emplace(r.who.group, r.who.incarnation);
    if (!fresh)
      it->second = std::max(it->second, r.who.incarnation);
  }

  std::vector<member_health> out;
  out.reserve(sorted.size());
  for (const auto& r : sorted) {
    const auto latest = newest.at(r.who.group);
    if (r.who.incarnation < latest) {
      out.push_back({r.who, health::dead,
                     to_string(r.who) + " dead: superseded by incarnation " + std::to_string(latest)});
      continue;
    }
    out.push_back(assess(r, now_ms, o));
  }

  if (o.max_step_lag > 0) {
    bool any = false;
    int64_t top = 0;
    for (size_t i = 0; i < sorted.size(); ++i)
      if (out[i].state != health::dead) {
        top = any ? std::max(top, sorted[i].last_step) : sorted[i].last_step;
        any = true;
      }
    for (size_t i = 0; i < sorted.size(); ++i) {
      if (out[i].state == health::dead || top - sorted[i].last_step <= o.max_step_lag)
        continue;
      out[i].state = health::suspect;
      out[i].reason = to_string(sorted[i].who) + " suspect: at step " +
                      std::to_string(sorted[i].last_step) + ", " +
                      std::to_string(top - sorted[i].last_step) + " steps behind step " +
                      std::to_string(top) + " (max_step_lag " + std::to_string(o.max_step_lag) + ")";
    }
  }
  return out;
}

} // namespace cmesh::recovery
