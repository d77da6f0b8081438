// Checkpoints on real files: written, read back bit for bit at other
// shardings, and refused, with the file and the tensor named, when any
// byte is not what was written.
#include "storage/reader.hpp"
#include "storage/testing.hpp"

#include <doctest/doctest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include <sys/stat.h>
#include <unistd.h>

using namespace cmesh;
using namespace cmesh::storage;
using namespace cmesh::storage::testing;

namespace {

/// Reads [first, first + count) of array a and compares it with the source.
void check_range(const checkpoint& c, const sample_state& s, size_t a, uint64_t first,
                 uint64_t count) {
  std::vector<float> got(count, -1.0f);
  auto err = c.read_range(s.arrays[a].name, first, std::span<float>(got));
  REQUIRE_MESSAGE(!err, describe(err));
  const float* want = s.values[a].data() + first;
  CHECK_MESSAGE((count == 0 || std::memcmp(got.data(), want, count * sizeof(float)) == 0),
                s.arrays[a].name << " [" << first << ", " << first + count << ")");
}

/// The first piece of a tensor stored in `file_name`.
const piece_entry& tensor_piece_in(const manifest& m, const std::string& file_name) {
  for (const auto& p : m.pieces)
    if (p.tensor >= 0 && m.files[p.file].name == file_name)
      return p;
  FAIL("no tensor piece in " << file_name);
  return m.pieces.front();
}

} // namespace

TEST_CASE("storage: a checkpoint round-trips bit for bit, with its metadata") {
  temp_dir root;
  auto s = make_sample(120);
  auto dir = write_sample(root.path(), s, 2);
  REQUIRE_MESSAGE(dir, describe(dir.error()));
  CHECK(*dir == root / "step-000000120");
  CHECK(std::filesystem::exists(*dir + "/manifest.msgpack"));
  CHECK_FALSE(std::filesystem::exists(*dir + "/manifest.msgpack.tmp"));
  CHECK(std::filesystem::exists(*dir + "/shard-0.bin"));
  CHECK(std::filesystem::exists(*dir + "/shard-1.bin"));
  auto c = checkpoint::open(*dir);
  REQUIRE_MESSAGE(c, describe(c.error()));
  CHECK(c->info().meta == s.meta);
  CHECK(c->info().tensors == s.tensors);
  CHECK(c->info().arrays == s.arrays);
  CHECK(c->info().config_digest == config_digest(s.meta.config));
  CHECK_FALSE(c->info().cmesh_version.empty());
  CHECK(c->info().written_unix_ms > 0);
  for (const auto& p : c->info().pieces)
    CHECK(p.offset % 4096 == 0);
  for (size_t a = 0; a < 3; ++a)
    check_range(*c, s, a, 0, s.values[a].size());
  CHECK_FALSE(c->verify());
  CHECK_FALSE(c->check_config(sample_config()));
  // Typed reads refuse another element size; ranges past the end are refused.
  std::vector<double> wrong(4);
  CHECK(code_of(c->read_range("weights", 0, std::span<double>(wrong))) == errc::invalid_argument);
  std::vector<float> past(8);
  CHECK(code_of(c->read_range("weights", s.values[0].size() - 4, std::span<float>(past)))
        == errc::invalid_argument);
  CHECK(code_of(c->read_range("nope", 0, std::span<float>(past))) == errc::invalid_argument);
}

