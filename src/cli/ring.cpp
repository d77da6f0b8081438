#include "cli/ring.hpp"

#include "transport/mesh.hpp"

#include "core/spawn.hpp"

#include <caf/all.hpp>
#include <fmt/format.h>

#include <future>

namespace cmesh::cli {

namespace {

struct ring_result {
  caf::error error;
  uint64_t seen = 0;
  uint64_t hops = 0;
  int64_t lap_ns_total = 0;
};

caf::behavior ring_actor(caf::event_based_actor* self, mesh* m, uint32_t rank, uint32_t size,
                         uint32_t laps, std::shared_ptr<std::promise<ring_result>> done) {
  auto next = m->remote((rank + 1) % size, "ring");
  self->monitor(next);
  auto state = std::make_shared<ring_result>();
  auto finished = std::make_shared<bool>(false);
  auto lap_start = std::make_shared<int64_t>(mono_ns());
  auto finish = [=](caf::error err) {
    if (*finished)
      return;
    *finished = true;
    state->error = std::move(err);
    done->set_value(*state);
    self->quit();
  };
  self->set_down_handler([=](caf::down_msg& d) {
    finish(make_error(code_of(d.reason) == errc::ok ? errc::peer_lost : code_of(d.reason),
                      "ring broken at rank " + std::to_string((rank + 1) % size) + ": "
                        + describe(d.reason)));
  });
  if (rank == 0)
    self->send(next, wire::token{0, 0, laps, 0});
  return {[=](wire::token t) {
    ++t.hops;
    ++state->seen;
    state->hops = t.hops;
    if (rank == 0) {
      ++t.lap;
      auto now = mono_ns();
      state->lap_ns_total += now - *lap_start;
      *lap_start = now;
      if (t.lap == laps) {
        finish({});
        return;
      }
    }
    self->send(next, t);
    if (rank != 0 && state->seen == laps)
      finish({});
  }};
}

} // namespace

caf::error run_ring(joined_mesh& j, uint32_t laps, std::chrono::milliseconds timeout) {
  const auto rank = static_cast<uint32_t>(j.place.rank);
  const auto size = static_cast<uint32_t>(j.place.world_size);
  caf::actor_system_config cfg;
  tune_actor_system(cfg, 2);
  caf::actor_system sys{cfg};
  ring_result res;
  {
    mesh m(sys, *j.net);
    auto done = std::make_shared<std::promise<ring_result>>();
    auto fut = done->get_future();
    // Published before the transport starts: no token can find it missing.
    auto ring = spawn_event_based(sys, [&m, rank, size, laps, done](caf::event_based_actor* self) {
      return ring_actor(self, &m, rank, size, laps, done);
    });
    m.publish("ring", ring);
    if (auto e = j.net->start())
      return e;
    if (fut.wait_for(timeout) != std::future_status::ready) {
      caf::anon_send_exit(ring, caf::exit_reason::kill);
      res.error = make_error(errc::timeout, "ring did not finish within "
                                              + std::to_string(timeout.count()) + " ms");
    } else {
      res = fut.get();
    }
  }
  if (!res.error) {
    std::string value = fmt::format("seen={} hops={}", res.seen, res.hops);
    if (rank == 0 && laps > 0)
      value += fmt::format(" lap_us={:.1f}", res.lap_ns_total / 1e3 / laps);
    j.coordinator.report({rank, "done", value, mono_ns()});
  } else {
    j.coordinator.report({rank, "failed", describe(res.error), mono_ns()});
  }
  sys.await_all_actors_done();
  return res.error;
}

} // namespace cmesh::cli
