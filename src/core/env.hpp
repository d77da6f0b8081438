// CMESH_* environment overrides for the options structs, and the launcher's
// view of this process: rank and size from OpenMPI, Slurm or CMESH_*.
#pragma once

#include <chrono>
#include <ctime>
#include <cstdint>
#include <optional>
#include <string>

namespace cmesh {

/// Value of an environment variable, if set and non-empty.
std::optional<std::string> env_string(const char* name);

/// Integer value of an environment variable; a set but malformed value is an
/// invalid_argument error rather than a silent default.
struct env_int_result {
  std::optional<int64_t> value;
  std::string error; // non-empty when the variable is set but not an integer
};
env_int_result env_int(const char* name);

/// Overrides `field` from the variable when it is set; returns false (and
/// fills `error`) on a malformed value.
bool env_override(const char* name, int64_t& field, std::string& error);

/// Where this process sits in the job, as its launcher told it.
struct launch_env {
  int64_t rank = 0;
  int64_t world_size = 1;
  int64_t local_rank = 0;
  std::string source; // "openmpi", "slurm", "cmesh" or "default"
};

/// Reads CMESH_RANK/CMESH_WORLD_SIZE, then OMPI_COMM_WORLD_*, then SLURM_*.
/// CMESH_* wins so that a replacement rank (srun --overlap) can name its slot.
launch_env read_launch_env(std::string& error);

/// Monotonic nanoseconds, comparable across processes on one machine.
inline int64_t mono_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
           std::chrono::steady_clock::now().time_since_epoch())
    .count();
}

/// The same clock in seconds.
inline double mono_s() {
  return static_cast<double>(mono_ns()) / 1e9;
}

/// Lowers the calling thread's priority by `nice` levels, up to 19 (Linux
/// nice values are per thread, and lowering one needs no privilege). False,
/// with errno set, when it could not; `nice` <= 0 leaves it as it is.
bool lower_thread_priority(int nice);

/// CPU time the calling thread has used, nanoseconds.
inline int64_t thread_cpu_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

} // namespace cmesh
