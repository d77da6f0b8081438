#include "recovery/placement.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <limits>
#include <random>

using namespace cmesh;
using namespace cmesh::recovery;

namespace {

/// The smallest max rank load over every assignment of one replica per
/// expert, at most `capacity` per rank (0: any).
double brute_force(const std::vector<uint64_t>& tokens, uint32_t ranks, uint32_t capacity) {
  const size_t n = tokens.size();
  std::vector<uint32_t> at(n, 0);
  double best = std::numeric_limits<double>::infinity();
  while (true) {
    std::vector<double> load(ranks, 0);
    std::vector<uint32_t> count(ranks, 0);
    bool fits = true;
    for (size_t e = 0; e < n; ++e) {
      load[at[e]] += static_cast<double>(tokens[e]);
      if (capacity != 0 && ++count[at[e]] > capacity)
        fits = false;
    }
    if (fits)
      best = std::min(best, *std::max_element(load.begin(), load.end()));
    size_t i = 0;
    while (i < n && ++at[i] == ranks)
      at[i++] = 0;
    if (i == n)
      break;
  }
  return best;
}

void check_consistent(const placement& p, const std::vector<uint64_t>& tokens,
                      const placement_options& o) {
  REQUIRE(p.expert_ranks.size() == tokens.size());
  REQUIRE(p.rank_experts.size() == o.ranks);
  for (uint32_t r = 0; r < o.ranks; ++r)
    if (o.capacity != 0)
      CHECK(p.rank_experts[r].size() <= o.capacity);
  auto loads = rank_loads(tokens, p.expert_ranks, o.ranks);
  REQUIRE(loads);
  for (uint32_t r = 0; r < o.ranks; ++r)
    CHECK((*loads)[r] == doctest::Approx(p.rank_load[r]));
  CHECK(p.max_load == doctest::Approx(*std::max_element(loads->begin(), loads->end())));
  CHECK(p.imbalance == doctest::Approx(imbalance(*loads)));
}

} // namespace

TEST_CASE("placement: optimal on small cases, checked against exhaustive search") {
  std::mt19937_64 rng(7);
  struct shape {
    size_t experts;
    uint32_t ranks;
    uint32_t capacity;
  };
  const shape shapes[] = {{6, 3, 0}, {6, 3, 2}, {6, 3, 3}, {7, 3, 3}, {8, 4, 0}, {8, 4, 2}};
  int cases = 0;
  for (const auto& sh : shapes) {
    for (int c = 0; c < 60; ++c) {
      std::vector<uint64_t> tokens(sh.experts);
      const uint64_t spread = (c % 3 == 0) ? 10 : (c % 3 == 1 ? 100 : 100000);
      for (auto& t : tokens)
        t = rng() % spread;
      placement_options o;
      o.ranks = sh.ranks;
      o.capacity = sh.capacity;
      auto p = place_experts(tokens, o);
      REQUIRE(p);
      check_consistent(*p, tokens, o);
      const double opt = brute_force(tokens, sh.ranks, sh.capacity);
      INFO("case ", cases, " experts ", sh.experts, " ranks ", sh.ranks, " capacity ", sh.capacity);
      CHECK(p->max_load == doctest::Approx(opt));
      CHECK(p->optimal);

      // Greedy LPT alone stays within its 4/3 bound.
      o.search_nodes = 0;
      auto g = place_experts(tokens, o);
      REQUIRE(g);
      CHECK(g->max_load >= p->max_load - 1e-9);
      CHECK(g->max_load <= opt * 4.0 / 3.0 + 1e-9);
      ++cases;
    }
  }
  CHECK(cases == 360);
}

TEST_CASE("placement: the search fixes a case where greedy LPT is not optimal") {
  const std::vector<uint64_t> tokens = {3, 3, 2, 2, 2};
  placement_options o;
  o.ranks = 2;
  o.search_nodes = 0;
  auto lpt = place_experts(tokens, o);
  REQUIRE(lpt);
  CHECK(lpt->max_load == 7); // 3+2+2 | 3+2
  CHECK_FALSE(lpt->optimal);
  o.search_nodes = 1000;
  auto best = place_experts(tokens, o);
  REQUIRE(best);
  CHECK(best->max_load == 6); // 3+3 | 2+2+2
  CHECK(best->optimal);
  CHECK(best->imbalance == doctest::Approx(1.0));
}

