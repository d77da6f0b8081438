// The manifest of a checkpoint: everything needed to trust and read the
// shard files beside it, written last (docs/design.md, Storage).
//
// The state is a few named flat arrays (the master weights, AdamW m and
// v), each split over shard files in element ranges. A tensor index
// (names, shapes, element offsets) cuts the indexed arrays into tensors;
// a piece is a run of elements of one array, inside one tensor (or
// between tensors), stored at an aligned offset of one file with its own
// xxh64. A tensor cut by a shard boundary, or longer than the writer's
// piece limit, is several pieces. Any element range can be read from the
// pieces that cover it, each verified: that is resharding.
//
// On disk: a 32-byte header (magic "CMSHCKPT", the format version, the
// body's length and xxh64, little-endian) and the msgpack body. The header
// makes a truncated or damaged manifest an error rather than a guess.
#pragma once

#include "core/error.hpp"
#include "core/job_config.hpp"

#include <msgpack.hpp>

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace cmesh::storage {

/// The version of the files written here. A manifest of another version
/// is refused with errc::bad_version, never guessed at; new fields go at
/// the end of a struct (an older manifest leaves them at their defaults).
constexpr uint32_t format_version = 1;
constexpr size_t manifest_header_bytes = 32;

/// Bytes per element of a dtype name ("f32", "f64", "bf16", "u8", "u32",
/// "u64"); 0 for a name it does not know.
size_t dtype_bytes(std::string_view dtype);

/// A named tensor of the indexed arrays: elements [offset, offset + size).
struct tensor_entry {
  std::string name;            // "layer1.moe.expert3.w1"
  std::vector<uint64_t> shape; // row-major
  uint64_t offset = 0;
  uint64_t size = 0;
  MSGPACK_DEFINE(name, shape, offset, size)
  bool operator==(const tensor_entry&) const = default;
};

/// A flat array of the state.
struct array_entry {
  std::string name;       // "weights", "adam_m", "adam_v"
  std::string dtype = "f32";
  uint64_t elements = 0;
  bool indexed = true;    // cut by the tensor index (false: pieces name only the array)
  MSGPACK_DEFINE(name, dtype, elements, indexed)
  bool operator==(const array_entry&) const = default;
};

struct file_entry {
  std::string name;   // in the checkpoint directory: "shard-0.bin"
  uint64_t bytes = 0; // its size
  MSGPACK_DEFINE(name, bytes)
  bool operator==(const file_entry&) const = default;
};

/// Elements [first, first + count) of one array, in one file.
struct piece_entry {
  uint32_t array = 0;  // into manifest::arrays
  uint32_t file = 0;   // into manifest::files
  int64_t tensor = -1; // into manifest::tensors; -1: no tensor (a gap, or an array not indexed)
  uint64_t first = 0;
  uint64_t count = 0;
  uint64_t offset = 0; // in bytes, a multiple of manifest::alignment
  uint64_t xxh64 = 0;  // of its count * dtype_bytes bytes, seed 0
  MSGPACK_DEFINE(array, file, tensor, first, count, offset, xxh64)
  bool operator==(const piece_entry&) const = default;
};

/// What the caller says about the state besides its arrays.
struct checkpoint_meta {
  uint64_t step = 0;             // the state after the committed steps 0 .. step-1
  uint64_t epoch = 0;
  uint32_t replicas = 0;         // the layout that wrote it: R groups x S ranks
  uint32_t ranks_per_group = 0;
  std::vector<uint32_t> expert_placement; // may be empty
  uint64_t data_position = 0;    // where the data loader resumes
  std::vector<uint64_t> rng_state;
  float loss_scale = 1;          // the dynamic loss scale and its good-step count
  uint64_t loss_scale_good_steps = 0;
  config_list config;            // the job's configuration (model::canonical_config)
  MSGPACK_DEFINE(step, epoch, replicas, ranks_per_group, expert_placement, data_position,
                 rng_state, loss_scale, loss_scale_good_steps, config)
  bool operator==(const checkpoint_meta&) const = default;
};

struct manifest {
  checkpoint_meta meta;
  uint64_t config_digest = 0;  // config_digest(meta.config)
  std::string cmesh_version;   // of the writer
  int64_t written_unix_ms = 0;
  uint64_t alignment = 4096;
  std::vector<tensor_entry> tensors;
  std::vector<array_entry> arrays;
  std::vector<file_entry> files;
  std::vector<piece_entry> pieces;
  MSGPACK_DEFINE(meta, config_digest, cmesh_version, written_unix_ms, alignment, tensors, arrays,
                 files, pieces)
  bool operator==(const manifest&) const = default;
};

/// Header and body, as written to disk.
std::vector<uint8_t> encode_manifest(const manifest& m);

/// The manifest in `bytes` (read from `path`, named in errors). Errors:
/// corrupt (bad magic, truncated, checksum, undecodable), bad_version.
/// The contents are not checked: validate() does that.
expected<manifest> decode_manifest(std::span<const uint8_t> bytes, const std::string& path);

/// Every field consistent: known dtypes, file names plain and distinct,
/// tensors inside the indexed arrays and not overlapping, pieces aligned,
/// inside their file, inside their tensor, and covering each array exactly
/// once, the config digest right. errc::corrupt naming `path` and the
/// field. Pure: file sizes on disk are the loader's business.
caf::error validate(const manifest& m, const std::string& path);

/// The part of validate() that needs no pieces: alignment, arrays, file
/// names, tensors (what a writer checks before it writes anything).
caf::error validate_layout(const manifest& m, const std::string& path);

/// validate() but for the arrays' coverage and the config digest: the
/// layout, and each piece consistent with it and its file, no two pieces
/// of a file sharing bytes. What a part (some shards of a checkpoint,
/// published for a committer) must pass before its pieces are taken.
caf::error validate_part(const manifest& m, const std::string& path);

/// "tensor layer0.w1 (weights)" or "elements [0, 4096) of adam_m": what a
/// piece holds, for errors.
std::string describe_piece(const manifest& m, const piece_entry& p);

/// The manifest as one JSON object (checksums as hex strings: JSON numbers
/// do not hold 64 bits everywhere).
std::string manifest_json(const manifest& m);

} // namespace cmesh::storage
