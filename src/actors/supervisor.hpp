// The worker's supervisor: between a rank's trainer and the coordinator.
//
// An event-based CAF actor (supervisor_actor, in the worker's actor system)
// owns all of its state; nothing else touches it. Coordinator pushes
// (epoch_notice, catchup_assign) arrive as messages from the client's I/O
// thread; the beacon and the step watchdog are a timer of its own; a lost
// coordinator is reconnected by a helper that reports back by message. The
// `supervisor` class is the trainer's side of it: every call is a message
// to the actor (a request where the trainer needs the answer), and the
// blocking work (building a communicator, receiving a catch-up) runs on the
// trainer's thread between messages. Communicator threads read a published
// immutable view of the actor's state (who was lost, the newest epoch).
//
// The actor:
//   - beacons the rank's status to the coordinator (worker_status, every
//     beacon interval and on each change: the coordinator's heartbeat);
//   - aborts the running communicators the moment an epoch arrives that
//     leaves out one of their members (nobody waits for a library timeout);
//   - answers the trainer's enter_epoch with what comes next: the epoch to
//     build (its members; a rank left out of an epoch it belonged to is
//     fenced, errc::fenced, and must restart as a new incarnation), a
//     catch-up to receive, a snapshot owed to a joiner, or an error;
//   - as a catch-up source: spawns a helper actor per joiner that prepares
//     snapshot buffers, waits for the joiner's request, is handed a copy of the state at
//     the next step boundary (a memcpy on the trainer's thread), sends it,
//     and streams every committed update the supervisor forwards, until the
//     supervisor ends the stream (the epoch that includes the joiner).
//     Training does not wait for any of this. The stream is bounded: a
//     joiner that falls stream_max steps behind is cut off and asks again.
//   - as a joiner: the trainer's thread receives the snapshot and the
//     stream, reports `ready` (the coordinator admits it to the next epoch),
//     and enters that epoch when the stream ends;
//   - monitors the worker's other local actors (watch): one that dies with
//     an error is reported to the coordinator and the process ends
//     (exit_actor_failed), so that the survivors go on and the launcher
//     restarts the rank.
//
// Catch-up sessions are actor conversations over the worker's actor mesh
// (transport/mesh.hpp): the joiner's request goes to the source's
// supervisor, which hands it to the session's helper; the snapshot's
// pieces and the committed updates go from the helper to the joiner as
// messages with bulk payloads (UCX transfers beside a msgpack header), and
// the joiner acknowledges each, which bounds what is in flight. A fenced
// peer ends the session at once (both sides monitor the other's proxy).
#pragma once

#include "actors/trainer.hpp"
#include "collectives/host/host_communicator.hpp"
#include "transport/bootstrap.hpp"
#include "transport/transport.hpp"

#include <caf/fwd.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

namespace cmesh {
class mesh;
} // namespace cmesh