TEST_CASE("storage: written at S=2, read at S=1, S=3 and any range (reshard)") {
  temp_dir root;
  auto s = make_sample(40, 2);
  // Small pieces (1024 floats) so that ranges start and end inside pieces too.
  write_options o;
  o.max_piece_bytes = 4096;
  auto dir = write_sample(root.path(), s, 2, o);
  REQUIRE_MESSAGE(dir, describe(dir.error()));
  auto c = checkpoint::open(*dir);
  REQUIRE(c);
  const uint64_t n = s.values[0].size();
  for (size_t shards : {1, 3, 4}) {
    auto split = s.shards(shards, 512);
    for (size_t k = 0; k < shards; ++k)
      for (size_t a = 0; a < 3; ++a) {
        const auto& sl = split[k][a];
        check_range(*c, s, a, sl.first, sl.bytes.size() / sizeof(float));
      }
  }
  // Ranges cutting tensors, the written shard boundary and the untensored tail.
  const uint64_t boundary = s.shards(2, 512)[1][0].first;
  const auto& w1 = s.tensors[2];
  for (auto [first, count] : std::vector<std::pair<uint64_t, uint64_t>>{
         {boundary - 3, 6}, {w1.offset + 5, w1.size - 10}, {w1.offset - 1, 2},
         {n - 9, 9}, {0, 1}, {n - 1, 1}, {1, n - 2}, {boundary, 0}})
    for (size_t a = 0; a < 3; ++a)
      check_range(*c, s, a, first, count);
  // What a rank must read: the pieces that touch its range, in order.
  auto ps = c->pieces_for(0, boundary - 3, 6);
  REQUIRE(ps.size() >= 2);
  CHECK(ps.front()->first <= boundary - 3);
  CHECK(ps.back()->first + ps.back()->count >= boundary + 3);
  CHECK(c->info().files[ps.front()->file].name == "shard-0.bin");
  CHECK(c->info().files[ps.back()->file].name == "shard-1.bin");
}

TEST_CASE("storage: verify fills the wanted ranges in its one pass; a bad range is refused") {
  temp_dir root;
  auto s = make_sample(40, 2);
  write_options o;
  o.max_piece_bytes = 4096;
  auto dir = write_sample(root.path(), s, 2, o);
  REQUIRE_MESSAGE(dir, describe(dir.error()));
  auto c = checkpoint::open(*dir);
  REQUIRE(c);
  const uint64_t n = s.values[0].size();
  // Ranges that start and end inside pieces, and one of each array.
  const uint64_t first = n / 3 + 7, count = n / 3;
  std::vector<float> w(count), m(count), v(n);
  std::vector<range_out> wanted{{"weights", first, std::as_writable_bytes(std::span<float>(w))},
                                {"adam_m", first + 1, std::as_writable_bytes(std::span<float>(m))},
                                {"adam_v", 0, std::as_writable_bytes(std::span<float>(v))}};
  REQUIRE(!c->verify(wanted));
  CHECK(std::equal(w.begin(), w.end(), s.values[0].begin() + static_cast<long>(first)));
  CHECK(std::equal(m.begin(), m.end(), s.values[1].begin() + static_cast<long>(first + 1)));
  CHECK(v == s.values[2]);
  // Two ranges of one array, or one past its end: the caller's mistake.
  std::vector<float> x(4);
  auto xb = std::as_writable_bytes(std::span<float>(x));
  CHECK(code_of(c->verify(std::vector<range_out>{{"weights", 0, xb}, {"weights", 8, xb}}))
        == errc::invalid_argument);
  CHECK(code_of(c->verify(std::vector<range_out>{{"weights", n - 2, xb}}))
        == errc::invalid_argument);
  CHECK(code_of(c->verify(std::vector<range_out>{{"nope", 0, xb}})) == errc::invalid_argument);
  // A flipped byte anywhere fails the pass, wanted or not.
  flip_byte(*dir + "/shard-1.bin", 4096 + 3);
  CHECK(code_of(c->verify(wanted)) == errc::corrupt);
}

TEST_CASE("storage: a part of a piece longer than the read buffer (1 MiB) is read and checked") {
  temp_dir root;
  auto s = make_sample(8, 3, 40); // embed: 256 x 1280 floats, 1.25 MiB, one piece
  auto dir = write_sample(root.path(), s, 1);
  REQUIRE(dir);
  auto c = checkpoint::open(*dir);
  REQUIRE(c);
  auto ps = c->pieces_for(0, 0, 1);
  REQUIRE(ps.size() == 1);
  REQUIRE(ps[0]->count * 4 > (1u << 20));
  const uint64_t chunk = (1u << 20) / 4; // elements per buffer
  check_range(*c, s, 0, chunk - 5, 10);   // across the buffer's boundary
  check_range(*c, s, 0, 3, chunk + 100);
  check_range(*c, s, 0, 0, ps[0]->count); // whole: read in place
  // A byte flipped past the first buffer fails a read of the first few elements.
  flip_byte(*dir + "/shard-0.bin", ps[0]->offset + 4 * chunk + 8);
  std::vector<float> head(4);
  CHECK(contains(describe(c->read_range("weights", 0, std::span<float>(head))),
                 "shard-0.bin: tensor embed (weights) checksum mismatch"));
}

