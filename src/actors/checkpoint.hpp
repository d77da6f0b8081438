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
#pragma once

#include "actors/trainer.hpp"
#include "model/config.hpp"

#include <caf/all.hpp>

#include <atomic>
#include <chrono>
#include <memory>

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
};

struct shadow_options {
  model::train_config train;
  size_t queue_max = 8; // messages in flight before an update is dropped
  bool check = false;   // compare with the trainer's state after every update
};

/// The trainer's side: a commit_listener that feeds a shadow actor.
class shadow_feed final : public commit_listener {
public:
  /// Spawns the shadow actor in `sys`, which must outlive the feed.
  shadow_feed(caf::actor_system& sys, shadow_options o);
  ~shadow_feed() override;
  shadow_feed(const shadow_feed&) = delete;
  shadow_feed& operator=(const shadow_feed&) = delete;

  void at_boundary(const train_state& st) override;
  void committed(uint64_t k, std::span<const float> update, const train_state& after) override;

  /// Asks the shadow where it stands, once the messages sent before were
  /// handled. Errors: timeout.
  expected<shadow_status> status(std::chrono::milliseconds timeout);

  /// Updates dropped because the shadow was behind by queue_max messages.
  uint64_t dropped() const { return dropped_; }

private:
  caf::actor_system& sys_;
  shadow_options o_;
  caf::actor shadow_;
  std::shared_ptr<std::atomic<int64_t>> in_flight_;
  bool tracking_ = false;  // the shadow follows: the next update it expects is next_
  uint64_t next_ = 0;
  uint64_t dropped_ = 0;
};

} // namespace cmesh::actors
