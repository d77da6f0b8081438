// The NCCL backend: collectives over GPU buffers (every pointer passed to an
// operation is a device pointer of the communicator's device).
//
// Built only when CMESH_HAVE_NCCL. One cmesh communicator owns one NCCL
// communicator created NON-BLOCKING (config.blocking = 0), one CUDA stream
// and a few bytes of device scratch. NCCL rank = index in members().ranks.
//
// Waiting. Every operation is enqueued on the communicator's own stream and
// then waited for by this runtime's own watchdog, never by a blocking CUDA or
// NCCL call: it polls cudaStreamQuery and ncclCommGetAsyncError (spinning
// briefly, then yielding, then sleeping a few microseconds between polls),
// and checks the operation's timeout (op_options::timeout), the abort flag
// (abort() from any thread) and peer_status for every member. Creation and
// shrinking are watched the same way (nccl_options::init_timeout, the
// optional abort flag in nccl_options, peer_status).
//
// Failure. As for every communicator (communicator.hpp): any error POISONS
// it; every later operation returns errc::poisoned at once, without touching
// NCCL, until the caller builds a new communicator (make_nccl_communicator
// for the next epoch, or shrink() below). A lost member is errc::peer_lost
// naming the rank; a deadline is errc::timeout; abort() is errc::aborted;
// a failed CUDA or NCCL call is errc::transport_failure with NCCL's text
// (ncclGetErrorString and ncclGetLastError). On failure the in-flight work is
// stopped at once: with ncclCommRevoke where the NCCL library has it (the
// NCCL communicator is then quiescent but still allocated, so that shrink()
// can build the survivors' communicator from it), otherwise, or when the
// revoke does not finish within nccl_options::revoke_timeout, with
// ncclCommAbort. The destructor aborts (or, when healthy, destroys) the NCCL
// communicator.
//
// Not like the host backend: int64 sums wrap silently on overflow (NCCL has
// no overflow check; errc::overflow is never returned here), and float avg
// is NCCL's (each value times 1/n, then summed), which may differ from
// sum / n in the last bits.
//
// Rendezvous. Member index 0 creates the NCCL unique id and publishes it in
// the coordinator's key/value store under "epoch/<epoch>/nccl/uid" (a fresh
// namespace per epoch); the others read it there.
//
// Several ranks on one GPU (tests): NCCL refuses two ranks of a communicator
// on one device of one host. Setting NCCL_HOSTID to a different value in each
// process, before any NCCL call, makes each process its own "host"; NCCL then
// connects them through its network (socket) transport.
#pragma once

#include "collectives/communicator.hpp"
#include "collectives/host/host_communicator.hpp" // peer_status

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace cmesh {
class coordinator_client;
}

// Opaque NCCL and CUDA handle types (nccl.h, cuda_runtime_api.h).
struct ncclComm;
struct CUstream_st;

