#include "actors/supervisor.hpp"

#include "actors/catchup.hpp"

#include "core/check.hpp"
#include "core/env.hpp"
#include "core/pages.hpp"
#include "core/spawn.hpp"
#include "transport/join.hpp"
#include "transport/mesh.hpp"
#ifdef CMESH_HAVE_NCCL
#include "collectives/nccl/nccl_communicator.hpp"
#endif

#include <caf/all.hpp>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <thread>
#include <unistd.h>

namespace cmesh::actors {

namespace {

using namespace std::chrono_literals;

bool includes(const wire::epoch_notice& n, uint32_t rank, uint64_t incarnation) {
  for (size_t i = 0; i < n.ranks.size(); ++i)
    if (n.ranks[i] == rank && (i >= n.incarnations.size() || n.incarnations[i] == incarnation))
      return true;
  return false;
}

bool has_rank(const std::vector<uint32_t>& ranks, uint32_t rank) {
  return std::find(ranks.begin(), ranks.end(), rank) != ranks.end();
}

} // namespace

/// A catch-up snapshot's buffers: the layout's range as one mapping. On
/// huge pages a small model's whole state is then a single page fault
/// where four arrays were hundreds (2 MB: 5.5 ms of faults on these VMs).
struct snapshot_buffers {
  snapshot_layout layout;
  std::array<std::span<float>, 4> parts;
  page_array memory;

  static snapshot_buffers sized(const std::array<size_t, 4>& n, page_array::pages kind) {
    const snapshot_layout l(n);
    snapshot_buffers b{l, {}, page_array(l.total, kind)};
    for (size_t i = 0; i < n.size(); ++i)
      b.parts[i] = {b.memory.data() + b.layout.at[i], n[i]};
    return b;
  }
};

/// What the supervisor actor publishes for the threads that wait in
/// collectives (their peer-status checks) and for the trainer's fast paths:
/// an immutable copy, replaced on each change.
struct supervisor_view {
  bool stopping = false;
  std::optional<std::string> failed;           // the coordinator gave up: why
  std::map<uint32_t, uint64_t> lost;           // rank -> the epoch it was lost in
  std::map<uint32_t, uint64_t> lost_count;     // rank -> losses heard of
  uint64_t newest_epoch = 0;                   // 0: none yet
  std::vector<uint32_t> newest_ranks;
  bool snapshot_owed = false; // a prepared session waits for the next boundary
  bool streaming = false;     // a session takes the committed updates
  uint64_t join_session = 0; // the newest catch-up session assigned to this rank as joiner
  std::shared_ptr<coordinator_client> client;

  uint64_t losses(uint32_t r) const {
    auto it = lost_count.find(r);
    return it == lost_count.end() ? 0 : it->second;
  }
};

struct view_cell {
  std::atomic<std::shared_ptr<const supervisor_view>> v;
  std::shared_ptr<const supervisor_view> get() const { return v.load(std::memory_order_acquire); }
};

/// One joiner this rank serves: what the serving helper and the supervisor
/// share. The snapshot's buffers go by message: from the helper (prepared)
/// through the supervisor to the trainer's thread (owed), which copies the
/// state into them, and back to the helper (taken), which sends them.
struct session_shared {
  wire::catchup_assign assign;
  std::atomic<bool> cancelled{false}; // replaced, cut off, or stopped
};
using session_ptr = std::shared_ptr<session_shared>;

// ---- Messages to and from the supervisor actor (local only) ----

using ctl_atom = caf::atom_constant<caf::atom("ctl")>;
using beacon_atom = caf::atom_constant<caf::atom("beacon")>;
using computing_atom = caf::atom_constant<caf::atom("computing")>;
using owed_atom = caf::atom_constant<caf::atom("owed")>;
using taken_atom = caf::atom_constant<caf::atom("taken")>;
using enter_atom = caf::atom_constant<caf::atom("enter")>;
using enter_to_atom = caf::atom_constant<caf::atom("enterto")>;
using abort_atom = caf::atom_constant<caf::atom("abort")>;
using stop_atom = caf::atom_constant<caf::atom("stop")>;
using shutdown_atom = caf::atom_constant<caf::atom("shutdown")>;
using streamed_atom = caf::atom_constant<caf::atom("streamed")>;
using send_snap_atom = caf::atom_constant<caf::atom("sendsnap")>;
using end_atom = caf::atom_constant<caf::atom("end")>;

/// The state at a step boundary: the step and the state's sizes.
struct boundary_msg {
  uint64_t step = 0;
  std::array<size_t, 4> sizes{};
};

/// A committed step, with its update when a session streams.
struct commit_msg {
  uint64_t k = 0;
  std::shared_ptr<const std::vector<float>> update;
};

/// A change of the beaconed status (sent at once).
struct status_msg {
  std::optional<uint8_t> state;
  std::optional<uint64_t> step, epoch, session;
  /// An epoch that broke on this rank, and why (the coordinator re-forms
  /// it if no death explains it).
  std::optional<std::pair<uint64_t, std::string>> broken;
  bool send = true;
};

/// What the trainer does next, the answer to enter_atom.
struct enter_reply {
  enum class kind : uint8_t { error, snapshot, join, epoch } what = kind::error;
  caf::error err;
  wire::epoch_notice notice;   // epoch
  wire::catchup_assign assign; // join
  uint64_t source_losses = 0;  // join: losses of its source heard of when it came
};

struct enter_msg {
  uint64_t after = 0;
  bool member_before = false;
};

/// A communicator the trainer built (or forgets: c empty), kept by the
/// supervisor only to abort it. Every holder but the trainer's thread lets
/// go of it first, so a communicator always dies on the thread that used it.
struct comm_reg {
  enum class kind : uint8_t { epoch, part, device } what = kind::epoch;
  size_t slot = 0;
  std::shared_ptr<coll::communicator> c;
};

/// From a serving helper: its joiner asked, and the buffers are ready.
struct prepared_msg {
  uint64_t session = 0;
  std::shared_ptr<snapshot_buffers> buf;
};
/// A joiner's request, handed by the supervisor to the session's helper
/// with the joiner's address (the request's sender, a mesh proxy).
struct joiner_request {
  wire::catchup_request r;
  caf::actor from;
};
/// A snapshot the trainer owes a session, and then has taken.
struct owed_snapshot {
  uint64_t session = 0;
  uint32_t joiner = 0;
  uint64_t step = 0;
  std::shared_ptr<snapshot_buffers> buf;
};
struct session_end_msg {
  uint64_t session = 0;
  bool clean = false;
};
struct finished_msg {
  uint64_t step = 0;
  wire::report done;
};
struct watch_msg {
  caf::actor a;
  std::string what;
  std::function<void(const caf::error&)> restart; // empty: the rank fails with it
};
struct reconnected_msg {
  std::shared_ptr<coordinator_client> c; // empty: the attempt failed
};
struct owed_list {
  std::vector<owed_snapshot> sessions;
};

} // namespace cmesh::actors

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(cmesh::control_message)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(cmesh::actors::boundary_msg)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(cmesh::actors::commit_msg)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(cmesh::actors::status_msg)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(cmesh::actors::enter_reply)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(cmesh::actors::enter_msg)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(cmesh::actors::comm_reg)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(cmesh::actors::prepared_msg)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(cmesh::actors::session_end_msg)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(cmesh::actors::finished_msg)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(cmesh::actors::reconnected_msg)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(cmesh::actors::watch_msg)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(cmesh::actors::owed_list)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(cmesh::actors::owed_snapshot)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(cmesh::actors::joiner_request)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(cmesh::wire::report)

