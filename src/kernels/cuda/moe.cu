// Mixture-of-experts routing on the device (see kernels/cuda/ops.hpp and,
// for the semantics, kernels/moe.hpp). Everything here is deterministic:
// integer outputs are computed by ordered scans, float outputs either follow
// the CPU's order of operations or reduce in a fixed tree.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.hpp"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace cmesh::kernels::cuda {

namespace {

// One thread per token. The j-th choice is the most probable expert not
// among the first j (strict '>': the lower index wins ties), as the CPU.
__global__ void top_k_kernel(const float* __restrict__ probs, std::size_t tokens,
                             std::size_t experts, std::size_t k, std::int32_t* chosen,
                             float* gates) {
  for (std::size_t t = detail::thread_index(); t < tokens; t += detail::thread_stride()) {
    const float* p = probs + t * experts;
    std::int32_t* c = chosen + t * k;
    float sum = 0.0f;
    for (std::size_t j = 0; j < k; ++j) {
      std::int32_t best = -1;
      for (std::size_t e = 0; e < experts; ++e) {
        const auto ei = static_cast<std::int32_t>(e);
        bool taken = false;
        for (std::size_t i = 0; i < j && !taken; ++i)
          taken = c[i] == ei;
        if (taken)
          continue;
        if (best < 0 || p[e] > p[best])
          best = ei;
      }
      c[j] = best;
      sum += p[best];
    }
    for (std::size_t j = 0; j < k; ++j)
      gates[t * k + j] = p[c[j]] / sum;
  }
}

__global__ void top_k_backward_kernel(const float* __restrict__ probs,
                                      const std::int32_t* __restrict__ chosen,
                                      const float* __restrict__ gates,
                                      const float* __restrict__ dgates, std::size_t tokens,
                                      std::size_t experts, std::size_t k, float* dprobs) {
  for (std::size_t t = detail::thread_index(); t < tokens; t += detail::thread_stride()) {
    const std::int32_t* c = chosen + t * k;
    const float* g = gates + t * k;
    const float* dg = dgates + t * k;
    float sum = 0.0f, dot = 0.0f;
    for (std::size_t j = 0; j < k; ++j) {
      sum += probs[t * experts + c[j]];
      dot += g[j] * dg[j];
    }
    for (std::size_t j = 0; j < k; ++j)
      dprobs[t * experts + c[j]] += (dg[j] - dot) / sum;
  }
}

// One block per expert e scans the assignments in order, a block-wide chunk
// at a time: an assignment's slot is the number of earlier assignments to
// the same expert (ballot + popcount within a warp, per-warp totals across
// the block, a running total across chunks). blockDim.x: a multiple of 32.
__global__ void assign_capacity_kernel(const std::int32_t* __restrict__ chosen, std::size_t n,
                                       std::int32_t experts, std::size_t capacity,
                                       std::int32_t* slots, std::int32_t* counts,
                                       std::int32_t* dropped) {
  __shared__ unsigned warp_totals[32];
  const std::int32_t e = static_cast<std::int32_t>(blockIdx.x);
  const unsigned lane = threadIdx.x & 31u;
  const unsigned warp = threadIdx.x >> 5;
  const unsigned warps = blockDim.x >> 5;
  std::size_t running = 0; // assignments to e before this chunk (same in every thread)
  for (std::size_t base = 0; base < n; base += blockDim.x) {
    const std::size_t a = base + threadIdx.x;
    const std::int32_t c = a < n ? chosen[a] : -1;
    const bool mine = a < n && c == e;
    if (e == 0 && a < n && (c < 0 || c >= experts))
      slots[a] = -1; // no expert: dropped, but not counted as such
    const unsigned ballot = __ballot_sync(0xffffffffu, mine);
    if (lane == 0)
      warp_totals[warp] = static_cast<unsigned>(__popc(ballot));
    __syncthreads();
    unsigned before = static_cast<unsigned>(__popc(ballot & ((1u << lane) - 1u)));
    unsigned chunk = 0;
    for (unsigned w = 0; w < warps; ++w) {
      const unsigned in_warp = warp_totals[w];
      if (w < warp)
        before += in_warp;
      chunk += in_warp;
    }
    if (mine) {
      const std::size_t rank = running + before;
      slots[a] = rank < capacity ? static_cast<std::int32_t>(rank) : -1;
    }
    running += chunk;
    __syncthreads(); // every thread has read warp_totals before the next chunk
  }
  if (threadIdx.x == 0) {
    const std::size_t accepted = running < capacity ? running : capacity;
    counts[e] = static_cast<std::int32_t>(accepted);
    if (dropped && running > accepted)
      atomicAdd(dropped, static_cast<std::int32_t>(running - accepted)); // integers: exact
  }
}

// Exclusive prefix sum of the counts, in order (experts are few).
__global__ void offsets_kernel(const std::int32_t* counts, std::size_t experts,
                               std::int32_t* offsets) {
  if (blockIdx.x != 0 || threadIdx.x != 0)
    return;
  std::int32_t at = 0;
  offsets[0] = 0;
  for (std::size_t e = 0; e < experts; ++e) {
    at += counts[e];
    offsets[e + 1] = at;
  }
}

__global__ void permutation_kernel(const std::int32_t* __restrict__ chosen,
                                   const std::int32_t* __restrict__ slots,
                                   const std::int32_t* __restrict__ offsets, std::size_t n,
                                   std::size_t k, std::int32_t* row_of, std::int32_t* token_of) {
  for (std::size_t a = detail::thread_index(); a < n; a += detail::thread_stride()) {
    const std::int32_t slot = slots[a];
    if (slot < 0) {
      row_of[a] = -1;
      continue;
    }
    const std::int32_t row = offsets[chosen[a]] + slot;
    row_of[a] = row;
    token_of[row] = static_cast<std::int32_t>(a / k);
  }
}

// One thread per output element; the k choices are added in order of j.
__global__ void unpermute_kernel(const float* __restrict__ expert_out,
                                 const std::int32_t* __restrict__ row_of,
                                 const float* __restrict__ gates, std::size_t tokens,
                                 std::size_t k, std::size_t width, float* y) {
  const std::size_t total = tokens * width;
  for (std::size_t e = detail::thread_index(); e < total; e += detail::thread_stride()) {
    const std::size_t t = e / width, i = e % width;
    float acc = y[e];
    for (std::size_t j = 0; j < k; ++j) {
      const std::int32_t row = row_of[t * k + j];
      if (row < 0)
        continue;
      acc += gates[t * k + j] * expert_out[static_cast<std::size_t>(row) * width + i];
    }
    y[e] = acc;
  }
}

// One warp per assignment: the lanes stride over the row, then the dot
// product is reduced across the warp (fixed tree).
__global__ void unpermute_backward_kernel(const float* dy, const float* expert_out,
                                          const std::int32_t* __restrict__ row_of,
                                          const float* __restrict__ gates, std::size_t tokens,
                                          std::size_t k, std::size_t width, float* dexpert_out,
                                          float* dgates) {
  const std::size_t n = tokens * k;
  const unsigned lane = threadIdx.x & 31u;
  const std::size_t warps = detail::thread_stride() / 32;
  for (std::size_t a = detail::thread_index() / 32; a < n; a += warps) {
    const std::int32_t row = row_of[a];
    if (row < 0) { // the whole warp takes this branch
      if (lane == 0)
        dgates[a] = 0.0f;
      continue;
    }
    const float* d = dy + (a / k) * width;
    const float* out = expert_out + static_cast<std::size_t>(row) * width;
    float* dout = dexpert_out + static_cast<std::size_t>(row) * width;
    const float g = gates[a];
    float dot = 0.0f;
    for (std::size_t i = lane; i < width; i += 32) {
      dot += d[i] * out[i];
      dout[i] = g * d[i];
    }
    dot = detail::warp_reduce(dot, detail::sum_op{});
    if (lane == 0)
      dgates[a] = dot;
  }
}

// One block, experts in order: E * sum_e (top1_e / n) * (p_sum_e / n), the
// CPU's formula; the counts are sums of 1.0 (exact), p_sum a tree in double.
__global__ void __launch_bounds__(1024) balance_loss_kernel(const float* __restrict__ probs,
                                    const std::int32_t* __restrict__ chosen, std::size_t tokens,
                                    std::size_t experts, std::size_t k, double* loss) {
  __shared__ double scratch[32];
  const double n = static_cast<double>(tokens);
  double total = 0; // the same in every thread: block_reduce gives all the result
  for (std::size_t e = 0; e < experts; ++e) {
    const auto ei = static_cast<std::int32_t>(e);
    double p_sum = 0, top1 = 0;
    for (std::size_t t = threadIdx.x; t < tokens; t += blockDim.x) {
      p_sum += static_cast<double>(probs[t * experts + e]);
      top1 += chosen[t * k] == ei ? 1.0 : 0.0;
    }
    p_sum = detail::block_reduce(p_sum, 0.0, detail::sum_op{}, scratch);
    top1 = detail::block_reduce(top1, 0.0, detail::sum_op{}, scratch);
    total += (top1 / n) * (p_sum / n);
  }
  if (threadIdx.x == 0)
    *loss = static_cast<double>(experts) * total;
}

// One block per expert: count its top-1 tokens, then add the constant
// gradient to its column.
__global__ void balance_backward_kernel(const std::int32_t* __restrict__ chosen,
                                        std::size_t tokens, std::size_t experts, std::size_t k,
                                        float weight, float* dprobs) {
  __shared__ double scratch[32];
  const double n = static_cast<double>(tokens);
  for (std::size_t e = blockIdx.x; e < experts; e += gridDim.x) {
    const auto ei = static_cast<std::int32_t>(e);
    double top1 = 0;
    for (std::size_t t = threadIdx.x; t < tokens; t += blockDim.x)
      top1 += chosen[t * k] == ei ? 1.0 : 0.0;
    top1 = detail::block_reduce(top1, 0.0, detail::sum_op{}, scratch);
    const float d = static_cast<float>(static_cast<double>(weight) *
                                       static_cast<double>(experts) * (top1 / n) / n);
    for (std::size_t t = threadIdx.x; t < tokens; t += blockDim.x)
      dprobs[t * experts + e] += d;
  }
}

void check_k(std::size_t experts, std::size_t k, const char* who) {
  if (k < 1 || k > experts)
    throw std::invalid_argument(std::string(who) + ": needs 1 <= k <= experts");
}

} // namespace

