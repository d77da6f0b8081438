#include "storage/writer.hpp"

#include "storage/io.hpp"
#include "storage/paths.hpp"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <mutex>
#include <set>

#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#ifndef CMESH_VERSION
#define CMESH_VERSION "unknown"
#endif

namespace cmesh::storage {

std::vector<piece_entry> cut_pieces(const manifest& layout, uint32_t array, uint64_t first,
                                    uint64_t count, uint64_t max_piece_elements) {
  struct span_of {
    uint64_t begin, end;
    int64_t tensor;
  };
  std::vector<span_of> tensors; // non-empty tensors by offset (they do not overlap)
  if (layout.arrays[array].indexed)
    for (size_t i = 0; i < layout.tensors.size(); ++i)
      if (const auto& t = layout.tensors[i]; t.size > 0)
        tensors.push_back({t.offset, t.offset + t.size, static_cast<int64_t>(i)});
  std::sort(tensors.begin(), tensors.end(), [](auto& a, auto& b) { return a.begin < b.begin; });
  max_piece_elements = std::max<uint64_t>(max_piece_elements, 1);
  std::vector<piece_entry> out;
  const uint64_t end = first + count;
  for (uint64_t pos = first; pos < end;) {
    // The first tensor that ends after pos: pos is inside it, or in the gap before it.
    auto t = std::upper_bound(tensors.begin(), tensors.end(), pos,
                              [](uint64_t p, const span_of& s) { return p < s.end; });
    uint64_t stop = end;
    int64_t tensor = -1;
    if (t != tensors.end() && t->begin <= pos) {
      stop = std::min(end, t->end);
      tensor = t->tensor;
    } else if (t != tensors.end()) {
      stop = std::min(end, t->begin);
    }
    for (; pos < stop; pos = std::min(stop, pos + max_piece_elements)) {
      piece_entry p;
      p.array = array;
      p.tensor = tensor;
      p.first = pos;
      p.count = std::min(stop, pos + max_piece_elements) - pos;
      out.push_back(p);
    }
  }
  return out;
}

namespace {

/// The partial directories of this process's live writers: two writers of
/// one step in one process would share a name, and the second must not
/// take the first one's directory for a leftover and remove it.
bool claim(const std::string& partial, bool take) {
  static std::mutex mu;
  static std::set<std::string> claimed;
  std::lock_guard lock(mu);
  if (!take)
    return claimed.erase(partial) > 0;
  return claimed.insert(partial).second;
}

} // namespace

expected<checkpoint_writer> checkpoint_writer::begin(const std::string& root,
                                                     checkpoint_meta meta,
                                                     std::vector<array_entry> arrays,
                                                     std::vector<tensor_entry> tensors,
                                                     write_options options) {
  checkpoint_writer w;
  w.options_ = options;
  w.m_.alignment = options.alignment;
  w.m_.arrays = std::move(arrays);
  w.m_.tensors = std::move(tensors);
  if (auto err = validate_layout(w.m_, "checkpoint layout"))
    return recode(err, errc::invalid_argument);
  w.m_.config_digest = config_digest(meta.config);
  w.m_.meta = std::move(meta);
  w.m_.cmesh_version = CMESH_VERSION;
  std::error_code ec;
  if (std::filesystem::create_directories(root, ec) && !ec) {
    // A new root's own name must be durable before anything in it is.
    auto path = std::filesystem::path(root).lexically_normal();
    if (!path.has_filename()) // "a/b/"
      path = path.parent_path();
    auto parent = path.parent_path().string();
    if (auto err = sync_dir(parent.empty() ? "." : parent))
      return err;
  }
  if (ec)
    return io_error("mkdir", root, ec.value());
  w.root_ = root;
  w.final_ = join(root, step_dir_name(w.m_.meta.step));
  w.partial_ = join(root, partial_dir_name(w.m_.meta.step, ::getpid(), this_host()));
  if (!claim(w.partial_, true))
    return make_error(errc::invalid_argument,
                      fmt::format("step {} is already being written into {} by this process",
                                  w.m_.meta.step, w.partial_));
  w.open_ = true; // from here the destructor removes it, and gives the claim back
  // Not another writer's (claimed above): this process's own leftover.
  if (auto err = remove_tree(w.partial_))
    return err;
  if (auto err = make_dir(w.partial_))
    return err;
  return w;
}

checkpoint_writer::checkpoint_writer(checkpoint_writer&& other) noexcept
    : root_(std::move(other.root_)), partial_(std::move(other.partial_)),
      final_(std::move(other.final_)), m_(std::move(other.m_)), options_(other.options_),
      failed_(std::move(other.failed_)), open_(other.open_) {
  other.open_ = false;
}

checkpoint_writer::~checkpoint_writer() {
  if (!open_)
    return;
  if (auto err = remove_tree(partial_))
    spdlog::warn("checkpoint: an unfinished write left {}: {}", partial_, describe(err));
  claim(partial_, false);
}

caf::error checkpoint_writer::fail(caf::error err) {
  if (open_) {
    if (auto e = remove_tree(partial_))
      spdlog::warn("checkpoint: a failed write left {}: {}", partial_, describe(e));
    claim(partial_, false);
    open_ = false;
  }
  failed_ = err;
  return err;
}

caf::error checkpoint_writer::write_shard(uint32_t shard, std::span<const array_slice> slices) {
  if (failed_)
    return failed_;
  const auto name = shard_file_name(shard);
  if (std::any_of(m_.files.begin(), m_.files.end(), [&](auto& f) { return f.name == name; }))
    return make_error(errc::invalid_argument, fmt::format("{} written twice", name));
  std::vector<piece_entry> pieces;
  const auto file_index = static_cast<uint32_t>(m_.files.size());
  std::vector<std::span<const std::byte>> data; // each piece's bytes
  for (const auto& s : slices) {
    auto a = std::find_if(m_.arrays.begin(), m_.arrays.end(),
                          [&](auto& x) { return x.name == s.array; });
    if (a == m_.arrays.end())
      return make_error(errc::invalid_argument, fmt::format("{}: no array {}", name, s.array));
    const size_t eb = dtype_bytes(a->dtype);
    const uint64_t n = s.bytes.size() / eb;
    if (s.bytes.size() % eb != 0 || s.first > a->elements || n > a->elements - s.first)
      return make_error(errc::invalid_argument,
                        fmt::format("{}: a slice of {} bytes at element {} does not fit array {} "
                                    "({} elements of {} bytes)",
                                    name, s.bytes.size(), s.first, s.array, a->elements, eb));
    const auto array = static_cast<uint32_t>(a - m_.arrays.begin());
    for (auto p : cut_pieces(m_, array, s.first, n, options_.max_piece_bytes / eb)) {
      p.file = file_index;
      data.push_back(s.bytes.subspan((p.first - s.first) * eb, p.count * eb));
      pieces.push_back(p);
    }
  }
  const auto path = join(partial_, name);
  auto f = open_file(path, O_WRONLY | O_CREAT | O_EXCL);
  if (!f)
    return fail(f.error());
  uint64_t at = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    at = (at + m_.alignment - 1) / m_.alignment * m_.alignment;
    pieces[i].offset = at;
    pieces[i].xxh64 = XXH64(data[i].data(), data[i].size(), 0);
    if (auto err = write_at(*f, data[i], at, path))
      return fail(err);
    at += data[i].size();
  }
  if (auto err = sync_file(*f, path))
    return fail(err);
  m_.files.push_back({name, at});
  m_.pieces.insert(m_.pieces.end(), pieces.begin(), pieces.end());
  return {};
}