namespace cmesh::actors {

namespace {

/// The supervisor actor's record of a session it serves.
struct session_rec {
  session_ptr sh;
  caf::actor helper;                     // spawned once the state's sizes are known
  std::shared_ptr<snapshot_buffers> buf; // from prepared until the snapshot is taken
  bool want_snapshot = true;             // until the trainer copies it
  bool end = false;                      // the stream's end was sent to the helper
  bool broken = false;                   // cut off, replaced or failed
  size_t backlog = 0;                    // updates forwarded and not acknowledged by the joiner
  bool prepared() const { return buf != nullptr; }
  /// Prepared, and waiting for the trainer's copy at its next boundary.
  bool owes_snapshot() const { return !broken && want_snapshot && prepared(); }
  /// Taking the committed updates.
  bool streaming() const { return !broken && !want_snapshot && !end; }
};

struct supervisor_state;
using supervisor_self = caf::stateful_actor<supervisor_state>;

struct supervisor_state {
  supervisor_self* self = nullptr;
  supervisor_options o;
  std::shared_ptr<view_cell> pub;
  std::shared_ptr<coordinator_client> client;
  bool connected = true;
  bool reconnecting = false;
  std::optional<wire::report> done_report; // re-sent after a reconnect
  bool stopping = false;
  std::optional<wire::epoch_notice> newest; // the newest non-failing epoch
  std::optional<wire::epoch_notice> failed; // the coordinator gave up
  std::optional<wire::catchup_assign> join; // the newest assignment as joiner
  uint64_t join_source_losses = 0;          // lost_count[join->source] when it came
  uint64_t join_done = 0;                   // sessions handed to the trainer up to here
  std::map<uint32_t, uint64_t> lost;        // rank -> the epoch it was lost in
  std::map<uint32_t, uint64_t> lost_count;  // rank -> losses heard of (any incarnation)
  // The trainer's communicators, held to abort them (comm_reg).
  std::shared_ptr<coll::communicator> comm;
  std::array<std::shared_ptr<coll::communicator>, 2> parts, devs;
  std::shared_ptr<std::atomic<bool>> dev_abort; // stops an NCCL creation in progress
  std::map<uint64_t, session_rec> sessions; // as source, by session id
  /// Sizes of this rank's params, moments and scalars, from the trainer's
  /// step boundaries: a helper prepares snapshot buffers of these sizes.
  std::optional<std::array<size_t, 4>> state_sizes;
  wire::worker_status status;
  bool announce_commit = false; // the first commit of an epoch is beaconed at once
  int64_t computing_since = 0;  // mono_ns of the running computation's start, 0: none
  struct waiter {
    caf::response_promise rp;
    enter_msg req;
    uint64_t id = 0;
  };
  std::optional<waiter> waiting; // the trainer's enter_epoch, until it can be answered
  uint64_t waits = 0;
  std::map<caf::actor_addr, watch_msg> watched;
  std::set<std::pair<uint32_t, uint64_t>> reported; // peers reported lost

