#include "actors/epoch_manager.hpp"

#include "core/env.hpp"
#include "recovery/roster.hpp"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <charconv>
#include <condition_variable>
#include <limits>
#include <map>
#include <mutex>
#include <thread>

namespace cmesh::actors {

namespace {

int64_t now_ms() {
  return mono_ns() / 1000000;
}

constexpr int64_t long_ago = std::numeric_limits<int64_t>::min() / 4;

using recovery::ranks_of_groups;
using recovery::ranks_of_members;

} // namespace

struct epoch_manager::impl {
  /// What the epoch manager knows of one rank's newest incarnation: the
  /// roster's report (what the decisions read), and the protocol's own.
  struct worker : recovery::rank_report {
    worker() { last_heartbeat_ms = long_ago; }
    wire::worker_status st; // its latest beacon
    uint64_t assigned_session = 0;
    int64_t registered_ms = 0;
  };

  coordinator& coord;
  epoch_manager_options o;
  std::shared_ptr<event_log> log;

  mutable std::mutex mu;
  std::condition_variable cv;
  bool stopping = false;
  bool dirty = true;
  std::map<uint32_t, worker> workers;
  recovery::epoch current; // its members are replica groups
  /// The ranks of the current epoch and their incarnations. A group's
  /// incarnation is the newest of its ranks': a restarted rank makes its
  /// whole group a new member.
  recovery::member_ranks member_ranks;
  recovery::quorum_decision last;
  int64_t waiting_since_ms = 0; // a broken epoch waiting for a quorum, since
  int64_t adopt_seen_ms = 0;    // a restarted coordinator first heard of a running epoch
  std::optional<std::string> failed;
  uint64_t next_session = 0;
  std::optional<std::pair<uint32_t, uint32_t>> newest_catchup; // (joiner, source)
  int64_t epoch_started_ms = 0;
  uint64_t max_member_step = 0;
  uint64_t epoch_base_step = 0;
  bool first_commit_seen = true;
  int64_t unresolved_failure_ms = 0; // the first failure no commit followed yet
  epoch_manager::recovery_summary stats;
  uint32_t reforms_in_a_row = 0; // broken epochs re-formed with no commit since
  /// The epoch before the current one, when the current one left nobody
  /// out of it (a grow or a re-form; 0 otherwise): its members may still
  /// run it until their agreed switch.
  uint64_t kept_everyone_of = 0;
  /// The current epoch's notice aborts the one before (it said so when it
  /// was announced, or went again to say so).
  bool aborts_previous = false;
  int64_t all_silent_since_ms = 0; // every connected member silent at once, since
  int64_t last_tick_ms = 0;        // the previous decision's time
  uint64_t divergence_step_seen = UINT64_MAX; // the last divergence report acted on
  uint64_t divergence_epoch_seen = 0;
  std::thread thread;

  impl(coordinator& c, epoch_manager_options opts, std::shared_ptr<event_log> l)
      : coord(c), o(std::move(opts)), log(std::move(l)) {}

  uint32_t S() const { return std::max<uint32_t>(1, o.ranks_per_group); }

  /// A member lost, or a step failed: the survivors' next commit ends it.
  void failure_at(int64_t now) {
    if (unresolved_failure_ms == 0)
      unresolved_failure_ms = now;
  }

  bool is_member(uint32_t rank, uint64_t inc) const {
    return recovery::is_member(member_ranks, rank, inc);
  }

  /// Makes `e` current; its groups' ranks with their present incarnations.
  void set_current(recovery::epoch e) {
    current = std::move(e);
    member_ranks.clear();
    for (auto r : ranks_of_members(current.members, S()))
      member_ranks[r] = workers[r].incarnation;
  }

  /// The roster the decisions read.
  recovery::roster roster() const {
    recovery::roster r;
    for (auto& [rank, w] : workers)
      r.emplace(rank, static_cast<const recovery::rank_report&>(w));
    return r;
  }

  recovery::group_options group_options() const {
    return {.ranks_per_group = S(),
            .heartbeat_timeout_ms = o.quorum.heartbeat_timeout_ms,
            .admit_ready = !(o.target_step != 0 && max_member_step >= o.target_step)};
  }

