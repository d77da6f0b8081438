#pragma once

// The collectives a trainer's step runs while its model computes: the
// expert exchange, the streamed weights of full sharding, and the unit by
// unit gradient sums of whole weights. In a header of their own so that
// tests drive them directly.

#include "actors/collective_lane.hpp"
#include "actors/resident.hpp"
#include "actors/trainer.hpp"
#include "collectives/communicator.hpp"
#include "collectives/exact.hpp"
#include "core/check.hpp"
#include "core/env.hpp"
#include "kernels/precision.hpp"
#include "model/model.hpp"
#include "recovery/placement.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <numeric>
#include <optional>
#include <span>
#include <utility>
#include <vector>

namespace cmesh::actors {

/// The flat range [a, b) of units first..last-1 of `m`.
inline std::pair<size_t, size_t> unit_range(const model::model& m, size_t first, size_t last) {
  const auto& ts = m.tensors();
  CMESH_CHECK(first < last && last <= ts.size());
  return {ts[first].offset, ts[last - 1].offset + ts[last - 1].size};
}

/// Expert parallelism over the replica group's communicator; the first
/// failure latches (later exchanges return at once, zeroed).
class group_exchange final : public model::expert_exchange {
public:
  /// `balanced`: each micro-batch's experts placed by the placement solver
  /// from the group's routed rows (at most `replicas` extra copies of hot
  /// experts); else the static blocks of expert_exchange::place.
  void configure(bool balanced, size_t replicas) {
    balanced_ = balanced;
    replicas_ = replicas;
  }
  void reset(coll::communicator* group) {
    group_ = group;
    error_ = {};
    used_ = 0;
  }
  /// Exact mode: experts computed per source (model::expert_exchange::
  /// per_source), other ranks' gradient pieces kept here until reset().
  void set_per_source(bool on) { per_source_ = on; }
  bool per_source() const override { return per_source_; }
  void piece(size_t source, size_t offset, const float* values, size_t count) override {
    (void)source; // the micro-batch it belongs to does not matter to the sum
    if (used_ == store_.size())
      store_.emplace_back();
    auto& p = store_[used_++];
    p.offset = offset;
    p.values.assign(values, values + count);
  }
  /// The pieces received since reset(), valid until the next piece() or reset().
  std::vector<coll::exact_piece> pieces() const {
    std::vector<coll::exact_piece> out;
    for (size_t i = 0; i < used_; ++i)
      out.push_back({store_[i].offset, store_[i].values});
    return out;
  }
  /// The exchanges run on `lane` (nullptr: on the caller's thread), in
  /// order with the weight stream's collectives on the same communicator.
  void set_lane(collective_lane* lane) { lane_ = lane; }
  caf::error take_error() { return std::exchange(error_, caf::error{}); }
  /// Max over mean of the rows each rank of the group computed since the
  /// last call (1 when none).
  double take_host_imbalance() {
    auto v = recovery::imbalance(load_);
    std::fill(load_.begin(), load_.end(), 0.0);
    return v;
  }

  void place(size_t layer, const int64_t* rows, size_t experts,
             std::vector<std::vector<uint32_t>>& hosts) override {
    const size_t S = ranks();
    std::vector<uint64_t> total(experts, 0);
    for (size_t s = 0; s < S; ++s)
      for (size_t e = 0; e < experts; ++e)
        total[e] += static_cast<uint64_t>(std::max<int64_t>(0, rows[s * experts + e]));
    bool placed = false;
    if (balanced_) {
      recovery::placement_options po;
      po.ranks = static_cast<uint32_t>(S);
      po.replication_budget = static_cast<uint32_t>(replicas_);
      po.search_nodes = 2000; // a node count, not a time: the same answer on every rank
      if (auto p = recovery::place_experts(total, po)) {
        hosts = std::move(p->expert_ranks);
        placed = true;
      }
    }
    if (!placed)
      expert_exchange::place(layer, rows, experts, hosts);
    load_.resize(S, 0.0);
    for (size_t e = 0; e < experts; ++e)
      for (auto r : hosts[e])
        load_[r] += static_cast<double>(total[e]) / static_cast<double>(hosts[e].size());
  }

