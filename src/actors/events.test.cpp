#include "actors/events.hpp"

#include <doctest/doctest.h>
#include <spdlog/sinks/base_sink.h>
#include <spdlog/spdlog.h>

#include <condition_variable>
#include <mutex>
#include <vector>

#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <fcntl.h>
#include <unistd.h>

using namespace cmesh::actors;

TEST_CASE("events: JSON strings are escaped") {
  CHECK(json_quote("plain") == "\"plain\"");
  CHECK(json_quote("a\"b\\c") == "\"a\\\"b\\\\c\"");
  CHECK(json_quote("line\nnext\ttab") == "\"line\\nnext\\ttab\"");
  CHECK(json_quote(std::string("\x01", 1)) == "\"\\u0001\"");
}

TEST_CASE("events: one object per line with every field") {
  auto line = format_event("epoch",
                           {{"epoch", uint64_t{3}},
                            {"members", std::vector<uint32_t>{0, 2}},
                            {"delta", int64_t{-4}},
                            {"member", true},
                            {"ratio", 0.5},
                            {"reason", std::string("g1 \"lost\"")}},
                           1764690000.25, 81234.5);
  CHECK(line == "{\"ts\":1764690000.250,\"mono_ms\":81234.500,\"event\":\"epoch\",\"epoch\":3,"
                "\"members\":[0,2],\"delta\":-4,\"member\":true,\"ratio\":0.500,"
                "\"reason\":\"g1 \\\"lost\\\"\"}");
}

TEST_CASE("events: a log file gets whole lines; a bad path is a typed error") {
  std::string path = "/tmp/cmesh_events_" + std::to_string(getpid()) + ".jsonl";
  std::remove(path.c_str());
  {
    auto log = event_log::open(path);
    REQUIRE(log);
    (*log)->emit("registered", {{"rank", uint64_t{1}}});
    (*log)->emit("failed", {{"reason", std::string("every group is dead")}});
  }
  std::ifstream in(path);
  std::string a, b, c;
  REQUIRE(std::getline(in, a));
  REQUIRE(std::getline(in, b));
  CHECK_FALSE(std::getline(in, c));
  CHECK(a.find("\"event\":\"registered\",\"rank\":1}") != std::string::npos);
  CHECK(b.find("\"reason\":\"every group is dead\"") != std::string::npos);
  std::remove(path.c_str());
  auto bad = event_log::open("/nonexistent-dir/x/events.jsonl");
  REQUIRE_FALSE(bad);
  CHECK(cmesh::code_of(bad.error()) == cmesh::errc::invalid_argument);
  // "" drops events without failing.
  auto none = event_log::open("");
  REQUIRE(none);
  (*none)->emit("anything");
}

