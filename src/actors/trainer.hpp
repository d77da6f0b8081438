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
// Layout: R replica groups x S ranks (HSDP). Global rank r is position
// r % S of group r / S; an epoch's members are whole groups. The flat
// parameter buffer is split into S shards (in whole blocks of
// norm_block elements); position p owns shard p: its fp32 master values and
// its AdamW moments, and nothing else of the optimizer. Each step:
//   all_gather the shards over the group (the full weights for compute)
//   -> forward/backward on this rank's micro-batches (the global batch
//   split over all R x S ranks) -> reduce_scatter the gradient over the
//   group -> all_reduce each shard over the groups (the `cross`
//   communicator of the ranks holding it) -> clip by the global norm
//   (per-block sums of squares, added in one fixed order whatever the
//   layout) -> commit vote over everyone -> AdamW on the shard.
// The committed updates kept for replay, the catch-up snapshot and its
// stream are this rank's shard only: a restarted rank at position p
// catches up from a member at position p. S = 1 is pure data parallelism.
// Replica verification (train.verify_every = N, 0: off): at step 0 and
// every N-th step each rank hashes its shard of the state (fp32 master,
// AdamW moments, loss scale) and the hashes ride on the commit vote. Where
// the groups holding a shard disagree (recovery::compare_replicas) the
// step is not committed: per-tensor hashes name what differs, one member
// reports it to the coordinator, which fences the minority (it restarts
// and catches up from the majority) or, with no majority, ends the job.
// Precision bf16: the master weights and AdamW state stay fp32; the working
// weights are the master rounded to bf16 (gathered over the group as bf16),
// the loss is multiplied by a dynamic loss scale, gradients travel and are
// summed as bf16, and a step whose gradient overflowed anywhere (agreed in
// the commit vote) is skipped by every rank and backs the scale off.
// Activations follow model.activations (see model/moe_lm.hpp).
// On a device (train.device = "cuda") with a supervision that has device
// collectives: the model keeps its weights and gradient in device memory
// and the step's bulk collectives run there (NCCL; in fp32, in bf16 runs
// too): this rank's shard of the weights is uploaded and gathered over the
// group in place; the gradient is reduce_scattered over the group in
// place, then the shard all_reduced over its holders (S = 1: the whole
// gradient all_reduced), and only this rank's shard of the sum is
// downloaded. Clipping, the vote and AdamW stay on the host. Exact mode and
// train.gradient_collectives = "host" run as on the CPU.
// Experts (S > 1): for each micro-batch and layer the
// group places the experts on its ranks from the rows every rank routed
// (train.expert_placement: "balanced" runs the placement solver, with
// train.expert_replicas extra copies of hot experts; "static" gives rank p
// the p-th block of E/S), and the hosts compute their experts over the rows
// every rank of the group sends them (all_to_allv over the group). The
// weights come from the group's gather either way, so a placement can
// change from one micro-batch to the next at no cost; their state is
// sharded like the rest. In exact mode the hosts compute each source
// rank's rows as products of their own, and the weight gradient of another
// rank's rows reaches the fixed-point sum as a piece of that rank's
// micro-batch (coll::exact_piece), so the bits do not depend on the layout.
// Resident experts (train.experts = "resident", actors/resident.hpp): each
// expert lives only on its host position (the static blocks), so a
// position's state is its piece of the dense tensors (packed, without the
// experts) followed by its experts; the dense pieces are gathered and
// reduce-scattered packed, the experts' gradient is complete on the host,
// and the state is summed over the groups as before.
#pragma once

#include "collectives/communicator.hpp"
#include "model/config.hpp"
#include "model/data.hpp"
#include "model/model.hpp"
#include "transport/messages.hpp"

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
  double host_imbalance = 0;    // experts split over a group: max rank load / mean (0: not split)
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
  double verify_ms = 0;         // spent hashing and comparing replicas (this rank)
  uint64_t state_hash = 0;      // hash_state of this rank's final state (shard)
  bool stopped = false;         // ended before the last step: a stop was asked for
  /// Bytes this rank holds for the experts at the end: the resident pages
  /// of the model's weights and gradient inside expert tensors, and the
  /// expert elements of its state arrays (master when a copy, AdamW
  /// moments, reduced gradient, replay window).
  size_t expert_bytes = 0;
};