namespace cmesh::actors {

struct supervisor_options {
  uint32_t rank = 0;
  uint64_t incarnation = 0;
  std::chrono::milliseconds beacon_interval{100};
  /// How long enter_epoch waits for an epoch (or a catch-up) before timeout.
  std::chrono::milliseconds epoch_wait{120000};
  /// Committed updates queued for one joiner before its stream is cut.
  size_t stream_max = 64;
  coll::host_options host;
  /// Step watchdog: a computation of one step longer than this is a hang
  /// of this rank; the supervisor reports it and ends the process (exit_hung) so
  /// that the survivors go on and the launcher restarts it. 0: off.
  std::chrono::milliseconds step_timeout{0};
  /// Bytes of one piece of a catch-up snapshot (one actor message), and
  /// the pieces the joiner has not acknowledged yet that a source may send
  /// (what the joiner holds in flight: 16 MiB). 1-8 MiB pieces and windows
  /// of 2-8 moved 26.8 MB at the same rate (docs/design.md, Catch-up).
  size_t catchup_chunk_bytes = size_t{4} << 20;
  size_t catchup_window = 4;
  /// Nice value added to the threads that serve and receive a catch-up
  /// (0: none): on a host shared with training ranks, the catch-up takes
  /// the cores they leave idle rather than slowing their steps.
  int catchup_nice = 0;
  /// Where the coordinator is and how this worker registered: when the
  /// connection is lost, the supervisor reconnects and registers again (a
  /// restarted coordinator rebuilds its state from the workers). Unset: no
  /// reconnecting.
  std::optional<host_port> coordinator;
  wire::register_worker registration;
  /// The trainer's collectives over device memory
  /// (supervision::device_communicator): none; host (the device is
  /// emulated in host memory, so a host communicator serves); nccl (an NCCL
  /// communicator on CUDA device `device`).
  enum class device_kind { none, host, nccl };
  device_kind device_collectives = device_kind::none;
  int device = -1; // nccl: the CUDA device ordinal (-1: NCCL's default choice)
  /// The worker's transport (the actor mesh's), or none. The supervisor
  /// makes it follow the membership: it dials the members of each newer
  /// epoch and its catch-up partner at the incarnations the coordinator
  /// named, with the addresses of the latest peer table, and nobody else.
  transport* net = nullptr;
  /// The worker's actor mesh over `net`: the supervisor is published on it
  /// as "supervisor", and catch-up sessions run over it. None: this rank
  /// can neither serve nor receive a catch-up.
  cmesh::mesh* actor_mesh = nullptr;
};

/// Exit code of a worker that its step watchdog found hung.
constexpr int exit_hung = 5;
/// Exit code of a worker one of whose local actors (watch) died.
constexpr int exit_actor_failed = 6;

class supervisor final : public supervision {
public:
  /// Takes over the worker's coordinator connection; the actor lives in
  /// `sys`, which must outlive this object.
  supervisor(caf::actor_system& sys, supervisor_options o, coordinator_client client,
             std::shared_ptr<coll::host_context> ctx);
  ~supervisor() override;

  /// Installs the control handler and starts beaconing.
  void start();
  /// Stops beaconing and every catch-up session, and aborts what the
  /// trainer waits on; idempotent. Callable from any thread.
  void stop();

  /// Supervises a local actor of this worker. If it dies with an error
  /// and `restart` is given (the actor can be restarted safely), that is
  /// called on the supervisor's thread (it must not block) and the rank
  /// goes on; otherwise the rank is reported failed and the process ends
  /// (exit_actor_failed). A normal exit or a shutdown is no failure.
  void watch(const caf::actor& a, std::string what,
             std::function<void(const caf::error&)> restart = {});

  /// The supervisor actor (for tests and for the worker's other actors).
  const caf::actor& actor() const;

  /// The trainer has finished at `step`: beacons say so until stop(), and
  /// `done` is reported (again to a coordinator that restarts meanwhile).
  void finished(uint64_t step, const wire::report& done);

  /// The current connection to the coordinator (it changes when the supervisor
  /// reconnects to a restarted coordinator).
  std::shared_ptr<coordinator_client> client() const;

  expected<coll::communicator*> enter_epoch(uint64_t after, const caf::error& why,
                                            train_state& state, const apply_update& apply) override;
  uint64_t newest_epoch() const override;
  void at_boundary(const train_state& state) override;
  void committed(uint64_t k, std::span<const float> update) override;
  void computing(bool on) override;
  void abort_epoch(const caf::error& why) override;
  void report_divergence(const wire::replica_divergence& d) override;
  expected<coll::communicator*> sub_communicator(size_t slot, coll::membership part) override;
  bool has_device_collectives() const override;
  expected<coll::communicator*> device_communicator(size_t slot, coll::membership part) override;

  struct impl;

private:
  std::unique_ptr<impl> impl_;
};

} // namespace cmesh::actors
