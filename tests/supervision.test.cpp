// Supervision and recovery end to end: real `cmesh launch` jobs, real
// SIGKILL / SIGSTOP from the launcher's chaos plan, the event log read back.
//
// The proof that no step is lost or applied twice: in exact mode every run
// with kills ends with final weights bit-identical to a run without them.
#include "node_harness.hpp"

#include <csignal>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

using namespace cmesh;
using namespace cmesh::testing;
using namespace std::chrono_literals;

namespace {

constexpr int steps = 100;

struct event {
  std::string name;
  std::string line;
  std::string field(const std::string& key) const {
    std::smatch m;
    std::regex re("\"" + key + "\":(\"[^\"]*\"|\\[[^\\]]*\\]|[-0-9.a-z]+)");
    return std::regex_search(line, m, re) ? m[1].str() : std::string{};
  }
  int64_t num(const std::string& key) const {
    auto f = field(key);
    return f.empty() ? -1 : std::stoll(f);
  }
};

std::vector<event> read_events(const std::string& path) {
  std::vector<event> out;
  std::ifstream in(path);
  std::string line;
  std::regex re("\"event\":\"([a-z_]+)\"");
  while (std::getline(in, line)) {
    std::smatch m;
    REQUIRE_MESSAGE(std::regex_search(line, m, re), "not an event line: " << line);
    REQUIRE(line.front() == '{');
    REQUIRE(line.back() == '}');
    out.push_back({m[1].str(), line});
  }
  return out;
}

/// Index of the first event at or after `from` named `name` for which
/// `pred` holds, or -1.
template <class Pred>
int find_event(const std::vector<event>& ev, size_t from, const std::string& name, Pred pred) {
  for (size_t i = from; i < ev.size(); ++i)
    if (ev[i].name == name && pred(ev[i]))
      return static_cast<int>(i);
  return -1;
}

std::vector<std::string> weights_of(const std::string& out) {
  return done_weights(out, steps);
}

struct job {
  run_result r;
  std::vector<event> events;
};

/// A job of `n` steps, in exact mode unless `exact` is false.
job launch(const std::string& args, bool exact = true, int n = steps,
           const std::vector<std::pair<std::string, std::string>>& env = {}) {
  auto path = "/tmp/cmesh_recovery_" + std::to_string(getpid()) + ".jsonl";
  std::remove(path.c_str());
  job j;
  j.r = run_cmesh(std::string("launch ") + (exact ? "--exact " : "") + "--steps "
                    + std::to_string(n) + " --log-every 20 --events " + path + " " + args,
                  env, 300s);
  j.events = read_events(path);
  std::remove(path.c_str());
  return j;
}

/// The weights of the run without failures (exact mode: any layout).
const std::string& reference_weights() {
  static std::string w = [] {
    auto j = launch("-n 1");
    INFO(j.r.output);
    REQUIRE(j.r.exit_code == 0);
    auto ws = weights_of(j.r.output);
    REQUIRE(ws.size() == 1);
    return ws[0];
  }();
  return w;
}

void check_identical(const job& j, size_t ranks_done) {
  auto ws = weights_of(j.r.output);
  CHECK(ws.size() == ranks_done);
  for (auto& w : ws)
    CHECK(w == reference_weights());
}

/// The job's recovery summary (its last line and the event log's
/// "recovery_summary") agrees with the events the log holds.
void check_summary(const job& j, int64_t divergences = 0) {
  const auto& ev = j.events;
  int at = find_event(ev, 0, "recovery_summary", [](auto&) { return true; });
  REQUIRE(at >= 0);
  const auto& s = ev[at];
  auto count = [&](const std::string& name, auto pred) {
    int64_t n = 0;
    for (size_t i = 0; i < static_cast<size_t>(at); ++i)
      n += ev[i].name == name && pred(ev[i]) ? 1 : 0;
    return n;
  };
  auto any = [](auto&) { return true; };
  CHECK(s.num("epochs") == count("epoch", any));
  CHECK(s.num("ranks_lost")
        == count("worker_lost", [](auto& e) { return e.field("member") == "true"; }));
  CHECK(s.num("catchups") == count("catchup_start", any));
  CHECK(s.num("rejoined") == count("catchup_end", any));
  // One resolved failure per first commit that followed a failure.
  CHECK(s.num("failures_resolved") >= (s.num("ranks_lost") > 0 ? 1 : 0));
  CHECK(s.num("failures_resolved") == count("first_commit", [](auto& e) {
    return e.num("since_failure_ms") >= 0;
  }));
  CHECK(s.num("failure_to_commit_p50_ms") >= 0);
  CHECK(s.num("failure_to_commit_max_ms") >= s.num("failure_to_commit_p50_ms"));
  CHECK(s.num("rejoin_max_ms") >= s.num("rejoin_p50_ms"));
  // Replica verification: no false alarm across kills, stops and faults.
  CHECK(s.num("divergences") == divergences);
  CHECK(count("replica_divergence", any) == divergences);
  auto line = captures(j.r.output, "cmesh: recovery: ([0-9]+) rank\\(s\\) lost");
  REQUIRE(line.size() == 1);
  CHECK(std::stoll(line[0]) == s.num("ranks_lost"));
}

} // namespace

