// Long chaos soaks (registered with CTest only under -DCMESH_SOAK=ON): many
// seeded SIGKILLs, seeded faults (a step that fails with every process
// alive, for the epoch to be re-formed), seeded SIGSTOPs (from half a
// heartbeat timeout, ridden out, to two, taken for a death and fenced after
// SIGCONT) and seeded hangs (the step watchdog, 2 s here, ends the rank),
// over long runs, in every layout the
// suite's short runs cover once. Exact mode must end bit-identical to the run without kills;
// the device path (not exact) must end with one set of weights.
//
// Scale: CMESH_SOAK_ROUNDS (seeds per case, default 3), CMESH_SOAK_STEPS
// (steps per run, default 300), CMESH_SOAK_KILLS (kills per run, default 8),
// CMESH_SOAK_FAULTS (faults per run, default 2), CMESH_SOAK_STOPS (stops per
// run, default 2), CMESH_SOAK_HANGS (hangs per run, default 1).
// Each round prints its seed; CMESH_SEED=N replays the first round's.
// Every recovery must also end within a generous bound (a hang guard: a
// wait that ran out a timeout instead of being told).
#include "node_harness.hpp"

#include <regex>
#include <set>

using namespace cmesh;
using namespace cmesh::testing;
using namespace std::chrono_literals;

namespace {

uint64_t env_or(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtoull(v, nullptr, 10) : fallback;
}

struct soak_params {
  uint64_t rounds = env_or("CMESH_SOAK_ROUNDS", 3);
  uint64_t steps = env_or("CMESH_SOAK_STEPS", 300);
  uint64_t kills = env_or("CMESH_SOAK_KILLS", 8);
  uint64_t faults = env_or("CMESH_SOAK_FAULTS", 2);
  uint64_t stops = env_or("CMESH_SOAK_STOPS", 2);
  uint64_t hangs = env_or("CMESH_SOAK_HANGS", 1);
};

size_t kills_in(const std::string& out) {
  return captures(out, "(chaos: SIGKILL)").size();
}

size_t faults_in(const std::string& out) {
  return captures(out, "(chaos: SIGUSR2)").size();
}

size_t stops_in(const std::string& out) {
  return captures(out, "(chaos: SIGSTOP)").size();
}

size_t hangs_in(const std::string& out) {
  return captures(out, "(chaos: SIGUSR1)").size();
}

/// The longest time from a failure to the survivors' next commit that the
/// launcher reported ("epoch N committed step S, X ms after it began, Y ms
/// after the failure"). Recovery is pushed, so it takes about a
/// second even on a loaded machine; tens of seconds mean a wait ran out a
/// timeout (30 s for an epoch's rendezvous or a collective) instead of
/// being told.
double slowest_recovery_ms(const std::string& out) {
  double worst = 0;
  for (auto& v : captures(out, "ms after it began, ([0-9]+) ms after the failure"))
    worst = std::max(worst, std::stod(v));
  return worst;
}

// A generous bound: well above a loaded machine's recovery, well below the
// timeouts a missed notice falls back on.
constexpr double recovery_bound_ms = 15000;

run_result soak_run(const std::string& args, uint64_t seed, const soak_params& p) {
  auto r = run_cmesh("launch --steps " + std::to_string(p.steps) + " --log-every 100 "
                       + "--restart-delay-ms 100 --max-restarts 100 --chaos-first-step 5 "
                       + "--chaos-kills " + std::to_string(p.kills) + " --chaos-faults "
                       + std::to_string(p.faults) + " --chaos-stops "
                       + std::to_string(p.stops) + " --chaos-hangs " + std::to_string(p.hangs)
                       + " --step-timeout-ms 2000 --verify-every 1 --chaos-seed "
                       + std::to_string(seed) + " " + args,
                     {}, 1800s);
  MESSAGE(args << " seed " << seed << ": exit " << r.exit_code << ", " << kills_in(r.output)
                << " kills, " << faults_in(r.output) << " faults, " << stops_in(r.output)
                << " stops, " << hangs_in(r.output) << " hangs, " << r.took.count() / 1000.0 << " s, slowest recovery "
                << slowest_recovery_ms(r.output) << " ms");
  // Every step verified: no false alarm, whatever the faults.
  CHECK(r.output.find("replica divergence") == std::string::npos);
  return r;
}

} // namespace

TEST_CASE("soak: exact mode, seeded kills in every layout, weights bit-identical") {
  const soak_params p;
  auto ref = run_cmesh("launch --exact -n 1 --steps " + std::to_string(p.steps)
                         + " --log-every 100",
                       {}, 1800s);
  REQUIRE(ref.exit_code == 0);
  auto rw = done_weights(ref.output, p.steps);
  REQUIRE(rw.size() == 1);
  uint64_t seed = test_seed();
  for (uint64_t round = 0; round < p.rounds; ++round, seed = seed * 6364136223846793005ULL + 1) {
    for (const std::string layout : {"-n 3", "-n 4 --replicas 2", "-n 4"}) {
      CAPTURE(layout);
      CAPTURE(seed);
      auto r = soak_run("--exact " + layout, seed, p);
      INFO(r.output);
      REQUIRE(r.exit_code == 0);
      CHECK(kills_in(r.output) >= 1);
      CHECK(slowest_recovery_ms(r.output) < recovery_bound_ms);
      auto ws = done_weights(r.output, p.steps);
      CHECK(!ws.empty());
      for (auto& w : ws)
        CHECK(w == rw[0]);
    }
  }
}

TEST_CASE("soak: the device path (emulated), seeded kills, one set of weights") {
  const soak_params p;
  uint64_t seed = test_seed() ^ 0x5eed;
  for (uint64_t round = 0; round < p.rounds; ++round, seed = seed * 6364136223846793005ULL + 1) {
    for (const std::string layout : {"-n 3", "-n 4 --replicas 2"}) {
      CAPTURE(layout);
      CAPTURE(seed);
      auto r = soak_run("--device emulated " + layout, seed, p);
      INFO(r.output);
      REQUIRE(r.exit_code == 0);
      CHECK(r.output.find("gradients summed on the device") != std::string::npos);
      CHECK(slowest_recovery_ms(r.output) < recovery_bound_ms);
      auto ws = done_weights(r.output, p.steps);
      CHECK(!ws.empty());
      CHECK(std::set<std::string>(ws.begin(), ws.end()).size() == 1);
    }
  }
}