  void publish();
  void on_peer_down(uint32_t rank, uint64_t incarnation, const std::string& why);
  void send_status();
  void apply_status(const status_msg& m);
  void beacon();
  void on_notice(const wire::epoch_notice& n);
  void on_assign(const wire::catchup_assign& a);
  void dial(const std::vector<rank_incarnation>& wanted);
  void redial_partners();
  void abort_epoch(const caf::error& why);
  void abort_if_left_out();
  void answer();
  void deliver(enter_reply r);
  void end_streams(const wire::epoch_notice& n);
  void spawn_helpers();
  void cut_off(session_rec& s, const caf::error& why);
  void on_commit(const commit_msg& m);
  owed_list owed();
  void register_comm(comm_reg& r);
  void stop();
  void reconnect();
  void on_reconnected(const std::shared_ptr<coordinator_client>& c);
  void on_down(const caf::down_msg& d);
  void install_control(coordinator_client& c);
};

void supervisor_state::publish() {
  auto v = std::make_shared<supervisor_view>();
  v->stopping = stopping;
  if (failed)
    v->failed = failed->reason;
  v->lost = lost;
  v->lost_count = lost_count;
  if (newest) {
    v->newest_epoch = newest->epoch;
    v->newest_ranks = newest->ranks;
  }
  for (auto& [id, s] : sessions) {
    v->snapshot_owed = v->snapshot_owed || s.owes_snapshot();
    v->streaming = v->streaming || s.streaming();
  }
  v->join_session = join ? join->session : 0;
  v->client = client;
  pub->v.store(std::move(v), std::memory_order_release);
}

void supervisor_state::send_status() {
  auto s = status;
  s.mono_ns = mono_ns();
  // The coordinator may be gone for a while: training goes on meanwhile,
  // and the beacon reconnects.
  if (client->send_status(s))
    connected = false;
}

void supervisor_state::apply_status(const status_msg& m) {
  if (m.state)
    status.state = *m.state;
  if (m.step)
    status.step = *m.step;
  if (m.epoch)
    status.epoch = *m.epoch;
  if (m.session)
    status.session = *m.session;
  if (m.broken) {
    status.broken_epoch = m.broken->first;
    status.broken_reason = m.broken->second.substr(0, 240); // a beacon's size
  }
  if (m.send)
    send_status();
}

void supervisor_state::beacon() {
  if (stopping)
    return;
  if (o.step_timeout.count() > 0 && computing_since != 0
      && mono_ns() - computing_since > o.step_timeout.count() * 1000000) {
    // The step watchdog: this rank's computation hangs. Say so and end the
    // process; its peers are told by its closed connection at once.
    auto why = fmt::format("step watchdog: rank {} computed for more than {} ms", o.rank,
                           o.step_timeout.count());
    spdlog::error("supervisor: {}; ending the process", why);
    (void) client->report({o.rank, "failed", why, mono_ns()});
    std::this_thread::sleep_for(std::chrono::milliseconds(50)); // let the report leave
    std::_Exit(exit_hung);
  }
  if (!connected && o.coordinator)
    reconnect();
  else
    send_status();
  redial_partners();
  self->delayed_send(self, o.beacon_interval, beacon_atom::value);
}

/// A helper connects to a restarted coordinator (a connect waits up to half
/// a second) and reports back.
void supervisor_state::reconnect() {
  if (reconnecting)
    return;
  reconnecting = true;
  spawn_blocking(self->home_system(), [sup = caf::actor_cast<caf::actor>(self), where = *o.coordinator,
                                       reg = o.registration](caf::blocking_actor*) {
    std::shared_ptr<coordinator_client> fresh;
    if (auto c = coordinator_client::connect(where, std::chrono::milliseconds(500))) {
      auto made = std::make_shared<coordinator_client>(std::move(*c));
      if (!made->rejoin(reg))
        fresh = std::move(made);
    }
    caf::anon_send(sup, reconnected_msg{std::move(fresh)});
  });
}

void supervisor_state::install_control(coordinator_client& c) {
  c.on_control([sup = caf::actor_cast<caf::actor>(self)](const control_message& m) {
    caf::anon_send(sup, ctl_atom::value, m);
  });
}

void supervisor_state::on_reconnected(const std::shared_ptr<coordinator_client>& c) {
  reconnecting = false;
  if (!c || stopping)
    return;
  install_control(*c);
  client = c;
  connected = true;
  spdlog::warn("supervisor: rank {} reconnected to the coordinator at {}", o.rank,
               o.coordinator->to_string());
  send_status();
  if (done_report)
    (void) client->report(*done_report);
  publish();
}

/// Aborts the current epoch's communicators and their parts.
void supervisor_state::abort_epoch(const caf::error& why) {
  if (comm)
    comm->abort(why);
  for (auto& p : parts)
    if (p)
      p->abort(why);
  for (auto& d : devs)
    if (d)
      d->abort(why);
  dev_abort->store(true);
}

void supervisor_state::abort_if_left_out() {
  if (failed) {
    if (comm)
      abort_epoch(make_error(errc::unrecoverable, failed->reason));
    return;
  }
  if (comm) {
    for (auto r : comm->members().ranks) {
      if (auto it = lost.find(r); it != lost.end() && it->second >= comm->members().epoch) {
        abort_epoch(make_error(errc::peer_lost,
                               fmt::format("rank {} was lost in epoch {}", r, it->second)));
        break;
      }
    }
  }
  if (!newest)
    return;
  if (comm && newest->epoch > comm->members().epoch && newest->abort_running) {
    // The running epoch broke though its members live: nobody is coming
    // back to its collectives.
    abort_epoch(make_error(errc::aborted, fmt::format("epoch {} replaces the broken epoch {}",
                                                      newest->epoch, comm->members().epoch)));
  } else if (comm && newest->epoch > comm->members().epoch) {
    for (auto r : comm->members().ranks) {
      bool stays = has_rank(newest->ranks, r)
                   && (r != o.rank || includes(*newest, o.rank, o.incarnation));
      if (!stays) {
        abort_epoch(make_error(errc::peer_lost, fmt::format("epoch {} left out rank {} ({})",
                                                            newest->epoch, r, newest->reason)));
        break;
      }
    }
  }
}

/// The mesh follows the membership: `wanted` dialled at the addresses of
/// the latest peer table.
void supervisor_state::dial(const std::vector<rank_incarnation>& wanted) {
  if (o.net == nullptr || !client)
    return;
  auto table = client->latest_table();
  if (!table)
    return;
  for (auto& e : entries_to_dial(*table, wanted, o.rank))
    if (auto err = o.net->connect_peer(e))
      spdlog::warn("supervisor: cannot dial rank {} (incarnation {}): {}", e.rank, e.incarnation,
                   describe(err));
}

/// Catch-up partners the transport does not hold at the incarnation their
/// session names (the peer table that brought a joiner's address came
/// after its assignment, or a dial failed) are dialled again at each beacon.
void supervisor_state::redial_partners() {
  if (o.net == nullptr || stopping)
    return;
  std::vector<rank_incarnation> wanted;
  for (auto& [id, s] : sessions) {
    const auto& a = s.sh->assign;
    if (!s.broken && !s.end && o.net->peer_incarnation(a.joiner) != a.joiner_incarnation)
      wanted.push_back({a.joiner, a.joiner_incarnation});
  }
  if (join && join->session > 0 && o.net->peer_incarnation(join->source) == 0)
    wanted.push_back({join->source, 0});
  if (!wanted.empty())
    dial(wanted);
}

void supervisor_state::on_notice(const wire::epoch_notice& n) {
  if (n.fail) {
    failed = n;
  } else if (!n.lost.empty()) {
    for (auto r : n.lost) {
      lost[r] = std::max(lost[r], n.epoch);
      ++lost_count[r];
    }
  } else if (!newest || n.epoch > newest->epoch) {
    newest = n;
    std::vector<rank_incarnation> members;
    for (size_t i = 0; i < n.ranks.size() && i < n.incarnations.size(); ++i)
      members.push_back({n.ranks[i], n.incarnations[i]});
    dial(members);
  } else if (n.epoch == newest->epoch && n.abort_running) {
    // The newest epoch again: the one before it broke after it came.
    newest->abort_running = true;
  }
  abort_if_left_out();
}

void supervisor_state::on_assign(const wire::catchup_assign& a) {
  if (a.joiner == o.rank && a.joiner_incarnation == o.incarnation) {
    dial({{a.source, 0}}); // a member: the table's entry is its running incarnation
    if (!join || a.session > join->session) { // a session in progress ends (view.join_session)
      join = a;
      join_source_losses = lost_count[a.source];
    }
    return;
  }
  if (a.source != o.rank || sessions.count(a.session))
    return;
  dial({{a.joiner, a.joiner_incarnation}});
  // A new session for the same joiner replaces the old one.
  for (auto& [id, s] : sessions)
    if (s.sh->assign.joiner == a.joiner && !s.broken)
      cut_off(s, make_error(errc::aborted, "replaced by a newer session"));
  session_rec s;
  s.sh = std::make_shared<session_shared>();
  s.sh->assign = a;
  sessions.emplace(a.session, std::move(s));
  spdlog::info("supervisor: rank {} is the catch-up source of rank {} (session {})", o.rank,
               a.joiner, a.session);
  spawn_helpers();
}

void supervisor_state::cut_off(session_rec& s, const caf::error& why) {
  s.broken = true;
  s.backlog = 0;
  s.sh->cancelled.store(true);
  if (s.helper)
    caf::anon_send(s.helper, stop_atom::value, why);
}

void supervisor_state::on_commit(const commit_msg& m) {
  status.step = m.k + 1;
  if (announce_commit) {
    // The coordinator times recovery by this beacon: send it now, not at
    // the next beacon tick.
    announce_commit = false;
    send_status();
  }
  bool cut = false;
  for (auto& [id, s] : sessions) {
    if (!s.streaming())
      continue;
    if (s.backlog >= o.stream_max) {
      spdlog::warn("supervisor: rank {} fell {} steps behind its catch-up stream; cutting it off",
                   s.sh->assign.joiner, s.backlog);
      cut_off(s, make_error(errc::queue_full, "catch-up stream overflow"));
      cut = true;
    } else if (!m.update) {
      cut_off(s, make_error(errc::invalid_argument, "a committed step came without its update"));
      cut = true;
    } else {
      ++s.backlog;
      self->send(s.helper, m);
    }
  }
  if (cut)
    publish();
}

/// The sessions whose snapshot the trainer copies now, at a step boundary.
owed_list supervisor_state::owed() {
  owed_list out;
  for (auto& [id, s] : sessions) {
    if (!s.owes_snapshot())
      continue;
    s.want_snapshot = false;
    out.sessions.push_back({id, s.sh->assign.joiner, 0, std::move(s.buf)});
  }
  publish(); // streaming from here: the trainer sends its next update
  return out;
}

void supervisor_state::deliver(enter_reply r) {
  waiting->rp.deliver(std::move(r));
  waiting.reset();
}

enter_reply failure(caf::error e) {
  enter_reply r;
  r.err = std::move(e);
  return r;
}

/// Streams to joiners admitted by epoch `n` end at the switch: their last
/// update is the one committed just before it.
void supervisor_state::end_streams(const wire::epoch_notice& n) {
  for (auto& [id, s] : sessions) {
    if (s.broken || s.end || !has_rank(n.ranks, s.sh->assign.joiner))
      continue;
    s.end = true;
    if (s.helper)
      self->send(s.helper, end_atom::value);
  }
  publish();
}

/// Answers the trainer's enter_epoch once there is something to do.
void supervisor_state::answer() {
  if (!waiting)
    return;
  auto& w = waiting->req;
  const bool snapshot_owed =
    w.member_before && std::any_of(sessions.begin(), sessions.end(), [](auto& kv) {
      return kv.second.owes_snapshot();
    });
  if (!stopping && snapshot_owed) {
    // A member waiting for its next epoch is at a step boundary: it can
    // serve a joiner now (this is how a quorum lost to several deaths at
    // once is rebuilt from the survivors).
    enter_reply r;
    r.what = enter_reply::kind::snapshot;
    return deliver(std::move(r));
  }
  if (stopping)
    return deliver(failure(make_error(errc::closed, "the supervisor stopped")));
  if (failed)
    return deliver(failure(make_error(errc::unrecoverable, failed->reason)));
  if (!w.member_before && join && join->session > join_done) {
    join_done = join->session;
    enter_reply r;
    r.what = enter_reply::kind::join;
    r.assign = *join;
    r.source_losses = join_source_losses;
    return deliver(std::move(r));
  }
  if (!newest || newest->epoch <= w.after)
    return;
  if (!includes(*newest, o.rank, o.incarnation)) {
    if (w.member_before)
      return deliver(failure(make_error(
        errc::fenced, fmt::format("rank {} (incarnation {:x}) was left out of epoch {}: {}", o.rank,
                                  o.incarnation, newest->epoch, newest->reason))));
    w.after = newest->epoch; // not ours yet: wait for a catch-up or a later epoch
    return;
  }
  end_streams(*newest);
  enter_reply r;
  r.what = enter_reply::kind::epoch;
  r.notice = *newest;
  deliver(std::move(r));
}

void serve_session(caf::blocking_actor* self, caf::actor sup, session_ptr sh,
                   supervisor_options o, std::array<size_t, 4> sizes,
                   std::shared_ptr<view_cell> pub);

void supervisor_state::spawn_helpers() {
  if (!state_sizes || stopping)
    return;
  for (auto& [id, s] : sessions) {
    if (s.helper || s.broken)
      continue;
    if (s.end) { // its joiner was admitted before it could start
      s.broken = true;
      continue;
    }
    s.helper = self->home_system().spawn(serve_session, caf::actor_cast<caf::actor>(self), s.sh, o,
                                         *state_sizes, pub);
  }
}

void supervisor_state::register_comm(comm_reg& r) {
  using kind = comm_reg::kind;
  switch (r.what) {
    case kind::epoch:
      for (auto& p : parts)
        p.reset(); // the last epoch's parts (the trainer is done with them)
      comm = std::move(r.c);
      if (!comm)
        return;
      abort_if_left_out(); // an epoch newer still may have come meanwhile
      status.state = wire::worker_status::training;
      status.epoch = comm->members().epoch;
      status.session = 0;
      announce_commit = true;
      send_status();
      return;
    case kind::part:
      parts.at(r.slot) = std::move(r.c);
      break;
    case kind::device:
      devs.at(r.slot) = std::move(r.c);
      break;
  }
  abort_if_left_out();
}

void supervisor_state::stop() {
  if (stopping)
    return;
  stopping = true;
  auto why = make_error(errc::closed, "the supervisor is stopping");
  abort_epoch(why);
  for (auto& [id, s] : sessions)
    cut_off(s, why);
  client->on_control({});
  publish();
  answer();
}

/// The transport fenced a peer: a member of the newest epoch is reported
/// to the coordinator once, which weighs it against what it hears itself
/// (recovery::weigh_peer_report) and, if it agrees, leaves it out of the
/// next epoch. Peers that are not members (a superseded incarnation, a
/// joiner) and losses at the end of the job are not reported.
void supervisor_state::on_peer_down(uint32_t rank, uint64_t incarnation, const std::string& why) {
  if (stopping || done_report || incarnation == 0 || rank == o.rank)
    return;
  if (!newest || !includes(*newest, rank, incarnation) || !reported.emplace(rank, incarnation).second)
    return;
  spdlog::warn("supervisor: rank {}'s transport lost rank {} (incarnation {:x}): {}; reported", o.rank,
               rank, incarnation, why);
  (void) client->report({o.rank, "peer_lost", fmt::format("{} {} {}", rank, incarnation, why),
                         mono_ns()});
}

/// A watched local actor that dies with an error takes the rank with it:
/// the coordinator hears of it at once, the survivors go on, and the
/// launcher restarts this rank as a new incarnation.
void supervisor_state::on_down(const caf::down_msg& d) {
  auto it = watched.find(d.source);
  if (it == watched.end())
    return;
  auto w = std::move(it->second);
  watched.erase(it);
  if (!d.reason || d.reason == caf::exit_reason::normal
      || d.reason == caf::exit_reason::user_shutdown || stopping)
    return;
  auto why = fmt::format("the {} actor of rank {} died: {}", w.what, o.rank,
                         d.reason.category() == error_category
                           ? describe(d.reason)
                           : self->home_system().render(d.reason));
  if (w.restart) {
    spdlog::warn("supervisor: {}; restarting it", why);
    w.restart(d.reason);
    return;
  }
  spdlog::error("supervisor: {}; ending the process", why);
  (void) client->report({o.rank, "failed", why, mono_ns()});
  std::this_thread::sleep_for(std::chrono::milliseconds(50)); // let the report leave
  std::_Exit(exit_actor_failed);
}

/// Coordinator pushes, the beacon, and what the trainer tells at each step.
caf::message_handler coordinator_and_steps(supervisor_self* self) {
  return {
    [self](ctl_atom, const control_message& m) {
      auto& S = self->state;
      if (auto* n = std::get_if<wire::epoch_notice>(&m))
        S.on_notice(*n);
      else if (auto* a = std::get_if<wire::catchup_assign>(&m))
        S.on_assign(*a);
      S.publish();
      S.answer();
    },
    [self](beacon_atom) { self->state.beacon(); },
    [self](computing_atom, bool on) { self->state.computing_since = on ? mono_ns() : 0; },
    [self](const boundary_msg& m) {
      auto& S = self->state;
      S.status.step = m.step;
      const bool first = !S.state_sizes;
      S.state_sizes = m.sizes;
      if (first)
        S.spawn_helpers();
    },
    [self](owed_atom) { return self->state.owed(); },
    [self](taken_atom, const owed_snapshot& t) {
      auto& S = self->state;
      if (auto it = S.sessions.find(t.session); it != S.sessions.end() && !it->second.broken)
        self->send(it->second.helper, send_snap_atom::value, t);
    },
    [self](const commit_msg& m) { self->state.on_commit(m); },
    [self](const status_msg& m) { self->state.apply_status(m); },
  };
}

/// The trainer's enter_epoch and the communicators it builds.
caf::message_handler epochs(supervisor_self* self) {
  return {
    [self](const enter_msg& m) {
      auto& S = self->state;
      if (S.waiting) // the trainer gave up on it
        S.deliver(failure(make_error(errc::aborted, "a newer enter_epoch replaced this one")));
      S.waiting = supervisor_state::waiter{self->make_response_promise(), m, ++S.waits};
      self->delayed_send(self, S.o.epoch_wait, enter_to_atom::value, S.waits);
      S.answer();
    },
    [self](enter_to_atom, uint64_t id) {
      auto& S = self->state;
      if (!S.waiting || S.waiting->id != id)
        return;
      S.deliver(failure(make_error(
        errc::timeout, fmt::format("rank {}: no epoch after {} within {} s", S.o.rank,
                                   S.waiting->req.after,
                                   std::chrono::duration_cast<std::chrono::seconds>(S.o.epoch_wait)
                                     .count()))));
    },
    [self](comm_reg& r) {
      self->state.register_comm(r);
      return true;
    },
    [self](abort_atom, const caf::error& why) {
      self->state.abort_epoch(why);
      return true;
    },
  };
}

/// The helpers that serve joiners, and the joiners' requests.
caf::message_handler catchup_sessions(supervisor_self* self) {
  return {
    [self](wire::catchup_request& r) {
      // From a joiner over the mesh: for the session's helper. One that
      // comes before the assignment or the helper is dropped; the joiner
      // asks again.
      auto& S = self->state;
      auto it = S.sessions.find(r.session);
      if (it == S.sessions.end() || !it->second.helper || it->second.broken
          || r.incarnation != it->second.sh->assign.joiner_incarnation)
        return;
      self->send(it->second.helper,
                 joiner_request{std::move(r), caf::actor_cast<caf::actor>(self->current_sender())});
    },
    [self](const prepared_msg& m) {
      auto& S = self->state;
      auto it = S.sessions.find(m.session);
      if (it == S.sessions.end() || it->second.broken || S.stopping)
        return;
      it->second.buf = m.buf;
      S.publish();
      S.answer();
    },
    [self](streamed_atom, uint64_t session, uint64_t acked) {
      auto& S = self->state;
      if (auto it = S.sessions.find(session); it != S.sessions.end())
        it->second.backlog -= std::min<size_t>(it->second.backlog, acked);
    },
    [self](const session_end_msg& m) {
      auto& S = self->state;
      if (auto it = S.sessions.find(m.session); it != S.sessions.end()) {
        auto& s = it->second;
        s.helper = nullptr;
        s.broken = s.broken || !m.clean;
        s.end = true;
        s.buf.reset();
      }
      S.publish();
      return true;
    },
  };
}

/// The end of the run, a restarted coordinator, watched actors, stopping.
caf::message_handler lifecycle(supervisor_self* self) {
  return {
    [self](const finished_msg& m) {
      auto& S = self->state;
      S.done_report = m.done;
      S.status.state = wire::worker_status::training;
      S.status.step = m.step;
      S.send_status();
      (void) S.client->report(m.done);
    },
    [self](const reconnected_msg& m) { self->state.on_reconnected(m.c); },
    [self](peer_down_atom, uint32_t rank, uint64_t incarnation, const std::string& why) {
      self->state.on_peer_down(rank, incarnation, why);
    },
    [self](watch_msg& m) {
      self->monitor(m.a);
      self->state.watched[m.a.address()] = std::move(m);
    },
    [self](stop_atom) {
      self->state.stop();
      return true;
    },
    [self](shutdown_atom) {
      auto& S = self->state;
      S.stop();
      // The trainer's thread holds the last references: its communicators
      // die there.
      S.comm.reset();
      S.parts = {};
      S.devs = {};
      self->quit();
      return true;
    },
  };
}

caf::behavior supervisor_actor(supervisor_self* self, supervisor_options o,
                               std::shared_ptr<coordinator_client> client,
                               std::shared_ptr<view_cell> pub,
                               std::shared_ptr<std::atomic<bool>> dev_abort) {
  auto& S = self->state;
  S.self = self;
  S.o = std::move(o);
  S.client = std::move(client);
  S.pub = std::move(pub);
  S.dev_abort = std::move(dev_abort);
  S.status.incarnation = S.o.incarnation;
  // Until the trainer first asks for an epoch (its model built): a
  // restarted rank is given a catch-up source only once it can take the
  // snapshot, so its start-up does not run while a source serves it.
  S.status.state = wire::worker_status::starting;
  S.publish();
  self->set_down_handler([self](caf::down_msg& d) { self->state.on_down(d); });
  return caf::behavior{coordinator_and_steps(self)
                         .or_else(epochs(self))
                         .or_else(catchup_sessions(self))
                         .or_else(lifecycle(self))};
}

/// Why a session this rank serves must end now, or none.
caf::error source_cut(const session_shared& sh, const view_cell& pub) {
  if (pub.get()->stopping)
    return make_error(errc::closed, "the supervisor is stopping");
  if (sh.cancelled.load())
    return make_error(errc::aborted, "the catch-up session was replaced or cut off");
  return {};
}

/// One session this rank serves as catch-up source, on its helper's
/// thread: what has come in so far, and the waits for the next of it.
struct source_session {
  caf::blocking_actor* self;
  caf::actor sup;
  session_ptr sh;
  std::shared_ptr<view_cell> pub;
  const wire::catchup_assign& a;
  std::optional<joiner_request> request{};
  std::optional<owed_snapshot> snap{};
  std::deque<commit_msg> commits{}; // forwarded by the supervisor, not yet sent
  uint64_t acked_pieces = 0, acked_updates = 0;
  bool end = false; // the supervisor ended the stream: the joiner is admitted
  caf::error failed{};
  int64_t last_news = mono_ns(); // of the joiner or the supervisor

