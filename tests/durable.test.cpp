// Durable training end to end: real `cmesh launch` jobs writing real
// checkpoint directories, SIGKILL of every worker at once, resume at the
// same and at other layouts, a corrupted checkpoint passed over, and bad
// --resume input refused with a clear error.
//
// The proof: in exact mode every resumed run ends with final weights
// bit-identical to the run that was never interrupted.
#include "node_harness.hpp"

#include <csignal>
#include <filesystem>
#include <fstream>
#include <regex>
#include <thread>

using namespace cmesh;
using namespace cmesh::testing;
using namespace std::chrono_literals;

namespace {

constexpr int steps = 40;

/// A fresh directory for one test's checkpoints, removed at the end.
struct scratch {
  std::string dir;
  explicit scratch(const std::string& name)
      : dir("/tmp/cmesh_durable_" + std::to_string(getpid()) + "_" + name) {
    std::filesystem::remove_all(dir);
  }
  ~scratch() { std::filesystem::remove_all(dir); }
};

run_result launch(const std::string& args) {
  return run_cmesh("launch --exact --steps " + std::to_string(steps) + " --log-every 10 " + args,
                   {}, 300s);
}

/// The weights of the run without failures (exact mode: any layout).
const std::string& reference_weights() {
  static std::string w = [] {
    auto r = launch("-n 1");
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    auto ws = done_weights(r.output, steps);
    REQUIRE(ws.size() == 1);
    return ws[0];
  }();
  return w;
}

void check_identical(const run_result& r, size_t ranks) {
  auto ws = done_weights(r.output, steps);
  CHECK(ws.size() == ranks);
  for (auto& w : ws)
    CHECK(w == reference_weights());
}

std::vector<uint64_t> steps_in(const std::string& root) {
  std::vector<uint64_t> out;
  if (!std::filesystem::exists(root))
    return out;
  for (auto& e : std::filesystem::directory_iterator(root)) {
    auto name = e.path().filename().string();
    if (name.starts_with("step-") && name.find('.') == std::string::npos)
      out.push_back(std::stoull(name.substr(5)));
  }
  std::sort(out.begin(), out.end());
  return out;
}

bool has(const std::string& text, const std::string& what) {
  return text.find(what) != std::string::npos;
}

} // namespace

TEST_CASE("2x2: SIGKILL every worker at once; the launcher resumes them from the checkpoints, "
          "bit-identical") {
  scratch s("killall");
  const auto events = s.dir + "/events.jsonl";
  std::filesystem::create_directories(s.dir);
  // Then one rank after the resume: its replacement catches up from the
  // live group rather than reading the checkpoint.
  auto r = launch("-n 4 --replicas 2 --checkpoint-dir " + s.dir
                  + "/ckpt --checkpoint-every 10 --restart-delay-ms 200 --chaos "
                    "kill-all@25,kill@28:1 --events "
                  + events);
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(has(r.output, "SIGKILL (kill-all) rank 3"));
  CHECK(has(r.output, "every worker restarts from the newest checkpoint (job restart 1 of 3)"));
  auto resumed = captures(r.output, "resuming from [^ ]+ \\(step ([0-9]+)");
  REQUIRE(resumed.size() == 1);
  CHECK((resumed[0] == "10" || resumed[0] == "20")); // the newest on disk at the kill
  // The replaced group rejoins, or is left behind when the others finish
  // first: either way every rank that finished holds the same weights.
  auto ws = done_weights(r.output, steps);
  CHECK((ws.size() == 2 || ws.size() == 4));
  for (auto& w : ws)
    CHECK(w == reference_weights());
  // Every step of it in the event log: the failure, the job's restart,
  // the replacement's catch-up.
  auto log = slurp(events);
  CHECK(has(log, "\"event\":\"failed\""));
  CHECK(has(log, "\"event\":\"job_restart\""));
  CHECK(has(log, "\"event\":\"catchup_start\""));
  CHECK(has(r.output, "SIGKILL rank 1"));
  // Retention kept the newest three, the last step's among them, and no
  // partial directory of the killed writers is left.
  for (auto& e : std::filesystem::directory_iterator(s.dir + "/ckpt"))
    CHECK_MESSAGE(e.path().filename().string().find(".partial-") == std::string::npos,
                  e.path().string());
  auto on_disk = steps_in(s.dir + "/ckpt");
  CHECK(on_disk.size() <= 3);
  REQUIRE(!on_disk.empty());
  CHECK(on_disk.back() == steps);
  // The checkpoints verify (cmesh checkpoint verify reads every piece).
  auto v = run_cmesh("checkpoint verify " + s.dir + "/ckpt", {}, 120s);
  INFO(v.output);
  CHECK(v.exit_code == 0);
}

