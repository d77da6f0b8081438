#include "transport/transport.hpp"

#include "core/check.hpp"
#include "core/env.hpp"
#include "transport/ucx.hpp"

#include <spdlog/spdlog.h>

#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>

namespace cmesh {

namespace {

constexpr int ch_shift = 60;
constexpr int src_shift = 40;
constexpr uint64_t ch_frame = 1;
constexpr uint64_t ch_ctrl = 2;
constexpr uint64_t ch_bulk = 3;
constexpr uint64_t ch_mask = uint64_t{0xf} << ch_shift;
constexpr int gen_shift = 24;
constexpr uint64_t src_bits_max = (uint64_t{1} << 20) - 1;
constexpr uint64_t gen_bits_max = (uint64_t{1} << 16) - 1;
constexpr uint64_t seq_mask = (uint64_t{1} << gen_shift) - 1;
constexpr uint64_t full_mask = ~uint64_t{0};
constexpr int64_t heartbeats_inflight_max = 16;
constexpr int probes_per_pass_max = 256;
constexpr int progress_calls_per_pass_max = 16;

uint64_t make_tag(uint64_t channel, uint32_t src, uint32_t gen, uint64_t seq) {
  return (channel << ch_shift) | (uint64_t{src} << src_shift)
         | ((uint64_t{gen} & gen_bits_max) << gen_shift) | (seq & seq_mask);
}

uint32_t tag_source(uint64_t tag) {
  return static_cast<uint32_t>((tag >> src_shift) & src_bits_max);
}

uint32_t tag_generation(uint64_t tag) {
  return static_cast<uint32_t>((tag >> gen_shift) & gen_bits_max);
}

/// An incarnation folded to the tag's 16 bits (all of its bits count: a
/// wall-clock incarnation differs from its predecessor's in the low ones).
uint32_t generation_of(uint64_t incarnation) {
  return static_cast<uint32_t>((incarnation ^ (incarnation >> 16) ^ (incarnation >> 32)
                                ^ (incarnation >> 48))
                               & gen_bits_max);
}

int64_t ms_to_ns(int64_t ms) {
  return ms * 1000000;
}

/// One UCP worker, the thread that progresses it, and the means to wake it.
struct lane {
  ucx::worker_handle ucx;
  std::thread thread;
  int wake_fd = -1;
  int epoll_fd = -1;
  std::atomic<bool> sleeping{false};
  std::vector<void*> closing; // endpoint close requests in flight

  ~lane() {
    if (wake_fd >= 0)
      ::close(wake_fd);
    if (epoll_fd >= 0)
      ::close(epoll_fd);
  }

  caf::error init(const std::string& name) {
    if (auto err = ucx.init(name))
      return err;
    wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    epoll_fd = epoll_create1(EPOLL_CLOEXEC);
    if (wake_fd < 0 || epoll_fd < 0)
      return make_error(errc::transport_failure, "eventfd/epoll_create failed");
    for (int fd : {wake_fd, ucx.event_fd()}) {
      epoll_event ev{};
      ev.events = EPOLLIN;
      ev.data.fd = fd;
      if (epoll_ctl(epoll_fd, EPOLL_CTL_ADD, fd, &ev) != 0)
        return make_error(errc::transport_failure, "epoll_ctl failed");
    }
    return {};
  }

  ucp_worker_h worker() const { return ucx.worker(); }

  void wake() {
    uint64_t one = 1;
    [[maybe_unused]] auto n = ::write(wake_fd, &one, sizeof(one));
  }

  void wake_if_sleeping() {
    if (sleeping.load())
      wake();
  }

  /// Arms the worker and waits for an event, a wake-up or the timeout;
  /// `more_work` is checked after arming, so no wake-up is lost.
  template <class MoreWork>
  void sleep(int timeout_ms, MoreWork&& more_work) {
    if (ucp_worker_arm(worker()) == UCS_ERR_BUSY)
      return;
    sleeping.store(true);
    if (more_work()) {
      sleeping.store(false);
      return;
    }
    epoll_event evs[2];
    int n = epoll_wait(epoll_fd, evs, 2, std::max(timeout_ms, 0));
    sleeping.store(false);
    for (int i = 0; i < n; ++i) {
      if (evs[i].data.fd == wake_fd) {
        uint64_t v;
        [[maybe_unused]] auto r = ::read(wake_fd, &v, sizeof(v));
      }
    }
  }

  void close_endpoint(ucp_ep_h& ep) {
    if (ep == nullptr)
      return;
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    prm.flags = UCP_EP_CLOSE_FLAG_FORCE;
    auto r = ucp_ep_close_nbx(ep, &prm);
    ep = nullptr;
    if (r != nullptr && !UCS_PTR_IS_ERR(r))
      closing.push_back(r);
  }

  void reap_closing() {
    std::erase_if(closing, [](void* r) {
      if (ucp_request_check_status(r) == UCS_INPROGRESS)
        return false;
      ucp_request_free(r);
      return true;
    });
  }

  /// Progresses until every close finished or the bound passed (a dead peer
  /// may never let one finish).
  void drain(int64_t bound_ms) {
    if (worker() == nullptr)
      return;
    auto deadline = mono_ns() + ms_to_ns(bound_ms);
    while (!closing.empty() && mono_ns() < deadline) {
      ucp_worker_progress(worker());
      reap_closing();
    }
    for (int i = 0; i < 1000; ++i)
      if (ucp_worker_progress(worker()) == 0)
        break;
  }
};

/// Completes a nbx call: immediate success, immediate error, or a request
/// whose callback runs later. Returns the request or nullptr.
template <class OnNow>
void* settle(ucs_status_ptr_t r, OnNow&& on_now) {
  if (r == nullptr) {
    on_now(UCS_OK);
    return nullptr;
  }
  if (UCS_PTR_IS_ERR(r)) {
    on_now(UCS_PTR_STATUS(r));
    return nullptr;
  }
  return r;
}

/// One inbound frame, kept in arrival order until it and its payload are in.
struct recv_slot {
  uint32_t from = 0;
  uint64_t bulk_seq = 0;
  std::vector<uint8_t> bytes;
  void* frame_req = nullptr;
  void* bulk_req = nullptr;
  bool frame_done = false;
  bool decoded = false;
  bool bulk_done = false;
  bool pull_posted = false;
  bool failed = false;
  caf::error error;
  wire::frame_header header;
  size_t body_offset = 0;
  bulk payload;