TEST_CASE("SIGKILL a rank: the survivors go on, the restarted rank catches up and rejoins") {
  // The catch-up's threads run at a lower priority here (--catchup-nice).
  auto j = launch("-n 3 --restart-delay-ms 200 --chaos kill@5:1 --catchup-nice 5");
  INFO(j.r.output);
  REQUIRE(j.r.exit_code == 0);
  auto& ev = j.events;
  // The sequence: chaos kill -> rank 1 lost -> an epoch without it -> the
  // survivors' first commit -> restart -> catch-up -> an epoch with it.
  int kill = find_event(ev, 0, "chaos", [](auto& e) { return e.field("signal") == "\"SIGKILL\""; });
  REQUIRE(kill >= 0);
  int lost = find_event(ev, kill, "worker_lost", [](auto& e) {
    return e.num("rank") == 1 && e.field("member") == "true";
  });
  REQUIRE(lost >= 0);
  int shrink = find_event(ev, lost, "epoch", [](auto& e) { return e.field("left") == "[1]"; });
  REQUIRE(shrink >= 0);
  CHECK(ev[shrink].field("members") == "[0,2]");
  int commit = find_event(ev, shrink, "first_commit", [](auto&) { return true; });
  REQUIRE(commit >= 0);
  auto since_failure = ev[commit].num("since_failure_ms");
  MESSAGE("kill -> survivors' next commit: " << since_failure << " ms");
  CHECK(since_failure >= 0);
  CHECK(since_failure < 10000); // a bound that catches hangs, not a timing goal
  int start = find_event(ev, shrink, "catchup_start", [](auto& e) { return e.num("rank") == 1; });
  REQUIRE(start >= 0);
  int ready = find_event(ev, start, "catchup_ready", [](auto& e) { return e.num("rank") == 1; });
  REQUIRE(ready >= 0);
  int grow = find_event(ev, ready, "epoch", [](auto& e) { return e.field("joined") == "[1]"; });
  REQUIRE(grow >= 0);
  CHECK(ev[grow].field("members") == "[0,1,2]");
  CHECK(find_event(ev, grow, "catchup_end", [](auto& e) { return e.num("rank") == 1; }) >= 0);
  // The actor mesh followed the membership: each survivor dialled the other
  // two members, lost rank 1's first incarnation and dialled its second; the
  // restarted rank dialled the two survivors. (A slow run, under the
  // sanitizers, may also see a live peer silent past the heartbeat bound:
  // more losses, never fewer connections.)
  auto mesh_of = [&](int rank, const char* field) {
    auto v = captures(j.r.output, "rank " + std::to_string(rank) + " stats .* " + field
                                    + "=([0-9]+)");
    return v.size() == 1 ? std::stoll(v[0]) : -1;
  };
  CHECK(mesh_of(0, "mesh_connected") == 3);
  CHECK(mesh_of(2, "mesh_connected") == 3);
  CHECK(mesh_of(1, "mesh_connected") == 2);
  CHECK(mesh_of(0, "mesh_lost") >= 1);
  CHECK(mesh_of(2, "mesh_lost") >= 1);
  // Exactly once: the final weights of all three equal the run without kills.
  check_identical(j, 3);
  check_summary(j);
  int sum = find_event(ev, 0, "recovery_summary", [](auto&) { return true; });
  CHECK(ev[sum].num("ranks_lost") == 1);
  CHECK(ev[sum].num("rejoined") == 1);
  CHECK(ev[sum].num("failures_resolved") >= 1);
}

TEST_CASE("2 groups x 2 ranks: SIGKILL one rank; the other group goes on, the group rejoins") {
  auto j = launch("-n 4 --replicas 2 --restart-delay-ms 200 --chaos kill@5:3");
  INFO(j.r.output);
  REQUIRE(j.r.exit_code == 0);
  auto& ev = j.events;
  // Rank 3 dies: its whole group (ranks 2 and 3) leaves the epoch, rank 2
  // is fenced; group 0 commits on; both ranks of group 1 restart, each
  // catches up from the member holding its shard, and the group rejoins.
  int kill = find_event(ev, 0, "chaos", [](auto& e) { return e.field("signal") == "\"SIGKILL\""; });
  REQUIRE(kill >= 0);
  int shrink = find_event(ev, kill, "epoch", [](auto& e) { return e.field("left") == "[2,3]"; });
  REQUIRE(shrink >= 0);
  CHECK(ev[shrink].field("members") == "[0,1]");
  int commit = find_event(ev, shrink, "first_commit", [](auto&) { return true; });
  REQUIRE(commit >= 0);
  MESSAGE("2x2: kill -> survivors' next commit: " << ev[commit].num("since_failure_ms") << " ms");
  CHECK(ev[commit].num("since_failure_ms") < 10000); // catches hangs, not a timing goal
  for (int64_t r : {2, 3}) {
    CAPTURE(r);
    int start = find_event(ev, shrink, "catchup_start", [&](auto& e) { return e.num("rank") == r; });
    REQUIRE(start >= 0);
    CHECK(ev[start].num("source") == r - 2); // the same position in group 0
  }
  int grow = find_event(ev, shrink, "epoch", [](auto& e) { return e.field("joined") == "[2,3]"; });
  REQUIRE(grow >= 0);
  CHECK(ev[grow].field("members") == "[0,1,2,3]");
  check_identical(j, 4);
}