  size_t ranks() const override { return group_->size(); }
  size_t rank() const override { return group_->index(); }
  bool exchange(const float* in, const std::vector<size_t>& send, float* out,
                const std::vector<size_t>& recv) override {
    if (!error_)
      error_ = call([&] { return group_->all_to_allv(in, send, out, recv, coll::dtype::float32); });
    if (error_)
      std::fill(out, out + std::accumulate(recv.begin(), recv.end(), size_t{0}), 0.0f);
    return !error_;
  }
  bool exchange_counts(const int64_t* in, int64_t* out, size_t per_rank) override {
    if (!error_)
      error_ = call([&] { return group_->all_to_all(in, out, per_rank, coll::dtype::int64); });
    if (error_)
      std::fill(out, out + per_rank * group_->size(), int64_t{0});
    return !error_;
  }

private:
  template <class F>
  caf::error call(F&& f) {
    return lane_ ? lane_->run(std::forward<F>(f)) : f();
  }

  coll::communicator* group_ = nullptr;
  collective_lane* lane_ = nullptr;
  caf::error error_;
  bool balanced_ = true;
  size_t replicas_ = 0;
  std::vector<double> load_;
  bool per_source_ = false;
  struct stored_piece {
    size_t offset = 0;
    std::vector<float> values;
  };
  std::vector<stored_piece> store_; // reused step after step; used_ of them hold pieces
  size_t used_ = 0;
};

/// Each rank's piece of the flat range [a, b) under `shards` into `counts`;
/// returns where the piece of rank `position` starts.
inline size_t unit_pieces(const shard_split& shards, size_t a, size_t b, size_t position,
                   std::vector<size_t>& counts) {
  counts.resize(shards.counts.size());
  size_t at = 0;
  for (size_t j = 0; j < counts.size(); ++j) {
    const size_t s = shards.offsets[j], e = s + shards.counts[j];
    const size_t lo = std::max(a, s), hi = std::min(b, e);
    counts[j] = hi > lo ? hi - lo : 0;
    if (j == position)
      at = lo;
  }
  return at;
}

/// Full sharding: the model's weights and gradients stream through the
/// replica group unit by unit. A unit is a contiguous range [a, b) of the
/// flat layout; rank j holds its intersection with shard j. fetch
/// all-gathers the pieces into a buffer of the unit's size (bf16: the
/// master rounded, gathered as bf16); reduce reduce-scatters the unit's
/// gradient (bf16 on the wire in bf16 runs) and adds this rank's piece to
/// the shard's sum. The buffers are reused unit after unit: they grow to the
/// largest unit and stay, so a step allocates nothing and touches no new
/// page. The first failure latches: later calls skip their collectives and
/// hand out zeros, and the step is voted down.
///
/// With a collective lane the collectives run on the lane's thread while
/// the model computes: the stream learns the order of the units from the
/// first micro-batch (every micro-batch fetches the same units in the same
/// order), and from then on gathers the next unit (after a micro-batch's
/// last, the next micro-batch's first) into a second buffer as soon as the
/// current one is fetched; a unit's reduce-scatter runs while
/// the next unit's backward computes, its gradient buffer alternating with
/// a second one. So a rank holds two units' weights and two gradients. A
/// fetch that is not the one foreseen (a model whose order changes) waits
/// for the gather in flight, gathers what it asked for, and stops
/// prefetching; every rank foresees the same, so the collectives still
/// match.
class weight_stream final : public model::parameter_stream {
public:
  void bind(model::model& m, const shard_split& shards, size_t position, bool bf16,
            collective_lane* lane = nullptr) {
    model_ = &m;
    shards_ = &shards;
    position_ = position;
    bf16_ = bf16;
    lane_ = lane;
    order_.clear();
    learnt_ = false;
    foreseen_ = true;
  }
  /// For one step: the group, this rank's fp32 master shard, the sum the
  /// gradient pieces are added to, and the clock of time spent waiting on
  /// collectives.
  void reset(coll::communicator* group, std::span<const float> master, std::span<float> sum,
             double* comm_s) {
    group_ = group;
    master_ = master;
    sum_ = sum;
    comm_s_ = comm_s;
    error_ = {};
    pos_ = 0;
  }
  /// Before each micro-batch's forward_backward; `more`: another one
  /// follows it in this step (its first unit is gathered ahead too).
  void begin_micro_batch(bool more) {
    if (!order_.empty())
      learnt_ = true;
    pos_ = 0;
    more_ = more;
  }
  /// Waits for every collective of the step; the first error.
  caf::error take_error() {
    if (lane_) {
      auto e = timed([&] { return lane_->drain(); });
      if (!error_)
        error_ = e;
      ahead_.reset();
      gticket_ = {0, 0};
    }
    return std::exchange(error_, caf::error{});
  }
  /// Units fetched, and how many of them had been gathered ahead.
  std::pair<uint64_t, uint64_t> prefetches() const { return {fetched_, used_}; }

