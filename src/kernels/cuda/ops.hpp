// CUDA twins of the CPU kernels in kernels/*.hpp (the CPU versions, in
// kernels/cpu/, are the oracles the *_cuda tests compare against). Only for
// builds with CMESH_HAVE_CUDA; also compiled by nvcc (C++17): keep this
// header free of C++20.
//
// Conventions: every pointer is device memory unless said otherwise; sizes
// are host values; each call enqueues its work on `stream` and returns
// without synchronizing (read results after cudaStreamSynchronize). A
// failed launch or CUDA call throws std::runtime_error (CMESH_CUDA_CHECK).
// Sizes of 0 enqueue nothing unless an output must still be written (a mean,
// a loss, a flag). Float only, plus the bf16 casts.
//
// Kernels (file):
//   gemm.cu        cublas_handle, gemm (cuBLAS sgemm, or GemmEx with bf16
//                  inputs; row-major), add_row_bias,
//                  add_column_sums
//   activation.cu  gelu_forward, gelu_backward
//   loss.cu        softmax_cross_entropy_forward (per-row loss + mean),
//                  softmax_cross_entropy_backward, softmax_rows,
//                  softmax_rows_backward
//   embedding.cu   gather_rows, scatter_add_rows, scatter_add_rows_atomic
//   moe.cu         top_k_gating (+ backward), assign_capacity,
//                  build_permutation, permute_tokens (+ backward),
//                  unpermute_tokens (+ backward), load_balancing_loss,
//                  load_balancing_backward (expert_capacity is host
//                  arithmetic: use cpu::expert_capacity)
//   optim.cu       adamw_step, scale_in_place, sum_of_squares, l2_norm,
//                  sqrt_in_place, clip_to_norm (host or device norm),
//                  pack_ranges, unpack_ranges
//   precision.cu   float_to_bf16, bf16_to_float, round_to_bf16, all_finite,
//                  mark_nonfinite, check_gradients / update_loss_scale (the
//                  scaler's state machine stays on the host, cpu::loss_scaler)
//
// Determinism. Every kernel here gives bit-identical results run to run for
// the same inputs, sizes and GPU model: launch shapes depend only on the
// sizes, reductions are fixed trees (warp shuffles, then one value per warp),
// and no floating-point atomics are used, except:
//   - scatter_add_rows_atomic: float atomicAdd, the order of repeated indices
//     varies run to run (NOT deterministic). scatter_add_rows is the
//     deterministic one (same order as the CPU, so bit-identical to it).
//   - gemm: cuBLAS is reproducible run to run on the same GPU model and
//     toolkit version with a handle used from one stream at a time (atomics
//     mode stays off, default math mode: no TF32); its rounding differs from
//     OpenBLAS.
// Against the CPU oracle: kernels/cuda/*.cu are compiled with --fmad=false,
// so elementwise arithmetic rounds exactly as the (non-FMA) CPU code does.
// Bit-identical to the CPU: add_row_bias, add_column_sums, gather_rows,
// scatter_add_rows, top_k_gating, top_k_gating_backward, assign_capacity,
// build_permutation, permute_tokens (+ backward), unpermute_tokens,
// load_balancing_backward, adamw_step, scale_in_place, clip_to_norm, the bf16
// casts and all_finite. Close but not bit-identical (different exp/log, or a
// tree instead of an in-order sum): gemm, gelu, the softmax and
// cross-entropy kernels, unpermute_tokens_backward (dgates), the load
// balancing loss, sum_of_squares and l2_norm.
#pragma once

