// The checkpoint actor's shadow: a copy of one shard's training state that
// follows the trainer by applying the committed updates it is sent, with
// the same optimizer (actors/optimizer.hpp), on the actor system's thread
// rather than the trainer's. So a copy at the last committed step exists
// without pausing training: what storage will write from (writing, tiers
// and resume are planned; see docs/design.md).
//
// The trainer feeds it through a `commit_listener` (shadow_feed): at each
// step boundary the feed seeds the shadow with a copy of the state when the
// shadow has none, or lost track (a reconciliation replayed updates the
// trainer did not announce, or the queue was full), and after each commit
// it sends the shard's update, a copy, as a CAF message. The trainer never
// waits: at most `queue_max` messages are in flight, and past that an
// update is dropped and the shadow re-seeded at the next boundary (a
// memcpy of the state on the trainer's thread).
//
// Exactness: the optimizer is bit-exact, so the shadow's state equals the
// trainer's after every step it applied. `check` sends the trainer's state
// hash with each update for the shadow to compare after applying it (a
// hash of the state per step on both sides: for tests and audits).
//
// Writing (a checkpoint_target): when the shadow reaches a step that is a
// multiple of `every`, or the run's last step, or one the commit vote
// agreed on because `every_time` passed on some rank since the last
// checkpoint (time differs between ranks; the vote makes the group's
// ranks pick the same step: commit_listener::wants_checkpoint), it copies its state and
// hands the copy to a disk actor of its own (a detached CAF actor: its
// blocking I/O takes no scheduler thread), which writes it through the
// tiers in order, each on its own: the local directory, then the shared one. One replica
// group writes each checkpoint, the lowest of the epoch's members: each of
// its S ranks writes its shard (storage's part protocol), and position 0
// adopts the others' parts, commits the manifest and applies retention. A
// checkpoint due while a write still runs waits for it (one copy waits; a
// newer one replaces it, and the older is counted as skipped), so the
// newest due, the run's last above all, is always written. A failed write
// (a full disk, a read-only directory, a part that never came) is logged
// and counted; training goes on and the previous checkpoints stay.
#pragma once

#include "actors/trainer.hpp"
#include "model/config.hpp"
#include "storage/manifest.hpp"
#include "transport/bulk.hpp"

#include <caf/all.hpp>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

CAF_ALLOW_UNSAFE_MESSAGE_TYPE(cmesh::bulk)

namespace cmesh::actors {

/// What a shadow holds and has done.
struct shadow_status {
  uint64_t step = 0;       // its state is at this step (committed steps 0 .. step-1)
  uint64_t state_hash = 0; // hash_state of its copy
  bool seeded = false;
  uint64_t applied = 0;    // updates applied
  uint64_t seeds = 0;      // copies of the trainer's state taken
  uint64_t checked = 0;    // updates whose result was compared with the trainer's
  uint64_t mismatches = 0; // ... and differed
  uint64_t written = 0;    // checkpoints (this rank's shard of them) written, every tier
  uint64_t write_failures = 0; // checkpoints some tier of which failed
  uint64_t write_skipped = 0; // replaced, while waiting for a write, by a newer one
  uint64_t last_written = 0;  // the step of the newest one written
  bool writing = false;       // a write is in flight or waiting
};

/// Where and when a shadow writes (see above).
struct checkpoint_target {
  std::vector<std::string> roots; // the tiers, in order: local, then shared
  uint64_t every = 0;             // steps between checkpoints (0: the last step only)
  std::chrono::milliseconds every_time{0}; // ... or this long since the last (0: off)
  size_t keep_last = 3;           // retention (storage/retention.hpp)
  uint64_t keep_every = 0;
  std::chrono::milliseconds assemble_timeout{60000}; // position 0 waits this long for parts
  uint32_t rank = 0;
  uint32_t replicas = 1;
  uint32_t ranks_per_group = 1;
  uint64_t elements = 0;                 // of the flat state (each of its three arrays)
  std::vector<storage::tensor_entry> tensors; // the model's, in the flat state
  config_list config;                    // the job's (model::canonical_config)
  uint64_t resumed_from = 0;             // the step resumed from: not written again
  /// Write only when told (shadow_flush_atom): the checkpointer's
  /// collector decides, since only it knows when every shard is at a step.
  bool when_told = false;
};

struct shadow_options {
  model::train_config train;
  size_t queue_max = 8; // messages in flight before an update is dropped
  bool check = false;   // compare with the trainer's state after every update
  std::optional<checkpoint_target> target; // none: the shadow writes nothing
  /// Hands each shadow actor the feed spawns to the worker's supervision,
  /// with what to call if it dies with an error (the feed then restarts it
  /// at the next step boundary). None: unsupervised.
  std::function<void(const caf::actor& shadow, std::function<void()> died)> supervise;
};

/// Chaos: the shadow actor dies with an error (throws) at the next update
/// it applies. Async-signal-safe.
void request_shadow_crash();

/// When a feed wants a time-based checkpoint (commit_listener's
/// wants_checkpoint and checkpoint_agreed): `every_time` since the last
/// checkpoint of any kind, every K steps' included.
struct checkpoint_clock {
  uint64_t every = 0;
  std::chrono::milliseconds every_time{0};
  uint64_t agreed_step = 0; // a checkpoint of the state at this step was agreed
  std::chrono::steady_clock::time_point last_due = std::chrono::steady_clock::now();