TEST_CASE("the device path: a killed group's loss aborts the device collectives, it rejoins") {
  // --device emulated: the gradient is summed by the epoch's device
  // communicators (the host backend over the emulated device): the
  // shard's holders' (everyone, with groups of one rank) and, with groups
  // of two, the group's. A kill must abort them like the epoch's other
  // communicators, and every epoch (the survivors', the grown one) builds
  // its own.
  std::string args, left, everyone;
  size_t ranks = 0, slots = 1;
  SUBCASE("3 groups of one rank") {
    args = "-n 3 --chaos kill@5:1";
    left = "[1]";
    everyone = "[0,1,2]";
    ranks = 3;
  }
  SUBCASE("2 groups of two ranks") {
    args = "-n 4 --replicas 2 --chaos kill@5:3";
    left = "[2,3]";
    everyone = "[0,1,2,3]";
    ranks = 4;
    slots = 2;
  }
  CAPTURE(args);
  // Not exact, a step takes a few milliseconds: long enough a run that the
  // restarted group rejoins before the end on a busy machine too.
  constexpr int long_run = 400;
  // Every step verified: replicas agree bit for bit on the device path.
  auto j = launch(args + " --device emulated --restart-delay-ms 200 --verify-every 1", false,
                  long_run);
  INFO(j.r.output);
  REQUIRE(j.r.exit_code == 0);
  CHECK(find_event(j.events, 0, "replica_divergence", [](auto&) { return true; }) < 0);
  CHECK(j.r.output.find("gradients summed on the device") != std::string::npos);
  auto& ev = j.events;
  int shrink = find_event(ev, 0, "epoch", [&](auto& e) { return e.field("left") == left; });
  REQUIRE(shrink >= 0);
  int commit = find_event(ev, shrink, "first_commit", [](auto&) { return true; });
  REQUIRE(commit >= 0);
  CHECK(ev[commit].num("since_failure_ms") < 10000); // catches hangs, not a timing goal
  int grow = find_event(ev, commit, "epoch", [&](auto& e) { return e.field("joined") == left; });
  REQUIRE(grow >= 0);
  CHECK(ev[grow].field("members") == everyone);
  // Rank 0 built its device communicators for each epoch it was in: the
  // first, the survivors', the grown one.
  auto built = captures(j.r.output, "rank 0 built epoch ([0-9]+)'s device communicator");
  CHECK(built.size() >= 3 * slots);
  CHECK(std::set<std::string>(built.begin(), built.end()).size() * slots == built.size());
  // One set of weights: the rejoined ranks applied every committed update.
  auto ws = done_weights(j.r.output, long_run);
  CHECK(ws.size() == ranks);
  CHECK(std::set<std::string>(ws.begin(), ws.end()).size() == 1);
}

TEST_CASE("2x2 with experts split over each group's ranks: kills, catch-up, one set of weights") {
  // Not exact mode: experts run on their owners (all_to_allv inside the
  // step), and a failure in the middle of an exchange votes the step down.
  // With full sharding the weights and gradients also stream through the
  // group inside the step: a kill lands in the middle of those too. With
  // resident experts a restarted rank's catch-up brings its own experts.
  for (std::string keys : {"sharding = \"optimizer\"", "sharding = \"full\"",
                           "experts = \"resident\""}) {
    CAPTURE(keys);
    const bool full = keys == "sharding = \"full\"";
    auto base = "/tmp/cmesh_recovery_ep_" + std::to_string(getpid());
    std::ofstream(base + ".toml") << "[train]\n" << keys << "\n";
    // Every step verified: replicas agree bit for bit outside exact mode.
    auto r = run_cmesh("launch -n 4 --replicas 2 --steps 100 --log-every 20 --restart-delay-ms 200 "
                       "--verify-every 1 --chaos kill@10:1,kill@70:2? --config " + base
                         + ".toml --events " + base + ".jsonl",
                       {}, 300s);
    auto ev = read_events(base + ".jsonl");
    std::remove((base + ".jsonl").c_str());
    std::remove((base + ".toml").c_str());
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    CHECK(r.output.find("experts split over the 2 ranks") != std::string::npos);
    if (full)
      CHECK(r.output.find("weights and gradients streamed over the 2 ranks") != std::string::npos);
    if (keys == "experts = \"resident\"")
      CHECK(r.output.find("resident experts: this rank holds 2 of 4 experts") != std::string::npos);
    int kills = 0, grows = 0;
    for (auto& e : ev) {
      kills += e.name == "chaos" ? 1 : 0;
      grows += e.name == "epoch" && e.field("joined").size() > 2 ? 1 : 0;
    }
    CHECK(find_event(ev, 0, "replica_divergence", [](auto&) { return true; }) < 0);
    CHECK(kills >= 1); // the second is skipped if group 0 is not back by then
    CHECK(grows >= 2); // the first epoch, and the restarted group's return
    auto ws = captures(r.output, "done \\(steps=100 .*weights=([0-9a-f]{16})\\)");
    CHECK(!ws.empty());
    CHECK(std::set<std::string>(ws.begin(), ws.end()).size() == 1);
  }
}

