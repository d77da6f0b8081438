#include "collectives/host/host_communicator.hpp"
#include "collectives/host/shm_ring.hpp"

#include <algorithm>

#include "core/check.hpp"
#include "core/env.hpp"
#include "transport/bootstrap.hpp"
#include "transport/ucx.hpp"

#include <poll.h>
#include <sched.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <cstring>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace cmesh::coll {

// -- context ---------------------------------------------------------------------

struct host_context::impl {
  uint32_t rank = 0;
  bulk_protocol bulk = bulk_protocol::eager;
  std::vector<std::pair<std::string, std::string>> config;
  // The worker new communicators connect on; each communicator holds the one
  // it was made on, so a renewal never pulls a worker from under it.
  std::shared_ptr<ucx::worker_handle> ucx;
  std::mutex busy; // one communicator operation at a time on the context
  // What the next communicator must know (docs/design.md, Collectives:
  // worker renewal): the members of the last one, and whether one failed.
  std::mutex renewal_mu;
  std::vector<uint32_t> last_ranks;
  std::atomic<bool> tainted{false};
  uint64_t renewals = 0;
  // The next worker, made ahead on a thread of its own (a UCP context costs
  // 10-30 ms of CPU), so that a renewal after a failure is a swap; only for
  // contexts created with keep_spare_worker. Nothing waits for it: a
  // renewal that finds no spare makes its worker itself.
  bool keep_spare = true;
  std::thread spare_maker;
  bool maker_running = false; // a spare maker is waiting or making
  std::shared_ptr<ucx::worker_handle> spare; // set by spare_maker
  std::condition_variable spare_cv;
  bool closing = false;
  // Workers left behind by a renewal, once their last communicator is gone:
  // destroyed by the spare maker, not on the rebuild's path (10 ms each).
  std::vector<std::shared_ptr<ucx::worker_handle>> retired;

  void retire(std::shared_ptr<ucx::worker_handle> w) {
    std::lock_guard<std::mutex> g(renewal_mu);
    if (w != ucx && w.use_count() == 1)
      retired.push_back(std::move(w));
  }

  /// A maker still waiting out its delay gives up; one making a worker
  /// finishes it.
  ~impl() {
    {
      std::lock_guard<std::mutex> g(renewal_mu);
      closing = true;
    }
    spare_cv.notify_all();
    if (spare_maker.joinable())
      spare_maker.join();
  }

  expected<std::shared_ptr<ucx::worker_handle>> new_worker() const {
    auto w = std::make_shared<ucx::worker_handle>();
    if (auto err = w->init("cmesh-coll-" + std::to_string(rank), config))
      return err;
    return w;
  }

  /// After `delay`: not at once after a renewal, where the other
  /// survivors rebuild their communicators on the same cores.
  /// A maker already running (waiting or making) makes the next spare.
  /// `nice`: levels the maker's thread runs below the caller's.
  void make_spare_ahead(std::chrono::milliseconds delay, int nice) {
    {
      std::lock_guard<std::mutex> g(renewal_mu);
      if (maker_running)
        return;
      maker_running = true;
    }
    if (spare_maker.joinable())
      spare_maker.join(); // the last one, done
    spare_maker = std::thread([this, delay, nice] {
      (void) lower_thread_priority(nice); // a hint: at worst it competes as before
      std::vector<std::shared_ptr<ucx::worker_handle>> old;
      {
        std::unique_lock<std::mutex> lk(renewal_mu);
        if (spare_cv.wait_for(lk, delay, [this] { return closing; })) {
          maker_running = false;
          return;
        }
        old.swap(retired);
      }
      old.clear();
      auto w = new_worker(); // on failure, the renewal makes one itself
      std::lock_guard<std::mutex> g(renewal_mu);
      if (w && !spare)
        spare = std::move(*w);
      maker_running = false;
    });
  }

  /// Moves to the spare if it was made, else to a worker made now; then
  /// starts on the next spare.
  caf::error renew() {
    std::shared_ptr<ucx::worker_handle> next;
    {
      std::lock_guard<std::mutex> g(renewal_mu);
      next = std::exchange(spare, nullptr);
    }
    if (!next) {
      auto w = new_worker();
      if (!w)
        return w.error();
      next = std::move(*w);
    }
    {
      std::lock_guard<std::mutex> g(renewal_mu);
      ucx = std::move(next);
    }
    if (keep_spare)
      make_spare_ahead(std::chrono::seconds(2), 0); // ready for the next failure
    return {};
  }

  std::shared_ptr<ucx::worker_handle> current() {
    std::lock_guard<std::mutex> g(renewal_mu);
    return ucx;
  }
};

host_context::host_context() : impl_(std::make_unique<impl>()) {}
host_context::~host_context() = default;

expected<bulk_protocol> default_bulk_protocol() {
  auto v = env_string("CMESH_COLL_BULK");
  if (!v || *v == "eager")
    return bulk_protocol::eager;
  if (*v == "rendezvous")
    return bulk_protocol::rendezvous;
  return make_error(errc::invalid_argument,
                    "CMESH_COLL_BULK=" + *v + ": expected eager or rendezvous");
}

expected<std::shared_ptr<host_context>> host_context::create(uint32_t rank,
                                                             std::optional<bulk_protocol> bulk,
                                                             bool keep_spare_worker,
                                                             size_t fifo_elems) {
  if (!bulk) {
    auto b = default_bulk_protocol();
    if (!b)
      return b.error();
    bulk = *b;
  }
  std::shared_ptr<host_context> ctx(new host_context());
  auto& I = *ctx->impl_;
  I.rank = rank;
  I.bulk = *bulk;
  // Shared-memory fragments of 32 KiB instead of UCX's 8 KiB: a quarter of
  // the per-fragment work for the same bytes (docs/design.md, Collectives).
  I.config = {{"MM_SEG_SIZE", "32k"}, {"MM_RX_BUFS_GROW", "64"}};
  if (*bulk == bulk_protocol::eager)
    I.config.emplace_back("RNDV_THRESH", "inf");
  if (fifo_elems > 0)
    I.config.emplace_back("MM_FIFO_SIZE", std::to_string(fifo_elems));
  auto w = I.new_worker();
  if (!w)
    return w.error();
  I.ucx = std::move(*w);
  I.keep_spare = keep_spare_worker;
  // At start-up, 19 nice levels down: it takes only CPU time the process
  // and its neighbours leave (a restarted rank's maker had put 8-10 ms of
  // CPU beside its catch-up and the survivors' step).
  if (keep_spare_worker)
    I.make_spare_ahead(std::chrono::milliseconds(0), 19);
  return ctx;
}

expected<std::shared_ptr<host_context>> transfer_context(uint32_t rank) {
  return host_context::create(rank, bulk_protocol::eager, false, 8);
}

caf::error host_context::prepare(const membership& next) {
  auto& I = *impl_;
  bool renew = I.tainted.load();
  {
    std::lock_guard<std::mutex> g(I.renewal_mu);
    for (auto r : I.last_ranks)
      renew |= std::find(next.ranks.begin(), next.ranks.end(), r) == next.ranks.end();
  }
  if (renew) {
    if (auto err = I.renew())
      return err;
    std::lock_guard<std::mutex> g(I.renewal_mu);
    ++I.renewals;
  }
  std::lock_guard<std::mutex> g(I.renewal_mu);
  I.last_ranks = next.ranks;
  I.tainted = false;
  return {};
}

