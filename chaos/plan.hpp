// Chaos plans: the faults `cmesh launch --chaos` injects into its own
// workers, with real signals, when training reaches given steps.
//
// Text form, comma-separated actions:
//   kill@S:R           SIGKILL rank R once the live members committed step S
//   kill@S:R?          the same, skipped if R is then the last live member
//   stop@S:R:MS        SIGSTOP rank R at step S, SIGCONT it MS milliseconds later
//   stop@S:R:MS?       the same, skipped if R's group is then the last live one
//   hang@S:R           SIGUSR1 rank R at step S: its trainer's next computation
//                      hangs for good (a stuck kernel), for the step watchdog
//   hang@S:R?          the same, skipped if R's group is then the last live one
//   fault@S:R[:N]      SIGUSR2 rank R at step S, N times (1 by default): its
//                      next N step attempts fail in their collectives (a
//                      transport error) though every process lives, for the
//                      coordinator to re-form the broken epoch
//   flip@S:R           SIGRTMIN to rank R at step S: its trainer flips one bit
//                      of its weights at its next step boundary (silent data
//                      corruption), for replica verification to catch
//   crash@S:R          SIGRTMIN+1 to rank R at step S: its trainer actor dies
//                      with an error at its next step boundary (a bug that
//                      throws), for the worker's supervisor actor to catch
//   crash-shadow@S:R   SIGRTMIN+2 to rank R at step S: its checkpoint shadow
//                      actor dies with an error at the next update it
//                      applies; its supervisor restarts it, seeded at the
//                      next step boundary
//   kill-source@S      SIGKILL the source of the newest unfinished catch-up,
//                      at step S or as soon as a catch-up runs after it whose
//                      source is not the last live member
//   kill-all@S         SIGKILL every worker at once at step S (the job then
//                      resumes from its checkpoints: --checkpoint-dir)
//   kill-checkpointer@S  SIGKILL the checkpointer process (--checkpointer) at
//                      step S (the launcher starts another; the writing ranks
//                      link to it and seed it)
//   corrupt@S          at step S, flip one byte of a shard file of the newest
//                      checkpoint (a resume must pass it over for an older one)
//   kill-coordinator   is not a plan action: the coordinator is the launcher
// A seeded random plan (random_plan) picks kills, faults, stops and hangs at
// distinct steps; the seed
// is printed with the plan, so a failing run can be replayed.
#pragma once

#include "core/error.hpp"

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace cmesh::chaos {

enum class action_kind : uint8_t {
  kill,
  stop,
  kill_source,
  hang,
  fault,
  flip,
  kill_all,
  corrupt,
  kill_checkpointer,
  crash,
  crash_shadow
};

struct action {
  action_kind kind = action_kind::kill;
  uint64_t at_step = 0;
  uint32_t rank = 0;   // kill, stop, hang, fault, flip, crash, crash-shadow
  int64_t stop_ms = 0; // stop
  /// Kill, stop and hang: skipped when its target's group is the last live
  /// one (the random ones are; a written plan means what it says).
  bool survivable = false;
  uint32_t times = 1; // fault
  bool operator==(const action&) const = default;
};

/// Parses the text form; ranks must be below `world_size`. Errors:
/// invalid_argument naming the bad action.
expected<std::vector<action>> parse_plan(std::string_view text, uint32_t world_size);

/// How many actions of each kind a random plan draws.
struct random_counts {
  size_t kills = 0;  // survivable SIGKILLs
  size_t faults = 0; // single faults
  size_t stops = 0;  // survivable SIGSTOPs, each for a time drawn from
  int64_t stop_min_ms = 0; // [stop_min_ms, stop_max_ms] (the launcher spans
  int64_t stop_max_ms = 0; // the heartbeat timeout: some ridden out, some deaths)
  size_t hangs = 0;  // survivable hangs, for the step watchdog
};

/// The actions of `n`, each at a step of its own drawn from [first_step,
/// last_step] (while steps are left), each of a rank drawn from [0,
/// world_size), sorted by step. Deterministic in its arguments. The kinds
/// are drawn in the order above, each after the one before: adding faults
/// to a seed keeps its kills, adding stops its kills and faults, and so on.
std::vector<action> random_plan(uint64_t seed, uint64_t first_step, uint64_t last_step,
                                uint32_t world_size, const random_counts& n);

/// The text form of a plan (parse_plan reads it back).
std::string to_string(const std::vector<action>& plan);

} // namespace cmesh::chaos