TEST_CASE("exact mode: seeded random kills and stops, a kill of a catch-up source, weights "
          "bit-identical") {
  auto seed = test_seed();
  MESSAGE("chaos seed " << seed << " (CMESH_SEED=" << seed << " replays it)");
  // Every step verified: no false alarm, whatever the kills and stops do.
  auto j = launch("-n 3 --restart-delay-ms 100 --max-restarts 20 --verify-every 1 "
                  "--chaos kill@4:1,kill-source@5 "
                  "--chaos-kills 2 --chaos-stops 2 --chaos-first-step 20 --chaos-seed "
                  + std::to_string(seed));
  INFO(j.r.output);
  REQUIRE(j.r.exit_code == 0);
  int source_kill = find_event(j.events, 0, "chaos", [](auto& e) {
    return e.field("signal") == "\"SIGKILL (catch-up source)\"";
  });
  CHECK(source_kill >= 0);
  // The plan drew two stops of 750 to 3000 ms (half to twice the default
  // 1500 ms heartbeat timeout); each one sent is continued.
  auto plan = captures(j.r.output, "chaos plan ([^ ]+) \\(seed");
  REQUIRE(plan.size() == 1);
  auto lengths = captures(plan[0], "stop@[0-9]+:[0-9]+:([0-9]+)\\?");
  CHECK(lengths.size() == 2);
  for (auto& ms : lengths) {
    CHECK(std::stoi(ms) >= 750);
    CHECK(std::stoi(ms) <= 3000);
  }
  size_t kills = 0, stops = 0;
  for (auto& e : j.events) {
    if (e.name != "chaos")
      continue;
    kills += e.field("signal").find("SIGKILL") != std::string::npos ? 1 : 0;
    stops += e.field("signal") == "\"SIGSTOP\"" ? 1 : 0;
  }
  MESSAGE(kills << " kills, " << stops << " stops");
  CHECK(kills >= 2);
  check_summary(j);
  auto ws = weights_of(j.r.output);
  REQUIRE(!ws.empty());
  for (auto& w : ws)
    CHECK(w == reference_weights());
}

namespace {

/// The step at which the flipped rank's trainer flipped its bit.
int64_t flipped_at(const std::string& output) {
  auto at = captures(output, "chaos flip: bit 0 of weight [0-9]+ \\([^)]*\\) flipped at step "
                             "([0-9]+)");
  REQUIRE(at.size() == 1);
  return std::stoll(at[0]);
}

} // namespace

TEST_CASE("replica verification: a flipped bit is caught, its group fenced and restarted, the "
          "weights are the reference's") {
  // Every step verified: the flip is caught in the step that first computes
  // with it, before any update made from it is committed.
  std::string args, left, shard;
  int64_t flipped = 0;
  size_t ranks = 0;
  SUBCASE("3 groups of one rank") {
    args = "-n 3 --chaos flip@5:1";
    flipped = 1, ranks = 3, left = "[1]", shard = "[0]";
  }
  SUBCASE("3 groups of two ranks: the group of the flipped rank leaves whole") {
    args = "-n 6 --replicas 3 --chaos flip@5:3";
    flipped = 3, ranks = 6, left = "[2,3]", shard = "[1]";
  }
  CAPTURE(args);
  auto j = launch(args + " --restart-delay-ms 100 --verify-every 1");
  INFO(j.r.output);
  REQUIRE(j.r.exit_code == 0);
  auto& ev = j.events;
  int div = find_event(ev, 0, "replica_divergence", [](auto&) { return true; });
  REQUIRE(div >= 0);
  CHECK(ev[div].num("step") == flipped_at(j.r.output));
  CHECK(ev[div].field("groups") == "[1]");
  CHECK(ev[div].field("ranks") == left);
  CHECK(ev[div].field("shards") == shard);
  CHECK(ev[div].field("no_majority") == "false");
  CHECK(ev[div].field("tensors").find("rank " + std::to_string(flipped) + " (group 1): ")
        != std::string::npos);
  CHECK(ev[div].field("tensors").find("(weights)") != std::string::npos);
  // Only one report, and no other divergence afterwards.
  CHECK(find_event(ev, div + 1, "replica_divergence", [](auto&) { return true; }) < 0);
  int lost = find_event(ev, div, "worker_lost", [&](auto& e) {
    return e.num("rank") == flipped && e.field("reason").find("diverged") != std::string::npos;
  });
  REQUIRE(lost >= 0);
  int shrink = find_event(ev, lost, "epoch", [&](auto& e) { return e.field("left") == left; });
  REQUIRE(shrink >= 0);
  int exit = find_event(ev, shrink, "worker_exit", [&](auto& e) {
    return e.num("rank") == flipped && e.field("status").find("fenced") != std::string::npos;
  });
  REQUIRE(exit >= 0);
  CHECK(find_event(ev, exit, "epoch", [&](auto& e) { return e.field("joined") == left; }) >= 0);
  check_summary(j, 1);
  check_identical(j, ranks);
}

