#include "recovery/quorum.hpp"

#include "core/check.hpp"
#include "recovery/health.hpp"

#include <algorithm>
#include <map>
#include <optional>
#include <set>

namespace cmesh::recovery {

std::string_view to_string(decision_kind k) {
  switch (k) {
    case decision_kind::keep:
      return "keep";
    case decision_kind::new_epoch:
      return "new_epoch";
    case decision_kind::wait:
      return "wait";
    case decision_kind::fail:
      return "fail";
  }
  return "unknown";
}

caf::error validate(const quorum_options& o) {
  if (o.min_replicas < 1)
    return make_error(errc::invalid_argument, "min_replicas must be >= 1");
  if (o.join_window_ms < 0)
    return make_error(errc::invalid_argument,
                      "join_window_ms must be >= 0, got " + std::to_string(o.join_window_ms));
  if (o.heartbeat_timeout_ms <= 0)
    return make_error(errc::invalid_argument,
                      "heartbeat_timeout_ms must be > 0, got " + std::to_string(o.heartbeat_timeout_ms));
  if (o.broken_grace_ms < 0)
    return make_error(errc::invalid_argument,
                      "broken_grace_ms must be >= 0, got " + std::to_string(o.broken_grace_ms));
  return {};
}

bool reason_changed(const quorum_decision& prev, const quorum_decision& next) {
  return prev.kind != next.kind || prev.reason != next.reason;
}

namespace {

struct lost_member {
  member who;
  std::string cause;
};

std::string describe(const std::vector<lost_member>& lost) {
  std::string out;
  for (const auto& l : lost) {
    if (!out.empty())
      out += ", ";
    out += to_string(l.who) + " (" + l.cause + ")";
  }
  return out;
}

std::string t(int64_t ms) {
  return "t=" + std::to_string(ms) + " ms";
}

std::string groups(size_t n) {
  return std::to_string(n) + (n == 1 ? " group" : " groups");
}

/// The newest incarnation the coordinator hears from, per group. Same
/// incarnation twice: the later heartbeat wins (then the earlier join), so
/// the input order never matters.
std::map<group_id, const participant*> newest_of(const std::vector<participant>& ps) {
  std::map<group_id, const participant*> newest;
  for (const auto& p : ps) {
    auto [it, fresh] = newest.emplace(p.who.group, &p);
    if (fresh)
      continue;
    const participant* q = it->second;
    if (p.who.incarnation > q->who.incarnation ||
        (p.who.incarnation == q->who.incarnation &&
         (p.last_heartbeat_ms > q->last_heartbeat_ms ||
          (p.last_heartbeat_ms == q->last_heartbeat_ms && p.joined_ms < q->joined_ms))))
      it->second = &p;
  }
  return newest;
}

/// The participants against the current epoch (the header's
/// classification).
struct classified {
  std::vector<member> survivors;
  std::vector<const participant*> broken; // survivors that reported the epoch broken
  std::vector<lost_member> lost;
  std::vector<const participant*> joiners; // sorted by group
  std::vector<member> joiner_ids, lost_ids;
};

classified classify(const quorum_state& state, int64_t now_ms, const quorum_options& o) {
  const auto& cur = state.current;
  const auto newest = newest_of(state.participants);
  auto live = [&](const participant& p) {
    return !heartbeat_expired(p.last_heartbeat_ms, now_ms, o.heartbeat_timeout_ms);
  };
  classified c;
  for (const auto& m : cur.members) {
    auto it = newest.find(m.group);
    const participant* p = it == newest.end() ? nullptr : it->second;
    if (p == nullptr || p->who.incarnation < m.incarnation) {
      c.lost.push_back({m, "not reported"});
    } else if (p->who.incarnation > m.incarnation) {
      c.lost.push_back({m, "superseded by " + to_string(p->who)});
    } else if (!live(*p)) {
      c.lost.push_back(
        {m, p->lost_reason.empty() ? "silent since " + t(p->last_heartbeat_ms) : p->lost_reason});
    } else {
      c.survivors.push_back(m);
      if (p->broken_since_ms != 0)
        c.broken.push_back(p);
    }
  }
  for (const auto& [g, p] : newest) {
    if (!live(*p))
      continue;
    auto m = std::lower_bound(cur.members.begin(), cur.members.end(), g,
                              [](const member& x, group_id y) { return x.group < y; });
    const bool is_member_group = m != cur.members.end() && m->group == g;
    if (!is_member_group || p->who.incarnation > m->incarnation)
      c.joiners.push_back(p);
  }
  for (const auto* p : c.joiners)
    c.joiner_ids.push_back(p->who);
  for (const auto& l : c.lost)
    c.lost_ids.push_back(l.who);
  return c;
}

/// Builds the decision: what every rule ends with.
struct decider {
  const quorum_state& state;
  const int64_t now_ms;
  const quorum_options& o;
  const classified& c;
  quorum_decision d;
  /// A broken epoch: due once the earliest report is broken_grace_ms old.
  std::optional<int64_t> broken_due_ms;
  std::string broken_text;
  bool broken_due = false;

