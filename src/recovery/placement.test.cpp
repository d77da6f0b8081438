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

// ---------------------------------------------------------------------------
// plan_placement, place_lpt, place_eplb.

namespace {

using layout_t = std::vector<std::vector<rank_id>>;

/// Every expert hosted at least once and never twice on one rank, every
/// rank within its slots, the replicas within the budget, and the loads
/// those of the layout.
void check_valid(const placement& p, const std::vector<uint64_t>& tokens,
                 const std::vector<uint32_t>& slots, uint32_t budget) {
  REQUIRE(p.expert_ranks.size() == tokens.size());
  REQUIRE(p.rank_experts.size() == slots.size());
  size_t replicas = 0;
  for (size_t e = 0; e < tokens.size(); ++e) {
    const auto& rs = p.expert_ranks[e];
    CHECK(!rs.empty());
    CHECK(std::adjacent_find(rs.begin(), rs.end()) == rs.end());
    CHECK(std::is_sorted(rs.begin(), rs.end()));
    for (auto r : rs) {
      REQUIRE(r < slots.size());
      const auto& held = p.rank_experts[r];
      CHECK(std::find(held.begin(), held.end(), e) != held.end());
    }
    replicas += rs.size();
  }
  CHECK(replicas <= tokens.size() + budget);
  for (size_t r = 0; r < slots.size(); ++r)
    CHECK(p.rank_experts[r].size() <= slots[r]);
  auto loads = rank_loads(tokens, p.expert_ranks, static_cast<uint32_t>(slots.size()));
  REQUIRE(loads);
  for (size_t r = 0; r < slots.size(); ++r)
    CHECK((*loads)[r] == doctest::Approx(p.rank_load[r]));
  CHECK(p.max_load == doctest::Approx(*std::max_element(loads->begin(), loads->end())));
}

std::vector<uint32_t> counts_of(const placement& p) {
  std::vector<uint32_t> out;
  for (const auto& rs : p.expert_ranks)
    out.push_back(static_cast<uint32_t>(rs.size()));
  return out;
}

/// A seeded random input: 1..24 experts with skewed counts, 1..8 ranks of
/// uneven slots (some 0) that hold every expert, a budget of 0..10, and a
/// current placement of 1..3 replicas per expert on any ranks (so some
/// ranks are over their slots).
struct random_case {
  std::vector<uint64_t> tokens;
  std::vector<uint32_t> slots;
  uint32_t budget = 0;
  layout_t current;
};

random_case make_case(uint64_t seed) {
  std::mt19937_64 rng(seed);
  random_case c;
  const size_t experts = 1 + rng() % 24;
  const uint32_t ranks = 1 + static_cast<uint32_t>(rng() % 8);
  const uint64_t spread = uint64_t{1} << (rng() % 20);
  for (size_t e = 0; e < experts; ++e) {
    const uint64_t t = rng() % (spread + 1);
    c.tokens.push_back(rng() % 4 == 0 ? t * t % 1000003 : t); // a few hot ones
  }
  const uint32_t per = static_cast<uint32_t>((experts + ranks - 1) / ranks);
  uint64_t total = 0;
  for (uint32_t r = 0; r < ranks; ++r) {
    c.slots.push_back(rng() % 5 == 0 ? 0 : static_cast<uint32_t>(rng() % (per + 4)));
    total += c.slots.back();
  }
  for (uint32_t r = 0; total < experts; r = (r + 1) % ranks, ++total)
    ++c.slots[r];
  c.budget = static_cast<uint32_t>(rng() % 11);
  for (size_t e = 0; e < experts; ++e) {
    std::vector<rank_id> all(ranks);
    std::iota(all.begin(), all.end(), 0);
    std::shuffle(all.begin(), all.end(), rng);
    all.resize(1 + rng() % std::min<uint32_t>(3, ranks));
    c.current.push_back(all);
  }
  return c;
}

plan_options options_of(const random_case& c) {
  plan_options o;
  o.replication_budget = c.budget;
  o.search_nodes = 2000;
  return o;
}

} // namespace

TEST_CASE("plan_placement: deterministic") {
  for (uint64_t seed = 1; seed <= 40; ++seed) {
    const auto c = make_case(seed);
    for (const auto* cur : {&c.current, static_cast<const layout_t*>(nullptr)}) {
      const layout_t none;
      auto a = plan_placement(c.tokens, c.slots, cur ? *cur : none, options_of(c));
      auto b = plan_placement(c.tokens, c.slots, cur ? *cur : none, options_of(c));
      INFO("seed ", seed);
      REQUIRE(a);
      REQUIRE(b);
      CHECK(a->placed.expert_ranks == b->placed.expert_ranks);
      CHECK(a->placed.rank_load == b->placed.rank_load);
      CHECK(a->moves == b->moves);
      CHECK(a->reason == b->reason);
      CHECK(a->detail == b->detail);
    }
  }
}

