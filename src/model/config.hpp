// Configuration of a training run, read from TOML. Every key has a default
// that trains the built-in workload in minutes on 2 CPU cores; an unknown
// key, a wrong type or an impossible value is a clear error.
#pragma once

#include "core/error.hpp"
#include "core/job_config.hpp"

#include <cstdint>
#include <string>
#include <vector>

namespace cmesh::model {

struct moe_config {
  size_t d_model = 64;
  size_t context = 8;        // causal window of previous tokens mixed per position
  size_t layers = 2;
  size_t ffn = 128;          // dense FFN hidden size
  size_t experts = 4;
  size_t top_k = 2;
  size_t expert_ffn = 64;    // expert FFN hidden size
  double capacity_factor = 1.25;
  double aux_loss_weight = 0.01;
  uint64_t init_seed = 1;
  // What the forward pass computes in and keeps for the backward pass:
  // "fp32", or "bf16" (each activation rounded to bf16 where a bf16 kernel
  // would write it, and stored as bf16 between the passes; matrix products
  // accumulate in fp32, the router, the loss and all gradients stay fp32).
  // In a config file it follows train.precision unless given.
  std::string activations = "fp32";
  // How matrix products take their operands: "fp32"; "bf16" (each operand
  // rounded to bf16, sums in fp32: tensor cores on a GPU, the same rounding
  // on the CPU; see kernels::gemm_math); or "auto": bf16 on a device (a GPU,
  // or the emulated one) when the activations are bf16, fp32 otherwise (on
  // the CPU the rounding only costs: OpenBLAS multiplies in fp32 anyway).
  std::string products = "auto";
};

/// Whether the products round their operands to bf16 (model.products),
/// on a device or on the CPU.
inline bool bf16_products(const moe_config& c, bool on_device) {
  return c.products == "bf16" || (c.products == "auto" && on_device && c.activations == "bf16");
}

struct train_config {
  size_t steps = 300;
  size_t global_batch = 32;  // sequences per step, over all replica groups
  size_t micro_batch = 4;    // sequences per micro-batch (the unit of contribution)
  size_t seq_len = 64;
  double lr = 3e-3;
  double weight_decay = 0.01;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  size_t warmup = 20;
  double grad_clip = 1.0;    // 0 turns clipping off
  uint64_t seed = 1;         // data order
  size_t log_every = 10;
  // Every this many committed steps (and at step 0) the replica groups
  // compare hashes of their weights and optimizer state in the commit
  // vote; a group that differs from the majority is fenced (0: off).
  size_t verify_every = 50;
  bool exact = false;        // fixed-point gradient sums: bit-identical whatever the layout
  std::string precision = "fp32"; // "fp32" or "bf16"
  double loss_scale = 65536; // bf16: the dynamic loss scale's starting value
  // Within a replica group: "optimizer" shards the fp32 master and AdamW
  // state (whole working weights and gradient on every rank); "full" also
  // streams the weights and gradients tensor by tensor (gathered just
  // before use, reduce-scattered and dropped right after: ZeRO-3 / FSDP).
  std::string sharding = "optimizer";
  // Run the step's collectives on a thread of their own while the model
  // computes. Full sharding: the next unit's weights are gathered, and the
  // last unit's gradient reduce-scattered, while a unit computes (one more
  // unit's weights and gradient held). Whole weights: each unit's gradient
  // is summed over the groups (one rank per group: all-reduced; several:
  // reduce-scattered over the group, then all-reduced over the shard's
  // holders) as soon as the step's last micro-batch is done with it. Not
  // with exact mode.
  bool overlap = true;
  // Experts split over a group's ranks (S > 1; exact mode too): "balanced"
  // places them per micro-batch by load (the placement solver), with at
  // most expert_replicas extra copies of hot experts; "static" gives each
  // rank a fixed block of E/S.
  std::string expert_placement = "balanced";
  // Where the experts' weights, gradients and optimizer state live with
  // several ranks per group: "replicated" (every rank holds every expert's
  // weights and gradient; the optimizer state is sharded like the dense
  // layers') or "resident" (each expert only on the rank hosting it, the
  // static block e * S / E; tokens travel to it, its weights never do).
  // Resident experts need optimizer sharding, the CPU and fp32 for now.
  std::string experts = "replicated";
  size_t expert_replicas = 0;
  // Where each rank computes its forward/backward: "cpu", "cuda" (a GPU per
  // rank; the optimizer stays on the host), or "emulated" (the device code
  // path on the CPU, in memory it treats as a device's: for tests where
  // there is no GPU).
  std::string device = "cpu";
  // On a device, where the gradient is summed over the ranks: "device"
  // (NCCL on GPUs; the host backend for "emulated") unless exact, else on
  // the host; "host": always on the host.
  std::string gradient_collectives = "device";
};

struct data_config {
  std::string file;          // empty: the built-in synthetic corpus
};

struct run_config {
  moe_config model;
  train_config train;
  data_config data;
};

/// Parses TOML text. Errors: invalid_argument naming the key and the problem.
expected<run_config> parse_config(const std::string& toml_text);

/// Reads and parses a file. Errors: invalid_argument (also for a missing file).
expected<run_config> load_config(const std::string& path);

/// Every key a config file may set, as "section.key", sorted.
std::vector<std::string> config_keys();

/// Checks a config against a layout of `replicas` groups of `ranks_per_group`.
caf::error validate(const run_config& c, size_t replicas, size_t ranks_per_group);

/// The part of a job's canonical configuration that needs no run config:
/// cmesh.version, layout.replicas and layout.ranks_per_group (what a
/// coordinator given no --config or job flags still knows).
config_list canonical_layout(size_t replicas, size_t ranks_per_group);

/// The canonical description of a run: every key that defines its result,
/// in a fixed order, values as text (doubles in the shortest form that
/// reads back exactly). canonical_layout, then every model.* key, every
/// train.* key but log_every (cosmetic), and data.identity: "synthetic", or
/// the xxh64 and size of the data file's bytes (not its path, which may
/// differ between nodes; the file is read once, here). Error:
/// invalid_argument when the data file cannot be read.
expected<config_list> canonical_config(const run_config& c, size_t replicas,
                                       size_t ranks_per_group);

} // namespace cmesh::model
