// Test helpers shared by the storage tests and the `cmesh checkpoint`
// test: a fresh directory that goes away, and a small state shaped like
// the trainer's (three f32 arrays indexed by named tensors) to write.
#pragma once

#include "core/hash.hpp"
#include "storage/writer.hpp"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace cmesh::storage::testing {

/// A fresh directory under /tmp, removed with everything in it when it goes.
class temp_dir {
public:
  temp_dir() {
    std::string tmpl = "/tmp/cmesh-storage-XXXXXX";
    if (!::mkdtemp(tmpl.data()))
      throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  ~temp_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

private:
  std::string path_;
};

/// Three f32 arrays of n elements (weights, adam_m, adam_v) and a tensor
/// index over them that leaves `tail` elements at the end in no tensor.
struct sample_state {
  std::vector<array_entry> arrays;
  std::vector<tensor_entry> tensors;
  std::vector<std::vector<float>> values; // per array
  checkpoint_meta meta;

  /// The slices of each of `s` shards: whole blocks of `block` elements,
  /// as even as they go, the rest in the last shard (the trainer's split).
  std::vector<std::vector<array_slice>> shards(size_t s, size_t block = 512) const {
    const size_t n = values[0].size(), blocks = n / block;
    std::vector<std::vector<array_slice>> out(s);
    size_t at = 0;
    for (size_t k = 0; k < s; ++k) {
      size_t c = (blocks / s + (k < blocks % s ? 1 : 0)) * block;
      if (k + 1 == s)
        c = n - at;
      for (size_t a = 0; a < arrays.size(); ++a)
        out[k].push_back(slice_of(arrays[a].name, at,
                                  std::span<const float>(values[a]).subspan(at, c)));
      at += c;
    }
    return out;
  }
};

inline bool contains(const std::string& text, const std::string& words) {
  return text.find(words) != std::string::npos;
}

/// Flips the lowest bit of one byte of a file (silent corruption).
inline void flip_byte(const std::string& path, uint64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  if (!f)
    throw std::runtime_error("cannot open " + path);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x01);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
}

inline config_list sample_config() {
  return {{"model.d_model", "32"}, {"model.layers", "1"}, {"model.experts", "4"},
          {"train.lr", "0.003"}};
}

/// `scale` multiplies the tensors' sizes (a bigger state for the disk-full test).
inline sample_state make_sample(uint64_t step, uint64_t seed = 1, uint64_t scale = 1,
                                uint64_t tail = 7) {
  sample_state s;
  const uint64_t d = 32 * scale;
  auto add = [&](std::string name, std::vector<uint64_t> shape) {
    uint64_t size = 1;
    for (auto x : shape)
      size *= x;
    uint64_t offset = s.tensors.empty() ? 0 : s.tensors.back().offset + s.tensors.back().size;
    s.tensors.push_back({std::move(name), std::move(shape), offset, size});
  };
  add("embed", {256, d});
  add("layer0.norm", {d});
  add("layer0.ffn.w1", {d, 100});
  add("layer0.ffn.w2", {100, d});
  add("out", {d, 256});
  const uint64_t n = s.tensors.back().offset + s.tensors.back().size + tail;
  for (const char* name : {"weights", "adam_m", "adam_v"}) {
    s.arrays.push_back({name, "f32", n, true});
    std::vector<float> v(n);
    for (uint64_t i = 0; i < n; ++i)
      v[i] = static_cast<float>(splitmix64(seed * 1000003 + s.arrays.size() * n + i) >> 40)
             / 16777216.0f - 0.5f;
    s.values.push_back(std::move(v));
  }
  s.meta.step = step;
  s.meta.epoch = 3;
  s.meta.replicas = 2;
  s.meta.ranks_per_group = 2;
  s.meta.expert_placement = {0, 1, 0, 1};
  s.meta.data_position = step * 64;
  s.meta.rng_state = {seed, splitmix64(seed)};
  s.meta.loss_scale = 65536.0f;
  s.meta.loss_scale_good_steps = 17;
  s.meta.config = sample_config();
  return s;
}

inline expected<std::string> write_sample(const std::string& root, const sample_state& s,
                                          size_t shards, write_options options = {}) {
  auto parts = s.shards(shards);
  return write_checkpoint(root, s.meta, s.arrays, s.tensors, parts, options);
}

} // namespace cmesh::storage::testing