  void on_event(const worker_event& ev);
  bool beacon(uint32_t rank, worker& w, const wire::worker_status& st, int64_t now);
  void first_commit(uint64_t step, int64_t now);
  void broken(uint32_t rank, worker& w, const wire::worker_status& st, int64_t now);
  void on_divergence(uint32_t rank, const wire::replica_divergence& d, int64_t now);
  void fail_job(const std::string& reason);
  void run();
  void decide(int64_t now);
  bool adopt(int64_t now);
  void assign_catch_ups(int64_t now);
  void credit_stall(int64_t now);
  void apply(recovery::quorum_decision d, int64_t now);
  void lost(uint32_t rank, worker& w, const std::string& why, int64_t now);
  void on_peer_report(uint32_t reporter, const std::string& value, int64_t now);
  /// Members found dead since the last decision, with the notice that
  /// tells their peers: sent only if that decision's epoch did not leave
  /// them out already (one death, one notice).
  struct loss {
    uint32_t rank = 0;
    uint64_t incarnation = 0;
    wire::epoch_notice notice;
  };
  std::vector<loss> unannounced;
  void announce_losses();

  /// The notice of the current epoch: its ranks and their incarnations.
  wire::epoch_notice current_notice(std::string reason) const {
    wire::epoch_notice n;
    n.epoch = current.id;
    n.reason = std::move(reason);
    for (auto& [rank, inc] : member_ranks) {
      n.ranks.push_back(rank);
      n.incarnations.push_back(inc);
    }
    return n;
  }

