// The interface a model implements to be trained by cmesh: the built-in MoE
// language model implements it, and so can a user's own model.
//
// Parameters are named tensors stored contiguously in one fp32 buffer (the
// master weights), gradients likewise, in the same order, so that the
// runtime can reduce, shard and checkpoint them as one flat vector or by
// tensor. Tensors of experts say which layer and expert they belong to, so
// that experts can be placed on (and moved between) ranks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace cmesh::model {

struct tensor_info {
  std::string name;          // "layer1.moe.expert3.w1"
  std::vector<size_t> shape; // row-major
  size_t offset = 0;         // into the flat parameter buffer, in elements
  size_t size = 0;           // elements
  int layer = -1;            // -1: not in a layer (embedding, output)
  int expert = -1;           // -1: dense
};

/// A micro-batch of byte sequences: `sequences` rows of `seq_len + 1`
/// tokens; the model reads tokens [0, seq_len) and predicts [1, seq_len].
struct batch {
  size_t sequences = 0;
  size_t seq_len = 0;
  std::vector<uint8_t> tokens;
};

struct step_stats {
  double loss = 0;          // mean cross-entropy per predicted token
  double aux_loss = 0;      // load-balancing loss (already weighted)
  size_t tokens = 0;        // predicted tokens
  size_t dropped = 0;       // token-expert assignments over capacity
  std::vector<size_t> expert_load; // tokens routed to each expert, all layers
};

/// Expert parallelism: the S ranks of a replica group share the work of
/// each MoE layer's experts. For every micro-batch and layer the group
/// agrees where each expert runs (place(), a pure function of every rank's
/// routed rows, so every rank computes the same answer); a model that
/// supports it sends the rows routed to each expert to its hosts (split
/// evenly over the hosts of a replicated expert) and gets the outputs back
/// (and the same for the gradients). Every rank of the group must make the
/// same calls in the same order: a rank with fewer micro-batches takes part
/// with empty ones.
/// The static placement of `experts` experts over `ranks` ranks: expert e
/// on rank e * ranks / experts (blocks of experts / ranks when they divide).
inline uint32_t static_host(size_t expert, size_t ranks, size_t experts) {
  return static_cast<uint32_t>(expert * ranks / experts);
}

class expert_exchange {
public:
  virtual ~expert_exchange() = default;
  virtual size_t ranks() const = 0;
  virtual size_t rank() const = 0;
  /// All-to-all of variable blocks: send_counts[j] floats of `in` (blocks
  /// in rank order) go to rank j; recv_counts[j] floats from rank j land in
  /// `out`. False after a failure (this call's or an earlier one's): `out`
  /// is zeroed, the model goes on, and the caller votes the step down.
  virtual bool exchange(const float* in, const std::vector<size_t>& send_counts, float* out,
                        const std::vector<size_t>& recv_counts) = 0;
  /// Where each of `experts` experts of MoE layer `layer` runs: hosts[e]
  /// the ranks computing expert e, ascending, at least one. `rows[s *
  /// experts + e]` is the number of rows rank s routes to expert e. The
  /// default is static: expert e on rank e * ranks() / experts.
  virtual void place(size_t layer, const int64_t* rows, size_t experts,
                     std::vector<std::vector<uint32_t>>& hosts) {
    (void)layer;
    (void)rows;
    hosts.assign(experts, {});
    for (size_t e = 0; e < experts; ++e)
      hosts[e] = {static_host(e, ranks(), experts)};
  }
  /// All-to-all of `per_rank` int64 values to and from every rank.
  virtual bool exchange_counts(const int64_t* in, int64_t* out, size_t per_rank) = 0;
  /// Per source (exact mode): a host computes each source rank's rows as
  /// products of their own (the shapes the source would use alone), a
  /// replicated expert takes all of one source's rows on host source %
  /// replicas, and the weight gradient for another rank's rows goes to
  /// piece() instead of gradients(). So each micro-batch's gradient has
  /// the same bits as when it runs on one rank, in parts.
  virtual bool per_source() const { return false; }
  /// Per source: the gradient of the flat range [offset, offset + count)
  /// (one expert's tensors) for the rows of `source`; valid for the call.
  virtual void piece(size_t source, size_t offset, const float* values, size_t count) {
    (void)source;
    (void)offset;
    (void)values;
    (void)count;
  }
};

