// Child processes for the launcher and the multi-process tests: spawn with
// extra environment, signal, wait with a deadline, and never leak one: the
// destructor kills and reaps a child that is still running.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <sys/types.h>
#include <utility>
#include <vector>

namespace cmesh {

class child_process {
public:
  child_process() = default;
  ~child_process();
  child_process(child_process&& other) noexcept;
  child_process& operator=(child_process&& other) noexcept;
  child_process(const child_process&) = delete;
  child_process& operator=(const child_process&) = delete;

  /// fork + execv of `path` with `args` (argv[0] is path) and the current
  /// environment plus `env`. Returns a child whose pid() is -1 on failure.
  static child_process spawn(const std::string& path, const std::vector<std::string>& args,
                             const std::vector<std::pair<std::string, std::string>>& env,
                             std::string* error = nullptr);

  pid_t pid() const { return pid_; }
  bool running() const { return pid_ > 0 && !status_; }

  /// Sends a signal; false when the child is gone.
  bool signal(int sig) const;

  /// Waits up to `timeout` for the child to exit; the raw wait status.
  std::optional<int> wait(std::chrono::milliseconds timeout);

  /// Non-blocking check; the raw wait status once exited.
  std::optional<int> poll();

  /// SIGKILL and reap (bounded); no-op when already reaped.
  void kill_and_reap();

private:
  pid_t pid_ = -1;
  std::optional<int> status_;
};

/// "exit 3", "signal 9 (Killed)" for a raw wait status.
std::string describe_wait_status(int status);

/// Exit code of a raw wait status: the code, or 128 + signal.
int exit_code_of(int status);

/// Directory of the running executable (for finding sibling binaries).
std::string self_exe_dir();

} // namespace cmesh
