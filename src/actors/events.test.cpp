#include "actors/events.hpp"

#include <doctest/doctest.h>

#include <cstdio>
#include <fstream>
#include <string>
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
