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
//   fault@S:R[:N]      SIGUSR2 rank R at step S, N times (1 by default): its
//                      next N step attempts fail in their collectives (a
//                      transport error) though every process lives, for the
//                      coordinator to re-form the broken epoch
//   kill-source@S      SIGKILL the source of the newest unfinished catch-up,
//                      at step S or as soon as a catch-up runs after it whose
//                      source is not the last live member
//   kill-coordinator   is not a plan action: the coordinator is the launcher
// A seeded random plan (random_plan) picks kills, faults and stops at
// distinct steps; the seed
// is printed with the plan, so a failing run can be replayed.
#pragma once

#include "core/error.hpp"

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace cmesh::chaos {

enum class action_kind : uint8_t { kill, stop, kill_source, hang, fault };

struct action {
  action_kind kind = action_kind::kill;
  uint64_t at_step = 0;
  uint32_t rank = 0;   // kill, stop, hang, fault
  int64_t stop_ms = 0; // stop
  /// Kill and stop: skipped when its target's group is the last live one
  /// (the random kills are; a written plan means what it says).
  bool survivable = false;
  uint32_t times = 1; // fault
  bool operator==(const action&) const = default;
};

/// Parses the text form; ranks must be below `world_size`. Errors:
/// invalid_argument naming the bad action.
expected<std::vector<action>> parse_plan(std::string_view text, uint32_t world_size);

/// Random survivable SIGSTOPs: how many, and the range their lengths are
/// drawn from (the launcher spans the heartbeat timeout with it, so that
/// some stops are ridden out and the others taken for deaths).
struct stop_draw {
  size_t count = 0;
  int64_t min_ms = 0;
  int64_t max_ms = 0;
};

/// `kills` survivable SIGKILLs, then `faults` single faults, then
/// `stops.count` survivable SIGSTOPs, all at distinct steps drawn from
/// [first_step, last_step], each of a rank drawn from [0, world_size),
/// sorted by step. Deterministic in its arguments; the kills do not depend
/// on `faults` or `stops`, nor the faults on `stops`.
std::vector<action> random_plan(uint64_t seed, size_t kills, uint64_t first_step,
                                uint64_t last_step, uint32_t world_size, size_t faults = 0,
                                stop_draw stops = {});

/// The text form of a plan (parse_plan reads it back).
std::string to_string(const std::vector<action>& plan);

} // namespace cmesh::chaos
