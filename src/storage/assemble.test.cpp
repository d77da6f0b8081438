// One checkpoint written by several processes: each writes its shards and
// publishes them as a part; the committer (shard 0) adopts the parts of
// its step and commits. On real files, with the parts written in this
// process (several writers of one step beside each other) and in forked
// children (other pids), and the parts nobody adopts cleaned up.
#include "storage/reader.hpp"
#include "storage/testing.hpp"

#include <doctest/doctest.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>

#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

using namespace cmesh;
using namespace cmesh::storage;
using namespace cmesh::storage::testing;
using namespace std::chrono_literals;

namespace {

bool exists(const std::string& path) {
  return std::filesystem::exists(path);
}

std::string base_name(const std::string& path) {
  return std::filesystem::path(path).filename().string();
}

/// Small pieces (1024 floats), so that parts hold many and reads cut them.
write_options small_pieces() {
  write_options o;
  o.max_piece_bytes = 4096;
  return o;
}

/// Begins a writer of `s`'s step, writes shard k of `shards` and publishes
/// it. The part's directory, or the error.
expected<std::string> publish(const std::string& root, const sample_state& s, uint32_t k,
                              size_t shards) {
  auto w = checkpoint_writer::begin(root, s.meta, s.arrays, s.tensors, small_pieces());
  if (!w)
    return w.error();
  if (auto err = w->write_shard(k, s.shards(shards)[k]))
    return err;
  if (auto err = w->publish_part())
    return err;
  return w->partial_dir();
}

/// Reads elements [first, first + count) of every array and compares them with `s`.
void check_range(const checkpoint& c, const sample_state& s, uint64_t first, uint64_t count) {
  for (size_t a = 0; a < s.arrays.size(); ++a) {
    std::vector<float> got(count, -1.0f);
    auto err = c.read_range(s.arrays[a].name, first, std::span<float>(got));
    REQUIRE_MESSAGE(!err, describe(err));
    CHECK_MESSAGE(std::memcmp(got.data(), s.values[a].data() + first, count * sizeof(float)) == 0,
                  s.arrays[a].name << " [" << first << ", " << first + count << ")");
  }
}

/// The checkpoint in `dir` is `s`, whole, in `shards` files: it opens,
/// verifies, reads back bit for bit, and at other shard counts too.
void check_whole(const std::string& dir, const sample_state& s, size_t shards) {
  auto c = checkpoint::open(dir);
  REQUIRE_MESSAGE(c, describe(c.error()));
  CHECK(c->info().meta == s.meta);
  CHECK(c->info().files.size() == shards);
  auto err = c->verify();
  CHECK_MESSAGE(!err, describe(err));
  check_range(*c, s, 0, s.values[0].size());
  for (size_t other : {1, 2, 4, 5}) // reshard: every new rank's range
    for (const auto& rank : s.shards(other))
      check_range(*c, s, rank[0].first, rank[0].bytes.size() / sizeof(float));
}

/// A forked child running `body` (its result: "" for success, else what
/// went wrong), which the parent collects with wait().
struct child {
  pid_t pid = -1;
  int fd = -1;

  static child spawn(const std::function<std::string()>& body) {
    int fds[2];
    REQUIRE(::pipe(fds) == 0);
    child c;
    c.pid = ::fork();
    REQUIRE(c.pid >= 0);
    if (c.pid == 0) {
      ::close(fds[0]);
      std::string out;
      try {
        out = body();
      } catch (const std::exception& e) {
        out = std::string("exception: ") + e.what();
      }
      out = "done " + out;
      (void)!::write(fds[1], out.data(), out.size());
      ::_exit(0); // no destructor: the parent's objects are not the child's to clean up
    }
    ::close(fds[1]);
    c.fd = fds[0];
    return c;
  }