  /// Pushes the (new) current epoch to every worker, starts timing its
  /// first commit from `base_step`, and logs it.
  void announce_epoch(int64_t now, uint64_t base_step, const std::string& reason,
                      std::vector<uint32_t> joined, std::vector<uint32_t> left,
                      bool abort_running = false) {
    auto n = current_notice(reason);
    n.abort_running = abort_running;
    coord.send_control(std::nullopt, n);
    epoch_started_ms = now;
    epoch_base_step = base_step;
    first_commit_seen = false;
    log->emit("epoch", {{"epoch", current.id},
                        {"members", n.ranks},
                        {"joined", std::move(joined)},
                        {"left", std::move(left)},
                        {"step", base_step},
                        {"abort_running", abort_running},
                        {"reason", reason}});
  }
  /// A line for the user (stdout), or for the process's log when printing
  /// is off. Called with the lock held: the log's writer thread does the
  /// I/O either way.
  void say(const std::string& line) {
    if (!o.print)
      return log->note("epoch manager: " + line);
    log->print("cmesh: " + line);
  }
};

void epoch_manager::impl::lost(uint32_t rank, worker& w, const std::string& why, int64_t now) {
  if (w.lost)
    return;
  w.lost = true;
  w.lost_ms = now;
  w.lost_why = why;
  bool member = is_member(rank, w.incarnation);
  if (member) {
    failure_at(now);
    ++stats.ranks_lost;
    // Its peers stop waiting for it once the next decision is made: by the
    // epoch that leaves it out, or, if none can form yet, by a notice of
    // the loss (announce_losses).
    auto n = current_notice(fmt::format("rank {} lost: {}", rank, why));
    n.lost = {rank};
    unannounced.push_back({rank, w.incarnation, std::move(n)});
  }
  say(fmt::format("rank {} lost{}: {}", rank, member ? "" : " (not a member)", why));
  log->emit("worker_lost", {{"rank", uint64_t{rank}},
                            {"incarnation", w.incarnation},
                            {"member", member},
                            {"reason", why}});
}

void epoch_manager::impl::announce_losses() {
  for (auto& l : unannounced)
    if (is_member(l.rank, l.incarnation))
      coord.send_control(std::nullopt, l.notice);
  unannounced.clear();
}

/// A worker's transport lost a peer ("RANK INCARNATION REASON"): believed
/// only where the coordinator's own view agrees (recovery::weigh_peer_report).
void epoch_manager::impl::on_peer_report(uint32_t reporter, const std::string& value,
                                         int64_t now) {
  uint32_t suspect = 0;
  uint64_t inc = 0;
  const char* end = value.data() + value.size();
  auto [p1, e1] = std::from_chars(value.data(), end, suspect);
  auto [p2, e2] = e1 == std::errc{} && p1 != end ? std::from_chars(p1 + 1, end, inc)
                                                 : std::from_chars_result{p1, std::errc::invalid_argument};
  if (e1 != std::errc{} || e2 != std::errc{}) {
    log->note(fmt::format("epoch manager: a malformed peer report from rank {}: '{}'", reporter,
                          value.substr(0, 80)));
    return;
  }
  const std::string why = p2 != end ? std::string(p2 + 1, end) : std::string();
  auto verdict = recovery::weigh_peer_report(roster(), member_ranks, reporter, suspect, inc, now,
                                             o.quorum.heartbeat_timeout_ms / 3);
  if (verdict == recovery::peer_report_verdict::lost) {
    lost(suspect, workers[suspect], fmt::format("rank {}'s transport lost it ({})", reporter, why),
         now);
  } else if (verdict == recovery::peer_report_verdict::heard_from) {
    log->emit("peer_report", {{"reporter", uint64_t{reporter}},
                              {"rank", uint64_t{suspect}},
                              {"incarnation", inc},
                              {"believed", false},
                              {"reason", why}});
  }
}

/// The first commit of the current epoch by a member: the epoch's start
/// and, after a failure, the failure timed to it.
void epoch_manager::impl::first_commit(uint64_t step, int64_t now) {
  first_commit_seen = true;
  reforms_in_a_row = 0;
  event_fields f{{"epoch", current.id},
                 {"step", step},
                 {"since_epoch_ms", static_cast<int64_t>(now - epoch_started_ms)}};
  // The first commit after a failure (an epoch grown by a join, long after,
  // is not a recovery): timed from the first failure found since the last
  // commit.
  std::string since;
  if (unresolved_failure_ms != 0) {
    const int64_t ms = now - unresolved_failure_ms;
    stats.failure_to_commit_ms.push_back(ms);
    unresolved_failure_ms = 0;
    f.emplace_back("since_failure_ms", ms);
    since = fmt::format(", {} ms after the failure", ms);
  }
  log->emit("first_commit", f);
  say(fmt::format("epoch {} committed step {}, {} ms after it began{}", current.id, step,
                  now - epoch_started_ms, since));
}

/// A rank reported that an epoch broke at it (its step failed, or it could
/// not build the epoch).
void epoch_manager::impl::broken(uint32_t rank, worker& w, const wire::worker_status& st,
                                 int64_t now) {
  w.broken_since_ms = now;
  const bool member = is_member(rank, w.incarnation);
  const bool current_epoch = member && st.broken_epoch == current.id;
  if (!current_epoch && !failed && !aborts_previous && member
      && st.broken_epoch == kept_everyone_of) {
    // The epoch before the current one broke after the current one was
    // announced (a join raced the failure). Its members switch at their
    // next agreed step boundary, which the broken step will never reach:
    // the current epoch goes again, telling them to abort that one now.
    aborts_previous = true;
    failure_at(now);
    auto n = current_notice(fmt::format("epoch {} broke at rank {} ({}) after epoch {} was "
                                        "announced",
                                        st.broken_epoch, rank, st.broken_reason, current.id));
    n.abort_running = true;
    coord.send_control(std::nullopt, n);
    say(n.reason + "; its members abort it");
  }
  if (current_epoch)
    failure_at(now);
  log->emit("epoch_broken", {{"rank", uint64_t{rank}},
                             {"epoch", st.broken_epoch},
                             {"current", current_epoch},
                             {"reason", st.broken_reason}});
  if (current_epoch && !failed)
    say(fmt::format("rank {}: epoch {} broke: {}", rank, st.broken_epoch, st.broken_reason));
}

/// A beacon of `ev.rank`'s newest incarnation. False when it is ignored (a
/// rank found dead stays out: it is fenced when it learns).
bool epoch_manager::impl::beacon(uint32_t rank, worker& w, const wire::worker_status& st,
                                 int64_t now) {
  w.last_heartbeat_ms = now;
  if (w.lost)
    return false;
  const bool member = is_member(rank, w.incarnation);
  if (st.state == wire::worker_status::ready && w.ready_since_ms == 0 && !member) {
    w.ready_since_ms = now;
    log->emit("catchup_ready",
              {{"rank", uint64_t{rank}}, {"session", st.session}, {"step", st.step}});
  } else if (st.state != wire::worker_status::ready) {
    w.ready_since_ms = 0;
  }
  if (!first_commit_seen && member && st.epoch == current.id && st.step > epoch_base_step)
    first_commit(st.step, now);
  if (st.broken_epoch != 0 && st.broken_epoch != w.st.broken_epoch)
    broken(rank, w, st, now);
  w.has_status = true;
  w.st = st;
  w.step = st.step;
  w.fresh = st.state == wire::worker_status::fresh;
  w.broken_epoch = st.broken_epoch;
  w.broken_reason = st.broken_reason;
  if (current.id == 0 && adopt_seen_ms == 0 && st.epoch > 0)
    adopt_seen_ms = now;
  if (member)
    max_member_step = std::max(max_member_step, st.step);
  return true;
}

void epoch_manager::impl::on_event(const worker_event& ev) {
  std::lock_guard lk(mu);
  auto now = now_ms();
  auto& w = workers[ev.rank];
  switch (ev.what) {
    case worker_event::type::registered:
      w = worker{};
      w.incarnation = ev.incarnation;
      w.connected = true;
      w.last_heartbeat_ms = now;
      w.registered_ms = now;
      log->emit("registered", {{"rank", uint64_t{ev.rank}}, {"incarnation", ev.incarnation}});
      break;
    case worker_event::type::status:
      if (ev.status.incarnation != w.incarnation)
        return; // a stale process that outlived its replacement
      if (!beacon(ev.rank, w, ev.status, now))
        return;
      break;
    case worker_event::type::disconnected:
      if (ev.incarnation != w.incarnation)
        return;
      w.connected = false;
      lost(ev.rank, w, "disconnected", now);
      break;
    case worker_event::type::report:
      if (ev.report.key != "peer_lost")
        return;
      on_peer_report(ev.rank, ev.report.value, now);
      break;
    case worker_event::type::divergence:
      on_divergence(ev.rank, ev.divergence, now);
      break;
  }
  dirty = true;
  cv.notify_all();
}

/// A member found that the replica groups' states differ: the minority's
/// ranks are taken out at once, as if dead (their peers retry the step
/// without them; they are fenced when the next epoch leaves them out, and
/// restart to catch up from the majority); with no majority the job ends.
void epoch_manager::impl::on_divergence(uint32_t rank, const wire::replica_divergence& d,
                                     int64_t now) {
  if (failed || (d.epoch == divergence_epoch_seen && d.step == divergence_step_seen))
    return;
  divergence_epoch_seen = d.epoch;
  divergence_step_seen = d.step;
  ++stats.divergences;
  const auto ranks = ranks_of_groups(d.minority, S());
  log->emit("replica_divergence", {{"epoch", d.epoch},
                                   {"step", d.step},
                                   {"reporter", uint64_t{rank}},
                                   {"groups", d.minority},
                                   {"ranks", ranks},
                                   {"no_majority", d.no_majority},
                                   {"shards", d.positions},
                                   {"tensors", d.tensors},
                                   {"reason", d.reason}});
  say(fmt::format("replica divergence at step {} in epoch {}: {}; differing: {}", d.step, d.epoch,
                  d.reason, d.tensors));
  if (d.no_majority) {
    fail_job(fmt::format("replica divergence at step {} with no majority to trust ({}); "
                         "restart from checkpoint needed",
                         d.step, d.reason));
    return;
  }
  for (auto r : ranks) {
    auto it = workers.find(r);
    if (it != workers.end() && is_member(r, it->second.incarnation))
      lost(r, it->second,
           fmt::format("diverged: its replica group's state differs from the majority's at "
                       "step {}",
                       d.step),
           now);
  }
}

/// Ends the job: every worker is told no epoch can form.
void epoch_manager::impl::fail_job(const std::string& reason) {
  if (failed)
    return;
  failed = reason;
  log->emit("failed", {{"epoch", current.id}, {"reason", reason}});
  say("no epoch can form: " + reason);
  wire::epoch_notice n;
  n.epoch = current.id;
  n.fail = true;
  n.reason = reason;
  coord.send_control(std::nullopt, n);
}

/// A restarted coordinator learns the running epoch from the workers'
/// beacons (after a settling second, so every survivor re-registered), and
/// re-forms it at once with the members it hears from.
bool epoch_manager::impl::adopt(int64_t now) {
  if (current.id != 0 || adopt_seen_ms == 0)
    return true;
  if (now - adopt_seen_ms < 1000)
    return false;
  uint64_t e = 0;
  for (auto& [rank, w] : workers)
    if (w.connected && w.has_status && w.st.incarnation == w.incarnation)
      e = std::max(e, w.st.epoch);
  // A group is adopted when all its ranks still train in that epoch.
  recovery::epoch adopted{e, {}};
  std::map<uint32_t, std::pair<uint32_t, uint64_t>> groups; // group -> (ranks, incarnation)
  for (auto& [rank, w] : workers) {
    if (!w.connected || !w.has_status || w.st.epoch != e)
      continue;
    if (w.st.state != wire::worker_status::training
        && w.st.state != wire::worker_status::recovering)
      continue;
    auto& g = groups[rank / S()];
    g.first += 1;
    g.second = std::max(g.second, w.incarnation);
    max_member_step = std::max(max_member_step, w.st.step);
  }
  for (auto& [g, v] : groups)
    if (v.first == S())
      adopted.members.push_back({g, v.second});
  set_current(adopted);
  say(fmt::format("adopted epoch {} {} from the workers", e, recovery::to_string(current.members)));
  log->emit("adopted", {{"epoch", e}, {"members", ranks_of_members(current.members, S())}});
  // The members of the running epoch that died while the coordinator was
  // away are unknown: a new epoch of those heard from drops them (the
  // others' running step is aborted and retried), and costs the healthy
  // case only a switch at the next step boundary.
  current.id = e + 1;
  auto reason = fmt::format("epoch {} re-formed after the coordinator returned", current.id);
  announce_epoch(now, max_member_step, reason, {}, {});
  say(reason);
  return true;
}

void epoch_manager::impl::decide(int64_t now) {
  if (failed)
    return; // the job is over: the workers leaving now form nothing
  if (!adopt(now))
    return;
  credit_stall(now);
  for (auto rank : recovery::silent_members(roster(), member_ranks, now,
                                            o.quorum.heartbeat_timeout_ms))
    lost(rank, workers[rank],
         fmt::format("silent for more than {} ms", o.quorum.heartbeat_timeout_ms), now);
  auto groups = recovery::group_participants(roster(), current, member_ranks, now,
                                             group_options());
  recovery::quorum_state qs;
  qs.current = current;
  qs.expected_groups = o.groups;
  qs.reforms_in_a_row = reforms_in_a_row;
  qs.participants = std::move(groups.participants);
  qs.heard_not_ready = groups.heard_not_ready;
  auto d = recovery::compute_quorum(qs, now, o.quorum);
  if (d.kind == recovery::decision_kind::wait && current.id != 0) {
    if (waiting_since_ms == 0)
      waiting_since_ms = now;
    if (now - waiting_since_ms > o.quorum_wait_ms) {
      d.kind = recovery::decision_kind::fail;
      d.reason = fmt::format("no quorum for {} ms ({}); restart from checkpoint needed",
                             o.quorum_wait_ms, d.reason);
    }
  } else {
    waiting_since_ms = 0;
  }
  apply(std::move(d), now);
}

/// Acts on the quorum's decision: logs a new reason to wait, fails the job,
/// or announces the new epoch.
void epoch_manager::impl::apply(recovery::quorum_decision d, int64_t now) {
  bool changed_reason = recovery::reason_changed(last, d);
  switch (d.kind) {
    case recovery::decision_kind::keep:
      break;
    case recovery::decision_kind::wait:
      if (changed_reason)
        log->emit("waiting", {{"epoch", current.id}, {"reason", d.reason}});
      break;
    case recovery::decision_kind::fail:
      fail_job(d.reason);
      break;
    case recovery::decision_kind::new_epoch: {
      set_current(d.epoch);
      uint64_t base = 0;
      for (auto& [rank, inc] : member_ranks)
        base = std::max(base, workers[rank].st.step);
      ++stats.epochs;
      if (d.reform) {
        ++reforms_in_a_row;
        ++stats.reforms;
      }
      kept_everyone_of = d.left.empty() ? current.id - 1 : 0;
      aborts_previous = d.abort_running;
      announce_epoch(now, base, d.reason, ranks_of_members(d.joined, S()), ranks_of_members(d.left, S()),
                     d.abort_running);
      for (auto r : ranks_of_members(d.joined, S()))
        if (workers[r].ready_since_ms != 0) {
          stats.rejoin_ms.push_back(now - workers[r].registered_ms);
          log->emit("catchup_end", {{"rank", uint64_t{r}},
                                    {"epoch", current.id},
                                    {"session", workers[r].st.session}});
        }
      say(fmt::format("epoch {} {} from step {}: {}", current.id,
                      recovery::to_string(current.members), base, d.reason));
      break;
    }
  }
  last = std::move(d);
}

/// Every connected member silent at once: more likely this process was held
/// up (a write to its log or event file throttled by the kernel while a
/// thread held this lock, its beacons unread) than all of them hanging
/// together (recovery::stall_credit).
void epoch_manager::impl::credit_stall(int64_t now) {
  const int64_t timeout = o.quorum.heartbeat_timeout_ms;
  const auto r = roster();
  auto v = recovery::stall_credit(r, member_ranks, now, timeout, all_silent_since_ms,
                                  10 * timeout, last_tick_ms);
  if (v.gap) {
    say(fmt::format("this process was held up for {} ms (no decision ran): every member gets "
                    "one more heartbeat timeout",
                    now - last_tick_ms));
    log->emit("stalled", {{"epoch", current.id}, {"ms", now - last_tick_ms}});
  }
  last_tick_ms = now;
  all_silent_since_ms = v.all_silent_since_ms;
  if (v.began) {
    say(fmt::format("every member has been silent for more than {} ms at once: waiting for "
                    "their beacons before taking any for dead",
                    timeout));
    log->emit("all_silent", {{"epoch", current.id}});
  }
  if (!v.credit)
    return;
  for (auto& [rank, inc] : member_ranks)
    if (recovery::attached_member(r, member_ranks, rank))
      workers[rank].last_heartbeat_ms = std::max(workers[rank].last_heartbeat_ms, *v.credit);
}

/// Sources for the ranks that need state (recovery::catch_up_sources): each
/// pair is told its session.
void epoch_manager::impl::assign_catch_ups(int64_t now) {
  if (current.id == 0 || failed)
    return;
  std::vector<uint32_t> joiners;
  for (auto& [rank, w] : workers) {
    if (!w.connected || w.lost || !w.has_status || is_member(rank, w.incarnation))
      continue;
    // Fresh, and it has seen (and failed) our latest assignment, or had none.
    if (w.st.state != wire::worker_status::fresh || w.st.session < w.assigned_session)
      continue;
    joiners.push_back(rank);
  }
  if (joiners.empty())
    return;
  for (auto [joiner, source] : recovery::catch_up_sources(roster(), member_ranks, joiners, now,
                                                          group_options(), next_session + 1)) {
    auto& w = workers[joiner];
    wire::catchup_assign a;
    a.session = ++next_session;
    a.joiner = joiner;
    a.joiner_incarnation = w.incarnation;
    a.source = source;
    w.assigned_session = a.session;
    ++stats.catchups;
    coord.send_control(a.joiner, a);
    coord.send_control(a.source, a);
    newest_catchup = std::pair{joiner, source};
    say(fmt::format("rank {} catches up from rank {} (session {})", joiner, source, a.session));
    log->emit("catchup_start", {{"rank", uint64_t{joiner}},
                                {"source", uint64_t{source}},
                                {"session", a.session},
                                {"step", max_member_step}});
  }
}

void epoch_manager::impl::run() {
  std::unique_lock lk(mu);
  while (!stopping) {
    cv.wait_for(lk, o.tick, [&] { return stopping || dirty; });
    if (stopping)
      break;
    dirty = false;
    auto now = now_ms();
    decide(now);
    announce_losses();
    assign_catch_ups(now);
  }
}

epoch_manager::epoch_manager(coordinator& coord, epoch_manager_options o, std::shared_ptr<event_log> log)
    : impl_(std::make_unique<impl>(coord, std::move(o), std::move(log))) {
  if (auto e = recovery::validate(impl_->o.quorum))
    throw std::invalid_argument(describe(e));
}

epoch_manager::~epoch_manager() {
  stop();
}

void epoch_manager::start() {
  auto* I = impl_.get();
  I->coord.on_event([I](const worker_event& ev) { I->on_event(ev); });
  I->thread = std::thread([I] { I->run(); });
}

namespace {

/// The median (nearest rank: the lower middle of an even count) and the
/// largest of `v`; 0 and 0 when it is empty.
std::pair<int64_t, int64_t> median_and_max(std::vector<int64_t> v) {
  if (v.empty())
    return {0, 0};
  std::sort(v.begin(), v.end());
  return {v[(v.size() - 1) / 2], v.back()};
}

} // namespace

std::string epoch_manager::recovery_summary::describe() const {
  const uint64_t failures = failure_to_commit_ms.size();
  if (ranks_lost == 0 && reforms == 0 && rejoin_ms.empty() && failures == 0 && divergences == 0)
    return {};
  std::string out = fmt::format("{} rank(s) lost, {} epoch(s) re-formed with every process "
                                "alive, {} epochs",
                                ranks_lost, reforms, epochs);
  if (divergences > 0)
    out += fmt::format("; {} replica divergence(s)", divergences);
  if (failures > 0) {
    auto [p50, max] = median_and_max(failure_to_commit_ms);
    out += fmt::format("; failure found to the next commit p50 {} ms, max {} ms ({})", p50, max,
                       failures);
  }
  if (!rejoin_ms.empty()) {
    auto [p50, max] = median_and_max(rejoin_ms);
    out += fmt::format("; {} catch-up session(s); registered to rejoined p50 {} ms, max {} ms "
                       "({} rank(s))",
                       catchups, p50, max, rejoin_ms.size());
  }
  return out;
}

epoch_manager::recovery_summary epoch_manager::summary() const {
  std::lock_guard lk(impl_->mu);
  return impl_->stats;
}

void epoch_manager::stop() {
  {
    std::lock_guard lk(impl_->mu);
    if (impl_->stopping)
      return;
    impl_->stopping = true;
  }
  impl_->cv.notify_all();
  impl_->coord.on_event({});
  if (impl_->thread.joinable())
    impl_->thread.join();
  {
    std::lock_guard lk(impl_->mu);
    const auto& st = impl_->stats;
    auto [commit_p50, commit_max] = median_and_max(st.failure_to_commit_ms);
    auto [rejoin_p50, rejoin_max] = median_and_max(st.rejoin_ms);
    impl_->log->emit("recovery_summary",
                     {{"epochs", st.epochs},
                      {"ranks_lost", st.ranks_lost},
                      {"reforms", st.reforms},
                      {"divergences", st.divergences},
                      {"catchups", st.catchups},
                      {"failures_resolved", uint64_t{st.failure_to_commit_ms.size()}},
                      {"failure_to_commit_p50_ms", commit_p50},
                      {"failure_to_commit_max_ms", commit_max},
                      {"rejoined", uint64_t{st.rejoin_ms.size()}},
                      {"rejoin_p50_ms", rejoin_p50},
                      {"rejoin_max_ms", rejoin_max}});
  }
  // What it said before stopping comes before what the caller prints next.
  impl_->log->flush(std::chrono::seconds(5));
}

std::optional<std::string> epoch_manager::failure() const {
  std::lock_guard lk(impl_->mu);
  return impl_->failed;
}

std::vector<uint32_t> epoch_manager::members() const {
  std::lock_guard lk(impl_->mu);
  return ranks_of_members(impl_->current.members, impl_->S());
}

uint64_t epoch_manager::epoch() const {
  std::lock_guard lk(impl_->mu);
  return impl_->current.id;
}

epoch_manager::view epoch_manager::snapshot() const {
  auto& I = *impl_;
  std::lock_guard lk(I.mu);
  view v;
  v.epoch = I.current.id;
  v.max_member_step = I.max_member_step;
  auto now = now_ms();
  for (auto& [rank, w] : I.workers) {
    rank_view r;
    r.rank = rank;
    r.incarnation = w.incarnation;
    r.member = I.is_member(rank, w.incarnation);
    r.live = w.connected && !w.lost
             && !recovery::heartbeat_expired(w.last_heartbeat_ms, now, I.o.quorum.heartbeat_timeout_ms);
    r.state = w.st.state;
    r.step = w.st.step;
    v.ranks.push_back(r);
  }
  if (I.newest_catchup) {
    auto [joiner, source] = *I.newest_catchup;
    auto it = I.workers.find(joiner);
    if (it != I.workers.end() && !I.is_member(joiner, it->second.incarnation))
      v.catchup_source = source;
  }
  return v;
}

void epoch_manager::note(std::string_view event, const event_fields& fields) {
  // With the members' step at that moment, so that an outside reader can
  // place the event among the steps (a restart, for one).
  auto all = fields;
  if (std::none_of(all.begin(), all.end(), [](auto& f) { return f.first == "step"; })) {
    std::lock_guard lk(impl_->mu);
    all.emplace_back("step", impl_->max_member_step);
  }
  impl_->log->emit(event, all);
}

} // namespace cmesh::actors