uint64_t host_context::renewals() const {
  std::lock_guard<std::mutex> g(impl_->renewal_mu);
  return impl_->renewals;
}

bulk_protocol host_context::bulk() const {
  return impl_->bulk;
}

uint32_t host_context::rank() const {
  return impl_->rank;
}

std::string host_context::address() const {
  return impl_->current()->address();
}

namespace {

constexpr uint64_t slot_bits = 18;
// The shared-memory ring: chains a member runs at once, and slots per ring
// (more than 2 x window, see shm_ring_run).
constexpr size_t shm_ring_window = 2;
constexpr size_t shm_ring_slots = 4 * shm_ring_window;
static_assert(shm_ring_slots > 2 * shm_ring_window);
// Its messages' tags: operation (22 bits) | phase (2) | step (16) | chunk (24).
constexpr uint64_t shm_chunk_mask = (uint64_t{1} << 24) - 1;
constexpr uint64_t shm_step_shift = 24;
constexpr uint64_t shm_step_mask = (uint64_t{1} << 16) - 1;
constexpr uint64_t shm_phase_shift = 40;
constexpr uint64_t shm_op_shift = 42;
constexpr uint64_t shm_op_mask = (uint64_t{1} << 22) - 1;
// The tag slots of the ring's set-up messages (ring chunks take the low ones).
constexpr uint64_t shm_slot_locator = (uint64_t{1} << slot_bits) - 1;
constexpr uint64_t shm_slot_attached = (uint64_t{1} << slot_bits) - 2;
// A chunked broadcast's "my receives are posted" word, to the member before.
constexpr uint64_t bcast_slot_ready = (uint64_t{1} << slot_bits) - 3;
constexpr uint64_t src_bits = 14;
constexpr uint64_t op_bits = 16;
constexpr uint64_t epoch_bits = 16;

uint64_t make_tag(uint64_t epoch, uint64_t op, uint64_t src, uint64_t slot) {
  CMESH_CHECK_LT(slot, uint64_t{1} << slot_bits);
  return ((epoch & ((uint64_t{1} << epoch_bits) - 1)) << (slot_bits + src_bits + op_bits))
         | ((op & ((uint64_t{1} << op_bits) - 1)) << (slot_bits + src_bits))
         | ((src & ((uint64_t{1} << src_bits) - 1)) << slot_bits) | slot;
}

/// A contiguous run of elements: block i of a split, chunk c of a block.
struct span_el {
  size_t offset = 0;
  size_t count = 0;
};

std::vector<span_el> blocks_of(const std::vector<size_t>& counts) {
  std::vector<span_el> out(counts.size());
  size_t off = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    out[i] = {off, counts[i]};
    off += counts[i];
  }
  return out;
}

std::vector<size_t> even_split(size_t count, size_t n) {
  std::vector<size_t> out(n, count / n);
  for (size_t i = 0; i < count % n; ++i)
    ++out[i];
  return out;
}

span_el chunk_of(const span_el& block, size_t c, size_t chunk_elems) {
  size_t lo = std::min(block.count, c * chunk_elems);
  size_t hi = std::min(block.count, lo + chunk_elems);
  return {block.offset + lo, hi - lo};
}

/// Sticky overflow marker of int64 sums (see dtype.hpp).
bool has_overflow_marker(const void* buf, size_t count, dtype t, reduce_op op) {
  if (t != dtype::int64 || op == reduce_op::max)
    return false;
  auto* p = static_cast<const int64_t*>(buf);
  bool any = false;
  for (size_t i = 0; i < count; ++i)
    any |= p[i] == std::numeric_limits<int64_t>::min();
  return any;
}

void on_ep_error(void* arg, ucp_ep_h, ucs_status_t status);

/// The failure detector's verdict on a member, as this operation's error:
/// peer_lost or peer_unresponsive, always naming the rank.
caf::error member_error(uint32_t rank, const caf::error& e) {
  auto c = code_of(e);
  if (c == errc::peer_lost || c == errc::peer_unresponsive)
    return e; // the transport's reasons already name the rank
  return make_error(errc::peer_lost, "rank " + std::to_string(rank) + ": " + describe(e));
}

class host_comm final : public communicator {
public:
  host_comm(std::shared_ptr<host_context> ctx, membership m, size_t me, peer_status status,
            host_options opts)
      : ctx_(std::move(ctx)), ucx_(ctx_->internals().current()), m_(std::move(m)), me_(me),
        status_(std::move(status)), opts_(opts) {}

  ~host_comm() override {
    close();
    ctx_->internals().retire(std::move(ucx_));
  }

  caf::error connect(const std::vector<std::string>& addresses);

  const membership& members() const override { return m_; }
  size_t index() const override { return me_; }

  caf::error all_reduce(void* buf, size_t count, dtype t, reduce_op op,
                        const op_options& o) override;
  caf::error reduce_scatter(const void* in, void* out, const std::vector<size_t>& counts, dtype t,
                            reduce_op op, const op_options& o) override;
  caf::error all_gather(const void* in, void* out, const std::vector<size_t>& counts, dtype t,
                        const op_options& o) override;
  caf::error broadcast(void* buf, size_t count, dtype t, size_t root,
                       const op_options& o) override;
  caf::error all_to_allv(const void* in, const std::vector<size_t>& send_counts, void* out,
                         const std::vector<size_t>& recv_counts, dtype t,
                         const op_options& o) override;
  caf::error barrier(const op_options& o) override;

  void abort(caf::error reason) override { latch_.request_abort(std::move(reason)); }

  bool shm() const { return shm_; }

  caf::error poisoned() const override { return latch_.poisoned(); }

  void note_ep_error(size_t peer, ucs_status_t st) {
    int expected = -1;
    if (ep_failed_.compare_exchange_strong(expected, static_cast<int>(peer)))
      ep_status_ = st;
  }

private:
  // -- requests --------------------------------------------------------------------
  struct req {
    void* handle = nullptr;
    bool done = true;
    bool recv = false;
    size_t peer = 0;
  };
  using req_id = size_t;

  ucp_worker_h worker() const { return ucx_->worker(); }
  size_t n() const { return m_.size(); }
  size_t left() const { return (me_ + n() - 1) % n(); }
  size_t right() const { return (me_ + 1) % n(); }

  req_id post(ucs_status_ptr_t r, bool recv, size_t peer, const char* what);
  req_id isend(size_t peer, const void* buf, size_t bytes, uint64_t slot);
  req_id irecv(size_t peer, void* buf, size_t bytes, uint64_t slot);
  bool test(req_id id);
  caf::error progress();
  caf::error check_failures();
  caf::error wait(req_id id);
  caf::error wait_all();
  caf::error fail(caf::error e);
  /// Poisons this communicator and taints its context: the next
  /// communicator made there gets a fresh worker (host_context::prepare).
  void poison(const caf::error& e) {
    ctx_->internals().tainted = true;
    latch_.poison(e);
  }
  void close();

  // -- operation framing -------------------------------------------------------------
  caf::error begin(const char* name, const op_options& o);
  caf::error end(caf::error e);

