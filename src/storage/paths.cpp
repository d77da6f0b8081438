#include "storage/paths.hpp"

#include <fmt/format.h>

#include <cerrno>
#include <charconv>

#include <signal.h>
#include <unistd.h>

namespace cmesh::storage {

namespace {

constexpr std::string_view step_prefix = "step-";
constexpr std::string_view partial_infix = ".partial-";

/// All of `s` as a decimal number (no sign, no blanks, no overflow).
template <class T>
std::optional<T> whole_number(std::string_view s) {
  T v{};
  if (s.empty())
    return std::nullopt;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc{} || end != s.data() + s.size())
    return std::nullopt;
  return v;
}

} // namespace

std::string step_dir_name(uint64_t step) {
  return fmt::format("step-{:09d}", step);
}

std::optional<uint64_t> parse_step_dir(std::string_view name) {
  if (!name.starts_with(step_prefix))
    return std::nullopt;
  return whole_number<uint64_t>(name.substr(step_prefix.size()));
}

std::string partial_dir_name(uint64_t step, int64_t pid, std::string_view host,
                             uint32_t writer) {
  if (writer == 0)
    return fmt::format("{}{}{}@{}", step_dir_name(step), partial_infix, pid, host);
  return fmt::format("{}{}{}.{}@{}", step_dir_name(step), partial_infix, pid, writer, host);
}

std::optional<partial_owner> parse_partial_dir(std::string_view name) {
  auto infix = name.find(partial_infix);
  auto at = name.find('@', infix == std::string_view::npos ? 0 : infix);
  if (infix == std::string_view::npos || at == std::string_view::npos)
    return std::nullopt;
  auto step = parse_step_dir(name.substr(0, infix));
  // "<pid>" or "<pid>.<writer>" (the host, after '@', may hold dots itself).
  auto pid_text = name.substr(infix + partial_infix.size(), at - infix - partial_infix.size());
  auto dot = pid_text.find('.');
  auto pid = whole_number<int64_t>(pid_text.substr(0, dot));
  auto writer = dot == std::string_view::npos ? std::optional<uint32_t>(0)
                                              : whole_number<uint32_t>(pid_text.substr(dot + 1));
  if (!step || !pid || !writer)
    return std::nullopt;
  return partial_owner{*step, *pid, std::string(name.substr(at + 1)), *writer};
}

std::string this_host() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0)
    return "localhost";
  return buf;
}

bool writer_alive(const partial_owner& owner) {
  if (owner.host != this_host())
    return true;
  if (owner.pid <= 0)
    return false;
  // kill(pid, 0): EPERM means a process we may not signal, still alive.
  return ::kill(static_cast<pid_t>(owner.pid), 0) == 0 || errno == EPERM;
}

std::string shard_file_name(uint32_t shard) {
  return fmt::format("shard-{}.bin", shard);
}

std::optional<uint32_t> parse_shard_file(std::string_view name) {
  constexpr std::string_view prefix = "shard-", suffix = ".bin";
  if (!name.starts_with(prefix) || !name.ends_with(suffix)
      || name.size() <= prefix.size() + suffix.size())
    return std::nullopt;
  return whole_number<uint32_t>(name.substr(prefix.size(),
                                            name.size() - prefix.size() - suffix.size()));
}

} // namespace cmesh::storage