  static constexpr auto tick = std::chrono::milliseconds(100);

  /// Waits up to one tick for a message and takes note of it.
  void pump() {
    self->receive(
      [&](joiner_request& r) {
        if (!request)
          request = std::move(r);
      },
      [&](send_snap_atom, owed_snapshot& t) { snap = std::move(t); },
      [&](commit_msg& m) { commits.push_back(std::move(m)); },
      [&](end_atom) { end = true; },
      [&](stop_atom, caf::error& why) {
        if (!failed)
          failed = std::move(why);
      },
      [&](wire::catchup_ack& k) {
        if (k.session != a.session)
          return;
        last_news = mono_ns();
        acked_pieces = std::max(acked_pieces, k.pieces);
        if (k.updates > acked_updates) {
          caf::anon_send(sup, streamed_atom::value, a.session, k.updates - acked_updates);
          acked_updates = k.updates;
        }
      },
      [&](caf::down_msg& d) {
        if (!failed)
          failed = make_error(errc::peer_lost, fmt::format("catch-up joiner rank {} was lost ({})",
                                                           a.joiner, describe(d.reason)));
      },
      caf::after(tick) >> [] {});
    if (!failed)
      failed = source_cut(*sh, *pub);
  }

  /// Pumps until `done()` or a failure; `what` is the timeout's error
  /// after `limit` without news.
  template <class F>
  caf::error until(F done, std::chrono::seconds limit, const char* what) {
    const int64_t since = mono_ns();
    while (!failed && !done()) {
      if (mono_ns() - std::max(since, last_news) > limit.count() * 1000000000)
        return make_error(errc::timeout, fmt::format("{} for {} s", what, limit.count()));
      pump();
    }
    return failed;
  }

