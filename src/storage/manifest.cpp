#include "storage/manifest.hpp"

#include "storage/paths.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>

#include <xxhash.h>

namespace cmesh::storage {

namespace {

constexpr char header_magic[8] = {'C', 'M', 'S', 'H', 'C', 'K', 'P', 'T'};

void put_u32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i)
    p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void put_u64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i)
    p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint64_t get_le(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i)
    v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

caf::error corrupt(const std::string& path, const std::string& what) {
  return make_error(errc::corrupt, fmt::format("{}: {}", path, what));
}

} // namespace

size_t dtype_bytes(std::string_view dtype) {
  if (dtype == "f32" || dtype == "u32")
    return 4;
  if (dtype == "f64" || dtype == "u64")
    return 8;
  if (dtype == "bf16")
    return 2;
  if (dtype == "u8")
    return 1;
  return 0;
}

std::vector<uint8_t> encode_manifest(const manifest& m) {
  msgpack::sbuffer body;
  msgpack::pack(body, m);
  std::vector<uint8_t> out(manifest_header_bytes + body.size());
  std::memcpy(out.data(), header_magic, sizeof(header_magic));
  put_u32(out.data() + 8, format_version);
  put_u32(out.data() + 12, 0);
  put_u64(out.data() + 16, body.size());
  put_u64(out.data() + 24, XXH64(body.data(), body.size(), 0));
  std::memcpy(out.data() + manifest_header_bytes, body.data(), body.size());
  return out;
}

expected<manifest> decode_manifest(std::span<const uint8_t> bytes, const std::string& path) {
  if (bytes.size() < manifest_header_bytes)
    return corrupt(path, fmt::format("truncated: {} bytes, shorter than its {}-byte header",
                                     bytes.size(), manifest_header_bytes));
  if (std::memcmp(bytes.data(), header_magic, sizeof(header_magic)) != 0)
    return corrupt(path, "not a cmesh checkpoint manifest (bad magic)");
  auto version = static_cast<uint32_t>(get_le(bytes.data() + 8, 4));
  if (version != format_version)
    return make_error(errc::bad_version,
                      fmt::format("{}: checkpoint format {}; this cmesh reads format {}", path,
                                  version, format_version));
  const uint64_t length = get_le(bytes.data() + 16, 8), sum = get_le(bytes.data() + 24, 8);
  auto body = bytes.subspan(manifest_header_bytes);
  if (body.size() != length)
    return corrupt(path, fmt::format("{}: {} bytes of body, the header says {}",
                                     body.size() < length ? "truncated" : "trailing bytes",
                                     body.size(), length));
  if (XXH64(body.data(), body.size(), 0) != sum)
    return corrupt(path, "checksum mismatch of the manifest body");
  // Each element needs at least one byte, so the size bounds every count.
  const size_t n = body.size();
  msgpack::unpack_limit limit(n, n, n, n, n, 16);
  try {
    size_t off = 0;
    auto oh = msgpack::unpack(reinterpret_cast<const char*>(body.data()), n, off, nullptr,
                              nullptr, limit);
    manifest m;
    oh.get().convert(m);
    return m;
  } catch (const std::exception& e) {
    return corrupt(path, fmt::format("undecodable manifest: {}", e.what()));
  }
}

std::string describe_piece(const manifest& m, const piece_entry& p) {
  const auto& array = p.array < m.arrays.size() ? m.arrays[p.array].name : std::string("?");
  if (p.tensor >= 0 && static_cast<size_t>(p.tensor) < m.tensors.size())
    return fmt::format("tensor {} ({})", m.tensors[static_cast<size_t>(p.tensor)].name, array);
  return fmt::format("elements [{}, {}) of {}", p.first, p.first + p.count, array);
}

