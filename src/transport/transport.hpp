// The per-process transport: two endpoints per peer, each on its own UCP
// worker and progress thread, and failure detection.
//
// Two lanes. The data lane (one UCP worker and its progress thread) carries
// frames and bulk payloads over data endpoints in NONE error mode: UCX picks
// shared memory and CMA, full speed. The control lane (a second worker and
// thread) carries heartbeats over control endpoints in PEER error mode: UCX
// picks TCP, and a dead peer is reported in milliseconds. Keeping them apart
// means a long copy on the data lane (a 256 MiB CMA pull) never delays a
// heartbeat, so silence really means a stopped process. The address in the
// peer table holds both workers' addresses.
//
// Tags. bits 63..60 channel, 59..40 source rank, 39..24 the source's
// generation (its incarnation folded to 16 bits), 23..0 bulk sequence (never
// 0 for a payload: 0 means none). A frame that carries a bulk payload has
// that payload's sequence in its own tag, and the payload follows under
// (bulk channel, source, generation, sequence); the receiver pulls it
// (rendezvous), so a death shows up on the receiver's side.
//
// Failure. A peer is lost when one of its endpoints fails (errc::peer_lost)
// or when nothing was heard from it for heartbeat_timeout_ms
// (errc::peer_unresponsive). A control endpoint that fails before its
// incarnation was ever heard from is first made again (at most 5 times,
// within connect_timeout_ms): two processes that dial each other at once
// can see one side's first endpoint fail though both live. Either way that incarnation of it is fenced for
// good: its endpoints are closed, receives from it are cancelled, later
// frames from it are dropped and sends to it fail at once. The peer-down
// handler runs once per incarnation.
//
// Membership. The peers follow the job's membership: connect_peer(), at any
// time, dials a rank's newer incarnation at its new address (fencing the
// older one first, if it still counts as alive), and the peer-up handler
// runs. Frames and heartbeats whose tag carries another generation than
// the peer's current one (a stale process that outlived its replacement)
// are dropped and counted, a payload is pulled only under its frame's
// generation, and a send or an endpoint error meant for an older
// incarnation never reaches or fences the newer one.
//
// Threads. send(), peer_alive() and stats() may be called from any thread.
// The handlers run on the data lane's thread and must not block.
#pragma once

#include "core/error.hpp"
#include "transport/bulk.hpp"
#include "transport/messages.hpp"
#include "transport/wire.hpp"

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

namespace cmesh {

struct transport_options {
  int64_t heartbeat_interval_ms = 100;
  /// Silence longer than this marks a peer unresponsive (CMESH_HEARTBEAT_TIMEOUT_MS);
  /// detection takes at most this plus one interval: 900 ms by default.
  int64_t heartbeat_timeout_ms = 800;
  /// A peer never heard from is given this long before it counts as lost.
  int64_t connect_timeout_ms = 10000;
  /// Frames waiting for the progress thread, over all peers.
  int64_t send_queue_max = 1 << 16;
  /// How long send() waits for room in a full queue before queue_full.
  int64_t send_block_ms = 2000;
  /// Sends in flight to one peer before further ones wait in its queue.
  int64_t inflight_per_peer_max = 1024;
  /// Bulk payloads pulled from one peer at a time (later ones wait, in
  /// order). One progress thread copies them one after the other anyway;
  /// more at once only spread the copies over more buffers: colder caches
  /// and more memory held (measured: 4 MiB payloads at 0.6 of raw UCX with
  /// 16 at a time, 0.9 with 2).
  int64_t pulls_per_peer_max = 2;
  /// Busy-polling after activity before the progress thread sleeps.
  int64_t spin_us = 50;
  /// The first part of spin_us polls without yielding the core: a yield is
  /// a system call, and on virtual machines one costs about a microsecond,
  /// which a message arriving meanwhile waits for.
  int64_t spin_hot_us = 5;

