#include "model/moe_lm.hpp"
#include "model/thread_hub.hpp"

#include "kernels/gemm.hpp"
#include "kernels/optim.hpp"
#include "kernels/precision.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

using namespace cmesh::model;

namespace {

moe_config tiny_config(size_t layers) {
  moe_config c;
  c.d_model = 8;
  c.context = 3;
  c.layers = layers;
  c.ffn = 8;
  c.experts = 4;
  c.top_k = 2;
  c.expert_ffn = 6;
  c.capacity_factor = 2.0; // experts / top_k: no expert can overflow
  c.aux_loss_weight = 0.1; // larger than the default, so its gradient shows
  c.init_seed = 7;
  return c;
}

// `sequences` windows of seq_len + 1 bytes of `text`, at deterministic offsets.
batch make_batch(const std::string& text, size_t sequences, size_t seq_len, std::mt19937& rng) {
  batch b;
  b.sequences = sequences;
  b.seq_len = seq_len;
  std::uniform_int_distribution<size_t> start(0, text.size() - seq_len - 2);
  for (size_t s = 0; s < sequences; ++s) {
    const size_t at = start(rng);
    b.tokens.insert(b.tokens.end(), text.begin() + static_cast<long>(at),
                    text.begin() + static_cast<long>(at + seq_len + 1));
  }
  return b;
}

std::string repeated_text(size_t bytes) {
  const std::string sentence = "the quick brown fox jumps over the lazy dog; ";
  std::string t;
  while (t.size() < bytes)
    t += sentence;
  return t;
}

batch tiny_batch() {
  std::mt19937 rng(3);
  return make_batch("a small text, for the gradient check of the whole model.", 2, 6, rng);
}

std::vector<double> initial_params_f64(const moe_config& c) {
  std::vector<float> p(moe_lm_parameter_count(c));
  moe_lm_init(c, p);
  std::vector<double> d(p.begin(), p.end());
  // Biases start at zero; nudge them so that their paths are exercised too.
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> u(-0.1, 0.1);
  for (const auto& t : moe_lm_tensors(c))
    if (t.shape.size() == 1)
      for (size_t i = 0; i < t.size; ++i)
        d[t.offset + i] = u(rng);
  return d;
}

double total_loss(const step_stats& s) { return s.loss + s.aux_loss; }

} // namespace

TEST_CASE("moe_lm: tensor layout, names and parameter count") {
  const moe_config c; // defaults
  const auto ts = moe_lm_tensors(c);
  REQUIRE(ts.size() == 3 + c.layers * (5 + 4 * c.experts) + 2);
  size_t at = 0;
  for (const auto& t : ts) {
    CAPTURE(t.name);
    CHECK(t.offset == at); // contiguous, in order
    at += t.size;
  }
  CHECK(at == moe_lm_parameter_count(c));
  CHECK(at == 166080); // see the architecture in moe_lm.hpp
  CHECK(ts.front().name == "embed");
  CHECK(ts[1].name == "mix.w");
  CHECK(ts[3].name == "layer0.ffn.w1");
  CHECK(ts[7].name == "layer0.moe.router");
  CHECK(ts[7].layer == 0);
  CHECK(ts[7].expert == -1);
  CHECK(ts[8].name == "layer0.moe.expert0.w1");
  CHECK(ts[8].expert == 0);
  CHECK(ts[8].shape == std::vector<size_t>{c.d_model, c.expert_ffn});
  const auto& e = ts[7 + 1 + 4 * 2 + 2]; // expert2.w2
  CHECK(e.name == "layer0.moe.expert2.w2");
  CHECK(e.layer == 0);
  CHECK(e.expert == 2);
  CHECK(ts.back().name == "out.b");
  CHECK(ts.back().layer == -1);

  auto m = make_moe_lm(c);
  CHECK(m->parameters().size() == at);
  CHECK(m->gradients().size() == at);
  CHECK(m->experts() == 4);
  CHECK(m->moe_layers() == 2);
}

TEST_CASE("moe_lm: initialisation is a pure function of the config") {
  moe_config c = tiny_config(2);
  std::vector<float> a(moe_lm_parameter_count(c)), b(a.size());
  moe_lm_init(c, a);
  moe_lm_init(c, b);
  CHECK(a == b);
  c.init_seed = 8;
  moe_lm_init(c, b);
  CHECK(a != b);
  // A tensor's values depend on its name, not on the tensors before it.
  moe_config one = tiny_config(1);
  one.init_seed = 7;
  std::vector<float> p1(moe_lm_parameter_count(one));
  moe_lm_init(one, p1);
  const auto t2 = moe_lm_tensors(tiny_config(2));
  const auto t1 = moe_lm_tensors(one);
  CHECK(t1[3].name == t2[3].name);
  CHECK(std::equal(p1.begin() + static_cast<long>(t1[3].offset),
                   p1.begin() + static_cast<long>(t1[3].offset + t1[3].size),
                   a.begin() + static_cast<long>(t2[3].offset)));
}

