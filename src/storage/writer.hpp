// Writing a checkpoint so that a crash at any moment leaves either the
// previous checkpoints alone or the new one whole (docs/design.md,
// Storage: the write protocol):
//
//   begin   mkdir ROOT/step-000000123.partial-<pid>@<host>
//   shard   each shard file written, fsynced (write_shard, once per file)
//   commit  manifest written to manifest.msgpack.tmp, fsynced, renamed to
//           manifest.msgpack; the directory fsynced; renamed to
//           ROOT/step-000000123 (swapped with an older one of that step);
//           ROOT fsynced
//
// Any failure (ENOSPC, EROFS, EACCES, EIO: errc::unreachable naming the
// call, the path and strerror) removes the partial directory; so does a
// writer dropped before commit. Nothing ever touches the other
// checkpoints. A writer killed in the middle leaves its partial directory,
// which no reader takes for a checkpoint and cleanup_partials removes.
#pragma once

#include "storage/manifest.hpp"

#include <cstddef>
#include <span>
#include <string>
#include <vector>

namespace cmesh::storage {

struct write_options {
  uint64_t alignment = 4096;         // every piece starts at a multiple of this, in its file
  uint64_t max_piece_bytes = 64ull << 20; // longer tensors are checksummed in pieces of this:
                                     // a reshard read of a few elements hashes at most this much
};

/// Elements [first, first + n) of one array, as one shard holds them:
/// bytes.size() is n times the array's dtype size.
struct array_slice {
  std::string array;
  uint64_t first = 0;
  std::span<const std::byte> bytes;
};

template <class T>
array_slice slice_of(std::string array, uint64_t first, std::span<const T> values) {
  return {std::move(array), first, std::as_bytes(values)};
}

/// The pieces of elements [first, first + count) of array `array` of a
/// manifest's layout: cut where a tensor of the index starts or ends (for
/// an indexed array) and every `max_piece_elements`. file, offset and
/// xxh64 are left for the writer. Pure.
std::vector<piece_entry> cut_pieces(const manifest& layout, uint32_t array, uint64_t first,
                                    uint64_t count, uint64_t max_piece_elements);

class checkpoint_writer {
public:
  /// Checks the layout (invalid_argument), creates `root` when missing and
  /// the partial directory of meta.step in it.
  static expected<checkpoint_writer> begin(const std::string& root, checkpoint_meta meta,
                                           std::vector<array_entry> arrays,
                                           std::vector<tensor_entry> tensors,
                                           write_options options = {});

  checkpoint_writer(checkpoint_writer&& other) noexcept;
  checkpoint_writer& operator=(checkpoint_writer&&) = delete;
  checkpoint_writer(const checkpoint_writer&) = delete;
  checkpoint_writer& operator=(const checkpoint_writer&) = delete;
  /// Not committed: removes the partial directory.
  ~checkpoint_writer();

  /// Writes and fsyncs shard-<shard>.bin holding `slices`. Errors:
  /// invalid_argument (an unknown array, a slice outside it, a shard
  /// written twice), unreachable (I/O). After an I/O error the writer is
  /// spent: its partial directory is gone and every call returns the error.
  caf::error write_shard(uint32_t shard, std::span<const array_slice> slices);

  /// Checks that the shards hold every element of every array exactly
  /// once (invalid_argument naming the array and element), then the
  /// manifest and the renames above. Returns the checkpoint's directory.
  expected<std::string> commit();

  const std::string& partial_dir() const { return partial_; }

private:
  checkpoint_writer() = default;
  caf::error fail(caf::error err);
  caf::error write_manifest();
  caf::error move_into_place();

  std::string root_, partial_, final_;
  manifest m_;
  write_options options_;
  caf::error failed_;
  bool open_ = false; // a partial directory exists that this writer owns
};

/// begin, write_shard(k, shards[k]) for each k, commit.
expected<std::string> write_checkpoint(const std::string& root, checkpoint_meta meta,
                                       std::vector<array_entry> arrays,
                                       std::vector<tensor_entry> tensors,
                                       std::span<const std::vector<array_slice>> shards,
                                       write_options options = {});

} // namespace cmesh::storage
