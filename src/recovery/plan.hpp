// Recovery plans: where a returning replica group copies its shards from,
// and whether it can catch up by replay or needs a fresh snapshot.
//
// Pure functions of their arguments, deterministic: the same inputs give the
// same plan on any coordinator, whatever order the inputs came in.
//
// Sources (plan_recovery). Every (joiner, shard) pair, joiners in group
// order and each joiner's shards ascending, is given a source group
// round-robin over the healthy groups sorted by group id: the i-th pair
// copies from healthy[i % n]. For one joiner with all S shards, shard s
// copies from healthy[s % n]: the start rotates with the shard index, so the
// copy load is spread over every healthy group (at most ceil(pairs / n) per
// group), and with several joiners the rotation continues where the previous
// joiner's left off. In HSDP shard s of a source group lives on that
// group's rank s, so a source rank serves one shard per joiner.
//
// Catch-up window (decide_catch_up). A state "at step s" has applied the
// committed steps 0 .. s-1. A source keeps the committed reduced gradients of
// its last `window_steps` steps, so a joiner at step j behind the live step L
// can replay steps j .. L-1 when 0 <= L - j <= window_steps; further behind
// (or with no state, or a state that is not from this run's history) it
// takes a fresh snapshot from its source instead.
#pragma once

#include "core/error.hpp"
#include "recovery/member.hpp"

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace cmesh::recovery {

/// A returning group and the shards it needs; empty `shards` means all of
/// them (0 .. shard_count-1).
struct joiner_shards {
  group_id group = 0;
  std::vector<uint32_t> shards;
};

/// Joiner `joiner`'s shard `shard` is copied from group `source` (its rank
/// holding that shard).
struct shard_source {
  group_id joiner = 0;
  uint32_t shard = 0;
  group_id source = 0;

  bool operator==(const shard_source&) const = default;
};

struct recovery_plan {
  /// Sorted by (joiner, shard).
  std::vector<shard_source> sources;
  std::string reason;
};

/// The plan for `joiners` copying from `healthy` (any order; duplicates are
/// ignored). errc::invalid_argument when there is no healthy group, when
/// shard_count is 0, a shard is >= shard_count, a joiner appears twice or is
/// itself listed as healthy.
expected<recovery_plan> plan_recovery(std::span<const group_id> healthy,
                                      std::span<const joiner_shards> joiners, uint32_t shard_count);

/// One joiner.
expected<recovery_plan> plan_recovery(std::span<const group_id> healthy, const joiner_shards& joiner,
                                      uint32_t shard_count);

enum class catch_up_kind : uint8_t {
  replay,         // stream the committed reduced gradients of steps first_step .. first_step+steps-1
  fresh_snapshot, // copy a new snapshot from the source (taken at its next step boundary)
};

std::string_view to_string(catch_up_kind k);

struct catch_up_decision {
  catch_up_kind kind = catch_up_kind::replay;
  /// replay: the first step to replay (= joiner_step); fresh_snapshot: the
  /// live step it was decided at.
  int64_t first_step = 0;
  /// replay: how many steps to replay (0 when already at the live step).
  int64_t steps = 0;
  std::string reason;
};

/// Replay or fresh snapshot for a joiner at `joiner_step` (negative: it holds
/// no state) while the live groups are at `live_step`, with the last
/// `window_steps` steps' gradients kept. live_step and window_steps must be
/// >= 0 (checked).
catch_up_decision decide_catch_up(int64_t joiner_step, int64_t live_step, int64_t window_steps);

} // namespace cmesh::recovery