TEST_CASE("moe_lm: whole-model gradient matches central differences (double)") {
  for (const size_t layers : {size_t{1}, size_t{2}}) {
    CAPTURE(layers);
    const moe_config c = tiny_config(layers);
    const batch b = tiny_batch();
    auto p = initial_params_f64(c);
    std::vector<double> g(p.size(), 0.0);
    std::vector<int32_t> base_routing;
    const step_stats s = moe_lm_forward_backward_f64(c, p, g, b, &base_routing);
    CHECK(s.dropped == 0);
    CHECK(s.tokens == 12);
    CHECK(s.aux_loss > 0);

    // About 200 parameters, a few from every tensor.
    const auto ts = moe_lm_tensors(c);
    const size_t per_tensor = std::max<size_t>(2, (200 + ts.size() - 1) / ts.size());
    std::mt19937 rng(static_cast<unsigned>(layers));
    const double h = 1e-5;
    double worst = 0;
    size_t checked = 0, skipped = 0;
    std::vector<int32_t> routing;
    for (const auto& t : ts) {
      CAPTURE(t.name);
      std::uniform_int_distribution<size_t> pick(0, t.size - 1);
      for (size_t r = 0; r < std::min(per_tensor, t.size); ++r) {
        const size_t i = t.offset + (t.size <= per_tensor ? r : pick(rng));
        const double keep = p[i];
        p[i] = keep + h;
        const double up = total_loss(moe_lm_forward_backward_f64(c, p, {}, b, &routing));
        const bool same_up = routing == base_routing;
        p[i] = keep - h;
        const double down = total_loss(moe_lm_forward_backward_f64(c, p, {}, b, &routing));
        const bool same_down = routing == base_routing;
        p[i] = keep;
        if (!same_up || !same_down) { // crossed a routing discontinuity
          ++skipped;
          continue;
        }
        const double fd = (up - down) / (2 * h);
        const double err = std::fabs(fd - g[i]) / std::max({std::fabs(fd), std::fabs(g[i]), 1e-6});
        if (err > 1e-5)
          MESSAGE(t.name << "[" << i - t.offset << "]: analytic " << g[i] << " numeric " << fd);
        worst = std::max(worst, err);
        ++checked;
      }
    }
    MESSAGE("gradient check, " << layers << " layer(s): " << checked << " parameters, "
                               << skipped << " skipped, max relative error " << worst);
    CHECK(checked >= 190);
    CHECK(skipped * 10 <= checked);
    CHECK(worst < 1e-5);
  }
}

TEST_CASE("moe_lm: the float model computes what the checked double network does") {
  const moe_config c = tiny_config(2);
  const batch b = tiny_batch();
  auto m = make_moe_lm(c);
  const auto p = m->parameters();
  std::vector<double> pd(p.begin(), p.end()), gd(pd.size(), 0.0);
  const step_stats sd = moe_lm_forward_backward_f64(c, pd, gd, b);
  m->zero_gradients();
  const step_stats sf = m->forward_backward(b, 1.0f);
  CHECK(sf.loss == doctest::Approx(sd.loss).epsilon(1e-5));
  CHECK(sf.aux_loss == doctest::Approx(sd.aux_loss).epsilon(1e-5));
  CHECK(sf.expert_load == sd.expert_load);
  double scale = 0, diff = 0;
  const auto g = m->gradients();
  for (size_t i = 0; i < g.size(); ++i) {
    scale = std::max(scale, std::fabs(gd[i]));
    diff = std::max(diff, std::fabs(gd[i] - g[i]));
  }
  CHECK(diff <= 1e-4 * scale);
  // evaluate() agrees with forward_backward() and leaves gradients alone.
  const std::vector<float> before(g.begin(), g.end());
  const step_stats se = m->evaluate(b);
  CHECK(se.loss == sf.loss);
  CHECK(std::equal(before.begin(), before.end(), g.begin()));
}

TEST_CASE("moe_lm: gradients are bit-identical run to run, and loss_scale scales them") {
  moe_config c; // the default size
  std::mt19937 rng(5);
  const batch b = make_batch(repeated_text(4096), 4, 64, rng);
  auto m1 = make_moe_lm(c);
  auto m2 = make_moe_lm(c);
  const step_stats s1 = m1->forward_backward(b, 1.0f);
  const step_stats s2 = m2->forward_backward(b, 1.0f);
  CHECK(s1.loss == s2.loss);
  CHECK(s1.expert_load == s2.expert_load);
  const auto g1 = m1->gradients(), g2 = m2->gradients();
  CHECK(std::memcmp(g1.data(), g2.data(), g1.size_bytes()) == 0);

  // Same model again after zeroing; and a power-of-two loss scale is exact.
  const std::vector<float> first(g1.begin(), g1.end());
  m1->zero_gradients();
  m1->forward_backward(b, 1.0f);
  CHECK(std::memcmp(first.data(), g1.data(), g1.size_bytes()) == 0);
  m1->zero_gradients();
  m1->forward_backward(b, 1024.0f);
  size_t inexact = 0;
  for (size_t i = 0; i < first.size(); ++i)
    inexact += g1[i] != 1024.0f * first[i];
  CHECK(inexact == 0);

  // Accounting: every token is routed top_k times, kept or dropped.
  size_t routed = 0;
  for (size_t n : s1.expert_load)
    routed += n;
  CHECK(s1.expert_load.size() == c.layers * c.experts);
  CHECK(routed + s1.dropped == c.layers * c.top_k * s1.tokens);
  CHECK(s1.tokens == 4 * 64);
}