namespace {

bool plain_file_name(std::string_view name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string_view::npos
         && name.find('\0') == std::string_view::npos && name != manifest_file
         && name != manifest_temp_file && name != part_file && name != part_temp_file;
}

caf::error check_arrays_and_files(const manifest& m, const std::string& path) {
  if (m.alignment == 0 || m.alignment > (uint64_t{1} << 30))
    return corrupt(path, fmt::format("alignment {} out of range", m.alignment));
  std::set<std::string> names;
  for (const auto& a : m.arrays) {
    const size_t eb = dtype_bytes(a.dtype);
    if (a.name.empty() || !names.insert(a.name).second)
      return corrupt(path, fmt::format("array name '{}' empty or repeated", a.name));
    if (eb == 0)
      return corrupt(path, fmt::format("array {}: unknown dtype '{}'", a.name, a.dtype));
    if (a.elements > std::numeric_limits<uint64_t>::max() / 2 / eb)
      return corrupt(path, fmt::format("array {}: {} elements out of range", a.name, a.elements));
  }
  names.clear();
  for (const auto& f : m.files)
    if (!plain_file_name(f.name) || !names.insert(f.name).second)
      return corrupt(path, fmt::format("file name '{}' not a plain name, or repeated", f.name));
  return {};
}

caf::error check_tensors(const manifest& m, const std::string& path) {
  uint64_t indexed_elements = std::numeric_limits<uint64_t>::max();
  for (const auto& a : m.arrays)
    if (a.indexed)
      indexed_elements = std::min(indexed_elements, a.elements);
  std::vector<const tensor_entry*> sorted;
  for (const auto& t : m.tensors) {
    uint64_t product = 1;
    for (auto d : t.shape)
      product = d != 0 && product > std::numeric_limits<uint64_t>::max() / d ? 0 : product * d;
    if (!t.shape.empty() && product != t.size)
      return corrupt(path, fmt::format("tensor {}: shape holds {} elements, size says {}", t.name,
                                       product, t.size));
    if (t.offset > indexed_elements || t.size > indexed_elements - t.offset)
      return corrupt(path, fmt::format("tensor {}: elements [{}, {}) past the end of the indexed "
                                       "arrays ({} elements)",
                                       t.name, t.offset, t.offset + t.size, indexed_elements));
    sorted.push_back(&t);
  }
  std::sort(sorted.begin(), sorted.end(),
            [](auto* a, auto* b) { return a->offset < b->offset; });
  for (size_t i = 1; i < sorted.size(); ++i)
    if (sorted[i]->offset < sorted[i - 1]->offset + sorted[i - 1]->size)
      return corrupt(path, fmt::format("tensors {} and {} overlap", sorted[i - 1]->name,
                                       sorted[i]->name));
  return {};
}

/// Whether [first, first + count) meets a tensor's elements.
bool meets_a_tensor(const manifest& m, uint64_t first, uint64_t count) {
  return std::any_of(m.tensors.begin(), m.tensors.end(), [&](const tensor_entry& t) {
    return t.size > 0 && t.offset < first + count && first < t.offset + t.size;
  });
}

caf::error check_piece(const manifest& m, const piece_entry& p, const std::string& path) {
  if (p.array >= m.arrays.size() || p.file >= m.files.size()
      || p.tensor < -1 || p.tensor >= static_cast<int64_t>(m.tensors.size()))
    return corrupt(path, fmt::format("a piece refers to array {}, file {}, tensor {} that do not "
                                     "exist", p.array, p.file, p.tensor));
  const auto& a = m.arrays[p.array];
  const auto& f = m.files[p.file];
  const auto what = describe_piece(m, p);
  if (p.count == 0 || p.first > a.elements || p.count > a.elements - p.first)
    return corrupt(path, fmt::format("{}: elements [{}, {}) outside the array's {}", what,
                                     p.first, p.first + p.count, a.elements));
  const uint64_t bytes = p.count * dtype_bytes(a.dtype);
  if (p.offset % m.alignment != 0 || p.offset > f.bytes || bytes > f.bytes - p.offset)
    return corrupt(path, fmt::format("{}: bytes [{}, {}) unaligned or past the end of {} ({} "
                                     "bytes)", what, p.offset, p.offset + bytes, f.name, f.bytes));
  if (p.tensor >= 0) {
    const auto& t = m.tensors[static_cast<size_t>(p.tensor)];
    if (!a.indexed || p.first < t.offset || p.first + p.count > t.offset + t.size)
      return corrupt(path, fmt::format("{}: elements [{}, {}) not inside the tensor", what,
                                       p.first, p.first + p.count));
  } else if (a.indexed && meets_a_tensor(m, p.first, p.count)) {
    return corrupt(path, fmt::format("{}: elements of a tensor in a piece of none", what));
  }
  return {};
}

/// Pieces sorted by `key` must each start where the previous one ends.
template <class Key, class End>
const piece_entry* first_gap_or_overlap(std::vector<const piece_entry*>& ps, uint64_t start,
                                        Key key, End end, uint64_t& at) {
  std::sort(ps.begin(), ps.end(), [&](auto* a, auto* b) { return key(*a) < key(*b); });
  at = start;
  for (auto* p : ps) {
    if (key(*p) != at)
      return p;
    at = end(*p);
  }
  return nullptr;
}

/// The pieces of each array cover it exactly once.
caf::error check_coverage(const manifest& m, const std::string& path) {
  std::vector<std::vector<const piece_entry*>> by_array(m.arrays.size());
  for (const auto& p : m.pieces)
    by_array[p.array].push_back(&p);
  uint64_t at = 0;
  for (size_t i = 0; i < m.arrays.size(); ++i) {
    auto* bad = first_gap_or_overlap(
      by_array[i], 0, [](const piece_entry& p) { return p.first; },
      [](const piece_entry& p) { return p.first + p.count; }, at);
    if (bad || at != m.arrays[i].elements)
      return corrupt(path, fmt::format("array {}: the pieces do not cover its {} elements "
                                       "exactly once (at element {})",
                                       m.arrays[i].name, m.arrays[i].elements, at));
  }
  return {};
}

/// Pieces of one file must not share bytes; gaps (alignment) are fine.
caf::error check_file_overlap(const manifest& m, const std::string& path) {
  std::vector<std::vector<const piece_entry*>> by_file(m.files.size());
  for (const auto& p : m.pieces)
    by_file[p.file].push_back(&p);
  for (size_t i = 0; i < m.files.size(); ++i) {
    auto& ps = by_file[i];
    std::sort(ps.begin(), ps.end(), [](auto* a, auto* b) { return a->offset < b->offset; });
    for (size_t k = 1; k < ps.size(); ++k)
      if (ps[k]->offset < ps[k - 1]->offset
                            + ps[k - 1]->count * dtype_bytes(m.arrays[ps[k - 1]->array].dtype))
        return corrupt(path, fmt::format("{}: {} and {} share bytes", m.files[i].name,
                                         describe_piece(m, *ps[k - 1]), describe_piece(m, *ps[k])));
  }
  return {};
}

} // namespace

