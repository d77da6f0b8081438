#include "transport/wire.hpp"

#include <doctest/doctest.h>

#include <cstdio>
#include <random>

using namespace cmesh;
using namespace cmesh::wire;

namespace {

// One filled-in value of every registered kind.
register_worker sample(type_list<register_worker>) {
  return {3, 4, 77, 1234, "node-a", bytes{1, 2, 3, 250}};
}
peer_table sample(type_list<peer_table>) {
  return {9, 2, {{0, 1, 10, "h0", bytes{7}}, {1, 2, 11, "h1", bytes{8, 9}}}};
}
report sample(type_list<report>) { return {2, "token", "laps=3", 123456789}; }
wire::shutdown sample(type_list<wire::shutdown>) { return {1, "all done"}; }
rejected sample(type_list<rejected>) { return {"rank 9 is outside world size 4"}; }
kv_put sample(type_list<kv_put>) { return {"epoch/3/host/1", bytes{1, 2, 3}}; }
kv_get sample(type_list<kv_get>) { return {17, "epoch/3/host/1", 5000}; }
kv_value sample(type_list<kv_value>) { return {17, "epoch/3/host/1", true, bytes{4, 5}}; }
kv_drop sample(type_list<kv_drop>) { return {"epoch/3/"}; }
worker_status sample(type_list<worker_status>) {
  return {0x1234567890ull, 7, 1200, worker_status::ready, 4, 987654321, 6, "injected fault"};
}
epoch_notice sample(type_list<epoch_notice>) { return {8, {0, 2, 3}, {11, 12, 13}, false, "g1 lost", {1}, true}; }
catchup_assign sample(type_list<catchup_assign>) { return {3, 1, 99, 2}; }
replica_divergence sample(type_list<replica_divergence>) {
  return {77, 5, 120, {2}, false, {0, 1}, "layer0.w1, out", "shard 0: group 2 differs"};
}
heartbeat sample(type_list<heartbeat>) { return {42, -7}; }
token sample(type_list<token>) { return {1, 2, 3, 99}; }
sequenced sample(type_list<sequenced>) { return {5, 100000, 17}; }
blob sample(type_list<blob>) {
  blob b{7, 0xdeadbeefcafef00dull, bulk::allocate(4096)};
  return b;
}
ack sample(type_list<ack>) { return {8, 9}; }
ckpt_seed sample(type_list<ckpt_seed>) {
  return {1, 0x1234567890ull, 17, 100, 2, true, bulk::allocate(302 * sizeof(float))};
}
ckpt_update sample(type_list<ckpt_update>) {
  return {1, 0x1234567890ull, 17, 0xabcdefull, false, bulk::allocate(100 * sizeof(float))};
}
catchup_request sample(type_list<catchup_request>) { return {4, 0x77ull, {100, 100, 100, 2}}; }
catchup_piece sample(type_list<catchup_piece>) {
  return {4, 30, 2048, bulk::allocate(64 * sizeof(float))};
}
catchup_update sample(type_list<catchup_update>) {
  return {4, 31, false, "", bulk::allocate(100 * sizeof(float))};
}
catchup_ack sample(type_list<catchup_ack>) { return {4, 13, 2}; }

frame_header some_header() {
  frame_header h;
  h.epoch = 12;
  h.src_process = 1;
  h.dst_process = 2;
  h.src_actor = "trainer";
  h.dst_actor = "supervisor";
  return h;
}

} // namespace

TEST_CASE("every message kind survives a round trip") {
  int kinds = 0;
  for_each_type(all_messages{}, [&]<class T>() {
    ++kinds;
    std::string name = T::name;
    CAPTURE(name);
    T in = sample(type_list<T>{});
    auto frame = encode(some_header(), in);
    auto v = decode_frame(frame);
    REQUIRE(v);
    CHECK(v->header.kind == T::kind);
    CHECK(v->header.epoch == 12);
    CHECK(v->header.src_process == 1);
    CHECK(v->header.dst_process == 2);
    CHECK(v->header.src_actor == "trainer");
    CHECK(v->header.dst_actor == "supervisor");
    if constexpr (has_bulk_v<T>)
      CHECK(v->header.bulk_len == in.payload.size());
    else
      CHECK(v->header.bulk_len == 0);
    auto out = decode_body<T>(v->body);
    REQUIRE(out);
    if constexpr (has_bulk_v<T>) {
      CHECK(out->payload.empty()); // the payload travels beside the frame
      out->payload = in.payload;
    }
    CHECK(*out == in);
    CHECK(std::string(kind_name(T::kind)) == T::name);
  });
  CHECK(kinds == 24);
}

TEST_CASE("kinds are unique") {
  std::vector<kind_t> seen;
  for_each_type(all_messages{}, [&]<class T>() { seen.push_back(T::kind); });
  std::sort(seen.begin(), seen.end());
  CHECK(std::adjacent_find(seen.begin(), seen.end()) == seen.end());
}

