#include "model/moe_lm.hpp"
#include "core/hash.hpp"

#include "core/check.hpp"
#include "core/pages.hpp"
#include "kernels/device.hpp"
#ifdef CMESH_HAVE_CUDA
#include "kernels/cuda/ops.hpp"
#include "kernels/cuda_check.hpp"
#endif
#include "kernels/activation.hpp"
#include "kernels/embedding.hpp"
#include "kernels/gemm.hpp"
#include "kernels/loss.hpp"
#include "kernels/moe.hpp"
#include "kernels/precision.hpp"

#include <algorithm>
#include <memory>
#include <cstring>
#include <cmath>
#include <random>
#include <string>
#include <type_traits>

namespace cmesh::model {

namespace {

namespace kc = kernels::cpu;

constexpr size_t vocab = 256;

// ---------------------------------------------------------------------------
// Layout: where each tensor lives in the flat buffer.

struct expert_at {
  size_t w1, b1, w2, b2;
};

// A unit of tensors fetched, released and reduced together when the
// weights are streamed: tensor indices [first, last).
struct unit {
  size_t first = 0, last = 0;
};

struct layer_at {
  size_t w1, b1, w2, b2, router;
  std::vector<expert_at> experts;
  unit ffn, route;
  std::vector<unit> expert_units;
};

struct layout {
  size_t embed = 0, mix_w = 0, mix_b = 0, out_w = 0, out_b = 0;
  unit pre, out; // embedding and mixing; the output layer
  std::vector<layer_at> layers;
  std::vector<tensor_info> tensors;
  size_t total = 0;

  size_t add(std::string name, std::vector<size_t> shape, int layer = -1, int expert = -1) {
    tensor_info t;
    t.name = std::move(name);
    t.size = 1;
    for (size_t s : shape)
      t.size *= s;
    t.shape = std::move(shape);
    t.offset = total;
    t.layer = layer;
    t.expert = expert;
    total += t.size;
    tensors.push_back(std::move(t));
    return tensors.back().offset;
  }
};

void check_config(const moe_config& c) {
  CMESH_CHECK_GE(c.d_model, 1u);
  CMESH_CHECK_GE(c.context, 1u);
  CMESH_CHECK_GE(c.ffn, 1u);
  CMESH_CHECK_GE(c.expert_ffn, 1u);
  CMESH_CHECK_GE(c.top_k, 1u);
  CMESH_CHECK_LE(c.top_k, c.experts);
}

layout make_layout(const moe_config& c) {
  check_config(c);
  const size_t d = c.d_model;
  layout l;
  l.embed = l.add("embed", {vocab, d});
  l.mix_w = l.add("mix.w", {c.context * d, d});
  l.mix_b = l.add("mix.b", {d});
  l.pre = {0, l.tensors.size()};
  for (size_t i = 0; i < c.layers; ++i) {
    const std::string p = "layer" + std::to_string(i) + ".";
    const int li = static_cast<int>(i);
    layer_at at{};
    at.ffn.first = l.tensors.size();
    at.w1 = l.add(p + "ffn.w1", {d, c.ffn}, li);
    at.b1 = l.add(p + "ffn.b1", {c.ffn}, li);
    at.w2 = l.add(p + "ffn.w2", {c.ffn, d}, li);
    at.b2 = l.add(p + "ffn.b2", {d}, li);
    at.ffn.last = l.tensors.size();
    at.router = l.add(p + "moe.router", {d, c.experts}, li);
    at.route = {at.ffn.last, l.tensors.size()};
    for (size_t e = 0; e < c.experts; ++e) {
      const size_t first = l.tensors.size();
      const std::string q = p + "moe.expert" + std::to_string(e) + ".";
      const int ei = static_cast<int>(e);
      expert_at x{};
      x.w1 = l.add(q + "w1", {d, c.expert_ffn}, li, ei);
      x.b1 = l.add(q + "b1", {c.expert_ffn}, li, ei);
      x.w2 = l.add(q + "w2", {c.expert_ffn, d}, li, ei);
      x.b2 = l.add(q + "b2", {d}, li, ei);
      at.experts.push_back(x);
      at.expert_units.push_back({first, l.tensors.size()});
    }
    l.layers.push_back(std::move(at));
  }
  const size_t out_first = l.tensors.size();
  l.out_w = l.add("out.w", {d, vocab});
  l.out_b = l.add("out.b", {vocab});
  l.out = {out_first, l.tensors.size()};
  return l;
}

// ---------------------------------------------------------------------------
// Initialisation.

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char ch : s)
    h = (h ^ ch) * 0x100000001b3ull;
  return h;
}