TEST_CASE("storage: a flipped byte in a shard names the file and the tensor") {
  temp_dir root;
  auto s = make_sample(7);
  auto dir = write_sample(root.path(), s, 2);
  REQUIRE(dir);
  auto c = checkpoint::open(*dir);
  REQUIRE(c);
  const auto& m = c->info();
  const auto& p = tensor_piece_in(m, "shard-1.bin");
  const auto& tensor = m.tensors[static_cast<size_t>(p.tensor)].name;
  flip_byte(*dir + "/shard-1.bin", p.offset + 5);
  // The manifest and sizes are intact: it opens, but verify reads every byte.
  auto again = checkpoint::open(*dir);
  REQUIRE(again);
  auto err = again->verify();
  REQUIRE(err);
  CHECK(code_of(err) == errc::corrupt);
  INFO(describe(err));
  CHECK(contains(describe(err), "shard-1.bin: tensor " + tensor + " (" + m.arrays[p.array].name
                                  + ") checksum mismatch"));
  // A read that touches the piece fails the same way; one that does not still reads.
  std::vector<float> out(p.count);
  auto read = again->read_range(m.arrays[p.array].name, p.first, std::span<float>(out));
  CHECK(contains(describe(read), "checksum mismatch"));
  check_range(*again, s, p.array, 0, 100);
  // The same through a partial read of the piece (streamed, not read in place).
  std::vector<float> one(1);
  CHECK(contains(describe(again->read_range(m.arrays[p.array].name, p.first + 1,
                                            std::span<float>(one))),
                 "checksum mismatch"));
}

TEST_CASE("storage: a truncated shard, a missing or damaged manifest are never opened") {
  temp_dir root;
  auto s = make_sample(3);
  auto dir = write_sample(root.path(), s, 2);
  REQUIRE(dir);
  SUBCASE("a truncated shard") {
    auto size = std::filesystem::file_size(*dir + "/shard-0.bin");
    std::filesystem::resize_file(*dir + "/shard-0.bin", size - 100);
    auto c = checkpoint::open(*dir);
    REQUIRE_FALSE(c);
    CHECK(code_of(c.error()) == errc::corrupt);
    INFO(describe(c.error()));
    CHECK(contains(describe(c.error()), "shard-0.bin: " + std::to_string(size - 100)
                                          + " bytes, the manifest says " + std::to_string(size)
                                          + " (truncated): tensor "));
  }
  SUBCASE("a missing shard") {
    std::filesystem::remove(*dir + "/shard-1.bin");
    auto c = checkpoint::open(*dir);
    REQUIRE_FALSE(c);
    CHECK(contains(describe(c.error()), "corrupt: " + *dir + "/shard-1.bin: missing"));
  }
  SUBCASE("a missing manifest") {
    std::filesystem::remove(*dir + "/manifest.msgpack");
    auto c = checkpoint::open(*dir);
    REQUIRE_FALSE(c);
    CHECK(code_of(c.error()) == errc::corrupt);
    CHECK(contains(describe(c.error()), "no manifest.msgpack"));
  }
  SUBCASE("a truncated manifest") {
    auto path = *dir + "/manifest.msgpack";
    std::filesystem::resize_file(path, std::filesystem::file_size(path) / 2);
    auto c = checkpoint::open(*dir);
    REQUIRE_FALSE(c);
    CHECK(code_of(c.error()) == errc::corrupt);
    CHECK(contains(describe(c.error()), "manifest.msgpack: truncated"));
    std::filesystem::resize_file(path, 5);
    CHECK(contains(describe(checkpoint::open(*dir).error()), "shorter than its 32-byte header"));
  }
  SUBCASE("a flipped byte in the manifest") {
    flip_byte(*dir + "/manifest.msgpack", 100);
    CHECK(contains(describe(checkpoint::open(*dir).error()), "checksum mismatch of the manifest"));
  }
}

