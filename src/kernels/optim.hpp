// Optimizer-side kernels over flat fp32 buffers: AdamW, gradient scaling,
// global L2 norm and clipping, and packing the gradients of a list of
// tensors into one contiguous buffer (for a collective) and back.
// Also compiled by nvcc (C++17): keep this header free of C++20.
#pragma once

#include <cstddef>
#include <cstdint>

namespace cmesh::kernels::cpu {

struct adamw_params {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
};

/// One AdamW step (decoupled weight decay, bias-corrected moments) at
/// `step` >= 1 (the count of updates including this one), over n elements:
///   m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
///   p -= lr * wd * p;     p -= lr * (m / (1-b1^step)) / (sqrt(v / (1-b2^step)) + eps)
void adamw_step(float* params, const float* grads, float* m, float* v, std::size_t n,
                const adamw_params& hp, std::uint64_t step);

/// x[i] *= alpha for i < n (unscaling by 1/loss_scale, averaging by 1/count).
void scale_in_place(float* x, float alpha, std::size_t n);

/// sum_i x[i]^2, accumulated in double in index order (deterministic).
double sum_of_squares(const float* x, std::size_t n);

/// sqrt(sum_of_squares): the L2 norm of one buffer. For a norm across
/// buffers or ranks, add their sum_of_squares and take the root.
double l2_norm(const float* x, std::size_t n);

/// Scales x so that its L2 norm is at most max_norm, given its `norm` (which
/// may be global, over more than this buffer). Returns the factor applied
/// (1 when the norm is within bounds, or max_norm <= 0: clipping off).
float clip_to_norm(float* x, std::size_t n, double norm, double max_norm);

/// dst[...] = the ranges src[offsets[i], offsets[i] + sizes[i]) for i < count,
/// one after another. Returns the number of elements written.
std::size_t pack_ranges(const float* src, const std::size_t* offsets, const std::size_t* sizes,
                        std::size_t count, float* dst);

/// The inverse: the packed ranges back to dst[offsets[i], ...]. Returns the
/// number of elements read.
std::size_t unpack_ranges(const float* packed, const std::size_t* offsets,
                          const std::size_t* sizes, std::size_t count, float* dst);

} // namespace cmesh::kernels::cpu
