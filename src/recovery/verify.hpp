// Replica verification: do the replica groups still hold the same state?
//
// Replicas apply the same committed updates to the same initial state, so
// the ranks holding one shard in different groups must hold it bit for bit
// (docs/design.md says in which modes, and why). Every `verify_every`
// committed steps each rank hashes its shard of the weights and of the
// optimizer state; the hashes ride on the commit vote, and every member
// runs compare_replicas on the same table, so all reach the same verdict
// without another message.
//
// The verdict, per shard position p: the hash that a strict majority of the
// groups hold is the truth; a group holding another hash at any position
// diverged (the minority: it is fenced, and catches up from the majority).
// A position where no hash has a strict majority (two groups that differ,
// or three that all differ) leaves nothing to trust: `no_majority`, and
// the job stops unless something else (a checkpoint shadow) can decide.
//
// Pure and deterministic: no clock, no I/O.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace cmesh::recovery {

struct replica_verdict {
  bool agree = true;
  /// Groups whose state differs from the majority's (sorted).
  std::vector<uint32_t> minority;
  /// Some position has no strict majority: nothing to trust.
  bool no_majority = false;
  /// Positions where the groups disagree (sorted).
  std::vector<uint32_t> positions;
  /// In words: which groups differ at which positions.
  std::string reason;
};

/// `groups` are the epoch's replica groups (any order, distinct), each of
/// `ranks_per_group` positions; `hashes[i * ranks_per_group + p]` is the
/// hash of position p of groups[i].
replica_verdict compare_replicas(std::span<const uint32_t> groups, size_t ranks_per_group,
                                 std::span<const uint64_t> hashes);

/// The names of the segments whose hashes differ between a diverged
/// replica and the majority's at the same position: `names[k]` for every k
/// with mine[k] != theirs[k] (at most `limit`, then "and N more").
std::string differing_segments(std::span<const std::string> names,
                               std::span<const uint64_t> mine, std::span<const uint64_t> theirs,
                               size_t limit = 8);

} // namespace cmesh::recovery