#include "kernels/gemm.hpp"      // gemm_math
#include "kernels/optim.hpp"     // cpu::adamw_params
#include "kernels/precision.hpp" // cpu::loss_scaler

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace cmesh::kernels::cuda {

// ---- gemm.cu ---------------------------------------------------------------

/// cuBLAS is opened on first use (dlopen), not linked, so that processes
/// that never use it do not map it. This opens it now: std::runtime_error
/// saying why when it cannot (the library or one of its symbols missing).
void load_cublas();

/// Owns a cuBLAS handle (cublasCreate on construction, on the current
/// device). Not thread-safe: use one per thread (or guard it). Movable.
class cublas_handle {
public:
  cublas_handle();
  ~cublas_handle();
  cublas_handle(cublas_handle&& other) noexcept;
  cublas_handle& operator=(cublas_handle&& other) noexcept;
  cublas_handle(const cublas_handle&) = delete;
  cublas_handle& operator=(const cublas_handle&) = delete;

  cublasHandle_t get() const noexcept { return handle_; }

private:
  cublasHandle_t handle_ = nullptr;
};

/// Row-major C[m,n] = alpha * op(A) * op(B) + beta * C, as cpu::gemm (same
/// storage and leading dimensions), through cublasSgemm with the operands
/// swapped (a row-major C is a column-major C^T = op(B)^T op(A)^T). Sets the
/// handle's stream to `stream`. beta == 0 overwrites C; k == 0 scales C;
/// m == 0 or n == 0 does nothing. Sizes above INT_MAX throw
/// std::invalid_argument. gemm_math::bf16_inputs goes through cublasGemmEx
/// with CUBLAS_COMPUTE_32F_FAST_16BF (operands rounded to bf16 by the
/// library, tensor cores, fp32 sums): cpu::gemm_bf16_inputs up to the order
/// of the additions.
void gemm(cublas_handle& handle, bool trans_a, bool trans_b, std::size_t m, std::size_t n,
          std::size_t k, float alpha, const float* a, std::size_t lda, const float* b,
          std::size_t ldb, float beta, float* c, std::size_t ldc, cudaStream_t stream,
          gemm_math math = gemm_math::fp32);

/// y[r, j] += bias[j] (y row-major [rows, cols]).
void add_row_bias(float* y, const float* bias, std::size_t rows, std::size_t cols,
                  cudaStream_t stream);

/// sums[j] += sum_r x[r, j], rows added in order (one thread per column).
void add_column_sums(float* sums, const float* x, std::size_t rows, std::size_t cols,
                     cudaStream_t stream);

// ---- activation.cu ---------------------------------------------------------

/// y[i] = gelu(x[i]) (tanh approximation, as cpu::gelu_forward); y may alias x.
void gelu_forward(const float* x, float* y, std::size_t n, cudaStream_t stream);

/// dx[i] = dy[i] * gelu'(x[i]); dx may alias dy.
void gelu_backward(const float* x, const float* dy, float* dx, std::size_t n,
                   cudaStream_t stream);

// ---- loss.cu ---------------------------------------------------------------

/// Per-row softmax cross-entropy of logits [rows, vocab]:
/// row_loss[r] = log-sum-exp(logits[r]) - logits[r, targets[r]] (rows
/// doubles, required: the mean is reduced from it), and *mean_loss (one
/// double, may be null) their mean, which is what
/// cpu::softmax_cross_entropy_forward returns. A target outside [0, vocab)
/// gives its row a NaN loss. rows == 0 or vocab == 0 gives zeros.
void softmax_cross_entropy_forward(const float* logits, const std::int32_t* targets,
                                   std::size_t rows, std::size_t vocab, double* row_loss,
                                   double* mean_loss, cudaStream_t stream);

/// dlogits = dloss * (softmax(logits) - onehot(targets)) / rows; dlogits may
/// alias logits.
void softmax_cross_entropy_backward(const float* logits, const std::int32_t* targets,
                                    std::size_t rows, std::size_t vocab, float dloss,
                                    float* dlogits, cudaStream_t stream);

/// probs[r] = softmax(logits[r]), [rows, cols]; may alias.
void softmax_rows(const float* logits, float* probs, std::size_t rows, std::size_t cols,
                  cudaStream_t stream);

/// dlogits[r,i] = p[r,i] * (dp[r,i] - sum_j p[r,j] dp[r,j]); may alias dprobs.
void softmax_rows_backward(const float* probs, const float* dprobs, float* dlogits,
                           std::size_t rows, std::size_t cols, cudaStream_t stream);

// ---- embedding.cu ----------------------------------------------------------

/// out[i] = table[index[i]] (rows of `width`), zeros for a negative index.
void gather_rows(const float* table, const std::int32_t* index, std::size_t count,
                 std::size_t width, float* out, cudaStream_t stream);

/// table[index[i]] += rows[i] in order of i, negative indices skipped:
/// deterministic and bit-identical to the CPU. One thread per column walks
/// the indices in order, so the parallelism is `width` and the time grows
/// with `count`. rows must not alias table.
void scatter_add_rows(const float* rows, const std::int32_t* index, std::size_t count,
                      std::size_t width, float* table, cudaStream_t stream);

/// The same with one float atomicAdd per element: fully parallel, but repeated
/// indices are summed in a varying order, so NOT deterministic.
void scatter_add_rows_atomic(const float* rows, const std::int32_t* index, std::size_t count,
                             std::size_t width, float* table, cudaStream_t stream);

// ---- moe.cu ----------------------------------------------------------------

/// As cpu::top_k_gating (ties to the lower index). Needs 1 <= k <= experts.
void top_k_gating(const float* probs, std::size_t tokens, std::size_t experts, std::size_t k,
                  std::int32_t* chosen, float* gates, cudaStream_t stream);

/// As cpu::top_k_gating_backward (accumulates into dprobs).
void top_k_gating_backward(const float* probs, const std::int32_t* chosen, const float* gates,
                           const float* dgates, std::size_t tokens, std::size_t experts,
                           std::size_t k, float* dprobs, cudaStream_t stream);

/// As cpu::assign_capacity: slots in assignment order (deterministic: one
/// block per expert scans the assignments in order), counts[e] the accepted
/// per expert, and *dropped (one int32, may be null) the number dropped.
/// An expert index outside [0, experts) gets slot -1 and is not counted.
void assign_capacity(const std::int32_t* chosen, std::size_t tokens, std::size_t experts,
                     std::size_t k, std::size_t capacity, std::int32_t* slots,
                     std::int32_t* counts, std::int32_t* dropped, cudaStream_t stream);

/// As cpu::build_permutation. The number of rows is offsets[experts] (on the
/// device: copy it back, or launch the row kernels with an upper bound such
/// as experts * capacity only if token_of is filled that far).
void build_permutation(const std::int32_t* chosen, const std::int32_t* slots,
                       const std::int32_t* counts, std::size_t tokens, std::size_t experts,
                       std::size_t k, std::int32_t* offsets, std::int32_t* row_of,
                       std::int32_t* token_of, cudaStream_t stream);

/// out[r] = x[token_of[r]] for r < rows (gather_rows).
void permute_tokens(const float* x, const std::int32_t* token_of, std::size_t rows,
                    std::size_t width, float* out, cudaStream_t stream);

/// dx[token_of[r]] += dout[r] in row order (deterministic scatter_add_rows).
void permute_tokens_backward(const float* dout, const std::int32_t* token_of, std::size_t rows,
                             std::size_t width, float* dx, cudaStream_t stream);

/// y[t] += sum_j gates[t*k+j] * expert_out[row_of[t*k+j]] in order of j.
void unpermute_tokens(const float* expert_out, const std::int32_t* row_of, const float* gates,
                      std::size_t tokens, std::size_t k, std::size_t width, float* y,
                      cudaStream_t stream);

/// As cpu::unpermute_tokens_backward (overwrites both outputs); dgates is a
/// dot product reduced by one warp per assignment (fixed tree).
void unpermute_tokens_backward(const float* dy, const float* expert_out,
                               const std::int32_t* row_of, const float* gates,
                               std::size_t tokens, std::size_t k, std::size_t width,
                               float* dexpert_out, float* dgates, cudaStream_t stream);

/// *loss (one double) = cpu::load_balancing_loss; tokens == 0 gives 0.
void load_balancing_loss(const float* probs, const std::int32_t* chosen, std::size_t tokens,
                         std::size_t experts, std::size_t k, double* loss, cudaStream_t stream);

/// As cpu::load_balancing_backward (accumulates into dprobs).
void load_balancing_backward(const std::int32_t* chosen, std::size_t tokens, std::size_t experts,
                             std::size_t k, float weight, float* dprobs, cudaStream_t stream);

// ---- optim.cu --------------------------------------------------------------

/// One AdamW step, as cpu::adamw_step (bias corrections computed on the host).
void adamw_step(float* params, const float* grads, float* m, float* v, std::size_t n,
                const cpu::adamw_params& hp, std::uint64_t step, cudaStream_t stream);

/// x[i] *= alpha.
void scale_in_place(float* x, float alpha, std::size_t n, cudaStream_t stream);

/// *out = sum_i x[i]^2 in double (or *out += it when `accumulate`, to sum
/// several buffers in a fixed order). A fixed two-level tree whose shape
/// depends only on n: deterministic. Uses a small stream-ordered scratch
/// (cudaMallocAsync).
void sum_of_squares(const float* x, std::size_t n, double* out, cudaStream_t stream,
                    bool accumulate = false);

/// *out = sqrt(sum_of_squares(x)).
void l2_norm(const float* x, std::size_t n, double* out, cudaStream_t stream);

/// *v = sqrt(*v): a norm from accumulated sums of squares.
void sqrt_in_place(double* v, cudaStream_t stream);

/// As cpu::clip_to_norm with the norm known on the host: returns the factor
/// applied (1 when not clipping), enqueueing the scaling when there is one.
float clip_to_norm(float* x, std::size_t n, double norm, double max_norm, cudaStream_t stream);

/// The same with the norm on the device (*norm, one double): no host round
/// trip. *factor (one float, may be null) receives the factor applied.
void clip_to_norm(float* x, std::size_t n, const double* norm, double max_norm, float* factor,
                  cudaStream_t stream);

/// As cpu::pack_ranges / unpack_ranges; offsets and sizes are HOST arrays,
/// src/dst/packed device buffers (one device-to-device copy per range).
std::size_t pack_ranges(const float* src, const std::size_t* offsets, const std::size_t* sizes,
                        std::size_t count, float* dst, cudaStream_t stream);
std::size_t unpack_ranges(const float* packed, const std::size_t* offsets,
                          const std::size_t* sizes, std::size_t count, float* dst,
                          cudaStream_t stream);

// ---- precision.cu ----------------------------------------------------------

/// bf16 bits, round to nearest even, NaN kept a quiet NaN (as the CPU).
void float_to_bf16(const float* x, std::uint16_t* y, std::size_t n, cudaStream_t stream);
void bf16_to_float(const std::uint16_t* x, float* y, std::size_t n, cudaStream_t stream);
void round_to_bf16(float* x, std::size_t n, cudaStream_t stream);

/// *finite (one int) = 1 when every x[i] is finite, else 0.
void all_finite(const float* x, std::size_t n, int* finite, cudaStream_t stream);

/// *found = 1 when some x[i] is inf or NaN; left alone otherwise. Zero it,
/// then mark several buffers, for one flag over a whole gradient set.
void mark_nonfinite(const float* x, std::size_t n, int* found, cudaStream_t stream);

/// The finite check on the device, the scale update on the host: reads the
/// flag back (synchronizes `stream`) and calls cpu::update_loss_scale.
/// Returns true when the step must be skipped.
bool check_gradients(cpu::loss_scaler& s, const float* grads, std::size_t n,
                     cudaStream_t stream);

/// The same from a flag set by mark_nonfinite (one int on the device).
bool update_loss_scale(cpu::loss_scaler& s, const int* found_nonfinite, cudaStream_t stream);

} // namespace cmesh::kernels::cuda