TEST_CASE("replica verification every N steps: caught within N steps") {
  constexpr int every = 4;
  auto j = launch("-n 3 --restart-delay-ms 100 --verify-every " + std::to_string(every)
                    + " --chaos flip@9:2",
                  false, 30);
  INFO(j.r.output);
  REQUIRE(j.r.exit_code == 0);
  int div = find_event(j.events, 0, "replica_divergence", [](auto&) { return true; });
  REQUIRE(div >= 0);
  const auto at = j.events[div].num("step"), flip = flipped_at(j.r.output);
  CHECK(at % every == 0);
  CHECK(at >= flip);
  CHECK(at < flip + every);
  CHECK(j.events[div].field("groups") == "[2]");
  // The restarted group rejoins from the majority: one set of weights.
  auto ws = done_weights(j.r.output, 30);
  CHECK(ws.size() == 3);
  CHECK(std::set<std::string>(ws.begin(), ws.end()).size() == 1);
}

TEST_CASE("replica verification with two groups: no majority, the job stops with a clear error") {
  auto j = launch("-n 2 --restart-delay-ms 100 --verify-every 1 --chaos flip@5:1", true, 20);
  INFO(j.r.output);
  CHECK(j.r.exit_code == 1);
  CHECK(j.r.output.find("with no majority to trust") != std::string::npos);
  CHECK(j.r.output.find("restart from checkpoint needed") != std::string::npos);
  int div = find_event(j.events, 0, "replica_divergence", [](auto&) { return true; });
  REQUIRE(div >= 0);
  CHECK(j.events[div].field("no_majority") == "true");
  CHECK(j.events[div].field("groups") == "[]");
  CHECK(find_event(j.events, div, "failed", [](auto&) { return true; }) >= 0);
  CHECK(find_event(j.events, div, "first_commit", [](auto&) { return true; }) < 0);
  CHECK(weights_of(j.r.output).empty());
}

TEST_CASE("checkpoint shadow: every rank's shadow equals its trainer's state at every step, "
          "across a kill and a catch-up") {
  std::string args;
  size_t ranks = 0;
  bool exact = true;
  const auto cfg = "/tmp/cmesh_recovery_shadow_" + std::to_string(getpid()) + ".toml";
  SUBCASE("exact, 3 groups of one rank") {
    args = "-n 3 --chaos kill@5:1";
    ranks = 3;
  }
  SUBCASE("bf16, full sharding, 2 groups of two ranks") {
    std::ofstream(cfg) << "[train]\nprecision = \"bf16\"\nsharding = \"full\"\n";
    args = "-n 4 --replicas 2 --chaos kill@5:3 --config " + cfg;
    ranks = 4;
    exact = false;
  }
  CAPTURE(args);
  auto j = launch(args + " --restart-delay-ms 100 --shadow-check", exact, 40);
  std::remove(cfg.c_str());
  INFO(j.r.output);
  REQUIRE(j.r.exit_code == 0);
  std::regex re("rank ([0-9]+) shadow step=([0-9]+) state=([0-9a-f]+) trainer_step=([0-9]+) "
                "trainer_state=([0-9a-f]+) applied=([0-9]+) seeds=([0-9]+) dropped=([0-9]+) "
                "checked=([0-9]+) mismatches=([0-9]+)");
  std::set<std::string> seen;
  for (auto it = std::sregex_iterator(j.r.output.begin(), j.r.output.end(), re);
       it != std::sregex_iterator(); ++it) {
    const auto& m = *it;
    CAPTURE(m[0].str());
    seen.insert(m[1].str());
    CHECK(m[2].str() == m[4].str()); // at the trainer's last step
    CHECK(m[3].str() == m[5].str()); // with its state, bit for bit
    CHECK(std::stoll(m[10].str()) == 0);
    // Every update it applied was compared; the restarted rank's shadow
    // started from the state it caught up to.
    CHECK(std::stoll(m[9].str()) == std::stoll(m[6].str()));
    CHECK(std::stoll(m[6].str()) >= 1);
  }
  CHECK(seen.size() == ranks);
}

