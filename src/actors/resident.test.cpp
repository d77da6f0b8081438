#include "actors/resident.hpp"
#include "model/moe_lm.hpp"

#include <doctest/doctest.h>

#include <numeric>
#include <set>

using namespace cmesh;
using namespace cmesh::actors;

namespace {

model::moe_config config(size_t experts, size_t layers) {
  model::moe_config c;
  c.d_model = 64;
  c.ffn = 128;
  c.expert_ffn = 96;
  c.experts = experts;
  c.top_k = 2;
  c.layers = layers;
  return c;
}

} // namespace

TEST_CASE("resident layout: every element held once per group, experts on their hosts only") {
  const auto c = config(8, 3);
  const auto tensors = model::moe_lm_tensors(c);
  const size_t n = model::moe_lm_parameter_count(c);
  for (size_t S : {1, 2, 4, 8}) {
    CAPTURE(S);
    std::vector<int> held(n, 0);
    std::set<size_t> blocks;
    for (size_t p = 0; p < S; ++p) {
      auto l = resident_layout::make(tensors, c.experts, S, p);
      REQUIRE(l);
      CHECK(l->total() == n);

      size_t state = 0;
      for (const auto& r : l->state_ranges()) {
        state += r.size();
        for (size_t i = r.begin; i < r.end; ++i)
          ++held[i];
      }
      CHECK(state == l->state_size());
      // flat_of walks the state in order.
      size_t i = 0;
      for (const auto& r : l->state_ranges())
        for (size_t f = r.begin; f < r.end; ++f, ++i)
          REQUIRE(l->flat_of(i) == f);
      // packed_of and state_of place single elements as the copies do.
      for (size_t k = 0, at = 0; k < l->dense().size(); ++k) {
        CHECK(l->packed_of(l->dense()[k].begin) == at);
        CHECK(l->packed_of(l->dense()[k].end - 1) == at + l->dense()[k].size() - 1);
        at += l->dense()[k].size();
      }
      for (const auto& u : l->units()) {
        CHECK(l->flat_of(l->state_of(u.begin)) == u.begin);
        CHECK(l->flat_of(l->state_of(u.end - 1)) == u.end - 1);
      }
      // Its units are exactly the tensors of its experts.
      size_t unit_elements = 0;
      for (const auto& u : l->units())
        unit_elements += u.size();
      size_t mine = 0;
      for (const auto& t : tensors)
        if (t.expert >= 0 && l->host_of(static_cast<size_t>(t.expert)) == p)
          mine += t.size;
      CHECK(unit_elements == mine);
      CHECK(l->state_size() == l->dense_piece() + mine);
      // Its blocks: whole, distinct over the group, covering its state.
      CHECK(std::accumulate(l->block_lengths().begin(), l->block_lengths().end(), size_t{0})
            == l->state_size());
      for (size_t b : l->block_ids()) {
        CHECK(b < l->blocks());
        CHECK(blocks.insert(b).second);
      }
    }
    for (size_t i = 0; i < n; ++i)
      REQUIRE(held[i] == 1);
    auto one = resident_layout::make(tensors, c.experts, 1, 0);
    CHECK(blocks.size() == one->blocks()); // the same blocks at every S
  }
}

TEST_CASE("resident layout: state order round trips, packed dense skips the experts") {
  const auto c = config(4, 2);
  const auto tensors = model::moe_lm_tensors(c);
  const size_t n = model::moe_lm_parameter_count(c);
  std::vector<float> flat(n);
  std::iota(flat.begin(), flat.end(), 1.0f);
  auto l = resident_layout::make(tensors, c.experts, 2, 1);
  REQUIRE(l);
  std::vector<float> state(l->state_size()), back(n, 0.0f);
  l->gather_state(flat, state);
  l->scatter_state(state, back);
  for (const auto& r : l->state_ranges())
    for (size_t i = r.begin; i < r.end; ++i)
      REQUIRE(back[i] == flat[i]);
  std::vector<float> packed(l->dense_total()), dense(n, 0.0f);
  l->pack_dense(flat, packed);
  l->unpack_dense(packed, dense);
  for (const auto& t : tensors)
    for (size_t i = t.offset; i < t.offset + t.size; ++i)
      REQUIRE(dense[i] == (t.expert < 0 ? flat[i] : 0.0f));
}

TEST_CASE("resident layout: experts that do not divide over the ranks are an error") {
  const auto c = config(6, 1);
  auto l = resident_layout::make(model::moe_lm_tensors(c), c.experts, 4, 0);
  REQUIRE_FALSE(l);
  CHECK(code_of(l.error()) == errc::invalid_argument);
}