  decider(const quorum_state& s, int64_t now, const quorum_options& opts, const classified& cl)
      : state(s), now_ms(now), o(opts), c(cl) {
    d.epoch = s.current;
    for (const auto* p : c.broken) {
      const int64_t due = p->broken_since_ms + o.broken_grace_ms;
      broken_due_ms = broken_due_ms ? std::min(*broken_due_ms, due) : due;
      broken_text += (broken_text.empty() ? "" : ", ") + to_string(p->who) + " ("
                     + (p->broken_reason.empty() ? "no reason given" : p->broken_reason) + ")";
    }
    if (!c.broken.empty())
      broken_text = "epoch " + std::to_string(s.current.id) + " broke at " + broken_text;
    broken_due = broken_due_ms && now_ms >= *broken_due_ms;
  }

  std::string lost_text() const { return c.lost.empty() ? "" : "; lost " + describe(c.lost); }

  quorum_decision finish(decision_kind kind, std::string reason) {
    d.kind = kind;
    d.reason = std::move(reason);
    if (kind == decision_kind::wait || kind == decision_kind::fail)
      d.left = c.lost_ids;
    return d;
  }

  quorum_decision form(std::vector<member> members, const std::string& why) {
    const auto& cur = state.current;
    std::sort(members.begin(), members.end());
    d.epoch = {cur.id + 1, std::move(members)};
    d.changed = true;
    d.abort_running = !c.broken.empty();
    for (const auto& m : d.epoch.members)
      if (!std::binary_search(cur.members.begin(), cur.members.end(), m))
        d.joined.push_back(m);
    for (const auto& m : cur.members)
      if (!std::binary_search(d.epoch.members.begin(), d.epoch.members.end(), m))
        d.left.push_back(m);
    std::string reason = "epoch " + std::to_string(d.epoch.id) + " " + to_string(d.epoch.members);
    if (cur.id > 0)
      reason += " replaces epoch " + std::to_string(cur.id);
    reason += lost_text();
    if (!d.joined.empty())
      reason += "; joined " + to_string(d.joined);
    if (!why.empty())
      reason += "; " + why;
    return finish(decision_kind::new_epoch, std::move(reason));
  }

  /// Where the epoch would be kept: re-formed instead once a report of it
  /// broken is due (or, after max_reforms in a row, given up on).
  quorum_decision keep_or_reform(std::string keep_reason, const std::string& window) {
    if (broken_due) {
      if (state.reforms_in_a_row >= o.max_reforms)
        return finish(decision_kind::fail,
                      broken_text + "; re-formed " + std::to_string(state.reforms_in_a_row)
                        + " times in a row with no step committed; restart from checkpoint "
                          "needed");
      d.reform = true;
      return form(c.survivors, broken_text + " while every member lives: re-formed"
                                 + (window.empty() ? "" : "; " + window));
    }
    if (broken_due_ms) {
      d.retry_at_ms = d.retry_at_ms ? std::min(*d.retry_at_ms, *broken_due_ms) : *broken_due_ms;
      keep_reason += "; " + broken_text + ", re-formed at " + t(*broken_due_ms)
                     + " unless a death explains it";
    }
    return finish(decision_kind::keep, std::move(keep_reason));
  }

