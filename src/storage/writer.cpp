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
#include <thread>

#include <fcntl.h>
#include <sys/stat.h>
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

enum class claim_op { take, give_back, query };

/// The partial directories of this process's live writers. The writers of
/// one step in one process each take a name of their own (begin takes the
/// first free one), and none may take another's directory for a leftover
/// and remove it. take: whether it was free (now taken); give_back:
/// whether it was taken; query: whether it is taken.
bool claim(const std::string& partial, claim_op op) {
  static std::mutex mu;
  static std::set<std::string> claimed;
  std::lock_guard lock(mu);
  switch (op) {
  case claim_op::take:
    return claimed.insert(partial).second;
  case claim_op::give_back:
    return claimed.erase(partial) > 0;
  case claim_op::query:
    return claimed.count(partial) > 0;
  }
  return false;
}

bool published(const std::string& dir) {
  return ::access(join(dir, part_file).c_str(), F_OK) == 0;
}

/// How long ago a part was published (its part file written).
std::chrono::milliseconds published_ago(const std::string& dir) {
  struct stat sb {};
  if (::stat(join(dir, part_file).c_str(), &sb) != 0)
    return std::chrono::milliseconds::max();
  const auto when = std::chrono::system_clock::time_point(
    std::chrono::duration_cast<std::chrono::system_clock::duration>(
      std::chrono::seconds(sb.st_mtim.tv_sec) + std::chrono::nanoseconds(sb.st_mtim.tv_nsec)));
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now()
                                                               - when);
}

/// The partial directory of a new writer of `step`, claimed for it: the
/// first of this process's names that no live writer of the process holds
/// and that is not a published part (a committer's to adopt). Claimed
/// before it is looked at: a part is published only under a claim, so an
/// unpublished directory found under ours stays unpublished.
std::string claim_partial(const std::string& root, uint64_t step) {
  const auto host = this_host();
  for (uint32_t n = 0;; ++n) {
    auto path = join(root, partial_dir_name(step, ::getpid(), host, n));
    if (!claim(path, claim_op::take))
      continue;
    if (!published(path))
      return path;
    claim(path, claim_op::give_back);
  }
}

int64_t now_unix_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
           std::chrono::system_clock::now().time_since_epoch())
    .count();
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
  w.partial_ = claim_partial(root, w.m_.meta.step);
  w.open_ = true; // from here the destructor removes it, and gives the claim back
  // Not another writer's, nor a part (claim_partial): a leftover of a dead
  // process that had this pid.
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
  claim(partial_, claim_op::give_back);
}

