// Durable training on the command line: where the checkpoint shadow writes
// (--checkpoint-dir, --checkpoint-shared, --checkpoint-every, retention)
// and where a run resumes from (--resume DIR|latest). docs/design.md,
// Storage.
#pragma once

#include "actors/checkpoint.hpp"
#include "actors/trainer.hpp"
#include "core/job_config.hpp"
#include "storage/reader.hpp"

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

namespace cmesh::cli {

struct durable_flags {
  std::string dir;        // --checkpoint-dir: the local tier (turns the shadow on)
  std::string shared;     // --checkpoint-shared: the shared tier
  uint64_t every = 50;    // --checkpoint-every: steps between checkpoints
  double seconds = 0;     // --checkpoint-seconds: ... or this long since the last (0: off)
  size_t keep_last = 3;   // --checkpoint-keep
  uint64_t keep_every = 0; // --checkpoint-keep-every
  std::string resume;     // --resume: "", a directory, or "latest"
  bool checkpointer = false; // --checkpointer: a process of its own writes (actors/checkpointer.hpp)
  bool writes() const { return !dir.empty() || !shared.empty(); }
  std::chrono::milliseconds every_time() const {
    return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
  }
  /// The tiers, in order.
  std::vector<std::string> roots() const;
};

/// Where and when checkpoints are written, for the shard of `rank` of a
/// run of the model `net` at R x S = replicas x per_group; the step resumed
/// from is not written again.
actors::checkpoint_target target_of(const durable_flags& f, const config_list& config,
                                    model::model& net, uint32_t rank, size_t replicas,
                                    size_t per_group, uint64_t resumed_from);

/// This rank's shard of a checkpoint's state: elements [first, first +
/// weights.size()) of each array.
struct shard_state {
  uint64_t first = 0;
  std::vector<float> weights, adam_m, adam_v;
};

/// A checkpoint to resume from, opened and verified, and this rank's shard
/// of it, read in the verifying pass.
struct resume_point {
  std::shared_ptr<const storage::checkpoint> ckpt;
  std::shared_ptr<const shard_state> shard;
  std::string note; // newer checkpoints passed over, and why (empty: none)
};

/// Where --resume points: "latest" takes the newest valid checkpoint of the
/// tiers (none at all: nullopt, the run starts at step 0); a directory is a
/// step directory, or a root whose newest valid checkpoint is taken. Every
/// piece is verified and the configuration compared with `job` (all but
/// the layout: a checkpoint is read at any R x S); elements [first, first
/// + count) of each array, this rank's shard, are kept on the way. Errors:
/// corrupt, invalid_argument (another configuration, a directory with no
/// checkpoint, "latest" without a tier), unreachable.
expected<std::optional<resume_point>> find_resume(const durable_flags& f, const config_list& job,
                                                  uint64_t first, uint64_t count);

/// Puts a resume point's shard into the trainer's state (for
/// trainer_options::load), with the loss scale and the step.
/// invalid_argument when the trainer's shard is another range.
std::function<caf::error(actors::train_state&, size_t)> loader_of(const resume_point& r);

/// Chaos (corrupt@STEP): flips one byte of data (the middle of the middle
/// piece of shard-0.bin) of the newest checkpoint of the first tier, as a
/// bad disk would. Returns what it did, or why it did nothing.
std::string corrupt_newest_checkpoint(const durable_flags& f);

} // namespace cmesh::cli