TEST_CASE("moe_lm: bf16 activations: near fp32, the same bits run to run, half the bytes") {
  cmesh::kernels::cpu::set_blas_threads(1);
  moe_config c; // the default widths, more layers: the cost of one layer unpacked is shared
  c.layers = 6;
  moe_config h = c;
  h.activations = "bf16";
  std::mt19937 rng(5);
  const auto text = repeated_text(4096);
  const batch big = make_batch(text, 8, 64, rng), small = make_batch(text, 3, 64, rng);
  auto wide = make_moe_lm(c), narrow = make_moe_lm(h), again = make_moe_lm(h);
  const step_stats s = wide->forward_backward(big), t = narrow->forward_backward(big);
  CHECK(t.tokens == s.tokens);
  // bf16 keeps 8 significant bits: the loss within a few 2^-8 of fp32's.
  CHECK(t.loss == doctest::Approx(s.loss).epsilon(2e-2));
  CHECK(t.loss != s.loss); // the activations were rounded
  auto g = wide->gradients(), k = narrow->gradients();
  double dot = 0, gg = 0, kk = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    dot += static_cast<double>(g[i]) * k[i];
    gg += static_cast<double>(g[i]) * g[i];
    kk += static_cast<double>(k[i]) * k[i];
  }
  const double cosine = dot / std::sqrt(gg * kk);
  MESSAGE("bf16 against fp32 activations: gradient cosine " << cosine << ", loss " << t.loss
                                                            << " vs " << s.loss);
  CHECK(cosine > 0.999);
  CHECK(std::sqrt(kk / gg) == doctest::Approx(1.0).epsilon(2e-2));
  // What the forward pass keeps: the layers' tensors at half the bytes,
  // plus one layer's float buffers (the pool) and the fp32 logits: at 6
  // layers about 0.75 of fp32, tending to half with depth.
  const size_t fp32_bytes = wide->saved_activation_bytes(),
               bf16_bytes = narrow->saved_activation_bytes();
  MESSAGE("saved activations: fp32 " << fp32_bytes << " bytes, bf16 " << bf16_bytes);
  CHECK(fp32_bytes > 0);
  CHECK(bf16_bytes < 0.8 * static_cast<double>(fp32_bytes));
  // Deterministic, and a smaller batch after a bigger one (the pool's
  // buffers hold more than the step needs) gives the bits of a fresh model.
  narrow->zero_gradients();
  const step_stats u = narrow->forward_backward(small), v = again->forward_backward(small);
  CHECK(u.loss == v.loss);
  auto k2 = narrow->gradients(), k3 = again->gradients();
  CHECK(std::memcmp(k2.data(), k3.data(), k2.size_bytes()) == 0);
  CHECK(narrow->evaluate(big).loss == t.loss);
  again->zero_gradients();
  again->forward_backward(big);
  narrow->zero_gradients();
  narrow->forward_backward(big);
  CHECK(std::memcmp(k2.data(), k3.data(), k2.size_bytes()) == 0);
  CHECK(std::memcmp(k.data(), k2.data(), k2.size_bytes()) == 0);
}

TEST_CASE("moe_lm: over capacity, assignments are dropped and counted") {
  moe_config c = tiny_config(1);
  c.capacity_factor = 0.5; // capacity 3 of 12 * 2 assignments over 4 experts
  const step_stats s = make_moe_lm(c)->evaluate(tiny_batch());
  size_t kept = 0;
  for (size_t n : s.expert_load) {
    CHECK(n <= 3);
    kept += n;
  }
  CHECK(s.dropped > 0);
  CHECK(kept + s.dropped == 24);
}

TEST_CASE("moe_lm: 150 AdamW steps learn a repetitive text (loss < 1.0 from ~5.5)") {
  cmesh::kernels::cpu::set_blas_threads(1);
  moe_config c; // the default model
  SUBCASE("fp32 activations") {}
  SUBCASE("bf16 activations") { c.activations = "bf16"; }
  auto m = make_moe_lm(c);
  const std::string text = repeated_text(1 << 14);
  std::mt19937 rng(9);
  const size_t n = m->parameters().size();
  std::vector<float> mom(n, 0.0f), var(n, 0.0f);
  cmesh::kernels::cpu::adamw_params hp;
  hp.lr = 3e-3f;
  hp.beta2 = 0.95f;
  hp.weight_decay = 0.01f;
  double first = 0, last = 0;
  double seconds = 0;
  const int steps = 150;
  for (int step = 1; step <= steps; ++step) {
    const batch b = make_batch(text, 4, 64, rng);
    m->zero_gradients();
    const auto t0 = std::chrono::steady_clock::now();
    const step_stats s = m->forward_backward(b, 1.0f);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    auto g = m->gradients();
    const double norm = cmesh::kernels::cpu::l2_norm(g.data(), n);
    cmesh::kernels::cpu::clip_to_norm(g.data(), n, norm, 1.0);
    cmesh::kernels::cpu::adamw_step(m->parameters().data(), g.data(), mom.data(), var.data(), n,
                                    hp, static_cast<uint64_t>(step));
    if (step == 1)
      first = s.loss;
    last = s.loss;
    REQUIRE(std::isfinite(s.loss));
  }
  MESSAGE("training (" << c.activations << " activations): loss " << first << " -> " << last << " in " << steps << " steps; "
                            << 1e3 * seconds / steps << " ms per forward_backward (4x64 tokens)");
  CHECK(first > 5.0);
  CHECK(last < 1.0);
}