caf::error checkpoint_writer::write_manifest() {
  const auto bytes = encode_manifest(m_);
  const auto temp = join(partial_, manifest_temp_file);
  auto f = open_file(temp, O_WRONLY | O_CREAT | O_TRUNC);
  if (!f)
    return f.error();
  if (auto err = write_at(*f, std::as_bytes(std::span(bytes)), 0, temp))
    return err;
  if (auto err = sync_file(*f, temp))
    return err;
  if (auto err = rename_path(temp, join(partial_, manifest_file)))
    return err;
  return sync_dir(partial_);
}

caf::error checkpoint_writer::move_into_place() {
  // rename(2) replaces only an empty directory; a checkpoint of the same
  // step (written before a restart from an older one) is swapped out in
  // one step, then removed under the partial name, so the step's name
  // always holds a whole checkpoint.
  auto err = rename_path(partial_, final_);
  if (err && std::filesystem::exists(final_)) {
    if (auto swap = rename_path(partial_, final_, true))
      return swap;
    if (auto e = remove_tree(partial_))
      spdlog::warn("checkpoint: the replaced {} left {}: {}", final_, partial_, describe(e));
    err = {};
  }
  if (err)
    return err;
  claim(partial_, false);
  open_ = false;
  return sync_dir(root_);
}

expected<std::string> checkpoint_writer::commit() {
  if (failed_)
    return failed_;
  if (auto err = validate(m_, partial_))
    return fail(recode(err, errc::invalid_argument, "the shards do not hold the checkpoint: "));
  m_.written_unix_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                         std::chrono::system_clock::now().time_since_epoch())
                         .count();
  if (auto err = write_manifest())
    return fail(err);
  // After the rename the checkpoint is whole; an error of the last fsync
  // only says that its name may not be durable yet.
  if (auto err = move_into_place())
    return fail(err);
  return final_;
}

expected<std::string> write_checkpoint(const std::string& root, checkpoint_meta meta,
                                       std::vector<array_entry> arrays,
                                       std::vector<tensor_entry> tensors,
                                       std::span<const std::vector<array_slice>> shards,
                                       write_options options) {
  auto w = checkpoint_writer::begin(root, std::move(meta), std::move(arrays), std::move(tensors),
                                    options);
  if (!w)
    return w.error();
  for (size_t k = 0; k < shards.size(); ++k)
    if (auto err = w->write_shard(static_cast<uint32_t>(k), shards[k]))
      return err;
  return w->commit();
}

} // namespace cmesh::storage