TEST_CASE("storage: a checkpoint of another configuration names each key that differs") {
  temp_dir root;
  auto s = make_sample(5);
  REQUIRE(write_sample(root.path(), s, 1));
  auto job = sample_config();
  job[0].second = "64";                     // model.d_model
  job.push_back({"model.top_k", "2"});      // a key the checkpoint lacks
  auto c = checkpoint::open(root / "step-000000005");
  REQUIRE(c);
  auto err = c->check_config(job);
  REQUIRE(err);
  CHECK(code_of(err) == errc::invalid_argument);
  INFO(describe(err));
  CHECK(contains(describe(err), "checkpoint step 5 was written with another configuration: "
                                "model.d_model = 32 (the job's: 64); model.top_k missing"));
  // newest_valid with that job finds nothing it may load, and says why.
  auto n = newest_valid(root.path(), &job);
  REQUIRE_FALSE(n);
  CHECK(code_of(n.error()) == errc::invalid_argument);
  CHECK(contains(describe(n.error()), "step 5: invalid_argument: "));
  CHECK(contains(describe(n.error()), "model.d_model = 32 (the job's: 64)"));
}

TEST_CASE("storage: newest_valid falls back past a corrupt newest checkpoint and says why") {
  temp_dir root;
  auto empty = newest_valid(root / "missing");
  REQUIRE(empty);
  CHECK_FALSE(empty->found); // no root: nothing to resume from, not an error
  auto none = newest_valid(root.path());
  REQUIRE(none);
  CHECK_FALSE(none->found);

  for (uint64_t step : {80, 100, 120})
    REQUIRE(write_sample(root.path(), make_sample(step, step), 2));
  auto c120 = checkpoint::open(root / "step-000000120");
  REQUIRE(c120);
  const auto& p = tensor_piece_in(c120->info(), "shard-1.bin");
  const auto tensor = c120->info().tensors[static_cast<size_t>(p.tensor)].name;
  flip_byte(root / "step-000000120/shard-1.bin", p.offset);
  std::filesystem::remove(root / "step-000000100/manifest.msgpack");

  auto job = sample_config();
  auto n = newest_valid(root.path(), &job);
  REQUIRE_MESSAGE(n, describe(n.error()));
  REQUIRE(n->found);
  CHECK(n->found->step() == 80);
  REQUIRE(n->skipped.size() == 2);
  INFO(n->note);
  CHECK(contains(n->skipped[0], "step 120: corrupt: "));
  CHECK(contains(n->skipped[0], "shard-1.bin: tensor " + tensor));
  CHECK(contains(n->skipped[1], "step 100: corrupt: "));
  CHECK(contains(n->skipped[1], "no manifest.msgpack"));
  CHECK(contains(n->note, "; falling back to step 80"));
  // Without reading the data the flipped byte goes unseen: step 120 opens.
  auto quick = newest_valid(root.path(), nullptr, false);
  REQUIRE(quick);
  CHECK(quick->found->step() == 120);
  // The listing: every step directory, valid or not, with why not.
  auto list = list_checkpoints(root.path(), true);
  REQUIRE(list);
  REQUIRE(list->size() == 3);
  CHECK(((*list)[0].step == 80 && !(*list)[0].error));
  CHECK(((*list)[1].step == 100 && code_of((*list)[1].error) == errc::corrupt));
  CHECK(((*list)[2].step == 120 && code_of((*list)[2].error) == errc::corrupt));
  CHECK((*list)[0].bytes > 3 * 4 * make_sample(80).values[0].size());
  // None valid: an error naming each, never an empty result.
  std::filesystem::remove(root / "step-000000080/shard-0.bin");
  auto bad = newest_valid(root.path());
  REQUIRE_FALSE(bad);
  CHECK(code_of(bad.error()) == errc::corrupt);
  CHECK(contains(describe(bad.error()), "no valid checkpoint in " + root.path()));
  CHECK(contains(describe(bad.error()), "step 80: corrupt: "));
}