TEST_CASE("--checkpointer: killed, it is started again and fed; after every worker is killed, "
          "the step they all last committed is on disk and the run resumes there") {
  scratch s("checkpointer");
  const auto root = s.dir + "/ckpt";
  std::filesystem::create_directories(s.dir);
  const auto events = s.dir + "/events.jsonl";
  // 60 steps: the replacement checkpointer is linked and seeded long before
  // the kill of every worker (its start and the ranks' linking to it take
  // about 0.5 s; 42 steps take about 2 s here, longer under sanitizers).
  constexpr int n = 60;
  const auto common = "launch --exact --steps " + std::to_string(n) + " --log-every 10 ";
  auto ref = run_cmesh(common + "-n 1", {}, 300s);
  REQUIRE(ref.exit_code == 0);
  auto ref_weights = done_weights(ref.output, n);
  REQUIRE(ref_weights.size() == 1);
  auto r = run_cmesh(common + "-n 4 --replicas 2 --checkpointer --shadow-check --checkpoint-dir "
                       + root
                       + " --checkpoint-every 10 --chaos kill-checkpointer@3,kill-all@45 "
                         "--events "
                       + events,
                     {}, 300s);
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(has(r.output, "cmesh: chaos: SIGKILL the checkpointer"));
  // Three checkpointer processes: the first (killed), its replacement
  // (stopped after the kill of every worker: it wrote where they stood),
  // and the resumed attempt's.
  CHECK(captures(r.output, "(cmesh: checkpointer for 2 replica group)").size() == 3);
  auto killed_at =
    captures(r.output, "SIGKILL \\(kill-all\\) rank 0 \\(pid [0-9]+\\) at step ([0-9]+)");
  REQUIRE(killed_at.size() == 1);
  auto resumed = captures(r.output, "resuming from [^ ]+ \\(step ([0-9]+)");
  REQUIRE(resumed.size() == 1);
  // Not the newest periodic checkpoint (40): the step the workers stood
  // at when they were killed (the slowest of a group may be one behind).
  CHECK(std::stoull(resumed[0]) + 1 >= std::stoull(killed_at[0]));
  CHECK(std::stoull(resumed[0]) > 40);
  CHECK(has(r.output, "checkpointer (signal 15): step " + resumed[0] + " is on disk"));
  auto ws = done_weights(r.output, n);
  CHECK(ws.size() == 4);
  for (auto& w : ws)
    CHECK(w == ref_weights[0]);
  // The shadows matched the trainers after every update they were sent.
  auto checked = captures(r.output, "checkpointer position [01] step=[0-9]+ state=[0-9a-f]+ "
                                    "applied=[0-9]+ seeds=[0-9]+ checked=([0-9]+) mismatches=0");
  CHECK(checked.size() == 4); // 2 positions x the 2 processes that were not killed
  for (auto& c : checked)
    CHECK(std::stoull(c) > 0);
  CHECK(!has(r.output, "differs from the trainer's"));
  auto log = slurp(events);
  CHECK(has(log, "\"event\":\"checkpointer_started\""));
  CHECK(has(log, "\"event\":\"checkpointer_exit\""));
  CHECK(has(log, "\"event\":\"job_restart\""));
  auto on_disk = steps_in(root);
  REQUIRE(!on_disk.empty());
  CHECK(on_disk.back() == n);
  CHECK(std::find(on_disk.begin(), on_disk.end(), std::stoull(resumed[0])) != on_disk.end());
  for (auto& e : std::filesystem::directory_iterator(root))
    CHECK_MESSAGE(e.path().filename().string().find(".partial-") == std::string::npos,
                  e.path().string());
  auto v = run_cmesh("checkpoint verify " + root, {}, 120s);
  INFO(v.output);
  CHECK(v.exit_code == 0);
}

