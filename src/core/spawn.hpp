// Spawning function-based CAF actors. CAF 0.17 stores a function actor's
// extra arguments in a shared tuple and, when there are none, dereferences
// an empty shared_ptr (harmless, but undefined behaviour that UBSan rightly
// reports). Passing the function itself as the one argument avoids that.
#pragma once

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/blocking_actor.hpp>
#include <caf/event_based_actor.hpp>

#include <utility>

namespace cmesh {

/// Scheduler settings of every cmesh actor system: `threads` workers that,
/// once idle, wait on a condition variable instead of CAF's default 50 us
/// sleep-and-poll (measured here: ~150 us per actor hop with the default).
inline void tune_actor_system(caf::actor_system_config& cfg, size_t threads) {
  cfg.set("scheduler.max-threads", threads);
  cfg.set("work-stealing.moderate-poll-attempts", size_t{0});
}

/// sys.spawn(f) for f(caf::event_based_actor*) returning a behavior or void.
template <class F>
caf::actor spawn_event_based(caf::actor_system& sys, F f) {
  return sys.spawn([](caf::event_based_actor* self, F g) { return g(self); }, std::move(f));
}

/// sys.spawn(f) for f(caf::blocking_actor*): a detached actor of its own thread.
template <class F>
caf::actor spawn_blocking(caf::actor_system& sys, F f) {
  return sys.spawn([](caf::blocking_actor* self, F g) { g(self); }, std::move(f));
}

} // namespace cmesh