// The standard deviation a tensor starts with: fan-in scaling, residual
// branch outputs shrunk further, biases zero.
double init_std(const moe_config& c, const tensor_info& t) {
  const auto ends_with = [&](const char* s) {
    const std::string suffix(s);
    return t.name.size() >= suffix.size() &&
           t.name.compare(t.name.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  if (t.shape.size() == 1)
    return 0.0;
  const double fan_in = static_cast<double>(t.shape[0]);
  const double residual = 1.0 / std::sqrt(2.0 * static_cast<double>(std::max<size_t>(c.layers, 1)));
  if (t.name == "embed")
    return 1.0;
  if (t.name == "out.w")
    return 0.5 / std::sqrt(fan_in);
  if (ends_with(".w2"))
    return residual / std::sqrt(fan_in);
  return 1.0 / std::sqrt(fan_in); // mix.w, w1, router
}

// Uniform with the wanted standard deviation, from mt19937_64's raw output
// (whose sequence the standard fixes, unlike its distributions').
void fill_uniform(float* out, size_t n, double std, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const double half_width = std * std::sqrt(3.0);
  for (size_t i = 0; i < n; ++i) {
    const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53; // [0, 1)
    out[i] = static_cast<float>((2.0 * u - 1.0) * half_width);
  }
}

// ---------------------------------------------------------------------------
// The network, in float (training) or double (gradient checks).

// Where the network's kernels run: the CPU here (host_ops), or a GPU
// (cuda_ops, below, in builds with CUDA). The network's code is the same
// for both: it calls its kernels through ops_, keeps its activations in
// ops_'s buffers (std::vector here; device memory there: resizing keeps no
// contents, and assign() only zeroes), and reads only row counts and
// offsets on the host, through download().
#define CMESH_CPU_KERNEL(name)                                 \
  template <class... A>                                        \
  auto name(A&&... a) {                                        \
    return kc::name(std::forward<A>(a)...);                    \
  }

template <class T>
struct host_ops {
  static constexpr bool host = true;
  template <class U>
  using buffer = std::vector<U>;

  // model.products = "bf16" (float networks only): operands rounded to bf16.
  kernels::gemm_math products = kernels::gemm_math::fp32;
  void gemm(bool ta, bool tb, size_t m, size_t n, size_t k, T alpha, const T* a, size_t lda,
            const T* b, size_t ldb, T beta, T* c, size_t ldc) {
    if constexpr (std::is_same_v<T, float>)
      if (products == kernels::gemm_math::bf16_inputs)
        return kc::gemm_bf16_inputs(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    kc::gemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  }
  CMESH_CPU_KERNEL(add_row_bias)
  CMESH_CPU_KERNEL(add_column_sums)
  CMESH_CPU_KERNEL(gelu_forward)
  CMESH_CPU_KERNEL(gelu_backward)
  CMESH_CPU_KERNEL(gather_rows)
  CMESH_CPU_KERNEL(scatter_add_rows)
  CMESH_CPU_KERNEL(softmax_cross_entropy_forward)
  CMESH_CPU_KERNEL(softmax_cross_entropy_backward)
  CMESH_CPU_KERNEL(softmax_rows)
  CMESH_CPU_KERNEL(softmax_rows_backward)
  CMESH_CPU_KERNEL(top_k_gating)
  CMESH_CPU_KERNEL(top_k_gating_backward)
  CMESH_CPU_KERNEL(assign_capacity)
  CMESH_CPU_KERNEL(build_permutation)
  CMESH_CPU_KERNEL(permute_tokens)
  CMESH_CPU_KERNEL(permute_tokens_backward)
  CMESH_CPU_KERNEL(unpermute_tokens)
  CMESH_CPU_KERNEL(unpermute_tokens_backward)
  CMESH_CPU_KERNEL(load_balancing_loss)
  CMESH_CPU_KERNEL(load_balancing_backward)
  CMESH_CPU_KERNEL(round_to_bf16)
  CMESH_CPU_KERNEL(float_to_bf16)
  CMESH_CPU_KERNEL(bf16_to_float)

  /// y[i] += x[i].
  static void add(T* y, const T* x, size_t n) {
    for (size_t i = 0; i < n; ++i)
      y[i] += x[i];
  }
  /// n host values into a buffer (resized to n).
  template <class U>
  static void upload(buffer<U>& out, const U* from, size_t n) {
    out.assign(from, from + n);
  }
  /// The first n values of a buffer to the host.
  template <class U>
  static void download(U* out, const buffer<U>& from, size_t n) {
    std::copy_n(from.data(), n, out);
  }
};

#undef CMESH_CPU_KERNEL

// y[rows, out] = x[rows, in] W[in, out] + b.
template <class T, class Ops>
void linear(Ops& ops, const T* x, const T* w, const T* b, size_t rows, size_t in, size_t out,
            T* y) {
  ops.gemm(false, false, rows, out, in, T(1), x, in, w, out, T(0), y, out);
  ops.add_row_bias(y, b, rows, out);
}

// Backward of linear: dW += x^T dy, db += column sums of dy, and
// dx = dy W^T (dx_beta 0) or dx += dy W^T (dx_beta 1).
template <class T, class Ops>
void linear_backward(Ops& ops, const T* x, const T* dy, const T* w, size_t rows, size_t in,
                     size_t out, T* dw, T* db, T* dx, T dx_beta) {
  ops.gemm(true, false, in, out, rows, T(1), x, in, dy, out, T(1), dw, out);
  ops.add_column_sums(db, dy, rows, out);
  ops.gemm(false, true, rows, in, out, T(1), dy, out, w, out, dx_beta, dx, in);
}

// bf16 activations between the forward and the backward pass: the bits of
// each saved tensor, back to back, and each tensor's length.
template <class Ops>
struct packed_activations {
  typename Ops::template buffer<uint16_t> bits;
  std::vector<size_t> sizes;
};

// What a layer's backward pass needs from its forward pass.
template <class T, class Ops>
struct layer_cache {
  template <class U>
  using buf = typename Ops::template buffer<U>;
  buf<T> x_in, ffn_pre, ffn_act, x_mid;
  buf<T> probs, gates;
  buf<int32_t> chosen, slots, counts, offsets, row_of, token_of;
  std::vector<int32_t> host_counts, host_offsets; // counts and offsets, on the host
  buf<T> xp, e_pre, e_act, e_out; // permuted rows, per-expert blocks
  size_t rows = 0;
  // Expert parallelism: what this rank's experts received.
  std::vector<size_t> send, recv;   // floats to / from each rank
  struct block {                    // rows from one source for one of my experts
    size_t from = 0, to = 0, rows = 0; // source-major and expert-major row offsets
  };
  std::vector<block> blocks;
  std::vector<size_t> mine_first, mine_rows; // per hosted expert, expert-major
  std::vector<size_t> hosted;       // the experts this rank computes, ascending
  std::vector<int> host_index;      // per expert: its index in `hosted`, or -1
  struct piece {                    // rows of xp sent to one host, in send order
    size_t row = 0, rows = 0;
  };
  std::vector<piece> pieces;
  std::vector<T> xs;                // xp (or its gradient) packed by host
  std::vector<T> xr, xe, ee_pre, ee_act, ye;  // received rows, expert-major rows
  size_t erows = 0;
  // bf16 activations: the saved tensors, as bf16, between the passes.
  packed_activations<Ops> packed;
};

template <class T, class Ops = host_ops<T>>
class network {
public:
  template <class U>
  using buf = typename Ops::template buffer<U>;

  explicit network(const moe_config& c, Ops ops = {})
      : c_(c), at_(make_layout(c)), ops_(std::move(ops)), caches_(c.layers),
        half_(std::is_same_v<T, float> && c.activations == "bf16") {
    if (std::is_same_v<T, float> && bf16_products(c, !Ops::host))
      ops_.products = kernels::gemm_math::bf16_inputs;
  }

  const layout& at() const { return at_; }
  void set_exchange(expert_exchange* x) { ex_ = x; }
  void set_stream(parameter_stream* s) { ps_ = s; }
  void set_listener(gradient_listener* l) { gl_ = l; }
  bool streamed() const { return ps_ != nullptr; }

  /// Bytes of what the forward pass keeps for the backward pass (the
  /// layers' caches, the first and last activations, bf16 packs and the
  /// float buffers they are unpacked into), as allocated.
  size_t saved_activation_bytes() const {
    size_t b = bytes(x_) + bytes(ctx_) + bytes(mix_pre_) + bytes(logits_) + bytes(top_.bits);
    for (const auto& p : pool_)
      b += bytes(p);
    for (const auto& m : caches_) {
      for (const auto* v : {&m.x_in, &m.ffn_pre, &m.ffn_act, &m.x_mid, &m.probs, &m.gates, &m.xp,
                            &m.e_pre, &m.e_act, &m.e_out})
        b += bytes(*v);
      for (const auto* v : {&m.xs, &m.xr, &m.xe, &m.ee_pre, &m.ee_act, &m.ye})
        b += bytes(*v);
      for (const auto* v : {&m.chosen, &m.slots, &m.row_of, &m.token_of})
        b += bytes(*v);
      b += bytes(m.packed.bits);
    }
    return b;
  }

  /// Forward, and backward when `g` is not null (adding loss_scale * grads).
  step_stats run(const T* p, T* g, const batch& b, T loss_scale, std::vector<int32_t>* routing) {
    p_ = p;
    keep_ = g != nullptr;
    prepare(b);
    step_stats s;
    s.tokens = n_;
    s.expert_load.assign(c_.layers * c_.experts, 0);
    forward(s);
    if constexpr (Ops::host)
      if (routing)
        record_routing(*routing);
    if (g)
      backward(g, loss_scale);
    else
      release(at_.out);
    return s;
  }

private:
  size_t d() const { return c_.d_model; }

  template <class B>
  static size_t bytes(const B& b) {
    using V = std::remove_cv_t<std::remove_pointer_t<decltype(b.data())>>;
    if constexpr (requires { b.capacity(); })
      return b.capacity() * sizeof(V);
    else
      return b.size() * sizeof(V);
  }

  // -------------------------------------------------------------------------
  // bf16 activations. Each activation a bf16 kernel would write is rounded
  // to bf16 where it is produced (round()), so the forward pass computes
  // with exactly the values it keeps; the tensors the backward pass needs
  // are then packed as bf16 (a lossless pack) and their float buffers go
  // back to a pool shared by all layers, which holds one layer's worth:
  // saved activations take half the bytes, plus one layer's in fp32. The
  // backward pass unpacks a layer's tensors into the pool's buffers. With
  // fp32 activations none of this runs and each cache keeps its buffers.
  // The tensors kept between the passes: the first `packed` are read by the
  // backward pass (packed as bf16), the rest are scratch it reuses at the
  // forward pass's sizes (pooled only). Empty with fp32 activations, which
  // makes lending, stashing and unstashing no-ops.
  struct saved_set {
    std::vector<buf<T>*> bufs;
    size_t packed = 0;
  };

  void round(T* x, size_t n) {
    if constexpr (std::is_same_v<T, float>)
      if (half_ && n)
        ops_.round_to_bf16(x, n);
  }
  // A layer's: what its backward pass reads, then its scratch (the
  // expert-parallel buffers exist on the host only).
  saved_set saved(layer_cache<T, Ops>& m) const {
    saved_set s;
    if (!half_)
      return s;
    s.bufs = {&m.x_in, &m.ffn_pre, &m.ffn_act, &m.x_mid, &m.xp, &m.e_pre, &m.e_act, &m.e_out};
    if constexpr (std::is_same_v<buf<T>, std::vector<T>>)
      s.bufs.insert(s.bufs.end(), {&m.xe, &m.ee_pre, &m.ee_act});
    s.packed = s.bufs.size();
    if constexpr (std::is_same_v<buf<T>, std::vector<T>>)
      s.bufs.insert(s.bufs.end(), {&m.xs, &m.xr, &m.ye});
    return s;
  }
  // The first activations' (the context window and the mix).
  saved_set saved_top() {
    if (!half_)
      return {};
    return {{&ctx_, &mix_pre_}, 2};
  }
  // Lends the pool's buffers to `s` (or takes them back: the same swap).
  void swap_pool(const saved_set& s) {
    if (pool_.size() < s.bufs.size())
      pool_.resize(s.bufs.size());
    for (size_t i = 0; i < s.bufs.size(); ++i) {
      using std::swap;
      swap(*s.bufs[i], pool_[i]);
    }
  }
  // End of a forward pass over `s` (holding the pool's buffers): packs what
  // the backward pass reads when one follows, returns the buffers.
  void stash(const saved_set& s, packed_activations<Ops>& into) {
    if constexpr (std::is_same_v<T, float>) {
      if (s.bufs.empty())
        return;
      into.sizes.resize(s.bufs.size());
      size_t total = 0;
      for (size_t i = 0; i < s.bufs.size(); ++i) {
        into.sizes[i] = s.bufs[i]->size();
        if (i < s.packed)
          total += into.sizes[i];
      }
      if (keep_) {
        into.bits.resize(total);
        size_t at = 0;
        for (size_t i = 0; i < s.packed; ++i)
          if (const size_t n = into.sizes[i]) {
            ops_.float_to_bf16(s.bufs[i]->data(), into.bits.data() + at, n);
            at += n;
          }
      }
      swap_pool(s);
    }
  }
  // Start of a backward pass over `s`: borrows the pool's buffers, at the
  // forward pass's sizes, the packed tensors unpacked into them.
  void unstash(const saved_set& s, const packed_activations<Ops>& from) {
    if constexpr (std::is_same_v<T, float>) {
      if (s.bufs.empty())
        return;
      swap_pool(s);
      CMESH_CHECK_EQ(from.sizes.size(), s.bufs.size());
      size_t at = 0;
      for (size_t i = 0; i < s.bufs.size(); ++i) {
        s.bufs[i]->resize(from.sizes[i]);
        if (i < s.packed && from.sizes[i]) {
          ops_.bf16_to_float(from.bits.data() + at, s.bufs[i]->data(), from.sizes[i]);
          at += from.sizes[i];
        }
      }
    }
  }

  // Streamed weights (parameter_stream): one unit is live at a time; its
  // weights (and in the backward pass its gradient) are the stream's
  // buffers, which W() and G() point into. No-ops when the weights are
  // whole: W() and G() point into the flat buffers.
  void fetch(unit u) {
    if (!ps_)
      return;
    CMESH_CHECK(live_w_ == nullptr); // one unit at a time
    if constexpr (Ops::host && std::is_same_v<T, float>)
      live_w_ = ps_->fetch(u.first, u.last);
    live_ = u;
    live_begin_ = at_.tensors[u.first].offset;
    live_end_ = at_.tensors[u.last - 1].offset + at_.tensors[u.last - 1].size;
  }
  void release(unit u) {
    if (!ps_)
      return;
    CMESH_CHECK(live_w_ != nullptr && live_.first == u.first);
    ps_->release(u.first, u.last);
    live_w_ = nullptr;
  }
  // The backward pass of a live unit: its gradient buffer.
  void accumulate(unit u) {
    if (!ps_)
      return;
    CMESH_CHECK(live_w_ != nullptr && live_.first == u.first);
    if constexpr (Ops::host && std::is_same_v<T, float>)
      live_g_ = ps_->gradient(u.first, u.last);
  }
  // The unit's gradient is final for this micro-batch.
  void reduced(unit u) {
    if (!ps_) {
      if (gl_)
        gl_->unit_done(u.first, u.last);
      return;
    }
    ps_->reduce(u.first, u.last);
    live_g_ = nullptr;
    release(u);
  }
  // Weights and gradient of the tensor at flat offset `off`.
  const T* W(size_t off) const {
    if (!ps_)
      return p_ + off;
    CMESH_CHECK(live_w_ != nullptr && off >= live_begin_ && off < live_end_);
    return live_w_ + (off - live_begin_);
  }
  T* G(T* g, size_t off) const {
    if (!ps_)
      return g + off;
    CMESH_CHECK(live_g_ != nullptr && off >= live_begin_ && off < live_end_);
    return live_g_ + (off - live_begin_);
  }

  // Token ids, targets and the context window's embedding indices.
  void prepare(const batch& b) {
    CMESH_CHECK_EQ(b.tokens.size(), b.sequences * (b.seq_len + 1));
    n_ = b.sequences * b.seq_len;
    const size_t ctx = c_.context;
    host_tok_.resize(n_);
    host_target_.resize(n_);
    host_ctx_.resize(n_ * ctx);
    for (size_t s = 0; s < b.sequences; ++s) {
      const uint8_t* seq = b.tokens.data() + s * (b.seq_len + 1);
      for (size_t t = 0; t < b.seq_len; ++t) {
        const size_t n = s * b.seq_len + t;
        host_tok_[n] = seq[t];
        host_target_[n] = seq[t + 1];
        for (size_t j = 0; j < ctx; ++j)
          host_ctx_[n * ctx + j] = t >= j ? static_cast<int32_t>(seq[t - j]) : -1;
      }
    }
  ops_.upload(tok_, host_tok_.data(), host_tok_.size());
    ops_.upload(target_, host_target_.data(), host_target_.size());
    ops_.upload(ctx_idx_, host_ctx_.data(), host_ctx_.size());
  }

  void forward(step_stats& s) {
    const size_t n = n_, dm = d(), cw = c_.context * dm;
    x_.resize(n * dm);
    tmp_.resize(n * std::max({dm, c_.ffn, vocab}));
    const saved_set top = saved_top();
    swap_pool(top);
    ctx_.resize(n * cw);
    mix_pre_.resize(n * dm);
    fetch(at_.pre);
    ops_.gather_rows(W(at_.embed), tok_.data(), n, dm, x_.data());
    ops_.gather_rows(W(at_.embed), ctx_idx_.data(), n * c_.context, dm, ctx_.data());
    round(x_.data(), n * dm);
    round(ctx_.data(), n * cw);
    linear(ops_, ctx_.data(), W(at_.mix_w), W(at_.mix_b), n, cw, dm, mix_pre_.data());
    round(mix_pre_.data(), n * dm);
    ops_.gelu_forward(mix_pre_.data(), tmp_.data(), n * dm);
    round(tmp_.data(), n * dm);
    ops_.add(x_.data(), tmp_.data(), n * dm);
    round(x_.data(), n * dm);
    release(at_.pre);
    stash(top, top_);
    double aux = 0;
    for (size_t l = 0; l < c_.layers; ++l)
      aux += layer_forward(l, s);
    logits_.resize(n * vocab);
    fetch(at_.out); // released after the backward pass (or by run)
    linear(ops_, x_.data(), W(at_.out_w), W(at_.out_b), n, dm, vocab, logits_.data());
    s.loss = ops_.softmax_cross_entropy_forward(logits_.data(), target_.data(), n, vocab);
    s.aux_loss = c_.aux_loss_weight * aux;
  }

  // x_ = x_ + DenseFFN(x_), then x_ = x_ + MoE(x_). Returns the layer's
  // unweighted aux loss.
  double layer_forward(size_t l, step_stats& s) {
    const layer_at& at = at_.layers[l];
    layer_cache<T, Ops>& m = caches_[l];
    const size_t n = n_, dm = d(), f = c_.ffn;
    const saved_set kept = saved(m);
    swap_pool(kept);
    m.x_in = x_;
    m.ffn_pre.resize(n * f);
    m.ffn_act.resize(n * f);
    fetch(at.ffn);
    linear(ops_, x_.data(), W(at.w1), W(at.b1), n, dm, f, m.ffn_pre.data());
    round(m.ffn_pre.data(), n * f);
    ops_.gelu_forward(m.ffn_pre.data(), m.ffn_act.data(), n * f);
    round(m.ffn_act.data(), n * f);
    linear(ops_, m.ffn_act.data(), W(at.w2), W(at.b2), n, f, dm, tmp_.data());
    round(tmp_.data(), n * dm);
    release(at.ffn);
    ops_.add(x_.data(), tmp_.data(), n * dm);
    round(x_.data(), n * dm);
    m.x_mid = x_;
    route(l, s);
    experts_forward(l);
    // The combine adds onto x_ (== x_mid): the MoE residual.
    ops_.unpermute_tokens(m.e_out.data(), m.row_of.data(), m.gates.data(), n, c_.top_k, dm,
                         x_.data());
    round(x_.data(), n * dm);
    const double aux =
      ops_.load_balancing_loss(m.probs.data(), m.chosen.data(), n, c_.experts, c_.top_k);
    stash(kept, m.packed);
    return aux;
  }

  // Router probabilities, top-k, capacity and the permuted input rows.
  void route(size_t l, step_stats& s) {
    layer_cache<T, Ops>& m = caches_[l];
    const size_t n = n_, dm = d(), e = c_.experts, k = c_.top_k;
    m.probs.resize(n * e);
    fetch(at_.layers[l].route);
    ops_.gemm(false, false, n, e, dm, T(1), m.x_mid.data(), dm, W(at_.layers[l].router), e, T(0),
             m.probs.data(), e);
    release(at_.layers[l].route);
    ops_.softmax_rows(m.probs.data(), m.probs.data(), n, e);
    m.chosen.resize(n * k);
    m.gates.resize(n * k);
    ops_.top_k_gating(m.probs.data(), n, e, k, m.chosen.data(), m.gates.data());
    m.slots.resize(n * k);
    m.counts.resize(e);
    const size_t capacity = kc::expert_capacity(c_.capacity_factor, n, e, k);
    s.dropped += ops_.assign_capacity(m.chosen.data(), n, e, k, capacity, m.slots.data(),
                                     m.counts.data());
    m.offsets.resize(e + 1);
    m.row_of.resize(n * k);
    m.token_of.resize(n * k);
    m.rows = ops_.build_permutation(m.chosen.data(), m.slots.data(), m.counts.data(), n, e, k,
                                   m.offsets.data(), m.row_of.data(), m.token_of.data());
    m.host_counts.resize(e);
    m.host_offsets.resize(e + 1);
    ops_.download(m.host_counts.data(), m.counts, e);
    ops_.download(m.host_offsets.data(), m.offsets, e + 1);
    for (size_t i = 0; i < e; ++i)
      s.expert_load[l * e + i] = static_cast<size_t>(m.host_counts[i]);
    m.xp.resize(m.rows * dm);
    ops_.permute_tokens(m.x_mid.data(), m.token_of.data(), m.rows, dm, m.xp.data());
  }

  // Each expert's FFN over its contiguous block of permuted rows.
  void experts_forward(size_t l) {
    if constexpr (Ops::host && std::is_same_v<T, float>)
      if (ex_)
        return experts_forward_parallel(l);
    layer_cache<T, Ops>& m = caches_[l];
    const size_t dm = d(), h = c_.expert_ffn;
    m.e_pre.resize(m.rows * h);
    m.e_act.resize(m.rows * h);
    m.e_out.resize(m.rows * dm);
    for (size_t e = 0; e < c_.experts; ++e) {
      const size_t first = static_cast<size_t>(m.host_offsets[e]);
      const size_t cnt = static_cast<size_t>(m.host_counts[e]);
      fetch(at_.layers[l].expert_units[e]);
      expert_rows_forward(at_.layers[l].experts[e], m.xp.data() + first * dm,
                          m.e_pre.data() + first * h, m.e_act.data() + first * h,
                          m.e_out.data() + first * dm, cnt);
      release(at_.layers[l].expert_units[e]);
    }
  }

  // One expert's FFN over `cnt` rows: in -> pre -> act -> out.
  void expert_rows_forward(const expert_at& x, const T* in, T* pre, T* act, T* out, size_t cnt) {
    const size_t dm = d(), h = c_.expert_ffn;
    linear(ops_, in, W(x.w1), W(x.b1), cnt, dm, h, pre);
    round(pre, cnt * h);
    ops_.gelu_forward(pre, act, cnt * h);
    round(act, cnt * h);
    linear(ops_, act, W(x.w2), W(x.b2), cnt, h, dm, out);
    round(out, cnt * dm);
  }

  // Rows of source-major blocks to expert-major (or back, `back`).
  static void reorder(const layer_cache<T, Ops>& m, const T* in, T* out, size_t width, bool back) {
    for (auto& b : m.blocks) {
      const T* src = in + (back ? b.to : b.from) * width;
      T* dst = out + (back ? b.from : b.to) * width;
      std::copy(src, src + b.rows * width, dst);
    }
  }

  // Rows of source `source` for one expert with `hosts` replicas: the i-th
  // host's share [first, first + count) of the source's `rows`. Split
  // evenly over the hosts; per source (exact mode) all go to host
  // source % hosts, so that each source's rows meet in one product.
  std::pair<size_t, size_t> share(int64_t rows, size_t hosts, size_t i, size_t source) const {
    const auto r = static_cast<size_t>(std::max<int64_t>(0, rows));
    if (ex_->per_source())
      return {0, i == source % hosts ? r : 0};
    const size_t first = r * i / hosts, last = r * (i + 1) / hosts;
    return {first, last - first};
  }

  // Packs rows of `in` (expert-major, as xp) into m.xs in send order, or
  // (`back`) unpacks m.xs into `out`.
  static void pack(layer_cache<T, Ops>& m, const T* in, T* out, size_t width, bool back) {
    size_t at = 0;
    for (auto& p : m.pieces) {
      if (back)
        std::copy(m.xs.data() + at * width, m.xs.data() + (at + p.rows) * width,
                  out + p.row * width);
      else
        std::copy(in + p.row * width, in + (p.row + p.rows) * width, m.xs.data() + at * width);
      at += p.rows;
    }
  }

  // Where this micro-batch's rows of layer l go: the group agrees where
  // each expert runs (expert_exchange::place, from every rank's counts);
  // this rank's rows go to their experts' hosts (m.pieces, m.send) and
  // its hosted experts receive every source's rows (m.blocks, m.recv,
  // expert-major offsets m.mine_first / m.mine_rows).
  void route_to_hosts(size_t l) {
    layer_cache<T, Ops>& m = caches_[l];
    const size_t dm = d(), S = ex_->ranks(), me = ex_->rank(), E = c_.experts;
    // Every rank's rows per expert: all[s * E + e].
    std::vector<int64_t> out_counts(S * E), all(S * E);
    for (size_t j = 0; j < S; ++j)
      for (size_t e = 0; e < E; ++e)
        out_counts[j * E + e] = m.host_counts[e];
    ex_->exchange_counts(out_counts.data(), all.data(), E);
    std::vector<std::vector<uint32_t>> hosts;
    ex_->place(l, all.data(), E, hosts);
    CMESH_CHECK_EQ(hosts.size(), E);
    auto host_slot = [&](size_t e, size_t j) -> long {
      auto it = std::find(hosts[e].begin(), hosts[e].end(), static_cast<uint32_t>(j));
      return it == hosts[e].end() ? -1 : static_cast<long>(it - hosts[e].begin());
    };
    // What goes where: by host, then by expert.
    m.send.assign(S, 0);
    m.pieces.clear();
    for (size_t j = 0; j < S; ++j)
      for (size_t e = 0; e < E; ++e)
        if (long i = host_slot(e, j); i >= 0) {
          auto [first, rows] = share(m.host_counts[e], hosts[e].size(), static_cast<size_t>(i), me);
          m.pieces.push_back({static_cast<size_t>(m.host_offsets[e]) + first, rows});
          m.send[j] += rows * dm;
        }
    // What arrives: from each source, its rows of my experts, by expert.
    m.hosted.clear();
    m.host_index.assign(E, -1);
    for (size_t e = 0; e < E; ++e)
      if (host_slot(e, me) >= 0) {
        m.host_index[e] = static_cast<int>(m.hosted.size());
        m.hosted.push_back(e);
      }
    const size_t mine = m.hosted.size();
    m.recv.assign(S, 0);
    m.blocks.clear();
    m.mine_first.assign(mine, 0);
    m.mine_rows.assign(mine, 0);
    size_t from = 0;
    for (size_t s = 0; s < S; ++s)
      for (size_t i = 0; i < mine; ++i) {
        const size_t e = m.hosted[i];
        const size_t rows = share(all[s * E + e], hosts[e].size(),
                                  static_cast<size_t>(host_slot(e, me)), s).second;
        m.blocks.push_back({from, 0, rows});
        m.mine_rows[i] += rows;
        m.recv[s] += rows * dm;
        from += rows;
      }
    m.erows = from;
    for (size_t i = 1; i < mine; ++i)
      m.mine_first[i] = m.mine_first[i - 1] + m.mine_rows[i - 1];
    std::vector<size_t> at = m.mine_first;
    for (size_t s = 0; s < S; ++s)
      for (size_t i = 0; i < mine; ++i) {
        auto& b = m.blocks[s * mine + i];
        b.to = at[i];
        at[i] += b.rows;
      }
  }

  // The row ranges (expert-major) hosted expert i computes as one product
  // each: all its rows at once, or (per source) each source's on their own.
  template <class F>
  void for_each_product(const layer_cache<T, Ops>& m, size_t i, F&& f) const {
    if (!ex_->per_source())
      return f(size_t{0}, m.mine_first[i], m.mine_rows[i]);
    const size_t mine = m.hosted.size();
    for (size_t s = 0; s < ex_->ranks(); ++s)
      if (const auto& b = m.blocks[s * mine + i]; b.rows > 0)
        f(s, b.to, b.rows);
  }

  // Expert parallel: this rank's rows go to their experts' hosts
  // (route_to_hosts), the hosts run their experts over the rows of every
  // rank and send the outputs back.
  void experts_forward_parallel(size_t l) {
    layer_cache<T, Ops>& m = caches_[l];
    const size_t dm = d(), h = c_.expert_ffn, E = c_.experts;
    route_to_hosts(l);
    m.xs.resize(m.rows * dm);
    pack(m, m.xp.data(), nullptr, dm, false);
    m.xr.resize(m.erows * dm);
    ex_->exchange(m.xs.data(), m.send, m.xr.data(), m.recv);
    m.xe.resize(m.erows * dm);
    reorder(m, m.xr.data(), m.xe.data(), dm, false);
    m.ee_pre.resize(m.erows * h);
    m.ee_act.resize(m.erows * h);
    m.ye.resize(m.erows * dm);
    // Streamed weights: every rank fetches every expert, in order (the
    // fetches are collective), and computes those it hosts.
    for (size_t e = 0; e < E; ++e) {
      fetch(at_.layers[l].expert_units[e]);
      if (m.host_index[e] >= 0) {
        for_each_product(m, static_cast<size_t>(m.host_index[e]),
                         [&](size_t, size_t first, size_t cnt) {
          expert_rows_forward(at_.layers[l].experts[e], m.xe.data() + first * dm,
                              m.ee_pre.data() + first * h, m.ee_act.data() + first * h,
                              m.ye.data() + first * dm, cnt);
        });
      }
      release(at_.layers[l].expert_units[e]);
    }
    reorder(m, m.ye.data(), m.xr.data(), dm, true); // outputs, source-major
    ex_->exchange(m.xr.data(), m.recv, m.xs.data(), m.send);
    m.e_out.resize(m.rows * dm);
    pack(m, nullptr, m.e_out.data(), dm, true);
  }

  // The backward of experts_forward_parallel: de_out_ (this rank's permuted
  // rows) to the hosts, their experts' gradients there, dxp_ back. A
  // replicated expert's weight gradient is split over its hosts: the
  // group's gradient reduction adds the parts. Per source, the gradient of
  // another rank's rows goes to expert_exchange::piece instead.
  void experts_backward_parallel(size_t l, T* g) {
    layer_cache<T, Ops>& m = caches_[l];
    const size_t dm = d(), h = c_.expert_ffn, me = ex_->rank();
    pack(m, de_out_.data(), nullptr, dm, false);
    ex_->exchange(m.xs.data(), m.send, m.xr.data(), m.recv);
    reorder(m, m.xr.data(), m.ye.data(), dm, false); // d(outputs), expert-major
    dact_.resize(m.erows * h);
    dxe_.resize(m.erows * dm);
    for (size_t e = 0; e < c_.experts; ++e) {
      const unit u = at_.layers[l].expert_units[e];
      fetch(u);
      accumulate(u);
      if (m.host_index[e] >= 0) {
        const expert_at& x = at_.layers[l].experts[e];
        for_each_product(m, static_cast<size_t>(m.host_index[e]),
                         [&](size_t source, size_t first, size_t cnt) {
          // Another source's weight gradient: its own zeroed buffer.
          const bool own = !ex_->per_source() || source == me;
          const size_t base = at_.tensors[u.first].offset;
          if (!own)
            piece_.assign(unit_size(u), T(0));
          auto grad = [&](size_t off) { return own ? G(g, off) : piece_.data() + (off - base); };
          T* da = dact_.data() + first * h;
          linear_backward(ops_, m.ee_act.data() + first * h, m.ye.data() + first * dm, W(x.w2),
                          cnt, h, dm, grad(x.w2), grad(x.b2), da, T(0));
          ops_.gelu_backward(m.ee_pre.data() + first * h, da, da, cnt * h);
          linear_backward(ops_, m.xe.data() + first * dm, da, W(x.w1), cnt, dm, h, grad(x.w1),
                          grad(x.b1), dxe_.data() + first * dm, T(0));
          if (!own)
            ex_->piece(source, base, piece_.data(), piece_.size());
        });
      }
      reduced(u);
    }
    reorder(m, dxe_.data(), m.xr.data(), dm, true);
    ex_->exchange(m.xr.data(), m.recv, m.xs.data(), m.send);
    dxp_.resize(m.rows * dm);
    pack(m, nullptr, dxp_.data(), dm, true);
  }

  size_t unit_size(unit u) const {
    return at_.tensors[u.last - 1].offset + at_.tensors[u.last - 1].size
           - at_.tensors[u.first].offset;
  }

  void backward(T* g, T loss_scale) {
    const size_t n = n_, dm = d(), cw = c_.context * dm;
    dlogits_.resize(n * vocab);
    ops_.softmax_cross_entropy_backward(logits_.data(), target_.data(), n, vocab, loss_scale,
                                       dlogits_.data());
    dx_.resize(n * dm);
    accumulate(at_.out);
    linear_backward(ops_, x_.data(), dlogits_.data(), W(at_.out_w), n, dm, vocab, G(g, at_.out_w),
                    G(g, at_.out_b), dx_.data(), T(0));
    reduced(at_.out);
    for (size_t l = c_.layers; l-- > 0;)
      layer_backward(l, g, loss_scale);
    // x = embed[tok] + gelu(mix(ctx)).
    const saved_set top = saved_top();
    unstash(top, top_);
    ops_.gelu_backward(mix_pre_.data(), dx_.data(), tmp_.data(), n * dm);
    dctx_.resize(n * cw);
    fetch(at_.pre);
    accumulate(at_.pre);
    linear_backward(ops_, ctx_.data(), tmp_.data(), W(at_.mix_w), n, cw, dm, G(g, at_.mix_w),
                    G(g, at_.mix_b), dctx_.data(), T(0));
    ops_.scatter_add_rows(dx_.data(), tok_.data(), n, dm, G(g, at_.embed));
    ops_.scatter_add_rows(dctx_.data(), ctx_idx_.data(), n * c_.context, dm, G(g, at_.embed));
    reduced(at_.pre);
    swap_pool(top);
  }

  // On entry dx_ is d(loss)/d(layer output); on exit d(loss)/d(layer input).
  void layer_backward(size_t l, T* g, T loss_scale) {
    layer_cache<T, Ops>& m = caches_[l];
    const saved_set kept = saved(m);
    unstash(kept, m.packed);
    moe_backward(l, g, loss_scale);
    const layer_at& at = at_.layers[l];
    const size_t n = n_, dm = d(), f = c_.ffn;
    dact_.resize(n * f);
    fetch(at.ffn);
    accumulate(at.ffn);
    linear_backward(ops_, m.ffn_act.data(), dx_.data(), W(at.w2), n, f, dm, G(g, at.w2), G(g, at.b2),
                    dact_.data(), T(0));
    ops_.gelu_backward(m.ffn_pre.data(), dact_.data(), dact_.data(), n * f);
    linear_backward(ops_, m.x_in.data(), dact_.data(), W(at.w1), n, dm, f, G(g, at.w1), G(g, at.b1),
                    dx_.data(), T(1));
    reduced(at.ffn);
    swap_pool(kept);
  }

  // x_out = x_mid + combine(experts(permute(x_mid)), gates(router(x_mid))):
  // turns dx_ from d/d(x_out) into d/d(x_mid).
  void moe_backward(size_t l, T* g, T loss_scale) {
    layer_cache<T, Ops>& m = caches_[l];
    const size_t n = n_, dm = d(), e = c_.experts, k = c_.top_k, h = c_.expert_ffn;
    de_out_.resize(m.rows * dm);
    dgates_.resize(n * k);
    ops_.unpermute_tokens_backward(dx_.data(), m.e_out.data(), m.row_of.data(), m.gates.data(), n,
                                  k, dm, de_out_.data(), dgates_.data());
    if constexpr (Ops::host && std::is_same_v<T, float>) {
      if (ex_) {
        experts_backward_parallel(l, g);
        ops_.permute_tokens_backward(dxp_.data(), m.token_of.data(), m.rows, dm, dx_.data());
        router_backward(l, g, loss_scale);
        return;
      }
    }
    dxp_.resize(m.rows * dm);
    dact_.resize(m.rows * h);
    for (size_t i = 0; i < e; ++i) {
      const expert_at& x = at_.layers[l].experts[i];
      const size_t first = static_cast<size_t>(m.host_offsets[i]);
      const size_t cnt = static_cast<size_t>(m.host_counts[i]);
      T* da = dact_.data() + first * h;
      fetch(at_.layers[l].expert_units[i]);
      accumulate(at_.layers[l].expert_units[i]);
      linear_backward(ops_, m.e_act.data() + first * h, de_out_.data() + first * dm, W(x.w2), cnt, h,
                      dm, G(g, x.w2), G(g, x.b2), da, T(0));
      ops_.gelu_backward(m.e_pre.data() + first * h, da, da, cnt * h);
      linear_backward(ops_, m.xp.data() + first * dm, da, W(x.w1), cnt, dm, h, G(g, x.w1), G(g, x.b1),
                      dxp_.data() + first * dm, T(0));
      reduced(at_.layers[l].expert_units[i]);
    }
    ops_.permute_tokens_backward(dxp_.data(), m.token_of.data(), m.rows, dm, dx_.data());
    router_backward(l, g, loss_scale);
  }

  // Gates and the aux loss back to the router weights and x_mid.
  void router_backward(size_t l, T* g, T loss_scale) {
    layer_cache<T, Ops>& m = caches_[l];
    const size_t n = n_, dm = d(), e = c_.experts, k = c_.top_k;
    dprobs_.assign(n * e, T(0));
    ops_.top_k_gating_backward(m.probs.data(), m.chosen.data(), m.gates.data(), dgates_.data(), n,
                              e, k, dprobs_.data());
    const T aux_weight = static_cast<T>(c_.aux_loss_weight) * loss_scale;
    ops_.load_balancing_backward(m.chosen.data(), n, e, k, aux_weight, dprobs_.data());
    ops_.softmax_rows_backward(m.probs.data(), dprobs_.data(), dprobs_.data(), n, e);
    const size_t router = at_.layers[l].router;
    fetch(at_.layers[l].route);
    accumulate(at_.layers[l].route);
    ops_.gemm(true, false, dm, e, n, T(1), m.x_mid.data(), dm, dprobs_.data(), e, T(1), G(g, router),
             e);
    ops_.gemm(false, true, n, dm, e, T(1), dprobs_.data(), e, W(router), e, T(1), dx_.data(), dm);
    reduced(at_.layers[l].route);
  }

  void record_routing(std::vector<int32_t>& out) const {
    out.clear();
    for (const auto& m : caches_)
      for (size_t a = 0; a < m.chosen.size(); ++a)
        out.push_back(m.slots[a] >= 0 ? m.chosen[a] : -1 - m.chosen[a]);
  }

  moe_config c_;
  layout at_;
  expert_exchange* ex_ = nullptr;
  std::vector<T> piece_; // per source: another rank's expert gradient
  parameter_stream* ps_ = nullptr;
  gradient_listener* gl_ = nullptr;
  unit live_;
  size_t live_begin_ = 0, live_end_ = 0;
  const T* live_w_ = nullptr; // float only: the stream is float
  T* live_g_ = nullptr;
  const T* p_ = nullptr;
  size_t n_ = 0;
  Ops ops_;
  std::vector<int32_t> host_tok_, host_target_, host_ctx_;
  buf<int32_t> tok_, target_, ctx_idx_;
  buf<T> x_, ctx_, mix_pre_, logits_, tmp_;
  std::vector<layer_cache<T, Ops>> caches_;
  bool half_ = false; // bf16 activations
  bool keep_ = false; // a backward pass follows this forward pass
  std::vector<buf<T>> pool_;        // bf16: the float buffers of the layer in hand
  packed_activations<Ops> top_;     // bf16: ctx_ and mix_pre_
  buf<T> dlogits_, dx_, dctx_, dact_, de_out_, dgates_, dxp_, dprobs_;
  std::vector<T> dxe_; // expert parallel (host only)
};

// ---------------------------------------------------------------------------
// The network on a device: its activations in device buffers, its kernels
// the device's. emulated_ops runs that code path on the CPU with buffers
// that allow no host access at all (a use would not compile) and forget
// their contents on every resize, so the device path is tested where there
// is no GPU; cuda_ops runs it on a GPU.

/// Device-like memory on the host: no element access, contents garbage
/// (NaN bytes) after every resize.
template <class U>
class emulated_buffer {
public:
  U* data() { return v_.data(); }
  const U* data() const { return v_.data(); }
  size_t size() const { return v_.size(); }
  void resize(size_t n) {
    v_.resize(n);
    std::memset(static_cast<void*>(v_.data()), 0xff, n * sizeof(U));
  }
  void assign(size_t n, U zero) {
    CMESH_CHECK(zero == U{});
    v_.assign(n, U{});
  }

private:
  std::vector<U> v_;
};

struct emulated_ops : host_ops<float> {
  static constexpr bool host = false;
  template <class U>
  using buffer = emulated_buffer<U>;
  template <class U>
  static void upload(buffer<U>& out, const U* from, size_t n) {
    out.resize(n);
    std::copy_n(from, n, out.data());
  }
  /// Into [offset, offset + n) of a buffer already that long or longer.
  template <class U>
  static void upload_range(buffer<U>& out, size_t offset, const U* from, size_t n) {
    CMESH_CHECK_LE(offset + n, out.size());
    std::copy_n(from, n, out.data() + offset);
  }
  template <class U>
  static void download(U* out, const buffer<U>& from, size_t n) {
    download_range(out, from, 0, n);
  }
  template <class U>
  static void download_range(U* out, const buffer<U>& from, size_t offset, size_t n) {
    CMESH_CHECK_LE(offset + n, from.size());
    std::copy_n(from.data() + offset, n, out);
  }
  static void synchronize() {}
};

/// The model over a device network: parameters() and gradients() are host
/// buffers (the runtime shards and updates them there); each
/// forward_backward uploads the weights, runs on the device and adds to the
/// device's gradient. It then downloads it, so gradients() holds the sum
/// since the last zero_gradients() when it returns, unless the gradient is
/// kept on the device (keep_gradients_on_device): the runtime then puts the
/// weights there itself (its shard uploaded, the rest gathered on the
/// device), sums the gradient there and downloads its shard of the sum.
/// Experts are not split over ranks and weights are not streamed on a
/// device yet.
template <class Ops>
class device_model final : public model {
public:
  device_model(const moe_config& c, Ops ops)
      : c_(c), net_(c, std::move(ops)), params_(net_.at().total), grads_(net_.at().total) {
    moe_lm_init(c, params_.span());
    d_grads_.assign(net_.at().total, 0.0f);
  }

  const std::vector<tensor_info>& tensors() const override { return net_.at().tensors; }
  std::span<float> parameters() override { return params_.span(); }
  std::span<float> gradients() override { return grads_.span(); }
  void zero_gradients() override {
    if (!kept_)
      std::fill(grads_.begin(), grads_.end(), 0.0f);
    d_grads_.assign(net_.at().total, 0.0f);
  }
  step_stats forward_backward(const batch& b, float loss_scale) override {
    if (!kept_)
      Ops::upload(d_params_, params_.data(), params_.size());
    auto s = net_.run(d_params_.data(), d_grads_.data(), b, loss_scale, nullptr);
    if (!kept_)
      Ops::download(grads_.data(), d_grads_, grads_.size());
    return s;
  }
  bool keep_gradients_on_device(bool on) override {
    if (on && !kept_) // the device's weights start as parameters()
      Ops::upload(d_params_, params_.data(), params_.size());
    kept_ = on;
    return true;
  }
  float* device_parameters() override {
    if (!kept_)
      return nullptr;
    Ops::synchronize();
    return d_params_.data();
  }
  void upload_parameters(size_t offset, size_t count) override {
    CMESH_CHECK(kept_);
    CMESH_CHECK_LE(offset + count, params_.size());
    Ops::upload_range(d_params_, offset, params_.data() + offset, count);
  }
  float* device_gradients() override {
    if (!kept_)
      return nullptr;
    Ops::synchronize(); // the network's kernels, before another stream reads it
    return d_grads_.data();
  }
  void download_gradients(size_t offset, size_t count) override {
    CMESH_CHECK_LE(offset + count, grads_.size());
    Ops::download_range(grads_.data() + offset, d_grads_, offset, count);
  }
  // Kept on the device, the runtime puts the weights there again before
  // its next micro-batches (as every step does).
  step_stats evaluate(const batch& b) override {
    Ops::upload(d_params_, params_.data(), params_.size());
    return net_.run(d_params_.data(), nullptr, b, 1.0f, nullptr);
  }
  size_t experts() const override { return c_.experts; }
  size_t moe_layers() const override { return c_.layers; }
  size_t saved_activation_bytes() const override { return net_.saved_activation_bytes(); }

private:
  moe_config c_;
  network<float, Ops> net_;
  page_array params_, grads_;
  typename Ops::template buffer<float> d_params_, d_grads_;
  bool kept_ = false; // the gradient stays on the device (keep_gradients_on_device)
};

#ifdef CMESH_HAVE_CUDA
namespace kcu = kernels::cuda;

/// Device memory (cudaMalloc) with the buffer interface the network uses:
/// resize keeps nothing, assign only zeroes. Everything runs on the legacy
/// default stream, so the network's kernels and these copies are ordered.
template <class U>
class cuda_buffer {
public:
  cuda_buffer() = default;
  ~cuda_buffer() {
    if (p_)
      cudaFree(p_);
  }
  cuda_buffer(const cuda_buffer& o) { *this = o; }
  cuda_buffer(cuda_buffer&& o) noexcept : p_(o.p_), n_(o.n_), cap_(o.cap_) {
    o.p_ = nullptr;
    o.n_ = o.cap_ = 0;
  }
  cuda_buffer& operator=(cuda_buffer&& o) noexcept {
    if (this != &o) {
      if (p_)
        cudaFree(p_);
      p_ = o.p_;
      n_ = o.n_;
      cap_ = o.cap_;
      o.p_ = nullptr;
      o.n_ = o.cap_ = 0;
    }
    return *this;
  }
  cuda_buffer& operator=(const cuda_buffer& o) {
    if (this != &o) {
      resize(o.n_);
      if (n_)
        CMESH_CUDA_CHECK(cudaMemcpyAsync(p_, o.p_, n_ * sizeof(U), cudaMemcpyDeviceToDevice, 0));
    }
    return *this;
  }
  U* data() { return p_; }
  const U* data() const { return p_; }
  size_t size() const { return n_; }
  void resize(size_t n) {
    if (n > cap_) {
      if (p_)
        CMESH_CUDA_CHECK(cudaFree(p_));
      p_ = nullptr;
      void* q = nullptr;
      CMESH_CUDA_CHECK(cudaMalloc(&q, n * sizeof(U)));
      p_ = static_cast<U*>(q);
      cap_ = n;
    }
    n_ = n;
  }
  void assign(size_t n, U zero) {
    CMESH_CHECK(zero == U{});
    resize(n);
    if (n)
      CMESH_CUDA_CHECK(cudaMemsetAsync(p_, 0, n * sizeof(U), 0));
  }

private:
  U* p_ = nullptr;
  size_t n_ = 0, cap_ = 0;
};

/// The network's kernels on the current GPU (kernels/cuda/ops.hpp), with
/// the CPU versions' signatures: a kernel whose CPU version returns a value
/// (a loss, a count) waits for it.
class cuda_ops {
public:
  static constexpr bool host = false;
  template <class U>
  using buffer = cuda_buffer<U>;

  cuda_ops() : blas_(std::make_shared<kcu::cublas_handle>()) {}

  kernels::gemm_math products = kernels::gemm_math::fp32; // model.products
  void gemm(bool ta, bool tb, size_t m, size_t n, size_t k, float alpha, const float* a,
            size_t lda, const float* b, size_t ldb, float beta, float* c, size_t ldc) {
    kcu::gemm(*blas_, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, stream_, products);
  }
  void add_row_bias(float* y, const float* bias, size_t rows, size_t cols) {
    kcu::add_row_bias(y, bias, rows, cols, stream_);
  }
  void add_column_sums(float* sums, const float* x, size_t rows, size_t cols) {
    kcu::add_column_sums(sums, x, rows, cols, stream_);
  }
  void gelu_forward(const float* x, float* y, size_t n) { kcu::gelu_forward(x, y, n, stream_); }
  void gelu_backward(const float* x, const float* dy, float* dx, size_t n) {
    kcu::gelu_backward(x, dy, dx, n, stream_);
  }
  void gather_rows(const float* table, const int32_t* index, size_t count, size_t width,
                   float* out) {
    kcu::gather_rows(table, index, count, width, out, stream_);
  }
  void scatter_add_rows(const float* rows, const int32_t* index, size_t count, size_t width,
                        float* table) {
    kcu::scatter_add_rows(rows, index, count, width, table, stream_);
  }
  double softmax_cross_entropy_forward(const float* logits, const int32_t* targets, size_t rows,
                                       size_t vocab) {
    row_loss_.resize(std::max<size_t>(rows, 1));
    scalar_.resize(1);
    kcu::softmax_cross_entropy_forward(logits, targets, rows, vocab, row_loss_.data(),
                                       scalar_.data(), stream_);
    return fetch(scalar_);
  }
  void softmax_cross_entropy_backward(const float* logits, const int32_t* targets, size_t rows,
                                      size_t vocab, float dloss, float* dlogits) {
    kcu::softmax_cross_entropy_backward(logits, targets, rows, vocab, dloss, dlogits, stream_);
  }
  void softmax_rows(const float* logits, float* probs, size_t rows, size_t cols) {
    kcu::softmax_rows(logits, probs, rows, cols, stream_);
  }
  void softmax_rows_backward(const float* probs, const float* dprobs, float* dlogits,
                             size_t rows, size_t cols) {
    kcu::softmax_rows_backward(probs, dprobs, dlogits, rows, cols, stream_);
  }
  void top_k_gating(const float* probs, size_t tokens, size_t experts, size_t k, int32_t* chosen,
                    float* gates) {
    kcu::top_k_gating(probs, tokens, experts, k, chosen, gates, stream_);
  }
  void top_k_gating_backward(const float* probs, const int32_t* chosen, const float* gates,
                             const float* dgates, size_t tokens, size_t experts, size_t k,
                             float* dprobs) {
    kcu::top_k_gating_backward(probs, chosen, gates, dgates, tokens, experts, k, dprobs,
                               stream_);
  }
  size_t assign_capacity(const int32_t* chosen, size_t tokens, size_t experts, size_t k,
                         size_t capacity, int32_t* slots, int32_t* counts) {
    count_.resize(1);
    kcu::assign_capacity(chosen, tokens, experts, k, capacity, slots, counts, count_.data(),
                         stream_);
    return static_cast<size_t>(std::max<int32_t>(0, fetch(count_)));
  }
  size_t build_permutation(const int32_t* chosen, const int32_t* slots, const int32_t* counts,
                           size_t tokens, size_t experts, size_t k, int32_t* offsets,
                           int32_t* row_of, int32_t* token_of) {
    kcu::build_permutation(chosen, slots, counts, tokens, experts, k, offsets, row_of, token_of,
                           stream_);
    int32_t rows = 0;
    CMESH_CUDA_CHECK(cudaMemcpyAsync(&rows, offsets + experts, sizeof(rows),
                                     cudaMemcpyDeviceToHost, stream_));
    CMESH_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return static_cast<size_t>(std::max<int32_t>(0, rows));
  }
  void permute_tokens(const float* x, const int32_t* token_of, size_t rows, size_t width,
                      float* out) {
    kcu::permute_tokens(x, token_of, rows, width, out, stream_);
  }
  void permute_tokens_backward(const float* dout, const int32_t* token_of, size_t rows,
                               size_t width, float* dx) {
    kcu::permute_tokens_backward(dout, token_of, rows, width, dx, stream_);
  }
  void unpermute_tokens(const float* expert_out, const int32_t* row_of, const float* gates,
                        size_t tokens, size_t k, size_t width, float* y) {
    kcu::unpermute_tokens(expert_out, row_of, gates, tokens, k, width, y, stream_);
  }
  void unpermute_tokens_backward(const float* dy, const float* expert_out, const int32_t* row_of,
                                 const float* gates, size_t tokens, size_t k, size_t width,
                                 float* dexpert_out, float* dgates) {
    kcu::unpermute_tokens_backward(dy, expert_out, row_of, gates, tokens, k, width, dexpert_out,
                                   dgates, stream_);
  }
  double load_balancing_loss(const float* probs, const int32_t* chosen, size_t tokens,
                             size_t experts, size_t k) {
    scalar_.resize(1);
    kcu::load_balancing_loss(probs, chosen, tokens, experts, k, scalar_.data(), stream_);
    return fetch(scalar_);
  }
  void load_balancing_backward(const int32_t* chosen, size_t tokens, size_t experts, size_t k,
                               float weight, float* dprobs) {
    kcu::load_balancing_backward(chosen, tokens, experts, k, weight, dprobs, stream_);
  }
  /// y += x: a bias of one row.
  void add(float* y, const float* x, size_t n) { kcu::add_row_bias(y, x, 1, n, stream_); }
  void round_to_bf16(float* x, size_t n) { kcu::round_to_bf16(x, n, stream_); }
  void float_to_bf16(const float* x, uint16_t* y, size_t n) {
    kcu::float_to_bf16(x, y, n, stream_);
  }
  void bf16_to_float(const uint16_t* x, float* y, size_t n) {
    kcu::bf16_to_float(x, y, n, stream_);
  }
  template <class U>
  static void upload(buffer<U>& out, const U* from, size_t n) {
    out.resize(n);
    if (n)
      CMESH_CUDA_CHECK(cudaMemcpy(out.data(), from, n * sizeof(U), cudaMemcpyHostToDevice));
  }
  /// Into [offset, offset + n) of a buffer already that long or longer.
  template <class U>
  static void upload_range(buffer<U>& out, size_t offset, const U* from, size_t n) {
    CMESH_CHECK_LE(offset + n, out.size());
    if (n)
      CMESH_CUDA_CHECK(
        cudaMemcpy(out.data() + offset, from, n * sizeof(U), cudaMemcpyHostToDevice));
  }
  template <class U>
  static void download(U* out, const buffer<U>& from, size_t n) {
    download_range(out, from, 0, n);
  }
  template <class U>
  static void download_range(U* out, const buffer<U>& from, size_t offset, size_t n) {
    CMESH_CHECK_LE(offset + n, from.size());
    if (n)
      CMESH_CUDA_CHECK(
        cudaMemcpy(out, from.data() + offset, n * sizeof(U), cudaMemcpyDeviceToHost));
  }
  /// Every kernel and copy of this device finished (the NCCL backend runs
  /// on a stream of its own, which the legacy default stream does not order).
  static void synchronize() { CMESH_CUDA_CHECK(cudaDeviceSynchronize()); }

private:
  template <class U>
  U fetch(const buffer<U>& one) {
    U v{};
    CMESH_CUDA_CHECK(cudaMemcpyAsync(&v, one.data(), sizeof(U), cudaMemcpyDeviceToHost, stream_));
    CMESH_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return v;
  }

  std::shared_ptr<kcu::cublas_handle> blas_;
  cudaStream_t stream_ = nullptr; // the legacy default stream
  buffer<double> row_loss_, scalar_;
  buffer<int32_t> count_;
};
#endif

// ---------------------------------------------------------------------------
// The model interface over the float network.

class moe_lm final : public model {
public:
  explicit moe_lm(const moe_config& c)
      : c_(c), net_(c), params_(net_.at().total), grads_(net_.at().total) {
    moe_lm_init(c, params_.span());
  }

  const std::vector<tensor_info>& tensors() const override { return net_.at().tensors; }
  std::span<float> parameters() override { return params_.span(); }
  std::span<float> gradients() override { return grads_.span(); }
  // Streamed: the gradients are the stream's, handed back unit by unit.
  void zero_gradients() override {
    if (net_.streamed())
      return;
    if (held_.empty())
      std::fill(grads_.begin(), grads_.end(), 0.0f);
    for (auto [a, b] : held_)
      std::fill(grads_.begin() + a, grads_.begin() + b, 0.0f);
  }

  bool hold_only(std::span<const std::pair<size_t, size_t>> ranges) override {
    if (net_.streamed() || ranges.empty())
      return false;
    held_.assign(ranges.begin(), ranges.end());
    size_t at = 0;
    for (auto [a, b] : held_) {
      if (a < at || b < a || b > params_.size())
        return false;
      discard_pages(params_.data() + at, a - at);
      discard_pages(grads_.data() + at, a - at);
      at = b;
    }
    discard_pages(params_.data() + at, params_.size() - at);
    discard_pages(grads_.data() + at, grads_.size() - at);
    return true;
  }

  step_stats forward_backward(const batch& b, float loss_scale) override {
    return net_.run(params_.data(), grads_.data(), b, loss_scale, nullptr);
  }
  step_stats evaluate(const batch& b) override {
    return net_.run(params_.data(), nullptr, b, 1.0f, nullptr);
  }

  size_t experts() const override { return c_.experts; }
  size_t moe_layers() const override { return c_.layers; }
  size_t saved_activation_bytes() const override { return net_.saved_activation_bytes(); }

  bool set_expert_exchange(expert_exchange* x) override {
    if (x && (x->ranks() == 0 || x->rank() >= x->ranks()))
      return false;
    net_.set_exchange(x);
    return true;
  }
  bool set_parameter_stream(parameter_stream* s) override {
    net_.set_stream(s);
    return true;
  }
  bool set_gradient_listener(gradient_listener* l) override {
    net_.set_listener(l);
    return true;
  }

private:
  moe_config c_;
  network<float> net_;
  // Untouched pages cost nothing: with streamed weights the runtime drops
  // the initial weights' pages, and the gradient's are never touched.
  page_array params_, grads_;
  std::vector<std::pair<size_t, size_t>> held_; // hold_only: the ranges in use
};

} // namespace

std::unique_ptr<model> make_moe_lm(const moe_config& c) { return std::make_unique<moe_lm>(c); }

expected<std::unique_ptr<model>> make_moe_lm_on(const moe_config& c, compute_device d,
                                                size_t ordinal) {
  switch (d) {
    case compute_device::cpu:
      return make_moe_lm(c);
    case compute_device::emulated:
      return std::unique_ptr<model>(std::make_unique<device_model<emulated_ops>>(c, emulated_ops{}));
    case compute_device::cuda:
      break;
  }
  const auto acc = kernels::query_accelerators();
  if (!acc.cuda_compiled)
    return make_error(errc::invalid_argument, "--device cuda: this build has no CUDA (" +
                                                kernels::describe(acc) + ")");
  if (acc.devices.empty())
    return make_error(errc::invalid_argument,
                      "--device cuda: no CUDA device: " + kernels::describe(acc));
#ifdef CMESH_HAVE_CUDA
  try {
    CMESH_CUDA_CHECK(cudaSetDevice(static_cast<int>(ordinal % acc.devices.size())));
    return std::unique_ptr<model>(std::make_unique<device_model<cuda_ops>>(c, cuda_ops{}));
  } catch (const std::exception& e) {
    return make_error(errc::invalid_argument, std::string("--device cuda: ") + e.what());
  }
#else
  (void)ordinal;
  return make_error(errc::invalid_argument, "--device cuda: this build has no CUDA");
#endif
}

std::vector<tensor_info> moe_lm_tensors(const moe_config& c) { return make_layout(c).tensors; }

size_t moe_lm_parameter_count(const moe_config& c) { return make_layout(c).total; }

void moe_lm_init(const moe_config& c, std::span<float> params) {
  const layout l = make_layout(c);
  CMESH_CHECK_EQ(params.size(), l.total);
  for (const tensor_info& t : l.tensors) {
    const uint64_t seed = splitmix64(c.init_seed ^ splitmix64(fnv1a(t.name)));
    fill_uniform(params.data() + t.offset, t.size, init_std(c, t), seed);
  }
}

step_stats moe_lm_forward_backward_f64(const moe_config& c, std::span<const double> params,
                                       std::span<double> grads, const batch& b,
                                       std::vector<int32_t>* routing) {
  network<double> net(c);
  CMESH_CHECK_EQ(params.size(), net.at().total);
  if (!grads.empty())
    CMESH_CHECK_EQ(grads.size(), net.at().total);
  return net.run(params.data(), grads.empty() ? nullptr : grads.data(), b, 1.0, routing);
}

} // namespace cmesh::model
