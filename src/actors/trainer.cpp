#include "actors/trainer.hpp"

#include "actors/optimizer.hpp"
#include "actors/resident.hpp"
#include "actors/step_collectives.hpp"

#include "collectives/exact.hpp"
#include "core/check.hpp"
#include "core/env.hpp"
#include "core/pages.hpp"
#include "kernels/optim.hpp"
#include "kernels/precision.hpp"
#include "recovery/placement.hpp"
#include "recovery/verify.hpp"

#include <xxhash.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cmath>
#include <cstring>
#include <atomic>
#include <stdexcept>
#include <chrono>
#include <deque>
#include <map>
#include <numeric>
#include <optional>
#include <thread>
#include <utility>

namespace cmesh::actors {

namespace {

std::atomic<bool> hang_requested{false};
std::atomic<int> faults_requested{0};
std::atomic<bool> crash_requested{false};
std::atomic<bool> stop_requested{false};
std::atomic<int> flips_requested{0};

/// A hash as a slot of the commit vote, an all_reduce with max over int64:
/// every other rank's slot holds INT64_MIN, so the max is the owner's
/// value (a hash equal to INT64_MIN's bits is moved by one).
int64_t vote_slot(uint64_t h) {
  int64_t v;
  std::memcpy(&v, &h, sizeof v);
  return v == INT64_MIN ? INT64_MIN + 1 : v;
}
uint64_t slot_hash(int64_t v) {
  uint64_t h;
  std::memcpy(&h, &v, sizeof h);
  return h;
}

/// A chaos hang: the computation never ends (until the process is killed).
void maybe_hang() {
  while (hang_requested.load(std::memory_order_relaxed))
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
}

/// Worst layer's max expert load over its mean.
double imbalance(const std::vector<float>& loads, size_t experts) {
  double worst = 1.0;
  for (size_t l = 0; experts > 0 && l + experts <= loads.size(); l += experts) {
    double sum = 0, mx = 0;
    for (size_t e = 0; e < experts; ++e) {
      sum += loads[l + e];
      mx = std::max<double>(mx, loads[l + e]);
    }
    if (sum > 0)
      worst = std::max(worst, mx / (sum / static_cast<double>(experts)));
  }
  return worst;
}

} // namespace

shard_split split_shards(size_t n, size_t s, size_t block) {
  CMESH_CHECK(s >= 1 && block >= 1);
  shard_split out;
  const size_t blocks = n / block, base = blocks / s, extra = blocks % s;
  size_t at = 0;
  for (size_t i = 0; i < s; ++i) {
    size_t c = (base + (i < extra ? 1 : 0)) * block;
    if (i + 1 == s)
      c = n - at;
    out.offsets.push_back(at);
    out.counts.push_back(c);
    at += c;
  }
  return out;
}

bool is_skipped_update(std::span<const float> update) {
  return !update.empty() && std::isnan(update[0]);
}

void request_hang() {
  hang_requested.store(true, std::memory_order_relaxed);
}

void request_fault() {
  faults_requested.fetch_add(1, std::memory_order_relaxed);
}

void request_crash() {
  crash_requested.store(true, std::memory_order_relaxed);
}

void request_stop() {
  stop_requested.store(true, std::memory_order_relaxed);
}

bool stop_was_requested() {
  return stop_requested.load(std::memory_order_relaxed);
}

void request_flip() {
  flips_requested.fetch_add(1, std::memory_order_relaxed);
}

struct trainer::impl {
  trainer_options o;
  std::shared_ptr<const model::corpus> data;
  coll::communicator* comm = nullptr;  // the current epoch's: every rank
  coll::communicator* group = nullptr; // this rank's replica group (S > 1)
  coll::communicator* cross = nullptr; // the ranks holding this shard (S > 1: else comm)
  supervision* sup = nullptr;          // elastic runs only
  coll::communicator* dev_group = nullptr; // on_device, S > 1: the group's over device memory
  coll::communicator* dev_cross = nullptr; // on_device: the shard's holders' (S = 1: everyone)
  bool on_device = false;              // the gradient summed on the model's device
  shard_split shards;
  size_t position = 0;                 // this rank's position in its group
  std::optional<resident_layout> resident; // train.experts = "resident": the state's layout
  std::vector<float> packed;           // resident: the dense tensors, packed
  std::vector<float> adam_m, adam_v;   // of this rank's shard
  bool bf16 = false;
  std::vector<float> master;           // bf16: the fp32 master of the shard
  std::array<float, 2> scalars{};      // loss scale, good steps since its last change
  std::vector<uint16_t> wire16;        // bf16: weights and gradients on the wire
  std::vector<uint16_t> shard16;
  group_exchange experts;              // expert parallelism (S > 1)
  bool expert_parallel = false;
  bool full = false;                   // full sharding: weights and gradients streamed
  weight_stream stream;
  std::unique_ptr<collective_lane> lane; // train.overlap: the step's collectives while computing
  unit_reducer reducer;                // whole weights, not exact: the gradient's sum over groups
  std::vector<float> shard_grad;       // the reduced gradient of the shard (S > 1)
  std::vector<std::vector<float>> contributions; // exact mode: one per micro-batch
  std::deque<std::pair<uint64_t, std::vector<float>>> recent; // committed updates, oldest first
  /// The update of a step whose commit vote failed here: if the others saw
  /// it pass, it is applied when the next epoch reconciles.
  std::optional<std::pair<uint64_t, std::vector<float>>> pending;
  /// The commit vote's buffer, reused step to step: [any rank failed,
  /// newest epoch, overflow, a checkpoint wanted, a stop asked for, then
  /// with replica verification one state hash per member], max-reduced.
  std::vector<int64_t> vote;
  static constexpr size_t vote_hashes = 5; // where the hashes start
  double comm_s = 0;

  impl(trainer_options opts, std::shared_ptr<const model::corpus> d)
      : o(std::move(opts)), data(std::move(d)) {}

  size_t per_group() const { return std::max<size_t>(1, o.ranks_per_group); }

  /// A collective, timed; the first error latches (later ones are skipped).
  template <class F>
  void collective(caf::error& latched, F&& f) {
    if (latched)
      return;
    double t0 = mono_s();
    latched = f();
    comm_s += mono_s() - t0;
  }

  void init_state(model::model& m, uint32_t rank) {
    shards = split_shards(m.parameters().size(), per_group(), norm_block);
    position = rank % per_group();
    size_t state = shards.counts[position];
    if (o.config.train.experts == "resident") {
      auto l = resident_layout::make(m.tensors(), m.experts(), per_group(), position);
      CMESH_CHECK(l); // the config was checked: the experts divide over the ranks
      resident = std::move(*l);
      state = resident->state_size();
    }
    adam_m.assign(state, 0.0f);
    adam_v.assign(state, 0.0f);
    bf16 = o.config.train.precision == "bf16";
    full = o.config.train.sharding == "full" && per_group() > 1;
    scalars = {static_cast<float>(o.config.train.loss_scale), 0.0f};
  }
  /// This rank's shard of a flat buffer (resident experts: none, the state
  /// is not one range of it).
  std::span<float> shard_of(std::span<float> full) const {
    if (resident)
      return {};
    return full.subspan(shards.offsets[position], shards.counts[position]);
  }

