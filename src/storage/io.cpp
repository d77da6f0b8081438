#include "storage/io.hpp"

#include <caf/message.hpp>
#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

namespace cmesh::storage {

caf::error io_error(std::string_view call, const std::string& path, int err) {
  return make_error(errc::unreachable, fmt::format("{} {}: {}", call, path, std::strerror(err)));
}

caf::error recode(const caf::error& err, errc code, std::string_view prefix) {
  const auto& ctx = err.context();
  std::string text = ctx.size() == 1 && ctx.match_element<std::string>(0)
                       ? ctx.get_as<std::string>(0)
                       : describe(err);
  return make_error(code, std::string(prefix) + text);
}

file::~file() {
  if (fd_ >= 0)
    ::close(fd_);
}

file& file::operator=(file&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0)
      ::close(fd_);
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

expected<file> open_file(const std::string& path, int flags, unsigned mode) {
  int fd = ::open(path.c_str(), flags | O_CLOEXEC, mode);
  if (fd < 0)
    return io_error("open", path, errno);
  return file(fd);
}

caf::error write_at(const file& f, std::span<const std::byte> data, uint64_t offset,
                    const std::string& path) {
  size_t done = 0;
  while (done < data.size()) {
    auto n = ::pwrite(f.fd(), data.data() + done, data.size() - done,
                      static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0)
      return io_error("write", path, errno);
    if (n == 0) // no progress and no error: the device takes nothing more
      return io_error("write", path, ENOSPC);
    done += static_cast<size_t>(n);
  }
  return {};
}

caf::error read_at(const file& f, std::span<std::byte> data, uint64_t offset,
                   const std::string& path) {
  size_t done = 0;
  while (done < data.size()) {
    auto n = ::pread(f.fd(), data.data() + done, data.size() - done,
                     static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0)
      return io_error("read", path, errno);
    if (n == 0)
      return make_error(errc::corrupt,
                        fmt::format("{}: truncated: ends at byte {}, {} bytes expected from {}",
                                    path, offset + done, data.size(), offset));
    done += static_cast<size_t>(n);
  }
  return {};
}

caf::error sync_file(const file& f, const std::string& path) {
  if (::fsync(f.fd()) != 0)
    return io_error("fsync", path, errno);
  return {};
}

caf::error sync_dir(const std::string& path) {
  auto d = open_file(path, O_RDONLY | O_DIRECTORY);
  if (!d)
    return d.error();
  return sync_file(*d, path);
}

caf::error rename_path(const std::string& from, const std::string& to, bool exchange) {
  int rc = exchange ? ::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_EXCHANGE)
                    : ::rename(from.c_str(), to.c_str());
  if (rc != 0)
    return io_error(exchange ? "rename (exchange)" : "rename", from + " -> " + to, errno);
  return {};
}

caf::error make_dir(const std::string& path) {
  if (::mkdir(path.c_str(), 0755) != 0)
    return io_error("mkdir", path, errno);
  return {};
}

caf::error remove_tree(const std::string& path) {
  std::error_code ec;
  std::filesystem::remove_all(path, ec);
  if (ec)
    return io_error("remove", path, ec.value());
  return {};
}

expected<uint64_t> file_size(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    return io_error("stat", path, errno);
  return static_cast<uint64_t>(st.st_size);
}

expected<std::vector<uint8_t>> read_whole(const std::string& path, uint64_t limit) {
  auto f = open_file(path, O_RDONLY);
  if (!f)
    return f.error();
  struct stat st {};
  if (::fstat(f->fd(), &st) != 0)
    return io_error("stat", path, errno);
  auto size = static_cast<uint64_t>(st.st_size);
  if (size > limit)
    return make_error(errc::corrupt,
                      fmt::format("{}: {} bytes, more than the {} it may hold", path, size, limit));
  std::vector<uint8_t> out(size);
  if (auto err = read_at(*f, std::as_writable_bytes(std::span(out)), 0, path))
    return err;
  return out;
}

expected<std::vector<std::string>> dir_entries(const std::string& path) {
  DIR* d = ::opendir(path.c_str());
  if (!d)
    return io_error("opendir", path, errno);
  std::vector<std::string> out;
  errno = 0;
  while (auto* e = ::readdir(d)) {
    std::string_view name = e->d_name;
    if (name != "." && name != "..")
      out.emplace_back(name);
    errno = 0;
  }
  int err = errno;
  ::closedir(d);
  if (err != 0)
    return io_error("readdir", path, err);
  return out;
}

std::string join(const std::string& dir, std::string_view name) {
  if (!dir.empty() && dir.back() == '/')
    return dir + std::string(name);
  return dir + "/" + std::string(name);
}

} // namespace cmesh::storage