  bool ready() const {
    return failed || (decoded && (header.bulk_len == 0 || bulk_done));
  }
};
using slot_ptr = std::shared_ptr<recv_slot>;

/// A receive callback's context: keeps the slot alive until UCX is done.
struct recv_ctx {
  slot_ptr slot;
  bool is_bulk = false;
};

void on_recv_done(void* request, ucs_status_t status, const ucp_tag_recv_info_t*,
                  void* user_data) {
  auto* ctx = static_cast<recv_ctx*>(user_data);
  auto& s = *ctx->slot;
  (ctx->is_bulk ? s.bulk_req : s.frame_req) = nullptr;
  (ctx->is_bulk ? s.bulk_done : s.frame_done) = true;
  if (status != UCS_OK && !s.failed) {
    s.failed = true;
    s.error = ucx::status_error(status, ctx->is_bulk ? "bulk receive" : "frame receive");
  }
  if (request != nullptr)
    ucp_request_free(request);
  delete ctx;
}

/// Posts the receive of a probed message into the slot's bytes.
void receive_into(ucp_worker_h w, ucp_tag_message_h msg, const slot_ptr& slot) {
  ucp_request_param_t prm{};
  prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  prm.cb.recv = on_recv_done;
  auto* ctx = new recv_ctx{slot, false};
  prm.user_data = ctx;
  auto r = ucp_tag_msg_recv_nbx(w, slot->bytes.data(), slot->bytes.size(), msg, &prm);
  slot->frame_req = settle(r, [&](ucs_status_t st) { on_recv_done(nullptr, st, nullptr, ctx); });
}

struct command {
  uint32_t peer = 0;
  std::vector<uint8_t> frame;
  bulk payload;
  uint64_t incarnation = 0; // the peer's it is for (0: any)
};

struct peer_state;

/// A send callback's context: owns the buffers until UCX is done with them.
struct send_ctx {
  std::atomic<int64_t>* inflight = nullptr;
  std::vector<uint8_t> frame;
  bulk payload;
};

void on_send_done(void* request, ucs_status_t, void* user_data) {
  auto* ctx = static_cast<send_ctx*>(user_data);
  if (ctx->inflight != nullptr)
    --*ctx->inflight;
  if (request != nullptr)
    ucp_request_free(request);
  delete ctx;
}

/// Posts a tagged send whose buffers the context owns.
void send_owned(ucp_ep_h ep, uint64_t tag, send_ctx* ctx, const void* buf, size_t len) {
  ucp_request_param_t prm{};
  prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  prm.cb.send = on_send_done;
  prm.user_data = ctx;
  if (ctx->inflight != nullptr)
    ++*ctx->inflight;
  auto r = ucp_tag_send_nbx(ep, buf, len, tag, &prm);
  settle(r, [&](ucs_status_t) { on_send_done(nullptr, UCS_OK, ctx); });
}

/// What an endpoint's error callback is told: the peer and the incarnation
/// the endpoint was made for, so that the error of an old endpoint never
/// fences a newer incarnation.
struct endpoint_ref {
  peer_state* peer = nullptr;
  uint64_t incarnation = 0;
  bool ctrl_lane = false; // the control lane's endpoint, else the data lane's
};

struct peer_state {
  transport::impl* owner = nullptr;
  uint32_t rank = 0;
  std::atomic<bool> connected{false};
  std::atomic<bool> alive{false};
  std::atomic<uint64_t> incarnation{0}; // the one connected (data lane writes)
  std::atomic<uint32_t> generation{0};  // its tag generation
  std::atomic<int64_t> connected_ns{0};
  std::atomic<int64_t> last_heard_ns{0}; // 0: never heard
  /// One per endpoint ever made (bounded by the peer's restarts), kept
  /// until the transport goes: UCX may call back late. Data lane's and
  /// control lane's apart, each touched by its own thread.
  std::vector<std::unique_ptr<endpoint_ref>> data_refs, ctrl_refs;

  // data lane only
  ucp_ep_h data = nullptr;
  uint64_t next_bulk_seq = 0;
  std::atomic<int64_t> inflight{0};
  std::deque<slot_ptr> inbox;
  std::deque<command> pending;

  mutable std::mutex reason_mtx;
  caf::error reason; // why it was fenced

  // control lane only
  ucp_ep_h ctrl = nullptr;
  uint64_t ctrl_incarnation = 0; // the incarnation `ctrl` was made for
  wire::bytes ctrl_address;      // and its address
  int ctrl_remakes = 0;          // of `ctrl` for that incarnation (retry_ctrl)
  std::atomic<int64_t> heartbeats_inflight{0};
  /// A control endpoint to make (address, incarnation), handed over by the
  /// data lane when it connected a new incarnation.
  std::mutex ctrl_mtx;
  std::optional<std::pair<wire::bytes, uint64_t>> ctrl_pending;

  void heard(int64_t now) { last_heard_ns.store(now, std::memory_order_relaxed); }
};

/// Whether `incarnation` is one to connect `p` at: the first, or a newer
/// one (the same again, or an older one, fenced for good, is not).
bool supersedes(const peer_state& p, uint64_t incarnation) {
  return !p.connected || incarnation > p.incarnation;
}

/// Peer table address: u32 length of the data worker's address, that
/// address, then the control worker's address.
wire::bytes pack_addresses(const std::string& data, const std::string& ctrl) {
  wire::bytes out(4);
  auto n = static_cast<uint32_t>(data.size());
  std::memcpy(out.data(), &n, 4);
  out.insert(out.end(), data.begin(), data.end());
  out.insert(out.end(), ctrl.begin(), ctrl.end());
  return out;
}

expected<std::pair<wire::bytes, wire::bytes>> unpack_addresses(const wire::bytes& b) {
  uint32_t n = 0;
  if (b.size() < 4)
    return make_error(errc::invalid_argument, "peer address too short");
  std::memcpy(&n, b.data(), 4);
  if (n == 0 || b.size() <= 4 + size_t{n})
    return make_error(errc::invalid_argument, "peer address is malformed");
  return std::make_pair(wire::bytes(b.begin() + 4, b.begin() + 4 + n),
                        wire::bytes(b.begin() + 4 + n, b.end()));
}

/// A spin-wait hint: lets the sibling hyperthread run and saves power.
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

/// The transport whose data lane runs on this thread (null elsewhere): a
/// send from that thread posts directly instead of queueing for itself.
thread_local const void* data_lane_owner = nullptr;

} // namespace

struct transport::impl {
  uint32_t self = 0;
  uint64_t incarnation = 0; // this process's
  uint32_t generation = 0;  // and its tag generation
  transport_options opts;
  std::vector<std::unique_ptr<peer_state>> peers; // the table is fixed once started; each
                                                  // entry follows its rank's incarnations
  frame_handler on_frame;
  peer_down_handler on_down;
  peer_up_handler on_up;

