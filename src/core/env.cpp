#include "core/env.hpp"

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace cmesh {

std::optional<std::string> env_string(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0')
    return std::nullopt;
  return std::string(v);
}

env_int_result env_int(const char* name) {
  env_int_result r;
  auto s = env_string(name);
  if (!s)
    return r;
  int64_t x = 0;
  auto [p, ec] = std::from_chars(s->data(), s->data() + s->size(), x);
  if (ec != std::errc{} || p != s->data() + s->size()) {
    r.error = std::string(name) + "='" + *s + "' is not an integer";
    return r;
  }
  r.value = x;
  return r;
}

bool env_override(const char* name, int64_t& field, std::string& error) {
  auto r = env_int(name);
  if (!r.error.empty()) {
    error = r.error;
    return false;
  }
  if (r.value)
    field = *r.value;
  return true;
}

namespace {

bool read_triplet(const char* rank, const char* size, const char* local,
                  const char* source, launch_env& out, std::string& error) {
  auto r = env_int(rank);
  auto s = env_int(size);
  if (!r.error.empty() || !s.error.empty()) {
    error = !r.error.empty() ? r.error : s.error;
    return true;
  }
  if (!r.value && !s.value)
    return false;
  if (!r.value || !s.value) {
    error = std::string("set both ") + rank + " and " + size;
    return true;
  }
  out.rank = *r.value;
  out.world_size = *s.value;
  auto l = env_int(local);
  out.local_rank = l.value.value_or(out.rank);
  out.source = source;
  if (out.world_size < 1 || out.rank < 0 || out.rank >= out.world_size)
    error = std::string(source) + " rank " + std::to_string(out.rank)
            + " is outside world size " + std::to_string(out.world_size);
  return true;
}

} // namespace

launch_env read_launch_env(std::string& error) {
  launch_env out;
  out.source = "default";
  if (read_triplet("CMESH_RANK", "CMESH_WORLD_SIZE", "CMESH_LOCAL_RANK", "cmesh", out, error))
    return out;
  if (read_triplet("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                   "OMPI_COMM_WORLD_LOCAL_RANK", "openmpi", out, error))
    return out;
  if (read_triplet("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "slurm", out, error))
    return out;
  return out;
}

bool lower_thread_priority(int nice) {
  if (nice <= 0)
    return true;
  const auto tid = static_cast<id_t>(::syscall(SYS_gettid));
  errno = 0;
  const int now = ::getpriority(PRIO_PROCESS, tid);
  if (errno != 0)
    return false;
  return ::setpriority(PRIO_PROCESS, tid, std::min(19, now + nice)) == 0;
}

} // namespace cmesh