  // -- algorithms ------------------------------------------------------------------
  caf::error recursive_doubling(uint8_t* buf, size_t count, dtype t, reduce_op op);
  caf::error ring_reduce_scatter(const uint8_t* in, uint8_t* out_own,
                                 const std::vector<span_el>& blocks, dtype t, reduce_op op);
  caf::error ring_all_gather(uint8_t* out, const std::vector<span_el>& blocks, dtype t);
  caf::error chain_broadcast(uint8_t* buf, size_t count, dtype t, size_t root);
  // The shared-memory ring of a communicator on one host (shm_ring.hpp).
  caf::error decide_shm();
  enum class shm_job : uint8_t { reduce_scatter, all_gather, all_reduce };
  /// reduce_scatter: `in` the whole input, `own_out` this member's block of
  /// the output. all_gather: `full` the output, this member's block in place.
  /// all_reduce: all three the one buffer (own_out at this member's block).
  caf::error shm_ring_run(shm_job job, const uint8_t* in, uint8_t* own_out, uint8_t* full,
                          const std::vector<span_el>& blocks, dtype t, reduce_op op);
  /// A ring message's tag: the operation, the phase (0 reduce-scatter, 1
  /// all-gather), the step and the chunk.
  uint64_t shm_tag(uint64_t phase, size_t step, size_t c) const {
    return ((tag_op_ & shm_op_mask) << shm_op_shift) | (phase << shm_phase_shift)
           | ((static_cast<uint64_t>(step) & shm_step_mask) << shm_step_shift)
           | (static_cast<uint64_t>(c) & shm_chunk_mask);
  }
  /// Chunks per block (the largest block's; at least one).
  size_t shm_chunks(const std::vector<span_el>& blocks, dtype t) const {
    const size_t ce = chunk_elems(t);
    size_t most = 0;
    for (auto& b : blocks)
      most = std::max(most, b.count);
    return std::max<size_t>(1, (most + ce - 1) / ce);
  }
  /// One turn of a shared-memory loop: spins while messages move, else
  /// counts as idle; checks failures, the abort flag and the deadline.
  caf::error shm_poll(bool moved) {
    if (moved)
      idle_polls_ = 0;
    else
      waiting_on_ = left();
    return progress();
  }
  /// A ring message of `bytes` where `want` were due: malformed.
  static caf::error shm_size_check(size_t bytes, size_t want) {
    if (bytes == want)
      return {};
    return make_error(errc::malformed_frame,
                      fmt::format("shared-memory ring: a chunk of {} bytes, {} due", bytes, want));
  }
  size_t chunk_elems(dtype t) const { return std::max<size_t>(1, opts_.chunk_bytes / size_of(t)); }
  uint8_t* staging(size_t bytes);

  std::shared_ptr<host_context> ctx_;
  std::shared_ptr<ucx::worker_handle> ucx_; // the worker this communicator was made on
  membership m_;
  size_t me_;
  peer_status status_;
  host_options opts_;
  std::vector<ucp_ep_h> eps_;
  std::vector<void*> closing_;
  shm_ring rx_ring_; // the left neighbour writes, this member reads
  shm_ring tx_ring_; // this member writes into the right neighbour's
  bool shm_untried_ = false; // the ring is decided at the first ring operation
  bool shm_ = false;

  uint64_t op_seq_ = 0;
  uint64_t tag_op_ = 0;
  const char* op_name_ = "";
  int64_t deadline_ns_ = 0;
  bool may_sleep_ = true; // this operation is not an op_options::transfer
  int64_t spin_before_yield_ = 0; // this operation's
  int64_t timeout_ms_ = 0;
  size_t waiting_on_ = 0;
  uint64_t polls_ = 0;
  uint64_t idle_polls_ = 0;
  // A broadcast's ready words: members, since a failed operation may leave
  // their requests to UCX after the call returns.
  uint8_t word_out_ = 1, word_in_ = 0;
  std::vector<req> reqs_;
  std::vector<uint8_t> staging_;
  std::unique_lock<std::mutex> busy_;

  failure_latch latch_;
  std::atomic<int> ep_failed_{-1};
  ucs_status_t ep_status_ = UCS_OK;
};

struct ep_arg {
  std::atomic<host_comm*> comm; // null once its communicator closed
  size_t peer;
};

void on_ep_error(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* a = static_cast<ep_arg*>(arg);
  if (auto* c = a->comm.load(std::memory_order_acquire))
    c->note_ep_error(a->peer, status);
}

// Endpoint callback arguments live as long as the process might call them.
// Communicators are built and closed on several threads at once (the
// trainer's epoch, a catch-up source's and a joiner's sessions): the list
// has a lock of its own.
struct ep_arg_list {
  std::mutex mu;
  std::vector<std::unique_ptr<ep_arg>> args;
};
ep_arg_list& ep_args() {
  static ep_arg_list l;
  return l;
}

caf::error host_comm::connect(const std::vector<std::string>& addresses) {
  eps_.assign(n(), nullptr);
  for (size_t i = 0; i < n(); ++i) {
    if (i == me_)
      continue;
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                    | UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t*>(addresses[i].data());
    ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    auto arg = std::make_unique<ep_arg>();
    arg->comm.store(this, std::memory_order_release);
    arg->peer = i;
    ep.err_handler.cb = on_ep_error;
    ep.err_handler.arg = arg.get();
    {
      auto& l = ep_args();
      std::lock_guard lk(l.mu);
      l.args.push_back(std::move(arg));
    }
    UCS_CHECK(ucp_ep_create(worker(), &ep, &eps_[i]));
  }
  shm_untried_ =
    n() > 1 && opts_.shared_memory_ring && env_string("CMESH_COLL_SHM_RING") != "0";
  return {};
}

caf::error host_comm::decide_shm() {
  if (!shm_untried_)
    return {};
  shm_untried_ = false;
  // Inside the first operation that runs the ring (every member runs the
  // same operations, so it is the same one everywhere), not while the
  // communicator is built: there, a member whose peer never builds (it left
  // for a newer epoch meanwhile) would wait out the timeout where nothing
  // can abort it. Every member learns whether every link works, so all pick
  // the same path: a process of another host (or namespace) fails to attach.
  // Every dtype's chunk fits: chunk_elems(t) x size_of(t) <= chunk_bytes (or one element).
  const size_t slot_bytes = std::max<size_t>(opts_.chunk_bytes, 8);
  int64_t mine[5] = {0, -1, 0, 0, 0}, theirs[5] = {};
  auto rx = shm_ring::create(shm_ring_slots, slot_bytes);
  if (rx) {
    auto where = rx->locator();
    mine[0] = where.pid;
    mine[1] = where.fd;
    mine[2] = static_cast<int64_t>(where.nonce);
    mine[3] = static_cast<int64_t>(where.slots);
    mine[4] = static_cast<int64_t>(where.slot_bytes);
  } else {
    spdlog::debug("shared-memory ring unavailable: {}", describe(rx.error()));
  }
  // The left neighbour writes into this member's ring; this member into the right's.
  isend(left(), mine, sizeof mine, shm_slot_locator);
  auto e = wait(irecv(right(), theirs, sizeof theirs, shm_slot_locator));
  int64_t attached = 0;
  if (!e && theirs[1] >= 0) {
    shm_ring_locator where{theirs[0], theirs[1], static_cast<uint64_t>(theirs[2]),
                           static_cast<uint64_t>(theirs[3]), static_cast<uint64_t>(theirs[4])};
    if (auto tx = shm_ring::attach(where)) {
      tx_ring_ = std::move(*tx);
      attached = 1;
    } else {
      spdlog::debug("shared-memory ring of rank {} not attached: {}", m_.ranks[right()],
                    describe(tx.error()));
    }
  }
  // Everyone learns whether every member attached: all take the rings or none.
  std::vector<int64_t> verdicts(n(), 0);
  verdicts[me_] = attached;
  if (!e) {
    for (size_t i = 0; i < n(); ++i)
      if (i != me_)
        irecv(i, &verdicts[i], sizeof(int64_t), shm_slot_attached);
    for (size_t i = 0; i < n(); ++i)
      if (i != me_)
        isend(i, &verdicts[me_], sizeof(int64_t), shm_slot_attached);
    e = wait_all(); // also the sends of stack buffers
  }
  if (e)
    return e;
  shm_ = rx && std::all_of(verdicts.begin(), verdicts.end(), [](int64_t v) { return v == 1; });
  if (shm_) {
    rx_ring_ = std::move(*rx);
    rx_ring_.close_descriptor(); // mapped by the left neighbour: the mapping keeps it
  } else {
    tx_ring_ = shm_ring{};
  }
  return {};
}