  /// What the child said ("" for success), after it exited; killed past `limit`.
  std::string wait(std::chrono::milliseconds limit) {
    std::string text;
    const auto deadline = std::chrono::steady_clock::now() + limit;
    for (char buf[1024];;) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
      pollfd p{fd, POLLIN, 0};
      if (left.count() <= 0 || ::poll(&p, 1, static_cast<int>(left.count())) == 0) {
        ::kill(pid, SIGKILL);
        text = "done timed out";
        break;
      }
      auto n = ::read(fd, buf, sizeof(buf));
      if (n == 0 || (n < 0 && errno != EINTR))
        break;
      if (n > 0)
        text.append(buf, static_cast<size_t>(n));
    }
    ::close(fd);
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    if (!text.starts_with("done "))
      return "the child ended with status " + std::to_string(status) + " and said " + text;
    return text.substr(5);
  }
};

/// A forked child that writes shard k of `shards` and publishes it, then
/// exits (its pid is gone when the parent looks).
child publish_in_child(const std::string& root, const sample_state& s, uint32_t k,
                       size_t shards) {
  return child::spawn([&root, &s, k, shards]() -> std::string {
    auto dir = publish(root, s, k, shards);
    return dir ? "" : describe(dir.error());
  });
}

} // namespace

TEST_CASE("storage: three writers of one step in one process: two publish parts, the committer "
          "adopts them and commits") {
  temp_dir root;
  auto s = make_sample(40, 4);
  auto split = s.shards(3);
  std::vector<std::string> parts;
  for (uint32_t k : {1u, 2u}) {
    auto w = checkpoint_writer::begin(root.path(), s.meta, s.arrays, s.tensors, small_pieces());
    REQUIRE(w);
    REQUIRE_FALSE(w->write_shard(k, split[k]));
    auto err = w->publish_part();
    REQUIRE_MESSAGE(!err, describe(err));
    parts.push_back(w->partial_dir());
    // The writer is done: another publish, a shard, a commit are refused.
    CHECK(contains(describe(w->publish_part()), "published as a part already"));
    CHECK(code_of(w->write_shard(0, split[0])) == errc::invalid_argument);
    auto late = w->commit();
    REQUIRE_FALSE(late);
    CHECK(code_of(late.error()) == errc::invalid_argument);
  } // dropped: a published part stays, the committer's to adopt
  REQUIRE(parts[0] != parts[1]);
  for (const auto& dir : parts) {
    CHECK(exists(dir + "/part.msgpack"));
    CHECK_FALSE(exists(dir + "/part.msgpack.tmp"));
    auto owner = parse_partial_dir(base_name(dir));
    REQUIRE(owner);
    CHECK(owner->step == 40);
    CHECK(owner->pid == ::getpid());
    CHECK(owner->host == this_host());
  }
  {
    // Nothing written: nothing to publish; the writer's directory goes with it.
    auto empty = checkpoint_writer::begin(root.path(), s.meta, s.arrays, s.tensors);
    REQUIRE(empty);
    CHECK(contains(describe(empty->publish_part()), "no shard written"));
  }
  auto c = checkpoint_writer::begin(root.path(), s.meta, s.arrays, s.tensors, small_pieces());
  REQUIRE(c);
  // The parts are passed by, never taken for this process's leftovers.
  CHECK(c->partial_dir() != parts[0]);
  CHECK(c->partial_dir() != parts[1]);
  CHECK(exists(parts[0] + "/shard-1.bin"));
  CHECK(exists(parts[1] + "/shard-2.bin"));
  REQUIRE_FALSE(c->write_shard(0, split[0]));
  auto err = c->adopt_parts(3, 5s);
  REQUIRE_MESSAGE(!err, describe(err));
  CHECK_FALSE(exists(parts[0]));
  CHECK_FALSE(exists(parts[1]));
  auto dir = c->commit();
  REQUIRE_MESSAGE(dir, describe(dir.error()));
  CHECK(*dir == root / "step-000000040");
  check_whole(*dir, s, 3);
  CHECK(list_partials(root.path())->empty());
}

