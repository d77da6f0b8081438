#include "kernels/loss.hpp"

#include <cmath>

namespace cmesh::kernels::cpu {

namespace {

template <class T>
T row_max(const T* row, std::size_t n) {
  T m = row[0];
  for (std::size_t i = 1; i < n; ++i)
    m = row[i] > m ? row[i] : m;
  return m;
}

// exp(v - shift), evaluated in T: expf is much faster than exp, and the
// exponent (v - shift <= 0 here) is exact enough in float.
template <class T>
double exp_shifted(T v, double shift) {
  return static_cast<double>(std::exp(static_cast<T>(static_cast<double>(v) - shift)));
}

// log(sum exp(row)) computed around the maximum, so nothing overflows.
// Summed in double whatever T is: a 256-way sum in float loses bits.
template <class T>
double log_sum_exp(const T* row, std::size_t n) {
  const double m = row_max(row, n);
  double s = 0;
  for (std::size_t i = 0; i < n; ++i)
    s += exp_shifted(row[i], m);
  return m + std::log(s);
}

template <class T>
double ce_forward(const T* logits, const std::int32_t* targets, std::size_t rows,
                  std::size_t vocab) {
  if (rows == 0 || vocab == 0)
    return 0;
  double total = 0;
  for (std::size_t r = 0; r < rows; ++r) {
    const T* row = logits + r * vocab;
    total += log_sum_exp(row, vocab) - static_cast<double>(row[targets[r]]);
  }
  return total / static_cast<double>(rows);
}

template <class T>
void ce_backward(const T* logits, const std::int32_t* targets, std::size_t rows,
                 std::size_t vocab, T dloss, T* dlogits) {
  if (rows == 0 || vocab == 0)
    return;
  const double per_row = static_cast<double>(dloss) / static_cast<double>(rows);
  for (std::size_t r = 0; r < rows; ++r) {
    const T* row = logits + r * vocab;
    T* out = dlogits + r * vocab;
    const double lse = log_sum_exp(row, vocab);
    for (std::size_t i = 0; i < vocab; ++i) {
      const double p = exp_shifted(row[i], lse);
      out[i] = static_cast<T>(per_row * (p - (static_cast<std::int32_t>(i) == targets[r])));
    }
  }
}

template <class T>
void softmax_t(const T* logits, T* probs, std::size_t rows, std::size_t cols) {
  if (cols == 0)
    return;
  for (std::size_t r = 0; r < rows; ++r) {
    const T* in = logits + r * cols;
    T* out = probs + r * cols;
    const double lse = log_sum_exp(in, cols);
    for (std::size_t i = 0; i < cols; ++i)
      out[i] = static_cast<T>(exp_shifted(in[i], lse));
  }
}

template <class T>
void softmax_backward_t(const T* probs, const T* dprobs, T* dlogits, std::size_t rows,
                        std::size_t cols) {
  for (std::size_t r = 0; r < rows; ++r) {
    const T* p = probs + r * cols;
    const T* dp = dprobs + r * cols;
    double dot = 0;
    for (std::size_t i = 0; i < cols; ++i)
      dot += static_cast<double>(p[i]) * static_cast<double>(dp[i]);
    T* out = dlogits + r * cols;
    for (std::size_t i = 0; i < cols; ++i)
      out[i] = static_cast<T>(static_cast<double>(p[i]) * (static_cast<double>(dp[i]) - dot));
  }
}

} // namespace

double softmax_cross_entropy_forward(const float* logits, const std::int32_t* targets,
                                     std::size_t rows, std::size_t vocab) {
  return ce_forward(logits, targets, rows, vocab);
}
double softmax_cross_entropy_forward(const double* logits, const std::int32_t* targets,
                                     std::size_t rows, std::size_t vocab) {
  return ce_forward(logits, targets, rows, vocab);
}
void softmax_cross_entropy_backward(const float* logits, const std::int32_t* targets,
                                    std::size_t rows, std::size_t vocab, float dloss,
                                    float* dlogits) {
  ce_backward(logits, targets, rows, vocab, dloss, dlogits);
}
void softmax_cross_entropy_backward(const double* logits, const std::int32_t* targets,
                                    std::size_t rows, std::size_t vocab, double dloss,
                                    double* dlogits) {
  ce_backward(logits, targets, rows, vocab, dloss, dlogits);
}
void softmax_rows(const float* logits, float* probs, std::size_t rows, std::size_t cols) {
  softmax_t(logits, probs, rows, cols);
}
void softmax_rows(const double* logits, double* probs, std::size_t rows, std::size_t cols) {
  softmax_t(logits, probs, rows, cols);
}
void softmax_rows_backward(const float* probs, const float* dprobs, float* dlogits,
                           std::size_t rows, std::size_t cols) {
  softmax_backward_t(probs, dprobs, dlogits, rows, cols);
}
void softmax_rows_backward(const double* probs, const double* dprobs, double* dlogits,
                           std::size_t rows, std::size_t cols) {
  softmax_backward_t(probs, dprobs, dlogits, rows, cols);
}

} // namespace cmesh::kernels::cpu
