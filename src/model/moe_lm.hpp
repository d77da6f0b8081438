// The built-in workload: a small byte-level Mixture-of-Experts language model.
//
//   x = embed[tok_t] + gelu(mix.w^T [embed[tok_t], embed[tok_t-1], ..., embed[tok_t-context+1]] + mix.b)
//   for each layer:  x = x + DenseFFN(x);  x = x + MoE(x)
//   logits = x out.w + out.b;  loss = mean cross-entropy + aux_loss_weight * sum of aux losses
//
// DenseFFN(x) = gelu(x w1 + b1) w2 + b2. MoE(x): router logits x router,
// softmax, top-k experts per token with gates renormalised over the k,
// capacity ceil(capacity_factor * tokens * k / experts) per expert filled
// in token order (the rest dropped: they contribute zero), each expert a
// DenseFFN of width expert_ffn, outputs summed weighted by the gates. The
// aux loss is the Switch load-balancing loss. Positions before the start of
// a sequence read zero embeddings. Weights are stored [in, out] (y = x W).
//
// There are no normalisation layers: residual branches start small (their
// output weights scaled by 1/sqrt(2 * layers)), which keeps training
// stable at the default learning rate.
//
// Everything is deterministic: the initial parameters are a pure function of
// the config, and the same parameters and batch give bit-identical
// gradients (matrix products use a fixed BLAS thread count, reductions run
// in a fixed order).
#pragma once

#include "model/config.hpp"
#include "model/model.hpp"

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

namespace cmesh::model {

/// The model for `c`, initialised from c.init_seed. Needs d_model, context,
/// ffn, expert_ffn >= 1 and 1 <= top_k <= experts (validate() checks configs
/// from files; here a violation is a programmer error and aborts).
std::unique_ptr<model> make_moe_lm(const moe_config& c);

/// Where the model computes. `emulated` runs the device code path (device
/// buffers, kernels called as a GPU's, weights uploaded and gradients
/// downloaded per micro-batch) with the CPU kernels and buffers that allow
/// no host access: the device path's test where there is no GPU.
enum class compute_device { cpu, cuda, emulated };

/// The model on `d`. cuda: on GPU `ordinal` modulo the visible devices
/// (made the calling thread's current device: call the model from this
/// thread), with the CUDA kernels and cuBLAS; errc::invalid_argument
/// (saying why) on a build without CUDA or a machine without a GPU.
expected<std::unique_ptr<model>> make_moe_lm_on(const moe_config& c, compute_device d,
                                                size_t ordinal = 0);

/// The tensors for `c` in buffer order: "embed", "mix.w", "mix.b", then per
/// layer "layerL.ffn.{w1,b1,w2,b2}", "layerL.moe.router",
/// "layerL.moe.expertE.{w1,b1,w2,b2}", then "out.w", "out.b".
std::vector<tensor_info> moe_lm_tensors(const moe_config& c);

/// Elements in the flat parameter buffer.
size_t moe_lm_parameter_count(const moe_config& c);

/// Writes the initial parameters. Each tensor is drawn from its own stream,
/// seeded by (init_seed, tensor name), so a tensor's initial value does not
/// depend on which other tensors exist.
void moe_lm_init(const moe_config& c, std::span<float> params);

/// The same network in double precision over caller-owned buffers, for
/// gradient checks: ADDS d(loss + weighted aux)/d(params) to `grads` (when
/// not empty). When `routing` is given it receives, for every layer, token
/// and choice (layer-major), the chosen expert e, or -1 - e when that
/// assignment was dropped for capacity: a perturbation that changes it
/// crosses a discontinuity.
step_stats moe_lm_forward_backward_f64(const moe_config& c, std::span<const double> params,
                                       std::span<double> grads, const batch& b,
                                       std::vector<int32_t>* routing = nullptr);

} // namespace cmesh::model
