#include "actors/step_collectives.hpp"

#include "collectives/host/host_communicator.hpp"

#include <doctest/doctest.h>

#include <functional>
#include <memory>
#include <thread>
#include <vector>

using namespace cmesh;
using namespace cmesh::actors;

namespace {

/// A model that is only a layout of tensors, each a unit of its own: the
/// streams read nothing else of it.
class layout_model final : public cmesh::model::model {
public:
  explicit layout_model(const std::vector<size_t>& sizes) {
    size_t at = 0;
    for (size_t i = 0; i < sizes.size(); ++i) {
      cmesh::model::tensor_info t;
      t.name = "t" + std::to_string(i);
      t.shape = {sizes[i]};
      t.offset = at;
      t.size = sizes[i];
      at += sizes[i];
      tensors_.push_back(t);
    }
    total_ = at;
  }
  size_t total() const { return total_; }
  const std::vector<cmesh::model::tensor_info>& tensors() const override { return tensors_; }
  std::span<float> parameters() override { return {}; }
  std::span<float> gradients() override { return {}; }
  void zero_gradients() override {}
  cmesh::model::step_stats forward_backward(const cmesh::model::batch&, float) override { return {}; }
  cmesh::model::step_stats evaluate(const cmesh::model::batch&) override { return {}; }
  size_t experts() const override { return 0; }
  size_t moe_layers() const override { return 0; }

private:
  std::vector<cmesh::model::tensor_info> tensors_;
  size_t total_ = 0;
};

/// A communicator per context (in one process) over the contexts' ranks,
/// epoch `epoch`.
struct comms {
  std::vector<std::shared_ptr<coll::host_context>> ctx;
  std::vector<std::unique_ptr<coll::communicator>> c;
};
comms make_comms(const std::vector<std::shared_ptr<coll::host_context>>& ctx, uint64_t epoch) {
  comms out;
  out.ctx = ctx;
  std::vector<std::string> addresses;
  coll::membership m{epoch, {}};
  for (size_t r = 0; r < ctx.size(); ++r) {
    addresses.push_back(ctx[r]->address());
    m.ranks.push_back(ctx[r]->rank());
  }
  auto alive = [](uint32_t) { return caf::error{}; };
  coll::host_options o;
  o.chunk_bytes = 16 * 1024;
  for (size_t r = 0; r < ctx.size(); ++r) {
    auto c = coll::make_host_communicator(ctx[r], m, addresses, alive, o);
    REQUIRE(c);
    out.c.push_back(std::move(*c));
  }
  return out;
}
std::vector<std::shared_ptr<coll::host_context>> contexts(size_t n) {
  std::vector<std::shared_ptr<coll::host_context>> out;
  for (size_t r = 0; r < n; ++r) {
    auto c = coll::host_context::create(static_cast<uint32_t>(r), std::nullopt, false);
    REQUIRE(c);
    out.push_back(*c);
  }
  return out;
}

/// Runs f(rank) on a thread per rank.
void on_each(size_t n, const std::function<void(size_t)>& f) {
  std::vector<std::thread> ts;
  for (size_t r = 0; r < n; ++r)
    ts.emplace_back([&, r] { f(r); });
  for (auto& t : ts)
    t.join();
}

} // namespace

TEST_CASE("weight stream: gathered ahead on the lane, the same weights and sums; an unforeseen "
          "order stops it and still matches") {
  // Units around and across the shard boundary (blocks of 4096).
  layout_model m({5000, 3, 9000, 7, 20000});
  const size_t N = m.total();
  const auto shards = split_shards(N, 2, 4096);
  auto master_of = [](size_t i) { return static_cast<float>(i % 1000) * 0.5f; };
  auto grad_of = [](size_t r, size_t i) { return static_cast<float>((r + 1) * (i % 13)); };
  // Micro-batches by the order of their fetches: learnt from the first,
  // foreseen in the next two, broken in the fourth.
  const std::vector<std::vector<size_t>> orders = {
    {0, 1, 2, 3, 4}, {0, 1, 2, 3, 4}, {0, 1, 2, 3, 4}, {0, 2, 1, 3, 4}, {0, 1, 2, 3, 4}};
  auto ctx = contexts(2);
  uint64_t tag = 11;
  for (bool bf16 : {false, true})
  for (bool lane_on : {true, false}) {
    CAPTURE(bf16);
    CAPTURE(lane_on);
    auto group = make_comms(ctx, tag++);
    // bf16 runs gather the master rounded to bf16; the gradients here are
    // small integers, exact in bf16, so the sums are exact either way.
    auto weight_of = [&](size_t i) {
      float w = master_of(i);
      if (bf16)
        kernels::cpu::round_to_bf16(&w, 1);
      return w;
    };
    std::vector<std::vector<float>> sums(2);
    std::vector<size_t> wrong(2, 0), ahead(2, 0), fetched(2, 0);
    std::vector<caf::error> errors(2);
    on_each(2, [&](size_t r) {
      std::vector<float> master(shards.counts[r]);
      for (size_t i = 0; i < master.size(); ++i)
        master[i] = master_of(shards.offsets[r] + i);
      sums[r].assign(shards.counts[r], 0.0f);
      collective_lane lane;
      weight_stream ws;
      double comm_s = 0;
      ws.bind(m, shards, r, bf16, lane_on ? &lane : nullptr);
      ws.reset(group.c[r].get(), master, sums[r], &comm_s);
      for (size_t k = 0; k < orders.size(); ++k) {
        ws.begin_micro_batch(k + 1 < orders.size());
        for (size_t u : orders[k]) {
          const auto& t = m.tensors()[u];
          const float* w = ws.fetch(u, u + 1);
          for (size_t j = 0; j < t.size; ++j)
            wrong[r] += w[j] != weight_of(t.offset + j);
          float* g = ws.gradient(u, u + 1);
          for (size_t j = 0; j < t.size; ++j)
            g[j] = grad_of(r, t.offset + j);
          ws.reduce(u, u + 1);
          ws.release(u, u + 1);
        }
      }
      errors[r] = ws.take_error();
      std::tie(fetched[r], ahead[r]) = ws.prefetches();
    });
    for (size_t r = 0; r < 2; ++r) {
      CAPTURE(r);
      CHECK_FALSE(errors[r]);
      CHECK(wrong[r] == 0);
      CHECK(fetched[r] == 25);
      // The second and third micro-batches' units but the second's first
      // (learnt at its start), the fourth's first; then no more.
      CHECK(ahead[r] == (lane_on ? 10u : 0u));
      size_t bad = 0;
      for (size_t i = 0; i < shards.counts[r]; ++i) {
        const size_t at = shards.offsets[r] + i;
        bad += sums[r][i] != 5.0f * (grad_of(0, at) + grad_of(1, at));
      }
      CHECK(bad == 0);
    }
  }
}

