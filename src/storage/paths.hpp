// Names inside a checkpoint root. A finished checkpoint is the directory
// `step-000000123` (zero-padded so that names sort like steps); anything
// else in the root is never taken for one. A writer works in
// `step-000000123.partial-<pid>@<host>` until the last rename, so a crash
// leaves only a partial directory, and its name says whose it was: a
// cleanup removes those whose writer is gone.
//
// Several writers of one step may live in one process (a process writing
// a part and the committer, or all of them in a unit test), and a part
// published by one stays in the root after the writer is gone, until a
// committer adopts it: each writer's directory carries a number of its
// own, `step-000000123.partial-<pid>.<n>@<host>`, where n > 0; the first
// writer of a step in a process (n = 0) has the plain name. The pid and
// the host still say whose it is.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace cmesh::storage {

/// "step-000000123".
std::string step_dir_name(uint64_t step);

/// The step of a finished checkpoint's directory name, else nullopt
/// ("step-" and digits only: partial directories are not).
std::optional<uint64_t> parse_step_dir(std::string_view name);

/// Who was writing a partial directory.
struct partial_owner {
  uint64_t step = 0;
  int64_t pid = 0;
  std::string host;
  uint32_t writer = 0; // which of the pid's writers of the step (0: the plain name)
};

/// "step-000000123.partial-4242@node7"; writer 2: "step-000000123.partial-4242.2@node7".
std::string partial_dir_name(uint64_t step, int64_t pid, std::string_view host,
                             uint32_t writer = 0);

/// The owner of a partial directory's name, else nullopt.
std::optional<partial_owner> parse_partial_dir(std::string_view name);

/// This machine's host name (the owner of the partial directories it makes).
std::string this_host();

/// Whether a partial directory's writer may still be running: on this host,
/// a live pid; on another host we cannot tell, so yes.
bool writer_alive(const partial_owner& owner);

/// "shard-3.bin".
std::string shard_file_name(uint32_t shard);

/// The shard of a shard file's name ("shard-3.bin": 3), else nullopt.
std::optional<uint32_t> parse_shard_file(std::string_view name);

/// The manifest of a finished checkpoint, and its name while it is written.
inline constexpr std::string_view manifest_file = "manifest.msgpack";
inline constexpr std::string_view manifest_temp_file = "manifest.msgpack.tmp";

/// In a partial directory whose shards were published for a committer to
/// adopt (checkpoint_writer::publish_part): what they hold, a manifest of
/// some of the shards. Written to the temp name, then renamed: a partial
/// directory holding part_file is a whole part.
inline constexpr std::string_view part_file = "part.msgpack";
inline constexpr std::string_view part_temp_file = "part.msgpack.tmp";

} // namespace cmesh::storage