  void apply(std::span<float> params, uint64_t k, std::span<const float> update);
  void remember(uint64_t k, std::span<const float> update);
  caf::error split_epoch();
  caf::error device_epoch();
  caf::error reconcile(train_state& st);
  expected<double> global_norm(std::span<const float> shard);
  expected<double> resident_norm(std::span<const float> state);
  /// Where tensor elements [a, b) lie in this rank's state: (index, count),
  /// count 0 when none do.
  std::pair<size_t, size_t> in_state(size_t a, size_t b) const;
  /// The flat element at index i of this rank's state.
  size_t flat_of(size_t i) const {
    return resident ? resident->flat_of(i) : shards.offsets[position] + i;
  }
  // Replica verification.
  void maybe_flip(std::span<float> master, uint64_t step, const model::model& net);
  caf::error check_replicas(coll::communicator& comm, std::span<const int64_t> hashes,
                            std::span<const float> master, const model::model& net,
                            uint64_t step);
  std::vector<uint64_t> segment_hashes(std::span<const float> master,
                                       const model::model& net) const;
  caf::error commit_vote(coll::communicator& comm, uint64_t step, caf::error& latched,
                         bool overflow, std::span<const float> master, const model::model& net,
                         double& verify_ms);
};

trainer::trainer(trainer_options opts, std::unique_ptr<model::model> m,
                 std::shared_ptr<const model::corpus> data, coll::communicator& comm)
    : impl_(std::make_unique<impl>(std::move(opts), std::move(data))), model_(std::move(m)) {
  CMESH_CHECK(impl_->per_group() == 1); // groups of several ranks need a supervision
  impl_->comm = &comm;
  impl_->cross = &comm;
  impl_->init_state(*model_, comm.members().ranks[comm.index()]);
}

trainer::trainer(trainer_options opts, std::unique_ptr<model::model> m,
                 std::shared_ptr<const model::corpus> data, supervision& sup, uint32_t rank)
    : impl_(std::make_unique<impl>(std::move(opts), std::move(data))), model_(std::move(m)) {
  impl_->sup = &sup;
  impl_->init_state(*model_, rank);
}

trainer::~trainer() = default;

void trainer::impl::apply(std::span<float> params, uint64_t k, std::span<const float> update) {
  apply_committed(o.config.train, {k, params, adam_m, adam_v, scalars}, k, update);
}

void trainer::impl::remember(uint64_t k, std::span<const float> update) {
  if (o.replay_window == 0)
    return;
  std::vector<float> slot;
  if (recent.size() >= o.replay_window) {
    slot = std::move(recent.front().second);
    recent.pop_front();
  }
  slot.assign(update.begin(), update.end());
  recent.emplace_back(k, std::move(slot));
}

/// The group and cross communicators of the epoch just entered: every
/// group must be whole (the coordinator admits whole groups only).
caf::error trainer::impl::split_epoch() {
  const size_t S = per_group();
  if (S == 1) {
    group = nullptr;
    cross = comm;
    return {};
  }
  const auto& m = comm->members();
  const uint32_t me = m.ranks[comm->index()];
  coll::membership g{m.epoch, {}}, x{m.epoch, {}};
  for (auto r : m.ranks) {
    if (r / S == me / S)
      g.ranks.push_back(r);
    if (r % S == me % S)
      x.ranks.push_back(r);
  }
  if (g.ranks.size() != S || m.ranks.size() % S != 0)
    return make_error(errc::invalid_argument,
                      fmt::format("epoch {} does not hold whole replica groups of {} ranks: does "
                                  "the coordinator have the workers' --replicas?",
                                  m.epoch, S));
  auto gc = sup->sub_communicator(0, std::move(g));
  if (!gc)
    return gc.error();
  auto xc = sup->sub_communicator(1, std::move(x));
  if (!xc)
    return xc.error();
  group = *gc;
  cross = *xc;
  return {};
}

/// The device communicators of the epoch just split: the group's (S > 1)
/// and the shard's holders', of the same members as the host ones.
caf::error trainer::impl::device_epoch() {
  dev_group = dev_cross = nullptr;
  if (group) {
    auto g = sup->device_communicator(0, group->members());
    if (!g)
      return g.error();
    dev_group = *g;
  }
  auto x = sup->device_communicator(1, cross->members());
  if (!x)
    return x.error();
  dev_cross = *x;
  return {};
}

caf::error trainer::impl::reconcile(train_state& st) {
  const size_t N = comm->size();
  // Everyone's step. A rank whose commit vote failed while the others saw
  // it pass holds that step's update (every rank had it before voting).
  // [step of each rank..., whether its last committed step was skipped...]
  std::vector<int64_t> all(2 * N, -1);
  all[comm->index()] = static_cast<int64_t>(st.step);
  all[N + comm->index()] =
    !recent.empty() && recent.back().first + 1 == st.step && is_skipped_update(recent.back().second);
  if (auto e = comm->all_reduce(all.data(), 2 * N, coll::dtype::int64, coll::reduce_op::max))
    return e;
  const int64_t top = *std::max_element(all.begin(), all.begin() + N);
  if (pending && static_cast<int64_t>(st.step) + 1 == top
      && static_cast<int64_t>(pending->first) == static_cast<int64_t>(st.step)) {
    // The ranks at the top know whether the step was skipped (an overflow
    // on another shard): then so is it here.
    for (size_t i = 0; i < N; ++i)
      if (all[i] == top && all[N + i] == 1)
        std::fill(pending->second.begin(), pending->second.end(), std::nanf(""));
    apply(st.params, st.step, pending->second);
    remember(st.step, pending->second);
    ++st.step;
    spdlog::info("trainer: step {} committed elsewhere: its update applied here", pending->first);
  }
  pending.reset();

  // The rest travels between the ranks holding the same shard.
  auto& c = *cross;
  const size_t n = c.size(), me = c.index();
  // [step of each member..., oldest update each member still holds...]
  std::vector<int64_t> steps(2 * n, -1);
  steps[me] = static_cast<int64_t>(st.step);
  steps[n + me] = recent.empty() ? static_cast<int64_t>(st.step)
                                 : static_cast<int64_t>(recent.front().first);
  if (auto e = c.all_reduce(steps.data(), 2 * n, coll::dtype::int64, coll::reduce_op::max))
    return e;
  const int64_t hi = *std::max_element(steps.begin(), steps.begin() + n);
  const int64_t lo = *std::min_element(steps.begin(), steps.begin() + n);
  if (hi != top)
    return make_error(errc::unrecoverable,
                      fmt::format("no rank holding shard {} reached step {}", position, top));
  if (hi == lo)
    return {};
  const size_t leader = static_cast<size_t>(std::find(steps.begin(), steps.end(), hi) - steps.begin());
  const int64_t oldest = steps[n + leader];
  for (size_t i = 0; i < n; ++i) {
    if (steps[i] < oldest) {
      auto who = c.members().ranks[i];
      return make_error(i == me ? errc::fenced : errc::aborted,
                        fmt::format("rank {} is at step {}, behind the oldest update (step {}) "
                                    "that rank {} at step {} still holds",
                                    who, steps[i], oldest, c.members().ranks[leader], hi));
    }
  }
  std::vector<float> update(st.params.size());
  for (int64_t k = lo; k < hi; ++k) {
    if (me == leader) {
      auto it = std::find_if(recent.begin(), recent.end(),
                             [&](const auto& r) { return r.first == static_cast<uint64_t>(k); });
      CMESH_CHECK(it != recent.end()); // the window covers hi - lo steps, checked above
      update = it->second;
    }
    if (auto e = c.broadcast(update.data(), update.size(), coll::dtype::float32, leader))
      return e;
    if (static_cast<int64_t>(st.step) == k) {
      apply(st.params, static_cast<uint64_t>(k), update);
      remember(static_cast<uint64_t>(k), update);
      ++st.step;
    }
  }
  spdlog::info("trainer: reconciled epoch {}: steps {}..{}, {} update(s) replayed", comm->members().epoch,
               lo, hi, hi - lo);
  return {};
}

/// The L2 norm of the whole gradient from the shards: each block's sum of
/// squares in double, gathered over the group (bit patterns, not summed on
/// the wire), then added in block order: the same bits in every layout.
expected<double> trainer::impl::global_norm(std::span<const float> shard) {
  if (resident)
    return resident_norm(shard);
  const size_t total = shards.offsets.back() + shards.counts.back();
  auto blocks_in = [](size_t n) { return (n + norm_block - 1) / norm_block; };
  std::vector<size_t> counts;
  for (auto c : shards.counts)
    counts.push_back(blocks_in(c));
  std::vector<double> partial(blocks_in(total), 0.0);
  const size_t first = shards.offsets[position] / norm_block;
  for (size_t b = 0; b < counts[position]; ++b) {
    size_t at = b * norm_block, len = std::min(norm_block, shard.size() - at);
    partial[first + b] = kernels::cpu::sum_of_squares(shard.data() + at, len);
  }
  if (group) {
    static_assert(sizeof(double) == sizeof(int64_t));
    if (auto e = group->all_gather(partial.data() + first, partial.data(), counts,
                                   coll::dtype::int64))
      return e;
  }
  double sum = 0;
  for (double p : partial)
    sum += p;
  return std::sqrt(sum);
}

/// Resident experts: the same per-block sums, each block computed by the
/// rank holding it and the others' zeros added to it (as bit patterns, so
/// nothing rounds), then added in block order.
expected<double> trainer::impl::resident_norm(std::span<const float> state) {
  const auto& L = *resident;
  std::vector<int64_t> partial(L.blocks(), 0);
  size_t at = 0;
  for (size_t k = 0; k < L.block_ids().size(); ++k) {
    const double v = kernels::cpu::sum_of_squares(state.data() + at, L.block_lengths()[k]);
    std::memcpy(&partial[L.block_ids()[k]], &v, sizeof v);
    at += L.block_lengths()[k];
  }
  if (group)
    if (auto e = group->all_reduce(std::span<int64_t>(partial), coll::reduce_op::sum))
      return e;
  double sum = 0;
  for (int64_t bits : partial) {
    double v;
    std::memcpy(&v, &bits, sizeof v);
    sum += v;
  }
  return std::sqrt(sum);
}

std::pair<size_t, size_t> trainer::impl::in_state(size_t a, size_t b) const {
  if (!resident) {
    const size_t lo = shards.offsets[position], hi = lo + shards.counts[position];
    const size_t x = std::max(lo, a), y = std::min(hi, b);
    return y > x ? std::pair{x - lo, y - x} : std::pair{size_t{0}, size_t{0}};
  }
  // A tensor's elements here are one run of the state: a dense tensor's
  // part of the dense piece (contiguous in the packed order), or a whole
  // expert tensor inside its unit.
  size_t at = 0;
  std::pair<size_t, size_t> out{0, 0};
  for (const auto& r : resident->state_ranges()) {
    const size_t x = std::max(r.begin, a), y = std::min(r.end, b);
    if (y > x) {
      if (out.second == 0)
        out.first = at + (x - r.begin);
      out.second += y - x;
    }
    at += r.size();
  }
  return out;
}

uint64_t hash_state(std::span<const float> params, std::span<const float> adam_m,
                    std::span<const float> adam_v, std::span<const float> scalars) {
  XXH3_state_t* h = XXH3_createState();
  CMESH_CHECK(h != nullptr);
  XXH3_64bits_reset(h);
  for (auto part : {params, adam_m, adam_v, scalars})
    XXH3_64bits_update(h, part.data(), part.size() * sizeof(float));
  const uint64_t out = XXH3_64bits_digest(h);
  XXH3_freeState(h);
  return out;
}

/// Chaos flip: one bit of the master shard (the lowest of the middle
/// element's mantissa: the subtlest corruption there is).
void trainer::impl::maybe_flip(std::span<float> master, uint64_t step, const model::model& net) {
  if (flips_requested.load(std::memory_order_relaxed) <= 0 || master.empty())
    return;
  flips_requested.fetch_sub(1, std::memory_order_relaxed);
  const size_t i = master.size() / 2;
  uint32_t bits;
  std::memcpy(&bits, &master[i], sizeof bits);
  bits ^= 1u;
  std::memcpy(&master[i], &bits, sizeof bits);
  const size_t at = flat_of(i);
  std::string tensor = "?";
  for (const auto& t : net.tensors())
    if (at >= t.offset && at < t.offset + t.size)
      tensor = t.name;
  spdlog::warn("trainer: chaos flip: bit 0 of weight {} ({}) flipped at step {}", at, tensor,
               step);
}

/// Per tensor of the model, the hashes of this rank's part of it: weights,
/// AdamW m, AdamW v; then the loss scale. The same number on every rank
/// (a tensor outside this shard hashes nothing).
std::vector<uint64_t> trainer::impl::segment_hashes(std::span<const float> master,
                                                    const model::model& net) const {
  std::vector<uint64_t> out;
  for (const auto& t : net.tensors()) {
    const auto [at, n] = in_state(t.offset, t.offset + t.size);
    out.push_back(XXH3_64bits(master.data() + at, n * sizeof(float)));
    out.push_back(XXH3_64bits(adam_m.data() + at, n * sizeof(float)));
    out.push_back(XXH3_64bits(adam_v.data() + at, n * sizeof(float)));
  }
  out.push_back(XXH3_64bits(scalars.data(), scalars.size() * sizeof(float)));
  return out;
}

/// The hashes of the commit vote (one slot per member, in member order)
/// compared over the replica groups. On a divergence every member learns
/// the same verdict; they exchange per-tensor hashes to name what differs,
/// one member reports it, and the step fails on every rank.
caf::error trainer::impl::check_replicas(coll::communicator& comm,
                                         std::span<const int64_t> slots,
                                         std::span<const float> master, const model::model& net,
                                         uint64_t step) {
  const size_t S = per_group(), N = comm.size();
  const auto& ranks = comm.members().ranks;
  std::vector<uint32_t> groups;
  std::map<uint32_t, size_t> index_of; // group -> its index in `groups`
  for (auto r : ranks)
    if (index_of.emplace(static_cast<uint32_t>(r / S), groups.size()).second)
      groups.push_back(static_cast<uint32_t>(r / S));
  std::vector<uint64_t> table(groups.size() * S, 0);
  for (size_t i = 0; i < N; ++i)
    table[index_of[static_cast<uint32_t>(ranks[i] / S)] * S + ranks[i] % S] = slot_hash(slots[i]);
  const auto v = recovery::compare_replicas(groups, S, table);
  if (v.agree)
    return {};
  auto in_minority = [&](size_t i) { // member i's group
    return std::binary_search(v.minority.begin(), v.minority.end(),
                              static_cast<uint32_t>(ranks[i] / S));
  };
  // Name the tensors: every member's per-segment hashes.
  const auto mine = segment_hashes(master, net);
  const size_t K = mine.size();
  std::vector<int64_t> all(N * K, INT64_MIN);
  for (size_t k = 0; k < K; ++k)
    all[comm.index() * K + k] = vote_slot(mine[k]);
  if (auto e = comm.all_reduce(all.data(), all.size(), coll::dtype::int64, coll::reduce_op::max))
    return e;
  std::vector<std::string> names;
  for (const auto& t : net.tensors())
    for (const char* what : {" (weights)", " (adam m)", " (adam v)"})
      names.push_back(t.name + what);
  names.push_back("loss scale");
  auto row = [&](size_t i) {
    std::vector<uint64_t> r(K);
    for (size_t k = 0; k < K; ++k)
      r[k] = slot_hash(all[i * K + k]);
    return r;
  };
  std::vector<std::string> parts;
  for (auto p : v.positions) {
    // The reference at position p: a member of the majority, or (no
    // majority) the first group's.
    std::vector<size_t> at_p;
    for (size_t i = 0; i < N; ++i)
      if (ranks[i] % S == p)
        at_p.push_back(i);
    size_t ref = at_p.front();
    for (auto i : at_p)
      if (!in_minority(i)) {
        ref = i;
        break;
      }
    for (auto i : at_p)
      if (i != ref && slot_hash(slots[i]) != slot_hash(slots[ref]))
        parts.push_back(fmt::format("rank {} (group {}): {}", ranks[i], ranks[i] / S,
                                    recovery::differing_segments(names, row(i), row(ref))));
  }
  wire::replica_divergence d;
  d.epoch = comm.members().epoch;
  d.step = step;
  d.minority = v.minority;
  d.no_majority = v.no_majority;
  d.positions = v.positions;
  d.tensors = fmt::format("{}", fmt::join(parts, "; "));
  d.reason = v.reason;
  // One member tells the coordinator: the first outside the minority.
  size_t reporter = 0;
  while (reporter < N && in_minority(reporter))
    ++reporter;
  if (sup && comm.index() == reporter)
    sup->report_divergence(d);
  spdlog::error("trainer: replica divergence at step {}{}: {}; differing: {}", step,
                in_minority(comm.index()) ? " (this rank's group is the minority)" : "", v.reason,
                d.tensors);
  return make_error(v.no_majority ? errc::unrecoverable : errc::aborted,
                    fmt::format("replica divergence at step {}: {}{}", step, v.reason,
                                v.no_majority ? "; no majority to trust" : ""));
}

/// The commit vote, an all_reduce (max) over every member: [a no (a
/// latched error), the newest epoch heard of, a gradient that overflowed];
/// verification steps add a slot per member, the hash of its state, and
/// compare them (a divergence latches). The result is in `vote`; returns
/// the vote's own error.
caf::error trainer::impl::commit_vote(coll::communicator& comm, uint64_t step,
                                      caf::error& latched, bool overflow,
                                      std::span<const float> master, const model::model& net,
                                      double& verify_ms) {
  const auto& tc = o.config.train;
  const bool verify = tc.verify_every > 0 && step % tc.verify_every == 0;
  vote.assign(vote_hashes + (verify ? comm.size() : 0), INT64_MIN);
  vote[0] = latched ? 1 : 0;
  vote[1] = sup ? static_cast<int64_t>(sup->newest_epoch()) : 0;
  vote[2] = overflow ? 1 : 0;
  vote[3] = o.listener && o.listener->wants_checkpoint(step) ? 1 : 0;
  vote[4] = stop_requested.load(std::memory_order_relaxed) ? 1 : 0;
  const double t0 = mono_s();
  if (verify)
    vote[vote_hashes + comm.index()] = vote_slot(hash_state(master, adam_m, adam_v, scalars));
  verify_ms += (mono_s() - t0) * 1e3;
  caf::error vote_error;
  collective(vote_error, [&] {
    return comm.all_reduce(vote.data(), vote.size(), coll::dtype::int64, coll::reduce_op::max);
  });
  if (verify && !latched && !vote_error && vote[0] == 0) {
    const double t1 = mono_s();
    collective(latched, [&] {
      return check_replicas(comm, std::span<const int64_t>(vote).subspan(vote_hashes), master,
                            net, step);
    });
    verify_ms += (mono_s() - t1) * 1e3;
  }
  return vote_error;
}

/// One run of the step loop: what the steps share (the spans of the model
/// and the shard, the mode, the state and the result), and the step's
/// phases, each a function of its own. A step reads as
///   boundary -> gather the weights -> compute and reduce the gradient (one
///   of exact, bf16 or fp32, streamed or whole) -> mean, overflow and clip
///   -> statistics and the commit vote -> commit (or retry in the next
///   epoch).
struct trainer::loop {
  impl& I;
  model::model& net;
  const model::train_config& tc;
  const size_t micro_total;
  const size_t S;
  std::span<float> params, grads;
  std::span<float> my_params; // the model's working weights of this shard
  std::span<float> master;    // the fp32 master of the shard
  bool whole_weights = false; // not streamed, not exact: summed unit by unit or whole
  bool unit_overlap = false;  // whole weights summed during the backward pass
  bool resident_overlap = false; // resident experts: the same, unit by unit into the state
  train_result result;
  double t_start = 0;
  double tokens_per_step = 0;
  train_state st;
  apply_update replay;
  uint64_t committed_here = 0; // steps this process computed and committed
  uint64_t switch_to = 0;      // the newest epoch the last vote agreed on

