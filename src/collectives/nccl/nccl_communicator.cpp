#include "collectives/nccl/nccl_communicator.hpp"

#include "core/env.hpp"
#include "transport/bootstrap.hpp"

#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>

#include <fmt/format.h>
#include <sched.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <mutex>
#include <thread>

// ncclCommShrink came with NCCL 2.27, ncclCommRevoke with 2.28.7; their flag
// macros say whether this nccl.h has them. The library loaded at run time may
// be older than the header (a 2.28.3 beside a 2.28.9 build), so both are
// looked up when first needed rather than linked: a missing one means the
// abort path (no revoke) or a full re-init (no shrink), never a process
// killed by the loader.
#ifdef NCCL_SHRINK_DEFAULT
#define CMESH_NCCL_HAS_SHRINK 1
#else
#define CMESH_NCCL_HAS_SHRINK 0
#endif
#ifdef NCCL_REVOKE_DEFAULT
#define CMESH_NCCL_HAS_REVOKE 1
#else
#define CMESH_NCCL_HAS_REVOKE 0
#endif

static_assert(sizeof(ncclUniqueId) == std::tuple_size_v<cmesh::coll::nccl_unique_id>,
              "nccl_unique_id must hold an ncclUniqueId");

namespace cmesh::coll {

namespace {

// -- status codes to cmesh errors -------------------------------------------------------

caf::error nccl_error(ncclResult_t r, std::string_view what) {
  // ncclGetLastError ignores its argument (the text is per thread/process).
  std::string last = ncclGetLastError(nullptr) ? ncclGetLastError(nullptr) : "";
  while (!last.empty() && (last.back() == '\n' || last.back() == ' '))
    last.pop_back();
  auto code = r == ncclInvalidArgument ? errc::invalid_argument : errc::transport_failure;
  return make_error(code, fmt::format("{}: {}{}{}", what, ncclGetErrorString(r),
                                      last.empty() ? "" : " (", last.empty() ? "" : last + ")"));
}

caf::error cuda_error(cudaError_t e, std::string_view what) {
  (void)cudaGetLastError(); // clear a non-sticky error so later calls do not see it again
  return make_error(errc::transport_failure,
                    fmt::format("{}: {}: {}", what, cudaGetErrorName(e), cudaGetErrorString(e)));
}

bool nccl_ok(ncclResult_t r) {
  return r == ncclSuccess || r == ncclInProgress;
}

// -- ncclCommAbort off the failing thread ------------------------------------------------

/// ncclCommAbort raises the communicator's abort flag first (its kernels
/// quit within microseconds), then tears down its proxy threads and
/// connections, which takes NCCL about half a second (its proxy polls that
/// often). A failed operation only needs the first part before returning,
/// so the teardown runs here, on one thread for the process. The thread and
/// its queue are never destroyed; an exit handler waits (bounded) for the
/// queued aborts, before the CUDA runtime's own handlers run.
class abort_reaper {
public:
  static abort_reaper& instance() {
    static auto* r = new abort_reaper(); // intentionally never destroyed
    return *r;
  }

  /// Queues `comm` for ncclCommAbort; false when the queue is full (the
  /// caller then aborts it itself).
  bool post(ncclComm_t comm, uint64_t epoch, int device) {
    {
      std::lock_guard<std::mutex> g(mtx_);
      if (queue_.size() >= capacity)
        return false;
      queue_.push_back({comm, epoch, device});
      ++pending_;
    }
    cv_.notify_all();
    return true;
  }

  /// Waits until no abort is queued or running, at most `timeout`.
  bool drain(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lk(mtx_);
    return done_cv_.wait_for(lk, timeout, [this] { return pending_ == 0; });
  }

private:
  struct job {
    ncclComm_t comm;
    uint64_t epoch;
    int device;
  };
  static constexpr size_t capacity = 64;

  abort_reaper() {
    std::thread([this] { run(); }).detach();
    std::atexit([] { (void)abort_reaper::instance().drain(std::chrono::milliseconds(5000)); });
  }

  void run() {
    std::unique_lock<std::mutex> lk(mtx_);
    for (;;) {
      cv_.wait(lk, [this] { return !queue_.empty(); });
      job j = queue_.front();
      queue_.pop_front();
      lk.unlock();
      (void)cudaSetDevice(j.device);
      if (auto r = ncclCommAbort(j.comm); r != ncclSuccess)
        spdlog::warn("nccl: ncclCommAbort of epoch {}: {}", j.epoch, ncclGetErrorString(r));
      (void)cudaGetLastError();
      lk.lock();
      if (--pending_ == 0)
        done_cv_.notify_all();
    }
  }