TEST_CASE(
    "plan_placement: every rank within its slots, every expert hosted, never twice on a rank") {
  for (uint64_t seed = 1; seed <= 300; ++seed) {
    const auto c = make_case(seed);
    INFO("seed ", seed);
    auto first = plan_placement(c.tokens, c.slots, {}, options_of(c));
    REQUIRE(first);
    CHECK(first->reason == plan_reason::first_placement);
    CHECK(first->moves.empty());
    check_valid(first->placed, c.tokens, c.slots, c.budget);
    auto next = plan_placement(c.tokens, c.slots, c.current, options_of(c));
    REQUIRE(next);
    check_valid(next->placed, c.tokens, c.slots, c.budget);
    auto moves = moves_between(c.current, next->placed.expert_ranks);
    REQUIRE(moves);
    CHECK(*moves == next->moves);
    // A rank without slots holds nothing.
    for (size_t r = 0; r < c.slots.size(); ++r)
      if (c.slots[r] == 0)
        CHECK(next->placed.rank_experts[r].empty());
  }
}

TEST_CASE("plan_placement: nothing changed, nothing moves") {
  for (uint64_t seed = 1; seed <= 100; ++seed) {
    const auto c = make_case(seed);
    INFO("seed ", seed);
    for (uint64_t bytes : {uint64_t{0}, uint64_t{1} << 20}) {
      auto o = options_of(c);
      o.cost.expert_bytes = bytes;
      auto first = plan_placement(c.tokens, c.slots, {}, o);
      REQUIRE(first);
      auto again = plan_placement(c.tokens, c.slots, first->placed.expert_ranks, o);
      REQUIRE(again);
      CHECK(again->reason == plan_reason::unchanged);
      CHECK(again->moves.empty());
      CHECK(again->placed.expert_ranks == first->placed.expert_ranks);
    }
    // From any current placement with free moves: planning the result
    // again changes nothing.
    auto o = options_of(c);
    auto once = plan_placement(c.tokens, c.slots, c.current, o);
    REQUIRE(once);
    auto twice = plan_placement(c.tokens, c.slots, once->placed.expert_ranks, o);
    REQUIRE(twice);
    CHECK(twice->reason == plan_reason::unchanged);
    CHECK(twice->moves.empty());
  }
}

TEST_CASE("plan_placement: a rank whose slots drop to 0 hands its experts over, the rest stay") {
  std::mt19937_64 rng(11);
  std::vector<uint64_t> tokens(32);
  for (auto& t : tokens)
    t = 100 + rng() % 5000;
  std::vector<uint32_t> slots(8, 6);
  plan_options o;
  o.replication_budget = 8;
  o.cost.expert_bytes = uint64_t{1} << 40; // every move is dear: only the forced ones happen
  auto before = plan_placement(tokens, slots, {}, o);
  REQUIRE(before);
  const auto& cur = before->placed;
  for (rank_id dead = 0; dead < slots.size(); ++dead) {
    auto s = slots;
    s[dead] = 0;
    auto after = plan_placement(tokens, s, cur.expert_ranks, o);
    INFO("dead rank ", dead, ": ", after ? after->detail : std::string());
    REQUIRE(after);
    CHECK(after->reason == plan_reason::forced);
    check_valid(after->placed, tokens, s, o.replication_budget);
    CHECK(after->placed.rank_experts[dead].empty());
    for (const auto& m : after->moves)
      CHECK(m.from == dead);
    for (size_t e = 0; e < tokens.size(); ++e) {
      const auto& was = cur.expert_ranks[e];
      const auto& now = after->placed.expert_ranks[e];
      if (std::find(was.begin(), was.end(), dead) == was.end()) {
        CHECK(now == was);
      } else {
        // It keeps its other replicas, and lives on.
        for (auto r : was)
          if (r != dead)
            CHECK(std::find(now.begin(), now.end(), r) != now.end());
        CHECK(std::find(now.begin(), now.end(), dead) == now.end());
      }
    }
  }
  // A smaller replication budget drops replicas (free) and moves nothing.
  o.replication_budget = 2;
  auto fewer = plan_placement(tokens, slots, cur.expert_ranks, o);
  REQUIRE(fewer);
  CHECK(fewer->reason == plan_reason::forced);
  check_valid(fewer->placed, tokens, slots, 2);
  for (const auto& m : fewer->moves)
    CHECK(m.kind == move_kind::drop);
}

