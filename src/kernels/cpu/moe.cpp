#include "kernels/moe.hpp"

#include "kernels/embedding.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

namespace cmesh::kernels::cpu {

namespace {

// The most probable expert not yet taken; strict '>' keeps the lower index
// on equal probabilities.
template <class T>
std::int32_t best_untaken(const T* p, std::size_t experts, const std::vector<char>& taken) {
  std::int32_t best = -1;
  for (std::size_t e = 0; e < experts; ++e) {
    if (taken[e])
      continue;
    if (best < 0 || p[e] > p[best])
      best = static_cast<std::int32_t>(e);
  }
  return best;
}

template <class T>
void top_k_t(const T* probs, std::size_t tokens, std::size_t experts, std::size_t k,
             std::int32_t* chosen, T* gates) {
  std::vector<char> taken(experts);
  for (std::size_t t = 0; t < tokens; ++t) {
    const T* p = probs + t * experts;
    std::fill(taken.begin(), taken.end(), 0);
    T sum = 0;
    for (std::size_t j = 0; j < k; ++j) {
      const std::int32_t e = best_untaken(p, experts, taken);
      taken[e] = 1;
      chosen[t * k + j] = e;
      sum += p[e];
    }
    for (std::size_t j = 0; j < k; ++j)
      gates[t * k + j] = p[chosen[t * k + j]] / sum;
  }
}

template <class T>
void top_k_backward_t(const T* probs, const std::int32_t* chosen, const T* gates,
                      const T* dgates, std::size_t tokens, std::size_t experts, std::size_t k,
                      T* dprobs) {
  for (std::size_t t = 0; t < tokens; ++t) {
    const std::int32_t* c = chosen + t * k;
    const T* g = gates + t * k;
    const T* dg = dgates + t * k;
    T sum = 0, dot = 0;
    for (std::size_t j = 0; j < k; ++j) {
      sum += probs[t * experts + c[j]];
      dot += g[j] * dg[j];
    }
    for (std::size_t j = 0; j < k; ++j)
      dprobs[t * experts + c[j]] += (dg[j] - dot) / sum;
  }
}

template <class T>
void unpermute_t(const T* expert_out, const std::int32_t* row_of, const T* gates,
                 std::size_t tokens, std::size_t k, std::size_t width, T* y) {
  for (std::size_t t = 0; t < tokens; ++t) {
    T* dst = y + t * width;
    for (std::size_t j = 0; j < k; ++j) {
      const std::int32_t row = row_of[t * k + j];
      if (row < 0)
        continue;
      const T g = gates[t * k + j];
      const T* src = expert_out + static_cast<std::size_t>(row) * width;
      for (std::size_t i = 0; i < width; ++i)
        dst[i] += g * src[i];
    }
  }
}

template <class T>
void unpermute_backward_t(const T* dy, const T* expert_out, const std::int32_t* row_of,
                          const T* gates, std::size_t tokens, std::size_t k, std::size_t width,
                          T* dexpert_out, T* dgates) {
  for (std::size_t t = 0; t < tokens; ++t) {
    const T* d = dy + t * width;
    for (std::size_t j = 0; j < k; ++j) {
      const std::size_t a = t * k + j;
      if (row_of[a] < 0) {
        dgates[a] = 0;
        continue;
      }
      const std::size_t row = static_cast<std::size_t>(row_of[a]);
      const T* out = expert_out + row * width;
      T* dout = dexpert_out + row * width;
      T dot = 0;
      for (std::size_t i = 0; i < width; ++i) {
        dot += d[i] * out[i];
        dout[i] = gates[a] * d[i];
      }
      dgates[a] = dot;
    }
  }
}

// Tokens whose first choice is each expert.
std::vector<std::size_t> top1_counts(const std::int32_t* chosen, std::size_t tokens,
                                     std::size_t experts, std::size_t k) {
  std::vector<std::size_t> n(experts);
  for (std::size_t t = 0; t < tokens; ++t)
    ++n[static_cast<std::size_t>(chosen[t * k])];
  return n;
}

template <class T>
double balance_loss_t(const T* probs, const std::int32_t* chosen, std::size_t tokens,
                      std::size_t experts, std::size_t k) {
  if (tokens == 0)
    return 0;
  const auto top1 = top1_counts(chosen, tokens, experts, k);
  double loss = 0;
  for (std::size_t e = 0; e < experts; ++e) {
    double p_sum = 0;
    for (std::size_t t = 0; t < tokens; ++t)
      p_sum += static_cast<double>(probs[t * experts + e]);
    const double n = static_cast<double>(tokens);
    loss += (static_cast<double>(top1[e]) / n) * (p_sum / n);
  }
  return static_cast<double>(experts) * loss;
}

template <class T>
void balance_backward_t(const std::int32_t* chosen, std::size_t tokens, std::size_t experts,
                        std::size_t k, T weight, T* dprobs) {
  if (tokens == 0)
    return;
  const auto top1 = top1_counts(chosen, tokens, experts, k);
  const double n = static_cast<double>(tokens);
  std::vector<T> d(experts);
  for (std::size_t e = 0; e < experts; ++e)
    d[e] = static_cast<T>(static_cast<double>(weight) * static_cast<double>(experts) *
                          (static_cast<double>(top1[e]) / n) / n);
  for (std::size_t t = 0; t < tokens; ++t)
    for (std::size_t e = 0; e < experts; ++e)
      dprobs[t * experts + e] += d[e];
}

} // namespace

void top_k_gating(const float* probs, std::size_t tokens, std::size_t experts, std::size_t k,
                  std::int32_t* chosen, float* gates) {
  top_k_t(probs, tokens, experts, k, chosen, gates);
}
void top_k_gating(const double* probs, std::size_t tokens, std::size_t experts, std::size_t k,
                  std::int32_t* chosen, double* gates) {
  top_k_t(probs, tokens, experts, k, chosen, gates);
}

void top_k_gating_backward(const float* probs, const std::int32_t* chosen, const float* gates,
                           const float* dgates, std::size_t tokens, std::size_t experts,
                           std::size_t k, float* dprobs) {
  top_k_backward_t(probs, chosen, gates, dgates, tokens, experts, k, dprobs);
}
void top_k_gating_backward(const double* probs, const std::int32_t* chosen, const double* gates,
                           const double* dgates, std::size_t tokens, std::size_t experts,
                           std::size_t k, double* dprobs) {
  top_k_backward_t(probs, chosen, gates, dgates, tokens, experts, k, dprobs);
}

std::size_t expert_capacity(double capacity_factor, std::size_t tokens, std::size_t experts,
                            std::size_t k) {
  if (experts == 0)
    return 0;
  const double want =
    capacity_factor * static_cast<double>(tokens * k) / static_cast<double>(experts);
  // A factor like 1.25 gives an exact product; shave the last bits so that a
  // product which ought to be an integer is not rounded up to the next one.
  return static_cast<std::size_t>(std::ceil(want * (1.0 - 1e-12)));
}

std::size_t assign_capacity(const std::int32_t* chosen, std::size_t tokens, std::size_t experts,
                            std::size_t k, std::size_t capacity, std::int32_t* slots,
                            std::int32_t* counts) {
  for (std::size_t e = 0; e < experts; ++e)
    counts[e] = 0;
  std::size_t dropped = 0;
  for (std::size_t a = 0; a < tokens * k; ++a) {
    std::int32_t& n = counts[chosen[a]];
    if (static_cast<std::size_t>(n) < capacity) {
      slots[a] = n++;
    } else {
      slots[a] = -1;
      ++dropped;
    }
  }
  return dropped;
}

std::size_t build_permutation(const std::int32_t* chosen, const std::int32_t* slots,
                              const std::int32_t* counts, std::size_t tokens, std::size_t experts,
                              std::size_t k, std::int32_t* offsets, std::int32_t* row_of,
                              std::int32_t* token_of) {
  offsets[0] = 0;
  for (std::size_t e = 0; e < experts; ++e)
    offsets[e + 1] = offsets[e] + counts[e];
  for (std::size_t a = 0; a < tokens * k; ++a) {
    if (slots[a] < 0) {
      row_of[a] = -1;
      continue;
    }
    const std::int32_t row = offsets[chosen[a]] + slots[a];
    row_of[a] = row;
    token_of[row] = static_cast<std::int32_t>(a / k);
  }
  return static_cast<std::size_t>(offsets[experts]);
}

void permute_tokens(const float* x, const std::int32_t* token_of, std::size_t rows,
                    std::size_t width, float* out) {
  gather_rows(x, token_of, rows, width, out);
}
void permute_tokens(const double* x, const std::int32_t* token_of, std::size_t rows,
                    std::size_t width, double* out) {
  gather_rows(x, token_of, rows, width, out);
}
void permute_tokens_backward(const float* dout, const std::int32_t* token_of, std::size_t rows,
                             std::size_t width, float* dx) {
  scatter_add_rows(dout, token_of, rows, width, dx);
}
void permute_tokens_backward(const double* dout, const std::int32_t* token_of, std::size_t rows,
                             std::size_t width, double* dx) {
  scatter_add_rows(dout, token_of, rows, width, dx);
}

void unpermute_tokens(const float* expert_out, const std::int32_t* row_of, const float* gates,
                      std::size_t tokens, std::size_t k, std::size_t width, float* y) {
  unpermute_t(expert_out, row_of, gates, tokens, k, width, y);
}
void unpermute_tokens(const double* expert_out, const std::int32_t* row_of, const double* gates,
                      std::size_t tokens, std::size_t k, std::size_t width, double* y) {
  unpermute_t(expert_out, row_of, gates, tokens, k, width, y);
}
void unpermute_tokens_backward(const float* dy, const float* expert_out,
                               const std::int32_t* row_of, const float* gates,
                               std::size_t tokens, std::size_t k, std::size_t width,
                               float* dexpert_out, float* dgates) {
  unpermute_backward_t(dy, expert_out, row_of, gates, tokens, k, width, dexpert_out, dgates);
}
void unpermute_tokens_backward(const double* dy, const double* expert_out,
                               const std::int32_t* row_of, const double* gates,
                               std::size_t tokens, std::size_t k, std::size_t width,
                               double* dexpert_out, double* dgates) {
  unpermute_backward_t(dy, expert_out, row_of, gates, tokens, k, width, dexpert_out, dgates);
}

double load_balancing_loss(const float* probs, const std::int32_t* chosen, std::size_t tokens,
                           std::size_t experts, std::size_t k) {
  return balance_loss_t(probs, chosen, tokens, experts, k);
}
double load_balancing_loss(const double* probs, const std::int32_t* chosen, std::size_t tokens,
                           std::size_t experts, std::size_t k) {
  return balance_loss_t(probs, chosen, tokens, experts, k);
}
void load_balancing_backward(const std::int32_t* chosen, std::size_t tokens, std::size_t experts,
                             std::size_t k, float weight, float* dprobs) {
  balance_backward_t(chosen, tokens, experts, k, weight, dprobs);
}
void load_balancing_backward(const std::int32_t* chosen, std::size_t tokens, std::size_t experts,
                             std::size_t k, double weight, double* dprobs) {
  balance_backward_t(chosen, tokens, experts, k, weight, dprobs);
}

} // namespace cmesh::kernels::cpu