TEST_CASE("SIGSTOP past the heartbeat bound: treated as failed, fenced after SIGCONT") {
  // Found by whichever detector's bound is shorter: a survivor's transport
  // (800 ms) reports it and the coordinator, which has not heard from it
  // for a third of its own bound, agrees; or the coordinator's beacons.
  std::string args, found_by;
  std::vector<std::pair<std::string, std::string>> env;
  SUBCASE("the transport's detector, through a survivor's supervisor") {
    args = "--chaos stop@5:2:2500";
    found_by = "transport lost it (peer_unresponsive";
  }
  SUBCASE("the coordinator's beacons") {
    args = "--heartbeat-timeout-ms 800 --chaos stop@5:2:1500";
    env = {{"CMESH_HEARTBEAT_TIMEOUT_MS", "5000"}};
    found_by = "silent";
  }
  CAPTURE(args);
  auto j = launch("-n 3 --restart-delay-ms 100 " + args, true, steps, env);
  INFO(j.r.output);
  REQUIRE(j.r.exit_code == 0);
  auto& ev = j.events;
  int lost = find_event(ev, 0, "worker_lost", [&](auto& e) {
    return e.num("rank") == 2 && e.field("reason").find(found_by) != std::string::npos;
  });
  REQUIRE(lost >= 0);
  int shrink = find_event(ev, lost, "epoch", [](auto& e) { return e.field("left") == "[2]"; });
  REQUIRE(shrink >= 0);
  // After SIGCONT it learns it was left out and exits fenced; it never
  // committed a step of the epoch it missed, and comes back as a new
  // incarnation that catches up.
  CHECK(j.r.output.find("rank 2 fenced") != std::string::npos);
  int exit = find_event(ev, shrink, "worker_exit", [](auto& e) {
    return e.num("rank") == 2 && e.field("status").find("fenced") != std::string::npos;
  });
  REQUIRE(exit >= 0);
  CHECK(find_event(ev, exit, "epoch", [](auto& e) { return e.field("joined") == "[2]"; }) >= 0);
  check_identical(j, 3);
}

TEST_CASE("a hung computation: the step watchdog ends the rank, the others go on") {
  auto j = launch("-n 3 --restart-delay-ms 100 --step-timeout-ms 1000 --chaos hang@5:1");
  INFO(j.r.output);
  REQUIRE(j.r.exit_code == 0);
  CHECK(j.r.output.find("step watchdog: rank 1 computed for more than 1000 ms")
        != std::string::npos);
  int exit = find_event(j.events, 0, "worker_exit", [](auto& e) {
    return e.num("rank") == 1 && e.field("status").find("watchdog") != std::string::npos;
  });
  REQUIRE(exit >= 0);
  CHECK(find_event(j.events, 0, "epoch", [](auto& e) { return e.field("left") == "[1]"; }) >= 0);
  CHECK(find_event(j.events, exit, "epoch", [](auto& e) { return e.field("joined") == "[1]"; })
        >= 0);
  check_identical(j, 3);
}

TEST_CASE("a trainer actor that dies with an error: its supervisor actor reports the rank, "
          "the others go on") {
  // SIGRTMIN+1 makes rank 1's trainer actor throw at its next step
  // boundary; the supervisor actor that monitors it reports the rank failed
  // and ends the process, which the launcher restarts.
  auto j = launch("-n 3 --restart-delay-ms 100 --chaos crash@5:1");
  INFO(j.r.output);
  REQUIRE(j.r.exit_code == 0);
  CHECK(j.r.output.find("the trainer actor of rank 1 died: crashed: injected crash at step")
        != std::string::npos);
  int exit = find_event(j.events, 0, "worker_exit", [](auto& e) {
    return e.num("rank") == 1 && e.field("status").find("a local actor died") != std::string::npos;
  });
  REQUIRE(exit >= 0);
  CHECK(find_event(j.events, 0, "epoch", [](auto& e) { return e.field("left") == "[1]"; }) >= 0);
  CHECK(find_event(j.events, exit, "epoch", [](auto& e) { return e.field("joined") == "[1]"; })
        >= 0);
  check_identical(j, 3);
}