TEST_CASE("storage: parts written by other processes are adopted (forked writers, other pids)") {
  temp_dir root;
  auto s = make_sample(41, 5);
  // The children write while the committer already waits for them.
  std::vector<child> children;
  for (uint32_t k : {1u, 2u})
    children.push_back(publish_in_child(root.path(), s, k, 3));
  auto c = checkpoint_writer::begin(root.path(), s.meta, s.arrays, s.tensors, small_pieces());
  REQUIRE(c);
  REQUIRE_FALSE(c->write_shard(0, s.shards(3)[0]));
  auto err = c->adopt_parts(3, 30s);
  for (auto& ch : children)
    CHECK(ch.wait(30s) == "");
  REQUIRE_MESSAGE(!err, describe(err));
  auto dir = c->commit();
  REQUIRE_MESSAGE(dir, describe(dir.error()));
  check_whole(*dir, s, 3);
  CHECK(list_partials(root.path())->empty()); // the parts went when adopted

  // The same with the parts published before the committer begins, by
  // processes gone by then: their pids are dead, their parts still adopted.
  auto next = make_sample(42, 6);
  for (uint32_t k : {1u, 2u}) {
    auto ch = publish_in_child(root.path(), next, k, 3);
    REQUIRE(ch.wait(30s) == "");
  }
  auto partials = list_partials(root.path());
  REQUIRE(partials);
  REQUIRE(partials->size() == 2);
  for (const auto& p : *partials) {
    CHECK(p.owner.pid != ::getpid());
    CHECK_FALSE(p.writer_alive);
  }
  auto c2 = checkpoint_writer::begin(root.path(), next.meta, next.arrays, next.tensors,
                                     small_pieces());
  REQUIRE(c2);
  REQUIRE_FALSE(c2->write_shard(0, next.shards(3)[0]));
  REQUIRE_FALSE(c2->adopt_parts(3, 5s));
  auto dir2 = c2->commit();
  REQUIRE_MESSAGE(dir2, describe(dir2.error()));
  check_whole(*dir2, next, 3);
}

TEST_CASE("storage: a committer that times out names the missing shards and leaves the parts") {
  temp_dir root;
  auto s = make_sample(50, 7);
  auto part = publish(root.path(), s, 1, 3);
  REQUIRE_MESSAGE(part, describe(part.error()));
  std::string committer;
  {
    auto c = checkpoint_writer::begin(root.path(), s.meta, s.arrays, s.tensors, small_pieces());
    REQUIRE(c);
    committer = c->partial_dir();
    REQUIRE_FALSE(c->write_shard(0, s.shards(3)[0]));
    const auto start = std::chrono::steady_clock::now();
    auto err = c->adopt_parts(3, 150ms);
    CHECK(std::chrono::steady_clock::now() - start >= 150ms);
    REQUIRE(err);
    CHECK(code_of(err) == errc::timeout);
    INFO(describe(err));
    CHECK(contains(describe(err), "step 50: after 150 ms no part in " + root.path()
                                    + " holds shard 2 (of 3)"));
    // Nothing was moved: the part waits for the next committer.
    CHECK(exists(*part + "/part.msgpack"));
    CHECK(exists(*part + "/shard-1.bin"));
    CHECK_FALSE(exists(committer + "/shard-1.bin"));
    CHECK(exists(committer + "/shard-0.bin"));
    CHECK_FALSE(exists(root / "step-000000050"));
    // Several missing: each named.
    auto none = checkpoint_writer::begin(root.path(), s.meta, s.arrays, s.tensors);
    REQUIRE(none);
    CHECK(contains(describe(none->adopt_parts(4, 20ms)), "holds shards 0, 2, 3 (of 4)"));
  }
  CHECK_FALSE(exists(committer)); // the destructor's
  CHECK_FALSE(exists(root / "step-000000050"));
  CHECK(exists(*part + "/part.msgpack"));
  // A live writer's part is not cleanup_partials'.
  auto cleaned = cleanup_partials(root.path());
  REQUIRE(cleaned);
  CHECK(cleaned->empty());
  // Once the missing shard is published, the next committer takes both parts.
  REQUIRE(publish(root.path(), s, 2, 3));
  auto c = checkpoint_writer::begin(root.path(), s.meta, s.arrays, s.tensors, small_pieces());
  REQUIRE(c);
  REQUIRE_FALSE(c->write_shard(0, s.shards(3)[0]));
  REQUIRE_FALSE(c->adopt_parts(3, 5s));
  auto dir = c->commit();
  REQUIRE_MESSAGE(dir, describe(dir.error()));
  check_whole(*dir, s, 3);
}

