// JSON-lines events: one object per line, so that failures and recoveries
// can be measured from outside the process.
//
//   {"ts":1764690000.123,"mono_ms":81234.5,"event":"epoch","epoch":3,...}
//
// ts is the wall clock (seconds since the Unix epoch); mono_ms is
// CLOCK_MONOTONIC in milliseconds, the same clock in every process on one
// machine (core/env.hpp mono_ns), so a test or benchmark that sends a signal
// can time what follows from its own monotonic timestamp.
//
// Writing never blocks the caller: emit() and print() stamp and format the
// line, then queue it (bounded) for a writer thread of the log's own. The
// epoch manager emits while it holds its lock; a write that the kernel throttles
// (a slow disk, a full pipe on stdout) used to stall its decisions with it.
// When the queue is full a line is dropped and counted, and the writer says
// how many at its next write ("events_dropped").
#pragma once

#include "core/error.hpp"

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
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
  /// Lines queued and not yet written, at most.
  static constexpr size_t default_max_queued = 8192;

  /// "-": stdout; "": nowhere (events are dropped); otherwise a file
  /// (appended). Text lines (print) go to stdout. Error: invalid_argument
  /// naming the path.
  static expected<std::shared_ptr<event_log>> open(const std::string& path,
                                                   size_t max_queued = default_max_queued);
  /// Over streams the caller owns and keeps open for the log's life (either
  /// may be null: its lines are dropped).
  static std::shared_ptr<event_log> over(std::FILE* events, std::FILE* text,
                                         size_t max_queued = default_max_queued);

  event_log(std::FILE* events, bool owned, std::FILE* text, size_t max_queued);
  event_log(const event_log&) = delete;
  event_log& operator=(const event_log&) = delete;
  /// Writes what is queued, then stops the writer.
  ~event_log();

  /// Queues one event line, stamped now. Thread-safe; never waits on I/O.
  void emit(std::string_view event, const event_fields& fields = {});
  /// Queues one line of text (no newline) for the text stream, in order
  /// with the events. Thread-safe; never waits on I/O.
  void print(std::string line);
  /// Queues one line for the process's log (spdlog, level info), in order
  /// with the rest: the writer thread hands it to the logger, whose sinks
  /// may block. Thread-safe; never waits on I/O.
  void note(std::string line);
  /// Waits until everything queued before the call is written and flushed;
  /// false if `timeout` passed first.
  bool flush(std::chrono::milliseconds timeout);
  /// Lines dropped so far because the queue was full.
  uint64_t dropped() const;

private:
  struct line {
    std::FILE* to; // null: the process's log
    std::string text;
  };
  void enqueue(std::FILE* to, std::string text);
  void write_loop();

  std::FILE* events_ = nullptr;
  bool owned_ = false;
  std::FILE* text_ = nullptr;
  size_t max_queued_;

  mutable std::mutex mu_;
  std::condition_variable wake_, written_cv_;
  std::deque<line> queue_;
  uint64_t queued_ = 0;  // lines accepted so far
  uint64_t written_ = 0; // of those, written and flushed
  uint64_t dropped_ = 0;
  uint64_t dropped_told_ = 0;
  bool stopping_ = false;
  std::thread writer_;
};

} // namespace cmesh::actors