caf::error validate_layout(const manifest& m, const std::string& path) {
  if (auto err = check_arrays_and_files(m, path))
    return err;
  return check_tensors(m, path);
}

caf::error validate_part(const manifest& m, const std::string& path) {
  if (auto err = validate_layout(m, path))
    return err;
  for (const auto& p : m.pieces)
    if (auto err = check_piece(m, p, path))
      return err;
  return check_file_overlap(m, path);
}

caf::error validate(const manifest& m, const std::string& path) {
  if (auto err = validate_layout(m, path))
    return err;
  for (const auto& p : m.pieces)
    if (auto err = check_piece(m, p, path))
      return err;
  if (auto err = check_coverage(m, path)) // first: a piece held twice is "not exactly once"
    return err;
  if (auto err = check_file_overlap(m, path))
    return err;
  if (config_digest(m.meta.config) != m.config_digest)
    return corrupt(path, fmt::format("config digest {:016x} is not that of its config ({:016x})",
                                     m.config_digest, config_digest(m.meta.config)));
  return {};
}

namespace {

std::string json_string(std::string_view s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\')
      out += '\\';
    if (c < 0x20)
      out += fmt::format("\\u{:04x}", c);
    else
      out += static_cast<char>(c);
  }
  return out + "\"";
}

std::string json_hex(uint64_t v) {
  return fmt::format("\"0x{:016x}\"", v);
}

