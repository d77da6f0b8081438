#include "core/process.hpp"

#include <csignal>
#include <cstring>
#include <thread>

#include <sys/wait.h>
#include <unistd.h>

extern char** environ;

namespace cmesh {

child_process::~child_process() {
  kill_and_reap();
}

child_process::child_process(child_process&& other) noexcept
    : pid_(std::exchange(other.pid_, -1)), status_(std::exchange(other.status_, std::nullopt)) {}

child_process& child_process::operator=(child_process&& other) noexcept {
  if (this != &other) {
    kill_and_reap();
    pid_ = std::exchange(other.pid_, -1);
    status_ = std::exchange(other.status_, std::nullopt);
  }
  return *this;
}

child_process child_process::spawn(const std::string& path, const std::vector<std::string>& args,
                                   const std::vector<std::pair<std::string, std::string>>& env,
                                   std::string* error) {
  // Everything the child needs is built before fork: only async-signal-safe
  // calls happen between fork and exec.
  std::vector<std::string> env_strings;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string kv(*e);
    bool overridden = false;
    for (auto& [k, v] : env)
      if (kv.compare(0, k.size() + 1, k + "=") == 0)
        overridden = true;
    if (!overridden)
      env_strings.push_back(std::move(kv));
  }
  for (auto& [k, v] : env)
    env_strings.push_back(k + "=" + v);
  std::vector<char*> envp;
  for (auto& s : env_strings)
    envp.push_back(s.data());
  envp.push_back(nullptr);
  std::vector<std::string> argv_strings{path};
  argv_strings.insert(argv_strings.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& s : argv_strings)
    argv.push_back(s.data());
  argv.push_back(nullptr);

  child_process c;
  pid_t pid = fork();
  if (pid < 0) {
    if (error != nullptr)
      *error = std::string("fork: ") + std::strerror(errno);
    return c;
  }
  if (pid == 0) {
    execve(path.c_str(), argv.data(), envp.data());
    _exit(127);
  }
  c.pid_ = pid;
  return c;
}

bool child_process::signal(int sig) const {
  return running() && ::kill(pid_, sig) == 0;
}

std::optional<int> child_process::poll() {
  if (pid_ <= 0 || status_)
    return status_;
  int st = 0;
  pid_t r = waitpid(pid_, &st, WNOHANG);
  if (r == pid_)
    status_ = st;
  return status_;
}

std::optional<int> child_process::wait(std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    if (auto st = poll())
      return st;
    if (pid_ <= 0 || std::chrono::steady_clock::now() >= deadline)
      return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

void child_process::kill_and_reap() {
  if (pid_ <= 0 || status_)
    return;
  ::kill(pid_, SIGCONT); // a stopped child must be able to die
  ::kill(pid_, SIGKILL);
  wait(std::chrono::seconds(10));
}

std::string describe_wait_status(int status) {
  if (WIFEXITED(status))
    return "exit " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status))
    return "signal " + std::to_string(WTERMSIG(status)) + " (" + strsignal(WTERMSIG(status)) + ")";
  return "status " + std::to_string(status);
}

int exit_code_of(int status) {
  if (WIFEXITED(status))
    return WEXITSTATUS(status);
  if (WIFSIGNALED(status))
    return 128 + WTERMSIG(status);
  return 255;
}

std::string self_exe_dir() {
  char buf[4096];
  auto n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0)
    return ".";
  std::string p(buf, static_cast<size_t>(n));
  return p.substr(0, p.rfind('/'));
}

} // namespace cmesh
