// Mixture-of-experts routing: top-k gating over router probabilities,
// expert capacity with dropped-assignment accounting, the Switch-style
// load-balancing loss, and the permutation of token rows into per-expert
// contiguous buffers (and back, weighted by the gates).
//
// An "assignment" is (token t, choice j < k), numbered t * k + j. Experts
// and index maps are int32 so that the CUDA twins can use the same buffers.
// Also compiled by nvcc (C++17): keep this header free of C++20.
#pragma once

#include <cstddef>
#include <cstdint>

namespace cmesh::kernels::cpu {

/// For each row t of probs [tokens, experts]: chosen[t*k + j] is the j-th
/// most probable expert (equal probabilities: the lower index first, so
/// routing is deterministic), and gates[t*k + j] its probability divided by
/// the sum over the k chosen. Needs 1 <= k <= experts.
void top_k_gating(const float* probs, std::size_t tokens, std::size_t experts, std::size_t k,
                  std::int32_t* chosen, float* gates);
void top_k_gating(const double* probs, std::size_t tokens, std::size_t experts, std::size_t k,
                  std::int32_t* chosen, double* gates);

/// Backward of the gate normalisation g_j = p_j / S (S = sum of the chosen p):
/// dprobs[t, chosen_j] += (dgates_j - sum_i g_i dgates_i) / S. Other entries
/// of dprobs are left alone (the top-k choice itself has no gradient).
void top_k_gating_backward(const float* probs, const std::int32_t* chosen, const float* gates,
                           const float* dgates, std::size_t tokens, std::size_t experts,
                           std::size_t k, float* dprobs);
void top_k_gating_backward(const double* probs, const std::int32_t* chosen, const double* gates,
                           const double* dgates, std::size_t tokens, std::size_t experts,
                           std::size_t k, double* dprobs);

/// Assignments an expert accepts: ceil(capacity_factor * tokens * k / experts).
std::size_t expert_capacity(double capacity_factor, std::size_t tokens, std::size_t experts,
                            std::size_t k);

/// Fills each expert up to `capacity` in assignment order (token order, then
/// choice order): slots[a] is the assignment's position in its expert's
/// buffer, or -1 when the expert was already full (dropped). counts[e] (of
/// `experts`) receives the accepted assignments per expert. Returns the
/// number dropped.
std::size_t assign_capacity(const std::int32_t* chosen, std::size_t tokens, std::size_t experts,
                            std::size_t k, std::size_t capacity, std::int32_t* slots,
                            std::int32_t* counts);

/// Index maps of the permuted buffer, where expert e's rows are
/// [offsets[e], offsets[e+1]): offsets (experts + 1 entries), row_of[a] the
/// row of assignment a (-1 when dropped), token_of[row] the token a row came
/// from (one entry per accepted assignment). Returns the number of rows.
std::size_t build_permutation(const std::int32_t* chosen, const std::int32_t* slots,
                              const std::int32_t* counts, std::size_t tokens, std::size_t experts,
                              std::size_t k, std::int32_t* offsets, std::int32_t* row_of,
                              std::int32_t* token_of);

/// out[r] = x[token_of[r]] for r < rows, rows of `width`.
void permute_tokens(const float* x, const std::int32_t* token_of, std::size_t rows,
                    std::size_t width, float* out);
void permute_tokens(const double* x, const std::int32_t* token_of, std::size_t rows,
                    std::size_t width, double* out);

/// Backward of permute_tokens: dx[token_of[r]] += dout[r], in row order.
void permute_tokens_backward(const float* dout, const std::int32_t* token_of, std::size_t rows,
                             std::size_t width, float* dx);
void permute_tokens_backward(const double* dout, const std::int32_t* token_of, std::size_t rows,
                             std::size_t width, double* dx);

/// y[t] += sum_j gates[t*k+j] * expert_out[row_of[t*k+j]] over the accepted
/// assignments (a dropped one contributes zero), rows of `width`.
void unpermute_tokens(const float* expert_out, const std::int32_t* row_of, const float* gates,
                      std::size_t tokens, std::size_t k, std::size_t width, float* y);
void unpermute_tokens(const double* expert_out, const std::int32_t* row_of, const double* gates,
                      std::size_t tokens, std::size_t k, std::size_t width, double* y);

/// Backward of unpermute_tokens, overwriting both outputs:
/// dexpert_out[row_of[a]] = gates[a] * dy[t], and dgates[a] =
/// dot(dy[t], expert_out[row_of[a]]) (0 for a dropped assignment).
void unpermute_tokens_backward(const float* dy, const float* expert_out,
                               const std::int32_t* row_of, const float* gates,
                               std::size_t tokens, std::size_t k, std::size_t width,
                               float* dexpert_out, float* dgates);
void unpermute_tokens_backward(const double* dy, const double* expert_out,
                               const std::int32_t* row_of, const double* gates,
                               std::size_t tokens, std::size_t k, std::size_t width,
                               double* dexpert_out, double* dgates);

/// Switch-style load-balancing loss E * sum_e f_e * P_e: f_e the fraction of
/// tokens whose top-1 choice (chosen[t*k]) is e, P_e the mean router
/// probability of e. 1 when perfectly balanced. tokens == 0 gives 0.
double load_balancing_loss(const float* probs, const std::int32_t* chosen, std::size_t tokens,
                           std::size_t experts, std::size_t k);
double load_balancing_loss(const double* probs, const std::int32_t* chosen, std::size_t tokens,
                           std::size_t experts, std::size_t k);

/// Gradient of weight * load_balancing_loss with respect to the router
/// probabilities, through P_e only (f_e counts choices: a constant):
/// dprobs[t, e] += weight * E * f_e / tokens. Chain with
/// softmax_rows_backward (loss.hpp) for the router logits.
void load_balancing_backward(const std::int32_t* chosen, std::size_t tokens, std::size_t experts,
                             std::size_t k, float weight, float* dprobs);
void load_balancing_backward(const std::int32_t* chosen, std::size_t tokens, std::size_t experts,
                             std::size_t k, double weight, double* dprobs);

} // namespace cmesh::kernels::cpu