TEST_CASE("plan_placement: a change is made when it pays, not when it does not") {
  // Rank 0 carries both hot experts: 200 against 2. Swapping one hot expert
  // with a cold one (2 moves, the ranks are full) gives 101 and 101.
  const std::vector<uint64_t> tokens = {100, 100, 1, 1};
  const std::vector<uint32_t> slots = {2, 2};
  const layout_t current = {{0}, {0}, {1}, {1}};
  plan_options o;
  o.cost.window_steps = 1;
  o.cost.seconds_per_token = 1e-3;
  o.cost.expert_bytes = 1'000'000'000;
  o.cost.bytes_per_second = 1e9; // 1 s per move
  o.cost.horizon_steps = 10;     // saves 99 tokens * 1 ms * 10 = 0.99 s < 2 s
  auto no = plan_placement(tokens, slots, current, o);
  REQUIRE(no);
  CHECK(no->reason == plan_reason::rebalance_does_not_pay);
  CHECK(no->moves.empty());
  CHECK(no->placed.expert_ranks == current);
  CHECK(no->max_load_before == 200);
  CHECK(no->saving_s == doctest::Approx(0.99));
  CHECK(no->cost_s == doctest::Approx(2.0));
  CHECK(no->detail.find("max load 200 -> 101") != std::string::npos);

  o.cost.horizon_steps = 1000; // 99 s > 2 s
  auto yes = plan_placement(tokens, slots, current, o);
  REQUIRE(yes);
  CHECK(yes->reason == plan_reason::rebalance_pays);
  CHECK(yes->placed.max_load == 101);
  CHECK(yes->moves.size() == 2);
  CHECK(yes->saving_s == doctest::Approx(99.0));
  CHECK(yes->detail.find("rebalance pays") != std::string::npos);

  // The window: the same counts summed over 100 steps are 100 times smaller per step.
  o.cost.window_steps = 100;
  auto windowed = plan_placement(tokens, slots, current, o);
  REQUIRE(windowed);
  CHECK(windowed->reason == plan_reason::rebalance_does_not_pay);
}

TEST_CASE("plan_placement: among placements of equal max load, the fewest moves") {
  // 8 experts of 10 tokens, 2 per rank; then expert 0 gets 30. The best max
  // load is 30 (expert 0 alone); one move of its neighbour reaches it.
  std::vector<uint64_t> tokens(8, 10);
  const std::vector<uint32_t> slots(4, 3);
  plan_options o;
  auto before = plan_placement(tokens, slots, {}, o);
  REQUIRE(before);
  CHECK(before->placed.max_load == 20);
  tokens[0] = 30;
  auto after = plan_placement(tokens, slots, before->placed.expert_ranks, o);
  REQUIRE(after);
  CHECK(after->reason == plan_reason::rebalance_pays);
  CHECK(after->placed.max_load == 30);
  REQUIRE(after->moves.size() == 1);
  CHECK(after->moves[0].kind == move_kind::move);
  CHECK(after->moves[0].expert != 0);
}

TEST_CASE("plan_placement: imbalance never above greedy LPT's with the same replica counts") {
  int compared = 0;
  for (uint64_t seed = 1; seed <= 500; ++seed) {
    const auto c = make_case(seed);
    const layout_t none;
    for (const auto* cur : {&none, &c.current}) {
      auto p = plan_placement(c.tokens, c.slots, *cur, options_of(c));
      REQUIRE_MESSAGE(p, "seed ", seed);
      auto lpt = place_lpt(c.tokens, counts_of(p->placed), c.slots);
      if (!lpt)
        continue; // greedy LPT strands a replica: no baseline
      ++compared;
      CHECK_MESSAGE(p->placed.max_load <= lpt->max_load * (1 + 1e-9) + 1e-9, "seed ", seed,
                    cur->empty() ? " (first placement)" : " (from a current placement)", ": ",
                    p->placed.max_load, " > ", lpt->max_load);
      CHECK_MESSAGE(p->placed.imbalance <= lpt->imbalance * (1 + 1e-9) + 1e-12, "seed ", seed);
    }
  }
  CHECK(compared > 900);
}

