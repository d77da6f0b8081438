// The trainer: one per rank, the step loop of HSDP training.
//
//   load this rank's micro-batches of the step (a pure function of seed,
//   step and the epoch's membership) -> forward/backward -> reduce the
//   gradients over the replica groups (exact mode: 64-bit fixed point, so
//   the sum is the same whatever the layout) -> commit vote -> optimizer.
//
// The commit vote: after the gradient reduction every rank votes; the step
// commits only if every rank of every live group voted yes (an all_reduce of
// the votes). Errors are latched: once a collective of a step failed, the
// step's later collectives are skipped and the vote is no. The step counter
// moves only on commit, and the optimizer runs only on commit, so a failed
// step is retried whole.
//
// Elastic runs (with a `supervision`): a failed step is retried whole in the
// next epoch by the survivors, the global batch split over them, so its
// samples are consumed exactly once. The vote also carries the newest epoch
// each rank has heard of; its maximum is the same on every member, so all
// switch to a grown epoch after the same step. At every epoch's start the
// members reconcile: they exchange their steps, and a member behind (a
// commit vote that completed on some ranks only, or a joiner whose stream
// lagged) gets the missing committed updates from the most advanced member,
// which keeps the last replay_window of them.
//
// Layout so far: R replica groups of one rank each (pure data parallel, all
// experts on every rank); sharding inside a group builds on the same loop.
#pragma once

#include "collectives/communicator.hpp"
#include "model/config.hpp"
#include "model/data.hpp"
#include "model/model.hpp"

#include <functional>
#include <memory>
#include <span>

namespace cmesh::actors {

struct step_report {
  uint64_t step = 0;            // the step that committed
  double loss = 0;              // mean over the global batch
  double aux_loss = 0;
  double tokens_per_s = 0;
  double step_ms = 0;
  double comm_ms = 0;           // waiting on collectives
  double expert_imbalance = 1;  // max expert load / mean, worst layer
  uint64_t dropped = 0;
  bool skipped = false;         // dynamic loss scaling skipped the update
  uint64_t epoch = 0;           // the epoch it committed in
  bool first_member = true;     // this rank is the epoch's first member (it prints)
};

struct train_result {
  uint64_t steps = 0;
  double final_loss = 0;
  double seconds = 0;
  double tokens_per_s = 0;
  uint64_t weights_xxh64 = 0;   // of the final fp32 weights, to compare runs
};

/// A rank's training state "at step s": the weights and AdamW moments after
/// the committed steps 0 .. s-1.
struct train_state {
  uint64_t step = 0;
  std::span<float> params, adam_m, adam_v;
};

/// Applies the committed update of step `k` (the final, averaged and clipped
/// gradient) to a state at step k, leaving it at k + 1. Bit-exact: the same
/// state and update give the same result on every rank.
using apply_update = std::function<void(uint64_t k, std::span<const float> update)>;

/// What the trainer needs from supervision (actors/agent.hpp implements it
/// over the coordinator). Without one, the trainer runs on one fixed
/// communicator and any failure ends the run.
class supervision {
public:
  virtual ~supervision() = default;

  /// Blocks until this rank is a member of an epoch newer than `after`, and
  /// returns that epoch's communicator (valid until the next call). `why` is
  /// the failure that ended the last epoch (none for the first epoch or an
  /// agreed switch). A restarted rank first receives its state here (a
  /// snapshot into `state`, then committed updates through `apply`).
  /// Errors: fenced (left out of the epoch), unrecoverable, timeout.
  virtual expected<coll::communicator*> enter_epoch(uint64_t after, const caf::error& why,
                                                    train_state& state,
                                                    const apply_update& apply) = 0;

  /// The newest epoch pushed to this rank (0: none). Voted with every step,
  /// so that all members switch to it after the same step.
  virtual uint64_t newest_epoch() const = 0;

  /// At each step boundary (state at `state.step`), on the trainer's thread:
  /// a catch-up source copies the snapshot it owes here.
  virtual void at_boundary(const train_state& state) = 0;

  /// After the commit of step `k`, with the update that was applied.
  virtual void committed(uint64_t k, std::span<const float> update) = 0;

  /// The trainer enters (true) or leaves (false) its local computation of a
  /// step: a step watchdog times it (collectives wait on others; compute
  /// that does not end is a hang of this rank).
  virtual void computing(bool) {}
};

/// Chaos support: makes the trainer's next computation hang for good (a
/// stuck kernel), so the step watchdog can be tested. Async-signal-safe.
void request_hang();

struct trainer_options {
  model::run_config config;
  size_t replicas = 1;
  size_t ranks_per_group = 1;
  std::function<void(const step_report&)> on_step; // called on every commit
  /// Committed updates kept for members that fall behind (reconciliation at
  /// an epoch's start): a member more than this many steps behind is fenced.
  size_t replay_window = 64;
};

/// The step loop over a communicator of every rank (one per replica group).
class trainer {
public:
  trainer(trainer_options opts, std::unique_ptr<model::model> m,
          std::shared_ptr<const model::corpus> data, coll::communicator& comm);
  /// Elastic: the communicator of each epoch comes from `sup`.
  trainer(trainer_options opts, std::unique_ptr<model::model> m,
          std::shared_ptr<const model::corpus> data, supervision& sup);
  ~trainer();

  /// Runs until config.train.steps committed steps. Errors: from the
  /// collectives (peer_lost, timeout, ...), overflow in exact mode.
  expected<train_result> run();

  model::model& net() { return *model_; }

private:
  struct impl;
  std::unique_ptr<impl> impl_;
  std::unique_ptr<model::model> model_;
};

} // namespace cmesh::actors