TEST_CASE("events: a writer that cannot write never blocks the caller; a full queue drops and "
          "says so") {
  // A pipe nobody reads until the end: its buffer is full, and the writer
  // thread blocks in its write, as on a throttled disk or a full stdout.
  int fds[2];
  REQUIRE(pipe(fds) == 0);
  // Fill the pipe first, so that the writer blocks on its first flush
  // (else it could fit in the buffer what the bounded queue accepted).
  size_t prefill = 0;
  {
    int flags = fcntl(fds[1], F_GETFL);
    REQUIRE(fcntl(fds[1], F_SETFL, flags | O_NONBLOCK) == 0);
    const std::string hashes(4096, '#');
    for (;;) {
      auto n = write(fds[1], hashes.data(), hashes.size());
      if (n <= 0)
        break;
      prefill += static_cast<size_t>(n);
    }
    REQUIRE(fcntl(fds[1], F_SETFL, flags) == 0);
  }
  REQUIRE(prefill > 0);
  std::FILE* w = fdopen(fds[1], "w");
  REQUIRE(w);
  constexpr size_t bound = 64;
  const std::string pad(200, 'x');
  uint64_t dropped = 0;
  {
    auto log = event_log::over(w, w, bound);
    // 4000 lines of ~300 bytes, 1.2 MB: far past the pipe's buffer. Each
    // call returns though the writer is stuck (a hang here fails by the
    // test's timeout).
    for (int i = 0; i < 4000; ++i) {
      log->emit("step", {{"i", int64_t{i}}, {"pad", pad}});
      if (i % 100 == 0)
        log->print("text line " + std::to_string(i));
    }
    dropped = log->dropped();
    CHECK(dropped > 0);
    CHECK_FALSE(log->flush(std::chrono::milliseconds(50)));
    // Drain the pipe on another thread so that the rest can be written.
    std::string all;
    std::thread reader([fd = fds[0], &all] {
      char buf[65536];
      for (;;) {
        auto n = read(fd, buf, sizeof buf);
        if (n <= 0)
          break;
        all.append(buf, static_cast<size_t>(n));
      }
    });
    CHECK(log->flush(std::chrono::seconds(30)));
    CHECK(log->dropped() == dropped);
    log.reset();
    std::fclose(w);
    reader.join();
    close(fds[0]);
    // Whole lines, the first event first, and the dropped lines counted.
    REQUIRE(all.size() > prefill);
    CHECK(all.find_first_not_of('#') == prefill);
    all.erase(0, prefill);
    CHECK(all.rfind("{\"ts\":", 0) == 0);
    CHECK(all.back() == '\n');
    CHECK(all.find("\"event\":\"step\",\"i\":0,") != std::string::npos);
    CHECK(all.find("text line 0\n") != std::string::npos);
    uint64_t told = 0, notices = 0, lines = 0;
    const std::string key = "\"event\":\"events_dropped\",\"count\":";
    for (size_t at = all.find(key); at != std::string::npos; at = all.find(key, at + 1)) {
      told += std::stoull(all.substr(at + key.size()));
      ++notices;
    }
    for (char c : all)
      lines += c == '\n';
    CHECK(told == dropped);
    // Every line given was written or counted as dropped, plus the notices.
    CHECK(lines == 4000 + 40 - dropped + notices);
  }
}

namespace {

/// A logger sink that holds every write until it is opened: a log whose
/// sinks block (a slow disk, a full pipe on stderr).
class gated_sink : public spdlog::sinks::base_sink<std::mutex> {
public:
  void open() {
    std::lock_guard lk(gate_mu_);
    open_ = true;
    gate_.notify_all();
  }
  std::vector<std::string> lines() {
    std::lock_guard lk(gate_mu_);
    return lines_;
  }

protected:
  void sink_it_(const spdlog::details::log_msg& msg) override {
    std::unique_lock lk(gate_mu_);
    gate_.wait(lk, [&] { return open_; });
    lines_.emplace_back(msg.payload.data(), msg.payload.size());
  }
  void flush_() override {}

private:
  std::mutex gate_mu_;
  std::condition_variable gate_;
  bool open_ = false;
  std::vector<std::string> lines_;
};

} // namespace

TEST_CASE("events: lines for the process's log go through the writer, in order, and never block "
          "the caller") {
  auto sink = std::make_shared<gated_sink>();
  auto before = spdlog::default_logger();
  spdlog::set_default_logger(std::make_shared<spdlog::logger>("gated", sink));
  {
    auto log = event_log::over(nullptr, nullptr, 16);
    // The writer takes the first line and blocks in the sink; every later
    // call still returns (a hang here fails by the test's timeout), and
    // past the bound lines are dropped and counted.
    for (int i = 0; i < 200; ++i)
      log->note("line " + std::to_string(i));
    CHECK(log->dropped() > 0);
    CHECK_FALSE(log->flush(std::chrono::milliseconds(50)));
    sink->open();
    CHECK(log->flush(std::chrono::seconds(30)));
    auto got = sink->lines();
    REQUIRE_FALSE(got.empty());
    CHECK(got.front() == "line 0");
    CHECK(got.size() == 200 - log->dropped());
    for (size_t k = 1; k < got.size(); ++k) // in order, gaps only where dropped
      CHECK(std::stoi(got[k].substr(5)) > std::stoi(got[k - 1].substr(5)));
  }
  spdlog::set_default_logger(before);
}