/// A rank's training state "at step s": the weights and AdamW moments after
/// the committed steps 0 .. s-1.
struct train_state {
  uint64_t step = 0;
  std::span<float> params, adam_m, adam_v; // this rank's shard of each (fp32 master)
  std::span<float> scalars;                // the dynamic loss scale and its good-step count
};

/// The committed update of a step that dynamic loss scaling skipped (a
/// non-finite gradient anywhere): every element NaN. Applying it moves only
/// the loss scale.
bool is_skipped_update(std::span<const float> update);

/// Shard boundaries of a flat buffer of n elements over s ranks: whole
/// blocks of `block` elements, as even as they go, the remainder of the
/// buffer in the last shard. counts[i] elements from offsets[i].
struct shard_split {
  std::vector<size_t> offsets, counts;
};
shard_split split_shards(size_t n, size_t s, size_t block);

/// Elements per block of the clipping norm: every layout adds the same
/// per-block sums of squares in the same order.
constexpr size_t norm_block = 4096;

/// Applies the committed update of step `k` (the final, averaged and clipped
/// gradient) to a state at step k, leaving it at k + 1. Bit-exact: the same
/// state and update give the same result on every rank.
using apply_update = std::function<void(uint64_t k, std::span<const float> update)>;

/// What the trainer needs from supervision (actors/supervisor.hpp implements it
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

  /// A communicator of part of the current epoch's members, built at once
  /// by every member over the epoch's communicator (each with its own
  /// part): slot 0 is this rank's replica group, slot 1 the ranks holding
  /// its shard in every group. Aborted with the epoch; valid until the
  /// next enter_epoch.
  virtual expected<coll::communicator*> sub_communicator(size_t slot, coll::membership part) = 0;

  /// Whether device_communicator() can work: the ranks compute on a device
  /// whose memory a communicator reaches (NCCL on GPUs).
  virtual bool has_device_collectives() const { return false; }

  /// A communicator of part of the current epoch's members over device
  /// memory (every pointer passed to it is the model's device memory),
  /// built at once by every member, each with its own part, slots as for
  /// sub_communicator: 0 this rank's replica group, 1 the ranks holding its
  /// shard in every group (every member when groups are of one rank).
  /// Aborted with the epoch; valid until the next enter_epoch.
  /// invalid_argument without device collectives.
  virtual expected<coll::communicator*> device_communicator(size_t slot, coll::membership part) {
    (void)slot;
    (void)part;
    return make_error(errc::invalid_argument, "no device collectives");
  }

  /// The trainer enters (true) or leaves (false) its local computation of a
  /// step: a step watchdog times it (collectives wait on others; compute
  /// that does not end is a hang of this rank).
  virtual void computing(bool) {}

  /// Aborts the current epoch's communicators on this rank (its peers are
  /// told by the coordinator): what a transport error does to them.
  virtual void abort_epoch(const caf::error& why) = 0;

  /// The replica groups' states differ (replica verification): tells the
  /// coordinator, which fences the minority or ends the job. Called by one
  /// member of the epoch; the trainer then waits for the next epoch.
  virtual void report_divergence(const wire::replica_divergence& d) { (void)d; }
};

/// Chaos support: makes the trainer's next computation hang for good (a
/// stuck kernel), so the step watchdog can be tested. Async-signal-safe.
void request_hang();

/// The hash replica verification compares: a rank's state at a step (its
/// shard of the fp32 master and both AdamW moments, then the loss scale's
/// scalars). XXH3, 64 bits: a check against faults, not adversaries.
uint64_t hash_state(std::span<const float> params, std::span<const float> adam_m,
                    std::span<const float> adam_v, std::span<const float> scalars);