caf::error checkpoint_writer::fail(caf::error err) {
  if (open_) {
    if (auto e = remove_tree(partial_))
      spdlog::warn("checkpoint: a failed write left {}: {}", partial_, describe(e));
    claim(partial_, claim_op::give_back);
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

caf::error checkpoint_writer::write_manifest_as(std::string_view temp_name,
                                                std::string_view name) {
  const auto bytes = encode_manifest(m_);
  const auto temp = join(partial_, temp_name);
  auto f = open_file(temp, O_WRONLY | O_CREAT | O_TRUNC);
  if (!f)
    return f.error();
  if (auto err = write_at(*f, std::as_bytes(std::span(bytes)), 0, temp))
    return err;
  if (auto err = sync_file(*f, temp))
    return err;
  if (auto err = rename_path(temp, join(partial_, name)))
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
  claim(partial_, claim_op::give_back);
  open_ = false;
  return sync_dir(root_);
}

expected<std::string> checkpoint_writer::commit() {
  if (failed_)
    return failed_;
  if (auto err = validate(m_, partial_))
    return fail(recode(err, errc::invalid_argument, "the shards do not hold the checkpoint: "));
  m_.written_unix_ms = now_unix_ms();
  if (auto err = write_manifest_as(manifest_temp_file, manifest_file))
    return fail(err);
  // After the rename the checkpoint is whole; an error of the last fsync
  // only says that its name may not be durable yet.
  if (auto err = move_into_place())
    return fail(err);
  return final_;
}

caf::error checkpoint_writer::publish_part() {
  if (failed_)
    return failed_;
  if (m_.files.empty())
    return make_error(errc::invalid_argument,
                      fmt::format("step {}: no shard written into {}: nothing to publish",
                                  m_.meta.step, partial_));
  m_.written_unix_ms = now_unix_ms();
  if (auto err = write_manifest_as(part_temp_file, part_file))
    return fail(err);
  // The directory is the committer's now: this writer's destructor leaves
  // it, and the next writers of the step in this process pass it by.
  claim(partial_, claim_op::give_back);
  open_ = false;
  failed_ = make_error(errc::invalid_argument,
                       fmt::format("step {}: the shards in {} are published as a part already: "
                                   "the writer is done",
                                   m_.meta.step, partial_));
  return {};
}

namespace {

constexpr uint64_t part_limit = uint64_t{1} << 30;
constexpr auto part_poll = std::chrono::milliseconds(10);

caf::error part_corrupt(const std::string& dir, const std::string& what) {
  return make_error(errc::corrupt, fmt::format("{}: {}", dir, what));
}

/// What makes a part another checkpoint's than `mine`: "" when none.
std::string part_differs(const manifest& part, const manifest& mine) {
  if (part.meta.step != mine.meta.step)
    return fmt::format("its step {} is not the committer's {}", part.meta.step, mine.meta.step);
  if (part.config_digest != mine.config_digest)
    return fmt::format("its config digest {:016x} is not the committer's {:016x}",
                       part.config_digest, mine.config_digest);
  if (part.arrays != mine.arrays)
    return "its arrays are not the committer's";
  if (part.tensors != mine.tensors)
    return "its tensors are not the committer's";
  if (part.alignment != mine.alignment)
    return fmt::format("its alignment {} is not the committer's {}", part.alignment,
                       mine.alignment);
  return {};
}

/// Each file of a part is a shard file there, of the size the part says.
caf::error check_part_files(const manifest& part, const std::string& dir) {
  if (part.files.empty())
    return part_corrupt(dir, "a part that holds no file");
  for (const auto& f : part.files) {
    if (!parse_shard_file(f.name))
      return part_corrupt(dir, fmt::format("{} is not a shard file", f.name));
    const auto path = join(dir, f.name);
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0)
      return errno == ENOENT ? part_corrupt(dir, fmt::format("{} missing", f.name))
                             : io_error("stat", path, errno);
    if (static_cast<uint64_t>(st.st_size) != f.bytes)
      return part_corrupt(dir, fmt::format("{}: {} bytes, the part says {}", f.name, st.st_size,
                                           f.bytes));
  }
  return {};
}

/// The part published in `dir`, checked against the committer's manifest.
expected<manifest> read_part(const std::string& dir, const manifest& mine) {
  const auto path = join(dir, part_file);
  auto bytes = read_whole(path, part_limit);
  if (!bytes)
    return bytes.error();
  auto part = decode_manifest(*bytes, path);
  if (!part)
    return part.error();
  if (auto what = part_differs(*part, mine); !what.empty())
    return part_corrupt(dir, "not a part of this checkpoint: " + what);
  if (auto err = validate_part(*part, dir))
    return err;
  if (auto err = check_part_files(*part, dir))
    return err;
  return part;
}

/// A committer's look for the parts of its step: each part read once, and
/// chosen when every shard it holds is still missing.
struct part_search {
  const manifest& mine;
  std::string root, own; // own: the committer's partial directory
  std::set<uint32_t> missing;
  std::vector<std::pair<std::string, manifest>> chosen;
  std::set<std::string> seen;

  caf::error scan();
  bool choose(const std::string& dir, manifest& part);
};

caf::error part_search::scan() {
  auto names = dir_entries(root);
  if (!names)
    return names.error();
  std::sort(names->begin(), names->end());
  for (const auto& name : *names) {
    const auto owner = parse_partial_dir(name);
    const auto dir = join(root, name);
    if (!owner || owner->step != mine.meta.step || dir == own || seen.count(dir) > 0
        || !published(dir))
      continue;
    auto part = read_part(dir, mine);
    if (!part && !published(dir))
      continue; // removed meanwhile (its writer's remove_own_stale_parts)
    if (!part)
      return part.error();
    seen.insert(dir);
    if (!choose(dir, *part))
      spdlog::warn("checkpoint: {} holds shards that step {} has already or does not need: "
                   "left alone", dir, mine.meta.step);
  }
  return {};
}

bool part_search::choose(const std::string& dir, manifest& part) {
  std::vector<uint32_t> shards;
  for (const auto& f : part.files)
    shards.push_back(*parse_shard_file(f.name)); // checked by read_part
  if (!std::all_of(shards.begin(), shards.end(), [&](uint32_t k) { return missing.count(k); }))
    return false;
  for (auto k : shards)
    missing.erase(k);
  chosen.emplace_back(dir, std::move(part));
  return true;
}

} // namespace

caf::error checkpoint_writer::adopt_parts(uint32_t shards, std::chrono::milliseconds timeout) {
  if (failed_)
    return failed_;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  part_search search{m_, root_, partial_, {}, {}, {}};
  for (uint32_t k = 0; k < shards; ++k)
    search.missing.insert(k);
  for (const auto& f : m_.files)
    if (auto k = parse_shard_file(f.name))
      search.missing.erase(*k);
  while (!search.missing.empty()) {
    if (auto err = search.scan())
      return code_of(err) == errc::unreachable ? fail(err) : err;
    if (search.missing.empty())
      break;
    if (std::chrono::steady_clock::now() >= deadline)
      return make_error(errc::timeout,
                        fmt::format("step {}: after {} ms no part in {} holds shard{} {} (of {})",
                                    m_.meta.step, timeout.count(), root_,
                                    search.missing.size() > 1 ? "s" : "",
                                    fmt::join(search.missing, ", "), shards));
    std::this_thread::sleep_for(part_poll);
  }
  for (const auto& [dir, part] : search.chosen)
    if (auto err = take_part(dir, part))
      return fail(err);
  return {};
}

caf::error checkpoint_writer::take_part(const std::string& dir, const manifest& part) {
  // Unpublished first: a crash midway leaves no part naming files it lost.
  const auto marker = join(dir, part_file);
  if (::unlink(marker.c_str()) != 0)
    return io_error("unlink", marker, errno);
  const auto base = static_cast<uint32_t>(m_.files.size());
  for (const auto& f : part.files) {
    if (auto err = rename_path(join(dir, f.name), join(partial_, f.name)))
      return err;
    m_.files.push_back(f);
  }
  for (auto p : part.pieces) {
    p.file += base;
    m_.pieces.push_back(p);
  }
  return remove_tree(dir);
}

expected<std::vector<std::string>> remove_own_stale_parts(const std::string& root,
                                                          uint64_t step,
                                                          std::chrono::milliseconds older_than) {
  auto names = dir_entries(root);
  if (!names)
    return names.error();
  std::sort(names->begin(), names->end());
  const auto pid = static_cast<int64_t>(::getpid());
  const auto host = this_host();
  std::vector<std::string> removed;
  for (const auto& name : *names) {
    const auto owner = parse_partial_dir(name);
    const auto dir = join(root, name);
    if (!owner || owner->pid != pid || owner->host != host || owner->step >= step
        || !published(dir) || claim(dir, claim_op::query) || published_ago(dir) < older_than)
      continue;
    if (auto err = remove_tree(dir))
      return err;
    removed.push_back(dir);
  }
  return removed;
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
