#include "actors/checkpoint.hpp"

#include "actors/optimizer.hpp"
#include "storage/reader.hpp"
#include "storage/retention.hpp"
#include "storage/writer.hpp"
#include "transport/bulk.hpp"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

namespace cmesh::actors {

caf::error write_shard_checkpoint(const checkpoint_target& t, const std::string& root,
                                  uint64_t step, std::span<const float> params,
                                  std::span<const float> adam_m, std::span<const float> adam_v,
                                  std::span<const float> scalars) {
  const uint32_t S = std::max<uint32_t>(1, t.ranks_per_group);
  const uint32_t position = t.rank % S;
  const auto split = split_shards(t.elements, S, norm_block);
  const uint64_t first = split.offsets[position];
  storage::checkpoint_meta meta;
  meta.step = step;
  meta.replicas = t.replicas;
  meta.ranks_per_group = S;
  meta.data_position = step; // the data of a step is a function of the step
  meta.loss_scale = scalars.size() > 0 ? scalars[0] : 1.0f;
  meta.loss_scale_good_steps = scalars.size() > 1 ? static_cast<uint64_t>(scalars[1]) : 0;
  meta.config = t.config;
  std::vector<storage::array_entry> arrays;
  for (const char* name : {"weights", "adam_m", "adam_v"})
    arrays.push_back({name, "f32", t.elements, true});
  auto w = storage::checkpoint_writer::begin(root, std::move(meta), std::move(arrays), t.tensors);
  if (!w)
    return w.error();
  const std::vector<storage::array_slice> slices{storage::slice_of("weights", first, params),
                                                 storage::slice_of("adam_m", first, adam_m),
                                                 storage::slice_of("adam_v", first, adam_v)};
  if (auto e = w->write_shard(position, slices))
    return e;
  if (position != 0) {
    if (auto e = w->publish_part())
      return e;
    if (auto gone = storage::remove_own_stale_parts(root, step, t.assemble_timeout); !gone)
      spdlog::warn("checkpoint: {}", describe(gone.error()));
    return {};
  }
  if (S > 1)
    if (auto e = w->adopt_parts(S, t.assemble_timeout))
      return e;
  auto dir = w->commit();
  if (!dir)
    return dir.error();
  spdlog::info("checkpoint: step {} written to {}", step, *dir);
  // The committer of a root trims it: the partial directories of writers
  // that died (killed in the middle of a write), then retention.
  if (auto gone = storage::cleanup_partials(root); !gone)
    spdlog::warn("checkpoint: {}", describe(gone.error()));
  else
    for (const auto& d : *gone)
      spdlog::info("checkpoint: removed {}, left by a writer that is gone", d);
  auto all = storage::list_checkpoints(root, false);
  if (!all)
    return all.error();
  std::vector<uint64_t> steps;
  for (auto& c : *all)
    steps.push_back(c.step);
  for (auto old : storage::retention_plan(steps, t.keep_last, t.keep_every))
    if (auto e = storage::remove_checkpoint(root, old))
      spdlog::warn("checkpoint: retention: {}", describe(e));
  return {};
}

namespace {

using seed_atom = shadow_seed_atom;
using commit_atom = shadow_commit_atom;
using status_atom = caf::atom_constant<caf::atom("status")>;
using write_atom = caf::atom_constant<caf::atom("write")>;
using written_atom = caf::atom_constant<caf::atom("written")>;
using writer_atom = caf::atom_constant<caf::atom("writer")>;

/// The disk actor: writes each copy it is sent through the tiers, in
/// order, and tells the shadow how it went.
caf::behavior disk_actor(caf::event_based_actor*, checkpoint_target t) {
  return {
    [=](write_atom, uint64_t step, const std::vector<float>& p, const std::vector<float>& m,
        const std::vector<float>& v, const std::vector<float>& sc) {
      // Each tier on its own: a full local disk still leaves the shared copy.
      std::string failure;
      for (const auto& root : t.roots) {
        if (auto e = write_shard_checkpoint(t, root, step, p, m, v, sc)) {
          failure += (failure.empty() ? "" : "; ") + describe(e);
          spdlog::error("checkpoint: rank {} could not write step {} to {}: {}", t.rank, step,
                        root, describe(e));
        }
      }
      return caf::make_message(written_atom::value, step, failure);
    },
  };
}

} // namespace

/// What a feed and its shadow share: the messages in flight, and the update
/// buffers the shadow hands back to be filled again (a fresh vector per
/// step, of the shard's size, would page-fault its way in on the trainer's
/// thread and be unmapped again on the shadow's).
namespace {
std::atomic<bool> shadow_crash_requested{false};
} // namespace

void request_shadow_crash() {
  shadow_crash_requested.store(true, std::memory_order_relaxed);
}

struct feed_link {
  std::atomic<int64_t> in_flight{0};
  std::atomic<bool> down{false}; // its shadow died: the feed restarts one
  std::mutex mu;
  std::vector<std::vector<float>> spare;
  size_t spare_max = 1;