  std::mutex mtx_;
  std::condition_variable cv_;
  std::condition_variable done_cv_;
  std::deque<job> queue_;
  size_t pending_ = 0; // queued or running
};

// -- entry points newer than some NCCL libraries --------------------------------------

/// `name` in the NCCL library this process loaded, or null (said once).
void* nccl_entry(const char* name) {
  void* f = ::dlsym(RTLD_DEFAULT, name);
  if (f == nullptr) {
    int v = 0;
    (void)ncclGetVersion(&v);
    spdlog::info("nccl: the loaded NCCL ({}) has no {}", v, name);
  }
  return f;
}

// Their types come from the header (unevaluated: no reference to the symbols).
#if CMESH_NCCL_HAS_REVOKE
using revoke_fn = decltype(&ncclCommRevoke);
revoke_fn nccl_revoke() {
  static const auto f = reinterpret_cast<revoke_fn>(nccl_entry("ncclCommRevoke"));
  return f;
}
#endif

#if CMESH_NCCL_HAS_SHRINK
using shrink_fn = decltype(&ncclCommShrink);
shrink_fn nccl_shrink() {
  static const auto f = reinterpret_cast<shrink_fn>(nccl_entry("ncclCommShrink"));
  return f;
}
#endif

/// Whether this process can shrink (header and library both have it).
bool can_shrink_comms() {
#if CMESH_NCCL_HAS_SHRINK
  return nccl_shrink() != nullptr;
#else
  return false;
#endif
}

} // namespace

// A failed NCCL call (ncclInProgress is not a failure on a non-blocking
// communicator) or CUDA call returns a cmesh error from the enclosing function.
#define CMESH_NCCL_CHECK(call)                                                     \
  do {                                                                             \
    if (const ncclResult_t cmesh_nccl_r_ = (call); !nccl_ok(cmesh_nccl_r_))        \
      return nccl_error(cmesh_nccl_r_, #call);                                     \
  } while (false)

#define CMESH_CUDA_CHECK_RET(call)                                                 \
  do {                                                                             \
    if (const cudaError_t cmesh_cuda_r_ = (call); cmesh_cuda_r_ != cudaSuccess)    \
      return cuda_error(cmesh_cuda_r_, #call);                                     \
  } while (false)

namespace {

ncclDataType_t to_nccl(dtype t) {
  switch (t) {
    case dtype::float32: return ncclFloat32;
    case dtype::bfloat16: return ncclBfloat16;
    case dtype::int64: return ncclInt64;
  }
  return ncclFloat32;
}

ncclRedOp_t to_nccl(reduce_op op) {
  switch (op) {
    case reduce_op::sum: return ncclSum;
    case reduce_op::avg: return ncclAvg;
    case reduce_op::max: return ncclMax;
  }
  return ncclSum;
}

/// The text of an error made by make_error(code, text).
std::string context_of(const caf::error& e) {
  const auto& ctx = e.context();
  if (ctx.size() == 1 && ctx.match_element<std::string>(0))
    return ctx.get_as<std::string>(0);
  return describe(e);
}

int64_t ns_of(std::chrono::nanoseconds d) {
  return d.count();
}

/// Why a member can no longer take part, as peer_lost (or peer_unresponsive)
/// naming its rank; none while every member other than `me` is fine.
caf::error check_peers(const membership& m, size_t me, const peer_status& status) {
  if (!status)
    return {};
  for (size_t i = 0; i < m.size(); ++i) {
    if (i == me)
      continue;
    if (auto e = status(m.ranks[i])) {
      auto c = code_of(e);
      return make_error(c == errc::peer_unresponsive ? c : errc::peer_lost,
                        "rank " + std::to_string(m.ranks[i]) + ": " + describe(e));
    }
  }
  return {};
}

/// Between two polls: spin, then yield the core, then sleep a little.
void pause(const nccl_options& o, int64_t waited_ns) {
  if (waited_ns < ns_of(o.spin_for))
    return;
  if (waited_ns < ns_of(o.yield_until)) {
    sched_yield();
    return;
  }
  std::this_thread::sleep_for(o.sleep);
}

/// Polls an NCCL communicator's state until it leaves ncclInProgress (a
/// non-blocking creation, shrink or revoke), watching a deadline, the abort
/// flag and the members. Returns the final state in `state`; an error when
/// the watch itself gave up.
struct watch {
  const char* what;
  const membership& m;
  size_t me;
  const peer_status& status;
  const nccl_options& opts;
  std::chrono::milliseconds timeout;

  caf::error until_ready(ncclComm_t comm, ncclResult_t& state) const {
    const int64_t start = mono_ns();
    const int64_t deadline = start + ns_of(timeout);
    int64_t next_status = start;
    for (;;) {
      ncclResult_t st = ncclInProgress;
      if (auto r = ncclCommGetAsyncError(comm, &st); r != ncclSuccess)
        st = r;
      if (st != ncclInProgress) {
        state = st;
        return {};
      }
      const int64_t now = mono_ns();
      if (opts.abort_flag != nullptr && opts.abort_flag->load(std::memory_order_relaxed))
        return make_error(errc::aborted, std::string(what) + " aborted");
      if (now >= next_status) {
        next_status = now + ns_of(opts.status_interval);
        if (auto e = check_peers(m, me, status))
          return make_error(code_of(e), std::string(what) + ": " + context_of(e));
      }
      if (now > deadline)
        return make_error(errc::timeout, fmt::format("{} timed out after {} ms", what,
                                                     timeout.count()));
      // Creation takes milliseconds to seconds: no need to spin.
      std::this_thread::sleep_for(std::chrono::microseconds(std::min<int64_t>(
        1000, std::max<int64_t>(20, (now - start) / 1000 / 20))));
    }
  }
};

// -- the communicator --------------------------------------------------------------------

class nccl_comm final : public communicator {
public:
  nccl_comm(membership m, size_t me, peer_status status, nccl_options opts, int device)
      : m_(std::move(m)), me_(me), status_(std::move(status)), opts_(std::move(opts)),
        device_(device) {
    name_ = opts_.name.empty() ? "cmesh-epoch-" + std::to_string(m_.epoch) : opts_.name;
  }

  ~nccl_comm() override {
    (void)cudaSetDevice(device_);
    {
      std::lock_guard<std::mutex> g(handle_mtx_);
      if (comm_ != nullptr) {
        // A healthy communicator has nothing in flight: a local destroy. A
        // poisoned one may still have work queued: abort it.
        ncclResult_t r = poisoned() ? ncclCommAbort(comm_) : ncclCommDestroy(comm_);
        if (r != ncclSuccess)
          spdlog::warn("nccl: freeing the communicator of epoch {}: {}", m_.epoch,
                       ncclGetErrorString(r));
        comm_ = nullptr;
      }
    }
    if (scratch_ != nullptr)
      (void)cudaFree(scratch_);
    if (stream_ != nullptr)
      (void)cudaStreamDestroy(stream_);
    (void)cudaGetLastError();
  }

  nccl_comm(const nccl_comm&) = delete;
  nccl_comm& operator=(const nccl_comm&) = delete;

  /// The device, the stream and the barrier's scratch.
  caf::error setup_cuda() {
    CMESH_CUDA_CHECK_RET(cudaSetDevice(device_));
    CMESH_CUDA_CHECK_RET(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    CMESH_CUDA_CHECK_RET(cudaMalloc(&scratch_, 64));
    CMESH_CUDA_CHECK_RET(cudaMemsetAsync(scratch_, 0, 64, stream_));
    CMESH_CUDA_CHECK_RET(cudaStreamSynchronize(stream_));
    return {};
  }

  ncclConfig_t config() const {
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    cfg.commName = name_.c_str();
    return cfg;
  }

  /// Non-blocking creation under the watchdog; ncclCommAbort on failure.
  caf::error init(const ncclUniqueId& id) {
    const int64_t t0 = mono_ns();
    ncclConfig_t cfg = config();
    ncclComm_t c = nullptr;
    const ncclResult_t r = ncclCommInitRankConfig(&c, static_cast<int>(m_.size()), id,
                                                  static_cast<int>(me_), &cfg);
    if (!nccl_ok(r)) {
      auto e = nccl_error(r, "ncclCommInitRankConfig");
      if (c != nullptr)
        (void)ncclCommAbort(c);
      return e;
    }
    ncclResult_t state = ncclInProgress;
    watch w{"ncclCommInitRankConfig", m_, me_, status_, opts_, opts_.init_timeout};
    auto e = w.until_ready(c, state);
    if (!e && state != ncclSuccess)
      e = nccl_error(state, "ncclCommInitRankConfig (asynchronous)");
    if (e) {
      (void)ncclCommAbort(c);
      return e;
    }
    std::lock_guard<std::mutex> g(handle_mtx_);
    comm_ = c;
    setup_ns_ = mono_ns() - t0;
    return {};
  }

  // -- communicator ----------------------------------------------------------------------

  const membership& members() const override { return m_; }
  size_t index() const override { return me_; }

  caf::error all_reduce(void* buf, size_t count, dtype t, reduce_op op,
                        const op_options& o) override {
    return run("all_reduce", o, count == 0, [&](ncclComm_t c) -> caf::error {
      CMESH_NCCL_CHECK(ncclAllReduce(buf, buf, count, to_nccl(t), to_nccl(op), c, stream_));
      return {};
    });
  }

  caf::error reduce_scatter(const void* in, void* out, const std::vector<size_t>& counts, dtype t,
                            reduce_op op, const op_options& o) override {
    if (counts.size() != size())
      return make_error(errc::invalid_argument, "reduce_scatter needs one count per member");
    const size_t es = size_of(t);
    const bool equal = std::all_of(counts.begin(), counts.end(),
                                   [&](size_t c) { return c == counts[0]; });
    const bool empty = std::all_of(counts.begin(), counts.end(), [](size_t c) { return c == 0; });
    auto* i8 = static_cast<const uint8_t*>(in);
    return run("reduce_scatter", o, empty, [&](ncclComm_t c) -> caf::error {
      if (equal && !opts_.force_block_path) {
        CMESH_NCCL_CHECK(
          ncclReduceScatter(in, out, counts[0], to_nccl(t), to_nccl(op), c, stream_));
        return {};
      }
      // Uneven blocks: one reduce per block, rooted at its owner, in one group.
      return grouped([&]() -> caf::error {
        size_t off = 0;
        for (size_t i = 0; i < counts.size(); off += counts[i], ++i) {
          if (counts[i] == 0)
            continue;
          CMESH_NCCL_CHECK(ncclReduce(i8 + off * es, i == me_ ? out : nullptr, counts[i],
                                      to_nccl(t), to_nccl(op), static_cast<int>(i), c, stream_));
        }
        return {};
      });
    });
  }

  caf::error all_gather(const void* in, void* out, const std::vector<size_t>& counts, dtype t,
                        const op_options& o) override {
    if (counts.size() != size())
      return make_error(errc::invalid_argument, "all_gather needs one count per member");
    const size_t es = size_of(t);
    const bool equal = std::all_of(counts.begin(), counts.end(),
                                   [&](size_t c) { return c == counts[0]; });
    const bool empty = std::all_of(counts.begin(), counts.end(), [](size_t c) { return c == 0; });
    auto* o8 = static_cast<uint8_t*>(out);
    return run("all_gather", o, empty, [&](ncclComm_t c) -> caf::error {
      if (equal && !opts_.force_block_path) {
        CMESH_NCCL_CHECK(ncclAllGather(in, out, counts[0], to_nccl(t), c, stream_));
        return {};
      }
      // Uneven blocks: each member broadcasts its block into place, in one group.
      return grouped([&]() -> caf::error {
        size_t off = 0;
        for (size_t i = 0; i < counts.size(); off += counts[i], ++i) {
          if (counts[i] == 0)
            continue;
          const void* send = i == me_ ? in : o8 + off * es;
          CMESH_NCCL_CHECK(ncclBroadcast(send, o8 + off * es, counts[i], to_nccl(t),
                                         static_cast<int>(i), c, stream_));
        }
        return {};
      });
    });
  }

  caf::error broadcast(void* buf, size_t count, dtype t, size_t root,
                       const op_options& o) override {
    if (root >= size())
      return make_error(errc::invalid_argument,
                        "broadcast root " + std::to_string(root) + " is not a member index");
    return run("broadcast", o, count == 0, [&](ncclComm_t c) -> caf::error {
      CMESH_NCCL_CHECK(
        ncclBroadcast(buf, buf, count, to_nccl(t), static_cast<int>(root), c, stream_));
      return {};
    });
  }

  caf::error all_to_allv(const void* in, const std::vector<size_t>& send_counts, void* out,
                         const std::vector<size_t>& recv_counts, dtype t,
                         const op_options& o) override {
    if (send_counts.size() != size() || recv_counts.size() != size())
      return make_error(errc::invalid_argument, "all_to_allv needs one count per member");
    if (send_counts[me_] != recv_counts[me_])
      return make_error(errc::invalid_argument,
                        "all_to_allv: own send and receive counts differ");
    const size_t es = size_of(t);
    auto* i8 = static_cast<const uint8_t*>(in);
    auto* o8 = static_cast<uint8_t*>(out);
    std::vector<size_t> soff(size()), roff(size());
    for (size_t j = 1; j < size(); ++j) {
      soff[j] = soff[j - 1] + send_counts[j - 1];
      roff[j] = roff[j - 1] + recv_counts[j - 1];
    }
    return run("all_to_allv", o, false, [&](ncclComm_t c) -> caf::error {
      if (send_counts[me_] > 0)
        CMESH_CUDA_CHECK_RET(cudaMemcpyAsync(o8 + roff[me_] * es, i8 + soff[me_] * es,
                                             send_counts[me_] * es, cudaMemcpyDeviceToDevice,
                                             stream_));
      if (size() == 1)
        return {};
      // Zero-sized pairs are skipped on both sides (both know the counts).
      return grouped([&]() -> caf::error {
        for (size_t k = 1; k < size(); ++k) {
          const size_t j = (me_ + k) % size();
          if (send_counts[j] > 0)
            CMESH_NCCL_CHECK(ncclSend(i8 + soff[j] * es, send_counts[j], to_nccl(t),
                                      static_cast<int>(j), c, stream_));
          if (recv_counts[j] > 0)
            CMESH_NCCL_CHECK(ncclRecv(o8 + roff[j] * es, recv_counts[j], to_nccl(t),
                                      static_cast<int>(j), c, stream_));
        }
        return {};
      });
    });
  }

  caf::error barrier(const op_options& o) override {
    return run("barrier", o, false, [&](ncclComm_t c) -> caf::error {
      CMESH_NCCL_CHECK(ncclAllReduce(scratch_, scratch_, 1, ncclFloat32, ncclSum, c, stream_));
      return {};
    });
  }

  void abort(caf::error reason) override { latch_.request_abort(std::move(reason)); }

  caf::error poisoned() const override { return latch_.poisoned(); }

  // -- for shrink(), abort_all() and nccl_info_of() ------------------------------------------

  /// Marks the communicator poisoned with `e` unless it already is.
  void poison(caf::error e) { latch_.poison(std::move(e)); }

  /// Revokes (once) so that the NCCL communicator is quiescent. True when it
  /// exists afterwards and reports no error: ncclCommShrink can use it.
  bool quiesce_for_shrink() {
    std::lock_guard<std::mutex> g(handle_mtx_);
    if (comm_ == nullptr)
      return false;
#if CMESH_NCCL_HAS_REVOKE
    if (!revoked_ && nccl_can_revoke())
      revoke_locked();
    if (comm_ == nullptr)
      return false;
#endif
    ncclResult_t st = ncclInProgress;
    if (ncclCommGetAsyncError(comm_, &st) != ncclSuccess)
      return false;
    return st == ncclSuccess;
  }

  /// Aborts the NCCL communicator now (if it still exists).
  void abort_handle() {
    std::lock_guard<std::mutex> g(handle_mtx_);
    abort_locked();
  }

#if CMESH_NCCL_HAS_SHRINK
  /// ncclCommShrink excluding member indices `exclude`, non-blocking under
  /// the watchdog. On failure both the parent and the child are aborted.
  expected<std::unique_ptr<nccl_comm>> shrink_to(membership next, size_t next_me,
                                                 std::vector<int> exclude, peer_status status,
                                                 nccl_options opts) {
    const int64_t t0 = mono_ns();
    auto child = std::make_unique<nccl_comm>(std::move(next), next_me, std::move(status),
                                             std::move(opts), device_);
    if (auto e = child->setup_cuda())
      return e;
    std::lock_guard<std::mutex> g(handle_mtx_);
    if (comm_ == nullptr)
      return make_error(errc::poisoned, "the NCCL communicator was already aborted");
    ncclConfig_t cfg = child->config();
    // After a completed revoke nothing is in flight; otherwise let NCCL stop it.
    const int flags = revoked_ ? NCCL_SHRINK_DEFAULT : NCCL_SHRINK_ABORT;
    ncclComm_t made = nullptr; // written by NCCL's job once the shrink is done
    const ncclResult_t r = nccl_shrink()(comm_, exclude.data(),
                                         static_cast<int>(exclude.size()), &made, &cfg, flags);
    caf::error e;
    if (!nccl_ok(r)) {
      e = nccl_error(r, "ncclCommShrink");
    } else {
      // The shrink's job is linked to the parent: its state says when it ends.
      ncclResult_t state = ncclInProgress;
      watch w{"ncclCommShrink", child->m_, child->me_, child->status_, child->opts_,
              child->opts_.init_timeout};
      e = w.until_ready(comm_, state);
      if (!e && state != ncclSuccess)
        e = nccl_error(state, "ncclCommShrink (asynchronous)");
      if (!e && made == nullptr)
        e = make_error(errc::transport_failure, "ncclCommShrink made no communicator");
      if (!e) {
        e = w.until_ready(made, state);
        if (!e && state != ncclSuccess)
          e = nccl_error(state, "ncclCommShrink (new communicator)");
      }
    }
    if (e) {
      // Aborting the parent also stops a shrink still running (and waits for it).
      abort_locked(true);
      if (made != nullptr)
        (void)ncclCommAbort(made);
      return e;
    }
    {
      std::lock_guard<std::mutex> cg(child->handle_mtx_);
      child->comm_ = made;
    }
    child->origin_ = nccl_info::origin::shrink;
    child->setup_ns_ = mono_ns() - t0;
    return child;
  }
#endif

  /// Everything of NCCL, under the handle lock, for abort_all().
  std::mutex& handle_mutex() { return handle_mtx_; }
  ncclComm_t& handle_locked() { return comm_; }

  nccl_info info() {
    nccl_info i;
    i.made_by = origin_;
    i.device = device_;
    i.stream = stream_;
    i.setup_time = std::chrono::nanoseconds(setup_ns_);
    std::lock_guard<std::mutex> g(handle_mtx_);
    i.comm = comm_;
    return i;
  }

  void set_origin(nccl_info::origin o, int64_t setup_ns) {
    origin_ = o;
    setup_ns_ = setup_ns;
  }

private:
  caf::error abort_reason() const { return latch_.abort_reason(); }

  /// ncclGroupStart, the body's calls, ncclGroupEnd (always, so that this
  /// thread's group depth is restored even when a call in it failed).
  template <class Body>
  caf::error grouped(Body&& body) {
    CMESH_NCCL_CHECK(ncclGroupStart());
    caf::error e = body();
    const ncclResult_t end = ncclGroupEnd();
    if (e)
      return e;
    if (!nccl_ok(end))
      return nccl_error(end, "ncclGroupEnd");
    return {};
  }

  /// Refuses when poisoned or aborted, enqueues, then waits.
  template <class Enqueue>
  caf::error run(const char* name, const op_options& o, bool nothing_to_do, Enqueue&& enqueue) {
    if (auto p = poisoned())
      return make_error(errc::poisoned, fmt::format("{} on a poisoned NCCL communicator ({}); "
                                                    "rebuild it for a new epoch",
                                                    name, describe(p)));
    if (latch_.abort_requested())
      return fail(abort_reason());
    if (nothing_to_do)
      return {};
    if (auto r = cudaSetDevice(device_); r != cudaSuccess)
      return fail(cuda_error(r, "cudaSetDevice"));
    const int64_t start = mono_ns();
    caf::error enqueue_error;
    bool gone = false;
    {
      std::lock_guard<std::mutex> g(handle_mtx_);
      if (comm_ == nullptr)
        gone = true; // aborted by abort_all() in the meantime
      else
        enqueue_error = enqueue(comm_);
    }
    if (gone) {
      auto e = abort_reason();
      poison(e);
      return e;
    }
    if (enqueue_error) {
      // Any failed enqueue leaves the communicator in an unknown state. NCCL
      // only knows that a connection broke: blame a lost member if there is one.
      if (code_of(enqueue_error) == errc::transport_failure)
        enqueue_error = blame(std::move(enqueue_error));
      return fail(std::move(enqueue_error));
    }
    return wait(name, o, start);
  }

  /// Waits for the operation just enqueued on the stream.
  caf::error wait(const char* name, const op_options& o, int64_t start) {
    const int64_t deadline = start + ns_of(o.timeout);
    int64_t next_status = start + ns_of(opts_.status_interval);
    bool launched = false; // NCCL finished enqueueing (the non-blocking launch)
    for (;;) {
      ncclResult_t st = async_state();
      if (st == ncclNumResults)
        return fail(abort_reason()); // abort_all() tore it down
      if (st == ncclSuccess)
        launched = true;
      else if (st != ncclInProgress)
        return fail(blame(nccl_error(st, std::string(name) + ": asynchronous NCCL error")));
      if (launched) {
        const cudaError_t q = cudaStreamQuery(stream_);
        if (q == cudaSuccess) {
          // Done; unless NCCL saw an error meanwhile (its kernels may then
          // have stopped early).
          st = async_state();
          if (st == ncclSuccess)
            return {};
          if (st == ncclNumResults)
            return fail(abort_reason());
          return fail(blame(nccl_error(st, std::string(name) + ": asynchronous NCCL error")));
        }
        if (q != cudaErrorNotReady)
          return fail(cuda_error(q, std::string(name) + ": cudaStreamQuery"));
      }
      if (latch_.abort_requested())
        return fail(abort_reason());
      const int64_t now = mono_ns();
      if (now >= next_status) {
        next_status = now + ns_of(opts_.status_interval);
        if (auto e = check_peers(m_, me_, status_))
          return fail(std::move(e));
      }
      if (now > deadline)
        return fail(make_error(errc::timeout,
                               fmt::format("{} timed out after {} ms{}", name, o.timeout.count(),
                                           launched ? "" : " (NCCL was still enqueueing it)")));
      pause(opts_, now - start);
    }
  }

  /// ncclCommGetAsyncError under the handle lock; ncclNumResults when the
  /// NCCL communicator is gone (abort_all()).
  ncclResult_t async_state() {
    std::lock_guard<std::mutex> g(handle_mtx_);
    if (comm_ == nullptr)
      return ncclNumResults;
    ncclResult_t st = ncclInProgress;
    if (auto r = ncclCommGetAsyncError(comm_, &st); r != ncclSuccess)
      st = r;
    return st;
  }

  /// After an NCCL error: a member the failure detector reports lost
  /// within blame_grace becomes the error (peer_lost naming it).
  caf::error blame(caf::error nccl_err) {
    const int64_t until = mono_ns() + ns_of(opts_.blame_grace);
    do {
      if (auto p = check_peers(m_, me_, status_))
        return make_error(code_of(p), context_of(p) + " (NCCL: " + describe(nccl_err) + ")");
      if (!status_)
        break;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    } while (mono_ns() < until);
    return nccl_err;
  }

  /// Poisons, stops the work in flight (revoke, else abort) and waits a
  /// bounded time for the stream to drain, so that the caller's buffers are
  /// no longer touched when this returns (as far as NCCL lets us).
  caf::error fail(caf::error e) {
    poison(e);
    {
      std::lock_guard<std::mutex> g(handle_mtx_);
      if (comm_ != nullptr && !revoked_) {
#if CMESH_NCCL_HAS_REVOKE
        // A communicator that already reports an error (a broken
        // connection) cannot be shrunk (quiesce_for_shrink): a revoke would
        // only cost its half second. Abort it at once.
        ncclResult_t st = ncclInProgress;
        const bool broken = ncclCommGetAsyncError(comm_, &st) != ncclSuccess
                         || (st != ncclSuccess && st != ncclInProgress);
        if (opts_.revoke_on_failure && nccl_can_revoke() && !broken)
          revoke_locked();
        else
          abort_locked();
#else
        abort_locked();
#endif
      }
    }
    const int64_t until = mono_ns() + ns_of(opts_.revoke_timeout);
    while (cudaStreamQuery(stream_) == cudaErrorNotReady && mono_ns() < until)
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    (void)cudaGetLastError();
    return e;
  }

#if CMESH_NCCL_HAS_REVOKE
  /// ncclCommRevoke and a bounded wait for it to finish; ncclCommAbort when
  /// it fails or takes longer than revoke_timeout. Under handle_mtx_.
  void revoke_locked() {
    const ncclResult_t r = nccl_revoke()(comm_, NCCL_REVOKE_DEFAULT);
    if (nccl_ok(r)) {
      const int64_t until = mono_ns() + ns_of(opts_.revoke_timeout);
      ncclResult_t st = ncclInProgress;
      while (mono_ns() < until) {
        if (auto q = ncclCommGetAsyncError(comm_, &st); q != ncclSuccess)
          st = q;
        if (st != ncclInProgress)
          break;
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
      if (st != ncclInProgress) {
        // Quiescent. The state may still show the error that caused the
        // revoke (e.g. the proxy's broken connection); shrink() checks it.
        revoked_ = true;
        return;
      }
      spdlog::warn("nccl: revoke of epoch {} did not finish in {} ms; aborting", m_.epoch,
                   opts_.revoke_timeout.count());
    } else {
      spdlog::warn("nccl: ncclCommRevoke of epoch {}: {}; aborting", m_.epoch,
                   ncclGetErrorString(r));
    }
    abort_locked();
  }
#endif

  /// Aborts the NCCL communicator: its teardown on the reaper's thread when
  /// opts_.abort_in_background and not `wait` (the flag that stops its
  /// kernels is raised there within microseconds; fail() waits for the
  /// stream), else here. Under handle_mtx_.
  void abort_locked(bool wait = false) {
    if (comm_ == nullptr)
      return;
    if (!wait && opts_.abort_in_background
        && abort_reaper::instance().post(comm_, m_.epoch, device_)) {
      comm_ = nullptr;
      return;
    }
    if (auto r = ncclCommAbort(comm_); r != ncclSuccess)
      spdlog::warn("nccl: ncclCommAbort of epoch {}: {}", m_.epoch, ncclGetErrorString(r));
    comm_ = nullptr;
  }

  membership m_;
  size_t me_;
  peer_status status_;
  nccl_options opts_;
  int device_;
  std::string name_;
  cudaStream_t stream_ = nullptr;
  void* scratch_ = nullptr;
  nccl_info::origin origin_ = nccl_info::origin::init;
  int64_t setup_ns_ = 0;

  failure_latch latch_;

  // Every NCCL call on comm_ happens under handle_mtx_, so that abort_all()
  // (another thread) never frees it under a running call.
  std::mutex handle_mtx_;
  ncclComm_t comm_ = nullptr;
  bool revoked_ = false;
};

// -- construction helpers -------------------------------------------------------------------

expected<int> pick_device(const membership& m, size_t me, const nccl_options& opts) {
  int count = 0;
  if (auto r = cudaGetDeviceCount(&count); r != cudaSuccess) {
    (void)cudaGetLastError();
    return make_error(errc::invalid_argument,
                      std::string("no CUDA device: cudaGetDeviceCount: ") + cudaGetErrorString(r));
  }
  if (count <= 0)
    return make_error(errc::invalid_argument, "no CUDA device is visible");
  if (opts.device >= 0) {
    if (opts.device >= count)
      return make_error(errc::invalid_argument, fmt::format("CUDA device {} of {} requested",
                                                            opts.device, count));
    return opts.device;
  }
  int64_t local = opts.local_rank;
  if (local < 0) {
    std::string err;
    auto env = read_launch_env(err);
    local = err.empty() && env.source != "default" ? env.local_rank : static_cast<int64_t>(me);
  }
  (void)m;
  return static_cast<int>(local % count);
}

caf::error validate(const membership& m, uint32_t my_rank, size_t& me) {
  if (m.size() == 0 || m.size() > static_cast<size_t>(std::numeric_limits<int>::max()))
    return make_error(errc::invalid_argument,
                      "membership of " + std::to_string(m.size()) + " ranks");
  me = m.index_of(my_rank);
  if (me == m.size())
    return make_error(errc::invalid_argument,
                      "rank " + std::to_string(my_rank) + " is not a member");
  auto sorted = m.ranks;
  std::sort(sorted.begin(), sorted.end());
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
    return make_error(errc::invalid_argument, "a rank appears twice in the membership");
  return {};
}

std::string uid_key(uint64_t epoch) {
  return "epoch/" + std::to_string(epoch) + "/nccl/uid";
}

/// kv_get in slices, so that the abort flag and the publisher's death are
/// noticed before the whole timeout passes.
expected<wire::bytes> watched_get(coordinator_client& coordinator, const std::string& key,
                                  const membership& m, size_t me, uint32_t publisher,
                                  const peer_status& status, const nccl_options& opts) {
  const int64_t deadline = mono_ns() + ns_of(opts.init_timeout);
  for (;;) {
    const int64_t left_ms = (deadline - mono_ns()) / 1000000;
    if (left_ms <= 0)
      return make_error(errc::timeout, fmt::format("no value for {} after {} ms", key,
                                                   opts.init_timeout.count()));
    auto v = coordinator.kv_get(key, std::chrono::milliseconds(std::min<int64_t>(left_ms, 500)));
    if (v || code_of(v.error()) != errc::timeout)
      return v;
    if (opts.abort_flag != nullptr && opts.abort_flag->load())
      return make_error(errc::aborted, "waiting for " + key + " aborted");
    if (status && publisher != m.ranks[me])
      if (auto e = status(publisher))
        return make_error(errc::peer_lost, "rank " + std::to_string(publisher)
                                             + " (publishes " + key + "): " + describe(e));
  }
}

nccl_comm* as_nccl(communicator* c) {
  return dynamic_cast<nccl_comm*>(c);
}

} // namespace

// -- public functions -----------------------------------------------------------------------

std::string_view to_string(nccl_info::origin o) {
  switch (o) {
    case nccl_info::origin::init: return "init";
    case nccl_info::origin::shrink: return "shrink";
    case nccl_info::origin::reinit: return "reinit";
  }
  return "?";
}

expected<nccl_unique_id> make_nccl_unique_id() {
  ncclUniqueId id;
  if (auto r = ncclGetUniqueId(&id); r != ncclSuccess)
    return nccl_error(r, "ncclGetUniqueId");
  nccl_unique_id out;
  std::memcpy(out.data(), &id, sizeof(id));
  return out;
}

expected<std::unique_ptr<communicator>> make_nccl_communicator(membership members,
                                                               uint32_t my_rank,
                                                               const nccl_unique_id& id,
                                                               peer_status status,
                                                               nccl_options opts) {
  size_t me = 0;
  if (auto e = validate(members, my_rank, me))
    return e;
  auto dev = pick_device(members, me, opts);
  if (!dev)
    return dev.error();
  auto c = std::make_unique<nccl_comm>(std::move(members), me, std::move(status), std::move(opts),
                                       *dev);
  if (auto e = c->setup_cuda())
    return e;
  ncclUniqueId uid;
  std::memcpy(&uid, id.data(), sizeof(uid));
  if (auto e = c->init(uid))
    return e;
  return std::unique_ptr<communicator>(std::move(c));
}

expected<std::unique_ptr<communicator>> make_nccl_communicator(membership members,
                                                               uint32_t my_rank,
                                                               coordinator_client& coordinator,
                                                               peer_status status,
                                                               nccl_options opts) {
  size_t me = 0;
  if (auto e = validate(members, my_rank, me))
    return e;
  const auto key = uid_key(members.epoch);
  nccl_unique_id id{};
  if (me == 0) {
    auto made = make_nccl_unique_id();
    if (!made)
      return made.error();
    id = *made;
    if (auto e = coordinator.kv_put(key, wire::bytes(id.begin(), id.end())))
      return e;
  } else {
    auto v = watched_get(coordinator, key, members, me, members.ranks[0], status, opts);
    if (!v)
      return v.error();
    if (v->size() != id.size())
      return make_error(errc::malformed_frame, fmt::format("{} holds {} bytes, not an NCCL "
                                                           "unique id of {}",
                                                           key, v->size(), id.size()));
    std::copy(v->begin(), v->end(), id.begin());
  }
  return make_nccl_communicator(std::move(members), my_rank, id, std::move(status),
                                std::move(opts));
}

expected<std::unique_ptr<communicator>> shrink(communicator& old_comm,
                                               const std::vector<uint32_t>& dead_ranks,
                                               uint64_t new_epoch, coordinator_client* coordinator,
                                               peer_status status, nccl_options opts) {
  auto* old = as_nccl(&old_comm);
  if (old == nullptr)
    return make_error(errc::invalid_argument, "shrink: not an NCCL communicator");
  const auto& om = old->members();
  const uint32_t my_rank = om.ranks[old->index()];
  membership next{new_epoch, {}};
  std::vector<int> exclude;
  for (size_t i = 0; i < om.size(); ++i) {
    if (std::find(dead_ranks.begin(), dead_ranks.end(), om.ranks[i]) != dead_ranks.end())
      exclude.push_back(static_cast<int>(i));
    else
      next.ranks.push_back(om.ranks[i]);
  }
  if (exclude.size() != dead_ranks.size())
    return make_error(errc::invalid_argument, "shrink: a dead rank is not a member (or repeated)");
  const size_t next_me = next.index_of(my_rank);
  if (next_me == next.size())
    return make_error(errc::invalid_argument,
                      "shrink: rank " + std::to_string(my_rank) + " is among the dead");
  if (new_epoch == om.epoch)
    return make_error(errc::invalid_argument, "shrink: the new epoch must differ from the old");

  const int64_t t0 = mono_ns();
  old->poison(make_error(errc::poisoned,
                         "replaced by the communicator of epoch " + std::to_string(new_epoch)));

  bool can_shrink = can_shrink_comms() && !exclude.empty() && old->quiesce_for_shrink();
  if (coordinator != nullptr) {
    // Every survivor must be able to shrink, or all re-initialise.
    const std::string ns = "epoch/" + std::to_string(new_epoch) + "/nccl/shrinkable/";
    const std::string mine = can_shrink ? "1" : "0";
    if (auto e = coordinator->kv_put(ns + std::to_string(my_rank),
                                     wire::bytes(mine.begin(), mine.end())))
      return e;
    for (size_t i = 0; i < next.size(); ++i) {
      if (i == next_me)
        continue;
      auto v = watched_get(*coordinator, ns + std::to_string(next.ranks[i]), next, next_me,
                           next.ranks[i], status, opts);
      if (!v)
        return v.error();
      if (v->size() != 1 || (*v)[0] != '1')
        can_shrink = false;
    }
  }

  caf::error shrink_error;
#if CMESH_NCCL_HAS_SHRINK
  if (can_shrink) {
    auto made = old->shrink_to(next, next_me, exclude, status, opts);
    if (made) {
      old->abort_handle(); // the parent is no longer needed (no shared resources)
      (*made)->set_origin(nccl_info::origin::shrink, mono_ns() - t0);
      return std::unique_ptr<communicator>(std::move(*made));
    }
    shrink_error = made.error();
    spdlog::warn("nccl: shrink to epoch {} failed ({}){}", new_epoch, describe(shrink_error),
                 coordinator != nullptr ? "; re-initialising" : "");
    if (coordinator == nullptr)
      return shrink_error;
  }
#endif
  old->abort_handle();
  if (coordinator == nullptr)
    return make_error(errc::invalid_argument,
                      "shrink: the NCCL communicator cannot be shrunk (aborted, in error, or "
                      "no ncclCommShrink in this NCCL) and there is no coordinator to "
                      "re-initialise through");
  auto made = make_nccl_communicator(next, my_rank, *coordinator, std::move(status),
                                     std::move(opts));
  if (!made)
    return made.error();
  as_nccl(made->get())->set_origin(nccl_info::origin::reinit, mono_ns() - t0);
  return made;
}

bool nccl_can_revoke() {
#if CMESH_NCCL_HAS_REVOKE
  return nccl_revoke() != nullptr;
#else
  return false;
#endif
}

bool drain_background_aborts(std::chrono::milliseconds timeout) {
  return abort_reaper::instance().drain(timeout);
}

caf::error abort_all(std::span<communicator* const> comms) {
  std::vector<nccl_comm*> ours;
  for (auto* c : comms) {
    if (c == nullptr)
      continue;
    if (auto* n = as_nccl(c))
      ours.push_back(n);
    else
      c->abort({});
  }
  std::sort(ours.begin(), ours.end());
  ours.erase(std::unique(ours.begin(), ours.end()), ours.end());
  const auto reason = make_error(errc::aborted, "aborted (abort_all)");
  for (auto* n : ours)
    n->abort(reason); // running operations notice and stop polling
  // Take every handle lock (in address order: no deadlock with another
  // abort_all) so that no thread is inside an NCCL call on them.
  std::vector<std::unique_lock<std::mutex>> locks;
  locks.reserve(ours.size());
  for (auto* n : ours)
    locks.emplace_back(n->handle_mutex());
  std::vector<ncclComm_t*> handles;
  for (auto* n : ours) {
    n->poison(reason);
    if (n->handle_locked() != nullptr)
      handles.push_back(&n->handle_locked());
  }
  if (handles.empty())
    return {};
  // NCCL 2.28 queues an abort issued inside a group as an asynchronous job
  // and runs the jobs of all of them in parallel threads at ncclGroupEnd,
  // which returns once every one is torn down.
  caf::error first;
  if (auto r = ncclGroupStart(); r != ncclSuccess) {
    first = nccl_error(r, "ncclGroupStart");
    for (auto* h : handles) // one by one, then
      (void)ncclCommAbort(*h);
  } else {
    for (auto* h : handles)
      if (auto r2 = ncclCommAbort(*h); r2 != ncclSuccess && !first)
        first = nccl_error(r2, "ncclCommAbort");
    if (auto r3 = ncclGroupEnd(); r3 != ncclSuccess && !first)
      first = nccl_error(r3, "ncclGroupEnd (aborts)");
  }
  for (auto* h : handles)
    *h = nullptr;
  return first;
}

expected<nccl_info> nccl_info_of(const communicator& c) {
  auto* n = dynamic_cast<const nccl_comm*>(&c);
  if (n == nullptr)
    return make_error(errc::invalid_argument, "not an NCCL communicator");
  return const_cast<nccl_comm*>(n)->info();
}

} // namespace cmesh::coll