namespace {

using hosts_t = std::vector<std::vector<uint32_t>>;
/// A fixed placement for every layer and micro-batch (empty: the default).
using placement_fn = std::function<hosts_t(size_t experts)>;

class thread_exchange final : public expert_exchange {
public:
  thread_exchange(thread_hub& hub, size_t ranks, size_t me, placement_fn place = {})
      : hub_(hub), ranks_(ranks), me_(me), place_(std::move(place)) {}
  void place(size_t layer, const int64_t* rows, size_t experts, hosts_t& hosts) override {
    if (place_)
      hosts = place_(experts);
    else
      expert_exchange::place(layer, rows, experts, hosts);
  }
  size_t ranks() const override { return ranks_; }
  size_t rank() const override { return me_; }
  bool per_source() const override { return per_source_; }
  void piece(size_t source, size_t offset, const float* values, size_t count) override {
    pieces.push_back({round, source, offset, std::vector<float>(values, values + count)});
  }
  // Per source: the pieces of other ranks' gradients, by the round they
  // came in (set by the caller before each micro-batch).
  struct held_piece {
    size_t round, source, offset;
    std::vector<float> values;
  };
  bool per_source_ = false;
  size_t round = 0;
  std::vector<held_piece> pieces;
  bool exchange(const float* in, const std::vector<size_t>& send, float* out,
                const std::vector<size_t>& recv) override {
    hub_.all_to_all(me_, reinterpret_cast<const char*>(in), bytes(send, sizeof(float)),
                    reinterpret_cast<char*>(out), bytes(recv, sizeof(float)));
    return true;
  }
  bool exchange_counts(const int64_t* in, int64_t* out, size_t per_rank) override {
    std::vector<size_t> c(ranks_, per_rank);
    hub_.all_to_all(me_, reinterpret_cast<const char*>(in), bytes(c, sizeof(int64_t)),
                    reinterpret_cast<char*>(out), bytes(c, sizeof(int64_t)));
    return true;
  }

private:
  static std::vector<size_t> bytes(const std::vector<size_t>& counts, size_t size) {
    std::vector<size_t> b;
    for (auto c : counts)
      b.push_back(c * size);
    return b;
  }
  thread_hub& hub_;
  size_t ranks_, me_;
  placement_fn place_;
};

/// Expert e on ranks e % 3 and (e + 1) % 3.
hosts_t every_expert_on_two_of_three(size_t experts) {
  hosts_t h(experts);
  for (uint32_t e = 0; e < experts; ++e) {
    h[e] = {e % 3, (e + 1) % 3};
    std::sort(h[e].begin(), h[e].end());
  }
  return h;
}

/// `ranks` models whose experts are split over them by `place`.
struct split_group {
  split_group(const moe_config& c, size_t ranks, placement_fn place, bool per_source)
      : hub(ranks) {
    for (size_t r = 0; r < ranks; ++r) {
      models.push_back(make_moe_lm(c));
      xs.push_back(std::make_unique<thread_exchange>(hub, ranks, r, place));
      xs[r]->per_source_ = per_source;
      REQUIRE(models[r]->set_expert_exchange(xs[r].get()));
    }
  }

  /// Rank r runs micro-batches r, r + ranks, ... in a thread of its own,
  /// and an empty one where it has none left (the exchanges are
  /// collective), as the trainer does: before(r, round), then the
  /// micro-batch, then after(r, i, stats) for micro-batch i.
  template <class Before, class After>
  void run(const std::vector<batch>& batches, Before before, After after) {
    const size_t ranks = models.size(), rounds = (batches.size() + ranks - 1) / ranks;
    std::vector<std::thread> threads;
    for (size_t r = 0; r < ranks; ++r)
      threads.emplace_back([&, r] {
        batch empty;
        empty.seq_len = batches[0].seq_len;
        for (size_t k = 0; k < rounds; ++k) {
          const size_t i = k * ranks + r;
          before(r, k);
          if (i < batches.size())
            after(r, i, models[r]->forward_backward(batches[i]));
          else
            models[r]->forward_backward(empty);
        }
      });
    for (auto& t : threads)
      t.join();
  }

  thread_hub hub;
  std::vector<std::unique_ptr<model>> models;
  std::vector<std::unique_ptr<thread_exchange>> xs;
};

/// Micro-batches dealt to `ranks` models in threads whose experts are split
/// by `place`: the group's summed gradient must be that of one local model
/// over all the micro-batches, and a rank holds no gradient of an expert it
/// does not host. Each rank runs as many micro-batches as the busiest
/// (empty ones), as the trainer does.
void check_split_gradient(size_t ranks, placement_fn place, const std::vector<batch>& batches) {
  auto c = tiny_config(2);
  auto reference = make_moe_lm(c);
  std::vector<double> ref_loss;
  for (auto& b : batches)
    ref_loss.push_back(reference->forward_backward(b).loss);
  std::vector<float> want(reference->gradients().begin(), reference->gradients().end());

  split_group g(c, ranks, place, false);
  auto& models = g.models;
  auto& xs = g.xs;
  std::vector<double> loss(batches.size());
  g.run(batches, [](size_t, size_t) {},
        [&](size_t, size_t i, const step_stats& st) { loss[i] = st.loss; });
  for (size_t i = 0; i < batches.size(); ++i)
    CHECK(loss[i] == doctest::Approx(ref_loss[i]).epsilon(1e-6));
  double worst = 0, scale = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    double sum = 0;
    for (auto& m : models)
      sum += m->gradients()[i];
    worst = std::max(worst, std::abs(sum - want[i]));
    scale = std::max(scale, std::abs(static_cast<double>(want[i])));
  }
  MESSAGE(ranks << " ranks: largest gradient difference " << worst << " (largest gradient "
                << scale << ")");
  CHECK(worst <= 1e-5 * scale);
  const auto hosts = place ? place(c.experts) : [&] {
    hosts_t h;
    xs[0]->expert_exchange::place(0, nullptr, c.experts, h);
    return h;
  }();
  for (size_t r = 0; r < ranks; ++r)
    for (auto& t : models[r]->tensors()) {
      if (t.expert < 0)
        continue;
      const auto& hs = hosts[static_cast<size_t>(t.expert)];
      if (std::find(hs.begin(), hs.end(), r) != hs.end())
        continue;
      for (size_t i = 0; i < t.size; ++i)
        REQUIRE(models[r]->gradients()[t.offset + i] == 0.0f);
    }
}