void host_comm::close() {
  std::lock_guard<std::mutex> g(ctx_->internals().busy);
  for (auto& r : reqs_) {
    if (r.handle != nullptr && !r.done) {
      if (r.recv)
        ucp_request_cancel(worker(), r.handle);
      ucp_request_free(r.handle);
    }
  }
  reqs_.clear();
  for (auto& ep : eps_) {
    if (ep == nullptr)
      continue;
    ucp_request_param_t prm{};
    prm.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    prm.flags = UCP_EP_CLOSE_FLAG_FORCE;
    auto r = ucp_ep_close_nbx(ep, &prm);
    if (r != nullptr && !UCS_PTR_IS_ERR(r))
      closing_.push_back(r);
    ep = nullptr;
  }
  auto deadline = mono_ns() + 200 * 1000000LL; // a dead peer may never let a close finish
  while (!closing_.empty() && mono_ns() < deadline) {
    ucp_worker_progress(worker());
    std::erase_if(closing_, [](void* r) {
      if (ucp_request_check_status(r) == UCS_INPROGRESS)
        return false;
      ucp_request_free(r);
      return true;
    });
  }
  for (auto* r : closing_)
    ucp_request_free(r);
  closing_.clear();
  // Forget the callbacks' target: a late endpoint error must not touch us.
  auto& l = ep_args();
  std::lock_guard lk(l.mu);
  for (auto& a : l.args)
    if (a && a->comm.load(std::memory_order_relaxed) == this)
      a->comm.store(nullptr, std::memory_order_release);
}

// -- requests ----------------------------------------------------------------------

host_comm::req_id host_comm::post(ucs_status_ptr_t r, bool recv, size_t peer, const char* what) {
  req q;
  q.recv = recv;
  q.peer = peer;
  if (r == nullptr) {
    q.done = true;
  } else if (UCS_PTR_IS_ERR(r)) {
    q.done = true;
    note_ep_error(peer, UCS_PTR_STATUS(r));
    spdlog::debug("{} to index {} failed at once: {}", what, peer,
                  ucs_status_string(UCS_PTR_STATUS(r)));
  } else {
    q.done = false;
    q.handle = r;
  }
  reqs_.push_back(q);
  return reqs_.size() - 1;
}

host_comm::req_id host_comm::isend(size_t peer, const void* buf, size_t bytes, uint64_t slot) {
  ucp_request_param_t prm{};
  auto r = ucp_tag_send_nbx(eps_[peer], buf, bytes, make_tag(m_.epoch, tag_op_, me_, slot), &prm);
  return post(r, false, peer, "send");
}

host_comm::req_id host_comm::irecv(size_t peer, void* buf, size_t bytes, uint64_t slot) {
  ucp_request_param_t prm{};
  auto r = ucp_tag_recv_nbx(worker(), buf, bytes, make_tag(m_.epoch, tag_op_, peer, slot),
                            ~uint64_t{0}, &prm);
  return post(r, true, peer, "receive");
}

bool host_comm::test(req_id id) {
  auto& q = reqs_[id];
  if (q.done)
    return true;
  auto st = ucp_request_check_status(q.handle);
  if (st == UCS_INPROGRESS) {
    waiting_on_ = q.peer;
    return false;
  }
  ucp_request_free(q.handle);
  q.handle = nullptr;
  q.done = true;
  if (st != UCS_OK)
    note_ep_error(q.peer, st);
  return true;
}

caf::error host_comm::progress() {
  if (ucp_worker_progress(worker()) != 0) {
    idle_polls_ = 0;
  } else if (++idle_polls_ >= static_cast<uint64_t>(spin_before_yield_)) {
    if (opts_.sleep_when_idle.count() > 0 && may_sleep_
        && idle_polls_ >= static_cast<uint64_t>(opts_.idle_polls_before_sleep)) {
      // Off the core until the worker has an event (or the slice ends and
      // failures are checked): for operations that wait long on a peer.
      if (ucp_worker_arm(worker()) == UCS_OK) {
        pollfd p{ucx_->event_fd(), POLLIN, 0};
        ::poll(&p, 1, static_cast<int>(opts_.sleep_when_idle.count()));
      }
    } else {
      sched_yield(); // an oversubscribed machine needs the core for the peer
    }
  }
  if ((++polls_ & 63) != 0 && !latch_.abort_requested()
      && ep_failed_.load(std::memory_order_relaxed) < 0)
    return {};
  return check_failures();
}

caf::error host_comm::check_failures() {
  if (latch_.abort_requested())
    return latch_.abort_reason();
  if (int i = ep_failed_.load(); i >= 0) {
    // Prefer the failure detector's reason (it knows a death from a hang).
    if (status_)
      if (auto e = status_(m_.ranks[i]))
        return member_error(m_.ranks[i], e);
    return make_error(errc::peer_lost, "rank " + std::to_string(m_.ranks[i]) + ": "
                                         + ucs_status_string(ep_status_));
  }
  if (status_) {
    for (size_t i = 0; i < n(); ++i) {
      if (i == me_)
        continue;
      if (auto e = status_(m_.ranks[i]))
        return member_error(m_.ranks[i], e);
    }
  }
  if (mono_ns() > deadline_ns_)
    return make_error(errc::timeout, std::string(op_name_) + " timed out after "
                                       + std::to_string(timeout_ms_) + " ms waiting on rank "
                                       + std::to_string(m_.ranks[waiting_on_]));
  return {};
}

caf::error host_comm::wait(req_id id) {
  while (!test(id))
    if (auto e = progress())
      return e;
  if (ep_failed_.load() >= 0) // it completed with an error
    return check_failures();
  return {};
}

caf::error host_comm::wait_all() {
  for (req_id i = 0; i < reqs_.size(); ++i)
    if (auto e = wait(i))
      return e;
  reqs_.clear();
  return {};
}