TEST_CASE("a step that fails with every process alive: the epoch is re-formed, nobody restarts") {
  // SIGUSR2 breaks rank 1's communicators in its next step, as a transport
  // error would. Its peers wait in a collective that cannot complete; the
  // coordinator re-forms the epoch with the same members and they retry.
  auto j = launch("-n 3 --restart-delay-ms 100 --broken-grace-ms 300 --chaos fault@5:1,fault@40:2");
  INFO(j.r.output);
  REQUIRE(j.r.exit_code == 0);
  auto& ev = j.events;
  size_t from = 0;
  for (uint32_t rank : {1u, 2u}) {
    CAPTURE(rank);
    int fault = find_event(ev, from, "chaos", [&](auto& e) {
      return e.num("rank") == rank && e.field("signal") == "\"SIGUSR2 (fault)\"";
    });
    REQUIRE(fault >= 0);
    int broke = find_event(ev, fault, "epoch_broken", [&](auto& e) {
      return e.num("rank") == rank && e.field("current") == "true";
    });
    REQUIRE(broke >= 0);
    CHECK(ev[broke].field("reason").find("injected fault") != std::string::npos);
    int reform = find_event(ev, broke, "epoch", [](auto&) { return true; });
    REQUIRE(reform >= 0);
    CHECK(ev[reform].num("epoch") == ev[broke].num("epoch") + 1);
    CHECK(ev[reform].field("members") == "[0,1,2]");
    CHECK(ev[reform].field("left") == "[]");
    CHECK(ev[reform].field("joined") == "[]");
    CHECK(ev[reform].field("abort_running") == "true");
    CHECK(ev[reform].field("reason").find("re-formed") != std::string::npos);
    int commit = find_event(ev, reform, "first_commit", [](auto&) { return true; });
    REQUIRE(commit >= 0);
    auto since = ev[commit].num("since_failure_ms");
    MESSAGE("report of the broken epoch -> next commit: " << since << " ms");
    CHECK(since >= 300); // the grace, waiting for a death that would explain it
    CHECK(since < 10000); // a bound that catches hangs (30 s collective timeouts), not a goal
    from = static_cast<size_t>(commit);
  }
  // Nobody died, was restarted or caught up.
  for (auto name : {"worker_lost", "restart", "catchup_start"})
    CHECK(find_event(ev, 0, name, [](auto&) { return true; }) < 0);
  check_identical(j, 3);
  check_summary(j);
  int sum = find_event(ev, 0, "recovery_summary", [](auto&) { return true; });
  CHECK(ev[sum].num("reforms") == 2);
  CHECK(ev[sum].num("failures_resolved") == 2);
  CHECK(ev[sum].num("failure_to_commit_p50_ms") >= 300); // the grace, as above
}

TEST_CASE("every group dead, or too many at once: a clear error, nothing committed after") {
  SUBCASE("every group dead") {
    auto j = launch("-n 2 --max-restarts 0 --chaos kill@5:0,kill@5:1");
    INFO(j.r.output);
    CHECK(j.r.exit_code == 1);
    CHECK(j.r.output.find("restart from checkpoint needed") != std::string::npos);
    CHECK(weights_of(j.r.output).empty());
    CHECK(find_event(j.events, 0, "failed", [](auto&) { return true; }) >= 0);
  }
  SUBCASE("two of three groups dead at once with min_replicas 2, none restarted") {
    auto j = launch("-n 3 --max-restarts 0 --min-replicas 2 --chaos kill@5:1,kill@5:2");
    INFO(j.r.output);
    CHECK(j.r.exit_code == 1);
    CHECK(j.r.output.find("restart from checkpoint needed") != std::string::npos);
    // The survivor never commits a step alone (fewer than min_replicas).
    CHECK(weights_of(j.r.output).empty());
    int failed = find_event(j.events, 0, "failed", [](auto&) { return true; });
    REQUIRE(failed >= 0);
    CHECK(find_event(j.events, 0, "epoch", [](auto& e) { return e.field("members") == "[0]"; }) < 0);
  }
  SUBCASE("a step that fails at every retry with everyone alive: an error after --max-reforms") {
    auto j = launch("-n 3 --broken-grace-ms 100 --max-reforms 2 --chaos fault@5:1:3");
    INFO(j.r.output);
    CHECK(j.r.exit_code == 1);
    CHECK(j.r.output.find("re-formed 2 times in a row with no step committed; restart from "
                          "checkpoint needed")
          != std::string::npos);
    CHECK(weights_of(j.r.output).empty());
    size_t reforms = 0;
    for (auto& e : j.events)
      reforms += e.name == "epoch" && e.field("abort_running") == "true" ? 1 : 0;
    CHECK(reforms == 2);
    int failed = find_event(j.events, 0, "failed", [](auto&) { return true; });
    REQUIRE(failed >= 0);
    // Nothing committed after the step that kept failing.
    CHECK(find_event(j.events, 0, "first_commit", [&](auto& e) {
            return e.num("epoch") > 1;
          }) < 0);
  }
  SUBCASE("two of three dead at once, restarted: rebuilt from the survivor") {
    auto j = launch("-n 3 --restart-delay-ms 100 --chaos kill@5:1,kill@5:2");
    INFO(j.r.output);
    REQUIRE(j.r.exit_code == 0);
    check_identical(j, 3);
  }
}