TEST_CASE("stopped at 2x2, resumed at 4x1 and at 1x2: bit-identical to the uninterrupted run") {
  scratch s("reshard");
  const auto root = s.dir + "/ckpt";
  // No restarts: the kill ends the job, the checkpoints stay.
  auto r = launch("-n 4 --replicas 2 --max-restarts 0 --checkpoint-dir " + root
                  + " --checkpoint-every 10 --chaos kill-all@25");
  INFO(r.output);
  CHECK(r.exit_code == 1);
  CHECK(has(r.output, "restart from checkpoint needed"));
  auto on_disk = steps_in(root);
  REQUIRE(!on_disk.empty());
  const auto newest = on_disk.back();
  CHECK(newest <= 20);
  SUBCASE("4 groups of 1") {
    auto q = launch("-n 4 --replicas 4 --resume " + root);
    INFO(q.output);
    REQUIRE(q.exit_code == 0);
    CHECK(has(q.output, "(step " + std::to_string(newest) + ", written by 2 replica group(s) x 2"));
    check_identical(q, 4);
  }
  SUBCASE("1 group of 2") {
    auto q = launch("-n 2 --replicas 1 --resume latest --checkpoint-dir " + root);
    INFO(q.output);
    REQUIRE(q.exit_code == 0);
    check_identical(q, 2);
    // It wrote on from where it resumed.
    CHECK(steps_in(root).back() == steps);
  }
}

TEST_CASE("a checkpoint shadow actor that dies: its supervisor restarts it, the checkpoints go on "
          "and resume bit-identical") {
  scratch s("crashshadow");
  const auto root = s.dir + "/ckpt";
  // Rank 0 writes its group's checkpoints. Its shadow throws at step 12;
  // every worker is killed at step 35 and nobody restarts them, so the
  // newest checkpoint on disk (step 30) was written by the restarted shadow.
  auto r = launch("-n 2 --replicas 2 --max-restarts 0 --checkpoint-dir " + root
                  + " --checkpoint-every 10 --chaos crash-shadow@12:0,kill-all@35");
  INFO(r.output);
  CHECK(r.exit_code == 1);
  CHECK(has(r.output, "SIGRTMIN+2 (crash-shadow) rank 0"));
  CHECK(has(r.output, "the checkpoint shadow actor of rank 0 died: crashed: injected crash at "
                      "update"));
  CHECK(has(r.output, "rank 0's shadow restarted (restart 1), seeded at step"));
  // The rank went on: no worker ended before the kill.
  CHECK(!has(r.output, "a local actor died"));
  auto on_disk = steps_in(root);
  REQUIRE(!on_disk.empty());
  CHECK(on_disk.back() == 30);
  auto v = run_cmesh("checkpoint verify " + root, {}, 120s);
  INFO(v.output);
  CHECK(v.exit_code == 0);
  auto q = launch("-n 1 --resume " + root);
  INFO(q.output);
  REQUIRE(q.exit_code == 0);
  CHECK(has(q.output, "(step 30, written by"));
  check_identical(q, 1);
}