  /// The step being run.
  struct step_ctx {
    uint64_t step = 0;
    coll::communicator* comm = nullptr;
    size_t world = 0;
    double t0 = 0;
    caf::error latched;       // the first failed collective: the vote is no
    std::vector<size_t> mine; // this rank's micro-batches
    /// [loss sum, aux sum, dropped, expert loads...], summed over all ranks.
    std::vector<float> stats = std::vector<float>(3, 0.0f);
    std::span<float> update;  // the reduced gradient of this rank's shard
    bool overflow = false;
  };

  loop(impl& i, model::model& m)
      : I(i), net(m), tc(i.o.config.train), micro_total(model::micro_batches_per_step(tc)),
        S(i.per_group()), params(m.parameters()), grads(m.gradients()),
        my_params(i.shard_of(params)), master(my_params),
        st{0, {}, i.adam_m, i.adam_v, i.scalars} {}

  caf::error prepare();
  caf::error enter(caf::error why);
  void split_experts();
  caf::error hold_resident();
  void gather_resident(step_ctx& s);
  void sum_resident(step_ctx& s);
  expected<train_result> run();
  /// False when the loop ends (a stop agreed); an error ends the run.
  expected<bool> run_step();
  void boundary(step_ctx& s);
  void gather_weights(step_ctx& s);
  void bind_update(step_ctx& s);
  void account(step_ctx& s, const model::step_stats& m);
  void compute(step_ctx& s, float loss_scale);
  void compute_exact(step_ctx& s);
  caf::error exact_resident(step_ctx& s, const std::vector<std::span<const float>>& spans,
                            std::span<const coll::exact_piece> pieces);
  size_t group_runs(const step_ctx& s) const;
  void sum_whole(step_ctx& s);
  void finish_units(step_ctx& s);
  void sum_on_device(step_ctx& s);
  void sum_shard(step_ctx& s);
  void reduce_gradient(step_ctx& s);
  void finish_gradient(step_ctx& s);
  expected<bool> commit(step_ctx& s);
  void report(step_ctx& s, bool skipped);
  expected<uint64_t> weights_hash();
  expected<uint64_t> resident_hash();
  size_t expert_bytes() const;
};

/// The master, streaming, device and reducer set-up of the run's mode.
caf::error trainer::loop::prepare() {
  // The fp32 master of the shard: the working weights themselves in fp32,
  // a copy of its own in bf16 (the working weights are its rounding), with
  // full sharding (the working weights come and go) and with resident
  // experts (the state is not one range of the weights).
  if (I.resident) {
    if (auto e = hold_resident())
      return e;
  } else if (I.bf16 || I.full) {
    I.master.assign(my_params.begin(), my_params.end());
    master = I.master;
  }
  st.params = master;
  if (I.full) {
    // The model's flat buffers are not used from now on.
    discard_pages(params.data(), params.size());
    discard_pages(grads.data(), grads.size());
    if (tc.overlap)
      I.lane = std::make_unique<collective_lane>();
    I.stream.bind(net, I.shards, I.position, I.bf16, I.lane.get());
    if (!net.set_parameter_stream(&I.stream))
      return make_error(errc::invalid_argument,
                        "train.sharding = \"full\": the model cannot stream its weights");
    spdlog::info("trainer: weights and gradients streamed over the {} ranks of the replica group{}",
                 S, I.lane ? ", the next unit gathered while one computes" : "");
  }
  // Whole weights: summed unit by unit during the backward pass when the
  // model reports finished units, else after it.
  whole_weights = !I.full && !tc.exact && !I.resident;
  // On a device: the gradient stays there and the device's collectives sum
  // it, once the backward passes are over.
  I.on_device = whole_weights && I.sup && tc.gradient_collectives == "device"
                && I.sup->has_device_collectives() && net.keep_gradients_on_device(true);
  if (I.on_device)
    spdlog::info("trainer: gradients summed on the device{}",
                 S > 1 ? " (reduce_scatter over the group, all_reduce over the groups)"
                       : " (all_reduce over the groups)");
  if (whole_weights && !I.on_device) {
    if (tc.overlap && net.set_gradient_listener(&I.reducer)) {
      I.lane = std::make_unique<collective_lane>();
      spdlog::info("trainer: gradients summed over the groups unit by unit during the backward "
                   "pass");
    }
    I.reducer.bind(net, I.lane.get(), I.shards, I.position);
  }
  if (I.resident && S > 1 && !tc.exact && tc.overlap && net.set_gradient_listener(&I.reducer)) {
    I.lane = std::make_unique<collective_lane>();
    I.reducer.bind(net, I.lane.get(), I.shards, I.position);
    I.reducer.bind_resident(&*I.resident);
    resident_overlap = true;
    spdlog::info("trainer: resident experts: gradients summed unit by unit during the backward "
                 "pass");
  }
  unit_overlap = (whole_weights && I.lane) || resident_overlap;
  replay = [this](uint64_t k, std::span<const float> u) {
    I.apply(master, k, u);
    I.remember(k, u);
  };
  if (I.o.load)
    return I.o.load(st, I.shards.offsets[I.position]);
  return {};
}

/// Resident experts: the master is this rank's state (its piece of the
/// dense tensors, then its experts), copied out of the initial weights; the
/// model keeps only the dense tensors and this rank's experts, and hands
/// the rest of its buffers back.
caf::error trainer::loop::hold_resident() {
  if (I.o.load || I.o.listener)
    return make_error(errc::invalid_argument,
                      "train.experts = \"resident\" does not support checkpoints or the "
                      "checkpoint shadow yet");
  const auto& L = *I.resident;
  I.master.resize(L.state_size());
  L.gather_state(params, I.master);
  master = I.master;
  std::vector<std::pair<size_t, size_t>> keep;
  for (const auto& r : L.touched())
    keep.emplace_back(r.begin, r.end);
  if (!net.hold_only(keep))
    return make_error(errc::invalid_argument,
                      "train.experts = \"resident\": the model cannot hold part of its weights");
  spdlog::info("trainer: resident experts: this rank holds {} of {} experts per layer, {} of "
               "{} parameters",
               net.experts() / S, net.experts(), L.state_size(), params.size());
  return {};
}

/// Resident experts: this rank's experts come from its master as they are
/// (nobody else holds them); the dense tensors are gathered over the group,
/// packed, and unpacked into place.
void trainer::loop::gather_resident(step_ctx& s) {
  const auto& L = *I.resident;
  if (!I.group)
    return L.scatter_state(master, params);
  L.scatter_units(master, params);
  I.packed.resize(L.dense_total());
  const size_t at = L.dense_split().offsets[I.position];
  std::copy(master.begin(), master.begin() + L.dense_piece(), I.packed.begin() + at);
  I.collective(s.latched, [&] {
    return I.group->all_gather(I.packed.data() + at, I.packed.data(), L.dense_split().counts,
                               coll::dtype::float32);
  });
  if (!s.latched)
    L.unpack_dense(I.packed, params);
}

/// Resident experts: the dense gradient reduce-scattered over the group
/// (packed), this rank's experts' gradient as it is (every row routed to
/// them was computed here), then the state's sum over the groups.
void trainer::loop::sum_resident(step_ctx& s) {
  const auto& L = *I.resident;
  if (!I.group) {
    L.gather_state(grads, s.update);
  } else {
    I.packed.resize(L.dense_total());
    L.pack_dense(grads, I.packed);
    I.collective(s.latched, [&] {
      return I.group->reduce_scatter(I.packed.data(), s.update.data(), L.dense_split().counts,
                                     coll::dtype::float32, coll::reduce_op::sum);
    });
    L.gather_units(grads, s.update);
  }
  coll::communicator* across = I.group ? I.cross : s.comm;
  I.collective(s.latched, [&] {
    return across->all_reduce(s.update.data(), s.update.size(), coll::dtype::float32,
                              coll::reduce_op::sum);
  });
}

/// Enters the next epoch (after a failure `why`, or an agreed switch) and
/// reconciles its members; retried while the new epoch fails too.
caf::error trainer::loop::enter(caf::error why) {
  for (;;) {
    uint64_t after = I.comm ? I.comm->members().epoch : 0;
    auto c = I.sup->enter_epoch(after, why, st, replay);
    if (!c)
      return c.error();
    I.comm = *c;
    auto e = I.split_epoch();
    if (!e && I.on_device)
      e = I.device_epoch();
    if (!e)
      e = I.reconcile(st);
    if (!e) {
      if (I.o.listener)
        I.o.listener->entered_epoch(I.comm->members().ranks, S);
      return {};
    }
    if (code_of(e) == errc::fenced || code_of(e) == errc::unrecoverable
        || code_of(e) == errc::invalid_argument) // e.g. layouts that disagree
      return e;
    spdlog::warn("trainer: epoch {} failed while reconciling: {}", I.comm->members().epoch,
                 describe(e));
    why = e;
  }
}

/// Expert parallelism inside a group. In exact mode per source: an
/// expert's gradient summed over the rows of several micro-batches in one
/// product would not be the per-micro-batch contribution exact mode adds.
void trainer::loop::split_experts() {
  if (!I.group)
    return;
  // Resident experts stay on their hosts: the static blocks.
  I.experts.configure(tc.expert_placement == "balanced" && !I.resident, tc.expert_replicas);
  I.experts.set_per_source(tc.exact);
  I.experts.reset(I.group);
  I.experts.set_lane(I.lane.get());
  I.expert_parallel = net.set_expert_exchange(&I.experts);
  // A rank holds only its experts' weights: it must never compute another's.
  CMESH_CHECK(I.expert_parallel || !I.resident);
  if (I.expert_parallel)
    spdlog::info("trainer: experts split over the {} ranks of the replica group", S);
}

/// The step boundary: the state is at `st.step`; the supervision and the
/// listener see it, and a chaos fault breaks this rank's communicators.
void trainer::loop::boundary(step_ctx& s) {
  I.maybe_flip(master, st.step, net);
  if (I.sup)
    I.sup->at_boundary(st);
  if (I.o.listener)
    I.o.listener->at_boundary(st);
  if (crash_requested.exchange(false, std::memory_order_relaxed))
    throw std::runtime_error(fmt::format("injected crash at step {} (chaos crash)", s.step));
  if (faults_requested.load(std::memory_order_relaxed) == 0)
    return;
  faults_requested.fetch_sub(1, std::memory_order_relaxed);
  // A chaos fault: this rank's communicators break as on a transport error;
  // the process and its peers live on.
  spdlog::warn("trainer: chaos fault: step {}'s collectives fail on this rank", s.step);
  auto why = make_error(errc::transport_failure,
                        fmt::format("injected fault at step {} (chaos fault)", s.step));
  if (I.sup)
    I.sup->abort_epoch(why);
  else
    s.comm->abort(why);
}

/// The full working weights from the group's shards (bf16: the master
/// rounded, and gathered as bf16). Full sharding gathers unit by unit
/// inside the model (weight_stream) instead.
void trainer::loop::gather_weights(step_ctx& s) {
  if (I.resident)
    return gather_resident(s);
  if (I.full)
    return;
  if (I.on_device) {
    // This rank's shard goes up (bf16: the master rounded); the group's
    // gather runs on the device, in place (in fp32).
    if (I.bf16) {
      std::copy(master.begin(), master.end(), my_params.begin());
      kernels::cpu::round_to_bf16(my_params.data(), my_params.size());
    }
    const size_t at = I.shards.offsets[I.position];
    net.upload_parameters(at, my_params.size());
    if (I.dev_group) {
      float* w = net.device_parameters();
      I.collective(s.latched, [&] {
        return I.dev_group->all_gather(w + at, w, I.shards.counts, coll::dtype::float32);
      });
    }
  } else if (I.bf16) {
    I.wire16.resize(params.size());
    auto* mine16 = I.wire16.data() + I.shards.offsets[I.position];
    kernels::cpu::float_to_bf16(master.data(), mine16, master.size());
    if (I.group)
      I.collective(s.latched, [&] {
        return I.group->all_gather(mine16, I.wire16.data(), I.shards.counts,
                                   coll::dtype::bfloat16);
      });
    if (!s.latched) {
      if (I.group)
        kernels::cpu::bf16_to_float(I.wire16.data(), params.data(), params.size());
      else
        kernels::cpu::bf16_to_float(mine16, my_params.data(), my_params.size());
    }
  } else if (I.group) {
    I.collective(s.latched, [&] {
      return I.group->all_gather(my_params.data(), params.data(), I.shards.counts,
                                 coll::dtype::float32);
    });
  }
}

/// Where the reduced gradient of this rank's shard ends (`s.update`), and
/// the streams and reducer that fill it.
void trainer::loop::bind_update(step_ctx& s) {
  if (I.resident) {
    I.shard_grad.resize(master.size());
    s.update = I.shard_grad;
    if (resident_overlap)
      I.reducer.reset({I.group, I.cross, grads, s.update, nullptr, nullptr});
    return;
  }
  s.update = S == 1 ? grads : std::span<float>();
  if (S > 1 && I.on_device) {
    s.update = I.shard_of(grads); // the shard's sum is downloaded into place
  } else if (S > 1) {
    I.shard_grad.resize(my_params.size());
    s.update = I.shard_grad;
  }
  if (I.full) {
    std::fill(s.update.begin(), s.update.end(), 0.0f);
    I.stream.reset(I.group, master, s.update, &I.comm_s);
  }
  if (!whole_weights || I.on_device)
    return;
  unit_reducer::step rs;
  rs.grads = grads;
  rs.sum = s.update;
  rs.group = I.group ? I.group : s.comm;
  rs.cross = I.group ? I.cross : nullptr;
  if (I.bf16) {
    I.wire16.resize(grads.size());
    rs.wire16 = I.wire16.data();
    if (I.group) {
      I.shard16.resize(s.update.size());
      rs.sum16 = I.shard16.data();
    }
  }
  I.reducer.reset(rs);
}

void trainer::loop::account(step_ctx& s, const model::step_stats& m) {
  auto& stats = s.stats;
  stats[0] += static_cast<float>(m.loss);
  stats[1] += static_cast<float>(m.aux_loss);
  stats[2] += static_cast<float>(m.dropped);
  if (stats.size() < 3 + m.expert_load.size())
    stats.resize(3 + m.expert_load.size(), 0.0f);
  for (size_t i = 0; i < m.expert_load.size(); ++i)
    stats[3 + i] += static_cast<float>(m.expert_load[i]);
}

/// This rank's micro-batches, their gradients (of the loss times
/// `loss_scale`) added up. With the experts split over the group, every
/// rank runs as many micro-batches as the one with the most (the experts'
/// exchanges are collective): empty ones make up the difference.
void trainer::loop::compute(step_ctx& s, float loss_scale) {
  size_t runs = s.mine.size();
  if (I.expert_parallel || I.full) {
    if (I.expert_parallel)
      I.experts.reset(I.group);
    runs = group_runs(s);
  }
  // Summed unit by unit: every rank reports every unit, so a rank without a
  // micro-batch runs an empty one.
  if (unit_overlap && !s.latched)
    runs = std::max<size_t>(runs, 1);
  model::batch empty;
  empty.seq_len = tc.seq_len;
  for (size_t k = 0; k < runs; ++k) {
    if (I.full)
      I.stream.begin_micro_batch(k + 1 < runs);
    if (unit_overlap && !s.latched && k + 1 == runs)
      I.reducer.arm();
    if (k < s.mine.size())
      account(s, net.forward_backward(model::make_micro_batch(*I.data, tc, s.step, s.mine[k]),
                                      loss_scale));
    else
      net.forward_backward(empty, loss_scale);
  }
  if (I.expert_parallel)
    if (auto e = I.experts.take_error(); e && !s.latched)
      s.latched = e;
  if (I.full)
    if (auto e = I.stream.take_error(); e && !s.latched)
      s.latched = e;
  if (I.sup)
    I.sup->computing(false);
}

/// The micro-batches the busiest rank of this rank's group runs this step.
size_t trainer::loop::group_runs(const step_ctx& s) const {
  size_t runs = s.mine.size();
  for (size_t q = 0; q < S; ++q)
    runs = std::max(runs, model::micro_batches_of(micro_total, s.world / S,
                                                  s.comm->index() / S, S, q).size());
  return runs;
}

/// Exact mode: each micro-batch's gradient is one contribution, turned into
/// fixed point before any sum, so no float sum depends on the layout. With
/// the experts split over the group, a micro-batch's expert gradients are
/// computed where the experts live (per source: the products the
/// micro-batch would run alone) and reach the sum as pieces from there;
/// every rank runs as many micro-batches as the busiest of its group, empty
/// ones making up the difference.
void trainer::loop::compute_exact(step_ctx& s) {
  const size_t runs = I.expert_parallel ? group_runs(s) : s.mine.size();
  if (I.expert_parallel)
    I.experts.reset(I.group);
  I.contributions.resize(s.mine.size());
  std::vector<std::span<const float>> spans;
  model::batch empty;
  empty.seq_len = tc.seq_len;
  for (size_t k = 0; k < runs; ++k) {
    net.zero_gradients();
    if (k >= s.mine.size()) {
      net.forward_backward(empty);
      continue;
    }
    account(s, net.forward_backward(model::make_micro_batch(*I.data, tc, s.step, s.mine[k])));
    I.contributions[k].assign(grads.begin(), grads.end());
    spans.emplace_back(I.contributions[k]);
  }
  if (s.mine.empty())
    net.zero_gradients();
  if (I.expert_parallel)
    if (auto e = I.experts.take_error(); e && !s.latched)
      s.latched = e;
  if (I.sup)
    I.sup->computing(false);
  const auto pieces = I.expert_parallel ? I.experts.pieces() : std::vector<coll::exact_piece>{};
  I.collective(s.latched, [&] {
    if (!I.group) {
      auto e = coll::exact_all_reduce(*s.comm, spans, grads, micro_total);
      if (!e && I.resident)
        I.resident->gather_state(grads, s.update);
      return e;
    }
    if (I.resident)
      return exact_resident(s, spans, pieces);
    return coll::exact_reduce_scatter(*s.comm, *I.group, *I.cross, spans, grads.size(),
                                      I.shards.counts, s.update, micro_total, {}, pieces);
  });
}

/// Exact mode with resident experts: the dense integers reduce-scattered
/// over the group (packed), this rank's experts' as they are.
caf::error trainer::loop::exact_resident(step_ctx& s,
                                         const std::vector<std::span<const float>>& spans,
                                         std::span<const coll::exact_piece> pieces) {
  const auto& L = *I.resident;
  std::vector<coll::exact_range> dense, own;
  for (const auto& r : L.dense())
    dense.emplace_back(r.begin, r.end);
  for (const auto& r : L.units())
    own.emplace_back(r.begin, r.end);
  return coll::exact_reduce_scatter_packed(*s.comm, *I.group, *I.cross, spans, grads.size(),
                                           dense, L.dense_split().counts, own, s.update,
                                           micro_total, {}, pieces);
}

/// On a device: the gradient summed in place there, then this rank's shard
/// of the sum comes down into `update` (its range of `grads`).
void trainer::loop::sum_on_device(step_ctx& s) {
  const size_t at = I.shards.offsets[I.position], n = I.shards.counts[I.position];
  if (!s.latched) {
    float* g = net.device_gradients();
    if (I.dev_group)
      I.collective(s.latched, [&] {
        return I.dev_group->reduce_scatter(g, g + at, I.shards.counts, coll::dtype::float32,
                                           coll::reduce_op::sum);
      });
    I.collective(s.latched, [&] {
      return I.dev_cross->all_reduce(g + at, n, coll::dtype::float32, coll::reduce_op::sum);
    });
  }
  net.download_gradients(at, n);
}

/// Whole weights: the gradient summed over the groups into `update` (in
/// fp32; S == 1: `update` is `grads`), unit by unit during the last backward
/// pass (overlap), else now as one piece.
void trainer::loop::sum_whole(step_ctx& s) {
  if (I.on_device)
    return sum_on_device(s);
  if (!unit_overlap && !s.latched)
    I.reducer.whole();
  finish_units(s);
}

/// Waits for the unit reducer's sums of the step: every unit summed, or
/// the step's error.
void trainer::loop::finish_units(step_ctx& s) {
  const double t0 = mono_s();
  auto e = I.reducer.finish();
  I.comm_s += mono_s() - t0;
  if (!e && !s.latched && I.reducer.covered() != grads.size())
    e = make_error(errc::invalid_argument,
                   fmt::format("the model reported finished gradients of {} of its {} "
                               "parameters",
                               I.reducer.covered(), grads.size()));
  if (e && !s.latched)
    s.latched = e;
}

/// Full sharding: the group's sum of this rank's shard is in `update`
/// already (fp32); summed over its holders in the other groups.
void trainer::loop::sum_shard(step_ctx& s) {
  I.collective(s.latched, [&] {
    return I.cross->all_reduce(s.update.data(), s.update.size(), coll::dtype::float32,
                               coll::reduce_op::sum);
  });
}

/// The summed gradient of this rank's shard in `update`, by the run's mode.
void trainer::loop::reduce_gradient(step_ctx& s) {
  if (tc.exact)
    return compute_exact(s);
  // bf16: gradients of the scaled loss, summed as bf16.
  const float scale = I.bf16 ? I.scalars[0] : 1.0f;
  compute(s, scale);
  if (resident_overlap)
    finish_units(s);
  else if (I.resident)
    sum_resident(s);
  else if (I.full)
    sum_shard(s);
  else
    sum_whole(s);
  if (I.bf16)
    kernels::cpu::scale_in_place(s.update.data(), 1.0f / scale, s.update.size());
}

/// The mean gradient over the global batch, clipped by its global norm. A
/// non-finite gradient on any shard skips the step everywhere (agreed in the
/// vote); the clipping norm is computed by everyone either way.
void trainer::loop::finish_gradient(step_ctx& s) {
  kernels::cpu::scale_in_place(s.update.data(), 1.0f / static_cast<float>(micro_total),
                               s.update.size());
  s.overflow = !s.latched && !kernels::cpu::all_finite(s.update.data(), s.update.size());
  if (tc.grad_clip <= 0 || s.latched)
    return;
  auto norm = I.global_norm(s.update);
  if (!norm)
    s.latched = norm.error();
  else if (!s.overflow)
    kernels::cpu::clip_to_norm(s.update.data(), s.update.size(), *norm, tc.grad_clip);
}

/// One step, from its boundary to its commit or its retry in the next
/// epoch. False once a stop was agreed.
expected<bool> trainer::loop::run_step() {
  step_ctx s;
  s.step = st.step;
  s.comm = I.comm;
  boundary(s);
  s.world = s.comm->size();
  s.t0 = mono_s();
  I.comm_s = 0;
  gather_weights(s);
  const uint32_t rank = s.comm->members().ranks[s.comm->index()];
  s.mine = model::micro_batches_of(micro_total, s.world / S, s.comm->index() / S, S, rank % S);
  if (s.latched)
    s.mine.clear(); // no weights to compute with: the vote will be no
  if (I.sup)
    I.sup->computing(true);
  maybe_hang();
  net.zero_gradients();
  bind_update(s);
  reduce_gradient(s);
  finish_gradient(s);
  // Every rank must have the same length of statistics for the reduction.
  s.stats.resize(3 + net.moe_layers() * net.experts(), 0.0f);
  I.collective(s.latched, [&] {
    return s.comm->all_reduce(s.stats.data(), s.stats.size(), coll::dtype::float32,
                              coll::reduce_op::sum);
  });
  auto vote_error = I.commit_vote(*s.comm, s.step, s.latched, s.overflow, master, net,
                                  result.verify_ms);
  if (!s.latched && !vote_error && I.vote[0] == 0)
    return commit(s);
  auto why = s.latched    ? s.latched
             : vote_error ? vote_error
                          : make_error(errc::aborted,
                                       "step " + std::to_string(s.step) + " was voted down");
  if (!I.sup)
    return why;
  if (!s.latched && vote_error) { // it may have passed elsewhere
    I.pending.emplace(s.step, std::vector<float>(s.update.begin(), s.update.end()));
    if (s.overflow)
      std::fill(I.pending->second.begin(), I.pending->second.end(), std::nanf(""));
  }
  spdlog::warn("trainer: step {} failed in epoch {}: {}; retrying it in the next epoch", s.step,
               s.comm->members().epoch, describe(why));
  if (auto e = enter(why))
    return e;
  return true;
}

/// Committed: the update of this rank's shard (or a skip, everywhere) is
/// applied, remembered, streamed, and reported. False when a stop was
/// agreed with it.
expected<bool> trainer::loop::commit(step_ctx& s) {
  const auto& vote = I.vote;
  const bool skipped = vote[2] != 0;
  if (skipped) {
    std::fill(s.update.begin(), s.update.end(), std::nanf(""));
    spdlog::info("trainer: step {} skipped: a gradient overflowed (loss scale {})", s.step,
                 I.scalars[0]);
  }
  I.apply(master, s.step, s.update);
  if (I.sup) {
    I.remember(s.step, s.update);
    I.sup->committed(s.step, s.update);
    switch_to = static_cast<uint64_t>(vote[1]);
  }
  ++st.step;
  ++committed_here;
  const bool stop = vote[4] != 0; // every member stops after this step, and checkpoints it
  if (I.o.listener) {
    if (vote[3] != 0 || stop)
      I.o.listener->checkpoint_agreed(s.step);
    I.o.listener->committed(s.step, s.update, st);
  }
  report(s, skipped);
  if (stop) {
    spdlog::info("trainer: stopped at step {}: a member was asked to stop", st.step);
    result.stopped = true;
  }
  return !stop;
}

void trainer::loop::report(step_ctx& s, bool skipped) {
  const double dt = mono_s() - s.t0;
  step_report rep;
  rep.step = st.step;
  rep.loss = s.stats[0] / static_cast<double>(micro_total);
  rep.aux_loss = s.stats[1] / static_cast<double>(micro_total);
  rep.dropped = static_cast<uint64_t>(s.stats[2]);
  rep.step_ms = dt * 1e3;
  rep.comm_ms = I.comm_s * 1e3;
  rep.tokens_per_s = tokens_per_step / dt;
  rep.skipped = skipped;
  rep.epoch = s.comm->members().epoch;
  rep.first_member = s.comm->index() == 0;
  rep.expert_imbalance =
    imbalance(std::vector<float>(s.stats.begin() + 3, s.stats.end()), net.experts());
  if (I.expert_parallel)
    rep.host_imbalance = I.experts.take_host_imbalance();
  result.final_loss = rep.loss;
  if (I.o.on_step)
    I.o.on_step(rep);
}

/// The hash of the final fp32 weights, from the group's masters: with full
/// sharding window by window, never the whole buffer at once.
expected<uint64_t> trainer::loop::weights_hash() {
  if (I.resident)
    return resident_hash();
  if (!I.full) {
    if (I.bf16)
      std::copy(master.begin(), master.end(), my_params.begin());
    if (I.group)
      if (auto e = I.group->all_gather(my_params.data(), params.data(), I.shards.counts,
                                       coll::dtype::float32))
        return e;
    return XXH64(params.data(), params.size() * sizeof(float), 0);
  }
  if (I.lane) {
    auto [fetched, ahead] = I.stream.prefetches();
    spdlog::info("trainer: {} of {} unit fetches were gathered ahead", ahead, fetched);
  }
  net.set_parameter_stream(nullptr);
  weight_stream fp32;
  fp32.bind(net, I.shards, I.position, false);
  fp32.reset(I.group, master, {}, &I.comm_s);
  std::unique_ptr<XXH64_state_t, decltype(&XXH64_freeState)> h(XXH64_createState(),
                                                               &XXH64_freeState);
  XXH64_reset(h.get(), 0);
  constexpr size_t window = size_t{1} << 20;
  std::vector<float> buf;
  for (size_t a = 0; a < params.size(); a += window) {
    const size_t b = std::min(params.size(), a + window);
    buf.resize(b - a);
    if (auto e = fp32.gather(a, b, buf.data()))
      return e;
    XXH64_update(h.get(), buf.data(), buf.size() * sizeof(float));
  }
  return XXH64_digest(h.get());
}

/// See train_result::expert_bytes.
size_t trainer::loop::expert_bytes() const {
  size_t in_state = 0, pages = 0, run_a = 0, run_b = 0;
  auto flush = [&] {
    if (run_b > run_a)
      pages += resident_bytes_in(params.data() + run_a, run_b - run_a)
               + resident_bytes_in(grads.data() + run_a, run_b - run_a);
  };
  for (const auto& t : net.tensors()) {
    if (t.expert < 0)
      continue;
    in_state += I.in_state(t.offset, t.offset + t.size).second;
    if (t.offset != run_b) {
      flush();
      run_a = t.offset;
    }
    run_b = t.offset + t.size;
  }
  flush();
  const size_t arrays = 2 + (I.master.empty() ? 0 : 1) + (I.shard_grad.empty() ? 0 : 1)
                        + I.recent.size();
  return pages + in_state * sizeof(float) * arrays;
}

/// Resident experts: window by window, each rank puts the elements it
/// holds (as bit patterns, zeros elsewhere) and the group sums them, so no
/// rank ever holds every expert.
expected<uint64_t> trainer::loop::resident_hash() {
  const auto& L = *I.resident;
  std::unique_ptr<XXH64_state_t, decltype(&XXH64_freeState)> h(XXH64_createState(),
                                                               &XXH64_freeState);
  XXH64_reset(h.get(), 0);
  constexpr size_t window = size_t{1} << 20;
  std::vector<int64_t> bits;
  std::vector<float> buf;
  for (size_t a = 0; a < params.size(); a += window) {
    const size_t b = std::min(params.size(), a + window);
    bits.assign(b - a, 0);
    size_t at = 0;
    for (const auto& r : L.state_ranges()) {
      for (size_t i = std::max(a, r.begin); i < std::min(b, r.end); ++i) {
        uint32_t u;
        std::memcpy(&u, &master[at + (i - r.begin)], sizeof u);
        bits[i - a] = u;
      }
      at += r.size();
    }
    if (I.group)
      if (auto e = I.group->all_reduce(std::span<int64_t>(bits), coll::reduce_op::sum))
        return e;
    buf.resize(b - a);
    for (size_t i = 0; i < buf.size(); ++i) {
      const auto u = static_cast<uint32_t>(bits[i]);
      std::memcpy(&buf[i], &u, sizeof u);
    }
    XXH64_update(h.get(), buf.data(), buf.size() * sizeof(float));
  }
  return XXH64_digest(h.get());
}

expected<train_result> trainer::loop::run() {
  t_start = mono_s();
  tokens_per_step = static_cast<double>(tc.global_batch * tc.seq_len);
  if (auto e = prepare())
    return e;
  if (I.sup)
    if (auto e = enter({}))
      return e;
  split_experts();
  while (st.step < tc.steps) {
    if (I.sup && switch_to > I.comm->members().epoch) {
      if (auto e = enter({}))
        return e;
      switch_to = 0;
      continue;
    }
    auto more = run_step();
    if (!more)
      return more.error();
    if (!*more)
      break;
  }
  if (I.o.listener)
    I.o.listener->at_boundary(st); // the last step's state (a listener may not have it)
  result.steps = st.step;
  result.state_hash = hash_state(master, I.adam_m, I.adam_v, I.scalars);
  result.seconds = mono_s() - t_start;
  result.tokens_per_s =
    tokens_per_step * static_cast<double>(committed_here) / std::max(result.seconds, 1e-9);
  auto h = weights_hash();
  if (!h)
    return h.error();
  result.weights_xxh64 = *h;
  result.expert_bytes = expert_bytes();
  return result;
}

expected<train_result> trainer::run() {
  loop l(*impl_, *model_);
  return l.run();
}

} // namespace cmesh::actors