/// Per source (exact mode): each micro-batch's gradient, its own rank's
/// part plus the pieces its experts' hosts computed, has the bits of the
/// same micro-batch's gradient on one local model.
void check_per_source_gradient(size_t ranks, placement_fn place, const std::vector<batch>& batches) {
  auto c = tiny_config(2);
  split_group g(c, ranks, place, true);
  auto& xs = g.xs;
  std::vector<std::vector<float>> own(batches.size());
  g.run(
    batches,
    [&](size_t r, size_t k) {
      g.models[r]->zero_gradients();
      xs[r]->round = k;
    },
    [&](size_t r, size_t i, const step_stats&) {
      own[i].assign(g.models[r]->gradients().begin(), g.models[r]->gradients().end());
    });
  auto local = make_moe_lm(c);
  size_t pieces = 0;
  for (size_t i = 0; i < batches.size(); ++i) {
    CAPTURE(i);
    std::vector<float> whole = own[i];
    for (auto& x : xs)
      for (auto& p : x->pieces)
        if (p.round * ranks + p.source == i) {
          ++pieces;
          for (size_t j = 0; j < p.values.size(); ++j) {
            REQUIRE(whole[p.offset + j] == 0.0f); // no element computed twice
            whole[p.offset + j] = p.values[j];
          }
        }
    local->zero_gradients();
    local->forward_backward(batches[i]);
    auto want = local->gradients();
    CHECK(std::memcmp(whole.data(), want.data(), want.size() * sizeof(float)) == 0);
  }
  MESSAGE(ranks << " ranks: " << pieces << " pieces");
  CHECK(pieces > 0);
}

} // namespace

TEST_CASE("moe_lm: experts per source: each micro-batch's gradient has the local bits") {
  std::mt19937 rng(11);
  const auto text = repeated_text(4096);
  std::vector<batch> batches;
  for (size_t sequences : {3, 2, 2, 4, 1})
    batches.push_back(make_batch(text, sequences, 32, rng));
  SUBCASE("two ranks, the static placement") { check_per_source_gradient(2, {}, batches); }
  SUBCASE("three ranks, every expert on two ranks (one source's rows on one of them)") {
    check_per_source_gradient(3, every_expert_on_two_of_three, batches);
  }
}

TEST_CASE("moe_lm: experts split over one rank compute exactly what the local experts do") {
  auto c = tiny_config(2);
  SUBCASE("fp32 activations") {}
  SUBCASE("bf16 activations") { c.activations = "bf16"; }
  std::mt19937 rng(5);
  const batch b = make_batch(repeated_text(4096), 4, 32, rng);
  auto local = make_moe_lm(c), split = make_moe_lm(c);
  thread_hub hub(1);
  thread_exchange x(hub, 1, 0);
  REQUIRE(split->set_expert_exchange(&x));
  auto s1 = local->forward_backward(b);
  auto s2 = split->forward_backward(b);
  CHECK(s1.loss == s2.loss);
  CHECK(s1.aux_loss == s2.aux_loss);
  auto g1 = local->gradients(), g2 = split->gradients();
  CHECK(std::memcmp(g1.data(), g2.data(), g1.size() * sizeof(float)) == 0);
}

TEST_CASE("moe_lm: experts split over ranks: the group's gradient is the local one's") {
  std::mt19937 rng(9);
  const auto text = repeated_text(4096);
  // Uneven micro-batches: the last round leaves ranks without one.
  std::vector<batch> batches;
  for (size_t sequences : {3, 2, 2, 4, 1})
    batches.push_back(make_batch(text, sequences, 32, rng));
  SUBCASE("two ranks, the static placement (experts 0-1 on rank 0, 2-3 on rank 1)") {
    check_split_gradient(2, {}, batches);
  }
  SUBCASE("two ranks, expert 0 on both, rank 0 hosting only one more") {
    check_split_gradient(2, [](size_t) { return hosts_t{{0, 1}, {1}, {1}, {0}}; }, batches);
  }
  SUBCASE("three ranks for four experts, every expert on two ranks") {
    check_split_gradient(3, every_expert_on_two_of_three, batches);
  }
  SUBCASE("two ranks, every expert on rank 1") {
    check_split_gradient(2, [](size_t experts) { return hosts_t(experts, {1}); }, batches);
  }
}

namespace {

// A stream over one rank: the weights live in `truth`; fetch copies a unit
// into a buffer of its own, release poisons that buffer with NaN (a
// weight used after its release spoils the loss), reduce adds the unit's
// gradient buffer to `sum`. It checks the protocol: units are whole tensors
// in order, one at a time, a gradient only for the fetched unit, and each
// tensor reduced once per micro-batch.
class checking_stream final : public parameter_stream {
public:
  checking_stream(model& m, std::vector<float> truth)
      : m_(m), truth_(std::move(truth)), sum_(truth_.size(), 0.0f),
        reduced_(m.tensors().size(), 0) {}