/// Full sharding (ZeRO-3 / FSDP style): the runtime keeps only a shard of
/// the weights and gradients on each rank, and the model borrows one unit
/// of tensors at a time (tensor indices [first, last) of tensors(),
/// contiguous in the flat layout): it fetches a unit's weights just before
/// it uses them, and in the backward pass takes a zeroed gradient buffer
/// for the unit and hands it back as soon as it is done with it. Buffers
/// hold the unit's tensors contiguously, in layout order. Every rank of a
/// replica group makes the same calls in the same order (they are
/// collective): a rank with fewer micro-batches runs empty ones, and a rank
/// fetches experts it does not compute. While a stream is set, the model
/// uses neither parameters() nor gradients().
class parameter_stream {
public:
  virtual ~parameter_stream() = default;
  /// The unit's weights, valid until release().
  virtual const float* fetch(size_t first, size_t last) = 0;
  /// Done with the unit's weights (for now).
  virtual void release(size_t first, size_t last) = 0;
  /// A zeroed buffer for the fetched unit's gradient, valid until reduce().
  virtual float* gradient(size_t first, size_t last) = 0;
  /// The unit's gradient is final for this micro-batch: the stream takes
  /// it. Once per unit and micro-batch, before release().
  virtual void reduce(size_t first, size_t last) = 0;
};

/// Whole weights: told, during a micro-batch's backward pass, as soon as a
/// unit's gradient in gradients() is complete for that micro-batch (the
/// unit's range then holds its sum over the micro-batches so far and is not
/// written again by it). Units as for parameter_stream: every micro-batch
/// reports every unit once, in the same order. The runtime starts a unit's
/// reduction there while the backward pass goes on.
class gradient_listener {
public:
  virtual ~gradient_listener() = default;
  virtual void unit_done(size_t first, size_t last) = 0;
};

class model {
public:
  virtual ~model() = default;

  virtual const std::vector<tensor_info>& tensors() const = 0;
  /// All parameters (fp32 master weights), tensors in order.
  virtual std::span<float> parameters() = 0;
  /// Gradients, same layout as parameters().
  virtual std::span<float> gradients() = 0;
  virtual void zero_gradients() = 0;

  /// Forward and backward on one micro-batch: ADDS d(loss)/d(params) to
  /// gradients(), where loss is the micro-batch's mean token cross-entropy
  /// plus the weighted auxiliary loss, times `loss_scale`.
  virtual step_stats forward_backward(const batch& b, float loss_scale = 1.0f) = 0;

  /// Loss only, no gradients.
  virtual step_stats evaluate(const batch& b) = 0;

  /// Runs the experts over the ranks of `x` from now on (nullptr: every
  /// expert here). False when the model does not support it.
  virtual bool set_expert_exchange(expert_exchange* x) { return x == nullptr; }

  /// Resident experts: from now on the model reads and writes only the
  /// flat ranges [first, second) of parameters() and gradients() (the
  /// dense tensors and the experts this rank hosts; zero_gradients zeroes
  /// only those), and the rest of both buffers goes back to the operating
  /// system. The caller runs the experts over an expert_exchange that
  /// hosts here only experts inside `ranges`. False when the model does
  /// not support it.
  virtual bool hold_only(std::span<const std::pair<size_t, size_t>> ranges) {
    (void)ranges;
    return false;
  }

  /// Streams the weights and gradients through `s` from now on (nullptr:
  /// both whole in parameters() and gradients()). False when the model
  /// does not support it.
  virtual bool set_parameter_stream(parameter_stream* s) { return s == nullptr; }

  /// Reports finished unit gradients to `l` from now on (nullptr: no
  /// more). False when the model does not support it.
  virtual bool set_gradient_listener(gradient_listener* l) { return l == nullptr; }

  /// Number of experts per MoE layer, and of MoE layers (0 for dense models).
  virtual size_t experts() const = 0;
  virtual size_t moe_layers() const = 0;

  /// Bytes the forward pass keeps for the backward pass, as allocated after
  /// the last step (0 when the model does not say).
  virtual size_t saved_activation_bytes() const { return 0; }

  /// A model that computes on a device can keep its gradient and weights
  /// there, so that the runtime gathers the weights and sums the gradient
  /// with communicators of that device's memory (NCCL on a GPU) instead of
  /// on the host. While kept: forward_backward reads the device's weights
  /// (device_parameters(), which the runtime fills: upload_parameters()
  /// copies a range of parameters() there, and a gather may write the rest
  /// in place) and adds to the device gradient only (gradients() is not
  /// written); zero_gradients() zeroes the device gradient; and
  /// download_gradients() copies a range of the gradient into gradients().
  /// evaluate() always reads parameters(). False when the model does not
  /// support it.
  virtual bool keep_gradients_on_device(bool on) { return !on; }
  /// The device gradient (the layout of gradients()), every write to it
  /// finished; nullptr when the gradient is not kept on a device. The
  /// runtime may write it (a sum in place).
  virtual float* device_gradients() { return nullptr; }
  /// Copies elements [offset, offset + count) of the device gradient into
  /// the same range of gradients().
  virtual void download_gradients(size_t offset, size_t count) {
    (void)offset;
    (void)count;
  }
  /// The device's weights (the layout of parameters()), every write to
  /// them finished; nullptr when not kept on a device.
  virtual float* device_parameters() { return nullptr; }
  /// Copies elements [offset, offset + count) of parameters() into the same
  /// range of the device's weights.
  virtual void upload_parameters(size_t offset, size_t count) {
    (void)offset;
    (void)count;
  }
};

} // namespace cmesh::model