  bool wants(uint64_t k);
  void agreed(uint64_t k);
};

/// Writes one shard's part of the checkpoint of `step` into `root`
/// (position 0 of the group also adopts the other parts and commits), then
/// applies retention there. Blocking; what the disk actor runs per tier.
caf::error write_shard_checkpoint(const checkpoint_target& t, const std::string& root,
                                  uint64_t step, std::span<const float> params,
                                  std::span<const float> adam_m, std::span<const float> adam_v,
                                  std::span<const float> scalars);

/// The shadow actor alone, as shadow_feed and the checkpointer process
/// (actors/checkpointer.hpp) run it. Its messages:
/// - (shadow_seed_atom, step, params, adam_m, adam_v, scalars, agreed): the
///   state at a step boundary (vectors moved in);
/// - (shadow_commit_atom, k, update, expect, agreed): step k's committed
///   update (a std::vector<float>, or a cmesh::bulk of floats: applied from
///   the buffer it came in), applied when the shadow is at k (else it is
///   dropped and the shadow is unseeded); `expect` as in
///   shadow_options::check;
/// - (shadow_flush_atom): write the state it is at now, unless a
///   checkpoint of that step was already due (a stop's last checkpoint);
/// - status: see shadow_status_of.
/// A request with either of the first three is answered once it is handled.
using shadow_seed_atom = caf::atom_constant<caf::atom("seed")>;
using shadow_commit_atom = caf::atom_constant<caf::atom("commit")>;
using shadow_flush_atom = caf::atom_constant<caf::atom("flush")>;
caf::actor spawn_shadow(caf::actor_system& sys, model::train_config train,
                        std::optional<checkpoint_target> target);

/// Asks a shadow actor where it stands, once the messages sent before were
/// handled. Errors: timeout.
expected<shadow_status> shadow_status_of(caf::actor_system& sys, const caf::actor& shadow,
                                         std::chrono::milliseconds timeout);

struct feed_link; // what a feed and its shadow share (checkpoint.cpp)

/// The trainer's side: a commit_listener that feeds a shadow actor. When
/// the shadow writes (a target) and does not check, only the ranks of the
/// writing group feed theirs: another group's shadow would only repeat the
/// work, and one that becomes the writer is seeded at its next boundary.
class shadow_feed final : public commit_listener {
public:
  /// Spawns the shadow actor in `sys`, which must outlive the feed.
  shadow_feed(caf::actor_system& sys, shadow_options o);
  ~shadow_feed() override;
  shadow_feed(const shadow_feed&) = delete;
  shadow_feed& operator=(const shadow_feed&) = delete;

  void entered_epoch(std::span<const uint32_t> members, size_t ranks_per_group) override;
  void at_boundary(const train_state& st) override;
  bool wants_checkpoint(uint64_t k) override;
  void checkpoint_agreed(uint64_t k) override;
  void committed(uint64_t k, std::span<const float> update, const train_state& after) override;

  /// Asks the shadow where it stands, once the messages sent before were
  /// handled. Errors: timeout.
  expected<shadow_status> status(std::chrono::milliseconds timeout);

  /// Waits until the shadow is at `step` or beyond (or is not fed: another
  /// group writes) with no write in flight (the run's last checkpoint is on
  /// disk before the worker exits).
  /// Errors: timeout.
  expected<shadow_status> drain(uint64_t step, std::chrono::milliseconds timeout);

  /// Updates dropped because the shadow was behind by queue_max messages.
  uint64_t dropped() const { return dropped_; }
  /// Shadow actors restarted after one died.
  uint64_t restarts() const { return restarts_; }

private:
  void spawn_shadow_actor();
  void restart_if_down(uint64_t step);
  caf::actor_system& sys_;
  shadow_options o_;
  caf::actor shadow_;
  std::shared_ptr<feed_link> link_;
  bool tracking_ = false;  // the shadow follows: the next update it expects is next_
  uint64_t next_ = 0;
  uint64_t dropped_ = 0;
  uint64_t restarts_ = 0;
  bool writer_ = true; // this rank's group writes the checkpoints (the epoch's lowest)
  checkpoint_clock clock_;
  bool active() const { return !o_.target || o_.check || writer_; }
};

} // namespace cmesh::actors