TEST_CASE("a corrupted newest checkpoint is passed over for the one before, said, and the run "
          "ends bit-identical") {
  scratch s("corrupt");
  const auto root = s.dir + "/ckpt";
  auto r = launch("-n 2 --checkpoint-dir " + root
                  + " --checkpoint-every 10 --chaos corrupt@25,kill-all@27");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  CHECK(has(r.output, "cmesh: chaos: flipped byte"));
  check_identical(r, 2);
  auto resumed = captures(r.output, "resuming from [^ ]+ \\(step ([0-9]+)");
  REQUIRE(resumed.size() == 1);
  // The corrupted one was the newest at the kill: the resume fell back.
  if (resumed[0] == "10")
    CHECK(has(r.output, "falling back to step 10"));
}

TEST_CASE("--resume of a bad checkpoint: a clear error naming what is wrong, nothing started") {
  scratch s("bad");
  const auto root = s.dir + "/ckpt";
  auto r = launch("-n 1 --checkpoint-dir " + root + " --checkpoint-every 20");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  REQUIRE(steps_in(root) == std::vector<uint64_t>{20, 40});
  const auto step40 = root + "/step-000000040";
  SUBCASE("another configuration") {
    auto q = run_cmesh("launch -n 1 --exact --steps 60 --resume " + step40, {}, 120s);
    INFO(q.output);
    CHECK(q.exit_code == 1);
    CHECK(has(q.output, "written with another configuration: train.steps = 40 (the job's: 60)"));
    CHECK(has(q.output, "usage error"));
  }
  SUBCASE("a flipped byte in a shard") {
    {
      std::fstream f(step40 + "/shard-0.bin", std::ios::in | std::ios::out | std::ios::binary);
      f.seekg(100);
      char c = 0;
      f.read(&c, 1);
      c ^= 1;
      f.seekp(100);
      f.write(&c, 1);
    }
    auto q = launch("-n 1 --resume " + step40);
    INFO(q.output);
    CHECK(q.exit_code == 1);
    CHECK(has(q.output, "shard-0.bin"));
    CHECK(has(q.output, "corrupt"));
    // Given the root, the newest valid one is taken instead, and it says so.
    auto f = launch("-n 1 --resume " + root);
    INFO(f.output);
    REQUIRE(f.exit_code == 0);
    CHECK(has(f.output, "falling back to step 20"));
    check_identical(f, 1);
  }
  SUBCASE("a missing manifest and an empty directory") {
    std::filesystem::remove(step40 + "/manifest.msgpack");
    auto q = launch("-n 1 --resume " + step40);
    INFO(q.output);
    CHECK(q.exit_code == 1);
    auto e = launch("-n 1 --resume " + s.dir + "/nothing-here");
    INFO(e.output);
    CHECK(e.exit_code == 1);
    CHECK(has(e.output, "no checkpoint there"));
  }
}

TEST_CASE("the disk filling up under training: each failed write is said, training goes on, the "
          "checkpoint before stays valid, the shared tier gets every one") {
  scratch s("full");
  const auto local = s.dir + "/local", shared = s.dir + "/shared", out = s.dir + "/out";
  std::filesystem::create_directories(local);
  const auto cmesh = bin_dir() + "/cmesh";
  // A 3 MiB tmpfs in a mount namespace of the job's own: the first
  // checkpoint (2.2 MB) fits, the next does not.
  const auto job = cmesh + " launch -n 2 --exact --steps " + std::to_string(steps)
                   + " --log-every 10 --checkpoint-dir " + local + " --checkpoint-shared "
                   + shared + " --checkpoint-every 10 --checkpoint-keep 5";
  const auto script = "mount --make-rprivate / && mount -t tmpfs -o size=3m tmpfs " + local
                      + " || { echo 'SKIP: no tmpfs mount here'; exit 77; }; " + job
                      + "; rc=\\$?; echo launch exit \\$rc; " + cmesh + " checkpoint verify "
                      + local + "; exit \\$rc";
  auto c = child_process::spawn(
    "/bin/sh", {"-c", "unshare -m sh -c \"" + script + "\" >" + out + " 2>&1"}, {});
  REQUIRE(c.pid() > 0);
  auto st = c.wait(300s);
  REQUIRE(st.has_value());
  const auto output = slurp(out);
  INFO(output);
  if (exit_code_of(*st) == 77 || has(output, "unshare: ")) {
    MESSAGE("skipped: a tmpfs in a mount namespace of its own is not permitted here");
    return;
  }
  REQUIRE(exit_code_of(*st) == 0);
  CHECK(has(output, "checkpoint: step 10 written to " + local + "/step-000000010"));
  CHECK(has(output, "could not write step 20 to " + local));
  CHECK(has(output, "No space left on device"));
  // The one that fitted verifies; no partial directory was left behind.
  CHECK(std::regex_search(output, std::regex("step-000000010 .* ok \\(verified\\)")));
  CHECK(!has(output, "partial:"));
  run_result r{0, output, {}};
  check_identical(r, 2);
  CHECK(steps_in(shared) == std::vector<uint64_t>{10, 20, 30, 40});
}

