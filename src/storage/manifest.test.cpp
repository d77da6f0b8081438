// The manifest and the names of a checkpoint root, without files.
#include "storage/manifest.hpp"
#include "storage/paths.hpp"
#include "storage/writer.hpp"

#include <doctest/doctest.h>

#include <unistd.h>

using namespace cmesh;
using namespace cmesh::storage;

namespace {

/// Two arrays of 20 elements: tensors a [0, 6) and b [8, 14); the rest in no tensor.
manifest small_layout() {
  manifest m;
  m.alignment = 64;
  m.arrays = {{"weights", "f32", 20, true}, {"counts", "u8", 20, false}};
  m.tensors = {{"a", {2, 3}, 0, 6}, {"b", {6}, 8, 6}};
  m.meta.step = 9;
  m.meta.config = {{"model.d_model", "8"}};
  m.config_digest = config_digest(m.meta.config);
  return m;
}

/// small_layout() with its pieces in one file, as a writer lays them out.
manifest small_manifest() {
  auto m = small_layout();
  uint64_t at = 0;
  for (uint32_t a = 0; a < 2; ++a)
    for (auto p : cut_pieces(m, a, 0, 20, 1000)) {
      p.offset = (at + 63) / 64 * 64;
      at = p.offset + p.count * dtype_bytes(m.arrays[a].dtype);
      m.pieces.push_back(p);
    }
  m.files = {{"shard-0.bin", at}};
  return m;
}

} // namespace

TEST_CASE("storage: step directory names sort like steps, and partial ones are never steps") {
  CHECK(step_dir_name(123) == "step-000000123");
  CHECK(step_dir_name(0) < step_dir_name(9));
  CHECK(step_dir_name(99) < step_dir_name(100));
  CHECK(parse_step_dir("step-000000123") == 123u);
  CHECK(parse_step_dir("step-5") == 5u);
  for (auto bad : {"step-", "step-12a", "step--1", "steps-1", "step-+1", "step- 1",
                   "step-000000123.partial-42@host", "step-000000123.tmp"})
    CHECK_MESSAGE(!parse_step_dir(bad), bad);

  auto name = partial_dir_name(123, 4242, "node7.example");
  CHECK(name == "step-000000123.partial-4242@node7.example");
  auto owner = parse_partial_dir(name);
  REQUIRE(owner);
  CHECK(owner->step == 123);
  CHECK(owner->pid == 4242);
  CHECK(owner->host == "node7.example");
  CHECK_FALSE(parse_partial_dir("step-000000123"));
  CHECK_FALSE(parse_partial_dir("step-000000123.partial-x@h"));
  CHECK_FALSE(parse_partial_dir("step-000000123.partial-12"));
  // The second and later writers of a step in one process: a number of their own.
  auto second = partial_dir_name(123, 4242, "node7.example", 2);
  CHECK(second == "step-000000123.partial-4242.2@node7.example");
  auto second_owner = parse_partial_dir(second);
  REQUIRE(second_owner);
  CHECK(second_owner->step == 123);
  CHECK(second_owner->pid == 4242);
  CHECK(second_owner->writer == 2);
  CHECK(second_owner->host == "node7.example");
  CHECK(owner->writer == 0);
  CHECK(partial_dir_name(123, 4242, "h", 0) == "step-000000123.partial-4242@h");
  for (auto bad : {"step-000000123.partial-12.@h", "step-000000123.partial-12.x@h",
                   "step-000000123.partial-.3@h", "step-000000123.partial-12.3.4@h"})
    CHECK_MESSAGE(!parse_partial_dir(bad), bad);
  CHECK(parse_shard_file("shard-3.bin") == 3u);
  for (auto bad : {"shard-.bin", "shard-3", "shard-x.bin", "part.msgpack", "shard-3.bin.tmp"})
    CHECK_MESSAGE(!parse_shard_file(bad), bad);

  // This process is alive; a pid that exited is not; another host's writer
  // cannot be checked, so it is taken for alive.
  CHECK(writer_alive({1, ::getpid(), this_host()}));
  CHECK_FALSE(writer_alive({1, 0, this_host()}));
  CHECK(writer_alive({1, 1, this_host() + ".elsewhere"}));
  CHECK(shard_file_name(3) == "shard-3.bin");
}

TEST_CASE("storage: pieces are cut at tensor boundaries, gaps and the size limit") {
  auto m = small_layout();
  auto ps = cut_pieces(m, 0, 0, 20, 1000);
  REQUIRE(ps.size() == 4);
  CHECK((ps[0].tensor == 0 && ps[0].first == 0 && ps[0].count == 6));
  CHECK((ps[1].tensor == -1 && ps[1].first == 6 && ps[1].count == 2)); // the gap
  CHECK((ps[2].tensor == 1 && ps[2].first == 8 && ps[2].count == 6));
  CHECK((ps[3].tensor == -1 && ps[3].first == 14 && ps[3].count == 6)); // the tail
  // A range that starts and ends inside tensors: the cut tensors are pieces too.
  auto mid = cut_pieces(m, 0, 4, 7, 1000);
  REQUIRE(mid.size() == 3);
  CHECK((mid[0].tensor == 0 && mid[0].first == 4 && mid[0].count == 2));
  CHECK((mid[1].tensor == -1 && mid[1].count == 2));
  CHECK((mid[2].tensor == 1 && mid[2].first == 8 && mid[2].count == 3));
  // At most 4 elements each.
  auto small = cut_pieces(m, 0, 0, 6, 4);
  REQUIRE(small.size() == 2);
  CHECK((small[0].count == 4 && small[1].first == 4 && small[1].count == 2));
  // An array that is not indexed is cut by the limit only.
  auto counts = cut_pieces(m, 1, 0, 20, 8);
  REQUIRE(counts.size() == 3);
  for (auto& p : counts)
    CHECK(p.tensor == -1);
}