void top_k_gating(const float* probs, std::size_t tokens, std::size_t experts, std::size_t k,
                  std::int32_t* chosen, float* gates, cudaStream_t stream) {
  if (tokens == 0)
    return;
  check_k(experts, k, "cuda::top_k_gating");
  top_k_kernel<<<detail::grid_for(tokens), detail::block_threads, 0, stream>>>(
    probs, tokens, experts, k, chosen, gates);
  detail::check_launch();
}

void top_k_gating_backward(const float* probs, const std::int32_t* chosen, const float* gates,
                           const float* dgates, std::size_t tokens, std::size_t experts,
                           std::size_t k, float* dprobs, cudaStream_t stream) {
  if (tokens == 0 || k == 0)
    return;
  top_k_backward_kernel<<<detail::grid_for(tokens), detail::block_threads, 0, stream>>>(
    probs, chosen, gates, dgates, tokens, experts, k, dprobs);
  detail::check_launch();
}

void assign_capacity(const std::int32_t* chosen, std::size_t tokens, std::size_t experts,
                     std::size_t k, std::size_t capacity, std::int32_t* slots,
                     std::int32_t* counts, std::int32_t* dropped, cudaStream_t stream) {
  if (experts > static_cast<std::size_t>(INT32_MAX))
    throw std::invalid_argument("cuda::assign_capacity: too many experts");
  const std::size_t n = tokens * k;
  if (dropped)
    CMESH_CUDA_CHECK(cudaMemsetAsync(dropped, 0, sizeof(std::int32_t), stream));
  if (experts == 0) {
    if (n > 0) // no expert to take anything; all-ones bytes are int32 -1
      CMESH_CUDA_CHECK(cudaMemsetAsync(slots, 0xff, n * sizeof(std::int32_t), stream));
    return;
  }
  if (n == 0) {
    CMESH_CUDA_CHECK(cudaMemsetAsync(counts, 0, experts * sizeof(std::int32_t), stream));
    return;
  }
  assign_capacity_kernel<<<static_cast<unsigned>(experts), detail::block_threads, 0, stream>>>(
    chosen, n, static_cast<std::int32_t>(experts), capacity, slots, counts, dropped);
  detail::check_launch();
}

