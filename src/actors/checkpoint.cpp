#include "actors/checkpoint.hpp"

#include "actors/optimizer.hpp"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <vector>

namespace cmesh::actors {

namespace {

using seed_atom = caf::atom_constant<caf::atom("seed")>;
using commit_atom = caf::atom_constant<caf::atom("commit")>;
using status_atom = caf::atom_constant<caf::atom("status")>;

/// The shadow actor's state: its copy of the shard and what it did.
struct shadow_state {
  static inline const char* name = "checkpoint_shadow";
  model::train_config train;
  std::shared_ptr<std::atomic<int64_t>> in_flight;
  std::vector<float> params, adam_m, adam_v, scalars;
  shadow_status st;

  train_state view() { return {st.step, params, adam_m, adam_v, scalars}; }
};

caf::behavior shadow_actor(caf::stateful_actor<shadow_state>* self, model::train_config train,
                           std::shared_ptr<std::atomic<int64_t>> in_flight) {
  self->state.train = std::move(train);
  self->state.in_flight = std::move(in_flight);
  return {
    [=](seed_atom, uint64_t step, std::vector<float>& p, std::vector<float>& m,
        std::vector<float>& v, std::vector<float>& sc) {
      auto& S = self->state;
      S.in_flight->fetch_sub(1, std::memory_order_relaxed);
      S.params = std::move(p);
      S.adam_m = std::move(m);
      S.adam_v = std::move(v);
      S.scalars = std::move(sc);
      S.st.step = step;
      S.st.seeded = true;
      ++S.st.seeds;
    },
    [=](commit_atom, uint64_t k, const std::vector<float>& update, uint64_t expect) {
      auto& S = self->state;
      S.in_flight->fetch_sub(1, std::memory_order_relaxed);
      if (!S.st.seeded || k != S.st.step || update.size() != S.params.size()) {
        // The feed re-seeds it at the next boundary.
        S.st.seeded = false;
        return;
      }
      apply_committed(S.train, S.view(), k, update);
      ++S.st.step;
      ++S.st.applied;
      if (expect != 0) {
        ++S.st.checked;
        // The feed sends the hash with its lowest bit set (0 means "no check").
        if ((hash_state(S.params, S.adam_m, S.adam_v, S.scalars) | 1) != expect) {
          ++S.st.mismatches;
          spdlog::error("checkpoint shadow: after step {} its state differs from the trainer's",
                        k);
        }
      }
    },
    [=](status_atom) {
      auto& S = self->state;
      S.st.state_hash = S.st.seeded ? hash_state(S.params, S.adam_m, S.adam_v, S.scalars) : 0;
      const auto& s = S.st;
      return std::vector<uint64_t>{s.step,    s.state_hash, s.seeded ? 1u : 0u, s.applied,
                                   s.seeds,   s.checked,    s.mismatches};
    },
  };
}

std::vector<float> copy_of(std::span<const float> s) {
  return std::vector<float>(s.begin(), s.end());
}

} // namespace

shadow_feed::shadow_feed(caf::actor_system& sys, shadow_options o)
    : sys_(sys), o_(std::move(o)), in_flight_(std::make_shared<std::atomic<int64_t>>(0)) {
  shadow_ = sys_.spawn(shadow_actor, o_.train, in_flight_);
}

shadow_feed::~shadow_feed() {
  caf::anon_send_exit(shadow_, caf::exit_reason::user_shutdown);
}

void shadow_feed::at_boundary(const train_state& st) {
  if (tracking_ && next_ == st.step)
    return;
  // A copy of the state at this boundary: the shadow starts (again) here.
  // It is sent even when the queue is full: the updates in it are moot.
  in_flight_->fetch_add(1, std::memory_order_relaxed);
  caf::anon_send(shadow_, seed_atom::value, st.step, copy_of(st.params), copy_of(st.adam_m),
                 copy_of(st.adam_v), copy_of(st.scalars));
  tracking_ = true;
  next_ = st.step;
}

void shadow_feed::committed(uint64_t k, std::span<const float> update, const train_state& after) {
  if (!tracking_ || k != next_) {
    tracking_ = false;
    return;
  }
  if (in_flight_->load(std::memory_order_relaxed) >= static_cast<int64_t>(o_.queue_max)) {
    ++dropped_;
    tracking_ = false; // re-seeded at the next boundary
    return;
  }
  const uint64_t expect =
    o_.check ? hash_state(after.params, after.adam_m, after.adam_v, after.scalars) | 1 : 0;
  in_flight_->fetch_add(1, std::memory_order_relaxed);
  caf::anon_send(shadow_, commit_atom::value, k, copy_of(update), expect);
  ++next_;
}

expected<shadow_status> shadow_feed::status(std::chrono::milliseconds timeout) {
  caf::scoped_actor self{sys_};
  expected<shadow_status> out = make_error(errc::timeout, "the checkpoint shadow did not answer");
  self->request(shadow_, caf::duration{timeout}, status_atom::value)
    .receive(
      [&](const std::vector<uint64_t>& v) {
        shadow_status s;
        s.step = v.at(0);
        s.state_hash = v.at(1);
        s.seeded = v.at(2) != 0;
        s.applied = v.at(3);
        s.seeds = v.at(4);
        s.checked = v.at(5);
        s.mismatches = v.at(6);
        out = s;
      },
      [&](caf::error& e) {
        out = make_error(errc::timeout,
                         fmt::format("the checkpoint shadow: {}", sys_.render(e)));
      });
  return out;
}

} // namespace cmesh::actors