  /// Rule 5: while the join window is open, the decision (none once it
  /// closed, or every expected group is live).
  std::optional<quorum_decision> join_window(const std::vector<member>& all, size_t known) {
    int64_t first_join = c.joiners.front()->joined_ms;
    for (const auto* p : c.joiners)
      first_join = std::min(first_join, p->joined_ms);
    const int64_t closes = first_join + o.join_window_ms;
    const bool everyone = state.expected_groups > 0 && all.size() >= state.expected_groups;
    if (now_ms >= closes || everyone)
      return std::nullopt;
    // After a loss, the survivors alone may be too few, or no majority,
    // though with the joiners (ready: caught up) they are enough (steps 3
    // and 4). They stand still until an epoch forms, so it forms now,
    // joiners included, rather than at the window's close: the window
    // batches joins while an epoch trains on, and a joiner ready a moment
    // later grows the new epoch at a step boundary, stalling nobody.
    const bool survivors_enough =
      c.survivors.size() >= o.min_replicas && 2 * c.survivors.size() > known;
    if (!c.lost.empty() && !survivors_enough)
      return form(all, "joining " + to_string(c.joiner_ids) + " admitted at once: the "
                         + std::to_string(c.survivors.size()) + " surviving of "
                         + groups(known) + " heard from are no quorum alone");
    d.pending = c.joiner_ids;
    d.retry_at_ms = closes;
    const std::string window =
      "joining " + to_string(c.joiner_ids) + " wait for the join window until " + t(closes);
    if (!c.lost.empty())
      return form(c.survivors, window);
    if (state.current.members.empty())
      return finish(decision_kind::wait, "no epoch yet: " + window);
    return keep_or_reform("epoch " + std::to_string(state.current.id) + " kept: " + window,
                          window);
  }
};

} // namespace

quorum_decision compute_quorum(const quorum_state& state, int64_t now_ms, const quorum_options& o) {
  CMESH_CHECK(!validate(o));
  const auto& cur = state.current;
  for (size_t i = 1; i < cur.members.size(); ++i)
    CMESH_CHECK_LT(cur.members[i - 1].group, cur.members[i].group);
  const auto c = classify(state, now_ms, o);
  decider k(state, now_ms, o, c);

  // 1. The fast path.
  if (c.lost.empty() && c.joiners.empty()) {
    if (cur.members.empty())
      return k.finish(decision_kind::wait, "no epoch yet and no live replica group registered");
    return k.keep_or_reform("epoch " + std::to_string(cur.id) + ": all "
                              + groups(cur.members.size()) + " live, nobody joining",
                            "");
  }
  std::vector<member> all = c.survivors;
  all.insert(all.end(), c.joiner_ids.begin(), c.joiner_ids.end());
  std::sort(all.begin(), all.end());
  // The majority is over the groups heard from: the live ones and those
  // still catching up (before the first epoch: at least the job's count).
  size_t known = all.size() + state.heard_not_ready;
  if (cur.members.empty())
    known = std::max<size_t>(known, state.expected_groups);

  // 2. Everybody dead.
  if (all.empty())
    return k.finish(decision_kind::fail, "every replica group of epoch " + std::to_string(cur.id)
                                           + " is dead: " + describe(c.lost)
                                           + "; restart from checkpoint needed");
  // 3. Too few groups.
  if (all.size() < o.min_replicas) {
    const std::string have = std::to_string(all.size()) + " live "
                             + (all.size() == 1 ? "group " : "groups ") + to_string(all)
                             + ", min_replicas " + std::to_string(o.min_replicas);
    if (c.joiners.empty())
      return k.finish(decision_kind::fail, "only " + have + " and none joining" + k.lost_text()
                                             + "; restart from checkpoint needed");
    return k.finish(decision_kind::wait, have + ", joining " + to_string(c.joiner_ids)
                                           + k.lost_text() + "; waiting for more groups");
  }
  // 4. No majority.
  if (2 * all.size() <= known)
    return k.finish(decision_kind::wait,
                    "no majority: " + std::to_string(all.size()) + " of " + groups(known)
                      + " live " + to_string(all) + k.lost_text()
                      + "; waiting (a minority must not go on alone)");
  // 5. The join window.
  if (!c.joiners.empty())
    if (auto w = k.join_window(all, known))
      return *w;
  // 6. A new epoch of every live group.
  return k.form(all, "");
}

} // namespace cmesh::recovery