  const float* fetch(size_t first, size_t last) override {
    REQUIRE(first < last);
    REQUIRE(last <= m_.tensors().size());
    REQUIRE_FALSE(live_);
    live_ = true;
    unit_ = {first, last};
    auto [a, b] = range(first, last);
    w_.assign(truth_.begin() + a, truth_.begin() + b);
    ++fetches;
    return w_.data();
  }
  void release(size_t first, size_t last) override {
    REQUIRE(live_);
    REQUIRE(unit_ == std::pair{first, last});
    REQUIRE(g_.empty()); // reduced before released
    live_ = false;
    std::fill(w_.begin(), w_.end(), std::nanf(""));
  }
  float* gradient(size_t first, size_t last) override {
    REQUIRE(live_);
    REQUIRE(unit_ == std::pair{first, last});
    auto [a, b] = range(first, last);
    g_.assign(b - a, 0.0f);
    return g_.data();
  }
  void reduce(size_t first, size_t last) override {
    REQUIRE(unit_ == std::pair{first, last});
    REQUIRE_FALSE(g_.empty());
    auto [a, b] = range(first, last);
    for (size_t i = a; i < b; ++i)
      sum_[i] += g_[i - a];
    g_.clear();
    for (size_t t = first; t < last; ++t)
      ++reduced_[t];
  }

  // Every tensor reduced exactly `times` times in all, nothing live.
  void check(int times) const {
    CHECK_FALSE(live_);
    for (size_t t = 0; t < reduced_.size(); ++t)
      CHECK_MESSAGE(reduced_[t] == times, m_.tensors()[t].name);
  }
  const std::vector<float>& sum() const { return sum_; }
  size_t fetches = 0;

private:
  std::pair<size_t, size_t> range(size_t first, size_t last) const {
    const auto& ts = m_.tensors();
    return {ts[first].offset, ts[last - 1].offset + ts[last - 1].size};
  }

  model& m_;
  std::vector<float> truth_, sum_, w_, g_;
  std::vector<int> reduced_;
  bool live_ = false;
  std::pair<size_t, size_t> unit_;
};

} // namespace

/// Two micro-batches of 3 and 2 sequences from the repeated text.
std::pair<batch, batch> two_batches(unsigned seed, size_t seq_len) {
  std::mt19937 rng(seed);
  const auto text = repeated_text(4000);
  batch b1 = make_batch(text, 3, seq_len, rng);
  return {std::move(b1), make_batch(text, 2, seq_len, rng)};
}

TEST_CASE("moe_lm: streamed weights give the gradient of whole ones, each unit reduced once") {
  const auto c = tiny_config(2);
  const auto [b1, b2] = two_batches(5, 12);

  auto whole = make_moe_lm(c);
  auto streamed = make_moe_lm(c);
  const std::vector<float> truth(whole->parameters().begin(), whole->parameters().end());
  checking_stream s(*streamed, truth);
  REQUIRE(streamed->set_parameter_stream(&s));

  // One micro-batch: the same bits.
  whole->zero_gradients();
  streamed->zero_gradients();
  const auto w1 = whole->forward_backward(b1, 2.0f);
  const auto s1 = streamed->forward_backward(b1, 2.0f);
  s.check(1);
  CHECK(s1.loss == w1.loss);
  CHECK(s1.aux_loss == w1.aux_loss);
  auto g = whole->gradients();
  CHECK(std::equal(g.begin(), g.end(), s.sum().begin()));
  // The model's own gradient buffer is not used.
  auto sg = streamed->gradients();
  CHECK(std::all_of(sg.begin(), sg.end(), [](float x) { return x == 0.0f; }));
  // Units: the embedding and mixing, per layer the dense FFN, the router
  // and each expert, the output; forward fetches each once, backward all
  // but the output (still held from the forward pass) again.
  const size_t units = 2 + c.layers * (2 + c.experts);
  CHECK(s.fetches == units + units - 1);

  // A second micro-batch adds up (in another order than the whole buffer
  // does: within rounding).
  const auto w2 = whole->forward_backward(b2);
  const auto s2 = streamed->forward_backward(b2);
  s.check(2);
  CHECK(s2.loss == w2.loss);
  for (size_t i = 0; i < g.size(); ++i)
    REQUIRE(s.sum()[i] == doctest::Approx(g[i]).epsilon(1e-5).scale(1e-6));

  // Evaluation fetches and releases too.
  const auto e = streamed->evaluate(b1);
  CHECK(e.loss == whole->evaluate(b1).loss);
  s.check(2);
  // Back to whole weights: the model's buffers are used directly again.
  REQUIRE(streamed->set_parameter_stream(nullptr));
}

namespace {

// Records each reported unit and a copy of its gradient range at the
// moment of the report.
class recording_listener final : public gradient_listener {
public:
  explicit recording_listener(model& m) : m_(m) {}
  void unit_done(size_t first, size_t last) override {
    REQUIRE(first < last);
    REQUIRE(last <= m_.tensors().size());
    const auto& ts = m_.tensors();
    const size_t a = ts[first].offset, b = ts[last - 1].offset + ts[last - 1].size;
    auto g = m_.gradients();
    units.push_back({first, last});
    seen.emplace_back(g.begin() + static_cast<std::ptrdiff_t>(a),
                      g.begin() + static_cast<std::ptrdiff_t>(b));
  }
  std::vector<std::pair<size_t, size_t>> units;
  std::vector<std::vector<float>> seen;

private:
  model& m_;
};

} // namespace