  std::atomic<bool> running{false};
  std::mutex start_mtx; // connect_peer() before start() arms on its caller's thread
  std::atomic<bool> departing{false};
  std::atomic<bool> stopped{false}; // sends before start() are queued, after stop() refused

  std::mutex queue_mtx;
  std::deque<command> queue;
  std::atomic<int64_t> queued{0};
  std::atomic<int64_t> pending_frames{0}; // over all peers' pending queues
  std::condition_variable space_cv;       // senders blocked on a full queue
  std::atomic<int> space_waiters{0};
  struct failure {
    uint32_t rank = 0;
    caf::error reason;
    uint64_t incarnation = 0; // the one it concerns (0: whichever is connected)
  };
  std::vector<failure> deferred_failures; // guarded by queue_mtx
  std::atomic<int> failures_pending{0};
  std::vector<wire::peer_entry> deferred_connects; // guarded by queue_mtx
  std::atomic<int> connects_pending{0};
  std::atomic<int> ctrl_connects_pending{0};

  uint64_t heartbeat_seq = 0;

  // Declared last, so destroyed first: destroying a UCP worker purges the
  // requests still pending on it, and their callbacks count down in the
  // peers' state (a heap-use-after-free at exit under AddressSanitizer
  // when the peers went first).
  lane data;
  lane ctrl;

  struct {
    std::atomic<uint64_t> frames_sent{0}, frames_received{0}, bulk_sent{0}, bulk_received{0},
      rejected{0}, refused{0}, lost{0}, stale{0}, connected{0};
  } counters;

  peer_state* peer(uint32_t rank) { return rank < peers.size() ? peers[rank].get() : nullptr; }

  caf::error create_endpoint(lane& l, ucp_ep_h* ep, endpoint_ref& ref, const wire::bytes& addr,
                             ucp_err_handling_mode_t mode);
  /// The data endpoint of `e` on the data lane (or before start), and its
  /// control endpoint handed to the control lane; the peer is alive from
  /// here.
  caf::error arm(peer_state& p, const wire::peer_entry& e, bool started);
  /// The control lane makes the control endpoints handed over to it.
  void make_ctrl_endpoints();
  /// `p`'s control endpoint for `incarnation` at `addr`, replacing an
  /// older one: on the control lane's thread, or before start.
  caf::error make_ctrl_endpoint(peer_state& p, const wire::bytes& addr, uint64_t incarnation);

  /// On the control lane's thread, in UCX's error callback of `ref`'s
  /// endpoint: remakes it instead of fencing when its incarnation was
  /// never heard from (see on_endpoint_error). False: fence.
  bool retry_ctrl(peer_state& p, const endpoint_ref& ref, ucs_status_t status);

  void defer_failure(uint32_t rank, caf::error reason, uint64_t incarnation = 0) {
    {
      std::lock_guard<std::mutex> g(queue_mtx);
      deferred_failures.push_back({rank, std::move(reason), incarnation});
      ++failures_pending;
    }
    data.wake_if_sleeping();
  }

  void notify_space() {
    if (space_waiters.load() > 0) {
      std::lock_guard<std::mutex> g(queue_mtx);
      space_cv.notify_all();
    }
  }

  void reject(const caf::error& e) {
    ++counters.rejected;
    wire::note_reject(e, "transport");
  }

  // -- data lane -----------------------------------------------------------------
  void run_data();
  bool drain_commands();
  caf::error send_on_lane(peer_state& p, command&& c);
  void flush_pending();
  /// Posts `c`, or holds it behind `p`'s pending frames. `counted`: it is
  /// already in pending_frames (a drained batch), and leaves the count if
  /// posted.
  void post_or_hold(peer_state& p, command&& c, bool counted = false);
  void post_send(peer_state& p, command&& c);
  bool poll_frames();
  void accept_frame(ucp_tag_message_h msg, const ucp_tag_recv_info_t& info);
  void discard(ucp_worker_h w, ucp_tag_message_h msg, const ucp_tag_recv_info_t& info);
  void decode_frame_in(peer_state& p, recv_slot& s);
  void post_pull(peer_state& p, recv_slot& s, const slot_ptr& owner);
  void advance_inbox(peer_state& p);
  void apply_failures();
  void apply_connects();
  void fail(uint32_t rank, const caf::error& reason, uint64_t incarnation = 0);