TEST_CASE("storage: the manifest round-trips, and a damaged one is refused with a reason") {
  auto m = small_manifest();
  REQUIRE_FALSE(validate(m, "m"));
  auto bytes = encode_manifest(m);
  auto back = decode_manifest(bytes, "m");
  REQUIRE(back);
  CHECK(*back == m);

  auto truncated = decode_manifest(std::span(bytes).first(bytes.size() - 3), "M");
  REQUIRE_FALSE(truncated);
  CHECK(code_of(truncated.error()) == errc::corrupt);
  CHECK(describe(truncated.error()).find("M: truncated") != std::string::npos);
  CHECK(code_of(decode_manifest(std::span(bytes).first(10), "M").error()) == errc::corrupt);

  auto flipped = bytes;
  flipped[bytes.size() / 2] ^= 0x10;
  auto f = decode_manifest(flipped, "M");
  REQUIRE_FALSE(f);
  CHECK(describe(f.error()).find("checksum mismatch of the manifest") != std::string::npos);

  auto magic = bytes;
  magic[0] = 'X';
  CHECK(describe(decode_manifest(magic, "M").error()).find("bad magic") != std::string::npos);

  auto version = bytes;
  version[8] = 2;
  auto v = decode_manifest(version, "M");
  REQUIRE_FALSE(v);
  CHECK(code_of(v.error()) == errc::bad_version);
  CHECK(describe(v.error()).find("format 2") != std::string::npos);
}

TEST_CASE("storage: validate finds every inconsistency and names it") {
  auto expect_corrupt = [](const manifest& m, const std::string& words) {
    auto err = validate(m, "M");
    REQUIRE(err);
    CHECK(code_of(err) == errc::corrupt);
    CHECK_MESSAGE(describe(err).find(words) != std::string::npos, describe(err));
  };
  auto m = small_manifest();
  auto gap = m;
  gap.pieces.erase(gap.pieces.begin() + 1);
  expect_corrupt(gap, "array weights: the pieces do not cover its 20 elements exactly once");
  auto twice = m;
  twice.pieces.push_back(twice.pieces[0]);
  expect_corrupt(twice, "exactly once");
  auto past = m;
  past.files[0].bytes -= 1;
  expect_corrupt(past, "past the end of shard-0.bin");
  auto unaligned = m;
  unaligned.pieces[1].offset += 4;
  expect_corrupt(unaligned, "unaligned");
  auto outside = m;
  outside.pieces[0].tensor = 1; // elements [0, 6) are not tensor b's
  expect_corrupt(outside, "tensor b (weights): elements [0, 6) not inside the tensor");
  auto untensored = m;
  untensored.pieces[0].tensor = -1;
  expect_corrupt(untensored, "elements of a tensor in a piece of none");
  auto overlap = m;
  overlap.tensors[1].offset = 4;
  expect_corrupt(overlap, "tensors a and b overlap");
  auto shape = m;
  shape.tensors[0].shape = {2, 2};
  expect_corrupt(shape, "tensor a: shape holds 4 elements, size says 6");
  auto dtype = m;
  dtype.arrays[1].dtype = "q4";
  expect_corrupt(dtype, "unknown dtype 'q4'");
  auto escape = m;
  escape.files[0].name = "../shard-0.bin";
  expect_corrupt(escape, "not a plain name");
  auto digest = m;
  digest.meta.config[0].second = "16";
  expect_corrupt(digest, "config digest");
  auto shared = m;
  shared.pieces[1].offset = 0; // the gap's bytes over tensor a's
  shared.pieces[1].count = 1;
  shared.pieces[1].first = 6;
  shared.pieces.insert(shared.pieces.begin() + 2, shared.pieces[1]);
  shared.pieces[2].first = 7;
  shared.pieces[2].offset = 64;
  expect_corrupt(shared, "share bytes");
}

TEST_CASE("storage: the manifest as JSON names everything, checksums as hex strings") {
  auto m = small_manifest();
  m.meta.rng_state = {0xfedcba9876543210ull};
  m.meta.config.push_back({"data.file", "a \"quoted\"\\path\n"});
  auto j = manifest_json(m);
  CHECK(j.find("\"step\": 9") != std::string::npos);
  CHECK(j.find("\"format\": 1") != std::string::npos);
  CHECK(j.find("\"rng_state\": [\"0xfedcba9876543210\"]") != std::string::npos);
  CHECK(j.find("{\"name\": \"a\", \"shape\": [2, 3], \"offset\": 0, \"size\": 6}")
        != std::string::npos);
  CHECK(j.find("\"tensor\": \"b\"") != std::string::npos);
  CHECK(j.find("\"tensor\": null") != std::string::npos);
  CHECK(j.find("\"data.file\": \"a \\\"quoted\\\"\\\\path\\u000a\"") != std::string::npos);
  CHECK(dtype_bytes("f32") == 4);
  CHECK(dtype_bytes("bf16") == 2);
  CHECK(dtype_bytes("int4") == 0);
}
