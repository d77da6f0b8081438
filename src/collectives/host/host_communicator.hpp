// The host backend: collectives over CPU buffers, between processes, over
// UCX (shared memory and CMA on one machine, the network elsewhere).
//
// Algorithms. all_reduce: recursive doubling (with the usual fold for a
// non-power-of-two count) up to small_bytes_max; above it, a ring
// reduce-scatter then a ring all-gather. The ring is pipelined per chunk:
// every chunk moves through the ring's steps on its own, so transfers of
// some chunks overlap the reduction of others, and the staging memory is
// 2 x window x chunk_bytes whatever the buffer's size (window = number of
// members, at least 2). all_gather receives straight into the output (no
// staging), broadcast is a pipelined chain from the root, all_to_allv posts
// every pairwise transfer at once. Large messages go eagerly through shared
// memory unless the context says rendezvous (bulk_protocol).
//
// Failure: see communicator.hpp. A member lost is noticed through the
// process's failure detector (peer_status, usually the transport's
// heartbeats and endpoint errors) and through this communicator's own
// endpoint errors; the error names the rank. The communicator is poisoned.
//
// Each process keeps one host_context (a UCP worker) for all epochs; a new
// epoch's communicator exchanges worker addresses through the coordinator's
// key/value store under "epoch/<id>/host/<rank>".
#pragma once

#include "collectives/communicator.hpp"

#include <functional>
#include <memory>
#include <optional>
#include <string>

namespace cmesh {
class coordinator_client;
}

namespace cmesh::coll {

/// Why a global rank can no longer take part (none while it can).
using peer_status = std::function<caf::error(uint32_t rank)>;

struct host_options {
  size_t chunk_bytes = 512 * 1024;
  size_t small_bytes_max = 64 * 1024; // recursive doubling up to here
  int64_t spin_before_yield = 200;    // consecutive idle polls before yielding the core
  /// Above zero: past idle_polls_before_sleep idle polls (a wait, not a
  /// transfer in progress), sleep on the worker's event descriptor for up
  /// to this long at a time instead of yielding (waits that may last a
  /// step, beside training that needs the cores).
  std::chrono::milliseconds sleep_when_idle{0};
  int64_t idle_polls_before_sleep = 2000;
  /// A communicator whose members all share a host moves the ring's chunks
  /// through shared-memory rings of its own (each member reads one of 8
  /// chunk-sized slots, written by its left neighbour) instead of UCX.
  /// CMESH_COLL_SHM_RING=0 turns it off.
  bool shared_memory_ring = true;
  std::chrono::milliseconds rendezvous_timeout{30000};
};

/// How a host context moves large messages (docs/design.md, Collectives).
enum class bulk_protocol : uint8_t {
  eager,      // copied through shared memory whatever the size
              // (UCX_RNDV_THRESH = inf): the sender copies into the
              // receiver's shared receive buffers, the receiver out of them
              // (cache-hot). The ring's chunking bounds what a peer can send
              // ahead of the receives posted for it.
  rendezvous, // UCX's choice: rendezvous above its threshold (the receiver
              // pulls: CMA on one machine, RDMA between machines)
};

/// The protocol a context gets when its creator does not say: eager, or
/// what CMESH_COLL_BULK (eager | rendezvous) says; a malformed value is an
/// invalid_argument error.
expected<bulk_protocol> default_bulk_protocol();

/// One UCP worker for the collectives of this process. A UCX_RNDV_THRESH in
/// the environment overrides `bulk`.
class host_context {
public:
  /// `bulk` unset: default_bulk_protocol(). `keep_spare_worker`: make the
  /// next worker ahead on a thread of its own (at creation, and 2 s after
  /// each renewal), so that prepare() after a failure is a swap; off for a
  /// context that is dropped after a failure rather than renewed.
  /// `fifo_elems` above zero: the shared-memory receive FIFO's length
  /// (UCX_MM_FIFO_SIZE; UCX's default is 64), see transfer_context().
  static expected<std::shared_ptr<host_context>> create(
    uint32_t rank, std::optional<bulk_protocol> bulk = std::nullopt,
    bool keep_spare_worker = true, size_t fifo_elems = 0);
  ~host_context();

  bulk_protocol bulk() const;
  uint32_t rank() const;
  /// The current worker's address, published for every epoch.
  std::string address() const;

  /// Readies the context for a communicator of `next`, before its address
  /// is published: when the last communicator made here failed, or had a
  /// member `next` lacks, the context moves to a fresh UCP worker. A member
  /// killed while writing into this worker's shared-memory receive queue
  /// leaves a slot that is never completed, and every message behind it,
  /// from any peer, waits forever. Communicators already made keep their
  /// worker. The coordinator and subcommunicator paths call it; a caller
  /// exchanging addresses itself calls it before address().
  caf::error prepare(const membership& next);
  /// How many times prepare() moved to a fresh worker.
  uint64_t renewals() const;

  struct impl;
  impl& internals() { return *impl_; }

private:
  host_context();
  std::unique_ptr<impl> impl_;
};

/// A context for one-shot bulk transfers between fresh workers
/// (bench/recovery's reference for a catch-up's rate): eager, no spare worker, and a receive
/// FIFO of 8 fragments instead of 64. A sender first touches every receive
/// buffer the FIFO cycles through, in the receiver's segments it maps
/// then: with 64 of 32 KiB that first touch cost a cold 26.8 MB broadcast
/// about 10 ms, 4/5 of its time, on the machines measured; with 8 it is
/// an eighth of that, and a warm broadcast moves as fast.
expected<std::shared_ptr<host_context>> transfer_context(uint32_t rank);

/// Why a communicator still being built is no longer wanted (e.g. a newer
/// epoch came, which a member may have gone to instead); no error while it
/// still is.
using build_status = std::function<caf::error()>;

/// Builds the communicator of `members` (this rank must be one): publishes
/// this worker's address under the epoch's namespace, reads the others' and
/// connects. The wait for the others' addresses runs in slices of 100 ms;
/// between them it asks `status` about every other member (published or
/// not) and `moot` (when given), and the first error ends the build. Errors:
/// invalid_argument, timeout (a member never published within
/// opts.rendezvous_timeout), closed (coordinator lost), transport_failure,
/// and whatever `status` and `moot` return.
expected<std::unique_ptr<communicator>> make_host_communicator(
  std::shared_ptr<host_context> ctx, membership members, coordinator_client& coordinator,
  peer_status status, host_options opts = {}, build_status moot = {});

/// Whether `c` is a host communicator whose ring runs through the
/// shared-memory rings (members all on one host, host_options::shared_memory_ring);
/// decided by its first operation that runs the ring, false before.
bool uses_shared_memory_ring(const communicator& c);

/// The same from addresses already known (index-aligned with members.ranks;
/// this rank's entry is ignored). For tests and for callers with their own
/// rendezvous.
expected<std::unique_ptr<communicator>> make_host_communicator(
  std::shared_ptr<host_context> ctx, membership members, const std::vector<std::string>& addresses,
  peer_status status, host_options opts = {});

/// A communicator of `sub` (a subset of parent's members that holds this
/// rank) on `ctx`, with the addresses exchanged over `parent`: every member
/// of parent calls it at once, each with its own subset (a replica group,
/// the ranks holding the same shard in every group). `ctx` must be a
/// context of its own for each kind of subset, so that the tags of
/// communicators of one epoch never meet on one worker.
expected<std::unique_ptr<communicator>> make_host_subcommunicator(
  communicator& parent, std::shared_ptr<host_context> ctx, membership sub, peer_status status,
  host_options opts = {});

} // namespace cmesh::coll
