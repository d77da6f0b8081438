// Running a peer's anchor script (../shared/anchors/*.sh) in the same run as
// our own measurement, and reading its figures.
#pragma once

#include "core/process.hpp"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace cmesh::bench {

struct script_output {
  std::vector<std::string> lines;
  int status = -1;   // raw wait status of the script
  std::string error; // set when it could not be run at all
};

/// Runs `bash path` under `timeout`, collecting its output lines.
inline script_output run_anchor_script(const std::string& path, int timeout_s) {
  script_output out;
  if (!std::filesystem::exists(path)) {
    out.error = "anchor unavailable: " + path + " not found";
    return out;
  }
  auto cmd = "timeout " + std::to_string(timeout_s) + " bash '" + path + "' 2>&1";
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (pipe == nullptr) {
    out.error = "anchor unavailable: cannot run " + path;
    return out;
  }
  char buf[2048];
  while (std::fgets(buf, sizeof(buf), pipe) != nullptr) {
    std::string line(buf);
    while (!line.empty() && (line.back() == '\n' || line.back() == '\r'))
      line.pop_back();
    out.lines.push_back(line);
  }
  out.status = ::pclose(pipe);
  return out;
}

/// The number a whole string spells, if it is one.
inline std::optional<double> parse_number(const std::string& s) {
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  if (end == s.c_str() || *end != '\0')
    return std::nullopt;
  return v;
}

} // namespace cmesh::bench