namespace cmesh::coll {

/// The bytes of an ncclUniqueId (NCCL_UNIQUE_ID_BYTES).
using nccl_unique_id = std::array<uint8_t, 128>;

/// A fresh unique id (ncclGetUniqueId). The calling process hosts NCCL's
/// bootstrap root for communicators created from it, so it must stay alive
/// while they are created. Error: transport_failure.
expected<nccl_unique_id> make_nccl_unique_id();

struct nccl_options {
  /// CUDA device of this process; -1: local_rank modulo the device count.
  int device = -1;
  /// Local rank for the default device; -1: from the launcher's environment
  /// (read_launch_env), or the member index when that says nothing.
  int local_rank = -1;
  /// Creation and shrinking, including the unique id's rendezvous.
  std::chrono::milliseconds init_timeout{60000};
  /// How long a revoke (after a failure) may take before ncclCommAbort.
  std::chrono::milliseconds revoke_timeout{10000};
  /// After an NCCL error, how long to wait for peer_status to name a lost
  /// member (errc::peer_lost) before reporting NCCL's own error.
  std::chrono::milliseconds blame_grace{500};
  /// How often peer_status is asked about every member while waiting.
  std::chrono::microseconds status_interval{1000};
  /// Poll loop: spin this long, then yield until yield_until, then sleep
  /// `sleep` between polls.
  std::chrono::microseconds spin_for{50};
  std::chrono::microseconds yield_until{2000};
  std::chrono::microseconds sleep{20};
  /// On a failure, revoke (keeps the communicator shrinkable) rather than
  /// abort at once. Without ncclCommRevoke in the library, always abort.
  bool revoke_on_failure = true;
  /// A failed or aborted operation returns once its kernels have stopped;
  /// ncclCommAbort's teardown (about 0.5 s of NCCL's proxy threads) goes on
  /// in the background (drain_background_aborts). False: it returns after.
  bool abort_in_background = true;
  /// Tests: reduce_scatter and all_gather always take the per-block path
  /// (grouped ncclReduce / ncclBroadcast) that uneven counts take.
  bool force_block_path = false;
  /// Set from any thread to stop a creation or shrink in progress (errc::aborted).
  const std::atomic<bool>* abort_flag = nullptr;
  /// NCCL's commName (logs); empty: "cmesh-epoch-<epoch>".
  std::string name;
};

/// Builds this process's communicator of `members` (my_rank must be one)
/// from a unique id every member was given. Errors: invalid_argument (bad
/// membership or no CUDA device), timeout, aborted, peer_lost,
/// transport_failure.
expected<std::unique_ptr<communicator>> make_nccl_communicator(
  membership members, uint32_t my_rank, const nccl_unique_id& id, peer_status status,
  nccl_options opts = {});

/// The same through the coordinator: member index 0 creates the unique id
/// and kv_puts it under "epoch/<epoch>/nccl/uid", the others kv_get it
/// (waiting up to opts.init_timeout). Also closed (coordinator lost).
expected<std::unique_ptr<communicator>> make_nccl_communicator(
  membership members, uint32_t my_rank, coordinator_client& coordinator, peer_status status,
  nccl_options opts = {});

/// The survivors' communicator for `new_epoch`: every member of `old`
/// except `dead_ranks` (global ranks) calls this with the same arguments;
/// the dead ranks take no part. Needs nothing from the dead ranks.
///
/// Path: stop `old` with ncclCommRevoke (unless a failure already revoked
/// it), then ncclCommShrink excluding the dead ranks, non-blocking under the
/// watchdog. With a coordinator, the survivors first agree through the
/// key/value store ("epoch/<new_epoch>/nccl/shrinkable/<rank>") that every
/// one of them can shrink (its NCCL communicator exists and reports no
/// error); otherwise, or when revoke/shrink are missing from the library or
/// the shrink fails, they fall back to a full re-initialisation with a fresh
/// unique id under "epoch/<new_epoch>/nccl/uid" (the fallback needs the
/// coordinator). `old` is poisoned afterwards and its NCCL communicator
/// freed. If survivors ever disagree in a way this cannot see (one's shrink
/// succeeds while another's fails), their next operation times out: treat
/// that as the failure of this epoch and go to the next.
expected<std::unique_ptr<communicator>> shrink(communicator& old,
                                               const std::vector<uint32_t>& dead_ranks,
                                               uint64_t new_epoch, coordinator_client* coordinator,
                                               peer_status status, nccl_options opts = {});

/// Aborts several communicators at once. NCCL communicators are aborted with
/// ncclCommAbort inside one ncclGroupStart/End (NCCL then tears them down in
/// parallel, so one slow teardown does not serialise the others); any other
/// communicator gets abort(). Every one ends poisoned with errc::aborted.
/// Safe while operations run on other threads: they return errc::aborted.
caf::error abort_all(std::span<communicator* const> comms);

/// Whether failures can revoke: this build's nccl.h and the NCCL library
/// loaded at run time both have ncclCommRevoke (NCCL 2.28.7 and later).
bool nccl_can_revoke();

/// Waits until the ncclCommAbort teardowns started in the background
/// (nccl_options::abort_in_background) have finished, at most `timeout`;
/// false when some still run. The process also waits for them at exit.
bool drain_background_aborts(std::chrono::milliseconds timeout);

/// How an NCCL communicator came to be, and its NCCL resources, for
/// diagnostics, benchmarks and interop. Never call NCCL on `comm` while one
/// of this communicator's operations runs, nor after it is poisoned.
struct nccl_info {
  enum class origin { init, shrink, reinit } made_by = origin::init;
  int device = -1;
  ncclComm* comm = nullptr;      // null once aborted
  CUstream_st* stream = nullptr; // the stream every operation runs on
  std::chrono::nanoseconds setup_time{0}; // creation, shrink or re-init
};

/// Details of an NCCL communicator; invalid_argument for another kind.
expected<nccl_info> nccl_info_of(const communicator& c);

std::string_view to_string(nccl_info::origin o);

} // namespace cmesh::coll
