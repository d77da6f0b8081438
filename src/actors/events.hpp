// JSON-lines events: one object per line, so that failures and recoveries
// can be measured from outside the process.
//
//   {"ts":1764690000.123,"mono_ms":81234.5,"event":"epoch","epoch":3,...}
//
// ts is the wall clock (seconds since the Unix epoch); mono_ms is
// CLOCK_MONOTONIC in milliseconds, the same clock in every process on one
// machine (core/env.hpp mono_ns), so a test or benchmark that sends a signal
// can time what follows from its own monotonic timestamp.
#pragma once

#include "core/error.hpp"

#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace cmesh::actors {

using event_value =
  std::variant<int64_t, uint64_t, double, bool, std::string, std::vector<uint32_t>>;
using event_fields = std::vector<std::pair<std::string, event_value>>;

/// Text of `s` as a JSON string literal.
std::string json_quote(std::string_view s);

/// One event line (without the newline).
std::string format_event(std::string_view event, const event_fields& fields, double ts,
                         double mono_ms);

class event_log {
public:
  /// "-": stdout; "": nowhere (events are dropped); otherwise a file
  /// (appended). Error: invalid_argument naming the path.
  static expected<std::shared_ptr<event_log>> open(const std::string& path);
  ~event_log();

  /// Writes one line and flushes it. Thread-safe.
  void emit(std::string_view event, const event_fields& fields = {});

private:
  std::mutex mu_;
  std::FILE* out_ = nullptr;
  bool owned_ = false;
};

} // namespace cmesh::actors