  /// Elements [a, b) of the flat layout from the group's masters into
  /// `out` (b - a floats), on the caller's thread: at the end of a run, the
  /// weights' hash window by window.
  caf::error gather(size_t a, size_t b, float* out) {
    pieces(a, b);
    return timed([&] { return gather_into(group_, a, b, counts_, lo_, out); });
  }

  const float* fetch(size_t first, size_t last) override {
    const std::pair<size_t, size_t> unit{first, last};
    if (!learnt_) {
      order_.push_back(unit);
    } else if (foreseen_ && (pos_ >= order_.size() || order_[pos_] != unit)) {
      foreseen_ = false;
      if (lane_)
        spdlog::warn("trainer: the model fetched its units in another order than in its "
                     "first micro-batch; weights are no longer gathered ahead");
    }
    ++pos_;
    ++fetched_;
    auto [a, b] = range(first, last);
    bool have = false;
    if (ahead_) { // the gather in flight ends before its buffer is touched
      auto e = timed([&] { return lane_->wait(ahead_->ticket); });
      if (!error_)
        error_ = e;
      if (ahead_->unit == unit) {
        live_ ^= 1;
        have = true;
        ++used_;
      }
      ahead_.reset();
    }
    auto& w = weights_[live_];
    if (!have) {
      w.resize(b - a);
      if (!error_) {
        pieces(a, b);
        auto job = [&] { return gather_into(group_, a, b, counts_, lo_, w.data()); };
        error_ = timed([&] { return lane_ ? lane_->run(job) : job(); });
      }
    }
    if (error_) {
      std::fill(w.begin(), w.end(), 0.0f);
      return w.data();
    }
    // The next unit: the next in the order, or the first of the next
    // micro-batch.
    const size_t next_pos = pos_ < order_.size() ? pos_ : 0;
    if (lane_ && learnt_ && foreseen_ && (pos_ < order_.size() || more_)) {
      const auto next_unit = order_[next_pos];
      auto [na, nb] = range(next_unit.first, next_unit.second);
      auto& next = weights_[live_ ^ 1];
      next.resize(nb - na);
      pieces(na, nb);
      ahead_ = ahead{next_unit,
                     lane_->submit([this, g = group_, na, nb, counts = counts_, lo = lo_,
                                    out = next.data()] {
                       return gather_into(g, na, nb, counts, lo, out);
                     })};
    }
    return w.data();
  }
  void release(size_t, size_t) override {}
  float* gradient(size_t first, size_t last) override {
    auto [a, b] = range(first, last);
    if (gticket_[gcur_] != 0) { // its last reduce-scatter still reads it
      auto e = timed([&] { return lane_->wait(gticket_[gcur_]); });
      if (!error_)
        error_ = e;
      gticket_[gcur_] = 0;
    }
    grad_[gcur_].assign(b - a, 0.0f);
    return grad_[gcur_].data();
  }
  void reduce(size_t first, size_t last) override {
    if (error_)
      return;
    auto [a, b] = range(first, last);
    const size_t mine = pieces(a, b);
    float* sum = mine ? sum_.data() + (lo_ - shards_->offsets[position_]) : nullptr;
    auto job = [this, g = group_, in = grad_[gcur_].data(), n = b - a, counts = counts_, mine,
                sum] { return reduce_into(g, in, n, counts, mine, sum); };
    if (!lane_) {
      error_ = timed(job);
      return;
    }
    gticket_[gcur_] = lane_->submit(std::move(job));
    gcur_ ^= 1;
  }

private:
  struct ahead {
    std::pair<size_t, size_t> unit;
    collective_lane::ticket ticket;
  };

