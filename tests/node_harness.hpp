// Runs a coordinator in the test process and N worker processes around it;
// every process is killed and reaped when the harness goes out of scope.
#pragma once

#include "core/env.hpp"
#include "core/process.hpp"
#include "transport/bootstrap.hpp"

#include <doctest/doctest.h>

#include <chrono>
#include <random>
#include <regex>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <unistd.h>
#include <cstdlib>
#include <string>
#include <vector>

namespace cmesh::testing {

using namespace std::chrono_literals;

inline std::string bin_dir() {
  if (const char* d = std::getenv("CMESH_BIN_DIR"))
    return d;
  return self_exe_dir() + "/../bin";
}

class node_harness {
public:
  explicit node_harness(uint32_t world_size, std::vector<std::pair<std::string, std::string>> env = {})
      : world_size_(world_size), coord_({"127.0.0.1", 0, world_size}), env_(std::move(env)) {
    REQUIRE_FALSE(coord_.start());
  }

  ~node_harness() {
    coord_.broadcast_shutdown(0, "test over");
    for (auto& n : nodes_)
      if (!n.wait(std::chrono::seconds(5)))
        n.kill_and_reap();
    coord_.stop();
  }

  /// Starts rank r of `program` with `args`.
  void spawn(const std::string& program, uint32_t rank, const std::vector<std::string>& args) {
    auto env = env_;
    env.emplace_back("CMESH_COORDINATOR", "127.0.0.1:" + std::to_string(coord_.port()));
    env.emplace_back("CMESH_RANK", std::to_string(rank));
    env.emplace_back("CMESH_WORLD_SIZE", std::to_string(world_size_));
    std::string err;
    auto c = child_process::spawn(bin_dir() + "/" + program, args, env, &err);
    REQUIRE_MESSAGE(c.pid() > 0, err);
    if (nodes_.size() <= rank)
      nodes_.resize(rank + 1);
    nodes_[rank] = std::move(c);
  }

  void spawn_all(const std::string& program, const std::vector<std::string>& args) {
    for (uint32_t r = 0; r < world_size_; ++r)
      spawn(program, r, args);
  }

  /// The report `key` of `rank`, waiting up to `timeout`.
  std::optional<wire::report> report(uint32_t rank, const std::string& key,
                                     std::chrono::milliseconds timeout = std::chrono::seconds(120)) {
    return coord_.wait_report([&](const wire::report& r) { return r.rank == rank && r.key == key; },
                              timeout);
  }

  std::vector<wire::report> reports(const std::string& key) const {
    std::vector<wire::report> out;
    for (auto& r : coord_.reports())
      if (r.key == key)
        out.push_back(r);
    return out;
  }

  child_process& node(uint32_t rank) { return nodes_.at(rank); }
  coordinator& coord() { return coord_; }

  /// Shuts the job down and returns each node's raw wait status.
  std::vector<std::optional<int>> finish(std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
    coord_.broadcast_shutdown(0, "test over");
    std::vector<std::optional<int>> out;
    for (auto& n : nodes_)
      out.push_back(n.wait(timeout));
    return out;
  }

private:
  uint32_t world_size_;
  coordinator coord_;
  std::vector<std::pair<std::string, std::string>> env_;
  std::vector<child_process> nodes_;
};

/// A worker's error report: "<errc> <mono_ns> <text>".
struct error_report {
  std::string code;
  int64_t mono_ns = 0;
  std::string text;
};

inline error_report parse_error(const wire::report& r) {
  error_report e;
  std::istringstream in(r.value);
  in >> e.code >> e.mono_ns;
  std::getline(in, e.text);
  return e;
}

/// A worker's abort report: "<errc of the aborted op> <ms to return> <errc after>".
struct abort_report {
  std::string code;
  double ms = 0;
  std::string after;
};

inline abort_report parse_abort(const wire::report& r) {
  abort_report a;
  std::istringstream in(r.value);
  in >> a.code >> a.ms >> a.after;
  return a;
}

/// The first capture group of every match of `pattern` in `text`, in order.
inline std::vector<std::string> captures(const std::string& text, const std::string& pattern) {
  std::vector<std::string> out;
  std::regex re(pattern);
  for (auto it = std::sregex_iterator(text.begin(), text.end(), re); it != std::sregex_iterator();
       ++it)
    out.push_back((*it)[1].str());
  return out;
}

/// The final weights each rank of a `cmesh launch` job reported in its
/// "done" line, in the order of their lines; each must have reached `steps`.
inline std::vector<std::string> done_weights(const std::string& out, uint64_t steps) {
  std::vector<std::string> w;
  std::regex re("done \\(steps=([0-9]+) .*weights=([0-9a-f]{16})\\)");
  for (auto it = std::sregex_iterator(out.begin(), out.end(), re); it != std::sregex_iterator();
       ++it) {
    CHECK((*it)[1].str() == std::to_string(steps));
    w.push_back((*it)[2].str());
  }
  return w;
}

/// A random seed, or CMESH_SEED to replay one; callers print it.
inline uint64_t test_seed() {
  uint64_t s = std::random_device{}();
  if (const char* v = std::getenv("CMESH_SEED"))
    s = std::strtoull(v, nullptr, 10);
  return s;
}

/// Runs the cmesh command with extra environment; output is stdout and
/// stderr together.
struct run_result {
  int exit_code = -1;
  std::string output; // stdout and stderr together
  std::chrono::milliseconds took{0};
};

inline run_result run_cmesh(const std::string& args, const std::vector<std::pair<std::string, std::string>>& env = {},
                     std::chrono::seconds timeout = 120s) {
  auto out_path = "/tmp/cmesh_cli_test_" + std::to_string(getpid()) + ".out";
  auto cmd = bin_dir() + "/cmesh " + args + " >" + out_path + " 2>&1";
  auto t0 = std::chrono::steady_clock::now();
  auto c = child_process::spawn("/bin/sh", {"-c", cmd}, env);
  REQUIRE(c.pid() > 0);
  auto st = c.wait(timeout);
  run_result r;
  r.took = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - t0);
  REQUIRE_MESSAGE(st.has_value(), "cmesh " << args << " did not finish within " << timeout.count() << " s");
  r.exit_code = exit_code_of(*st);
  std::ifstream in(out_path);
  std::stringstream ss;
  ss << in.rdbuf();
  r.output = ss.str();
  std::remove(out_path.c_str());
  return r;
}

/// `cmesh ARGS > out 2>&1`, exec'd so that the child's pid is cmesh's.
inline child_process spawn_cmesh(const std::string& args, const std::string& out,
                                 const std::vector<std::pair<std::string, std::string>>& env = {}) {
  auto c = child_process::spawn("/bin/sh",
                                {"-c", "exec " + bin_dir() + "/cmesh " + args + " >" + out + " 2>&1"},
                                env);
  REQUIRE(c.pid() > 0);
  return c;
}

/// A whole file's text ("" when it cannot be read).
inline std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

/// A port that was free a moment ago on 127.0.0.1 (a coordinator bound it).
inline uint16_t free_port() {
  coordinator probe(coordinator_options{});
  REQUIRE_FALSE(probe.start());
  auto port = probe.port();
  probe.stop();
  return port;
}

} // namespace cmesh::testing
