// Names inside a checkpoint root. A finished checkpoint is the directory
// `step-000000123` (zero-padded so that names sort like steps); anything
// else in the root is never taken for one. A writer works in
// `step-000000123.partial-<pid>@<host>` until the last rename, so a crash
// leaves only a partial directory, and its name says whose it was: a
// cleanup removes those whose writer is gone.
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
};

/// "step-000000123.partial-4242@node7".
std::string partial_dir_name(uint64_t step, int64_t pid, std::string_view host);

/// The owner of a partial directory's name, else nullopt.
std::optional<partial_owner> parse_partial_dir(std::string_view name);

/// This machine's host name (the owner of the partial directories it makes).
std::string this_host();

/// Whether a partial directory's writer may still be running: on this host,
/// a live pid; on another host we cannot tell, so yes.
bool writer_alive(const partial_owner& owner);

/// "shard-3.bin".
std::string shard_file_name(uint32_t shard);

/// The manifest of a finished checkpoint, and its name while it is written.
inline constexpr std::string_view manifest_file = "manifest.msgpack";
inline constexpr std::string_view manifest_temp_file = "manifest.msgpack.tmp";

} // namespace cmesh::storage
