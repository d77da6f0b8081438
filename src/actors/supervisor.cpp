#include "actors/supervisor.hpp"

#include "core/check.hpp"
#include "core/env.hpp"
#include "core/pages.hpp"
#include "transport/join.hpp"
#ifdef CMESH_HAVE_NCCL
#include "collectives/nccl/nccl_communicator.hpp"
#endif

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <thread>
#include <cstring>
#include <cerrno>
#include <unistd.h>

namespace cmesh::actors {

namespace {

using clock_type = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr uint64_t catchup_epoch_base = uint64_t{1} << 15;

bool includes(const wire::epoch_notice& n, uint32_t rank, uint64_t incarnation) {
  for (size_t i = 0; i < n.ranks.size(); ++i)
    if (n.ranks[i] == rank && (i >= n.incarnations.size() || n.incarnations[i] == incarnation))
      return true;
  return false;
}

/// The catch-up's bulk broadcasts, which both peers are already in: polled
/// without the naps its communicators take while they wait for a step.
const coll::op_options transfer_op = [] {
  coll::op_options o;
  o.transfer = true;
  return o;
}();

bool has_rank(const wire::epoch_notice& n, uint32_t rank) {
  return std::find(n.ranks.begin(), n.ranks.end(), rank) != n.ranks.end();
}

} // namespace

uint64_t catchup_epoch(uint64_t session) {
  return catchup_epoch_base + session % catchup_epoch_base;
}

/// A catch-up snapshot's buffers: params, adam_m, adam_v, scalars
/// (train_state's order) as parts of one mapping, each on a cache line. On
/// huge pages a small model's whole state is then a single page fault
/// where four arrays were hundreds (2 MB: 5.5 ms of faults on these VMs).
struct snapshot_buffers {
  std::array<std::span<float>, 4> parts;
  page_array memory;

  static snapshot_buffers sized(const std::array<size_t, 4>& n, page_array::pages kind) {
    constexpr size_t align = 16; // floats
    auto up = [](size_t x) { return (x + align - 1) / align * align; };
    size_t total = 0;
    for (size_t x : n)
      total += up(x);
    snapshot_buffers b;
    b.memory = page_array(total, kind);
    size_t at = 0;
    for (size_t i = 0; i < n.size(); ++i) {
      b.parts[i] = {b.memory.data() + at, n[i]};
      at += up(n[i]);
    }
    return b;
  }
};

/// One joiner this rank serves.
struct session {
  wire::catchup_assign assign;
  bool want_snapshot = true;  // until at_boundary copies it
  bool end = false;           // the stream's last update is queued
  bool broken = false;        // cut off, or failed
  uint64_t snap_step = 0;
  snapshot_buffers snap;
  void drop_state() { snap = {}; }
  std::deque<std::pair<uint64_t, std::vector<float>>> queue;
  std::unique_ptr<coll::communicator> comm; // from prepared until the stream ends
  std::thread thread;
  /// Buffers allocated and the communicator built (the serving thread sets
  /// comm last; it is reset only after the snapshot was sent).
  bool prepared() const { return comm != nullptr; }
};
using session_ptr = std::shared_ptr<session>;

struct supervisor::impl {
  supervisor_options o;
  std::shared_ptr<coordinator_client> client_; // guarded by mu
  std::shared_ptr<coll::host_context> ctx;
  std::optional<wire::report> done_report;     // re-sent after a reconnect
  bool connected = true;

  mutable std::mutex mu;
  std::condition_variable cv;
  bool stopping = false;
  std::optional<wire::epoch_notice> newest; // the newest non-failing epoch
  std::optional<wire::epoch_notice> failed; // the coordinator gave up
  std::optional<wire::catchup_assign> join; // the newest assignment as joiner
  uint64_t join_source_losses = 0;          // lost_count[join->source] when it came
  std::map<uint32_t, uint64_t> lost;        // rank -> the epoch it was lost in
  std::map<uint32_t, uint64_t> lost_count;  // rank -> losses heard of (any incarnation)
  uint64_t join_done = 0;                   // sessions handled as joiner up to here
  std::unique_ptr<coll::communicator> comm; // the current epoch's
  /// Parts of the current epoch (a replica group; a shard's holders), each
  /// on a host context of its own, built lazily.
  std::array<std::shared_ptr<coll::host_context>, 2> part_ctx;
  std::array<std::unique_ptr<coll::communicator>, 2> parts;
  /// The epoch's communicators over device memory (device_communicator,
  /// slots as for parts), and the epoch each belongs to.
  std::array<std::unique_ptr<coll::communicator>, 2> devs;
  std::array<uint64_t, 2> dev_epochs{};
  std::array<std::shared_ptr<coll::host_context>, 2> dev_ctx; // device_kind::host
  std::atomic<bool> dev_abort{false}; // stops an NCCL creation in progress
  /// Aborts the current epoch's communicator and its parts (mu held).
  /// Puts `epoch` and why it broke here into the beacon (the caller holds
  /// `mu` and sends it). The reason is cut to a beacon's size.
  void note_broken(uint64_t epoch, const std::string& why) {
    status.broken_epoch = epoch;
    status.broken_reason = why.substr(0, 240);
  }
  void abort_epoch(const caf::error& why) {
    if (comm)
      comm->abort(why);
    for (auto& p : parts)
      if (p)
        p->abort(why);
    for (auto& d : devs)
      if (d)
        d->abort(why);
    dev_abort.store(true);
  }
  coll::communicator* join_comm = nullptr;  // the catch-up we receive, while it runs
  uint32_t join_source = 0;
  uint64_t join_losses_before = 0;          // lost_count[join_source] when it began
  std::map<uint64_t, session_ptr> sessions; // as source, by session id
  /// A catch-up context made at start-up, so that neither a source nor a
  /// joiner creates a UCP context (20-80 ms of CPU on these machines) while
  /// training runs beside it. Taken by one session at a time, given back
  /// after a clean end (a failed session's worker may hold a dead peer's
  /// leftovers, so it is dropped: it keeps no spare worker).
  std::shared_ptr<coll::host_context> spare_catchup_ctx;
  expected<std::shared_ptr<coll::host_context>> take_catchup_ctx() {
    {
      std::lock_guard lk(mu);
      if (spare_catchup_ctx)
        return std::exchange(spare_catchup_ctx, nullptr);
    }
    return coll::transfer_context(o.rank);
  }
  /// After a clean session only: its peer is done with the context (the
  /// stream's end marker was the last message), so the next session, with
  /// another peer, needs no fresh worker.
  void give_back_catchup_ctx(std::shared_ptr<coll::host_context> c) {
    c->quiesced();
    std::lock_guard lk(mu);
    if (!spare_catchup_ctx)
      spare_catchup_ctx = std::move(c);
  }
  /// Sizes of this rank's params, moments and scalars, from the trainer's
  /// step boundaries: a source prepares snapshot buffers of these sizes.
  std::optional<std::array<size_t, 4>> state_sizes;
  wire::worker_status status;
  bool announce_commit = false; // the first commit of an epoch is beaconed at once
  int64_t computing_since = 0;  // mono_ns of the running computation's start, 0: none
  std::thread beacon;