caf::error host_comm::fail(caf::error e) {
  for (auto& r : reqs_) {
    if (r.handle != nullptr && !r.done) {
      if (r.recv)
        ucp_request_cancel(worker(), r.handle);
      ucp_request_free(r.handle); // released by UCX once it completes
      r.handle = nullptr;
      r.done = true;
    }
  }
  reqs_.clear();
  poison(e);
  return e;
}

uint8_t* host_comm::staging(size_t bytes) {
  if (staging_.size() < bytes)
    staging_.resize(bytes);
  return staging_.data();
}

// -- operation framing -----------------------------------------------------------------

caf::error host_comm::begin(const char* name, const op_options& o) {
  if (auto p = poisoned())
    return make_error(errc::poisoned, std::string(name) + " on a poisoned communicator ("
                                        + describe(p) + "); rebuild it for a new epoch");
  if (latch_.abort_requested()) {
    auto reason = latch_.abort_reason();
    poison(reason);
    return reason;
  }
  busy_ = std::unique_lock<std::mutex>(ctx_->internals().busy);
  op_name_ = name;
  tag_op_ = op_seq_++;
  timeout_ms_ = o.timeout.count();
  deadline_ns_ = mono_ns() + timeout_ms_ * 1000000;
  // A transfer spins at least as long as a training collective before it
  // yields: a yield on a busy core can cost a scheduler slice.
  may_sleep_ = !o.transfer;
  spin_before_yield_ = o.transfer ? std::max(opts_.spin_before_yield,
                                             host_options{}.spin_before_yield)
                                  : opts_.spin_before_yield;
  polls_ = 0;
  reqs_.clear();
  return {};
}

caf::error host_comm::end(caf::error e) {
  // An overflow is a property of the data, not of the group: finish the
  // protocol and stay usable. Anything else poisons.
  if (!e || code_of(e) == errc::overflow) {
    if (auto w = wait_all())
      e = w;
  }
  if (e && code_of(e) != errc::overflow)
    fail(e);
  busy_.unlock();
  return e;
}

// -- algorithms ----------------------------------------------------------------------

caf::error host_comm::recursive_doubling(uint8_t* buf, size_t count, dtype t, reduce_op op) {
  const size_t bytes = count * size_of(t);
  uint8_t* tmp = staging(bytes);
  const size_t p = size_t{1} << (63 - __builtin_clzll(n()));
  const size_t extra = n() - p;
  bool overflow = false;
  // Fold: in the first 2*extra members, even ones hand their data to the odd.
  long vidx = -1;
  if (me_ < 2 * extra) {
    if (me_ % 2 == 0) {
      if (auto e = wait(isend(me_ + 1, buf, bytes, 0)))
        return e;
    } else {
      if (auto e = wait(irecv(me_ - 1, tmp, bytes, 0)))
        return e;
      overflow |= !reduce_into(buf, tmp, count, t, op);
      vidx = static_cast<long>(me_ / 2);
    }
  } else {
    vidx = static_cast<long>(me_ - extra);
  }
  if (vidx >= 0) {
    uint64_t slot = 1;
    for (size_t mask = 1; mask < p; mask <<= 1, ++slot) {
      size_t vpartner = static_cast<size_t>(vidx) ^ mask;
      size_t partner = vpartner < extra ? vpartner * 2 + 1 : vpartner + extra;
      auto s = isend(partner, buf, bytes, slot);
      auto r = irecv(partner, tmp, bytes, slot);
      if (auto e = wait(r))
        return e;
      if (auto e = wait(s))
        return e;
      overflow |= !reduce_into(buf, tmp, count, t, op);
    }
  }
  if (me_ < 2 * extra) {
    auto e = me_ % 2 == 1 ? wait(isend(me_ - 1, buf, bytes, 63))
                          : wait(irecv(me_ + 1, buf, bytes, 63));
    if (e)
      return e;
  }
  (void)overflow; // carried by the sticky marker in the data itself
  return {};
}

caf::error host_comm::ring_reduce_scatter(const uint8_t* in, uint8_t* out_own,
                                          const std::vector<span_el>& blocks, dtype t,
                                          reduce_op op) {
  if (auto e = decide_shm())
    return e;
  if (shm_)
    return shm_ring_run(shm_job::reduce_scatter, in, out_own, nullptr, blocks, t, op);
  const size_t es = size_of(t);
  const size_t ce = chunk_elems(t);
  size_t max_block = 0;
  for (auto& b : blocks)
    max_block = std::max(max_block, b.count);
  const size_t nchunks = std::max<size_t>(1, (max_block + ce - 1) / ce);
  const size_t steps = n() - 1;
  const size_t window = std::min(nchunks, std::max<size_t>(2, n()));
  uint8_t* pool = staging(2 * window * ce * es);
  auto block_sent = [&](size_t s) { return (me_ + 2 * n() - s - 1) % n(); };
  auto block_recv = [&](size_t s) { return (me_ + 2 * n() - s - 2) % n(); };

  struct lane_state {
    size_t chunk = 0;
    size_t step = 0;
    req_id recv = 0;
    req_id send = 0;
    uint8_t* slot_recv = nullptr;
    uint8_t* slot_send = nullptr;
    bool active = false;
  };
  std::vector<lane_state> lanes(window);
  size_t next_chunk = 0;
  size_t finished = 0;
  auto start = [&](lane_state& L, size_t w) {
    L = {};
    L.chunk = next_chunk++;
    L.slot_recv = pool + (2 * w) * ce * es;
    L.slot_send = pool + (2 * w + 1) * ce * es;
    auto sc = chunk_of(blocks[block_sent(0)], L.chunk, ce);
    L.send = isend(right(), in + sc.offset * es, sc.count * es, L.chunk);
    auto rc = chunk_of(blocks[block_recv(0)], L.chunk, ce);
    L.recv = irecv(left(), L.slot_recv, rc.count * es, L.chunk);
    L.active = true;
  };
  for (size_t w = 0; w < window; ++w)
    start(lanes[w], w);
  while (finished < nchunks) {
    if (auto e = progress())
      return e;
    for (size_t w = 0; w < window; ++w) {
      auto& L = lanes[w];
      if (!L.active || !test(L.recv))
        continue;
      auto rc = chunk_of(blocks[block_recv(L.step)], L.chunk, ce);
      const bool last = L.step + 1 == steps;
      // The block received at the last step is this member's own. In place
      // (all_reduce), the sum goes straight into it: one pass, not a
      // reduction into the staging slot and a copy out of it.
      uint8_t* own_dst =
        last && rc.count > 0 ? out_own + (rc.offset - blocks[me_].offset) * es : nullptr;
      const bool in_place = own_dst != nullptr && own_dst == in + rc.offset * es;
      if (in_place)
        (void)reduce_into(own_dst, L.slot_recv, rc.count, t, op);
      else
        (void)reduce_into(L.slot_recv, in + rc.offset * es, rc.count, t, op);
      if (auto e = wait(L.send))
        return e;
      if (last) {
        if (!in_place && rc.count > 0) // an empty block may come with a null buffer
          std::memcpy(own_dst, L.slot_recv, rc.count * es);
        L.active = false;
        ++finished;
        if (next_chunk < nchunks)
          start(L, w);
        continue;
      }
      std::swap(L.slot_recv, L.slot_send);
      ++L.step;
      uint64_t slot = L.step * nchunks + L.chunk;
      L.send = isend(right(), L.slot_send, rc.count * es, slot);
      auto nrc = chunk_of(blocks[block_recv(L.step)], L.chunk, ce);
      L.recv = irecv(left(), L.slot_recv, nrc.count * es, slot);
    }
  }
  return wait_all();
}