  /// The all-gather of [a, b) (`counts` per rank, this rank's piece at
  /// flat offset `lo`) into `out`. On the lane's thread when there is one:
  /// the bf16 scratch is its own.
  caf::error gather_into(coll::communicator* g, size_t a, size_t b,
                         const std::vector<size_t>& counts, size_t lo, float* out) {
    const size_t mine = counts[position_];
    const float* in = mine ? master_.data() + (lo - shards_->offsets[position_]) : master_.data();
    if (!bf16_)
      return g->all_gather(in, out, counts, coll::dtype::float32);
    piece16_.resize(mine);
    unit16_.resize(b - a);
    kernels::cpu::float_to_bf16(in, piece16_.data(), mine);
    auto e = g->all_gather(piece16_.data(), unit16_.data(), counts, coll::dtype::bfloat16);
    if (!e)
      kernels::cpu::bf16_to_float(unit16_.data(), out, b - a);
    return e;
  }
  /// The reduce-scatter of a unit's gradient `in` (n floats), this rank's
  /// piece (`mine` floats) added to `sum`. In fp32 the sum so far goes into
  /// this rank's piece of `in` first and the reduce-scatter writes straight
  /// into `sum`: no piece-sized scratch (the unit's gradient buffer is
  /// rewritten before its next use anyway).
  caf::error reduce_into(coll::communicator* g, float* in, size_t n,
                         const std::vector<size_t>& counts, size_t mine, float* sum) {
    if (!bf16_) {
      if (mine == 0)
        return g->reduce_scatter(in, nullptr, counts, coll::dtype::float32, coll::reduce_op::sum);
      float* own = in + std::accumulate(counts.begin(), counts.begin() + position_, size_t{0});
      for (size_t i = 0; i < mine; ++i)
        own[i] += sum[i];
      return g->reduce_scatter(in, sum, counts, coll::dtype::float32, coll::reduce_op::sum);
    }
    unit16_.resize(n);
    piece16_.resize(mine);
    kernels::cpu::float_to_bf16(in, unit16_.data(), n);
    auto e = g->reduce_scatter(unit16_.data(), piece16_.data(), counts, coll::dtype::bfloat16,
                               coll::reduce_op::sum);
    if (e)
      return e;
    std::array<float, 1024> wide;
    for (size_t i = 0; i < mine; i += wide.size()) {
      const size_t k = std::min(wide.size(), mine - i);
      kernels::cpu::bf16_to_float(piece16_.data() + i, wide.data(), k);
      for (size_t j = 0; j < k; ++j)
        sum[i + j] += wide[j];
    }
    return {};
  }
  std::pair<size_t, size_t> range(size_t first, size_t last) const {
    return unit_range(*model_, first, last);
  }
  /// Each rank's piece of [a, b) into counts_; this rank's starts at lo_.
  size_t pieces(size_t a, size_t b) {
    lo_ = unit_pieces(*shards_, a, b, position_, counts_);
    return counts_[position_];
  }
  template <class F>
  caf::error timed(F&& f) {
    const double t0 = mono_s();
    auto e = f();
    *comm_s_ += mono_s() - t0;
    return e;
  }