TEST_CASE("storage: a part of another step is left alone; one of this step with another layout "
          "or configuration is corrupt") {
  temp_dir root;
  auto s = make_sample(60, 8);
  auto begin_committer = [&] {
    auto c = checkpoint_writer::begin(root.path(), s.meta, s.arrays, s.tensors, small_pieces());
    REQUIRE(c);
    REQUIRE_FALSE(c->write_shard(0, s.shards(2)[0]));
    return std::move(*c);
  };
  auto expect_corrupt = [&](const std::string& part, const std::string& words) {
    auto c = begin_committer();
    auto err = c.adopt_parts(2, 2s);
    REQUIRE(err);
    CHECK(code_of(err) == errc::corrupt);
    INFO(describe(err));
    CHECK(contains(describe(err), part + ": "));
    CHECK(contains(describe(err), words));
    CHECK(exists(part + "/part.msgpack")); // not adopted, not removed
    CHECK(exists(c.partial_dir()));        // the committer's, for its destructor
  };
  SUBCASE("another step") {
    auto other = make_sample(61, 8);
    auto part = publish(root.path(), other, 1, 2);
    REQUIRE(part);
    auto c = begin_committer();
    CHECK(code_of(c.adopt_parts(2, 100ms)) == errc::timeout);
    CHECK(exists(*part + "/part.msgpack"));
    CHECK(exists(*part + "/shard-1.bin"));
  }
  SUBCASE("another configuration") {
    auto other = s;
    other.meta.config.push_back({"train.seed", "2"});
    auto part = publish(root.path(), other, 1, 2);
    REQUIRE(part);
    expect_corrupt(*part, "not a part of this checkpoint: its config digest");
  }
  SUBCASE("another tensor index") {
    auto other = s;
    other.tensors.pop_back(); // "out": elements of no tensor now
    auto part = publish(root.path(), other, 1, 2);
    REQUIRE(part);
    expect_corrupt(*part, "its tensors are not the committer's");
  }
  SUBCASE("another alignment") {
    auto w = checkpoint_writer::begin(root.path(), s.meta, s.arrays, s.tensors, {512, 4096});
    REQUIRE(w);
    REQUIRE_FALSE(w->write_shard(1, s.shards(2)[1]));
    REQUIRE_FALSE(w->publish_part());
    expect_corrupt(w->partial_dir(), "its alignment 512 is not the committer's 4096");
  }
  SUBCASE("another step under this step's name") {
    auto other = make_sample(61, 8);
    auto part = publish(root.path(), other, 1, 2);
    REQUIRE(part);
    auto renamed = root / partial_dir_name(60, ::getpid(), this_host(), 77);
    std::filesystem::rename(*part, renamed);
    expect_corrupt(renamed, "its step 61 is not the committer's 60");
  }
}