TEST_CASE("plan_placement: bad inputs are errors") {
  const std::vector<uint64_t> tokens = {5, 4, 3};
  plan_options o;
  auto code = [](const auto& r) { return r ? errc::ok : code_of(r.error()); };
  CHECK(code(plan_placement(tokens, std::vector<uint32_t>{}, {}, o)) == errc::invalid_argument);
  CHECK(code(plan_placement(std::vector<uint64_t>{}, std::vector<uint32_t>{2}, {}, o)) ==
        errc::invalid_argument);
  // Slots that cannot hold every expert: the message has the numbers.
  auto small = plan_placement(tokens, std::vector<uint32_t>{1, 0, 1}, {}, o);
  REQUIRE_FALSE(small);
  CHECK(code_of(small.error()) == errc::invalid_argument);
  CHECK(describe(small.error()).find("3 experts do not fit in 2 slots over 3 ranks") !=
        std::string::npos);
  const std::vector<uint32_t> slots = {2, 2};
  // The current placement: another expert count (an expert out of range),
  // a rank out of range, an expert with no rank, a rank twice.
  for (const layout_t& bad :
       {layout_t{{0}, {1}}, layout_t{{0}, {1}, {0}, {1}}, layout_t{{0}, {2}, {1}},
        layout_t{{0}, {}, {1}}, layout_t{{0}, {1, 1}, {0}}}) {
    auto r = plan_placement(tokens, slots, bad, o);
    REQUIRE_FALSE(r);
    CHECK(code_of(r.error()) == errc::invalid_argument);
  }
  auto far = plan_placement(tokens, slots, layout_t{{0}, {7}, {1}}, o);
  REQUIRE_FALSE(far);
  CHECK(describe(far.error()).find("expert 1 on rank 7 of 2") != std::string::npos);
  o.cost.window_steps = 0;
  CHECK(code(plan_placement(tokens, slots, {}, o)) == errc::invalid_argument);
  o.cost.window_steps = 1;
  o.cost.expert_bytes = 1;
  o.cost.bytes_per_second = 0;
  CHECK(code(plan_placement(tokens, slots, {}, o)) == errc::invalid_argument);
}

TEST_CASE("place_lpt and place_eplb: the baselines") {
  const std::vector<uint64_t> tokens = {1000, 60, 50, 40, 30, 20, 10, 5};
  // EPLB-style: 4 ranks x 3 slots, every slot used, the hot expert on every rank.
  auto eplb = place_eplb(tokens, 4, 3);
  REQUIRE(eplb);
  check_valid(*eplb, tokens, std::vector<uint32_t>(4, 3), 4);
  CHECK(eplb->expert_ranks[0].size() == 4);
  size_t replicas = 0;
  for (const auto& rs : eplb->expert_ranks)
    replicas += rs.size();
  CHECK(replicas == 12);
  CHECK(code_of(place_eplb(tokens, 2, 3).error()) == errc::invalid_argument);
  CHECK(code_of(place_eplb(tokens, 0, 3).error()) == errc::invalid_argument);

  // Greedy LPT with given counts, on uneven slots.
  const std::vector<uint32_t> slots = {4, 0, 3, 3};
  std::vector<uint32_t> counts(tokens.size(), 1);
  counts[0] = 3;
  auto lpt = place_lpt(tokens, counts, slots);
  REQUIRE(lpt);
  check_valid(*lpt, tokens, slots, 2);
  CHECK(lpt->expert_ranks[0] == std::vector<rank_id>{0, 2, 3});
  CHECK(lpt->mean_load == doctest::Approx(1215.0 / 3)); // over the ranks with slots
  counts[0] = 4;                                        // more replicas than ranks with slots
  CHECK(code_of(place_lpt(tokens, counts, slots).error()) == errc::invalid_argument);
  counts[0] = 0;
  CHECK(code_of(place_lpt(tokens, counts, slots).error()) == errc::invalid_argument);
  // Two experts of 3 replicas need 2 slots on each of 3 ranks: {4, 1, 1} cannot.
  CHECK(code_of(place_lpt(std::vector<uint64_t>{1, 1}, std::vector<uint32_t>{3, 3},
                          std::vector<uint32_t>{4, 1, 1})
                    .error()) == errc::invalid_argument);
}

TEST_CASE("plan_placement: replica counts that greedy LPT strands are still placed") {
  // Two replicas of expert 1 and one of expert 0 on slots {1, 3}: greedy LPT
  // puts expert 0 on rank 0, which fills it, and the second replica of
  // expert 1 has nowhere to go; the plan fills the slots as Gale and Ryser do.
  const std::vector<uint64_t> tokens = {10, 20};
  const std::vector<uint32_t> slots = {1, 3};
  CHECK(code_of(place_lpt(tokens, std::vector<uint32_t>{1, 2}, slots).error()) ==
        errc::invalid_argument);
  plan_options o;
  o.replication_budget = 2;
  auto p = plan_placement(tokens, slots, {}, o);
  REQUIRE(p);
  check_valid(p->placed, tokens, slots, 2);
  CHECK(p->placed.max_load == 20);
  auto again = plan_placement(tokens, slots, layout_t{{1}, {0, 1}}, o);
  REQUIRE(again);
  check_valid(again->placed, tokens, slots, 2);
  CHECK(again->reason == plan_reason::unchanged);
}
