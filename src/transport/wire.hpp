// Frame format. Every frame is a fixed little-endian header followed by the
// two actor names and a msgpack body:
//
//   u32 magic 'CMSH' | u16 version | u16 kind | u64 epoch
//   u32 src process  | u32 dst process
//   u16 src name len | u16 dst name len | u32 body len | u64 bulk len
//   src name | dst name | body
//
// The frame's byte count must equal header + names + body exactly. A bulk
// payload of `bulk len` bytes, when present, travels as a separate transfer.
// Decoding never trusts a frame: every check failure is a typed error.
#pragma once

#include "core/error.hpp"
#include "transport/messages.hpp"

#include <atomic>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace cmesh::wire {

constexpr uint32_t magic = 0x48534d43; // "CMSH" read as little-endian bytes
constexpr uint16_t version = 1;
constexpr size_t header_bytes = 40;
constexpr size_t actor_name_max = 128;
constexpr size_t body_bytes_max = size_t{1} << 30;
constexpr uint64_t bulk_bytes_max = uint64_t{1} << 40;

/// Process id meaning "not addressed to a process of the mesh" (bootstrap).
constexpr uint32_t no_process = 0xffffffffu;

struct frame_header {
  kind_t kind = 0;
  uint64_t epoch = 0;
  uint32_t src_process = no_process;
  uint32_t dst_process = no_process;
  std::string src_actor;
  std::string dst_actor;
  uint64_t bulk_len = 0;
};

/// A decoded frame whose body still points into the received bytes.
struct frame_view {
  frame_header header;
  std::span<const uint8_t> body;
};

/// Validates and splits a frame. Errors: malformed_frame, bad_version, unknown_kind.
expected<frame_view> decode_frame(std::span<const uint8_t> bytes);

/// Encodes the header and a body that is already msgpack.
std::vector<uint8_t> encode_frame(const frame_header& h, std::span<const uint8_t> body);

/// msgpack body of a message (bulk payloads excluded).
template <class T>
std::vector<uint8_t> encode_body(const T& msg) {
  msgpack::sbuffer buf;
  msgpack::pack(buf, msg);
  auto* p = reinterpret_cast<const uint8_t*>(buf.data());
  return std::vector<uint8_t>(p, p + buf.size());
}

/// Full frame for a message; the header's kind and bulk length are taken from it.
template <class T>
std::vector<uint8_t> encode(frame_header h, const T& msg) {
  h.kind = T::kind;
  if constexpr (has_bulk_v<T>)
    h.bulk_len = msg.payload.size();
  else
    h.bulk_len = 0;
  auto body = encode_body(msg);
  return encode_frame(h, body);
}

namespace detail {
/// Unpacks with limits derived from the input size, so no length field can
/// make the decoder allocate more than the frame could hold.
expected<msgpack::object_handle> unpack_bounded(std::span<const uint8_t> body);
} // namespace detail

/// Decodes a body as T. Error: malformed_frame (undecodable, wrong shape,
/// trailing bytes).
template <class T>
expected<T> decode_body(std::span<const uint8_t> body) {
  auto oh = detail::unpack_bounded(body);
  if (!oh)
    return oh.error();
  try {
    T out;
    oh->get().convert(out);
    return out;
  } catch (const std::exception& e) {
    return make_error(errc::malformed_frame, std::string(T::name) + " body: " + e.what());
  }
}

/// Process-wide counts of rejected frames, by reason (for logs and metrics).
struct reject_counters {
  std::atomic<uint64_t> malformed{0};
  std::atomic<uint64_t> bad_version{0};
  std::atomic<uint64_t> unknown_kind{0};
  std::atomic<uint64_t> unknown_destination{0};
  std::atomic<uint64_t> stale{0};
  uint64_t total() const {
    return malformed + bad_version + unknown_kind + unknown_destination + stale;
  }
};
reject_counters& rejects();

/// Counts and logs (rate-limited) a rejected frame.
void note_reject(const caf::error& e, const char* where);

} // namespace cmesh::wire