  /// Tells the joiner that the session failed, so that it asks again.
  void refuse(const caf::error& why) {
    if (request && code_of(why) != errc::peer_lost)
      self->send(request->from, wire::catchup_update{a.session, 0, true, describe(why), {}});
  }
};

/// Floats in one piece of a catch-up snapshot.
size_t piece_floats(const supervisor_options& o) {
  return std::max<size_t>(o.catchup_chunk_bytes / sizeof(float), 16);
}

/// Sends the snapshot's range in pieces of catchup_chunk_bytes (the last
/// shorter), at most `window` unacknowledged, each a bulk payload that
/// points into the snapshot's buffers (no copy).
caf::error send_snapshot(source_session& s, const supervisor_options& o) {
  auto& snap = *s.snap;
  const size_t total = snap.buf->layout.total, per = piece_floats(o);
  const size_t n_pieces = snap.buf->layout.pieces(per);
  const size_t window = std::max<size_t>(o.catchup_window, 1);
  const auto cpu0 = thread_cpu_ns();
  const auto t0 = mono_ns();
  size_t sent = 0;
  while (s.acked_pieces < n_pieces) {
    for (; sent < n_pieces && sent < s.acked_pieces + window; ++sent) {
      const size_t at = sent * per, n = std::min(per, total - at);
      float* from = snap.buf->memory.data() + at;
      wire::catchup_piece m{s.a.session, snap.step, at, {}};
      m.payload = bulk(std::shared_ptr<uint8_t[]>(snap.buf, reinterpret_cast<uint8_t*>(from)),
                       n * sizeof(float));
      s.self->send(s.request->from, std::move(m));
    }
    auto room = [&] {
      return sent < n_pieces ? s.acked_pieces + window > sent : s.acked_pieces >= n_pieces;
    };
    if (auto e = s.until(room, std::chrono::seconds(60), "no acknowledgement of a snapshot piece"))
      return e;
  }
  const double secs = static_cast<double>(mono_ns() - t0) / 1e9;
  const double mb = static_cast<double>(total * sizeof(float)) / 1e6;
  spdlog::info("supervisor: session {}: snapshot of step {} sent to rank {} ({:.1f} MB in {:.4f} s, "
               "{:.2f} GB/s, {} pieces; CPU {:.1f} ms)",
               s.a.session, snap.step, s.a.joiner, mb, secs, mb / 1e3 / std::max(secs, 1e-9),
               n_pieces, (thread_cpu_ns() - cpu0) / 1e6);
  snap.buf.reset(); // sent: its memory goes back
  return {};
}

/// Sends each committed update the supervisor forwards, until it ends the
/// stream (the epoch that admits the joiner) with the end marker.
caf::error stream_updates(source_session& s) {
  const auto cpu0 = thread_cpu_ns();
  uint64_t streamed = 0;
  for (;;) {
    for (; !s.commits.empty(); s.commits.pop_front()) {
      const auto& u = s.commits.front().update;
      wire::catchup_update m{s.a.session, s.commits.front().k, false, {}, {}};
      m.payload = bulk(std::shared_ptr<uint8_t[]>(u, reinterpret_cast<uint8_t*>(
                                                       const_cast<float*>(u->data()))),
                       u->size() * sizeof(float));
      s.self->send(s.request->from, std::move(m));
      ++streamed;
      s.last_news = mono_ns();
    }
    if (s.end) {
      // The end marker follows the joiner's acknowledgement of the last
      // update: nothing of this session reaches the helper after it ends.
      if (auto e = s.until([&] { return s.acked_updates >= streamed; }, std::chrono::seconds(60),
                           "no acknowledgement of the last update"))
        return e;
      s.self->send(s.request->from, wire::catchup_update{s.a.session, 0, true, {}, {}});
      spdlog::info("supervisor: session {}: stream to rank {} ended after {} update(s) (CPU {:.1f} ms)",
                   s.a.session, s.a.joiner, streamed, (thread_cpu_ns() - cpu0) / 1e6);
      return {};
    }
    // A step takes well under this; silence this long means training stopped.
    if (auto e = s.until([&] { return s.end || !s.commits.empty(); }, std::chrono::seconds(600),
                         "no committed step to stream"))
      return e;
  }
}

/// The steps of a session after its buffers are ready: the joiner's
/// request, the snapshot at the trainer's next boundary, the stream.
caf::error serve_joiner(source_session& s, const supervisor_options& o,
                        const std::shared_ptr<snapshot_buffers>& buf) {
  auto asked = [&] { return s.request.has_value(); };
  if (auto e = s.until(asked, std::chrono::seconds(5), "no catch-up request from the joiner");
      code_of(e) == errc::timeout) {
    spdlog::warn("supervisor: session {}: no request from rank {} after 5 s (the transport holds "
                 "its incarnation {:x}; the session names {:x})",
                 s.a.session, s.a.joiner, o.net ? o.net->peer_incarnation(s.a.joiner) : 0,
                 s.a.joiner_incarnation);
    e = s.until(asked, std::chrono::seconds(55), "no catch-up request from the joiner");
    if (e)
      return e;
  } else if (e) {
    return e;
  }
  const auto& want = s.request->r.sizes;
  for (size_t i = 0; i < buf->parts.size(); ++i)
    if (want.size() != buf->parts.size() || want[i] != buf->parts[i].size())
      return make_error(errc::invalid_argument,
                        fmt::format("the joiner's state has another shape ({} parameters; this "
                                    "model has {})",
                                    want.empty() ? 0 : want[0], buf->parts[0].size()));
  s.self->monitor(s.request->from);
  s.self->send(s.sup, prepared_msg{s.a.session, buf});
  if (auto e = s.until([&] { return s.snap.has_value() || s.end; }, std::chrono::seconds(600),
                       "no step boundary"))
    return e;
  if (!s.snap)
    return make_error(errc::aborted, "the session ended before its snapshot");
  if (auto e = send_snapshot(s, o))
    return e;
  return stream_updates(s);
}

/// The helper actor of one session this rank serves as catch-up source.
/// Prepared before the snapshot, here: the buffers are allocated and their
/// pages touched on this thread, on huge pages (a fresh 100 MB vector filled
/// on the trainer's thread cost it 270 ms of page faults), so that at the
/// step boundary the trainer only copies (6 ms for 100 MB).
void serve_session(caf::blocking_actor* self, caf::actor sup, session_ptr sh,
                   supervisor_options o, std::array<size_t, 4> sizes,
                   std::shared_ptr<view_cell> pub) {
  if (!lower_thread_priority(o.catchup_nice))
    spdlog::debug("supervisor: cannot lower the catch-up thread's priority: {}",
                  std::strerror(errno));
  const auto& a = sh->assign;
  const auto t_setup = mono_ns();
  auto buf = std::make_shared<snapshot_buffers>(snapshot_buffers::sized(sizes, page_array::pages::huge));
  std::fill(buf->memory.begin(), buf->memory.end(), 0.0f); // fault the pages in here
  spdlog::info("supervisor: session {}: buffers for rank {} ready in {:.1f} ms", a.session,
               a.joiner, (mono_ns() - t_setup) / 1e6);
  source_session s{self, sup, sh, pub, a};
  auto e = serve_joiner(s, o, buf);
  if (e) {
    s.refuse(e);
    if (!sh->cancelled.load() && !pub->get()->stopping)
      spdlog::warn("supervisor: catch-up session {} to rank {} failed: {}", a.session, a.joiner,
                   describe(e));
  }
  self->request(sup, caf::duration{std::chrono::seconds(10)}, session_end_msg{a.session, !e})
    .receive([](bool) {}, [](caf::error&) {});
}

} // namespace

struct supervisor::impl {
  caf::actor_system& sys;
  supervisor_options o;
  std::shared_ptr<coll::host_context> ctx;
  std::shared_ptr<view_cell> pub = std::make_shared<view_cell>();
  std::shared_ptr<std::atomic<bool>> dev_abort = std::make_shared<std::atomic<bool>>(false);
  caf::actor actor;
  std::atomic<bool> stopped{false};
  // The trainer's thread's own: the communicators it uses (the supervisor
  // holds them too, to abort them, and lets go first).
  std::shared_ptr<coll::communicator> comm;
  std::array<std::shared_ptr<coll::host_context>, 2> part_ctx, dev_ctx;
  std::array<std::shared_ptr<coll::communicator>, 2> parts, devs;
  std::array<uint64_t, 2> dev_epochs{};