void build_permutation(const std::int32_t* chosen, const std::int32_t* slots,
                       const std::int32_t* counts, std::size_t tokens, std::size_t experts,
                       std::size_t k, std::int32_t* offsets, std::int32_t* row_of,
                       std::int32_t* token_of, cudaStream_t stream) {
  offsets_kernel<<<1, 1, 0, stream>>>(counts, experts, offsets);
  detail::check_launch();
  const std::size_t n = tokens * k;
  if (n == 0)
    return;
  permutation_kernel<<<detail::grid_for(n), detail::block_threads, 0, stream>>>(
    chosen, slots, offsets, n, k, row_of, token_of);
  detail::check_launch();
}

void permute_tokens(const float* x, const std::int32_t* token_of, std::size_t rows,
                    std::size_t width, float* out, cudaStream_t stream) {
  gather_rows(x, token_of, rows, width, out, stream);
}

void permute_tokens_backward(const float* dout, const std::int32_t* token_of, std::size_t rows,
                             std::size_t width, float* dx, cudaStream_t stream) {
  scatter_add_rows(dout, token_of, rows, width, dx, stream);
}

void unpermute_tokens(const float* expert_out, const std::int32_t* row_of, const float* gates,
                      std::size_t tokens, std::size_t k, std::size_t width, float* y,
                      cudaStream_t stream) {
  if (tokens == 0 || width == 0 || k == 0)
    return;
  unpermute_kernel<<<detail::grid_for(tokens * width), detail::block_threads, 0, stream>>>(
    expert_out, row_of, gates, tokens, k, width, y);
  detail::check_launch();
}

