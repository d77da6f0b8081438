#include "recovery/roster.hpp"

#include "recovery/health.hpp"
#include "recovery/plan.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

namespace cmesh::recovery {

std::vector<uint32_t> ranks_of_groups(const std::vector<group_id>& groups, uint32_t S) {
  std::vector<uint32_t> out;
  for (auto g : groups)
    for (uint32_t p = 0; p < S; ++p)
      out.push_back(g * S + p);
  return out;
}

std::vector<uint32_t> ranks_of_members(const std::vector<member>& members, uint32_t S) {
  std::vector<group_id> gs;
  for (auto& m : members)
    gs.push_back(m.group);
  return ranks_of_groups(gs, S);
}

member_ranks incarnations_of(const std::vector<uint32_t>& ranks, const roster& r) {
  member_ranks out;
  for (auto rank : ranks) {
    auto it = r.find(rank);
    out[rank] = it == r.end() ? 0 : it->second.incarnation;
  }
  return out;
}

namespace {

const rank_report* find(const roster& r, uint32_t rank) {
  auto it = r.find(rank);
  return it == r.end() ? nullptr : &it->second;
}

bool attached(const rank_report& w, incarnation_id inc) {
  return w.incarnation == inc && w.connected && !w.lost;
}

} // namespace

bool is_member(const member_ranks& members, uint32_t rank, incarnation_id inc) {
  auto it = members.find(rank);
  return it != members.end() && it->second == inc;
}

bool attached_member(const roster& r, const member_ranks& members, uint32_t rank) {
  auto m = members.find(rank);
  const auto* w = find(r, rank);
  return m != members.end() && w && attached(*w, m->second);
}

std::vector<uint32_t> silent_members(const roster& r, const member_ranks& members, int64_t now_ms,
                                     int64_t timeout_ms) {
  std::vector<uint32_t> out;
  for (auto& [rank, inc] : members) {
    const auto* w = find(r, rank);
    if (w && attached(*w, inc) && heartbeat_expired(w->last_heartbeat_ms, now_ms, timeout_ms))
      out.push_back(rank);
  }
  return out;
}

peer_report_verdict weigh_peer_report(const roster& r, const member_ranks& members,
                                      uint32_t reporter, uint32_t suspect, incarnation_id inc,
                                      int64_t now_ms, int64_t corroborate_ms) {
  if (!attached_member(r, members, reporter))
    return peer_report_verdict::stale_reporter;
  if (!is_member(members, suspect, inc))
    return peer_report_verdict::not_member;
  const auto* w = find(r, suspect);
  if (!w || w->incarnation != inc)
    return peer_report_verdict::not_member;
  if (w->lost)
    return peer_report_verdict::known;
  if (!w->connected || now_ms - w->last_heartbeat_ms >= corroborate_ms)
    return peer_report_verdict::lost;
  return peer_report_verdict::heard_from;
}

stall_verdict stall_credit(const roster& r, const member_ranks& members, int64_t now_ms,
                           int64_t timeout_ms, int64_t all_silent_since_ms, int64_t patience_ms,
                           int64_t last_tick_ms) {
  if (last_tick_ms != 0 && 2 * (now_ms - last_tick_ms) > timeout_ms) {
    stall_verdict v;
    v.credit = now_ms; // nobody's beacons were read meanwhile
    v.gap = true;
    return v;
  }
  std::vector<int64_t> beacons;
  for (auto& [rank, inc] : members) {
    const auto* w = find(r, rank);
    if (w && attached(*w, inc))
      beacons.push_back(w->last_heartbeat_ms);
  }
  stall_verdict v;
  v.all_silent_since_ms = all_silent_since_ms;
  if (auto c = credit_when_all_silent(beacons, now_ms, timeout_ms, all_silent_since_ms,
                                      patience_ms)) {
    v.credit = c;
    if (all_silent_since_ms == 0) {
      v.all_silent_since_ms = now_ms;
      v.began = true;
    }
    return v;
  }
  const bool heard = std::any_of(beacons.begin(), beacons.end(), [&](int64_t t) {
    return !heartbeat_expired(t, now_ms, timeout_ms);
  });
  if (heard) {
    if (all_silent_since_ms != 0)
      v.credit = now_ms; // the stall is over: a full timeout from now
    v.all_silent_since_ms = 0;
  }
  return v;
}

namespace {

/// A member group's participant: its epoch member, with its ranks' oldest
/// heartbeat, earliest broken report and deaths.
participant member_participant(const roster& r, const epoch& current, group_id g, int64_t hb,
                               uint32_t S) {
  participant p;
  p.who = *std::find_if(current.members.begin(), current.members.end(),
                        [&](const member& x) { return x.group == g; });
  p.last_heartbeat_ms = hb;
  for (uint32_t rank = g * S; rank < (g + 1) * S; ++rank) {
    const auto& w = r.at(rank);
    if (w.lost)
      p.lost_reason += (p.lost_reason.empty() ? "" : "; ")
                       + fmt::format("rank {} {} at t={} ms", rank, w.lost_why, w.lost_ms);
    if (w.broken_epoch != current.id || w.broken_since_ms == 0)
      continue;
    if (p.broken_since_ms == 0 || w.broken_since_ms < p.broken_since_ms)
      p.broken_since_ms = w.broken_since_ms;
    p.broken_reason += (p.broken_reason.empty() ? "" : "; ")
                       + fmt::format("rank {}: {}", rank, w.broken_reason);
  }
  return p;
}

} // namespace

group_view group_participants(const roster& r, const epoch& current, const member_ranks& members,
                              int64_t now_ms, const group_options& o) {
  const uint32_t S = std::max<uint32_t>(1, o.ranks_per_group);
  const int64_t timeout = o.heartbeat_timeout_ms;
  std::map<group_id, bool> groups; // group -> a member of the current epoch
  for (auto& [rank, w] : r)
    if (w.incarnation != 0)
      groups[rank / S] = false;
  for (auto& m : current.members)
    groups[m.group] = true;
  group_view out;
  for (auto& [g, member] : groups) {
    bool same = member, complete = true, all_joining = true, all_heard = true;
    int64_t hb = std::numeric_limits<int64_t>::max(), joined = 0;
    incarnation_id inc = 0;
    for (uint32_t rank = g * S; rank < (g + 1) * S; ++rank) {
      const auto* w = find(r, rank);
      if (!w || w->incarnation == 0) {
        complete = same = false; // a group without all its ranks is no survivor
        break;
      }
      const bool silent = heartbeat_expired(w->last_heartbeat_ms, now_ms, timeout);
      // The dead count as silent from the moment they were found dead.
      hb = std::min(hb, (w->connected && !w->lost)
                          ? w->last_heartbeat_ms
                          : std::min(w->last_heartbeat_ms, w->lost_ms - timeout - 1));
      inc = std::max(inc, w->incarnation);
      same = same && is_member(members, rank, w->incarnation);
      const bool joining = w->has_status && !w->lost
                           && ((w->ready_since_ms != 0 && o.admit_ready)
                               || (current.id == 0 && w->fresh && w->step == 0));
      all_joining = all_joining && joining;
      joined = std::max(joined, w->ready_since_ms != 0 ? w->ready_since_ms : w->last_heartbeat_ms);
      all_heard = all_heard && w->has_status && !w->lost && w->connected && !silent;
    }
    if (same) {
      out.participants.push_back(member_participant(r, current, g, hb, S));
    } else if (complete && all_joining) {
      // Not a member (or a member superseded by a restarted rank, which
      // then counts as lost): a joiner once every rank of it is ready.
      participant p;
      p.who = {g, inc};
      p.last_heartbeat_ms = hb;
      p.joined_ms = joined;
      out.participants.push_back(std::move(p));
    } else if (complete && all_heard) {
      ++out.heard_not_ready; // catching up: heard from, not eligible yet
    }
  }
  return out;
}

std::vector<catch_up_source> catch_up_sources(const roster& r, const member_ranks& members,
                                              const std::vector<uint32_t>& joiners,
                                              int64_t now_ms, const group_options& o,
                                              uint64_t rotation) {
  const uint32_t S = std::max<uint32_t>(1, o.ranks_per_group);
  // Member groups whose every rank is attached and heard from.
  std::map<group_id, bool> healthy_groups;
  for (auto& [rank, inc] : members) {
    const auto* w = find(r, rank);
    const bool ok = w && attached(*w, inc)
                    && !heartbeat_expired(w->last_heartbeat_ms, now_ms, o.heartbeat_timeout_ms);
    auto [it, fresh] = healthy_groups.emplace(rank / S, ok);
    if (!fresh)
      it->second = it->second && ok;
  }
  std::vector<group_id> healthy;
  for (auto& [g, ok] : healthy_groups)
    if (ok)
      healthy.push_back(g);
  std::map<group_id, joiner_shards> by_group;
  for (auto rank : joiners) {
    if (std::binary_search(healthy.begin(), healthy.end(), rank / S))
      continue; // a healthy member's rank needs no source (and is no joiner)
    auto& j = by_group[rank / S];
    j.group = rank / S;
    j.shards.push_back(rank % S);
  }
  std::vector<joiner_shards> js;
  for (auto& [g, j] : by_group)
    js.push_back(std::move(j));
  if (js.empty() || healthy.empty())
    return {};
  auto plan = plan_recovery(healthy, js, S, rotation);
  if (!plan)
    return {}; // cannot happen with the inputs built above
  std::vector<catch_up_source> out;
  for (auto& s : plan->sources)
    out.push_back({s.joiner * S + s.shard, s.source * S + s.shard});
  return out;
}

} // namespace cmesh::recovery
