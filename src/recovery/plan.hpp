// Recovery plans: where a returning replica group copies its shards from.
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
// Rotation. `rotation` shifts the start: the i-th pair copies from
// healthy[(rotation + i) % n], so a caller planning one joiner at a time
// (the epoch manager, passing a session counter) still spreads the copies
// and does not retry a failed session from the same source when another
// exists.
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
                                      std::span<const joiner_shards> joiners, uint32_t shard_count,
                                      uint64_t rotation = 0);

/// One joiner.
expected<recovery_plan> plan_recovery(std::span<const group_id> healthy, const joiner_shards& joiner,
                                      uint32_t shard_count, uint64_t rotation = 0);

} // namespace cmesh::recovery