  // -- control lane --------------------------------------------------------------
  void run_ctrl();
  bool poll_heartbeats();
  void post_heartbeats();
  void check_liveness(int64_t now);
};

// -- options -------------------------------------------------------------------

expected<transport_options> transport_options::from_env(transport_options d) {
  std::string err;
  bool ok = env_override("CMESH_HEARTBEAT_INTERVAL_MS", d.heartbeat_interval_ms, err)
            && env_override("CMESH_HEARTBEAT_TIMEOUT_MS", d.heartbeat_timeout_ms, err)
            && env_override("CMESH_CONNECT_TIMEOUT_MS", d.connect_timeout_ms, err)
            && env_override("CMESH_SEND_QUEUE_MAX", d.send_queue_max, err)
            && env_override("CMESH_SPIN_US", d.spin_us, err)
            && env_override("CMESH_SPIN_HOT_US", d.spin_hot_us, err)
            && env_override("CMESH_PULLS_PER_PEER", d.pulls_per_peer_max, err)
            && env_override("CMESH_SEND_BLOCK_MS", d.send_block_ms, err);
  if (!ok)
    return make_error(errc::invalid_argument, err);
  if (d.heartbeat_interval_ms <= 0 || d.heartbeat_timeout_ms <= d.heartbeat_interval_ms)
    return make_error(errc::invalid_argument,
                      "heartbeat timeout must exceed a positive heartbeat interval");
  if (d.send_queue_max <= 0 || d.inflight_per_peer_max <= 0 || d.pulls_per_peer_max <= 0
      || d.spin_us < 0 || d.spin_hot_us < 0
      || d.send_block_ms < 0 || d.connect_timeout_ms <= 0)
    return make_error(errc::invalid_argument, "transport bounds must be positive");
  return d;
}

// -- transport -----------------------------------------------------------------

transport::transport() : impl_(std::make_unique<impl>()) {}

transport::~transport() {
  stop();
}

expected<std::unique_ptr<transport>> transport::create(uint32_t self, transport_options opts,
                                                       uint64_t incarnation) {
  if (self > src_bits_max)
    return make_error(errc::invalid_argument, "rank " + std::to_string(self) + " exceeds 2^20");
  std::unique_ptr<transport> t(new transport());
  t->impl_->self = self;
  t->impl_->incarnation = incarnation;
  t->impl_->generation = generation_of(incarnation);
  t->impl_->opts = opts;
  if (auto err = t->impl_->data.init("cmesh-data-" + std::to_string(self)))
    return err;
  if (auto err = t->impl_->ctrl.init("cmesh-ctrl-" + std::to_string(self)))
    return err;
  return t;
}

uint32_t transport::self() const {
  return impl_->self;
}

const transport_options& transport::options() const {
  return impl_->opts;
}

wire::bytes transport::address() const {
  return pack_addresses(impl_->data.ucx.address(), impl_->ctrl.ucx.address());
}

void transport::set_handlers(frame_handler on_frame, peer_down_handler on_down,
                             peer_up_handler on_up) {
  CMESH_CHECK(!impl_->running);
  impl_->on_frame = std::move(on_frame);
  impl_->on_down = std::move(on_down);
  impl_->on_up = std::move(on_up);
}

caf::error transport::reserve(uint32_t world_size) {
  CMESH_CHECK(!impl_->running);
  const uint64_t max_rank = std::max<uint64_t>(impl_->self, world_size == 0 ? 0 : world_size - 1);
  if (max_rank > src_bits_max)
    return make_error(errc::invalid_argument, "rank exceeds 2^20");
  auto& peers = impl_->peers;
  if (peers.size() < max_rank + 1)
    peers.resize(max_rank + 1);
  for (uint32_t r = 0; r <= max_rank; ++r) {
    if (!peers[r]) {
      peers[r] = std::make_unique<peer_state>();
      peers[r]->owner = impl_.get();
      peers[r]->rank = r;
    }
  }
  return {};
}

caf::error transport::connect(const std::vector<wire::peer_entry>& entries) {
  CMESH_CHECK(!impl_->running);
  uint32_t max_rank = impl_->self;
  for (const auto& e : entries)
    max_rank = std::max(max_rank, e.rank);
  if (max_rank > src_bits_max)
    return make_error(errc::invalid_argument, "rank exceeds 2^20");
  if (auto e = reserve(max_rank + 1))
    return e;
  for (const auto& e : entries) {
    if (e.rank == impl_->self)
      continue;
    if (auto err = impl_->arm(*impl_->peers[e.rank], e, false))
      return err;
  }
  return {};
}

caf::error transport::connect_peer(const wire::peer_entry& e) {
  auto* p = impl_->peer(e.rank);
  if (p == nullptr)
    return make_error(errc::invalid_argument,
                      "rank " + std::to_string(e.rank) + " is beyond the peer table");
  if (e.rank == impl_->self)
    return {};
  if (auto addrs = unpack_addresses(e.ucx_address); !addrs)
    return addrs.error();
  if (impl_->stopped)
    return make_error(errc::closed, "transport is stopped");
  {
    std::lock_guard<std::mutex> g(impl_->start_mtx);
    if (!impl_->running)
      return supersedes(*p, e.incarnation) ? impl_->arm(*p, e, false) : caf::error{};
  }
  {
    std::lock_guard<std::mutex> g(impl_->queue_mtx);
    impl_->deferred_connects.push_back(e);
    ++impl_->connects_pending;
  }
  impl_->data.wake_if_sleeping();
  return {};
}

uint64_t transport::peer_incarnation(uint32_t peer) const {
  auto* p = impl_->peer(peer);
  return p != nullptr && p->connected ? p->incarnation.load() : 0;
}

caf::error transport::start() {
  std::lock_guard<std::mutex> g(impl_->start_mtx);
  if (impl_->running.exchange(true))
    return {};
  impl_->data.thread = std::thread([this] { impl_->run_data(); });
  impl_->ctrl.thread = std::thread([this] { impl_->run_ctrl(); });
  return {};
}

caf::error transport::send(uint32_t peer, std::vector<uint8_t> frame, bulk payload,
                          uint64_t incarnation) {
  auto* p = impl_->peer(peer);
  if (p == nullptr || !p->connected || peer == impl_->self)
    return make_error(errc::invalid_argument, "no endpoint to rank " + std::to_string(peer));
  if (incarnation == 0)
    incarnation = p->incarnation.load();
  if (!p->alive || incarnation != p->incarnation.load()) {
    ++impl_->counters.refused;
    return make_error(errc::peer_lost, "rank " + std::to_string(peer) + " is fenced");
  }
  if (impl_->stopped)
    return make_error(errc::closed, "transport is stopped");
  if (data_lane_owner == impl_.get())
    return impl_->send_on_lane(*p, command{peer, std::move(frame), std::move(payload),
                                           incarnation});
  {
    std::unique_lock<std::mutex> g(impl_->queue_mtx);
    auto full = [&] {
      return impl_->queued.load() + impl_->pending_frames.load() >= impl_->opts.send_queue_max;
    };
    // Backpressure: wait a bounded time for the data lane to drain (it
    // keeps a drained batch counted until it moved, so the count never
    // dips below what is queued). What ends the wait decides: space (the
    // frame goes in), the deadline with the queue still full, the peer
    // fenced, or the transport stopped.
    const auto deadline = std::chrono::steady_clock::now()
                          + std::chrono::milliseconds(impl_->opts.send_block_ms);
    bool waited_out = false;
    while (full() && p->alive && !impl_->stopped) {
      ++impl_->space_waiters;
      auto woke = impl_->space_cv.wait_until(g, deadline);
      --impl_->space_waiters;
      if (woke == std::cv_status::timeout) {
        waited_out = full();
        break;
      }
    }
    if (waited_out || !p->alive) {
      ++impl_->counters.refused;
      return make_error(errc::queue_full, "send queue holds "
                                            + std::to_string(impl_->opts.send_queue_max)
                                            + " frames after waiting "
                                            + std::to_string(impl_->opts.send_block_ms) + " ms");
    }
    if (impl_->stopped)
      return make_error(errc::closed, "transport is stopped");
    impl_->queue.push_back(command{peer, std::move(frame), std::move(payload), incarnation});
    ++impl_->queued;
  }
  impl_->data.wake_if_sleeping();
  return {};
}

bool transport::peer_alive(uint32_t peer) const {
  auto* p = impl_->peer(peer);
  return p != nullptr && p->alive;
}

caf::error transport::peer_error(uint32_t peer) const {
  auto* p = impl_->peer(peer);
  if (p == nullptr || !p->connected)
    return peer == impl_->self ? caf::error{}
                               : make_error(errc::invalid_argument,
                                            "no endpoint to rank " + std::to_string(peer));
  if (p->alive)
    return {};
  std::lock_guard<std::mutex> g(p->reason_mtx);
  return p->reason ? p->reason : make_error(errc::closed, "transport stopped");
}

void transport::fence(uint32_t peer, caf::error reason) {
  auto* p = impl_->peer(peer);
  impl_->defer_failure(peer, std::move(reason), p != nullptr ? p->incarnation.load() : 0);
}

transport_stats transport::stats() const {
  auto& c = impl_->counters;
  transport_stats s;
  s.frames_sent = c.frames_sent;
  s.frames_received = c.frames_received;
  s.bulk_bytes_sent = c.bulk_sent;
  s.bulk_bytes_received = c.bulk_received;
  s.frames_rejected = c.rejected;
  s.sends_refused = c.refused;
  s.peers_lost = c.lost;
  s.frames_stale = c.stale;
  s.peers_connected = c.connected;
  return s;
}

void transport::begin_shutdown() {
  impl_->departing = true;
}

void transport::stop() {
  if (!impl_)
    return;
  impl_->departing = true;
  impl_->stopped = true;
  if (impl_->running.exchange(false)) {
    for (lane* l : {&impl_->data, &impl_->ctrl}) {
      l->wake();
      if (l->thread.joinable())
        l->thread.join();
    }
  }
  // Both threads are gone: tear down from here.
  for (auto& p : impl_->peers) {
    if (!p)
      continue;
    p->alive = false;
    for (auto& s : p->inbox)
      for (void* r : {s->bulk_req, s->frame_req})
        if (r != nullptr)
          ucp_request_cancel(impl_->data.worker(), r);
    p->inbox.clear();
    impl_->data.close_endpoint(p->data);
    impl_->ctrl.close_endpoint(p->ctrl);
  }
  impl_->data.drain(500);
  impl_->ctrl.drain(500);
}

// -- impl: endpoints -------------------------------------------------------------

namespace {

void on_endpoint_error(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* ref = static_cast<endpoint_ref*>(arg);
  auto* p = ref->peer;
  // A control endpoint (made on the control lane's thread, where this
  // runs) that fails before anything was heard from its incarnation is
  // made again within the connect bound: when two processes dial each
  // other at once (a catch-up's source and joiner, the members of a new
  // epoch), UCX's TCP transport may fail one side's first endpoint
  // (Endpoint timeout) though both live. A peer that is really gone is
  // fenced by the remade endpoint's error or by the connect bound.
  if (ref->ctrl_lane && p->owner->retry_ctrl(*p, *ref, status))
    return;
  // Closing endpoints inside UCX's callback is not allowed: defer to the loop.
  p->owner->defer_failure(p->rank,
                          make_error(errc::peer_lost,
                                     "rank " + std::to_string(p->rank) + ": "
                                       + ucs_status_string(status)
                                       + (ref->ctrl_lane ? " (control lane)" : " (data lane)")),
                          ref->incarnation);
}

} // namespace

caf::error transport::impl::create_endpoint(lane& l, ucp_ep_h* out, endpoint_ref& ref,
                                            const wire::bytes& addr, ucp_err_handling_mode_t mode) {
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                  | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.address = reinterpret_cast<const ucp_address_t*>(addr.data());
  ep.err_mode = mode;
  ep.err_handler.cb = on_endpoint_error;
  ep.err_handler.arg = &ref;
  UCS_CHECK(ucp_ep_create(l.worker(), &ep, out));
  return {};
}

caf::error transport::impl::arm(peer_state& p, const wire::peer_entry& e, bool started) {
  auto addrs = unpack_addresses(e.ucx_address);
  if (!addrs)
    return addrs.error();
  data.close_endpoint(p.data); // an older incarnation's, if any (fail() closed a live one's)
  p.data_refs.push_back(std::make_unique<endpoint_ref>(endpoint_ref{&p, e.incarnation}));
  if (auto err = create_endpoint(data, &p.data, *p.data_refs.back(), addrs->first,
                                 UCP_ERR_HANDLING_MODE_NONE)) {
    p.data = nullptr; // the older incarnation stays as it was: fenced, or never connected
    return err;
  }
  p.next_bulk_seq = 0;
  p.incarnation = e.incarnation;
  p.generation = generation_of(e.incarnation);
  {
    std::lock_guard<std::mutex> g(p.reason_mtx);
    p.reason = {};
  }
  p.last_heard_ns = 0;
  p.connected_ns = mono_ns();
  if (started) {
    // The control lane makes its endpoint; until then it sends this
    // incarnation no heartbeat (ctrl_incarnation differs).
    {
      std::lock_guard<std::mutex> g(p.ctrl_mtx);
      p.ctrl_pending = std::make_pair(addrs->second, e.incarnation);
    }
    ++ctrl_connects_pending;
    ctrl.wake_if_sleeping();
  } else if (auto err = make_ctrl_endpoint(p, addrs->second, e.incarnation)) {
    return err;
  }
  p.connected = true;
  p.alive = true;
  ++counters.connected;
  return {};
}

void transport::impl::make_ctrl_endpoints() {
  ctrl_connects_pending = 0;
  for (auto& p : peers) {
    if (!p)
      continue;
    std::optional<std::pair<wire::bytes, uint64_t>> want;
    {
      std::lock_guard<std::mutex> g(p->ctrl_mtx);
      want.swap(p->ctrl_pending);
    }
    if (!want)
      continue;
    if (auto err = make_ctrl_endpoint(*p, want->first, want->second))
      defer_failure(p->rank, err, want->second);
  }
}

caf::error transport::impl::make_ctrl_endpoint(peer_state& p, const wire::bytes& addr,
                                               uint64_t incarnation) {
  ctrl.close_endpoint(p.ctrl);
  p.ctrl_refs.push_back(std::make_unique<endpoint_ref>(endpoint_ref{&p, incarnation, true}));
  if (auto err = create_endpoint(ctrl, &p.ctrl, *p.ctrl_refs.back(), addr,
                                 UCP_ERR_HANDLING_MODE_PEER)) {
    p.ctrl = nullptr;
    return err;
  }
  if (incarnation != p.ctrl_incarnation)
    p.ctrl_remakes = 0;
  p.ctrl_incarnation = incarnation;
  p.ctrl_address = addr;
  return {};
}

bool transport::impl::retry_ctrl(peer_state& p, const endpoint_ref& ref, ucs_status_t status) {
  constexpr int remakes_max = 5;
  if (ref.incarnation != p.incarnation.load() || ref.incarnation != p.ctrl_incarnation
      || p.last_heard_ns.load() != 0 || p.ctrl_remakes >= remakes_max
      || mono_ns() - p.connected_ns.load() > ms_to_ns(opts.connect_timeout_ms))
    return false;
  ++p.ctrl_remakes;
  spdlog::info("rank {}: the control endpoint to rank {} failed before its first heartbeat ({}); "
               "making it again ({} of {})",
               self, p.rank, ucs_status_string(status), p.ctrl_remakes, remakes_max);
  {
    std::lock_guard<std::mutex> g(p.ctrl_mtx);
    if (!p.ctrl_pending)
      p.ctrl_pending = std::make_pair(p.ctrl_address, ref.incarnation);
  }
  ++ctrl_connects_pending; // the control lane's loop remakes it, outside UCX's callback
  return true;
}

/// Connections asked for after start (connect_peer), on the data lane.
void transport::impl::apply_connects() {
  std::vector<wire::peer_entry> entries;
  {
    std::lock_guard<std::mutex> g(queue_mtx);
    entries.swap(deferred_connects);
    connects_pending = 0;
  }
  for (auto& e : entries) {
    auto* p = peer(e.rank);
    if (p == nullptr || !supersedes(*p, e.incarnation))
      continue; // the same incarnation again, or an older one: fenced for good
    if (p->alive)
      fail(e.rank,
           make_error(errc::peer_lost, "rank " + std::to_string(e.rank) + " incarnation "
                                         + std::to_string(p->incarnation.load())
                                         + " superseded by incarnation "
                                         + std::to_string(e.incarnation)));
    if (auto err = arm(*p, e, true)) {
      spdlog::warn("rank {}: cannot connect rank {} incarnation {}: {}", self, e.rank,
                   e.incarnation, describe(err));
      continue;
    }
    spdlog::debug("rank {}: connected rank {} incarnation {}", self, e.rank, e.incarnation);
    if (on_up)
      on_up(e.rank, e.incarnation);
  }
}

// -- impl: data lane -------------------------------------------------------------

void transport::impl::run_data() {
  data_lane_owner = this;
  int64_t idle_since = mono_ns();
  while (running.load(std::memory_order_relaxed)) {
    bool activity = drain_commands();
    // Bounded: each call may copy one fragment of a large pull; frames and
    // sends must not wait for a whole window of payloads.
    for (int i = 0; i < progress_calls_per_pass_max; ++i) {
      if (ucp_worker_progress(data.worker()) == 0)
        break;
      activity = true;
    }
    activity |= poll_frames();
    for (auto& p : peers)
      if (p && !p->inbox.empty())
        advance_inbox(*p);
    if (pending_frames.load(std::memory_order_relaxed) > 0)
      flush_pending();
    if (failures_pending.load(std::memory_order_relaxed) > 0)
      apply_failures();
    if (connects_pending.load(std::memory_order_relaxed) > 0)
      apply_connects();
    auto now = mono_ns();
    if (activity) {
      idle_since = now;
      continue;
    }
    if (now - idle_since < opts.spin_hot_us * 1000) {
      cpu_relax();
      continue;
    }
    if (now - idle_since < opts.spin_us * 1000) {
      std::this_thread::yield(); // a busy peer may need this core
      continue;
    }
    data.reap_closing();
    data.sleep(static_cast<int>(opts.heartbeat_interval_ms), [&] {
      return queued.load() > 0 || failures_pending.load() > 0 || connects_pending.load() > 0
             || !running.load();
    });
    idle_since = mono_ns();
  }
}

bool transport::impl::drain_commands() {
  if (queued.load(std::memory_order_acquire) == 0)
    return false;
  std::deque<command> batch;
  {
    std::lock_guard<std::mutex> g(queue_mtx);
    batch.swap(queue);
    // The batch stays counted (as pending) until each frame is posted or
    // held: a sender waiting for space must never see the occupancy dip
    // while the batch moves (it once took the dip for space, then found
    // the queue full again and failed with queue_full in milliseconds,
    // not after its wait).
    pending_frames += static_cast<int64_t>(batch.size());
    queued.store(0);
  }
  for (auto& c : batch) {
    auto* p = peer(c.peer);
    if (p == nullptr || !p->alive || (c.incarnation != 0 && c.incarnation != p->incarnation)) {
      --pending_frames;
      continue;
    }
    post_or_hold(*p, std::move(c), true);
  }
  notify_space();
  return true;
}

void transport::impl::post_or_hold(peer_state& p, command&& c, bool counted) {
  // Behind earlier held frames, or over the in-flight bound: held, in order.
  if (p.inflight.load() >= opts.inflight_per_peer_max || !p.pending.empty()) {
    p.pending.push_back(std::move(c));
    if (!counted)
      ++pending_frames;
  } else {
    post_send(p, std::move(c));
    if (counted)
      --pending_frames;
  }
}

caf::error transport::impl::send_on_lane(peer_state& p, command&& c) {
  // A handler on this thread (a frame handler, an actor dispatched here by
  // the mesh) sends: post at once, after whatever other threads queued
  // before (the order between one pair of actors holds even when an actor
  // runs here one time and on a CAF worker the next). Waiting on space_cv
  // would wait for this very thread; make room by progressing instead.
  drain_commands();
  const int64_t deadline = mono_ns() + opts.send_block_ms * 1'000'000;
  while (pending_frames.load(std::memory_order_relaxed) >= opts.send_queue_max && p.alive
         && !stopped) {
    if (mono_ns() > deadline) {
      ++counters.refused;
      return make_error(errc::queue_full, "send queue holds " + std::to_string(opts.send_queue_max)
                                            + " frames after progressing "
                                            + std::to_string(opts.send_block_ms) + " ms");
    }
    ucp_worker_progress(data.worker());
    flush_pending();
  }
  if (!p.alive) {
    ++counters.refused;
    return make_error(errc::peer_lost, "rank " + std::to_string(p.rank) + " is fenced");
  }
  post_or_hold(p, std::move(c));
  return {};
}

void transport::impl::flush_pending() {
  for (auto& p : peers) {
    if (!p)
      continue;
    while (!p->pending.empty() && p->inflight.load() < opts.inflight_per_peer_max) {
      post_send(*p, std::move(p->pending.front()));
      p->pending.pop_front();
      --pending_frames;
    }
  }
  notify_space();
}

void transport::impl::post_send(peer_state& p, command&& c) {
  const bool has_bulk = !c.payload.empty();
  uint64_t seq = 0;
  if (has_bulk) {
    seq = ++p.next_bulk_seq & seq_mask;
    if (seq == 0) // wrapped: 0 means no payload
      seq = ++p.next_bulk_seq & seq_mask;
  }
  auto* fctx = new send_ctx{&p.inflight, std::move(c.frame), {}};
  send_owned(p.data, make_tag(ch_frame, self, generation, seq), fctx, fctx->frame.data(),
             fctx->frame.size());
  ++counters.frames_sent;
  if (has_bulk) {
    auto* bctx = new send_ctx{&p.inflight, {}, std::move(c.payload)};
    counters.bulk_sent += bctx->payload.size();
    send_owned(p.data, make_tag(ch_bulk, self, generation, seq), bctx, bctx->payload.data(),
               bctx->payload.size());
  }
}

bool transport::impl::poll_frames() {
  bool any = false;
  // Bounded per pass so that sends are never starved by a flood.
  for (int i = 0; i < probes_per_pass_max; ++i) {
    ucp_tag_recv_info_t info{};
    auto* msg = ucp_tag_probe_nb(data.worker(), ch_frame << ch_shift, ch_mask, 1, &info);
    if (msg == nullptr)
      break;
    any = true;
    accept_frame(msg, info);
  }
  return any;
}

void transport::impl::discard(ucp_worker_h w, ucp_tag_message_h msg,
                              const ucp_tag_recv_info_t& info) {
  auto slot = std::make_shared<recv_slot>();
  slot->bytes.resize(info.length);
  receive_into(w, msg, slot);
}

void transport::impl::accept_frame(ucp_tag_message_h msg, const ucp_tag_recv_info_t& info) {
  const uint32_t from = tag_source(info.sender_tag);
  auto* p = peer(from);
  if (p == nullptr || !p->alive || from == self) {
    // A fenced or unknown sender: take the message off the queue and drop it.
    discard(data.worker(), msg, info);
    return;
  }
  if (tag_generation(info.sender_tag) != p->generation) {
    // Another incarnation of the rank: a process that outlived its
    // replacement, or a replacement not connected yet.
    discard(data.worker(), msg, info);
    ++counters.stale;
    return;
  }
  p->heard(mono_ns());
  if (info.length > wire::header_bytes + 2 * wire::actor_name_max + wire::body_bytes_max) {
    discard(data.worker(), msg, info);
    reject(make_error(errc::malformed_frame, "oversized frame"));
    return;
  }
  auto slot = std::make_shared<recv_slot>();
  slot->from = from;
  slot->bulk_seq = info.sender_tag & seq_mask;
  slot->bytes.resize(info.length);
  receive_into(data.worker(), msg, slot);
  p->inbox.push_back(std::move(slot));
}

void transport::impl::decode_frame_in(peer_state& p, recv_slot& s) {
  auto v = wire::decode_frame(s.bytes);
  if (!v) {
    s.failed = true;
    s.error = v.error();
    return;
  }
  if (v->header.src_process != p.rank) {
    s.failed = true;
    s.error = make_error(errc::malformed_frame,
                         "frame claims source " + std::to_string(v->header.src_process)
                           + " but came from rank " + std::to_string(p.rank));
    return;
  }
  if ((v->header.bulk_len != 0) != (s.bulk_seq != 0)) {
    s.failed = true;
    s.error = make_error(errc::malformed_frame, "bulk length and tag disagree");
    return;
  }
  s.header = std::move(v->header);
  s.body_offset = s.bytes.size() - v->body.size();
  s.decoded = true;
}

void transport::impl::post_pull(peer_state& p, recv_slot& s, const slot_ptr& owner) {
  s.pull_posted = true;
  // Taken from the pool only now: the buffer a consumer released a moment
  // ago comes back, still mapped and likely still in cache.
  s.payload = bulk::allocate(s.header.bulk_len);
  ucp_request_param_t prm{};
  prm.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  prm.cb.recv = on_recv_done;
  auto* ctx = new recv_ctx{owner, true};
  prm.user_data = ctx;
  auto r = ucp_tag_recv_nbx(data.worker(), s.payload.data(), s.payload.size(),
                            make_tag(ch_bulk, p.rank, p.generation, s.bulk_seq), full_mask,
                            &prm);
  s.bulk_req = settle(r, [&](ucs_status_t st) { on_recv_done(nullptr, st, nullptr, ctx); });
}

void transport::impl::advance_inbox(peer_state& p) {
  // Decode every arrived frame and start the payload pulls of the first
  // opts.pulls_per_peer_max that have one, in order; then deliver from the
  // front, in order.
  int pulling = 0;
  for (auto& s : p.inbox) {
    if (s->frame_done && !s->decoded && !s->failed)
      decode_frame_in(p, *s);
    if (!s->decoded || s->failed || s->header.bulk_len == 0 || s->bulk_done)
      continue;
    if (!s->pull_posted && pulling < opts.pulls_per_peer_max)
      post_pull(p, *s, s);
    pulling += s->pull_posted ? 1 : 0;
  }
  while (!p.inbox.empty() && p.inbox.front()->ready()) {
    auto s = std::move(p.inbox.front());
    p.inbox.pop_front();
    if (s->failed) {
      reject(s->error);
      continue;
    }
    ++counters.frames_received;
    counters.bulk_received += s->payload.size();
    if (on_frame) {
      inbound_frame f;
      f.from = p.rank;
      f.header = std::move(s->header);
      f.bytes = std::move(s->bytes);
      f.body_offset = s->body_offset;
      f.payload = std::move(s->payload);
      on_frame(std::move(f));
    }
  }
}

void transport::impl::apply_failures() {
  std::vector<failure> failures;
  {
    std::lock_guard<std::mutex> g(queue_mtx);
    failures.swap(deferred_failures);
    failures_pending = 0;
  }
  for (auto& f : failures)
    fail(f.rank, f.reason, f.incarnation);
}

void transport::impl::fail(uint32_t rank, const caf::error& reason, uint64_t incarnation) {
  auto* p = peer(rank);
  if (p == nullptr || !p->alive)
    return;
  if (incarnation != 0 && incarnation != p->incarnation)
    return; // about an incarnation that is gone already: not this one's
  {
    std::lock_guard<std::mutex> g(p->reason_mtx);
    p->reason = reason;
  }
  p->alive = false;
  ++counters.lost;
  spdlog::log(departing ? spdlog::level::debug : spdlog::level::warn, "rank {}: lost rank {}: {}",
              self, rank, describe(reason));
  for (auto& s : p->inbox)
    for (void* r : {s->bulk_req, s->frame_req})
      if (r != nullptr)
        ucp_request_cancel(data.worker(), r);
  p->inbox.clear();
  pending_frames -= static_cast<int64_t>(p->pending.size());
  p->pending.clear();
  notify_space();
  data.close_endpoint(p->data);
  ctrl.wake_if_sleeping(); // the control lane closes its endpoint
  if (on_down)
    on_down(rank, reason);
}

// -- impl: control lane ----------------------------------------------------------

void transport::impl::run_ctrl() {
  int64_t next_tick = mono_ns();
  while (running.load(std::memory_order_relaxed)) {
    while (ucp_worker_progress(ctrl.worker()) != 0) {
    }
    if (ctrl_connects_pending.load(std::memory_order_relaxed) > 0)
      make_ctrl_endpoints();
    bool activity = poll_heartbeats();
    for (auto& p : peers)
      if (p && !p->alive && p->ctrl != nullptr)
        ctrl.close_endpoint(p->ctrl);
    auto now = mono_ns();
    if (now >= next_tick) {
      next_tick = now + ms_to_ns(opts.heartbeat_interval_ms);
      post_heartbeats();
      check_liveness(now);
      ctrl.reap_closing();
    }
    if (activity)
      continue;
    ctrl.sleep(static_cast<int>((next_tick - now) / 1000000) + 1,
               [&] { return !running.load() || ctrl_connects_pending.load() > 0; });
  }
}

bool transport::impl::poll_heartbeats() {
  bool any = false;
  for (int i = 0; i < probes_per_pass_max; ++i) {
    ucp_tag_recv_info_t info{};
    auto* msg = ucp_tag_probe_nb(ctrl.worker(), ch_ctrl << ch_shift, ch_mask, 1, &info);
    if (msg == nullptr)
      break;
    any = true;
    auto slot = std::make_shared<recv_slot>();
    slot->bytes.resize(std::min<size_t>(info.length, 4096));
    auto* p = peer(tag_source(info.sender_tag));
    if (p != nullptr && p->alive && info.length <= 4096) {
      if (tag_generation(info.sender_tag) == p->generation)
        p->heard(mono_ns());
      else
        ++counters.stale;
    }
    receive_into(ctrl.worker(), msg, slot);
    // Heartbeats only prove liveness; a malformed one is still counted.
    if (slot->frame_done && !slot->failed) {
      auto v = wire::decode_frame(slot->bytes);
      if (!v)
        reject(v.error());
      else if (v->header.kind != wire::heartbeat::kind)
        reject(make_error(errc::malformed_frame, "non-heartbeat on the control channel"));
    }
  }
  return any;
}

void transport::impl::post_heartbeats() {
  wire::frame_header h;
  h.src_process = self;
  wire::heartbeat hb{++heartbeat_seq, mono_ns()};
  for (auto& p : peers) {
    if (!p || !p->alive || p->ctrl == nullptr || p->ctrl_incarnation != p->incarnation
        || p->heartbeats_inflight.load() >= heartbeats_inflight_max)
      continue;
    h.dst_process = p->rank;
    auto* ctx = new send_ctx{&p->heartbeats_inflight, wire::encode(h, hb), {}};
    send_owned(p->ctrl, make_tag(ch_ctrl, self, generation, 0), ctx, ctx->frame.data(),
               ctx->frame.size());
  }
}

void transport::impl::check_liveness(int64_t now) {
  for (auto& p : peers) {
    if (!p || !p->alive)
      continue;
    const uint64_t inc = p->incarnation;
    auto last = p->last_heard_ns.load(std::memory_order_relaxed);
    if (last != 0 && now - last > ms_to_ns(opts.heartbeat_timeout_ms)) {
      defer_failure(p->rank,
                    make_error(errc::peer_unresponsive,
                               "rank " + std::to_string(p->rank) + " silent for "
                                 + std::to_string((now - last) / 1000000) + " ms"),
                    inc);
    } else if (last == 0 && now - p->connected_ns > ms_to_ns(opts.connect_timeout_ms)) {
      defer_failure(p->rank,
                    make_error(errc::peer_unresponsive,
                               "rank " + std::to_string(p->rank) + " never answered within "
                                 + std::to_string(opts.connect_timeout_ms) + " ms"),
                    inc);
    }
  }
}

} // namespace cmesh
