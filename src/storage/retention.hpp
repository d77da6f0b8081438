// Which checkpoints to keep: the newest few, for restarts, and every M-th
// step, for going back further. Pure, so the checkpoint actor's policy is
// tested without files.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace cmesh::storage {

/// The steps of `steps` (any order, repeats counted once) to delete:
/// all but the newest `keep_last` (at least 1: the newest is always
/// kept) and the multiples of `keep_every` (0: none kept for that).
/// Ascending.
std::vector<uint64_t> retention_plan(std::span<const uint64_t> steps, size_t keep_last,
                                     uint64_t keep_every);

} // namespace cmesh::storage
