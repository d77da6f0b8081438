// The bridge between the transport and CAF: remote actors look like local
// ones. A remote actor is named by (rank, name); mesh::remote() returns a
// caf::actor handle (a proxy) that encodes whatever registered message it is
// sent and ships it to that process. Incoming frames are decoded and put into
// the named local actor's mailbox with the sender's proxy as sender, so
// `self->current_sender()` can be replied to as usual.
//
// Order: messages from one actor to one remote actor arrive in the order
// sent (one proxy mailbox-free path, one UCX endpoint, one receive queue).
//
// Failure: when the transport fences a peer, every proxy of that rank
// terminates with the transport's reason (errc::peer_lost or
// errc::peer_unresponsive), so every local actor that monitors one of them
// gets a down_msg carrying that reason. A proxy made for a fenced rank is
// terminated from the start.
//
// Membership: a proxy is bound to the incarnation of its rank that was
// connected when it was made, and never reaches another. Once the
// transport connects a newer incarnation (transport::connect_peer),
// remote() of that rank returns a new proxy for it; the old proxies stay
// terminated. Links to remote actors are not supported:
// monitor them instead. A message the transport refuses because the peer's
// send queue stayed full for the whole backpressure wait fences that peer
// (errc::queue_full): its monitors get a down_msg instead of a silent gap
// in the order of the messages that follow.
#pragma once

#include "transport/messages.hpp"
#include "transport/transport.hpp"

#include <caf/actor.hpp>
#include <caf/actor_system.hpp>
#include <caf/allowed_unsafe_message_type.hpp>

#include <memory>
#include <string>

// Actor messages travel as C++ values inside one process; the wire encoding
// is msgpack (messages.hpp), not CAF's serialization.
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(cmesh::wire::token)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(cmesh::wire::sequenced)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(cmesh::wire::blob)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(cmesh::wire::ack)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(cmesh::wire::ckpt_seed)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(cmesh::wire::ckpt_update)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(cmesh::wire::catchup_request)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(cmesh::wire::catchup_piece)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(cmesh::wire::catchup_update)
CAF_ALLOW_UNSAFE_MESSAGE_TYPE(cmesh::wire::catchup_ack)

namespace cmesh {
/// (peer_down_atom, uint32_t rank, uint64_t incarnation, std::string reason):
/// the transport fenced that incarnation of a peer (mesh::watch_peers).
using peer_down_atom = caf::atom_constant<caf::atom("peerdown")>;
} // namespace cmesh

namespace cmesh {

struct mesh_stats {
  uint64_t forwarded = 0;       // messages shipped by proxies
  uint64_t delivered = 0;       // frames put into local mailboxes
  uint64_t unsendable = 0;      // messages to a proxy of a type not in the registry
  uint64_t send_failures = 0;   // transport refused (peer fenced, queue full)
};

class mesh {
public:
  /// Installs itself as the transport's frame and peer-down handler: call
  /// before transport::start().
  mesh(caf::actor_system& sys, transport& t);
  ~mesh();
  mesh(const mesh&) = delete;
  mesh& operator=(const mesh&) = delete;

  /// Where the messages that arrive for a published actor are run.
  enum class dispatch {
    /// Put into its mailbox; CAF's scheduler runs it on one of its workers.
    scheduled,
    /// Run at once on the transport's data thread, as the frame is decoded,
    /// and its sends to other processes posted from there: no thread is
    /// woken on either side, which removes most of a round trip's latency.
    /// The actor's handlers must be short and must never block (the data
    /// thread stalls meanwhile). Messages from local actors still reach it
    /// through CAF's scheduler, and a flood is handed back to the scheduler
    /// after `inline_burst_max` messages.
    transport,
  };
  static constexpr size_t inline_burst_max = 64;

  /// Makes a local actor reachable from other processes under `name`.
  void publish(const std::string& name, const caf::actor& a,
               dispatch how = dispatch::scheduled);

  /// Handle to actor `name` in process `rank` (the local actor itself when
  /// rank is this process).
  caf::actor remote(uint32_t rank, const std::string& name);

  /// Tells `a` of every peer incarnation the transport fences, as
  /// (peer_down_atom, rank, incarnation, reason): the worker's failure
  /// detector. Replaces an earlier watcher.
  void watch_peers(caf::actor a);

  /// Epoch stamped on outgoing frames.
  void set_epoch(uint64_t epoch);

  uint32_t self() const;
  mesh_stats stats() const;

  struct core; // shared with the proxies, outlives the mesh while they live

private:
  std::shared_ptr<core> core_;
};

} // namespace cmesh