template <class T, class F>
std::vector<std::string> json_each(const std::vector<T>& v, F each) {
  std::vector<std::string> parts;
  for (const auto& x : v)
    parts.push_back(each(x));
  return parts;
}

template <class T, class F>
std::string json_list(const std::vector<T>& v, F each) {
  return fmt::format("[{}]", fmt::join(json_each(v, each), ", "));
}

std::string meta_json(const manifest& m) {
  const auto& mt = m.meta;
  std::vector<std::string> config;
  for (const auto& [k, v] : mt.config)
    config.push_back(json_string(k) + ": " + json_string(v));
  auto number = [](auto v) { return fmt::format("{}", v); };
  return fmt::format(
    "  \"step\": {},\n  \"epoch\": {},\n  \"replicas\": {},\n  \"ranks_per_group\": {},\n"
    "  \"expert_placement\": {},\n  \"data_position\": {},\n  \"rng_state\": {},\n"
    "  \"loss_scale\": {},\n  \"loss_scale_good_steps\": {},\n  \"config_digest\": {},\n"
    "  \"config\": {{{}}},\n",
    mt.step, mt.epoch, mt.replicas, mt.ranks_per_group, json_list(mt.expert_placement, number),
    mt.data_position, json_list(mt.rng_state, json_hex),
    std::isfinite(mt.loss_scale) ? fmt::format("{}", mt.loss_scale) : "null",
    mt.loss_scale_good_steps, json_hex(m.config_digest), fmt::join(config, ", "));
}

} // namespace

std::string manifest_json(const manifest& m) {
  auto array = [](const array_entry& a) {
    return fmt::format("{{\"name\": {}, \"dtype\": {}, \"elements\": {}, \"indexed\": {}}}",
                       json_string(a.name), json_string(a.dtype), a.elements, a.indexed);
  };
  auto file = [](const file_entry& f) {
    return fmt::format("{{\"name\": {}, \"bytes\": {}}}", json_string(f.name), f.bytes);
  };
  auto tensor = [](const tensor_entry& t) {
    return fmt::format("{{\"name\": {}, \"shape\": [{}], \"offset\": {}, \"size\": {}}}",
                       json_string(t.name), fmt::join(t.shape, ", "), t.offset, t.size);
  };
  auto piece = [&m](const piece_entry& p) {
    auto name = [&](auto& v, auto i) { return i < v.size() ? json_string(v[i].name) : "null"; };
    std::string t = p.tensor >= 0 ? name(m.tensors, static_cast<size_t>(p.tensor)) : "null";
    return fmt::format("{{\"array\": {}, \"file\": {}, \"tensor\": {}, \"first\": {}, "
                       "\"count\": {}, \"offset\": {}, \"xxh64\": {}}}",
                       name(m.arrays, p.array), name(m.files, p.file), t, p.first, p.count,
                       p.offset, json_hex(p.xxh64));
  };
  constexpr std::string_view sep = ",\n    ";
  return fmt::format("{{\n  \"format\": {},\n  \"cmesh_version\": {},\n  \"written_unix_ms\": {},\n"
                     "{}  \"alignment\": {},\n  \"arrays\": [\n    {}],\n  \"files\": [\n    {}],\n"
                     "  \"tensors\": [\n    {}],\n  \"pieces\": [\n    {}]\n}}\n",
                     format_version, json_string(m.cmesh_version), m.written_unix_ms,
                     meta_json(m), m.alignment, fmt::join(json_each(m.arrays, array), sep),
                     fmt::join(json_each(m.files, file), sep),
                     fmt::join(json_each(m.tensors, tensor), sep),
                     fmt::join(json_each(m.pieces, piece), sep));
}

} // namespace cmesh::storage