TEST_CASE("placement: replicating the hot expert lowers the max load") {
  const std::vector<uint64_t> tokens = {1000, 60, 50, 40, 30, 20, 10, 5};
  placement_options o;
  o.ranks = 4;
  o.capacity = 4;
  auto plain = place_experts(tokens, o);
  REQUIRE(plain);
  CHECK(plain->max_load == 1000);
  CHECK(plain->imbalance == doctest::Approx(1000.0 / (1215.0 / 4)));

  o.replication_budget = 3;
  auto rep = place_experts(tokens, o);
  REQUIRE(rep);
  check_consistent(*rep, tokens, o);
  CHECK(rep->expert_ranks[0].size() == 4); // on every rank, 250 tokens each
  CHECK(rep->max_load < 400);
  CHECK(rep->max_load >= 1215.0 / 4);
  CHECK(rep->imbalance < plain->imbalance / 2.5);
  for (size_t e = 1; e < tokens.size(); ++e)
    CHECK(rep->expert_ranks[e].size() == 1);

  // A budget of one helps less; no budget is spent where it does not help.
  o.replication_budget = 1;
  auto one = place_experts(tokens, o);
  REQUIRE(one);
  CHECK(one->expert_ranks[0].size() == 2);
  CHECK(one->max_load == 500);
  const std::vector<uint64_t> flat = {10, 10, 10, 10};
  o.replication_budget = 4;
  auto f = place_experts(flat, o);
  REQUIRE(f);
  for (const auto& rs : f->expert_ranks)
    CHECK(rs.size() == 1);
  CHECK(f->max_load == 10);
}

TEST_CASE("placement: deterministic tie-breaks") {
  const std::vector<uint64_t> even = {5, 5, 5, 5};
  placement_options o;
  o.ranks = 4;
  auto p = place_experts(even, o);
  REQUIRE(p);
  for (uint32_t e = 0; e < 4; ++e)
    CHECK(p->expert_ranks[e] == std::vector<rank_id>{e});

  // No load at all: experts still spread by count, imbalance 1.
  const std::vector<uint64_t> zero(6, 0);
  auto z = place_experts(zero, o);
  REQUIRE(z);
  CHECK(z->imbalance == 1.0);
  for (const auto& es : z->rank_experts)
    CHECK(es.size() <= 2);

  std::mt19937_64 rng(3);
  std::vector<uint64_t> tokens(32);
  for (auto& t : tokens)
    t = rng() % 1000;
  o.ranks = 8;
  o.capacity = 6;
  o.replication_budget = 8;
  auto a = place_experts(tokens, o);
  auto b = place_experts(tokens, o);
  REQUIRE(a);
  REQUIRE(b);
  check_consistent(*a, tokens, o);
  CHECK(a->expert_ranks == b->expert_ranks);
  CHECK(a->rank_load == b->rank_load);
}

TEST_CASE("placement: bad inputs are errors") {
  placement_options o;
  o.ranks = 2;
  o.capacity = 1;
  const std::vector<uint64_t> three = {1, 2, 3};
  CHECK(code_of(place_experts(three, o).error()) == errc::invalid_argument);
  o.ranks = 0;
  CHECK(code_of(place_experts(three, o).error()) == errc::invalid_argument);
  o.ranks = 2;
  CHECK(code_of(place_experts(std::vector<uint64_t>{}, o).error()) == errc::invalid_argument);
  CHECK(imbalance(std::vector<double>{4, 2, 0, 2}) == doctest::Approx(2.0));
  CHECK(imbalance(std::vector<double>{}) == 1.0);
}

TEST_CASE("placement: moves between two placements") {
  const std::vector<std::vector<rank_id>> before = {{0}, {1}, {2, 3}, {0, 1}, {4}};
  const std::vector<std::vector<rank_id>> after = {{1}, {2, 1}, {2}, {3, 2}, {4}};
  auto m = moves_between(before, after);
  REQUIRE(m);
  const std::vector<expert_move> expect = {
    {0, 0, 1, move_kind::move},
    {1, 1, 2, move_kind::copy},
    {2, 3, no_rank, move_kind::drop},
    {3, 0, 2, move_kind::move},
    {3, 1, 3, move_kind::move},
  };
  CHECK(*m == expect);
  // Nothing changed: no moves.
  auto none = moves_between(before, before);
  REQUIRE(none);
  CHECK(none->empty());
  // New replicas with no rank keeping the expert copy from the old ones in turn.
  using layout = std::vector<std::vector<rank_id>>;
  auto spread = moves_between(layout{{0}}, layout{{1, 2, 3}});
  REQUIRE(spread);
  CHECK(*spread == std::vector<expert_move>{{0, 0, 1, move_kind::move},
                                            {0, 0, 2, move_kind::copy},
                                            {0, 0, 3, move_kind::copy}});

  CHECK(code_of(moves_between(layout{{0}}, layout{{0}, {1}}).error()) == errc::invalid_argument);
  CHECK(code_of(moves_between(layout{{0}}, layout{{}}).error()) == errc::invalid_argument);
  CHECK(code_of(moves_between(layout{{0, 0}}, layout{{1}}).error()) == errc::invalid_argument);

  // Between two solver outputs: replicas of the hot expert appear as copies.
  const std::vector<uint64_t> tokens = {1000, 60, 50, 40};
  placement_options o;
  o.ranks = 4;
  auto p0 = place_experts(tokens, o);
  o.replication_budget = 3;
  auto p1 = place_experts(tokens, o);
  REQUIRE(p0);
  REQUIRE(p1);
  auto d = moves_between(*p0, *p1);
  REQUIRE(d);
  size_t copies = 0;
  for (const auto& x : *d)
    copies += x.kind == move_kind::copy;
  CHECK(copies == p1->expert_ranks[0].size() - 1);
}