TEST_CASE("moe_lm: a unit's gradient is final when the listener hears of it") {
  const auto c = tiny_config(2);
  const auto [b1, b2] = two_batches(7, 12);
  auto m = make_moe_lm(c);
  auto plain = make_moe_lm(c);
  recording_listener l(*m);
  REQUIRE(m->set_gradient_listener(&l));
  m->zero_gradients();
  plain->zero_gradients();
  batch empty;
  empty.seq_len = 12;
  size_t per_batch = 0;
  std::vector<std::pair<size_t, size_t>> first_order;
  for (const batch* b : std::array<const batch*, 3>{&b1, &b2, &empty}) {
    l.units.clear();
    l.seen.clear();
    const auto s = m->forward_backward(*b, 2.0f);
    CHECK(s.loss == plain->forward_backward(*b, 2.0f).loss);
    // Every tensor in exactly one unit, each unit once, in the same order
    // every micro-batch (an empty one too).
    std::vector<int> count(m->tensors().size(), 0);
    for (auto [f, t] : l.units)
      for (size_t i = f; i < t; ++i)
        ++count[i];
    for (size_t i = 0; i < count.size(); ++i)
      CHECK_MESSAGE(count[i] == 1, m->tensors()[i].name);
    if (first_order.empty())
      first_order = l.units;
    CHECK(l.units == first_order);
    per_batch = l.units.size();
    // What the listener saw is what the micro-batch left: nothing wrote
    // into a unit after it was reported.
    auto g = m->gradients();
    const auto& ts = m->tensors();
    for (size_t u = 0; u < l.units.size(); ++u) {
      const size_t a = ts[l.units[u].first].offset;
      CHECK(std::equal(l.seen[u].begin(), l.seen[u].end(),
                       g.begin() + static_cast<std::ptrdiff_t>(a)));
    }
  }
  CHECK(per_batch == 2 + c.layers * (2 + c.experts));
  // Reporting changes nothing: the same bits as a model without listener.
  auto g = m->gradients(), pg = plain->gradients();
  CHECK(std::equal(g.begin(), g.end(), pg.begin()));
  REQUIRE(m->set_gradient_listener(nullptr));
}

TEST_CASE("moe_lm: the device code path (emulated) computes what the CPU model does") {
  // The device network keeps its activations in buffers that forget their
  // contents on every resize and allow no host access: a step that relied
  // on either would differ here (or not compile).
  auto c = tiny_config(2);
  SUBCASE("fp32 activations") {}
  SUBCASE("bf16 activations") {
    c.activations = "bf16";
    c.products = "fp32"; // "auto" would round the device's products only
  }
  SUBCASE("bf16 activations and products") {
    c.activations = "bf16";
    c.products = "bf16";
  }
  const auto [b1, b2] = two_batches(11, 16);
  auto cpu = make_moe_lm(c);
  auto dev = make_moe_lm_on(c, compute_device::emulated);
  REQUIRE(dev);
  auto& d = **dev;
  REQUIRE(d.parameters().size() == cpu->parameters().size());
  CHECK(std::equal(d.parameters().begin(), d.parameters().end(), cpu->parameters().begin()));
  CHECK_FALSE(d.set_expert_exchange(reinterpret_cast<expert_exchange*>(&d)));
  for (int round = 0; round < 2; ++round) {
    cpu->zero_gradients();
    d.zero_gradients();
    const auto s1 = cpu->forward_backward(b1, 4.0f), t1 = d.forward_backward(b1, 4.0f);
    const auto s2 = cpu->forward_backward(b2), t2 = d.forward_backward(b2);
    CHECK(s1.loss == t1.loss);
    CHECK(s1.aux_loss == t1.aux_loss);
    CHECK(s2.loss == t2.loss);
    CHECK(s1.dropped == t1.dropped);
    CHECK(s1.expert_load == t1.expert_load);
    auto g = cpu->gradients(), h = d.gradients();
    CHECK(std::memcmp(g.data(), h.data(), g.size() * sizeof(float)) == 0);
    // The runtime changes the weights between steps: the device sees them.
    for (size_t i = 0; i < g.size(); ++i) {
      cpu->parameters()[i] -= 0.01f * g[i];
      d.parameters()[i] -= 0.01f * h[i];
    }
  }
  CHECK(cpu->evaluate(b2).loss == d.evaluate(b2).loss);
  batch empty;
  empty.seq_len = 16;
  CHECK(d.forward_backward(empty).tokens == 0);
}

TEST_CASE("moe_lm: bf16 products round the operands: near the fp32 products, not their bits") {
  // With bf16 activations and weights the forward products' operands are
  // bf16 values already; the backward products round the gradients.
  auto c = tiny_config(2);
  c.activations = "bf16";
  auto fp32 = make_moe_lm(c);
  c.products = "bf16";
  auto bf16 = make_moe_lm(c);
  for (auto* m : {fp32.get(), bf16.get()}) {
    auto p = m->parameters();
    cmesh::kernels::cpu::round_to_bf16(p.data(), p.size()); // bf16 weights, as training has
  }
  const auto [b1, b2] = two_batches(11, 16);
  fp32->zero_gradients();
  bf16->zero_gradients();
  const auto s = fp32->forward_backward(b1), t = bf16->forward_backward(b1);
  CHECK(s.loss == t.loss); // the forward pass multiplies bf16 values: no rounding
  auto g = fp32->gradients(), h = bf16->gradients();
  double num = 0, den = 0;
  size_t differ = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    num += (double(g[i]) - h[i]) * (double(g[i]) - h[i]);
    den += double(g[i]) * g[i];
    differ += g[i] != h[i];
  }
  CHECK(differ > 0);
  CHECK(std::sqrt(num / den) < 1e-2); // a bf16 step is 2^-8
  MESSAGE("bf16 products: " << differ << " of " << g.size()
          << " gradient values differ, relative l2 " << std::sqrt(num / den));
}

