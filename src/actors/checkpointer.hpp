// The checkpointer process: the checkpoint shadows (actors/checkpoint.hpp)
// moved out of the workers, so that the state at the last committed step
// outlives the loss of every replica group.
//
// One process (`cmesh checkpointer`) holds one shadow actor per shard
// position of a group, S in all. The ranks of the writing group (the
// epoch's lowest) stream to it what an in-worker shadow is fed: a copy of
// their shard's state at a step boundary (a seed), then each committed
// update. The stream is actor messages over UCX (transport/mesh.hpp):
// wire::ckpt_seed and wire::ckpt_update carry the floats as bulk payloads
// beside a msgpack header, and the checkpointer answers each with a
// wire::ack once its shadow applied it.
//
// Links. The mesh of the job's workers has a fixed peer table, and the
// writing group changes with the epochs, so each (position, feeding rank)
// pair is a link of its own: a two-process transport and mesh, made when a
// rank becomes a writer. The checkpointer puts a fresh id of its own under
// "checkpointer/id" in the coordinator's store when it starts. The rank
// puts a link request (that id, a fresh link id and its UCP address) under
// "checkpointer/link/<position>"; the checkpointer, which polls those keys
// and ignores requests made to another checkpointer, makes its
// side, answers with its address under "checkpointer/accept/<position>/
// <link>", and drops the position's previous link. Both sides' transports
// watch each other with heartbeats: a rank whose link died asks for a new
// one while it writes; messages of a replaced link are dropped.
//
// Whole steps only. A checkpoint needs every shard at one step, and the
// S feeds are S processes: the checkpointer's collector actor passes a
// position's updates to its shadow only up to the step every position can
// reach (the least, over the positions, of where its shadow stands plus
// its queued updates), so the shadows move together and the newest whole
// step is always one they can all write. It writes every K steps or T
// seconds (the vote's agreed steps travel with the updates), at the run's
// last step, and, when it is stopped (SIGTERM, or the coordinator gone:
// the job ended or died), the step its shadows stand at: after every
// worker was killed, that is the last step they all committed and sent,
// which the restarted workers resume from.
//
// Bounds. A rank has at most `queue_max` messages unanswered; past that an
// update is dropped and the rank re-seeds at its next boundary, as with an
// in-worker shadow. The collector holds at most that many per position.
#pragma once

#include "actors/checkpoint.hpp"
#include "actors/trainer.hpp"
#include "transport/bootstrap.hpp"
#include "transport/transport.hpp"

#include <caf/all.hpp>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace cmesh::actors {

/// The store's keys of the link protocol (see above).
std::string checkpointer_link_key(uint32_t position);
std::string checkpointer_accept_key(uint32_t position, uint64_t link);
std::string checkpointer_id_key(); // the running checkpointer's id

struct checkpointer_feed_options {
  model::train_config train;
  host_port coordinator;
  uint32_t rank = 0;
  uint32_t ranks_per_group = 1;
  size_t queue_max = 8; // messages unanswered before an update is dropped
  bool check = false;   // send the trainer's state hash with every update
  uint64_t every = 0;   // the checkpoints' steps and time (for wants_checkpoint)
  std::chrono::milliseconds every_time{0};
  transport_options transport;
  std::chrono::milliseconds link_timeout{2000}; // for the checkpointer's id and answer
};

/// What a feed did.
struct checkpointer_feed_stats {
  bool linked = false;
  uint64_t links = 0;   // made
  uint64_t seeds = 0;   // sent
  uint64_t sent = 0;    // updates sent
  uint64_t dropped = 0; // updates dropped: too many unanswered, or no link
  uint64_t acked = 0;   // answers
  uint64_t refused = 0; // ... that said the checkpointer lost track (a re-seed follows)
};

struct checkpointer_link; // a link's transport, mesh and counters (checkpointer.cpp)

/// The trainer's side: a commit_listener that streams this rank's shard to
/// the checkpointer while its group writes. It never blocks the trainer: a
/// thread of its own makes the links.
class checkpointer_feed final : public commit_listener {
public:
  checkpointer_feed(caf::actor_system& sys, checkpointer_feed_options o);
  ~checkpointer_feed() override;
  checkpointer_feed(const checkpointer_feed&) = delete;
  checkpointer_feed& operator=(const checkpointer_feed&) = delete;

  void entered_epoch(std::span<const uint32_t> members, size_t ranks_per_group) override;
  void at_boundary(const train_state& st) override;
  bool wants_checkpoint(uint64_t k) override;
  void checkpoint_agreed(uint64_t k) override;
  void committed(uint64_t k, std::span<const float> update, const train_state& after) override;

  /// Waits until every message sent was answered (the last step reached
  /// the checkpointer's shadow before the rank exits), or this rank does
  /// not feed. Errors: timeout (also when none was answered for 5 s:
  /// updates held back for a position whose rank died never are),
  /// peer_lost.
  caf::error drain(std::chrono::milliseconds timeout);

  checkpointer_feed_stats stats() const;

private:
  std::shared_ptr<checkpointer_link> current() const;
  void run_links();

  caf::actor_system& sys_;
  checkpointer_feed_options o_;
  std::atomic<bool> writer_{false}; // this rank's group writes (set per epoch)
  std::atomic<bool> stopping_{false};
  mutable std::mutex mu_;
  std::shared_ptr<checkpointer_link> link_; // under mu_
  std::thread linker_;
  // The trainer's thread only:
  const checkpointer_link* bound_ = nullptr; // the link the stream below runs over
  bool tracking_ = false;
  uint64_t next_ = 0;
  uint64_t seeds_ = 0, sent_ = 0, dropped_ = 0;
  std::atomic<uint64_t> links_{0};
  checkpoint_clock clock_;
};

struct checkpointer_options {
  model::train_config train;
  /// Where and when to write; its `rank` is ignored (each shadow writes as
  /// its position of group 0).
  checkpoint_target target;
  host_port coordinator;
  transport_options transport;
};

struct checkpointer_state; // (checkpointer.cpp)

/// The process's side: the shadows, the collector and the links.
class checkpointer {
public:
  /// Connects to the coordinator's store and spawns the actors in `sys`,
  /// which must outlive it. Errors: unreachable.
  static expected<std::unique_ptr<checkpointer>> start(caf::actor_system& sys,
                                                       checkpointer_options o);
  ~checkpointer();

  /// One pass over the link requests: makes the links asked for. Errors:
  /// closed (the coordinator is gone).
  caf::error poll_links();

  /// Writes the newest whole step the shadows stand at, unless it was
  /// written (or is being written) already, and waits for every write.
  /// Returns that step (0: nothing was ever fed). Errors: timeout,
  /// unrecoverable (the positions stand at different steps: some rank's
  /// stream was cut, and no step is whole), aborted (a write failed).
  expected<uint64_t> flush(std::chrono::milliseconds timeout);

  /// Where each position's shadow stands.
  std::vector<expected<shadow_status>> status(std::chrono::milliseconds timeout);

  uint64_t links_made() const;

private:
  explicit checkpointer(std::unique_ptr<checkpointer_state> s);
  std::unique_ptr<checkpointer_state> s_;
};

} // namespace cmesh::actors
