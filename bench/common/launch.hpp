// Running `cmesh launch` (the binary beside the benchmark's own) as a child
// process, with a time limit, and reading what it printed.
#pragma once

#include <fmt/format.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <unistd.h>

namespace cmesh::bench {

/// The directory of this executable (build/bin).
inline std::string self_dir() {
  char buf[4096];
  auto n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0)
    return ".";
  std::string p(buf, static_cast<size_t>(n));
  return p.substr(0, p.rfind('/'));
}

struct launch_output {
  int status = -1;    // raw wait status (0: success)
  std::string output; // stdout and stderr together
};

/// Runs `ENV cmesh launch ARGS` under `timeout -k 10 timeout_s`. `base` is
/// a path prefix for the run's files ("{base}.out" is the output; the
/// caller may name others, e.g. an event log, in `args`).
inline launch_output run_launch(const std::string& base, const std::string& args,
                                int timeout_s, const std::string& env = {}) {
  auto cmd = fmt::format("{}{}timeout -k 10 {} {}/cmesh launch {} >{}.out 2>&1", env,
                         env.empty() ? "" : " ", timeout_s, self_dir(), args, base);
  launch_output r;
  r.status = std::system(cmd.c_str());
  std::ifstream out(base + ".out");
  std::stringstream ss;
  ss << out.rdbuf();
  r.output = ss.str();
  std::remove((base + ".out").c_str());
  return r;
}

} // namespace cmesh::bench