  impl(caf::actor_system& s, supervisor_options opts, std::shared_ptr<coll::host_context> x)
      : sys(s), o(std::move(opts)), ctx(std::move(x)) {}

  std::shared_ptr<const supervisor_view> view() const { return pub->get(); }

  /// Asks the supervisor actor and waits for its answer (at most `timeout`).
  template <class R, class... Ts>
  expected<R> ask(std::chrono::milliseconds timeout, Ts&&... xs) {
    caf::scoped_actor self{sys};
    expected<R> out = make_error(errc::closed, "the supervisor did not answer");
    self->request(actor, caf::duration{timeout}, std::forward<Ts>(xs)...)
      .receive([&](R& r) { out = std::move(r); },
               [&](caf::error& e) {
                 out = make_error(errc::closed, "the supervisor did not answer: "
                                                  + sys.render(e));
               });
    return out;
  }
  template <class... Ts>
  void tell(Ts&&... xs) {
    caf::anon_send(actor, std::forward<Ts>(xs)...);
  }
  void set_status(std::optional<uint8_t> state, std::optional<uint64_t> step = {},
                  std::optional<uint64_t> epoch = {}, std::optional<uint64_t> session = {}) {
    status_msg m;
    m.state = state;
    m.step = step;
    m.epoch = epoch;
    m.session = session;
    tell(std::move(m));
  }
  /// Tells the supervisor of a communicator (or that it is gone) and waits
  /// until it has taken note.
  void note_comm(comm_reg r) {
    if (auto ok = ask<bool>(std::chrono::seconds(30), std::move(r)); !ok)
      spdlog::warn("supervisor: {}", describe(ok.error()));
  }
  coll::peer_status member_status(uint64_t epoch) const;
  /// A host subcommunicator of `world` on `ctx`, made on first use.
  expected<std::unique_ptr<coll::communicator>> host_part(std::shared_ptr<coll::host_context>& ctx,
                                                          coll::communicator& world,
                                                          coll::membership part) {
    if (!ctx) {
      auto c = coll::host_context::create(o.rank);
      if (!c)
        return c.error();
      ctx = std::move(*c);
    }
    return coll::make_host_subcommunicator(world, ctx, std::move(part),
                                           member_status(world.members().epoch), o.host);
  }
  void take_snapshots(const train_state& st);
  expected<coll::communicator*> build_epoch(const wire::epoch_notice& n, uint64_t& after);
  caf::error receive(const enter_reply& r, train_state& st, const apply_update& apply);
};

/// A member of `epoch` is lost when a newer epoch left it out.
coll::peer_status supervisor::impl::member_status(uint64_t epoch) const {
  return [p = pub, epoch](uint32_t r) -> caf::error {
    auto v = p->get();
    if (v->stopping)
      return make_error(errc::closed, "the supervisor is stopping");
    if (v->failed)
      return make_error(errc::unrecoverable, *v->failed);
    if (auto it = v->lost.find(r); it != v->lost.end() && it->second >= epoch)
      return make_error(errc::peer_lost, fmt::format("rank {} was lost in epoch {}", r, it->second));
    if (v->newest_epoch > epoch && !has_rank(v->newest_ranks, r))
      return make_error(errc::peer_lost, fmt::format("epoch {} left out rank {}", v->newest_epoch, r));
    return {};
  };
}

supervisor::supervisor(caf::actor_system& sys, supervisor_options o, coordinator_client client,
                       std::shared_ptr<coll::host_context> ctx)
    : impl_(std::make_unique<impl>(sys, std::move(o), std::move(ctx))) {
  auto c = std::make_shared<coordinator_client>(std::move(client));
  auto v = std::make_shared<supervisor_view>();
  v->client = c;
  impl_->pub->v.store(std::move(v));
  // Detached: beacons and aborts never wait behind the worker's other
  // actors on the scheduler.
  impl_->actor = sys.spawn<caf::detached>(supervisor_actor, impl_->o, std::move(c), impl_->pub,
                                          impl_->dev_abort);
}

std::shared_ptr<coordinator_client> supervisor::client() const {
  return impl_->view()->client;
}

const caf::actor& supervisor::actor() const {
  return impl_->actor;
}

supervisor::~supervisor() {
  stop();
  (void) impl_->ask<bool>(std::chrono::seconds(30), shutdown_atom::value);
}

void supervisor::start() {
  auto& I = *impl_;
  // Joiners' catch-up requests come to it over the mesh.
  if (I.o.actor_mesh != nullptr)
    I.o.actor_mesh->publish("supervisor", I.actor);
  client()->on_control([a = I.actor](const control_message& m) {
    caf::anon_send(a, ctl_atom::value, m);
  });
  I.tell(beacon_atom::value);
}

void supervisor::stop() {
  if (impl_->stopped.exchange(true))
    return;
  if (auto ok = impl_->ask<bool>(std::chrono::seconds(30), stop_atom::value); !ok)
    spdlog::warn("supervisor: stopping: {}", describe(ok.error()));
}

void supervisor::watch(const caf::actor& a, std::string what,
                       std::function<void(const caf::error&)> restart) {
  impl_->tell(watch_msg{a, std::move(what), std::move(restart)});
}

void supervisor::finished(uint64_t step, const wire::report& done) {
  impl_->tell(finished_msg{step, done});
}

void supervisor::computing(bool on) {
  impl_->tell(computing_atom::value, on);
}

void supervisor::abort_epoch(const caf::error& why) {
  if (auto ok = impl_->ask<bool>(std::chrono::seconds(30), abort_atom::value, why); !ok)
    spdlog::warn("supervisor: abort: {}", describe(ok.error()));
}

void supervisor::report_divergence(const wire::replica_divergence& d) {
  auto m = d;
  m.incarnation = impl_->o.incarnation;
  if (auto c = client())
    if (auto e = c->send_divergence(m))
      spdlog::warn("supervisor: the divergence report did not reach the coordinator: {}",
                   describe(e));
}

uint64_t supervisor::newest_epoch() const {
  return impl_->view()->newest_epoch;
}

void supervisor::at_boundary(const train_state& st) {
  auto& I = *impl_;
  I.tell(boundary_msg{st.step, {st.params.size(), st.adam_m.size(), st.adam_v.size(),
                                st.scalars.size()}});
  if (I.view()->snapshot_owed)
    I.take_snapshots(st);
}

/// Copies the state into the buffers of each session that waits for it.
void supervisor::impl::take_snapshots(const train_state& st) {
  const auto t0 = mono_ns();
  auto owed = ask<owed_list>(std::chrono::seconds(30), owed_atom::value);
  if (!owed)
    return;
  for (auto& s : owed->sessions) {
    const std::span<const float> from[4] = {st.params, st.adam_m, st.adam_v, st.scalars};
    const std::array<size_t, 4> n{from[0].size(), from[1].size(), from[2].size(), from[3].size()};
    // A size that changed since the helper prepared (it does not, within a
    // run) gets a fresh buffer.
    for (size_t i = 0; i < n.size(); ++i)
      if (s.buf->parts[i].size() != n[i]) {
        s.buf = std::make_shared<snapshot_buffers>(
          snapshot_buffers::sized(n, page_array::pages::normal));
        break;
      }
    for (size_t i = 0; i < n.size(); ++i)
      std::copy(from[i].begin(), from[i].end(), s.buf->parts[i].begin());
    s.step = st.step;
    spdlog::info("supervisor: session {}: snapshot of step {} taken for rank {} ({:.1f} ms)",
                 s.session, s.step, s.joiner, (mono_ns() - t0) / 1e6);
    tell(taken_atom::value, std::move(s));
  }
}

void supervisor::committed(uint64_t k, std::span<const float> update) {
  commit_msg m{k, nullptr};
  // Copied only while a joiner takes the stream.
  if (impl_->view()->streaming)
    m.update = std::make_shared<const std::vector<float>>(update.begin(), update.end());
  impl_->tell(std::move(m));
}

expected<coll::communicator*> supervisor::enter_epoch(uint64_t after, const caf::error& why,
                                                      train_state& st, const apply_update& apply) {
  auto& I = *impl_;
  const bool member_before = after != 0;
  {
    status_msg m;
    m.state = why ? wire::worker_status::recovering
              : member_before ? wire::worker_status::training
                              : (st.step == 0 ? wire::worker_status::fresh
                                              : wire::worker_status::ready);
    m.step = st.step;
    if (why && member_before) // the coordinator re-forms the epoch if no death explains this
      m.broken = std::make_pair(after, describe(why));
    I.tell(std::move(m));
  }
  for (;;) {
    auto r = I.ask<enter_reply>(I.o.epoch_wait + std::chrono::seconds(30),
                                enter_msg{after, member_before});
    if (!r)
      return r.error();
    switch (r->what) {
      case enter_reply::kind::error:
        return r->err;
      case enter_reply::kind::snapshot:
        I.take_snapshots(st);
        continue;
      case enter_reply::kind::join: {
        // On a thread of its own, so that its priority can be lowered and
        // the trainer's thread keeps its own.
        caf::error e;
        std::thread([&] {
          lower_thread_priority(I.o.catchup_nice);
          e = I.receive(*r, st, apply);
        }).join();
        if (e) {
          spdlog::warn("supervisor: catch-up session {} from rank {} failed: {}", r->assign.session,
                       r->assign.source, describe(e));
          // Back to square one: a fresh snapshot from a (new) source.
          I.set_status(wire::worker_status::fresh, st.step, {}, r->assign.session);
        } else {
          spdlog::info("supervisor: rank {} caught up to step {} (session {})", I.o.rank, st.step,
                       r->assign.session);
        }
        continue;
      }
      case enter_reply::kind::epoch:
        if (auto c = I.build_epoch(r->notice, after); c || code_of(c.error()) != errc::aborted) {
          if (c)
            spdlog::info("supervisor: rank {} in epoch {} ({} members) at step {}", I.o.rank,
                         r->notice.epoch, r->notice.ranks.size(), st.step);
          return c;
        }
        continue;
    }
  }
}

/// Builds epoch `n`'s communicator and hands it to the supervisor. A build
/// that fails moves `after` past the epoch and returns aborted: the caller
/// waits for the next.
expected<coll::communicator*> supervisor::impl::build_epoch(const wire::epoch_notice& n,
                                                            uint64_t& after) {
  // A newer epoch makes this one moot: its members may go straight to the
  // newest they know (a joiner that caught up meanwhile, a member that heard
  // of it before the switch), and would never publish here.
  coll::build_status moot = [p = pub, epoch = n.epoch]() -> caf::error {
    auto v = p->get();
    if (v->newest_epoch > epoch)
      return make_error(errc::aborted, fmt::format("epoch {} was superseded by epoch {} while it "
                                                   "was built",
                                                   epoch, v->newest_epoch));
    return {};
  };
  auto c = coll::make_host_communicator(ctx, {n.epoch, n.ranks}, *view()->client,
                                        member_status(n.epoch), o.host, std::move(moot));
  if (!c) {
    if (code_of(c.error()) == errc::aborted) {
      spdlog::info("supervisor: rank {} skips epoch {}: {}", o.rank, n.epoch, describe(c.error()));
    } else {
      spdlog::warn("supervisor: rank {} could not build epoch {}: {}", o.rank, n.epoch,
                   describe(c.error()));
      // Its other members may have built it and wait for this rank.
      status_msg m;
      m.broken = std::make_pair(n.epoch, "could not build the epoch: " + describe(c.error()));
      tell(std::move(m));
    }
    after = n.epoch;
    return make_error(errc::aborted, "the epoch was not built");
  }
  std::shared_ptr<coll::communicator> made = std::move(*c);
  note_comm({.what = comm_reg::kind::epoch, .c = made});
  parts = {}; // the last epoch's parts, which the supervisor let go of
  comm = std::move(made);
  return comm.get();
}

namespace {

/// This rank's side of a catch-up as joiner, on a thread of the trainer's:
/// it asks the source, copies the snapshot's pieces into the state,
/// applies the streamed updates, and acknowledges each.
struct joiner_session {
  caf::scoped_actor self;
  const supervisor_options& o;
  const wire::catchup_assign& a;
  uint64_t losses_before; // of the source, heard of when the assignment came
  std::shared_ptr<view_cell> pub;
  train_state& st;
  const apply_update& apply;
  std::function<void(uint8_t, uint64_t)> status; // (state, step): beaconed at once
  caf::actor source{};                            // its helper, from its first message
  uint64_t pieces = 0, updates = 0;
  snapshot_layout layout{{st.params.size(), st.adam_m.size(), st.adam_v.size(), st.scalars.size()}};
  size_t have = 0; // floats of the snapshot's range received
  std::optional<uint64_t> snap_step{};
  int64_t t_first = 0;
  bool done = false;
  caf::error failed{};