  model::model* model_ = nullptr;
  const shard_split* shards_ = nullptr;
  size_t position_ = 0;
  bool bf16_ = false;
  collective_lane* lane_ = nullptr;
  coll::communicator* group_ = nullptr;
  std::span<const float> master_;
  std::span<float> sum_;
  double* comm_s_ = nullptr;
  caf::error error_;
  std::vector<size_t> counts_;
  size_t lo_ = 0;
  // The unit order of a micro-batch (learnt from the first), the position
  // in it, and whether fetches still follow it.
  std::vector<std::pair<size_t, size_t>> order_;
  size_t pos_ = 0;
  bool learnt_ = false, foreseen_ = true, more_ = false;
  std::optional<ahead> ahead_; // the gather of the next unit, into weights_[live_ ^ 1]
  uint64_t fetched_ = 0, used_ = 0;
  std::array<std::vector<float>, 2> weights_, grad_;
  size_t live_ = 0, gcur_ = 0;
  std::array<collective_lane::ticket, 2> gticket_{0, 0}; // reduce-scatters reading grad_
  // Scratch of the collectives (the lane's thread's when there is one).
  std::vector<uint16_t> piece16_, unit16_;
};

/// Whole weights (not exact mode): the gradient summed over the groups.
/// With a collective lane, each unit's gradient is summed on the lane as
/// soon as the step's last micro-batch is done with it
/// (model::gradient_listener), while the backward pass goes on with the
/// units before it; without one, whole() sums the whole buffer as one
/// piece after the backward pass, on the caller's thread. One rank per group: an
/// all_reduce of the unit over everyone, in place. Groups of several ranks:
/// a reduce_scatter of the unit over the group (each rank's piece of it is
/// its part of its shard), then an all_reduce of the piece over the shard's
/// holders, into the shard's sum. Finished units adjacent in the flat
/// layout go as one collective, up to a bucket of 1 Mi elements. bf16 runs
/// convert the unit to bf16 and the sum back, as the whole-buffer path
/// does. Every rank reports the same units in the same order, so the
/// lane's collectives match; the units must tile the flat buffer (checked
/// by count).
class unit_reducer final : public model::gradient_listener {
public:
  struct step {
    coll::communicator* group = nullptr; // everyone when one rank per group
    coll::communicator* cross = nullptr; // the shard's holders (several ranks per group)
    std::span<float> grads;              // the model's gradient
    std::span<float> sum;                // this rank's shard of the sum (grads itself: S == 1)
    uint16_t* wire16 = nullptr;          // bf16: as long as grads
    uint16_t* sum16 = nullptr;           // bf16, S > 1: as long as sum
  };
  /// `lane`: nullptr sums on the caller's thread (whole() only).
  void bind(model::model& m, collective_lane* lane, const shard_split& shards, size_t position) {
    model_ = &m;
    lane_ = lane;
    shards_ = &shards;
    position_ = position;
  }
  /// Resident experts (groups of several ranks, fp32): `sum` is the
  /// rank's state. A dense unit is reduce-scattered over the group by the
  /// packed dense split; an expert unit is complete on its host, which
  /// copies it into its state and sums it over the groups; other ranks
  /// skip it.
  void bind_resident(const resident_layout* layout) { resident_ = layout; }
  /// For one step; nothing goes before arm() or whole().
  void reset(const step& st) {
    st_ = st;
    armed_ = false;
    covered_ = 0;
    lo_ = hi_ = 0;
    error_ = {};
  }
  /// The whole gradient as one piece, once the backward pass is over.
  void whole() { submit(0, st_.grads.size()); }
  /// Hands over what is left and waits for every sum of the step: the
  /// first error.
  caf::error finish() {
    flush();
    if (lane_)
      return lane_->drain();
    return std::exchange(error_, caf::error{});
  }
  /// The next micro-batch is the step's last: its finished units go.
  void arm() { armed_ = true; }
  /// Elements handed to the lane this step.
  size_t covered() const { return covered_; }