TEST_CASE("checkpoints every T seconds: the ranks of the group agree on the step in the commit "
          "vote; each checkpoint is whole and resumes bit-identical") {
  scratch s("seconds");
  const auto root = s.dir + "/ckpt";
  auto r = launch("-n 4 --replicas 2 --checkpoint-dir " + root
                  + " --checkpoint-every 0 --checkpoint-seconds 0.3 --checkpoint-keep 100");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  check_identical(r, 4);
  CHECK(!has(r.output, "could not write"));
  auto on_disk = steps_in(root);
  REQUIRE(on_disk.size() >= 2); // at least one by time, and the last step's
  CHECK(on_disk.back() == steps);
  auto v = run_cmesh("checkpoint verify " + root, {}, 120s);
  INFO(v.output);
  CHECK(v.exit_code == 0);
  const auto middle = root + "/step-" + [&] {
    auto t = std::to_string(on_disk.front());
    return std::string(9 - t.size(), '0') + t;
  }();
  auto q = launch("-n 2 --replicas 1 --resume " + middle);
  INFO(q.output);
  REQUIRE(q.exit_code == 0);
  check_identical(q, 2);
}

TEST_CASE("SIGTERM to cmesh launch: every worker stops after the same step, checkpoints it, and "
          "the job resumes from there at another layout, bit-identical") {
  scratch s("stop");
  std::filesystem::create_directories(s.dir);
  const auto root = s.dir + "/ckpt", out = s.dir + "/out";
  auto c = spawn_cmesh("launch -n 4 --replicas 2 --exact --steps " + std::to_string(steps)
                         + " --log-every 1 --checkpoint-dir " + root + " --checkpoint-every 100",
                       out);
  // Once step 12 committed, the launcher is asked to stop (as a
  // scheduler's preemption or a Ctrl-C would).
  const auto until = std::chrono::steady_clock::now() + 120s;
  while (!has(slurp(out), "\nstep    12") && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(20ms);
  REQUIRE(has(slurp(out), "\nstep    12"));
  c.signal(SIGTERM);
  auto st = c.wait(120s);
  REQUIRE(st.has_value());
  const auto output = slurp(out);
  INFO(output);
  CHECK(exit_code_of(*st) == 128 + SIGTERM);
  auto stopped = captures(output, "cmesh: stopped after step ([0-9]+) on request");
  REQUIRE(stopped.size() == 1);
  const auto at = std::stoull(stopped[0]);
  CHECK(at >= 12);
  CHECK(at < static_cast<uint64_t>(steps));
  // Every rank stopped at that step; its checkpoint is the only one.
  CHECK(captures(output, "trainer: stopped at step ([0-9]+)")
        == std::vector<std::string>(4, stopped[0]));
  CHECK(steps_in(root) == std::vector<uint64_t>{at});
  auto q = launch("-n 4 --replicas 4 --resume latest --checkpoint-dir " + root);
  INFO(q.output);
  REQUIRE(q.exit_code == 0);
  CHECK(has(q.output, "(step " + stopped[0] + ","));
  check_identical(q, 4);
}