  std::array<std::span<float>, 4> arrays() const {
    return {st.params, st.adam_m, st.adam_v, st.scalars};
  }

  /// Why the session must end now, or none.
  caf::error cut() const {
    auto v = pub->get();
    if (v->stopping)
      return make_error(errc::closed, "the supervisor is stopping");
    if (v->join_session > a.session)
      return make_error(errc::aborted, "a newer catch-up session was assigned");
    if (v->losses(a.source) > losses_before)
      return make_error(errc::peer_lost, fmt::format("catch-up source rank {} was lost", a.source));
    if (v->newest_epoch != 0 && !has_rank(v->newest_ranks, a.source))
      return make_error(errc::peer_lost,
                        fmt::format("catch-up source rank {} left the job", a.source));
    return {};
  }

  void fail(caf::error e) {
    if (!failed)
      failed = std::move(e);
  }

  /// The transport pulls each piece into a pooled buffer of the piece's
  /// size (bulk::allocate). In a fresh process those are fresh pages, and
  /// a pull into them takes a page fault per 4 KiB: the buffers the pieces
  /// will cycle through are touched here, before the request, and go back
  /// to the pool.
  void warm_receive_buffers() {
    const size_t per = piece_floats(o), n_pieces = layout.pieces(per);
    std::vector<bulk> warm;
    for (size_t i = 0; i < std::min(n_pieces, o.catchup_window + 1); ++i)
      warm.push_back(bulk::allocate(std::min(per, layout.total) * sizeof(float)));
    if (n_pieces > 1 && layout.total % per != 0)
      warm.push_back(bulk::allocate(layout.total % per * sizeof(float))); // the last piece
    for (auto& b : warm)
      std::memset(b.data(), 0, b.size());
  }

  void ack() { self->send(source, wire::catchup_ack{a.session, pieces, updates}); }

  void on_piece(const wire::catchup_piece& p) {
    const size_t total = layout.total, n = p.payload.size() / sizeof(float);
    if ((snap_step && *snap_step != p.step) || have + n > total)
      return fail(make_error(errc::invalid_argument,
                             fmt::format("catch-up piece from rank {} of step {} after {} of {} "
                                         "floats of step {}",
                                         a.source, p.step, have, total, snap_step.value_or(p.step))));
    if (auto e = place_piece(layout, p.offset, p.payload.span(), arrays()))
      return fail(make_error(errc::invalid_argument,
                             fmt::format("from rank {}: {}", a.source, describe(e))));
    if (!snap_step)
      t_first = mono_ns();
    snap_step = p.step;
    have += n;
    ++pieces;
    ack();
    if (have < total)
      return;
    st.step = p.step;
    const double secs = static_cast<double>(mono_ns() - t_first) / 1e9;
    const double mb = static_cast<double>(total * sizeof(float)) / 1e6;
    spdlog::info("supervisor: rank {} received the snapshot of step {} from rank {} (session {}): "
                 "{:.1f} MB in {:.4f} s from its first piece, {:.2f} GB/s",
                 o.rank, st.step, a.source, a.session, mb, secs, mb / 1e3 / std::max(secs, 1e-9));
    status(wire::worker_status::ready, st.step);
  }

  void on_update(const wire::catchup_update& u) {
    if (u.end) {
      if (!u.refused.empty())
        return fail(make_error(errc::aborted, fmt::format("catch-up source rank {} ended the "
                                                          "session: {}",
                                                          a.source, u.refused)));
      if (have < layout.total)
        return fail(make_error(errc::invalid_argument, "the catch-up stream ended before its "
                                                       "snapshot was whole"));
      done = true;
      return;
    }
    if (have < layout.total || u.step != st.step || u.payload.size() != st.params.size() * sizeof(float))
      return fail(make_error(errc::invalid_argument,
                             fmt::format("catch-up stream sent step {} ({} bytes) while this rank "
                                         "is at step {}{}",
                                         u.step, u.payload.size(), st.step,
                                         have < layout.total ? " without its snapshot" : "")));
    apply(st.step, std::span<const float>(reinterpret_cast<const float*>(u.payload.data()),
                                          st.params.size()));
    ++st.step;
    ++updates;
    ack();
    status(wire::worker_status::ready, st.step);
  }