  void unit_done(size_t first, size_t last) override {
    if (!armed_)
      return;
    const auto [a, b] = unit_range(*model_, first, last);
    if (const int e = model_->tensors()[first].expert; resident_ && e >= 0) {
      covered_ += b - a;
      if (resident_->host_of(static_cast<size_t>(e)) == position_)
        submit_expert(a, b);
      return;
    }
    if (hi_ > lo_ && (b == lo_ || a == hi_)) { // adjacent: one collective for both
      lo_ = std::min(lo_, a);
      hi_ = std::max(hi_, b);
    } else {
      flush();
      lo_ = a;
      hi_ = b;
    }
    if (hi_ - lo_ >= bucket_elements)
      flush();
  }
private:
  /// Hands the bucket over.
  void flush() {
    if (hi_ > lo_)
      submit(lo_, hi_);
    lo_ = hi_ = 0;
  }
  // Finished units adjacent in the flat layout are summed together up to
  // this many elements (4 MiB of fp32): a small model's units are a few
  // thousand elements, and a collective each would cost more than it hides.
  static constexpr size_t bucket_elements = size_t{1} << 20;

  /// Resident: this rank's expert unit [a, b) into its state, summed over
  /// the groups.
  void submit_expert(size_t a, size_t b) {
    float* sum = st_.sum.data() + resident_->state_of(a);
    std::copy(st_.grads.begin() + a, st_.grads.begin() + b, sum);
    hand([c = st_.cross, sum, n = b - a] {
      return c->all_reduce(sum, n, coll::dtype::float32, coll::reduce_op::sum);
    });
  }

  void submit(size_t a, size_t b) {
    covered_ += b - a;
    float* g = st_.grads.data() + a;
    uint16_t* w = st_.wire16 ? st_.wire16 + a : nullptr;
    if (!st_.cross) {
      hand([c = st_.group, g, w, n = b - a] {
        if (!w)
          return c->all_reduce(g, n, coll::dtype::float32, coll::reduce_op::sum);
        kernels::cpu::float_to_bf16(g, w, n);
        auto e = c->all_reduce(w, n, coll::dtype::bfloat16, coll::reduce_op::sum);
        if (!e)
          kernels::cpu::bf16_to_float(w, g, n);
        return e;
      });
      return;
    }
    // Cut by the shards, or (resident) a dense range, contiguous in the
    // packed order too, by the packed dense split into the state's piece.
    const shard_split& split = resident_ ? resident_->dense_split() : *shards_;
    const size_t from = resident_ ? resident_->packed_of(a) : a;
    std::vector<size_t> counts;
    const size_t lo = unit_pieces(split, from, from + (b - a), position_, counts);
    const size_t mine = counts[position_], at = mine ? lo - split.offsets[position_] : 0;
    hand([st = st_, g, w, n = b - a, counts = std::move(counts), mine, at] {
      float* sum = st.sum.data() + at;
      if (!w) {
        auto e = st.group->reduce_scatter(g, sum, counts, coll::dtype::float32,
                                          coll::reduce_op::sum);
        if (!e)
          e = st.cross->all_reduce(sum, mine, coll::dtype::float32, coll::reduce_op::sum);
        return e;
      }
      uint16_t* sum16 = st.sum16 + at;
      kernels::cpu::float_to_bf16(g, w, n);
      auto e = st.group->reduce_scatter(w, sum16, counts, coll::dtype::bfloat16,
                                        coll::reduce_op::sum);
      if (!e)
        e = st.cross->all_reduce(sum16, mine, coll::dtype::bfloat16, coll::reduce_op::sum);
      if (!e)
        kernels::cpu::bf16_to_float(sum16, sum, mine);
      return e;
    });
  }
  /// To the lane, or run here (the first error latches).
  void hand(collective_lane::job j) {
    if (lane_)
      lane_->submit(std::move(j));
    else if (!error_)
      error_ = j();
  }

  model::model* model_ = nullptr;
  collective_lane* lane_ = nullptr;
  const shard_split* shards_ = nullptr;
  const resident_layout* resident_ = nullptr;
  size_t position_ = 0;
  step st_;
  bool armed_ = false;
  size_t covered_ = 0;
  size_t lo_ = 0, hi_ = 0; // the bucket: finished units not yet handed over
  caf::error error_;       // without a lane
};

} // namespace cmesh::actors