TEST_CASE("unit reducer: finished units summed over the groups, adjacent ones merged") {
  layout_model m({5000, 3, 9000, 7, 20000});
  const size_t N = m.total();
  auto grad_of = [](size_t r, size_t i) { return static_cast<float>((r + 1) * (i % 13)); };
  auto ctx = contexts(2);
  SUBCASE("one rank per group, fp32 and bf16: all_reduce in place") {
    for (bool bf16 : {false, true}) {
      CAPTURE(bf16);
      auto everyone = make_comms(ctx, bf16 ? 21 : 22);
      const auto shards = split_shards(N, 1, 4096);
      std::vector<std::vector<float>> grads(2);
      std::vector<caf::error> errors(2);
      std::vector<size_t> covered(2), jobs(2);
      on_each(2, [&](size_t r) {
        grads[r].resize(N);
        for (size_t i = 0; i < N; ++i)
          grads[r][i] = grad_of(r, i);
        std::vector<uint16_t> wire(N);
        collective_lane lane;
        unit_reducer red;
        red.bind(m, &lane, shards, 0);
        unit_reducer::step st;
        st.group = everyone.c[r].get();
        st.grads = grads[r];
        st.sum = grads[r];
        st.wire16 = bf16 ? wire.data() : nullptr;
        red.reset(st);
        red.unit_done(4, 5); // before arm(): not this step's last micro-batch
        red.arm();
        for (size_t u = 5; u-- > 0;) // the backward pass: last unit first
          red.unit_done(u, u + 1);
        errors[r] = red.finish();
        covered[r] = red.covered();
        jobs[r] = lane.jobs_run();
      });
      for (size_t r = 0; r < 2; ++r) {
        CHECK_FALSE(errors[r]);
        CHECK(covered[r] == N);
        CHECK(jobs[r] == 1); // adjacent units, under the bucket: one collective
        size_t bad = 0;
        for (size_t i = 0; i < N; ++i)
          bad += grads[r][i] != grad_of(0, i) + grad_of(1, i); // small integers: exact in bf16
        CHECK(bad == 0);
      }
    }
  }
  SUBCASE("a group of two ranks: reduce_scatter over the group, all_reduce over the holders") {
    auto group = make_comms(ctx, 31);
    // One group: the holders of each shard are its own rank alone.
    auto solo0 = make_comms({ctx[0]}, 32);
    auto solo1 = make_comms({ctx[1]}, 33);
    coll::communicator* cross[2] = {solo0.c[0].get(), solo1.c[0].get()};
    const auto shards = split_shards(N, 2, 4096);
    // Unit by unit on a lane, and without one the whole buffer at once.
    for (bool with_lane : {true, false}) {
      CAPTURE(with_lane);
      std::vector<std::vector<float>> sums(2);
      std::vector<caf::error> errors(2);
      std::vector<size_t> covered(2);
      on_each(2, [&](size_t r) {
        std::vector<float> grads(N);
        for (size_t i = 0; i < N; ++i)
          grads[i] = grad_of(r, i);
        sums[r].assign(shards.counts[r], -1.0f); // every element written
        collective_lane lane;
        unit_reducer red;
        red.bind(m, with_lane ? &lane : nullptr, shards, r);
        unit_reducer::step st;
        st.group = group.c[r].get();
        st.cross = cross[r];
        st.grads = grads;
        st.sum = sums[r];
        red.reset(st);
        if (with_lane) {
          red.arm();
          // Not adjacent in this order: a collective each.
          for (size_t u : {4, 2, 0, 3, 1})
            red.unit_done(u, u + 1);
        } else {
          red.whole();
        }
        errors[r] = red.finish();
        covered[r] = red.covered();
      });
      for (size_t r = 0; r < 2; ++r) {
        CHECK_FALSE(errors[r]);
        CHECK(covered[r] == N);
        size_t bad = 0;
        for (size_t i = 0; i < shards.counts[r]; ++i) {
          const size_t at = shards.offsets[r] + i;
          bad += sums[r][i] != grad_of(0, at) + grad_of(1, at);
        }
        CHECK(bad == 0);
      }
    }
  }
}