/// Asks the trainer to stop (SIGTERM: a scheduler's preemption, Ctrl-C
/// under cmesh launch): the request rides on the next commit vote, so every
/// member stops after the same step, which is checkpointed (the listener
/// is told checkpoint_agreed), and run() returns with `stopped`.
/// Async-signal-safe.
void request_stop();
bool stop_was_requested();

/// Chaos support: flips one bit of this rank's weights (its fp32 master
/// shard) at the next step boundary, as silent data corruption would, so
/// replica verification can be tested. Async-signal-safe.
void request_flip();

/// Chaos support: makes the collectives of the trainer's next step attempt
/// fail on this rank, as on a transport error, while every process lives
/// on; each call fails one more attempt. Async-signal-safe.
void request_fault();

/// Chaos: the trainer actor dies with an error (throws) at its next step
/// boundary, as a bug would make it; the worker's supervisor actor, which
/// monitors it, reports the rank failed. Async-signal-safe.
void request_crash();

/// Sees this rank's committed steps, on the trainer's thread (the
/// checkpoint shadow's feed: actors/checkpoint.hpp). Must not block.
class commit_listener {
public:
  virtual ~commit_listener() = default;
  /// The trainer entered an epoch of these members (global ranks, sorted),
  /// in groups of `ranks_per_group`; before the epoch's first boundary.
  virtual void entered_epoch(std::span<const uint32_t> members, size_t ranks_per_group) {
    (void)members;
    (void)ranks_per_group;
  }
  /// At each step boundary, the state at st.step.
  virtual void at_boundary(const train_state& st) = 0; // and once after the last step
  /// Whether this rank wants a checkpoint of the state after step `k` (a
  /// time-based one): asked before k's commit vote, which carries it; if
  /// any member wants one, every member is told checkpoint_agreed(k) just
  /// before committed(k), so all of them checkpoint the same step.
  virtual bool wants_checkpoint(uint64_t k) {
    (void)k;
    return false;
  }
  virtual void checkpoint_agreed(uint64_t k) { (void)k; }
  /// Step k committed here with `update`, leaving the state `after` (at
  /// step k + 1). Steps applied by reconciliation or catch-up are not
  /// announced: a listener that sees a gap takes the state at a boundary.
  virtual void committed(uint64_t k, std::span<const float> update, const train_state& after) = 0;
};

struct trainer_options {
  model::run_config config;
  size_t replicas = 1;
  size_t ranks_per_group = 1;
  std::function<void(const step_report&)> on_step; // called on every commit
  /// Committed updates kept for members that fall behind (reconciliation at
  /// an epoch's start): a member more than this many steps behind is fenced.
  size_t replay_window = 4;
  commit_listener* listener = nullptr; // not owned; outlives run()
  /// Resume: fills this rank's shard of the state before the first epoch
  /// (`first`: the shard's first element in the flat parameter buffer) and
  /// sets st.step; the run then goes on from there. Its error ends run().
  std::function<caf::error(train_state& st, size_t first)> load;
};

/// The step loop. Without a supervision: over one fixed communicator of
/// every rank, one rank per replica group.
class trainer {
public:
  trainer(trainer_options opts, std::unique_ptr<model::model> m,
          std::shared_ptr<const model::corpus> data, coll::communicator& comm);
  /// Elastic: the communicator of each epoch comes from `sup`; `rank` is
  /// this process's global rank (its position in its group is rank % S).
  trainer(trainer_options opts, std::unique_ptr<model::model> m,
          std::shared_ptr<const model::corpus> data, supervision& sup, uint32_t rank);
  ~trainer();

  /// Runs until config.train.steps committed steps. Errors: from the
  /// collectives (peer_lost, timeout, ...), overflow in exact mode.
  expected<train_result> run();

  model::model& net() { return *model_; }

private:
  struct impl;
  struct loop; // one run of the step loop
  std::unique_ptr<impl> impl_;
  std::unique_ptr<model::model> model_;
};

} // namespace cmesh::actors
