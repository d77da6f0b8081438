// Writing a checkpoint so that a crash at any moment leaves either the
// previous checkpoints alone or the new one whole (docs/design.md,
// Storage: the write protocol):
//
//   begin   mkdir ROOT/step-000000123.partial-<pid>@<host> (or <pid>.<n>: paths.hpp)
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
//
// One checkpoint written by several processes (shard k of the state lives
// in rank k of a replica group). Every process begins a writer of the step
// in the same root (one file system: the files move by rename(2)) and
// writes its own shards; then
//
//   publish  each process but the committer: publish_part writes
//            part.msgpack (a manifest of its shards, each piece's xxh64
//            computed by the process that wrote the bytes) into its partial
//            directory by a temp name, fsync, rename, directory fsync; the
//            directory is now a part, the committer's to adopt
//   adopt    the committer (the writer of shard 0): adopt_parts polls the
//            root until the parts of the step hold every other shard, checks
//            each against its own layout and the file sizes on disk (no
//            data is read again), moves their shard files into its partial
//            directory, takes their files and pieces into its manifest and
//            removes the emptied parts
//   commit   the committer, as above: the coverage check finds a shard
//            missing or held twice
//
// A part nobody adopts (the committer died or timed out) stays in the
// root: cleanup_partials removes it once its writer's process is gone; a
// process that lives on removes its own with remove_own_stale_parts. Each
// writer's directory has a name of its own (paths.hpp), so the writers of a
// step in one process, and the parts they leave, never share one.
#pragma once

#include "storage/manifest.hpp"

#include <chrono>
#include <cstddef>
#include <span>
#include <string>
#include <string_view>
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
  /// the partial directory of meta.step in it: the first name of this
  /// process's (paths.hpp) that no live writer of it holds and that is not
  /// a published part; a leftover of a dead process of the same pid there
  /// is removed first.
  static expected<checkpoint_writer> begin(const std::string& root, checkpoint_meta meta,
                                           std::vector<array_entry> arrays,
                                           std::vector<tensor_entry> tensors,
                                           write_options options = {});

  checkpoint_writer(checkpoint_writer&& other) noexcept;
  checkpoint_writer& operator=(checkpoint_writer&&) = delete;
  checkpoint_writer(const checkpoint_writer&) = delete;
  checkpoint_writer& operator=(const checkpoint_writer&) = delete;
  /// Not committed (nor published): removes the partial directory.
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

  /// Hands the shards written so far to the committer of this step:
  /// writes part.msgpack (an encode_manifest'ed manifest of this writer's
  /// meta, arrays, tensors, files and pieces) by its temp name, fsynced,
  /// renamed, the directory fsynced. From then on the partial directory
  /// belongs to whoever adopts it: the destructor leaves it, and every
  /// later call of this writer is invalid_argument. Errors: unreachable
  /// (I/O: the writer is spent, its directory removed), invalid_argument
  /// (nothing written, or called twice).
  caf::error publish_part();

  /// The committer: waits, polling the root every 10 ms, until the parts
  /// published for meta.step in the root hold every shard in [0, shards)
  /// that this writer did not write, up to `timeout`. Each part is checked
  /// when found: it decodes, holds shard files only, has the step, arrays,
  /// tensors, alignment and config digest of this writer, consistent
  /// pieces, and files of the sizes it says (corrupt naming the part's
  /// directory and what differs). A part whose shards are not all still
  /// missing (a duplicate) is left alone; a part of another step is never
  /// read. Once all are found, moves their shard files into this writer's
  /// partial directory, takes in their files and pieces (file indices
  /// remapped) and removes the emptied parts; commit() is next. Errors:
  /// timeout naming the shards still missing (no part was touched; this
  /// writer's directory is left for its destructor), corrupt (nothing
  /// moved either), unreachable (I/O: the writer is spent, its directory
  /// removed with whatever it had adopted).
  caf::error adopt_parts(uint32_t shards, std::chrono::milliseconds timeout);

  const std::string& partial_dir() const { return partial_; }

private:
  checkpoint_writer() = default;
  caf::error fail(caf::error err);
  caf::error write_manifest_as(std::string_view temp_name, std::string_view name);
  caf::error move_into_place();
  caf::error take_part(const std::string& dir, const manifest& part);

  std::string root_, partial_, final_;
  manifest m_;
  write_options options_;
  caf::error failed_;
  bool open_ = false; // a partial directory exists that this writer owns
};

/// Removes the parts this process published for steps before `step` that
/// no committer adopted (a committer that died or timed out): a process
/// whose pid lives is never cleaned up by cleanup_partials, so it cleans
/// its own. Partial directories of writers still at work are kept, and so
/// are parts published less than `older_than` ago (a committer may still
/// be adopting them: give its assemble timeout). Returns the directories
/// removed. Errors: unreachable.
expected<std::vector<std::string>> remove_own_stale_parts(
  const std::string& root, uint64_t step,
  std::chrono::milliseconds older_than = std::chrono::milliseconds(0));

/// begin, write_shard(k, shards[k]) for each k, commit.
expected<std::string> write_checkpoint(const std::string& root, checkpoint_meta meta,
                                       std::vector<array_entry> arrays,
                                       std::vector<tensor_entry> tensors,
                                       std::span<const std::vector<array_slice>> shards,
                                       write_options options = {});

} // namespace cmesh::storage