TEST_CASE("storage: a writer dropped or failing before commit leaves nothing behind") {
  temp_dir root;
  auto s = make_sample(10);
  REQUIRE(write_sample(root.path(), s, 2));
  auto parts = s.shards(2);
  std::string partial;
  {
    auto w = checkpoint_writer::begin(root.path(), make_sample(20).meta, s.arrays, s.tensors);
    REQUIRE(w);
    partial = w->partial_dir();
    REQUIRE_FALSE(w->write_shard(0, parts[0]));
    CHECK(std::filesystem::exists(partial + "/shard-0.bin"));
    // Never listed, never loaded, while it is written.
    auto list = list_checkpoints(root.path());
    REQUIRE(list);
    CHECK(list->size() == 1);
    auto partials = list_partials(root.path());
    REQUIRE(partials);
    REQUIRE(partials->size() == 1);
    CHECK(partials->front().writer_alive); // this process
    CHECK(partials->front().owner.step == 20);
    CHECK(newest_valid(root.path())->found->step() == 10);
    // A live writer's directory is kept unless all are asked for.
    auto kept = cleanup_partials(root.path());
    REQUIRE(kept);
    CHECK(kept->empty());
    CHECK(std::filesystem::exists(partial));
    // A second writer of the same step in this process takes a name of
    // its own (never the first one's directory for a leftover): the first
    // one's files stay, and each goes with its writer.
    std::string twin_partial;
    {
      auto twin =
        checkpoint_writer::begin(root.path(), make_sample(20).meta, s.arrays, s.tensors);
      REQUIRE(twin);
      twin_partial = twin->partial_dir();
      CHECK(twin_partial == root / "step-000000020.partial-" + std::to_string(::getpid()) + ".1@"
                              + this_host());
      CHECK(std::filesystem::exists(partial + "/shard-0.bin"));
    }
    CHECK_FALSE(std::filesystem::exists(twin_partial));
    CHECK(std::filesystem::exists(partial + "/shard-0.bin"));
  }
  CHECK_FALSE(std::filesystem::exists(partial));

  // Shards that miss elements: commit refuses, and the partial directory goes.
  auto w = checkpoint_writer::begin(root.path(), make_sample(30).meta, s.arrays, s.tensors);
  REQUIRE(w);
  REQUIRE_FALSE(w->write_shard(1, parts[1]));
  auto done = w->commit();
  REQUIRE_FALSE(done);
  CHECK(code_of(done.error()) == errc::invalid_argument);
  CHECK(contains(describe(done.error()), "array weights: the pieces do not cover"));
  CHECK_FALSE(std::filesystem::exists(w->partial_dir()));
  CHECK(code_of(w->write_shard(0, parts[0])) == errc::invalid_argument); // spent

  // Bad input is refused before anything is written.
  auto w2 = checkpoint_writer::begin(root.path(), make_sample(40).meta, s.arrays, s.tensors);
  REQUIRE(w2);
  std::vector<array_slice> unknown{slice_of("momentum", 0, std::span<const float>(s.values[0]))};
  CHECK(contains(describe(w2->write_shard(0, unknown)), "no array momentum"));
  std::vector<array_slice> past{slice_of("weights", 1, std::span<const float>(s.values[0]))};
  CHECK(contains(describe(w2->write_shard(0, past)), "does not fit array weights"));
  REQUIRE_FALSE(w2->write_shard(0, parts[0]));
  CHECK(contains(describe(w2->write_shard(0, parts[0])), "shard-0.bin written twice"));
  auto bad_layout = s.tensors;
  bad_layout[1].offset = 0;
  auto w3 = checkpoint_writer::begin(root.path(), s.meta, s.arrays, bad_layout);
  REQUIRE_FALSE(w3);
  CHECK(code_of(w3.error()) == errc::invalid_argument);
}

TEST_CASE("storage: writing a step again replaces it whole; remove_checkpoint deletes one") {
  temp_dir root;
  REQUIRE(write_sample(root.path(), make_sample(50, 1), 2));
  auto second = make_sample(50, 2);
  auto dir = write_sample(root.path(), second, 3);
  REQUIRE_MESSAGE(dir, describe(dir.error()));
  auto c = checkpoint::open(*dir);
  REQUIRE(c);
  CHECK(c->info().files.size() == 3);
  check_range(*c, second, 0, 0, second.values[0].size());
  CHECK(list_partials(root.path())->empty()); // the old one went with its partial name

  REQUIRE(write_sample(root.path(), make_sample(60), 1));
  REQUIRE_FALSE(remove_checkpoint(root.path(), 50));
  auto list = list_checkpoints(root.path());
  REQUIRE(list);
  REQUIRE(list->size() == 1);
  CHECK(list->front().step == 60);
  CHECK(list_partials(root.path())->empty());
  CHECK(code_of(remove_checkpoint(root.path(), 50)) == errc::unreachable);
}