  std::vector<float> copy(std::span<const float> from) {
    std::vector<float> v;
    {
      std::lock_guard lock(mu);
      if (!spare.empty()) {
        v = std::move(spare.back());
        spare.pop_back();
      }
    }
    v.assign(from.begin(), from.end()); // in place when it is large enough
    return v;
  }
  void give_back(std::vector<float>&& v) {
    std::lock_guard lock(mu);
    if (spare.size() < spare_max)
      spare.push_back(std::move(v));
  }
};

namespace {

/// A copy of the shard's state at a step, for the disk.
struct snapshot {
  uint64_t step = 0;
  std::vector<float> params, adam_m, adam_v, scalars;
};

/// The shadow actor's state: its copy of the shard and what it did.
struct shadow_state {
  static inline const char* name = "checkpoint_shadow";
  model::train_config train;
  std::shared_ptr<feed_link> link;
  std::vector<float> params, adam_m, adam_v, scalars;
  shadow_status st;
  std::optional<checkpoint_target> target;
  caf::actor disk;
  bool writer = true;    // its group writes the checkpoints
  uint64_t last_due = 0; // the newest step a checkpoint was due at (written or skipped)
  std::optional<snapshot> pending; // due while a write ran: written after it

  train_state view() { return {st.step, params, adam_m, adam_v, scalars}; }
};

using shadow_self = caf::stateful_actor<shadow_state>;

/// Sends a copy to the disk actor; when it is done, the copy that became
/// due meanwhile (if any) follows.
void send_write(shadow_self* self, snapshot copy) {
  auto& S = self->state;
  S.st.writing = true;
  const uint64_t step = copy.step;
  self->request(S.disk, caf::infinite, write_atom::value, step, std::move(copy.params),
                std::move(copy.adam_m), std::move(copy.adam_v), std::move(copy.scalars))
    .then([self](written_atom, uint64_t step, const std::string& failure) {
      auto& T = self->state;
      T.st.writing = false;
      if (failure.empty()) {
        ++T.st.written;
        T.st.last_written = std::max(T.st.last_written, step);
      } else {
        ++T.st.write_failures;
      }
      if (T.pending) {
        auto next = std::move(*T.pending);
        T.pending.reset();
        send_write(self, std::move(next));
      }
    });
}

/// After the shadow reached a step: when a checkpoint is due there (see
/// checkpoint.hpp), a copy goes to the disk actor, or waits for the write
/// in flight (one copy waits at most: a newer one replaces it).
void maybe_write(shadow_self* self, bool agreed) {
  auto& S = self->state;
  const uint64_t s = S.st.step;
  if (!S.target || !S.writer || !S.st.seeded || s == 0 || s <= S.last_due
      || s <= S.target->resumed_from)
    return;
  const bool due = agreed
                  || (!S.target->when_told
                      && ((S.target->every > 0 && s % S.target->every == 0)
                          || s == S.train.steps));
  if (!due)
    return;
  S.last_due = s;
  snapshot copy{s, S.params, S.adam_m, S.adam_v, S.scalars};
  if (!S.st.writing) {
    send_write(self, std::move(copy));
    return;
  }
  if (S.pending) {
    ++S.st.write_skipped;
    spdlog::warn("checkpoint: rank {} skips step {}: step {} is due while a write still runs",
                 S.target->rank, S.pending->step, s);
  }
  S.pending = std::move(copy);
}

/// Applies step k's committed update when the shadow stands at k (else it
/// is unseeded: its feed seeds it again), checks it against the trainer's
/// hash when one came, and writes when a checkpoint is due. False when it
/// was not applied.
bool apply_update(shadow_self* self, uint64_t k, std::span<const float> update, uint64_t expect,
                  bool agreed) {
  auto& S = self->state;
  if (!S.st.seeded || k != S.st.step || update.size() != S.params.size()) {
    S.st.seeded = false;
    return false;
  }
  apply_committed(S.train, S.view(), k, update);
  ++S.st.step;
  ++S.st.applied;
  if (expect != 0) {
    ++S.st.checked;
    // The feed sends the hash with its lowest bit set (0 means "no check").
    if ((hash_state(S.params, S.adam_m, S.adam_v, S.scalars) | 1) != expect) {
      ++S.st.mismatches;
      spdlog::error("checkpoint shadow: after step {} its state differs from the trainer's", k);
    }
  }
  maybe_write(self, agreed);
  return true;
}

caf::behavior shadow_actor(shadow_self* self, model::train_config train,
                           std::shared_ptr<feed_link> link,
                           std::optional<checkpoint_target> target) {
  auto& S0 = self->state;
  S0.train = std::move(train);
  S0.link = std::move(link);
  S0.target = std::move(target);
  if (S0.target) {
    S0.disk = self->spawn<caf::detached + caf::linked>(disk_actor, *S0.target);
    S0.last_due = S0.target->resumed_from;
  }
  // An exception (a bug) ends the actor with its message as the reason,
  // for the supervisor that watches it.
  self->set_exception_handler([](caf::scheduled_actor*, std::exception_ptr& x) -> caf::error {
    try {
      std::rethrow_exception(x);
    } catch (const std::exception& e) {
      return make_error(errc::crashed, e.what());
    } catch (...) {
      return make_error(errc::crashed, "an unknown exception");
    }
  });
  return {
    [=](seed_atom, uint64_t step, std::vector<float>& p, std::vector<float>& m,
        std::vector<float>& v, std::vector<float>& sc, bool agreed) {
      auto& S = self->state;
      S.link->in_flight.fetch_sub(1, std::memory_order_relaxed);
      S.params = std::move(p);
      S.adam_m = std::move(m);
      S.adam_v = std::move(v);
      S.scalars = std::move(sc);
      S.st.step = step;
      S.st.seeded = true;
      ++S.st.seeds;
      maybe_write(self, agreed);
    },
    [=](commit_atom, uint64_t k, std::vector<float>& update, uint64_t expect, bool agreed) {
      self->state.link->in_flight.fetch_sub(1, std::memory_order_relaxed);
      if (shadow_crash_requested.exchange(false, std::memory_order_relaxed))
        throw std::runtime_error(fmt::format("injected crash at update {} (chaos crash-shadow)", k));
      if (apply_update(self, k, update, expect, agreed))
        self->state.link->give_back(std::move(update));
    },
    [=](commit_atom, uint64_t k, const bulk& update, uint64_t expect, bool agreed) {
      // The checkpointer's: applied from the buffer it was received into.
      self->state.link->in_flight.fetch_sub(1, std::memory_order_relaxed);
      apply_update(self, k,
                   {reinterpret_cast<const float*>(update.data()), update.size() / sizeof(float)},
                   expect, agreed);
    },
    [=](shadow_flush_atom) {
      // A stop's last checkpoint: the state it is at, unless one of that
      // step was due already (written, being written or waiting).
      maybe_write(self, true);
    },
    [=](writer_atom, bool writer) { self->state.writer = writer; },
    [=](status_atom) {
      auto& S = self->state;
      S.st.state_hash = S.st.seeded ? hash_state(S.params, S.adam_m, S.adam_v, S.scalars) : 0;
      S.st.writing = S.st.writing || S.pending.has_value();
      const auto& s = S.st;
      return std::vector<uint64_t>{s.step,         s.state_hash,     s.seeded ? 1u : 0u,
                                   s.applied,      s.seeds,          s.checked,
                                   s.mismatches,   s.written,        s.write_failures,
                                   s.write_skipped, s.last_written,  s.writing ? 1u : 0u};
    },
  };
}

std::vector<float> copy_of(std::span<const float> s) {
  return std::vector<float>(s.begin(), s.end());
}

} // namespace

shadow_feed::shadow_feed(caf::actor_system& sys, shadow_options o)
    : sys_(sys), o_(std::move(o)) {
  if (o_.target) {
    clock_.every = o_.target->every;
    clock_.every_time = o_.target->every_time;
    writer_ = o_.target->rank / std::max<uint32_t>(1, o_.target->ranks_per_group) == 0;
  }
  spawn_shadow_actor();
}

/// A shadow actor of its own link, told whether it writes, and handed to
/// the supervision: if it dies with an error, the link says so and the
/// next boundary restarts it.
void shadow_feed::spawn_shadow_actor() {
  link_ = std::make_shared<feed_link>();
  link_->spare_max = o_.queue_max + 1;
  shadow_ = sys_.spawn(shadow_actor, o_.train, link_, o_.target);
  caf::anon_send(shadow_, writer_atom::value, writer_);
  if (o_.supervise)
    o_.supervise(shadow_, [link = link_] { link->down.store(true); });
}

void shadow_feed::restart_if_down(uint64_t step) {
  if (!link_->down.load())
    return;
  // Safe: the shadow holds a copy of what the trainer has, and a write it
  // had in flight never committed its manifest. The new one is seeded now.
  ++restarts_;
  tracking_ = false;
  spawn_shadow_actor();
  spdlog::warn("checkpoint: rank {}'s shadow restarted (restart {}), seeded at step {}",
               o_.target ? o_.target->rank : 0, restarts_, step);
}

void shadow_feed::entered_epoch(std::span<const uint32_t> members, size_t ranks_per_group) {
  if (!o_.target || members.empty())
    return;
  const size_t S = std::max<size_t>(1, ranks_per_group);
  const bool w = o_.target->rank / S == *std::min_element(members.begin(), members.end()) / S;
  if (w != writer_)
    caf::anon_send(shadow_, writer_atom::value, w);
  writer_ = w;
}

shadow_feed::~shadow_feed() {
  caf::anon_send_exit(shadow_, caf::exit_reason::user_shutdown);
}

bool checkpoint_clock::wants(uint64_t k) {
  if (every_time.count() <= 0)
    return false;
  if (every > 0 && (k + 1) % every == 0)
    last_due = std::chrono::steady_clock::now();
  return std::chrono::steady_clock::now() - last_due >= every_time;
}

void checkpoint_clock::agreed(uint64_t k) {
  agreed_step = k + 1; // the state after step k
  last_due = std::chrono::steady_clock::now();
}

bool shadow_feed::wants_checkpoint(uint64_t k) {
  return o_.target && clock_.wants(k);
}

void shadow_feed::checkpoint_agreed(uint64_t k) {
  clock_.agreed(k);
}

void shadow_feed::at_boundary(const train_state& st) {
  restart_if_down(st.step);
  if (!active()) {
    tracking_ = false; // seeded again if this group becomes the writer
    return;
  }
  if (tracking_ && next_ == st.step)
    return;
  // A copy of the state at this boundary: the shadow starts (again) here.
  // It is sent even when the queue is full: the updates in it are moot.
  link_->in_flight.fetch_add(1, std::memory_order_relaxed);
  caf::anon_send(shadow_, seed_atom::value, st.step, copy_of(st.params), copy_of(st.adam_m),
                 copy_of(st.adam_v), copy_of(st.scalars), st.step == clock_.agreed_step);
  tracking_ = true;
  next_ = st.step;
}

void shadow_feed::committed(uint64_t k, std::span<const float> update, const train_state& after) {
  if (!active() || !tracking_ || k != next_) {
    tracking_ = false;
    return;
  }
  if (link_->in_flight.load(std::memory_order_relaxed) >= static_cast<int64_t>(o_.queue_max)) {
    ++dropped_;
    tracking_ = false; // re-seeded at the next boundary
    return;
  }
  const uint64_t expect =
    o_.check ? hash_state(after.params, after.adam_m, after.adam_v, after.scalars) | 1 : 0;
  link_->in_flight.fetch_add(1, std::memory_order_relaxed);
  caf::anon_send(shadow_, commit_atom::value, k, link_->copy(update), expect,
                 k + 1 == clock_.agreed_step);
  ++next_;
}

expected<shadow_status> shadow_status_of(caf::actor_system& sys, const caf::actor& shadow,
                                         std::chrono::milliseconds timeout) {
  caf::scoped_actor self{sys};
  expected<shadow_status> out = make_error(errc::timeout, "the checkpoint shadow did not answer");
  self->request(shadow, caf::duration{timeout}, status_atom::value)
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
        s.written = v.at(7);
        s.write_failures = v.at(8);
        s.write_skipped = v.at(9);
        s.last_written = v.at(10);
        s.writing = v.at(11) != 0;
        out = s;
      },
      [&](caf::error& e) {
        out = make_error(errc::timeout,
                         fmt::format("the checkpoint shadow: {}", sys.render(e)));
      });
  return out;
}

caf::actor spawn_shadow(caf::actor_system& sys, model::train_config train,
                        std::optional<checkpoint_target> target) {
  auto link = std::make_shared<feed_link>();
  link->spare_max = 0; // its updates come from elsewhere: nothing to hand back
  return sys.spawn(shadow_actor, std::move(train), std::move(link), std::move(target));
}

expected<shadow_status> shadow_feed::status(std::chrono::milliseconds timeout) {
  return shadow_status_of(sys_, shadow_, timeout);
}

expected<shadow_status> shadow_feed::drain(uint64_t step, std::chrono::milliseconds timeout) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    auto s = status(timeout);
    if (!s)
      return s;
    // A shadow not fed (another group writes) stays where it was.
    if ((s->step >= step || !active()) && !s->writing)
      return s;
    if (std::chrono::steady_clock::now() > until)
      return make_error(errc::timeout,
                        fmt::format("the checkpoint shadow is at step {}{} after {} ms, not at "
                                    "step {}",
                                    s->step, s->writing ? " and still writing" : "",
                                    timeout.count(), step));
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

} // namespace cmesh::actors