caf::error host_comm::ring_all_gather(uint8_t* out, const std::vector<span_el>& blocks, dtype t) {
  if (auto e = decide_shm())
    return e;
  if (shm_)
    return shm_ring_run(shm_job::all_gather, nullptr, nullptr, out, blocks, t, reduce_op::sum);
  const size_t es = size_of(t);
  const size_t ce = chunk_elems(t);
  size_t max_block = 0;
  for (auto& b : blocks)
    max_block = std::max(max_block, b.count);
  const size_t nchunks = std::max<size_t>(1, (max_block + ce - 1) / ce);
  const size_t steps = n() - 1;
  auto block_sent = [&](size_t s) { return (me_ + n() - s % n()) % n(); };
  auto block_recv = [&](size_t s) { return (me_ + 2 * n() - s - 1) % n(); };
  // Receives land in the output (no staging). At most `window` chunks' chains
  // run at once, as in the reduce-scatter: with eager sends a member ahead of
  // its right neighbour can put at most that many chunks into the
  // neighbour's unexpected queue, whatever the buffer's size.
  const size_t window = std::min(nchunks, std::max<size_t>(2, n()));
  struct chain {
    size_t chunk = 0;
    size_t step = 0;
    req_id recv = 0;
    bool active = false;
  };
  std::vector<chain> lanes(window);
  size_t next_chunk = 0;
  size_t finished = 0;
  auto start = [&](chain& L) {
    L = {};
    L.chunk = next_chunk++;
    auto sc = chunk_of(blocks[block_sent(0)], L.chunk, ce);
    isend(right(), out + sc.offset * es, sc.count * es, L.chunk);
    auto rc = chunk_of(blocks[block_recv(0)], L.chunk, ce);
    L.recv = irecv(left(), out + rc.offset * es, rc.count * es, L.chunk);
    L.active = true;
  };
  for (auto& L : lanes)
    start(L);
  while (finished < nchunks) {
    if (auto e = progress())
      return e;
    for (auto& L : lanes) {
      if (!L.active || !test(L.recv))
        continue;
      if (++L.step == steps) {
        L.active = false;
        ++finished;
        if (next_chunk < nchunks)
          start(L);
        continue;
      }
      // Forward what just arrived, and receive the next block.
      uint64_t slot = L.step * nchunks + L.chunk;
      auto sc = chunk_of(blocks[block_sent(L.step)], L.chunk, ce);
      isend(right(), out + sc.offset * es, sc.count * es, slot);
      auto rc = chunk_of(blocks[block_recv(L.step)], L.chunk, ce);
      L.recv = irecv(left(), out + rc.offset * es, rc.count * es, slot);
    }
  }
  return wait_all();
}

// The shared-memory ring: each member reads the ring its left neighbour
// writes and writes into its right neighbour's. The work is the UCX ring's
// (reduce-scatter steps, then all-gather steps), one chain per chunk index:
// a chain is n tokens, one per block, each a message that moves one member
// to the right per step. A member handles the message at the head of its
// ring only when it can write the message that follows from it (a partial
// sum goes on to the right; a final sum or a gathered chunk is forwarded
// unless this member is the last to receive it) straight into a slot of the
// right ring: no staging, and a partial sum is written once, from the slot
// it came in and the member's own contribution. It starts a new chain only
// while it has finished (received its last message of) all but `window` of
// those it started. Why no ring can deadlock: a member waits only on a full
// right ring, so a deadlock needs every ring full, n x slots messages. A
// token in flight belongs to a chain c with min(finished) <= c <
// max(started), and max(started) - min(finished) <= 2 x window (a member's
// last message of a chain needs every other member to have started it), so
// at most n x 2 x window messages are ever in the rings: with more than 2 x
// window slots per ring (shm_ring_slots) they are never all full. Messages
// of one (phase, step) come in chunk order; anything else is malformed.
caf::error host_comm::shm_ring_run(shm_job job, const uint8_t* in, uint8_t* own_out,
                                   uint8_t* full, const std::vector<span_el>& blocks, dtype t,
                                   reduce_op op) {
  const size_t es = size_of(t), ce = chunk_elems(t), nn = n(), steps = nn - 1;
  const size_t nchunks = shm_chunks(blocks, t);
  const bool rs_phase = job != shm_job::all_gather;
  const bool ag_phase = job != shm_job::reduce_scatter;
  // The block `back` places to this member's left: reduce-scatter step s
  // sends block(s + 1) and receives block(s + 2); all-gather step s sends
  // block(s) and receives block(s + 1). The last reduce-scatter step
  // receives this member's own block.
  auto block = [&](size_t back) -> const span_el& { return blocks[(me_ + 2 * nn - back) % nn]; };
  // Next chunk due per (phase, step), phase 0 the reduce-scatter.
  std::vector<size_t> due(2 * steps, 0);
  const size_t receives = nchunks * steps * (rs_phase && ag_phase ? 2 : 1);
  size_t received = 0, started = 0, finished = 0;
  auto publish = [&](uint64_t phase, size_t step, size_t c, size_t bytes) {
    tx_ring_.publish(shm_tag(phase, step, c), bytes);
  };
  // The message at the head of the ring, if what follows from it can be
  // written now; `moved` says whether it was taken.
  auto take = [&](const uint8_t* data, uint64_t tag, size_t bytes, bool& moved) -> caf::error {
    const uint64_t phase = (tag >> shm_phase_shift) & 3;
    const size_t step = static_cast<size_t>((tag >> shm_step_shift) & shm_step_mask);
    const size_t c = static_cast<size_t>(tag & shm_chunk_mask);
    const bool known = (phase == 0 ? rs_phase : phase == 1 && ag_phase) && step < steps
                       && tag == shm_tag(phase, step, c) && c == due[phase * steps + step];
    if (!known)
      return make_error(errc::malformed_frame,
                        fmt::format("{}: shared-memory ring message {:#x} from rank {}", op_name_,
                                    tag, m_.ranks[left()]));
    const bool last = step + 1 == steps;
    const bool forward = phase == 0 ? !last || ag_phase : !last;
    uint8_t* slot = forward ? tx_ring_.reserve() : nullptr;
    if (forward && slot == nullptr)
      return {}; // the right ring is full: this message waits at the head
    const span_el ch = chunk_of(block(step + 1 + (phase == 0 ? 1 : 0)), c, ce);
    if (auto e = shm_size_check(bytes, ch.count * es))
      return e;
    if (phase == 0 && !last) {
      // A partial sum: what came in plus this member's share, to the right.
      (void)reduce_to(slot, data, in + ch.offset * es, ch.count, t, op);
      publish(0, step + 1, c, bytes);
    } else if (phase == 0) {
      // This member's own block, now summed over everyone.
      uint8_t* dst = own_out + (ch.offset - blocks[me_].offset) * es;
      const uint8_t* mine = in + ch.offset * es;
      if (ch.count > 0) {
        if (dst != mine)
          std::memcpy(dst, mine, bytes);
        (void)reduce_into(dst, data, ch.count, t, op); // overflow: the sticky marker
        if (ag_phase && op == reduce_op::avg)
          scale_down(dst, ch.count, t, nn);
        if (ag_phase)
          std::memcpy(slot, dst, bytes); // still in cache
      }
      if (ag_phase)
        publish(1, 0, c, bytes);
      else
        ++finished;
    } else {
      if (ch.count > 0) {
        std::memcpy(full + ch.offset * es, data, bytes);
        if (!last)
          std::memcpy(slot, full + ch.offset * es, bytes);
      }
      if (!last)
        publish(1, step + 1, c, bytes);
      else
        ++finished;
    }
    ++due[phase * steps + step];
    ++received;
    rx_ring_.release();
    moved = true;
    return {};
  };
  while (received < receives || started < nchunks) {
    bool moved = false;
    uint64_t tag = 0;
    size_t bytes = 0;
    // One message a turn, then new chains: taking every message waiting
    // before starting the next chain cost a 4 MiB all_reduce of two members
    // 15% of its rate. What follows this operation's last message is the
    // next operation's.
    if (received < receives)
      if (const uint8_t* data = rx_ring_.peek(tag, bytes))
        if (auto e = take(data, tag, bytes, moved))
          return e;
    // A new chain: this member's contribution to the block on its left, or
    // (all-gather alone) its own block.
    while (started < nchunks && started < finished + shm_ring_window) {
      uint8_t* slot = tx_ring_.reserve();
      if (slot == nullptr)
        break;
      const span_el ch = chunk_of(rs_phase ? block(1) : blocks[me_], started, ce);
      const uint8_t* src = rs_phase ? in : full;
      if (ch.count > 0)
        std::memcpy(slot, src + ch.offset * es, ch.count * es);
      publish(rs_phase ? 0 : 1, 0, started, ch.count * es);
      ++started;
      moved = true;
    }
    if (auto e = shm_poll(moved))
      return e;
  }
  return {};
}

