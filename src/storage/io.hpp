// The few POSIX file operations a checkpoint needs, each turning a failed
// system call into a typed error that names the call, the path and
// strerror. Storage I/O failures (ENOSPC, EROFS, EACCES, EIO, ...) are
// errc::unreachable: the storage cannot be written or read, which says
// nothing about the data. Data that was read and is wrong (short, or not
// what the manifest says) is errc::corrupt. docs/design.md, Storage, says
// why these two and not others.
#pragma once

#include "core/error.hpp"

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace cmesh::storage {

/// errc::unreachable: "<call> <path>: <strerror(err)>".
caf::error io_error(std::string_view call, const std::string& path, int err);

/// The same error's text under another code: "corrupt: X" -> "invalid_argument: X"
/// where a check meant for stored data finds a caller's mistake.
caf::error recode(const caf::error& err, errc code, std::string_view prefix = {});

/// An open file descriptor, closed when it goes.
class file {
public:
  file() = default;
  explicit file(int fd) : fd_(fd) {}
  ~file();
  file(file&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  file& operator=(file&& other) noexcept;
  file(const file&) = delete;
  file& operator=(const file&) = delete;
  int fd() const { return fd_; }

private:
  int fd_ = -1;
};

/// open(2) with O_CLOEXEC.
expected<file> open_file(const std::string& path, int flags, unsigned mode = 0644);

/// pwrite(2) until every byte is written (EINTR and short writes retried).
caf::error write_at(const file& f, std::span<const std::byte> data, uint64_t offset,
                    const std::string& path);

/// pread(2) of exactly data.size() bytes; fewer (the file ends first) is
/// errc::corrupt "truncated".
caf::error read_at(const file& f, std::span<std::byte> data, uint64_t offset,
                   const std::string& path);

/// fsync(2) of an open file, or of a directory by its path (which makes the
/// entries created, renamed or removed in it durable).
caf::error sync_file(const file& f, const std::string& path);
caf::error sync_dir(const std::string& path);

/// rename(2); with `exchange` renameat2(RENAME_EXCHANGE): both exist, and
/// they swap in one step.
caf::error rename_path(const std::string& from, const std::string& to, bool exchange = false);

/// mkdir(2) of one directory (EEXIST is an error: callers know what they made).
caf::error make_dir(const std::string& path);

/// Removes a tree; a missing path is no error.
caf::error remove_tree(const std::string& path);

/// The size of a file, or its stat(2) error.
expected<uint64_t> file_size(const std::string& path);

/// A whole small file; errc::corrupt when larger than `limit`.
expected<std::vector<uint8_t>> read_whole(const std::string& path, uint64_t limit);

/// The names in a directory (not "." and ".."), unsorted.
expected<std::vector<std::string>> dir_entries(const std::string& path);

/// "a/b" (no doubled slash).
std::string join(const std::string& dir, std::string_view name);

} // namespace cmesh::storage
