#include "transport/wire.hpp"

#include <spdlog/spdlog.h>

#include <cstring>

namespace cmesh::wire {

namespace {

template <class T>
void put(std::vector<uint8_t>& out, T x) {
  static_assert(std::is_integral_v<T>);
  for (size_t i = 0; i < sizeof(T); ++i)
    out.push_back(static_cast<uint8_t>(static_cast<std::make_unsigned_t<T>>(x) >> (8 * i)));
}

template <class T>
T get(const uint8_t* p) {
  std::make_unsigned_t<T> x = 0;
  for (size_t i = 0; i < sizeof(T); ++i)
    x |= static_cast<std::make_unsigned_t<T>>(p[i]) << (8 * i);
  return static_cast<T>(x);
}

} // namespace

const char* kind_name(kind_t kind) {
  const char* out = nullptr;
  visit_kind<all_messages>(kind, [&]<class T>() { out = T::name; });
  return out;
}

bool known_kind(kind_t kind) {
  return kind_name(kind) != nullptr;
}

std::vector<uint8_t> encode_frame(const frame_header& h, std::span<const uint8_t> body) {
  std::vector<uint8_t> out;
  out.reserve(header_bytes + h.src_actor.size() + h.dst_actor.size() + body.size());
  put<uint32_t>(out, magic);
  put<uint16_t>(out, version);
  put<uint16_t>(out, h.kind);
  put<uint64_t>(out, h.epoch);
  put<uint32_t>(out, h.src_process);
  put<uint32_t>(out, h.dst_process);
  put<uint16_t>(out, static_cast<uint16_t>(h.src_actor.size()));
  put<uint16_t>(out, static_cast<uint16_t>(h.dst_actor.size()));
  put<uint32_t>(out, static_cast<uint32_t>(body.size()));
  put<uint64_t>(out, h.bulk_len);
  out.insert(out.end(), h.src_actor.begin(), h.src_actor.end());
  out.insert(out.end(), h.dst_actor.begin(), h.dst_actor.end());
  out.insert(out.end(), body.begin(), body.end());
  return out;
}

expected<frame_view> decode_frame(std::span<const uint8_t> bytes) {
  if (bytes.size() < header_bytes)
    return make_error(errc::malformed_frame,
                      "frame of " + std::to_string(bytes.size()) + " bytes is shorter than its header");
  const uint8_t* p = bytes.data();
  if (get<uint32_t>(p) != magic)
    return make_error(errc::malformed_frame, "bad magic");
  auto ver = get<uint16_t>(p + 4);
  if (ver != version)
    return make_error(errc::bad_version, "wire version " + std::to_string(ver) + ", expected "
                                           + std::to_string(version));
  frame_view v;
  auto& h = v.header;
  h.kind = get<uint16_t>(p + 6);
  h.epoch = get<uint64_t>(p + 8);
  h.src_process = get<uint32_t>(p + 16);
  h.dst_process = get<uint32_t>(p + 20);
  size_t src_len = get<uint16_t>(p + 24);
  size_t dst_len = get<uint16_t>(p + 26);
  size_t body_len = get<uint32_t>(p + 28);
  h.bulk_len = get<uint64_t>(p + 32);
  if (src_len > actor_name_max || dst_len > actor_name_max)
    return make_error(errc::malformed_frame, "actor name longer than "
                                               + std::to_string(actor_name_max));
  if (body_len > body_bytes_max || h.bulk_len > bulk_bytes_max)
    return make_error(errc::malformed_frame, "body or bulk length out of range");
  if (header_bytes + src_len + dst_len + body_len != bytes.size())
    return make_error(errc::malformed_frame,
                      "length fields say " + std::to_string(header_bytes + src_len + dst_len + body_len)
                        + " bytes, frame has " + std::to_string(bytes.size()));
  if (!known_kind(h.kind))
    return make_error(errc::unknown_kind, "kind " + std::to_string(h.kind));
  bool bulk_kind = false;
  visit_kind<all_messages>(h.kind, [&]<class T>() { bulk_kind = has_bulk_v<T>; });
  if (!bulk_kind && h.bulk_len != 0)
    return make_error(errc::malformed_frame,
                      std::string(kind_name(h.kind)) + " carries no bulk payload");
  const auto* names = reinterpret_cast<const char*>(p + header_bytes);
  h.src_actor.assign(names, src_len);
  h.dst_actor.assign(names + src_len, dst_len);
  v.body = bytes.subspan(header_bytes + src_len + dst_len);
  return v;
}

namespace detail {

expected<msgpack::object_handle> unpack_bounded(std::span<const uint8_t> body) {
  // Each element needs at least one byte, so the input size bounds every count.
  const size_t n = body.size();
  msgpack::unpack_limit limit(n, n, n, n, n, 32);
  try {
    size_t off = 0;
    auto oh = msgpack::unpack(reinterpret_cast<const char*>(body.data()), n, off, nullptr,
                              nullptr, limit);
    if (off != n)
      return make_error(errc::malformed_frame, std::to_string(n - off) + " trailing bytes");
    return oh;
  } catch (const std::exception& e) {
    return make_error(errc::malformed_frame, std::string("msgpack: ") + e.what());
  }
}

} // namespace detail

reject_counters& rejects() {
  static reject_counters c;
  return c;
}

void note_reject(const caf::error& e, const char* where) {
  auto& c = rejects();
  switch (code_of(e)) {
    case errc::bad_version: ++c.bad_version; break;
    case errc::unknown_kind: ++c.unknown_kind; break;
    case errc::unknown_destination: ++c.unknown_destination; break;
    case errc::stale_epoch: ++c.stale; break;
    default: ++c.malformed; break;
  }
  // Log the first few and then every 1000th, so a flood cannot drown the log.
  auto n = c.total();
  if (n <= 10 || n % 1000 == 0)
    spdlog::warn("rejected frame from {} ({} so far): {}", where, n, describe(e));
}

} // namespace cmesh::wire