  /// Asks until the source answers (it drops a request that comes before
  /// it knows the session), then takes what it sends until the stream's
  /// end, a failure, or silence.
  caf::error run(mesh& m) {
    warm_receive_buffers();
    // A restarted joiner dials its source when the assignment comes: its
    // proxy is made once the transport holds the source's endpoints (one
    // made before would be bound to no incarnation).
    caf::actor to_source;
    wire::catchup_request req{a.session, o.incarnation, {}};
    for (auto x : arrays())
      req.sizes.push_back(x.size());
    const int64_t start = mono_ns();
    int64_t asked = 0, heard = start;
    uint64_t asks = 0;
    bool said_unreachable = false;
    while (!done && !failed) {
      const int64_t now = mono_ns();
      if (!to_source && o.net != nullptr && o.net->peer_alive(a.source)) {
        to_source = m.remote(a.source, "supervisor");
        self->monitor(to_source);
      }
      if (to_source && !source && now - asked > 200'000'000) {
        self->send(to_source, req);
        asked = now;
        if (++asks % 25 == 0)
          spdlog::warn("supervisor: rank {} asked catch-up source rank {} {} times for session {} "
                       "without an answer",
                       o.rank, a.source, asks, a.session);
      }
      if (!to_source && now - start > 2'000'000'000 && !said_unreachable) {
        said_unreachable = true;
        spdlog::warn("supervisor: rank {}'s transport has not connected catch-up source rank {} "
                     "after 2 s (session {})",
                     o.rank, a.source, a.session);
      }
      if (!source && now - start > 60'000'000'000)
        return make_error(errc::timeout, fmt::format("catch-up source rank {} did not answer "
                                                     "for 60 s",
                                                     a.source));
      if (source && now - heard > 600'000'000'000)
        return make_error(errc::timeout, "nothing from the catch-up source for 600 s");
      auto from_source = [&](uint64_t session) {
        if (session != a.session) // an older session's
          return false;
        heard = mono_ns();
        source = caf::actor_cast<caf::actor>(self->current_sender());
        return true;
      };
      self->receive(
        [&](wire::catchup_piece& p) {
          if (from_source(p.session))
            on_piece(p);
        },
        [&](wire::catchup_update& u) {
          if (from_source(u.session))
            on_update(u);
        },
        [&](caf::down_msg& d) {
          fail(make_error(errc::peer_lost, fmt::format("catch-up source rank {} was lost ({})",
                                                       a.source, describe(d.reason))));
        },
        caf::after(std::chrono::milliseconds(50)) >> [] {});
      if (!failed)
        failed = cut();
    }
    return failed;
  }
};

} // namespace

/// This rank's catch-up as joiner: the snapshot, then the stream, from the
/// assigned source, over the actor mesh.
caf::error supervisor::impl::receive(const enter_reply& r, train_state& st,
                                     const apply_update& apply) {
  const auto& a = r.assign;
  set_status(wire::worker_status::catching_up, {}, {}, a.session);
  if (o.actor_mesh == nullptr)
    return make_error(errc::invalid_argument, "this worker has no actor mesh to catch up over");
  joiner_session j{caf::scoped_actor{sys}, o, a, r.source_losses, pub, st, apply,
                   [this](uint8_t state, uint64_t step) { set_status(state, step); }};
  return j.run(*o.actor_mesh);
}

expected<coll::communicator*> supervisor::sub_communicator(size_t slot, coll::membership part) {
  auto& I = *impl_;
  CMESH_CHECK_LT(slot, I.parts.size());
  if (!I.comm)
    return make_error(errc::invalid_argument, "no epoch to split");
  auto* world = I.comm.get();
  auto c = I.host_part(I.part_ctx[slot], *world, std::move(part));
  if (!c)
    return c.error();
  std::shared_ptr<coll::communicator> made = std::move(*c);
  I.note_comm({.what = comm_reg::kind::part, .slot = slot, .c = made}); // a loss or a newer epoch that came meanwhile reaches it there
  if (auto p = world->poisoned())
    made->abort(p);
  I.parts[slot] = std::move(made);
  return I.parts[slot].get();
}

bool supervisor::has_device_collectives() const {
  return impl_->o.device_collectives != supervisor_options::device_kind::none;
}

#ifdef CMESH_HAVE_NCCL
namespace {

/// An NCCL communicator of `part` of epoch `world`. The first member of
/// the part makes its unique id; every member sends [made, 16 words of id]
/// (zeros unless it made one) to every other over the epoch's host
/// communicator and takes its part's.
expected<std::unique_ptr<coll::communicator>>
make_nccl_part(coll::communicator& world, coll::membership part, const supervisor_options& o,
               uint64_t epoch, size_t slot, std::atomic<bool>* abort_flag,
               coll::peer_status status) {
  constexpr size_t words = 1 + sizeof(coll::nccl_unique_id) / sizeof(int64_t);
  static_assert(sizeof(coll::nccl_unique_id) % sizeof(int64_t) == 0);
  const size_t n = world.size(), me = world.index();
  std::vector<int64_t> msgs(n * words, 0);
  std::string why;
  if (part.ranks[0] == o.rank) {
    if (auto id = coll::make_nccl_unique_id()) {
      msgs[me * words] = 1;
      std::memcpy(&msgs[me * words + 1], id->data(), id->size());
    } else {
      why = describe(id.error());
    }
  }
  std::vector<int64_t> mine(msgs.begin() + static_cast<ptrdiff_t>(me * words),
                            msgs.begin() + static_cast<ptrdiff_t>((me + 1) * words));
  if (auto e = world.all_gather(mine.data(), msgs.data(), std::vector<size_t>(n, words),
                                 coll::dtype::int64))
    return e;
  const size_t leader = world.members().index_of(part.ranks[0]);
  if (leader == n || msgs[leader * words] != 1)
    return make_error(errc::transport_failure,
                      fmt::format("epoch {}: rank {} could not make an NCCL unique id{}", epoch,
                                  part.ranks[0], why.empty() ? "" : ": " + why));
  coll::nccl_unique_id id{};
  std::memcpy(id.data(), &msgs[leader * words + 1], id.size());
  coll::nccl_options no;
  no.device = o.device;
  no.abort_flag = abort_flag;
  no.name = fmt::format("cmesh-epoch-{}-{}", epoch, slot == 0 ? "group" : "cross");
  return coll::make_nccl_communicator(std::move(part), o.rank, id, std::move(status), no);
}

} // namespace
#endif

expected<coll::communicator*> supervisor::device_communicator(size_t slot, coll::membership part) {
  auto& I = *impl_;
  using kind = supervisor_options::device_kind;
  CMESH_CHECK_LT(slot, I.devs.size());
  if (I.o.device_collectives == kind::none)
    return make_error(errc::invalid_argument, "this worker has no device collectives");
  const size_t members = part.size();
  if (part.index_of(I.o.rank) == members)
    return make_error(errc::invalid_argument,
                      fmt::format("rank {} is not in the part it asked for", I.o.rank));
  if (!I.comm)
    return make_error(errc::invalid_argument, "no epoch for a device communicator");
  coll::communicator* world = I.comm.get();
  const uint64_t epoch = world->members().epoch;
  if (auto& d = I.devs[slot]; d && I.dev_epochs[slot] == epoch && d->members().ranks == part.ranks)
    return d.get();
  if (I.devs[slot]) {
    I.note_comm({.what = comm_reg::kind::device, .slot = slot, .c = nullptr}); // forgotten
    I.devs[slot].reset();
  }
  // A loss that ends this epoch while its communicator is built poisons
  // `world` (the exchange below fails) or is caught after it (below).
  I.dev_abort->store(false);
  const int64_t t0 = mono_ns();
  expected<std::unique_ptr<coll::communicator>> made =
    make_error(errc::invalid_argument, "no device collectives in this build");
  if (I.o.device_collectives == kind::host) {
    made = I.host_part(I.dev_ctx[slot], *world, std::move(part));
  } else {
#ifdef CMESH_HAVE_NCCL
    made = make_nccl_part(*world, std::move(part), I.o, epoch, slot, I.dev_abort.get(),
                          I.member_status(epoch));
#endif
  }
  if (!made)
    return made.error();
  spdlog::info("supervisor: rank {} built epoch {}'s device communicator {} ({}, {} members) in "
               "{:.1f} ms",
               I.o.rank, epoch, slot, I.o.device_collectives == kind::host ? "host backend" : "NCCL",
               members, static_cast<double>(mono_ns() - t0) / 1e6);
  std::shared_ptr<coll::communicator> d = std::move(*made);
  I.note_comm({.what = comm_reg::kind::device, .slot = slot, .c = d});
  if (auto p = world->poisoned())
    d->abort(p);
  I.devs[slot] = std::move(d);
  I.dev_epochs[slot] = epoch;
  return I.devs[slot].get();
}

} // namespace cmesh::actors
