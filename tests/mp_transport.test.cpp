// Real processes exchanging messages over UCX on this machine.
#include "node_harness.hpp"

#include <csignal>
#include <sstream>
#include <thread>
#include <vector>

using namespace cmesh;
using namespace cmesh::testing;
using namespace std::chrono_literals;

namespace {

void all_exit_zero(node_harness& h) {
  auto st = h.finish();
  for (size_t r = 0; r < st.size(); ++r) {
    CAPTURE(r);
    REQUIRE(st[r].has_value());
    CHECK(describe_wait_status(*st[r]) == "exit 0");
  }
}

struct down_report {
  uint32_t rank = 0;
  std::string reason;
  int64_t mono_ns = 0;
};

down_report parse_down(const wire::report& r) {
  down_report d;
  std::istringstream in(r.value);
  in >> d.rank >> d.reason >> d.mono_ns;
  return d;
}

} // namespace

namespace {

/// Runs `scenario` on 2 and then 4 nodes; every rank must report `key` with
/// the value `expected`, and every node exit 0. These check order and
/// integrity, not failure detection: with the suite's other multi-process
/// tests on the same two cores a node can be off the CPU for seconds, so
/// the send-queue and heartbeat bounds are far from the defaults.
void every_rank_reports(const std::vector<std::string>& scenario, const std::string& key,
                        const std::string& expected,
                        std::vector<std::pair<std::string, std::string>> env = {}) {
  env.insert(env.end(),
             {{"CMESH_SEND_BLOCK_MS", "30000"}, {"CMESH_HEARTBEAT_TIMEOUT_MS", "10000"}});
  for (uint32_t n : {2u, 4u}) {
    CAPTURE(n);
    node_harness h(n, env);
    h.spawn_all("cmesh_test_node", scenario);
    for (uint32_t r = 0; r < n; ++r) {
      auto rep = h.report(r, key);
      REQUIRE(rep);
      CHECK(rep->value == expected);
    }
    all_exit_zero(h);
  }
}

} // namespace

TEST_CASE("100,000 small messages arrive in order") {
  every_rank_reports({"order", "100000"}, "order", "ok 100000");
}

TEST_CASE("a send queue of 64 frames under 100,000 messages: senders wait for space, none fails") {
  // The queue is full nearly all the time, and each drain of it wakes the
  // waiting senders: the occupancy they see must never dip while a drained
  // batch moves to the per-peer queues (a sender once took such a dip for
  // space, found the queue full again and failed at once, long before its
  // 30 s wait was over).
  every_rank_reports({"order", "100000"}, "order", "ok 100000", {{"CMESH_SEND_QUEUE_MAX", "64"}});
}

TEST_CASE("actors run on the transport thread: 100,000 messages and their acks in order") {
  every_rank_reports({"inline", "100000"}, "inline", "ok 100000 / ok 100000");
}

TEST_CASE("a 256 MiB payload arrives intact") {
  every_rank_reports({"payload", std::to_string(256u << 20)}, "payload",
                     "ok " + std::to_string(256u << 20));
}

namespace {

// Kills (or stops) `victim` once everyone is ready; the survivors must see
// `expected` for it within `bound` and still answer each other.
void check_loss(uint32_t n, uint32_t victim, int sig, errc expected, std::chrono::milliseconds bound,
                std::vector<std::pair<std::string, std::string>> env = {}) {
  node_harness h(n, std::move(env));
  h.spawn_all("cmesh_test_node", {"survive", std::to_string(victim)});
  for (uint32_t r = 0; r < n; ++r)
    REQUIRE(h.report(r, "ready"));
  std::this_thread::sleep_for(300ms); // heartbeats flowing both ways
  auto t_kill = mono_ns();
  REQUIRE(h.node(victim).signal(sig));
  for (uint32_t r = 0; r < n; ++r) {
    if (r == victim)
      continue;
    CAPTURE(r);
    auto rep = h.report(r, "down", bound + 10s);
    REQUIRE(rep);
    auto d = parse_down(*rep);
    CHECK(d.rank == victim);
    CHECK(d.reason == std::string(to_string(expected)));
    auto latency = std::chrono::nanoseconds(d.mono_ns - t_kill);
    MESSAGE("rank " << r << " saw " << d.reason << " after "
                    << std::chrono::duration_cast<std::chrono::milliseconds>(latency).count()
                    << " ms");
    CHECK(latency < bound);
    auto served = h.report(r, "serving", 30s);
    REQUIRE(served);
    CHECK(served->value == "ok " + std::to_string(n - 2));
  }
  if (sig == SIGSTOP)
    h.node(victim).signal(SIGCONT);
  h.node(victim).kill_and_reap();
}

} // namespace

TEST_CASE("SIGKILL of a peer: survivors see peer_lost in time and keep serving") {
  // A death is noticed by the endpoint (milliseconds), far ahead of the
  // heartbeat bound; the bound here only guards against hangs on a busy CI.
  check_loss(3, 1, SIGKILL, errc::peer_lost, 1500ms);
  check_loss(4, 3, SIGKILL, errc::peer_lost, 1500ms);
}

TEST_CASE("SIGSTOP of a peer: the heartbeat bound fires") {
  // Default heartbeat timeout (800 ms): the report must come after it and well
  // before a hang would.
  check_loss(3, 2, SIGSTOP, errc::peer_unresponsive, 4000ms);
}

TEST_CASE("a peer whose send queue stays full is fenced: its monitors see queue_full") {
  // Heartbeats far longer than the backpressure wait, so the full queue is
  // what ends it; a small queue of 64 KiB blobs fills in milliseconds.
  node_harness h(2, {{"CMESH_HEARTBEAT_TIMEOUT_MS", "30000"},
                     {"CMESH_SEND_QUEUE_MAX", "64"},
                     {"CMESH_SEND_BLOCK_MS", "300"}});
  h.spawn_all("cmesh_test_node", {"flood"});
  for (uint32_t r = 0; r < 2; ++r)
    REQUIRE(h.report(r, "ready"));
  REQUIRE(h.node(1).signal(SIGSTOP)); // before rank 0 starts sending (1 s)
  auto rep = h.report(0, "down", 30s);
  h.node(1).signal(SIGCONT);
  REQUIRE(rep);
  auto d = parse_down(*rep);
  CHECK(d.rank == 1);
  CHECK(d.reason == std::string(to_string(errc::queue_full)));
  auto flood = h.report(0, "flood", 30s);
  REQUIRE(flood);
  MESSAGE("messages sent before the fence: " << flood->value);
  h.node(1).kill_and_reap();
}
