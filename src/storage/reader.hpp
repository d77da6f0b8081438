// Reading checkpoints, trusting nothing that was not checked: a checkpoint
// opens only with a manifest that decodes, passes validate() and matches
// the sizes of its files on disk; every byte read is checked against its
// piece's xxh64 before the call returns. Errors (docs/design.md, Storage):
// corrupt (what was read is wrong; names the file and the tensor),
// bad_version, invalid_argument (a caller's mistake, or a checkpoint of
// another configuration, naming every key that differs), unreachable (I/O).
#pragma once

#include "storage/manifest.hpp"
#include "storage/paths.hpp"

#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace cmesh::storage {

/// Elements [first, first + out.size() / dtype size) of one array, to be
/// filled by checkpoint::verify.
struct range_out {
  std::string array;
  uint64_t first = 0;
  std::span<std::byte> out;
};

class checkpoint {
public:
  /// The checkpoint in `dir` (a step directory). A missing manifest is
  /// corrupt: the directory is unfinished or damaged.
  static expected<checkpoint> open(const std::string& dir);

  const manifest& info() const { return m_; }
  const std::string& dir() const { return dir_; }
  uint64_t step() const { return m_.meta.step; }
  /// The bytes of its shard files.
  uint64_t bytes() const;

  /// The index of an array in info().arrays; invalid_argument when none.
  expected<uint32_t> array_index(std::string_view name) const;

  /// The pieces that hold elements [first, first + count) of array
  /// `array`, in element order: what a rank must read for that range.
  std::vector<const piece_entry*> pieces_for(uint32_t array, uint64_t first,
                                             uint64_t count) const;

  /// Elements [first, first + n) of `array` into `out` (n elements of its
  /// dtype), from every piece that covers them, each piece read whole and
  /// verified. Any range: a checkpoint written at S shards is read at any
  /// other S. On an error `out` holds garbage.
  caf::error read_range(std::string_view array, uint64_t first, std::span<std::byte> out) const;

  template <class T>
  caf::error read_range(std::string_view array, uint64_t first, std::span<T> out) const {
    if (auto err = check_element_size(array, sizeof(T)))
      return err;
    return read_range(array, first, std::as_writable_bytes(out));
  }

  /// Reads every piece and checks its xxh64.
  caf::error verify() const { return verify({}); }

  /// verify(), copying on the way the bytes of every range of `wanted`
  /// (one pass over the files: a resume checks the whole checkpoint and
  /// takes its shard of it). At most one range per array; a range outside
  /// its array is invalid_argument. On an error the outputs hold garbage.
  caf::error verify(std::span<const range_out> wanted) const;

  /// invalid_argument "checkpoint step N was written with another
  /// configuration: KEY = ITS (the job's: YOURS); ..." unless the
  /// checkpoint's configuration is `job`'s, but for the layout.* keys (a
  /// checkpoint is read at any layout: resharding).
  caf::error check_config(const config_list& job) const;

private:
  checkpoint() = default;
  caf::error check_element_size(std::string_view array, size_t bytes) const;

  std::string dir_;
  manifest m_;
  std::vector<std::vector<size_t>> by_array_; // piece indices of each array, by first element
};

/// A step directory in a root, valid or not.
struct checkpoint_status {
  uint64_t step = 0;
  std::string dir;
  caf::error error;        // none: it opens (and verified, when asked)
  uint64_t bytes = 0;      // of the files in it
  int64_t mtime_unix_ms = 0;
};

/// Every `step-N` directory of `root`, by step (partial directories are
/// not listed). With `verify_data` each one is read and verified too.
expected<std::vector<checkpoint_status>> list_checkpoints(const std::string& root,
                                                          bool verify_data = false);

struct partial_status {
  std::string dir;
  partial_owner owner;
  bool writer_alive = false;
};

/// The partial directories of `root` (unfinished writes).
expected<std::vector<partial_status>> list_partials(const std::string& root);

/// Removes the partial directories whose writer is gone (`all`: every
/// one); returns the directories removed.
expected<std::vector<std::string>> cleanup_partials(const std::string& root, bool all = false);

/// The newest checkpoint of a root that is whole, and what it passed over.
struct newest_checkpoint {
  std::optional<checkpoint> found; // nullopt: the root holds no checkpoint at all
  std::vector<std::string> skipped; // newer ones, each "step 120: corrupt: ..."
  std::string note; // "step 120: ...; falling back to step 100" (empty: nothing skipped)
};

/// Tries the checkpoints of `root` newest first: one that opens, verifies
/// (with `verify_data`) and, given `job`, has that configuration, is
/// taken; each one passed over is logged and said in `skipped`. A root
/// that holds checkpoints none of which is whole is an error (the code of
/// the newest one's, naming every one), never an empty result: training
/// must not silently start over. A missing root holds no checkpoint.
/// `wanted` (with verify_data) is filled from the checkpoint taken, in the
/// verifying pass (checkpoint::verify).
expected<newest_checkpoint> newest_valid(const std::string& root, const config_list* job = nullptr,
                                         bool verify_data = true,
                                         std::span<const range_out> wanted = {});

/// Removes the checkpoint of `step`: first renamed to a partial name (so a
/// crash midway leaves nothing that looks like a checkpoint), then deleted.
caf::error remove_checkpoint(const std::string& root, uint64_t step);

} // namespace cmesh::storage