TEST_CASE("storage: a damaged part is corrupt, naming its directory") {
  temp_dir root;
  auto s = make_sample(70, 9);
  auto part = publish(root.path(), s, 1, 2);
  REQUIRE(part);
  std::string words;
  SUBCASE("a flipped byte in part.msgpack") {
    flip_byte(*part + "/part.msgpack", 100);
    words = *part + "/part.msgpack: checksum mismatch of the manifest body";
  }
  SUBCASE("a truncated shard file") {
    auto size = std::filesystem::file_size(*part + "/shard-1.bin");
    std::filesystem::resize_file(*part + "/shard-1.bin", size - 10);
    words = *part + ": shard-1.bin: " + std::to_string(size - 10) + " bytes, the part says "
            + std::to_string(size);
  }
  SUBCASE("a missing shard file") {
    std::filesystem::remove(*part + "/shard-1.bin");
    words = *part + ": shard-1.bin missing";
  }
  auto c = checkpoint_writer::begin(root.path(), s.meta, s.arrays, s.tensors);
  REQUIRE(c);
  REQUIRE_FALSE(c->write_shard(0, s.shards(2)[0]));
  auto err = c->adopt_parts(2, 2s);
  REQUIRE(err);
  CHECK(code_of(err) == errc::corrupt);
  CHECK_MESSAGE(contains(describe(err), words), describe(err));
  CHECK(exists(*part + "/part.msgpack"));
  CHECK_FALSE(exists(root / "step-000000070"));
}

TEST_CASE("storage: remove_own_stale_parts removes this process's unadopted parts of older "
          "steps only") {
  temp_dir root;
  auto old_part = publish(root.path(), make_sample(10), 1, 2);
  auto new_part = publish(root.path(), make_sample(20), 1, 2);
  REQUIRE(old_part);
  REQUIRE(new_part);
  // Another process's part of the old step, and a writer of an older step still at work here.
  auto ch = publish_in_child(root.path(), make_sample(10), 0, 2);
  REQUIRE(ch.wait(30s) == "");
  auto busy = checkpoint_writer::begin(root.path(), make_sample(5).meta, make_sample(5).arrays,
                                       make_sample(5).tensors);
  REQUIRE(busy);
  REQUIRE_FALSE(busy->write_shard(0, make_sample(5).shards(2)[0]));
  auto removed = remove_own_stale_parts(root.path(), 20);
  REQUIRE_MESSAGE(removed, describe(removed.error()));
  REQUIRE(removed->size() == 1);
  CHECK(removed->front() == *old_part);
  CHECK_FALSE(exists(*old_part));
  CHECK(exists(*new_part + "/part.msgpack"));
  CHECK(exists(busy->partial_dir() + "/shard-0.bin"));
  auto partials = list_partials(root.path());
  REQUIRE(partials);
  CHECK(partials->size() == 3); // the new part, the busy writer, the child's part
  // Nothing more to remove; a missing root is an I/O error.
  CHECK(remove_own_stale_parts(root.path(), 20)->empty());
  CHECK(code_of(remove_own_stale_parts(root / "missing", 20).error()) == errc::unreachable);
}

TEST_CASE("storage: a part whose writer's process is gone is removed by cleanup_partials") {
  temp_dir root;
  auto s = make_sample(30, 3);
  auto ch = publish_in_child(root.path(), s, 1, 2);
  REQUIRE(ch.wait(30s) == "");
  auto own = publish(root.path(), s, 0, 2); // this process lives: its part stays
  REQUIRE(own);
  auto partials = list_partials(root.path());
  REQUIRE(partials);
  REQUIRE(partials->size() == 2);
  std::string dead;
  for (const auto& p : *partials)
    if (p.owner.pid != ::getpid()) {
      dead = p.dir;
      CHECK_FALSE(p.writer_alive);
      CHECK(p.owner.step == 30);
      CHECK(p.owner.host == this_host());
      CHECK(exists(p.dir + "/part.msgpack"));
    }
  REQUIRE_FALSE(dead.empty());
  auto removed = cleanup_partials(root.path());
  REQUIRE(removed);
  REQUIRE(removed->size() == 1);
  CHECK(removed->front() == dead);
  CHECK_FALSE(exists(dead));
  CHECK(exists(*own + "/part.msgpack"));
}