TEST_CASE("bad frames are rejected with typed errors") {
  auto good = encode(some_header(), token{1, 2, 3, 4});
  SUBCASE("short") {
    auto f = good;
    f.resize(10);
    CHECK(code_of(decode_frame(f).error()) == errc::malformed_frame);
  }
  SUBCASE("bad magic") {
    auto f = good;
    f[0] ^= 0xff;
    CHECK(code_of(decode_frame(f).error()) == errc::malformed_frame);
  }
  SUBCASE("unknown version") {
    auto f = good;
    f[4] = 99;
    CHECK(code_of(decode_frame(f).error()) == errc::bad_version);
  }
  SUBCASE("unknown kind") {
    auto f = good;
    f[6] = 0xee;
    f[7] = 0xee;
    CHECK(code_of(decode_frame(f).error()) == errc::unknown_kind);
  }
  SUBCASE("wrong length") {
    auto f = good;
    f.push_back(0);
    CHECK(code_of(decode_frame(f).error()) == errc::malformed_frame);
    f.resize(good.size() - 1);
    CHECK(code_of(decode_frame(f).error()) == errc::malformed_frame);
  }
  SUBCASE("bulk on a kind without payload") {
    auto h = some_header();
    h.kind = token::kind;
    h.bulk_len = 5;
    auto body = encode_body(token{});
    auto f = encode_frame(h, body);
    CHECK(code_of(decode_frame(f).error()) == errc::malformed_frame);
  }
  SUBCASE("undecodable body") {
    auto h = some_header();
    h.kind = token::kind;
    std::vector<uint8_t> junk{0xc1, 0xc1, 0xc1}; // 0xc1 is never used by msgpack
    auto frame = encode_frame(h, junk);
    auto v = decode_frame(frame);
    REQUIRE(v);
    CHECK(code_of(decode_body<token>(v->body).error()) == errc::malformed_frame);
  }
  SUBCASE("wrong body shape") {
    auto h = some_header();
    auto frame = encode(h, report{1, "k", "v", 2});
    auto v = decode_frame(frame);
    REQUIRE(v);
    CHECK(code_of(decode_body<token>(v->body).error()) == errc::malformed_frame);
  }
  SUBCASE("array length far beyond the frame") {
    // fixarray header claiming 2^32-1 elements with nothing behind it.
    std::vector<uint8_t> body{0xdd, 0xff, 0xff, 0xff, 0xff};
    CHECK(code_of(decode_body<peer_table>(body).error()) == errc::malformed_frame);
  }
}

namespace {

// Decodes a frame as far as it goes; a defect shows as a crash or sanitizer
// report, a rejection as a typed error.
bool decode_any(std::span<const uint8_t> bytes) {
  auto v = decode_frame(bytes);
  if (!v) {
    auto c = code_of(v.error());
    CHECK((c == errc::malformed_frame || c == errc::bad_version || c == errc::unknown_kind));
    return false;
  }
  bool ok = false;
  visit_kind<all_messages>(v->header.kind, [&]<class T>() {
    auto m = decode_body<T>(v->body);
    if (!m)
      CHECK(code_of(m.error()) == errc::malformed_frame);
    ok = static_cast<bool>(m);
  });
  return ok;
}

} // namespace

TEST_CASE("random, truncated and bit-flipped frames never crash the decoder") {
  uint64_t seed = std::random_device{}();
  if (const char* s = std::getenv("CMESH_SEED"))
    seed = std::strtoull(s, nullptr, 10);
  std::printf("wire fuzz seed %llu (set CMESH_SEED to replay)\n",
              static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  std::vector<std::vector<uint8_t>> corpus;
  for_each_type(all_messages{}, [&]<class T>() {
    corpus.push_back(encode(some_header(), sample(type_list<T>{})));
  });
  int decoded = 0, rejected = 0;
  for (int i = 0; i < 20000; ++i) {
    auto f = corpus[rng() % corpus.size()];
    switch (i % 4) {
      case 0: { // bit flips anywhere
        int flips = 1 + static_cast<int>(rng() % 4);
        for (int k = 0; k < flips; ++k)
          f[rng() % f.size()] ^= static_cast<uint8_t>(1u << (rng() % 8));
        break;
      }
      case 1: // truncated
        f.resize(rng() % f.size());
        break;
      case 2: { // random bytes behind a valid header
        for (size_t k = header_bytes; k < f.size(); ++k)
          f[k] = static_cast<uint8_t>(rng());
        break;
      }
      default: { // entirely random
        f.resize(rng() % 256);
        for (auto& b : f)
          b = static_cast<uint8_t>(rng());
      }
    }
    (decode_any(f) ? decoded : rejected)++;
  }
  MESSAGE("decoded " << decoded << ", rejected " << rejected);
  CHECK(decoded + rejected == 20000);
  CHECK(rejected > 0);
}
