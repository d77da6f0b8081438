// Softmax cross-entropy over the rows of a logits matrix, numerically stable
// (the row maximum is subtracted before exponentiating).
// Also compiled by nvcc (C++17): keep this header free of C++20.
#pragma once

#include <cstddef>
#include <cstdint>

namespace cmesh::kernels::cpu {

/// Mean over rows of -log softmax(logits[r])[targets[r]], logits [rows, vocab].
/// Targets must lie in [0, vocab). rows == 0 gives 0.
double softmax_cross_entropy_forward(const float* logits, const std::int32_t* targets,
                                     std::size_t rows, std::size_t vocab);
double softmax_cross_entropy_forward(const double* logits, const std::int32_t* targets,
                                     std::size_t rows, std::size_t vocab);

/// dlogits = dloss * (softmax(logits) - onehot(targets)) / rows: the gradient
/// of dloss * mean loss. Overwrites dlogits [rows, vocab]; it may alias logits.
void softmax_cross_entropy_backward(const float* logits, const std::int32_t* targets,
                                    std::size_t rows, std::size_t vocab, float dloss,
                                    float* dlogits);
void softmax_cross_entropy_backward(const double* logits, const std::int32_t* targets,
                                    std::size_t rows, std::size_t vocab, double dloss,
                                    double* dlogits);

/// Row-wise softmax: probs[r] = softmax(logits[r]), [rows, cols]; may alias.
void softmax_rows(const float* logits, float* probs, std::size_t rows, std::size_t cols);
void softmax_rows(const double* logits, double* probs, std::size_t rows, std::size_t cols);

/// Backward of softmax_rows: dlogits[r,i] = p[r,i] * (dp[r,i] - sum_j p[r,j] dp[r,j]).
/// Overwrites dlogits; it may alias dprobs.
void softmax_rows_backward(const float* probs, const float* dprobs, float* dlogits,
                           std::size_t rows, std::size_t cols);
void softmax_rows_backward(const double* probs, const double* dprobs, double* dlogits,
                           std::size_t rows, std::size_t cols);

} // namespace cmesh::kernels::cpu