  impl(supervisor_options opts, coordinator_client c, std::shared_ptr<coll::host_context> x)
      : o(std::move(opts)), client_(std::make_shared<coordinator_client>(std::move(c))),
        ctx(std::move(x)) {
    status.incarnation = o.incarnation;
    // Until the trainer first asks for an epoch (its model built): a
    // restarted rank is given a catch-up source only once it can take the
    // snapshot, so its start-up does not run while a source serves it.
    status.state = wire::worker_status::starting;
  }

  std::shared_ptr<coordinator_client> client() const {
    std::lock_guard lk(mu);
    return client_;
  }
  bool reconnect();

  void on_control(const control_message& m);
  void dial(const std::vector<rank_incarnation>& wanted);
  void abort_if_left_out(); // with mu held
  void set_status(uint8_t state, std::optional<uint64_t> step = {},
                  std::optional<uint64_t> epoch = {}, std::optional<uint64_t> session = {});
  void send_status();
  void run_beacon();
  void serve(session_ptr s);
  caf::error receive(const wire::catchup_assign& a, train_state& st, const apply_update& apply);
  coll::peer_status member_status(uint64_t epoch);
  /// Catch-up moves whole state buffers between two processes: large
  /// chunks (fewer messages), the rest as for training.
  coll::host_options catchup_host_options() const {
    auto h = o.host;
    h.chunk_bytes = std::max<size_t>(h.chunk_bytes, o.catchup_chunk_bytes);
    // Catch-up runs beside training: it must not spin on a core the
    // trainers need while it waits for its peer (a joiner waits a whole
    // step for each update): it sleeps on the worker's events.
    h.spin_before_yield = 1;
    h.sleep_when_idle = std::chrono::milliseconds(2);
    h.idle_polls_before_sleep = 100;
    // It broadcasts (and the shared-memory ring would sleep through its
    // slices: nothing wakes the worker's descriptor for it).
    h.shared_memory_ring = false;
    return h;
  }
};

void supervisor::impl::set_status(uint8_t state, std::optional<uint64_t> step,
                             std::optional<uint64_t> epoch, std::optional<uint64_t> session) {
  {
    std::lock_guard lk(mu);
    status.state = state;
    if (step)
      status.step = *step;
    if (epoch)
      status.epoch = *epoch;
    if (session)
      status.session = *session;
  }
  send_status();
}

void supervisor::impl::send_status() {
  wire::worker_status s;
  {
    std::lock_guard lk(mu);
    s = status;
  }
  s.mono_ns = mono_ns();
  // The coordinator may be gone for a while: training goes on meanwhile,
  // and the beacon thread reconnects.
  if (client()->send_status(s)) {
    std::lock_guard lk(mu);
    connected = false;
  }
}

bool supervisor::impl::reconnect() {
  auto c = coordinator_client::connect(*o.coordinator, std::chrono::milliseconds(500));
  if (!c)
    return false;
  auto fresh = std::make_shared<coordinator_client>(std::move(*c));
  if (fresh->rejoin(o.registration))
    return false;
  fresh->on_control([this](const control_message& m) { on_control(m); });
  std::optional<wire::report> done;
  {
    std::lock_guard lk(mu);
    client_ = fresh;
    connected = true;
    done = done_report;
  }
  spdlog::warn("supervisor: rank {} reconnected to the coordinator at {}", o.rank,
               o.coordinator->to_string());
  send_status();
  if (done)
    (void) fresh->report(*done);
  return true;
}

void supervisor::impl::run_beacon() {
  std::unique_lock lk(mu);
  while (!stopping) {
    if (o.step_timeout.count() > 0 && computing_since != 0
        && mono_ns() - computing_since > o.step_timeout.count() * 1000000) {
      // The step watchdog: this rank's computation hangs. Say so and end
      // the process; its peers are told by its closed connection at once.
      auto why = fmt::format("step watchdog: rank {} computed for more than {} ms", o.rank,
                             o.step_timeout.count());
      lk.unlock();
      spdlog::error("supervisor: {}; ending the process", why);
      (void) client()->report({o.rank, "failed", why, mono_ns()});
      std::this_thread::sleep_for(std::chrono::milliseconds(50)); // let the report leave
      std::_Exit(exit_hung);
    }
    bool lost = !connected;
    lk.unlock();
    if (lost && o.coordinator)
      reconnect();
    else
      send_status();
    lk.lock();
    cv.wait_for(lk, o.beacon_interval, [&] { return stopping; });
  }
}

/// A member of `epoch` is lost when a newer epoch left it out.
coll::peer_status supervisor::impl::member_status(uint64_t epoch) {
  return [this, epoch](uint32_t r) -> caf::error {
    std::lock_guard lk(mu);
    if (stopping)
      return make_error(errc::closed, "the supervisor is stopping");
    if (failed)
      return make_error(errc::unrecoverable, failed->reason);
    if (auto it = lost.find(r); it != lost.end() && it->second >= epoch)
      return make_error(errc::peer_lost, fmt::format("rank {} was lost in epoch {}", r, it->second));
    if (newest && newest->epoch > epoch && !has_rank(*newest, r))
      return make_error(errc::peer_lost, fmt::format("epoch {} left out rank {}", newest->epoch, r));
    return {};
  };
}

void supervisor::impl::abort_if_left_out() {
  if (failed) {
    if (comm)
      abort_epoch(make_error(errc::unrecoverable, failed->reason));
    if (join_comm)
      join_comm->abort(make_error(errc::unrecoverable, failed->reason));
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
  if (join_comm && lost_count[join_source] > join_losses_before) {
    join_comm->abort(make_error(errc::peer_lost,
                                fmt::format("catch-up source rank {} was lost", join_source)));
  }
  if (!newest)
    return;
  if (comm && newest->epoch > comm->members().epoch && newest->abort_running) {
    // The running epoch broke though its members live: nobody is coming
    // back to its collectives.
    abort_epoch(make_error(errc::aborted, fmt::format("epoch {} replaces the broken epoch {}",
                                                      newest->epoch, comm->members().epoch)));
  } else if (comm && newest->epoch > comm->members().epoch) {
    const auto& m = comm->members();
    for (auto r : m.ranks) {
      bool stays = has_rank(*newest, r)
                   && (r != o.rank || includes(*newest, o.rank, o.incarnation));
      if (!stays) {
        abort_epoch(make_error(errc::peer_lost, fmt::format("epoch {} left out rank {} ({})",
                                                            newest->epoch, r, newest->reason)));
        break;
      }
    }
  }
  if (join_comm && !has_rank(*newest, join_source))
    join_comm->abort(make_error(errc::peer_lost, fmt::format("catch-up source rank {} left the "
                                                             "job in epoch {}",
                                                             join_source, newest->epoch)));
}

/// The mesh follows the membership: `wanted` dialled at the addresses of
/// the latest peer table (mu held).
void supervisor::impl::dial(const std::vector<rank_incarnation>& wanted) {
  if (o.mesh == nullptr || !client_)
    return;
  auto table = client_->latest_table();
  if (!table)
    return;
  for (auto& e : entries_to_dial(*table, wanted, o.rank))
    if (auto err = o.mesh->connect_peer(e))
      spdlog::warn("supervisor: cannot dial rank {} (incarnation {}): {}", e.rank, e.incarnation,
                   describe(err));
}

void supervisor::impl::on_control(const control_message& m) {
  std::lock_guard lk(mu);
  if (auto* n = std::get_if<wire::epoch_notice>(&m)) {
    if (n->fail) {
      failed = *n;
    } else if (!n->lost.empty()) {
      for (auto r : n->lost) {
        lost[r] = std::max(lost[r], n->epoch);
        ++lost_count[r];
        if (join_comm && r == join_source)
          join_comm->abort(make_error(errc::peer_lost,
                                      fmt::format("catch-up source rank {} was lost", r)));
      }
    } else if (!newest || n->epoch > newest->epoch) {
      newest = *n;
      std::vector<rank_incarnation> members;
      for (size_t i = 0; i < n->ranks.size() && i < n->incarnations.size(); ++i)
        members.push_back({n->ranks[i], n->incarnations[i]});
      dial(members);
    } else if (n->epoch == newest->epoch && n->abort_running) {
      // The newest epoch again: the one before it broke after it came.
      newest->abort_running = true;
    }
    abort_if_left_out();
  } else if (auto* a = std::get_if<wire::catchup_assign>(&m)) {
    if (a->joiner == o.rank && a->joiner_incarnation == o.incarnation) {
      dial({{a->source, 0}}); // a member: the table's entry is its running incarnation
      if (!join || a->session > join->session) {
        join = *a;
        join_source_losses = lost_count[a->source];
        if (join_comm)
          join_comm->abort(make_error(errc::aborted, "a newer catch-up session was assigned"));
      }
    } else if (a->source == o.rank && !sessions.count(a->session)) {
      dial({{a->joiner, a->joiner_incarnation}});
      // A new session for the same joiner replaces the old one.
      for (auto& [id, s] : sessions) {
        if (s->assign.joiner == a->joiner && !s->broken) {
          s->broken = true;
          if (s->comm)
            s->comm->abort(make_error(errc::aborted, "replaced by a newer session"));
        }
      }
      auto s = std::make_shared<session>();
      s->assign = *a;
      sessions[a->session] = s;
      spdlog::info("supervisor: rank {} is the catch-up source of rank {} (session {})", o.rank,
                   a->joiner, a->session);
      // Started under the lock, so stop() never sees a half-assigned thread.
      if (!stopping)
        s->thread = std::thread([this, s] { serve(s); });
    }
  }
  cv.notify_all();
}

void supervisor::impl::serve(session_ptr s) {
  if (!lower_thread_priority(o.catchup_nice))
    spdlog::debug("supervisor: cannot lower the catch-up thread's priority: {}", std::strerror(errno));
  const auto& a = s->assign;
  auto fail = [&](const caf::error& e) {
    spdlog::warn("supervisor: catch-up session {} to rank {} failed: {}", a.session, a.joiner,
                 describe(e));
    std::lock_guard lk(mu);
    s->broken = true;
    s->queue.clear();
    s->drop_state();
  };
  // Prepared before the snapshot, here: the buffers are allocated and their
  // pages touched on this thread, on huge pages (a fresh 100 MB vector
  // filled on the trainer's thread cost it 270 ms of page faults), and the
  // communicator is built, so that at the step boundary the trainer only
  // copies (6 ms for 100 MB).
  const auto t_setup = mono_ns();
  const auto cpu_setup = thread_cpu_ns();
  {
    std::array<size_t, 4> n;
    {
      std::unique_lock lk(mu);
      if (!cv.wait_for(lk, 600s, [&] { return stopping || s->broken || state_sizes.has_value(); }))
        return fail(make_error(errc::timeout, "no step boundary for 600 s"));
      if (stopping || s->broken)
        return;
      n = *state_sizes;
    }
    auto fresh = snapshot_buffers::sized(n, page_array::pages::huge);
    std::fill(fresh.memory.begin(), fresh.memory.end(), 0.0f); // fault the pages in here
    std::lock_guard lk(mu);
    s->snap = std::move(fresh);
  }
  const auto t_buffers = mono_ns();
  auto sctx = take_catchup_ctx();
  if (!sctx)
    return fail(sctx.error());
  const auto t_ctx = mono_ns();
  auto cl = client();
  // Nothing tells a source that its joiner died: its session ends when the
  // supervisor stops, when a newer session replaces it, or at the timeout.
  coll::peer_status session_status = [this, s](uint32_t) -> caf::error {
    std::lock_guard lk(mu);
    if (stopping)
      return make_error(errc::closed, "the supervisor is stopping");
    if (s->broken)
      return make_error(errc::aborted, "the catch-up session was replaced");
    return {};
  };
  auto c = coll::make_host_communicator(*sctx, {catchup_epoch(a.session), {o.rank, a.joiner}},
                                        *cl, session_status, catchup_host_options());
  if (!c)
    return fail(c.error());
  {
    std::lock_guard lk(mu);
    if (s->broken || stopping)
      return;
    s->comm = std::move(*c);
  }
  cv.notify_all();
  spdlog::info("supervisor: session {}: prepared for rank {} in {:.1f} ms (buffers {:.1f}, context "
               "{:.1f}, communicator {:.1f}; CPU {:.1f})",
               a.session, a.joiner, (mono_ns() - t_setup) / 1e6, (t_buffers - t_setup) / 1e6,
               (t_ctx - t_buffers) / 1e6, (mono_ns() - t_ctx) / 1e6,
               (thread_cpu_ns() - cpu_setup) / 1e6);
  const auto cpu_prepared = thread_cpu_ns();
  {
    std::unique_lock lk(mu);
    if (!cv.wait_for(lk, 600s, [&] { return stopping || s->broken || !s->want_snapshot; }))
      return fail(make_error(errc::timeout, "no step boundary for 600 s"));
    if (stopping || s->broken)
      return;
  }
  auto& comm = *s->comm;
  const size_t n_params = s->snap.parts[0].size();
  int64_t hdr[2] = {static_cast<int64_t>(s->snap_step), static_cast<int64_t>(n_params)};
  caf::error e = comm.broadcast(hdr, 2, coll::dtype::int64, 0);
  // The joiner says when it has checked the header and waits for the
  // state, and when it holds all of it. The time from the first word to
  // the last is the transfer's (the joiner's start-up and endpoints are
  // not in it). Each array's broadcast itself waits for the joiner's
  // receives to be posted (an eager stream ahead of them would fill UCX's
  // unexpected queue with fresh buffers). The joiner answers the header at
  // once: its word is awaited without naps (a nap is up to 2 ms of a
  // transfer of a few).
  int64_t joiner_says = 0;
  if (!e)
    e = comm.broadcast(&joiner_says, 1, coll::dtype::int64, 1, transfer_op);
  auto t0 = mono_ns();
  for (auto part : s->snap.parts)
    if (!e)
      e = comm.broadcast(part.data(), part.size(), coll::dtype::float32, 0, transfer_op);
  if (!e)
    e = comm.broadcast(&joiner_says, 1, coll::dtype::int64, 1, transfer_op);
  if (e)
    return fail(e);
  double secs = static_cast<double>(mono_ns() - t0) / 1e9;
  double mb = 3.0 * static_cast<double>(n_params * sizeof(float)) / 1e6;
  // The snapshot is sent: give its memory back (a session object stays,
  // small, until the supervisor stops).
  s->drop_state();
  spdlog::info("supervisor: session {}: snapshot of step {} sent to rank {} ({:.1f} MB in {:.3f} s, "
               "{:.2f} GB/s; CPU from the prepared communicator {:.1f} ms)",
               a.session, s->snap_step, a.joiner, mb, secs, mb / 1e3 / std::max(secs, 1e-9),
               (thread_cpu_ns() - cpu_prepared) / 1e6);
  const auto cpu_sent = thread_cpu_ns();
  uint64_t streamed = 0;
  for (;;) {
    std::pair<uint64_t, std::vector<float>> item;
    bool last = false;
    {
      std::unique_lock lk(mu);
      // A step takes well under this; silence this long means training stopped.
      if (!cv.wait_for(lk, 600s, [&] { return stopping || s->broken || s->end || !s->queue.empty(); }))
        return fail(make_error(errc::timeout, "no committed step to stream for 600 s"));
      if (stopping || s->broken)
        return;
      if (!s->queue.empty()) {
        item = std::move(s->queue.front());
        s->queue.pop_front();
      } else {
        last = true;
      }
    }
    if (last) {
      int64_t end[2] = {-1, 0};
      if (auto err = comm.broadcast(end, 2, coll::dtype::int64, 0))
        return fail(err);
      spdlog::info("supervisor: session {}: stream to rank {} ended after {} update(s) (CPU {:.1f} ms;"
                   " the whole session {:.1f} ms)",
                   a.session, a.joiner, streamed, (thread_cpu_ns() - cpu_sent) / 1e6,
                   (thread_cpu_ns() - cpu_setup) / 1e6);
      {
        std::lock_guard lk(mu);
        s->comm.reset();
      }
      give_back_catchup_ctx(std::move(*sctx));
      return;
    }
    int64_t h[2] = {static_cast<int64_t>(item.first), static_cast<int64_t>(item.second.size())};
    if (auto err = comm.broadcast(h, 2, coll::dtype::int64, 0))
      return fail(err);
    if (auto err = comm.broadcast(item.second.data(), item.second.size(), coll::dtype::float32, 0,
                                  transfer_op))
      return fail(err);
    ++streamed;
  }
}

caf::error supervisor::impl::receive(const wire::catchup_assign& a, train_state& st,
                                const apply_update& apply) {
  set_status(wire::worker_status::catching_up, {}, {}, a.session);
  auto jctx = take_catchup_ctx();
  if (!jctx)
    return jctx.error();
  // Declared before the communicator, so it runs after that is gone.
  struct give_back_t {
    impl* self;
    std::shared_ptr<coll::host_context> ctx;
    bool clean = false;
    ~give_back_t() {
      if (clean)
        self->give_back_catchup_ctx(std::move(ctx));
    }
  } give_back{this, *jctx};
  // Losses of the source heard of since the assignment came end the session.
  uint64_t losses_before = 0;
  {
    std::lock_guard lk(mu);
    losses_before = join && join->session == a.session ? join_source_losses : lost_count[a.source];
  }
  coll::peer_status source_status = [this, losses_before](uint32_t r) -> caf::error {
    std::lock_guard lk(mu);
    if (stopping)
      return make_error(errc::closed, "the supervisor is stopping");
    if (lost_count[r] > losses_before)
      return make_error(errc::peer_lost, fmt::format("catch-up source rank {} was lost", r));
    if (newest && !has_rank(*newest, r))
      return make_error(errc::peer_lost, fmt::format("catch-up source rank {} left the job", r));
    return {};
  };
  auto cl = client();
  auto c = coll::make_host_communicator(*jctx, {catchup_epoch(a.session), {a.source, o.rank}},
                                        *cl, source_status, catchup_host_options());
  if (!c)
    return c.error();
  auto& comm = **c;
  {
    std::lock_guard lk(mu);
    join_comm = &comm;
    join_source = a.source;
    join_losses_before = losses_before;
    abort_if_left_out();
  }
  struct clear_t {
    impl* self;
    ~clear_t() {
      std::lock_guard lk(self->mu);
      self->join_comm = nullptr;
    }
  } clear{this};
  int64_t hdr[2] = {0, 0};
  if (auto e = comm.broadcast(hdr, 2, coll::dtype::int64, 0))
    return e;
  if (hdr[0] < 0 || static_cast<size_t>(hdr[1]) != st.params.size())
    return make_error(errc::invalid_argument,
                      fmt::format("catch-up snapshot of {} parameters at step {}; this model has {}",
                                  hdr[1], hdr[0], st.params.size()));
  // Ready for the state, then holding all of it: the words the source
  // times the transfer by (see serve). This side's clock runs from the
  // first word sent to the last: the state moved in between, with the
  // source's wake-up but not its noticing the end.
  int64_t says = 1;
  if (auto e = comm.broadcast(&says, 1, coll::dtype::int64, 1))
    return e;
  const auto t0 = mono_ns();
  for (std::span<float> x : {st.params, st.adam_m, st.adam_v, st.scalars})
    if (auto e = comm.broadcast(x.data(), x.size(), coll::dtype::float32, 0, transfer_op))
      return e;
  if (auto e = comm.broadcast(&says, 1, coll::dtype::int64, 1, transfer_op))
    return e;
  st.step = static_cast<uint64_t>(hdr[0]);
  const double secs = static_cast<double>(mono_ns() - t0) / 1e9;
  const double mb = 3.0 * static_cast<double>(st.params.size() * sizeof(float)) / 1e6;
  spdlog::info("supervisor: rank {} received the snapshot of step {} from rank {} (session {}): "
               "{:.1f} MB in {:.4f} s, {:.2f} GB/s",
               o.rank, st.step, a.source, a.session, mb, secs, mb / 1e3 / std::max(secs, 1e-9));
  set_status(wire::worker_status::ready, st.step);
  std::vector<float> update(st.params.size());
  for (;;) {
    // The stream ends when the source enters the epoch that admits us.
    if (auto e = comm.broadcast(hdr, 2, coll::dtype::int64, 0, {std::chrono::minutes(10)}))
      return e;
    if (hdr[0] < 0) {
      give_back.clean = true;
      return {};
    }
    if (static_cast<uint64_t>(hdr[0]) != st.step || static_cast<size_t>(hdr[1]) != update.size())
      return make_error(errc::invalid_argument,
                        fmt::format("catch-up stream sent step {} while this rank is at step {}",
                                    hdr[0], st.step));
    if (auto e = comm.broadcast(update.data(), update.size(), coll::dtype::float32, 0,
                                transfer_op)) // right behind its header
      return e;
    apply(st.step, update);
    ++st.step;
    set_status(wire::worker_status::ready, st.step);
  }
}

supervisor::supervisor(supervisor_options o, coordinator_client client, std::shared_ptr<coll::host_context> ctx)
    : impl_(std::make_unique<impl>(std::move(o), std::move(client), std::move(ctx))) {}

std::shared_ptr<coordinator_client> supervisor::client() const {
  return impl_->client();
}

supervisor::~supervisor() {
  stop();
}

void supervisor::start() {
  auto* I = impl_.get();
  if (auto c = coll::transfer_context(I->o.rank))
    I->spare_catchup_ctx = std::move(*c);
  else
    spdlog::warn("supervisor: no spare catch-up context ({}); a catch-up will make its own",
                 describe(c.error()));
  I->client()->on_control([I](const control_message& m) { I->on_control(m); });
  I->beacon = std::thread([I] { I->run_beacon(); });
}

void supervisor::stop() {
  auto& I = *impl_;
  std::vector<session_ptr> all;
  {
    std::lock_guard lk(I.mu);
    if (I.stopping)
      return;
    I.stopping = true;
    if (I.comm)
      I.abort_epoch(make_error(errc::closed, "the supervisor is stopping"));
    if (I.join_comm)
      I.join_comm->abort(make_error(errc::closed, "the supervisor is stopping"));
    for (auto& [id, s] : I.sessions) {
      all.push_back(s);
      if (s->comm)
        s->comm->abort(make_error(errc::closed, "the supervisor is stopping"));
    }
  }
  I.cv.notify_all();
  I.client()->on_control({});
  if (I.beacon.joinable())
    I.beacon.join();
  for (auto& s : all)
    if (s->thread.joinable())
      s->thread.join();
}

void supervisor::finished(uint64_t step, const wire::report& done) {
  {
    std::lock_guard lk(impl_->mu);
    impl_->done_report = done;
  }
  impl_->set_status(wire::worker_status::training, step);
  (void) impl_->client()->report(done);
}

void supervisor::computing(bool on) {
  std::lock_guard lk(impl_->mu);
  impl_->computing_since = on ? mono_ns() : 0;
}

void supervisor::abort_epoch(const caf::error& why) {
  std::lock_guard lk(impl_->mu);
  impl_->abort_epoch(why);
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
  std::lock_guard lk(impl_->mu);
  return impl_->newest ? impl_->newest->epoch : 0;
}

void supervisor::at_boundary(const train_state& st) {
  auto& I = *impl_;
  std::vector<session_ptr> start;
  const auto t0 = mono_ns();
  {
    std::lock_guard lk(I.mu);
    I.status.step = st.step;
    if (!I.state_sizes)
      I.cv.notify_all(); // a source may be waiting to size its buffers
    I.state_sizes = {st.params.size(), st.adam_m.size(), st.adam_v.size(), st.scalars.size()};
    for (auto& [id, s] : I.sessions) {
      if (!s->want_snapshot || !s->prepared() || s->broken)
        continue;
      s->want_snapshot = false;
      s->snap_step = st.step;
      // Copies into the buffers the serving thread prepared; a size that
      // changed since (it does not, within a run) gets a fresh buffer.
      const std::span<const float> from[4] = {st.params, st.adam_m, st.adam_v, st.scalars};
      const std::array<size_t, 4> n{from[0].size(), from[1].size(), from[2].size(),
                                    from[3].size()};
      for (size_t i = 0; i < n.size(); ++i)
        if (s->snap.parts[i].size() != n[i]) {
          s->snap = snapshot_buffers::sized(n, page_array::pages::normal);
          break;
        }
      for (size_t i = 0; i < n.size(); ++i)
        std::copy(from[i].begin(), from[i].end(), s->snap.parts[i].begin());
      start.push_back(s);
    }
  }
  if (start.empty())
    return;
  I.cv.notify_all();
  for (auto& s : start)
    spdlog::info("supervisor: session {}: snapshot of step {} taken for rank {} ({:.1f} ms)",
                 s->assign.session, s->snap_step, s->assign.joiner, (mono_ns() - t0) / 1e6);
}

void supervisor::committed(uint64_t k, std::span<const float> update) {
  auto& I = *impl_;
  std::unique_lock lk(I.mu);
  I.status.step = k + 1;
  if (I.announce_commit) {
    // The coordinator times recovery by this beacon: send it now, not at
    // the next beacon tick.
    I.announce_commit = false;
    lk.unlock();
    I.send_status();
    lk.lock();
  }
  for (auto& [id, s] : I.sessions) {
    if (s->want_snapshot || s->broken || s->end)
      continue;
    if (s->queue.size() >= I.o.stream_max) {
      spdlog::warn("supervisor: rank {} fell {} steps behind its catch-up stream; cutting it off",
                   s->assign.joiner, s->queue.size());
      s->broken = true;
      s->queue.clear();
      if (s->comm)
        s->comm->abort(make_error(errc::queue_full, "catch-up stream overflow"));
      continue;
    }
    s->queue.emplace_back(k, std::vector<float>(update.begin(), update.end()));
  }
  I.cv.notify_all();
}

expected<coll::communicator*> supervisor::enter_epoch(uint64_t after, const caf::error& why,
                                                 train_state& st, const apply_update& apply) {
  auto& I = *impl_;
  const bool member_before = after != 0;
  if (why && member_before) {
    // The coordinator re-forms the epoch if no death explains this.
    std::lock_guard lk(I.mu);
    I.note_broken(after, describe(why));
  }
  I.set_status(why ? wire::worker_status::recovering
               : member_before ? wire::worker_status::training
                               : (st.step == 0 ? wire::worker_status::fresh
                                               : wire::worker_status::ready),
               st.step);
  auto deadline = clock_type::now() + I.o.epoch_wait;
  std::unique_lock lk(I.mu);
  for (;;) {
    auto snapshot_owed = [&] {
      return member_before && std::any_of(I.sessions.begin(), I.sessions.end(), [](auto& kv) {
               return kv.second->want_snapshot && kv.second->prepared() && !kv.second->broken;
             });
    };
    I.cv.wait_until(lk, deadline, [&] {
      return I.stopping || I.failed || snapshot_owed()
             || (!member_before && I.join && I.join->session > I.join_done)
             || (I.newest && I.newest->epoch > after);
    });
    if (!I.stopping && snapshot_owed()) {
      // A member waiting for its next epoch is at a step boundary: it can
      // serve a joiner now (this is how a quorum lost to several deaths at
      // once is rebuilt from the survivors).
      lk.unlock();
      at_boundary(st);
      lk.lock();
      continue;
    }
    if (I.stopping)
      return make_error(errc::closed, "the supervisor stopped");
    if (I.failed)
      return make_error(errc::unrecoverable, I.failed->reason);
    if (I.join && I.join->session > I.join_done && !member_before) {
      auto a = *I.join;
      I.join_done = a.session;
      lk.unlock();
      // On a thread of its own, so that its priority can be lowered and
      // the trainer's thread keeps its own.
      caf::error e;
      std::thread([&] {
        lower_thread_priority(I.o.catchup_nice);
        e = I.receive(a, st, apply);
      }).join();
      if (e) {
        spdlog::warn("supervisor: catch-up session {} from rank {} failed: {}", a.session, a.source,
                     describe(e));
        // Back to square one: a fresh snapshot from a (new) source.
        I.set_status(wire::worker_status::fresh, st.step, {}, a.session);
      } else {
        spdlog::info("supervisor: rank {} caught up to step {} (session {})", I.o.rank, st.step,
                     a.session);
      }
      deadline = clock_type::now() + I.o.epoch_wait;
      lk.lock();
      continue;
    }
    if (I.newest && I.newest->epoch > after) {
      auto n = *I.newest;
      if (!includes(n, I.o.rank, I.o.incarnation)) {
        if (member_before)
          return make_error(errc::fenced,
                            fmt::format("rank {} (incarnation {:x}) was left out of epoch {}: {}",
                                        I.o.rank, I.o.incarnation, n.epoch, n.reason));
        after = n.epoch; // not ours yet: wait for a catch-up or a later epoch
        continue;
      }
      // Streams to joiners admitted by this epoch end here: their last
      // update is the one committed just before the switch.
      for (auto& [id, s] : I.sessions)
        if (!s->broken && has_rank(n, s->assign.joiner))
          s->end = true;
      I.cv.notify_all();
      lk.unlock();
      auto cl = I.client();
      // A newer epoch makes this one moot: its members may go straight to
      // the newest they know (a joiner that caught up meanwhile, a member
      // that heard of it before the switch), and would never publish here.
      coll::build_status moot = [&I, epoch = n.epoch]() -> caf::error {
        std::lock_guard lk(I.mu);
        if (I.newest && I.newest->epoch > epoch)
          return make_error(errc::aborted,
                            fmt::format("epoch {} was superseded by epoch {} while it was built",
                                        epoch, I.newest->epoch));
        return {};
      };
      auto c = coll::make_host_communicator(I.ctx, {n.epoch, n.ranks}, *cl,
                                            I.member_status(n.epoch), I.o.host, std::move(moot));
      lk.lock();
      if (!c) {
        if (code_of(c.error()) == errc::aborted)
          spdlog::info("supervisor: rank {} skips epoch {}: {}", I.o.rank, n.epoch, describe(c.error()));
        else {
          spdlog::warn("supervisor: rank {} could not build epoch {}: {}", I.o.rank, n.epoch,
                       describe(c.error()));
          // Its other members may have built it and wait for this rank.
          I.note_broken(n.epoch, "could not build the epoch: " + describe(c.error()));
          lk.unlock();
          I.send_status();
          lk.lock();
        }
        after = n.epoch;
        deadline = clock_type::now() + I.o.epoch_wait;
        continue;
      }
      for (auto& p : I.parts)
        p.reset(); // the last epoch's parts (the trainer is done with them)
      I.comm = std::move(*c);
      I.abort_if_left_out(); // an epoch newer still may have come meanwhile
      I.status.state = wire::worker_status::training;
      I.status.epoch = n.epoch;
      I.status.session = 0;
      I.announce_commit = true;
      lk.unlock();
      I.send_status();
      spdlog::info("supervisor: rank {} in epoch {} ({} members) at step {}", I.o.rank, n.epoch,
                   n.ranks.size(), st.step);
      return I.comm.get();
    }
    if (clock_type::now() >= deadline)
      return make_error(errc::timeout,
                        fmt::format("rank {}: no epoch after {} within {} s", I.o.rank, after,
                                    std::chrono::duration_cast<std::chrono::seconds>(I.o.epoch_wait)
                                      .count()));
  }
}

expected<coll::communicator*> supervisor::sub_communicator(size_t slot, coll::membership part) {
  auto& I = *impl_;
  CMESH_CHECK_LT(slot, I.parts.size());
  coll::communicator* world = nullptr;
  std::shared_ptr<coll::host_context> ctx;
  uint64_t epoch = 0;
  {
    std::lock_guard lk(I.mu);
    if (!I.comm)
      return make_error(errc::invalid_argument, "no epoch to split");
    world = I.comm.get();
    epoch = world->members().epoch;
    if (!I.part_ctx[slot]) {
      auto c = coll::host_context::create(I.o.rank);
      if (!c)
        return c.error();
      I.part_ctx[slot] = std::move(*c);
    }
    ctx = I.part_ctx[slot];
  }
  auto c = coll::make_host_subcommunicator(*world, ctx, std::move(part), I.member_status(epoch),
                                           I.o.host);
  if (!c)
    return c.error();
  std::lock_guard lk(I.mu);
  I.parts[slot] = std::move(*c);
  // A loss or a newer epoch that came while it was built reaches it too.
  if (auto p = world->poisoned())
    I.parts[slot]->abort(p);
  I.abort_if_left_out();
  return I.parts[slot].get();
}

} // namespace cmesh::actors

namespace cmesh::actors {

bool supervisor::has_device_collectives() const {
  return impl_->o.device_collectives != supervisor_options::device_kind::none;
}

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
  coll::communicator* world = nullptr;
  uint64_t epoch = 0;
  std::shared_ptr<coll::host_context> ctx;
  std::unique_ptr<coll::communicator> old; // destroyed outside the lock
  {
    std::lock_guard lk(I.mu);
    if (!I.comm)
      return make_error(errc::invalid_argument, "no epoch for a device communicator");
    world = I.comm.get();
    epoch = world->members().epoch;
    auto& d = I.devs[slot];
    if (d && I.dev_epochs[slot] == epoch && d->members().ranks == part.ranks)
      return d.get();
    old = std::move(d);
    // A loss that ends this epoch while its communicator is built poisons
    // `world` (the exchange below fails) or is caught after it (below).
    I.dev_abort.store(false);
    if (I.o.device_collectives == kind::host && !I.dev_ctx[slot]) {
      auto c = coll::host_context::create(I.o.rank);
      if (!c)
        return c.error();
      I.dev_ctx[slot] = std::move(*c);
    }
    ctx = I.dev_ctx[slot];
  }
  old.reset();
  const int64_t t0 = mono_ns();
  expected<std::unique_ptr<coll::communicator>> made =
    make_error(errc::invalid_argument, "no device collectives in this build");
  if (I.o.device_collectives == kind::host) {
    made = coll::make_host_subcommunicator(*world, ctx, std::move(part), I.member_status(epoch),
                                           I.o.host);
  } else {
#ifdef CMESH_HAVE_NCCL
    // The first member of each part makes its unique id; every member
    // sends [made, 16 words of id] (zeros unless it made one) to every
    // other over the epoch's host communicator and takes its part's.
    constexpr size_t words = 1 + sizeof(coll::nccl_unique_id) / sizeof(int64_t);
    static_assert(sizeof(coll::nccl_unique_id) % sizeof(int64_t) == 0);
    const size_t n = world->size(), me = world->index();
    std::vector<int64_t> msgs(n * words, 0);
    std::string why;
    if (part.ranks[0] == I.o.rank) {
      if (auto id = coll::make_nccl_unique_id()) {
        msgs[me * words] = 1;
        std::memcpy(&msgs[me * words + 1], id->data(), id->size());
      } else {
        why = describe(id.error());
      }
    }
    std::vector<int64_t> mine(msgs.begin() + static_cast<ptrdiff_t>(me * words),
                              msgs.begin() + static_cast<ptrdiff_t>((me + 1) * words));
    if (auto e = world->all_gather(mine.data(), msgs.data(), std::vector<size_t>(n, words),
                                   coll::dtype::int64))
      return e;
    const size_t leader = world->members().index_of(part.ranks[0]);
    if (leader == n || msgs[leader * words] != 1)
      return make_error(errc::transport_failure,
                        fmt::format("epoch {}: rank {} could not make an NCCL unique id{}", epoch,
                                    part.ranks[0], why.empty() ? "" : ": " + why));
    coll::nccl_unique_id id{};
    std::memcpy(id.data(), &msgs[leader * words + 1], id.size());
    coll::nccl_options no;
    no.device = I.o.device;
    no.abort_flag = &I.dev_abort;
    no.name = fmt::format("cmesh-epoch-{}-{}", epoch, slot == 0 ? "group" : "cross");
    made = coll::make_nccl_communicator(std::move(part), I.o.rank, id, I.member_status(epoch),
                                        no);
#endif
  }
  if (!made)
    return made.error();
  spdlog::info("supervisor: rank {} built epoch {}'s device communicator {} ({}, {} members) in "
               "{:.1f} ms",
               I.o.rank, epoch, slot, I.o.device_collectives == kind::host ? "host backend" : "NCCL",
               members, static_cast<double>(mono_ns() - t0) / 1e6);
  std::lock_guard lk(I.mu);
  auto& d = I.devs[slot];
  d = std::move(*made);
  I.dev_epochs[slot] = epoch;
  if (auto p = world->poisoned())
    d->abort(p);
  I.abort_if_left_out();
  return d.get();
}

} // namespace cmesh::actors