void unpermute_tokens_backward(const float* dy, const float* expert_out,
                               const std::int32_t* row_of, const float* gates,
                               std::size_t tokens, std::size_t k, std::size_t width,
                               float* dexpert_out, float* dgates, cudaStream_t stream) {
  const std::size_t n = tokens * k;
  if (n == 0)
    return;
  // 8 warps (assignments) per block.
  const unsigned blocks = detail::grid_for(n, detail::block_threads / 32);
  unpermute_backward_kernel<<<blocks, detail::block_threads, 0, stream>>>(
    dy, expert_out, row_of, gates, tokens, k, width, dexpert_out, dgates);
  detail::check_launch();
}

void load_balancing_loss(const float* probs, const std::int32_t* chosen, std::size_t tokens,
                         std::size_t experts, std::size_t k, double* loss, cudaStream_t stream) {
  if (tokens == 0 || experts == 0) {
    CMESH_CUDA_CHECK(cudaMemsetAsync(loss, 0, sizeof(double), stream)); // 0.0
    return;
  }
  balance_loss_kernel<<<1, 1024, 0, stream>>>(probs, chosen, tokens, experts, k, loss);
  detail::check_launch();
}

void load_balancing_backward(const std::int32_t* chosen, std::size_t tokens, std::size_t experts,
                             std::size_t k, float weight, float* dprobs, cudaStream_t stream) {
  if (tokens == 0 || experts == 0)
    return;
  const auto blocks = static_cast<unsigned>(std::min<std::size_t>(experts, detail::max_grid));
  balance_backward_kernel<<<blocks, detail::block_threads, 0, stream>>>(chosen, tokens, experts,
                                                                       k, weight, dprobs);
  detail::check_launch();
}

} // namespace cmesh::kernels::cuda