  /// Defaults overridden by CMESH_HEARTBEAT_INTERVAL_MS, CMESH_HEARTBEAT_TIMEOUT_MS,
  /// CMESH_CONNECT_TIMEOUT_MS, CMESH_SEND_QUEUE_MAX, CMESH_SPIN_US, CMESH_SPIN_HOT_US,
  /// CMESH_PULLS_PER_PEER, CMESH_SEND_BLOCK_MS.
  static expected<transport_options> from_env(transport_options defaults);
};

/// A frame received from a peer, with its bulk payload when it has one.
struct inbound_frame {
  uint32_t from = 0;
  wire::frame_header header;
  std::vector<uint8_t> bytes;
  size_t body_offset = 0;
  bulk payload;
  std::span<const uint8_t> body() const {
    return std::span<const uint8_t>(bytes).subspan(body_offset);
  }
};

struct transport_stats {
  uint64_t frames_sent = 0;
  uint64_t frames_received = 0;
  uint64_t bulk_bytes_sent = 0;
  uint64_t bulk_bytes_received = 0;
  uint64_t frames_rejected = 0;
  uint64_t sends_refused = 0;
  uint64_t peers_lost = 0;
  uint64_t frames_stale = 0;    // frames and heartbeats of another incarnation, dropped
  uint64_t peers_connected = 0; // peer incarnations connected (connect(), connect_peer())
};

class transport {
public:
  using frame_handler = std::function<void(inbound_frame&&)>;
  using peer_down_handler = std::function<void(uint32_t peer, const caf::error& reason)>;
  using peer_up_handler = std::function<void(uint32_t peer, uint64_t incarnation)>;

  /// Creates the UCP context and worker for process `self`, which runs as
  /// `incarnation` (the one its peer-table entry names; 0 where nothing
  /// restarts).
  static expected<std::unique_ptr<transport>> create(uint32_t self, transport_options opts,
                                                     uint64_t incarnation = 0);

  ~transport();
  transport(const transport&) = delete;
  transport& operator=(const transport&) = delete;

  uint32_t self() const;
  const transport_options& options() const;

  /// This worker's UCP address, for the peer table.
  wire::bytes address() const;

  /// Sets the handlers; call before start(). `on_up` runs on the data
  /// lane's thread when connect_peer() connected a peer after start().
  void set_handlers(frame_handler on_frame, peer_down_handler on_down,
                    peer_up_handler on_up = {});

  /// Makes room for ranks 0 .. world_size-1 (connect() does it for the
  /// ranks it is given); call before start().
  caf::error reserve(uint32_t world_size);

  /// Creates the endpoints to every other entry; call before start().
  caf::error connect(const std::vector<wire::peer_entry>& peers);

  /// Connects `peer` (a rank within reserve()'s or connect()'s range) at
  /// its incarnation and address, at any time: before start() as
  /// connect() does, after it on the lanes' threads (this returns once the
  /// request is queued). An incarnation older than or the same as the one
  /// connected is ignored; a newer one replaces it (the older one is fenced
  /// for good with errc::peer_lost first, if it was alive). Errors:
  /// invalid_argument (rank out of range, malformed address), closed.
  caf::error connect_peer(const wire::peer_entry& peer);

  /// The incarnation `peer` is connected at (0: none, or never told).
  uint64_t peer_incarnation(uint32_t peer) const;

  /// Starts the progress thread.
  caf::error start();

  /// Queues an encoded frame (and its payload) to `peer`. When the queue is
  /// full, blocks up to send_block_ms (backpressure). Called from the data
  /// lane's own thread (a handler), it posts at once, after what other
  /// threads queued before, and makes room by progressing rather than
  /// waiting. Errors: peer_lost when the peer is fenced, queue_full,
  /// invalid_argument, closed.
  /// `incarnation` (0: whichever is connected) is the one the frame is for:
  /// once the peer runs another, the frame is refused (peer_lost) or, when
  /// the change comes while it waits in the queue, dropped.
  caf::error send(uint32_t peer, std::vector<uint8_t> frame, bulk payload = {},
                  uint64_t incarnation = 0);

  /// Encodes and sends a message.
  template <class T>
  caf::error send_message(uint32_t peer, wire::frame_header h, const T& msg,
                          uint64_t incarnation = 0) {
    h.src_process = self();
    h.dst_process = peer;
    bulk payload;
    if constexpr (wire::has_bulk_v<T>)
      payload = msg.payload;
    return send(peer, wire::encode(std::move(h), msg), std::move(payload), incarnation);
  }

  /// False once the peer is fenced (or was never connected).
  bool peer_alive(uint32_t peer) const;

  /// Why the peer was fenced (none while it is alive). Thread-safe.
  caf::error peer_error(uint32_t peer) const;

  /// Fences a peer from outside (e.g. the coordinator declared it dead).
  void fence(uint32_t peer, caf::error reason);

  transport_stats stats() const;

  /// The job is ending: peers leaving from now on are expected, so their
  /// loss is logged quietly (the peer-down handler still runs).
  void begin_shutdown();

  /// Stops the progress thread and closes every endpoint; idempotent.
  void stop();

  struct impl; // the progress thread's state (transport.cpp)

private:
  transport();
  std::unique_ptr<impl> impl_;
};

} // namespace cmesh