caf::error host_comm::chain_broadcast(uint8_t* buf, size_t count, dtype t, size_t root) {
  const size_t es = size_of(t);
  const size_t bytes = count * es;
  const size_t pos = (me_ + n() - root) % n();
  if (bytes <= opts_.small_bytes_max) {
    if (pos == 0) {
      for (size_t i = 0; i < n(); ++i)
        if (i != me_)
          isend(i, buf, bytes, 0);
      return wait_all();
    }
    return wait(irecv(root, buf, bytes, 0));
  }
  const size_t ce = chunk_elems(t);
  const size_t nchunks = (count + ce - 1) / ce;
  const bool last = pos == n() - 1;
  span_el all{0, count};
  // A member sends only once the next one has posted every receive. An
  // eager fragment that arrives before its receive waits in UCX's
  // unexpected queue, holding one of the receiver's shared-memory buffers:
  // their pool grows to what is in flight, fresh pages that both sides
  // fault in (the sender maps each new segment). On a fresh pair of
  // workers that cost a 26.8 MB broadcast 4/5 of its rate; the word costs
  // one small message.
  const req_id next_ready = last ? 0 : irecv(right(), &word_in_, 1, bcast_slot_ready);
  if (pos == 0) {
    if (auto e = wait(next_ready))
      return e;
    for (size_t c = 0; c < nchunks; ++c) {
      auto ch = chunk_of(all, c, ce);
      isend(right(), buf + ch.offset * es, ch.count * es, c);
    }
    return wait_all();
  }
  std::vector<req_id> recv(nchunks);
  for (size_t c = 0; c < nchunks; ++c) {
    auto ch = chunk_of(all, c, ce);
    recv[c] = irecv(left(), buf + ch.offset * es, ch.count * es, c);
  }
  isend(left(), &word_out_, 1, bcast_slot_ready);
  for (size_t c = 0; c < nchunks; ++c) {
    if (auto e = wait(recv[c]))
      return e;
    if (!last) {
      if (c == 0)
        if (auto e = wait(next_ready))
          return e;
      auto ch = chunk_of(all, c, ce);
      isend(right(), buf + ch.offset * es, ch.count * es, c);
    }
  }
  return wait_all();
}

// -- operations ---------------------------------------------------------------------

caf::error host_comm::all_reduce(void* buf, size_t count, dtype t, reduce_op op,
                                 const op_options& o) {
  if (auto e = begin("all_reduce", o))
    return e;
  auto* b = static_cast<uint8_t*>(buf);
  caf::error e;
  if (n() > 1 && count > 0) {
    if (count * size_of(t) <= opts_.small_bytes_max || count < n()) {
      e = recursive_doubling(b, count, t, op);
      if (!e && op == reduce_op::avg)
        scale_down(b, count, t, n());
    } else {
      auto blocks = blocks_of(even_split(count, n()));
      auto own = blocks[me_];
      e = decide_shm();
      if (!e && shm_) {
        e = shm_ring_run(shm_job::all_reduce, b, b + own.offset * size_of(t), b, blocks, t, op);
      } else if (!e) {
        e = ring_reduce_scatter(b, b + own.offset * size_of(t), blocks, t, op);
        if (!e && op == reduce_op::avg)
          scale_down(b + own.offset * size_of(t), own.count, t, n());
        if (!e)
          e = ring_all_gather(b, blocks, t);
      }
    }
  } else if (op == reduce_op::avg) {
    scale_down(b, count, t, n());
  }
  if (!e && has_overflow_marker(buf, count, t, op))
    e = make_error(errc::overflow, "int64 all_reduce overflowed");
  return end(std::move(e));
}

caf::error host_comm::reduce_scatter(const void* in, void* out, const std::vector<size_t>& counts,
                                     dtype t, reduce_op op, const op_options& o) {
  if (counts.size() != n())
    return make_error(errc::invalid_argument, "reduce_scatter needs one count per member");
  if (auto e = begin("reduce_scatter", o))
    return e;
  auto blocks = blocks_of(counts);
  auto own = blocks[me_];
  const size_t es = size_of(t);
  caf::error e;
  if (n() > 1)
    e = ring_reduce_scatter(static_cast<const uint8_t*>(in), static_cast<uint8_t*>(out), blocks,
                            t, op);
  else if (own.count > 0) // an empty block may come with null buffers; in place: no copy
    std::memmove(out, static_cast<const uint8_t*>(in) + own.offset * es, own.count * es);
  if (!e && op == reduce_op::avg)
    scale_down(out, own.count, t, n());
  if (!e && has_overflow_marker(out, own.count, t, op))
    e = make_error(errc::overflow, "int64 reduce_scatter overflowed");
  return end(std::move(e));
}

caf::error host_comm::all_gather(const void* in, void* out, const std::vector<size_t>& counts,
                                 dtype t, const op_options& o) {
  if (counts.size() != n())
    return make_error(errc::invalid_argument, "all_gather needs one count per member");
  if (auto e = begin("all_gather", o))
    return e;
  auto blocks = blocks_of(counts);
  const size_t es = size_of(t);
  auto* o8 = static_cast<uint8_t*>(out);
  if (blocks[me_].count > 0 && o8 + blocks[me_].offset * es != in)
    std::memmove(o8 + blocks[me_].offset * es, in, blocks[me_].count * es);
  caf::error e;
  if (n() > 1)
    e = ring_all_gather(o8, blocks, t);
  return end(std::move(e));
}