TEST_CASE("moe_lm: a gradient kept on the device (emulated, or a GPU) is the CPU model's") {
  // keep_gradients_on_device: the runtime uploads the weights by range (a
  // gather may write the rest), the gradient stays on the device until it
  // downloads a range of it.
  // The emulated device gives the CPU's bits; a GPU its products' rounding.
  auto c = tiny_config(2);
  const auto [b1, b2] = two_batches(5, 16);
  auto cpu = make_moe_lm(c);
  CHECK_FALSE(cpu->keep_gradients_on_device(true)); // a CPU model has no device
  CHECK(cpu->device_gradients() == nullptr);
  compute_device where = compute_device::emulated;
  SUBCASE("emulated") {}
  SUBCASE("GPU") { where = compute_device::cuda; }
  auto dev = make_moe_lm_on(c, where);
  if (!dev) {
    MESSAGE("skipped: " << cmesh::describe(dev.error()));
    CHECK(where == compute_device::cuda);
    return;
  }
  auto& d = **dev;
  // Bits on the emulated device; on a GPU within its rounding (largest
  // gradient ~0.2, differences ~1e-7).
  auto same = [&](const float* x, const float* y, size_t len) {
    if (where == compute_device::emulated)
      return std::memcmp(x, y, len * sizeof(float)) == 0;
    for (size_t i = 0; i < len; ++i)
      if (!(std::abs(x[i] - y[i]) <= 1e-5f))
        return false;
    return true;
  };
  CHECK(d.device_gradients() == nullptr); // not kept yet
  CHECK(d.device_parameters() == nullptr);
  REQUIRE(d.keep_gradients_on_device(true)); // the weights go up once here
  CHECK(d.device_parameters() != nullptr);
  const size_t n = d.gradients().size();
  for (int round = 0; round < 2; ++round) {
    CAPTURE(round);
    cpu->zero_gradients();
    d.zero_gradients();
    cpu->forward_backward(b1);
    cpu->forward_backward(b2, 2.0f);
    d.forward_backward(b1);
    d.forward_backward(b2, 2.0f);
    std::fill(d.gradients().begin(), d.gradients().end(), -1.0f);
    REQUIRE(d.device_gradients() != nullptr);
    // A range first: only it comes down.
    const size_t a = n / 3, len = n / 4;
    d.download_gradients(a, len);
    auto g = cpu->gradients(), h = d.gradients();
    CHECK(same(g.data() + a, h.data() + a, len));
    CHECK(h[a - 1] == -1.0f);
    CHECK(h[a + len] == -1.0f);
    d.download_gradients(0, n);
    CHECK(same(g.data(), h.data(), n));
    // New weights reach the device as the runtime uploads them, in two
    // ranges here.
    for (size_t i = 0; i < n; ++i) {
      cpu->parameters()[i] -= 0.01f * g[i];
      d.parameters()[i] -= 0.01f * g[i];
    }
    d.upload_parameters(0, a);
    d.upload_parameters(a, n - a);
  }
  // The runtime may sum in place on the device; a kept gradient is not
  // written to gradients() by forward_backward.
  d.zero_gradients();
  std::fill(d.gradients().begin(), d.gradients().end(), 7.0f);
  d.forward_backward(b1);
  CHECK(d.gradients()[0] == 7.0f);
  REQUIRE(d.keep_gradients_on_device(false));
  CHECK(d.device_gradients() == nullptr);
  d.zero_gradients();
  d.forward_backward(b1);
  cpu->zero_gradients();
  cpu->forward_backward(b1);
  CHECK(same(cpu->gradients().data(), d.gradients().data(), n));
}

TEST_CASE("moe_lm: on a GPU the model computes what the CPU model does") {
  auto c = tiny_config(2);
  // bf16: a product that lands on the other side of a rounding boundary on
  // the GPU moves an activation by one bf16 step (2^-8), so that case
  // compares directions and the loss, not bits.
  bool half = false;
  SUBCASE("fp32 activations") {}
  SUBCASE("bf16 activations") {
    c.activations = "bf16";
    c.products = "bf16"; // the CPU rounds the operands as the GPU's tensor cores do
    half = true;
  }
  auto dev = make_moe_lm_on(c, compute_device::cuda);
  if (!dev) {
    const auto why = cmesh::describe(dev.error());
    MESSAGE("skipped: " << why);
    CHECK(cmesh::code_of(dev.error()) == cmesh::errc::invalid_argument);
    CHECK(why.find("--device cuda") != std::string::npos);
    return;
  }
  std::mt19937 rng(13);
  const batch b = make_batch(repeated_text(4000), 4, 32, rng);
  auto cpu = make_moe_lm(c);
  auto& d = **dev;
  cpu->zero_gradients();
  d.zero_gradients();
  const auto s = cpu->forward_backward(b), t = d.forward_backward(b);
  CHECK(t.loss == doctest::Approx(s.loss).epsilon(half ? 1e-2 : 1e-5));
  CHECK(t.aux_loss == doctest::Approx(s.aux_loss).epsilon(half ? 1e-2 : 1e-4));
  if (!half)
    CHECK(t.expert_load == s.expert_load);
  auto g = cpu->gradients(), h = d.gradients();
  double worst = 0, scale = 0, dot = 0, gg = 0, hh = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    worst = std::max(worst, std::abs(static_cast<double>(g[i]) - h[i]));
    scale = std::max(scale, std::abs(static_cast<double>(g[i])));
    dot += static_cast<double>(g[i]) * h[i];
    gg += static_cast<double>(g[i]) * g[i];
    hh += static_cast<double>(h[i]) * h[i];
  }
  const double cosine = dot / std::sqrt(gg * hh);
  MESSAGE("GPU against CPU (" << c.activations << " activations): largest gradient difference "
                              << worst << " (largest " << scale << "), cosine " << cosine);
  if (half)
    CHECK(cosine > 0.999);
  else
    CHECK(worst <= 1e-4 * scale);
}