namespace {

/// Waits (at most 60 s) until the file at `path` holds `text`.
void wait_for_text(const std::string& path, const std::string& text) {
  auto t0 = std::chrono::steady_clock::now();
  while (slurp(path).find(text) == std::string::npos
         && std::chrono::steady_clock::now() - t0 < 60s)
    std::this_thread::sleep_for(20ms);
}


} // namespace

TEST_CASE("losing the coordinator: training goes on, a restarted coordinator rebuilds its state") {
  for (bool with_worker : {false, true}) {
    CAPTURE(with_worker);
    auto port = std::to_string(free_port());
    auto base = "/tmp/cmesh_coordloss_" + std::to_string(getpid());
    auto job = "--exact --steps " + std::to_string(steps) + " --log-every 50";
    auto coord = spawn_cmesh("coordinator --port " + port + " -n 3 " + job, base + ".c1");
    auto worker_env = [&](int r) {
      return std::vector<std::pair<std::string, std::string>>{
        {"CMESH_COORDINATOR", "127.0.0.1:" + port},
        {"CMESH_RANK", std::to_string(r)},
        {"CMESH_WORLD_SIZE", "3"}};
    };
    std::vector<child_process> workers;
    for (int r = 0; r < 3; ++r)
      workers.push_back(spawn_cmesh("worker " + job, base + ".w" + std::to_string(r), worker_env(r)));
    // Kill it (and a worker) once training runs.
    wait_for_text(base + ".c1", "committed step");
    std::this_thread::sleep_for(300ms);
    coord.signal(SIGKILL);
    if (with_worker)
      workers[2].signal(SIGKILL);
    REQUIRE(coord.wait(10s));
    if (with_worker)
      REQUIRE(workers[2].wait(10s));
    std::this_thread::sleep_for(500ms);
    // Meanwhile the others keep training (they need no coordinator until
    // their membership changes); then the coordinator comes back on the
    // same port, and the worker is started again, as srun would.
    auto coord2 = spawn_cmesh("coordinator --port " + port + " -n 3 " + job, base + ".c2");
    if (with_worker)
      workers[2] = spawn_cmesh("worker " + job, base + ".w2b", worker_env(2));
    auto st = coord2.wait(240s);
    auto out = slurp(base + ".c2");
    INFO(out);
    REQUIRE(st);
    CHECK(exit_code_of(*st) == 0);
    CHECK(out.find("adopted epoch") != std::string::npos);
    for (auto& w : workers) {
      auto ws = w.wait(30s);
      if (!ws)
        w.kill_and_reap();
      REQUIRE(ws);
      CHECK(exit_code_of(*ws) == 0);
    }
    // Every rank that finished has the weights of the run without faults.
    auto ws = weights_of(out);
    // On a failure: what the workers said (the restarted one's catch-up).
    const auto worker_logs = slurp(base + ".w0") + slurp(base + ".w1")
                             + (with_worker ? slurp(base + ".w2b") : std::string());
    INFO("the workers' logs:\n", worker_logs);
    CHECK(ws.size() == 3);
    for (auto& w : ws)
      CHECK(w == reference_weights());
    for (auto suffix : {".c1", ".c2", ".w0", ".w1", ".w2", ".w2b"})
      std::remove((base + suffix).c_str());
  }
}

TEST_CASE("a stalled coordinator (its process SIGSTOPped): no member is taken for dead") {
  // While the launcher's process is stopped its members' beacons wait
  // unread; on SIGCONT every member looks silent at once. That is the
  // coordinator's own stall, not three hangs: the job goes on.
  auto base = "/tmp/cmesh_stall_" + std::to_string(getpid());
  auto launcher = spawn_cmesh("launch --exact --steps " + std::to_string(steps)
                                + " --log-every 50 -n 3 --heartbeat-timeout-ms 500 --events "
                                + base + ".jsonl",
                              base + ".out");
  wait_for_text(base + ".out", "committed step");
  std::this_thread::sleep_for(100ms);
  launcher.signal(SIGSTOP);
  std::this_thread::sleep_for(1500ms); // three heartbeat timeouts
  launcher.signal(SIGCONT);
  auto st = launcher.wait(240s);
  if (!st)
    launcher.kill_and_reap();
  auto out = slurp(base + ".out");
  INFO(out);
  REQUIRE(st);
  CHECK(exit_code_of(*st) == 0);
  auto ev = read_events(base + ".jsonl");
  CHECK(find_event(ev, 0, "worker_lost", [](auto&) { return true; }) < 0);
  CHECK(find_event(ev, 0, "failed", [](auto&) { return true; }) < 0);
  auto ws = weights_of(out);
  CHECK(ws.size() == 3);
  for (auto& w : ws)
    CHECK(w == reference_weights());
  for (auto suffix : {".out", ".jsonl"})
    std::remove((base + suffix).c_str());
}