caf::error host_comm::broadcast(void* buf, size_t count, dtype t, size_t root,
                                const op_options& o) {
  if (root >= n())
    return make_error(errc::invalid_argument, "broadcast root " + std::to_string(root)
                                                + " is not a member index");
  if (auto e = begin("broadcast", o))
    return e;
  caf::error e;
  if (n() > 1)
    e = chain_broadcast(static_cast<uint8_t*>(buf), count, t, root);
  return end(std::move(e));
}

caf::error host_comm::all_to_allv(const void* in, const std::vector<size_t>& send_counts,
                                  void* out, const std::vector<size_t>& recv_counts, dtype t,
                                  const op_options& o) {
  if (send_counts.size() != n() || recv_counts.size() != n())
    return make_error(errc::invalid_argument, "all_to_allv needs one count per member");
  if (send_counts[me_] != recv_counts[me_])
    return make_error(errc::invalid_argument, "all_to_allv: own send and receive counts differ");
  if (auto e = begin("all_to_allv", o))
    return e;
  const size_t es = size_of(t);
  auto sb = blocks_of(send_counts);
  auto rb = blocks_of(recv_counts);
  auto* i8 = static_cast<const uint8_t*>(in);
  auto* o8 = static_cast<uint8_t*>(out);
  for (size_t j = 0; j < n(); ++j)
    if (j != me_)
      irecv(j, o8 + rb[j].offset * es, rb[j].count * es, 0);
  for (size_t k = 1; k < n(); ++k) {
    size_t j = (me_ + k) % n(); // staggered, so not everyone sends to 0 first
    isend(j, i8 + sb[j].offset * es, sb[j].count * es, 0);
  }
  if (sb[me_].count > 0) // an empty block may come with null buffers
    std::memmove(o8 + rb[me_].offset * es, i8 + sb[me_].offset * es, sb[me_].count * es);
  return end({});
}

caf::error host_comm::barrier(const op_options& o) {
  int64_t token = 0;
  return all_reduce(&token, 1, dtype::int64, reduce_op::max, o);
}

} // namespace

// -- construction ------------------------------------------------------------------

bool uses_shared_memory_ring(const communicator& c) {
  auto* h = dynamic_cast<const host_comm*>(&c);
  return h != nullptr && h->shm();
}

expected<std::unique_ptr<communicator>> make_host_communicator(
  std::shared_ptr<host_context> ctx, membership members, const std::vector<std::string>& addresses,
  peer_status status, host_options opts) {
  if (members.size() == 0 || members.size() >= (size_t{1} << src_bits))
    return make_error(errc::invalid_argument, "membership of "
                                                + std::to_string(members.size()) + " ranks");
  auto me = members.index_of(ctx->rank());
  if (me == members.size())
    return make_error(errc::invalid_argument,
                      "rank " + std::to_string(ctx->rank()) + " is not a member");
  if (addresses.size() != members.size())
    return make_error(errc::invalid_argument, "one address per member needed");
  auto c = std::make_unique<host_comm>(std::move(ctx), std::move(members), me, std::move(status),
                                       opts);
  if (auto e = c->connect(addresses))
    return e;
  return std::unique_ptr<communicator>(std::move(c));
}

expected<std::unique_ptr<communicator>> make_host_subcommunicator(
  communicator& parent, std::shared_ptr<host_context> ctx, membership sub, peer_status status,
  host_options opts) {
  if (auto e = ctx->prepare(sub))
    return e;
  // Every address padded to the longest one, in whole int64 words.
  const auto mine = ctx->address();
  int64_t words = static_cast<int64_t>((mine.size() + sizeof(int64_t) - 1) / sizeof(int64_t) + 1);
  if (auto e = parent.all_reduce(&words, 1, dtype::int64, reduce_op::max))
    return e;
  const size_t w = static_cast<size_t>(words), n = parent.size();
  std::vector<int64_t> table(w * n, 0);
  auto* row = reinterpret_cast<char*>(table.data() + w * parent.index());
  std::memcpy(row, mine.data(), mine.size());
  // Each row's last word holds the address's length.
  table[w * parent.index() + w - 1] = static_cast<int64_t>(mine.size());
  if (auto e = parent.all_gather(table.data() + w * parent.index(), table.data(),
                                 std::vector<size_t>(n, w), dtype::int64))
    return e;
  std::vector<std::string> addresses;
  for (auto r : sub.ranks) {
    size_t i = parent.members().index_of(r);
    if (i == n)
      return make_error(errc::invalid_argument,
                        "rank " + std::to_string(r) + " is not a member of the parent communicator");
    auto len = static_cast<size_t>(table[w * i + w - 1]);
    if (len > (w - 1) * sizeof(int64_t))
      return make_error(errc::malformed_frame, "a published address is longer than its row");
    addresses.emplace_back(reinterpret_cast<const char*>(table.data() + w * i), len);
  }
  return make_host_communicator(std::move(ctx), std::move(sub), addresses, std::move(status), opts);
}

expected<std::unique_ptr<communicator>> make_host_communicator(
  std::shared_ptr<host_context> ctx, membership members, coordinator_client& coordinator,
  peer_status status, host_options opts, build_status moot) {
  auto ns = "epoch/" + std::to_string(members.epoch) + "/host/";
  if (auto e = ctx->prepare(members))
    return e;
  auto mine = ctx->address();
  if (auto e = coordinator.kv_put(ns + std::to_string(ctx->rank()),
                                  wire::bytes(mine.begin(), mine.end())))
    return e;
  std::vector<std::string> addresses(members.size());
  // Waited for in slices, so that any member found lost meanwhile (the
  // failure detector says so), not only the one awaited, or a build made
  // moot ends the wait at once, not at the timeout: a member that went to
  // a newer membership instead never publishes here.
  constexpr std::chrono::milliseconds slice{100};
  const auto deadline = std::chrono::steady_clock::now() + opts.rendezvous_timeout;
  auto still_wanted = [&]() -> caf::error {
    if (moot)
      if (auto e = moot())
        return e;
    if (status)
      for (auto r : members.ranks)
        if (r != ctx->rank())
          if (auto lost = status(r))
            return lost;
    return {};
  };
  for (size_t i = 0; i < members.size(); ++i) {
    if (members.ranks[i] == ctx->rank()) {
      addresses[i] = mine;
      continue;
    }
    const auto key = ns + std::to_string(members.ranks[i]);
    for (;;) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
      auto a = coordinator.kv_get(key, std::clamp(left, std::chrono::milliseconds(1), slice));
      if (a) {
        addresses[i].assign(a->begin(), a->end());
        break;
      }
      if (code_of(a.error()) != errc::timeout)
        return a.error();
      if (left <= slice)
        return make_error(errc::timeout,
                          "rank " + std::to_string(members.ranks[i])
                            + " published no address for membership " + std::to_string(members.epoch)
                            + " within " + std::to_string(opts.rendezvous_timeout.count())
                            + " ms (key \"" + key + "\" at the coordinator)");
      if (auto e = still_wanted())
        return e;
    }
  }
  return make_host_communicator(std::move(ctx), std::move(members), addresses, std::move(status),
                                opts);
}

} // namespace cmesh::coll
