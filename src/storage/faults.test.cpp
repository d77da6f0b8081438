// Faults of the storage itself: a writer killed mid-write, a disk that
// fills up, a directory that cannot be written. The disk and the
// read-only directory are real file systems: a 1 MiB tmpfs mounted in a
// child process's own mount namespace (unshare), so nothing outside the
// test sees it. Where mounting is not permitted those cases are skipped,
// saying why.
#include "storage/reader.hpp"
#include "storage/testing.hpp"

#include <doctest/doctest.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

using namespace cmesh;
using namespace cmesh::storage;
using namespace cmesh::storage::testing;

namespace {

/// What a child process found, as key/value lines (doctest's checks live
/// in the parent: a forked child's would be lost).
struct child_report {
  bool skipped = false;
  std::string why; // skipped: why; else how the child ended, when not with 0
  std::map<std::string, std::string> values;
};

constexpr int skip_code = 77;

/// In a fresh mount namespace: root in a user namespace too when this
/// process is not root. Empty, or why not.
std::string private_mounts() {
  if (::unshare(CLONE_NEWNS) != 0) {
    const uid_t uid = ::geteuid();
    const gid_t gid = ::getegid();
    if (::unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0)
      return std::string("unshare(CLONE_NEWNS), with or without a user namespace: ")
             + std::strerror(errno);
    std::ofstream("/proc/self/setgroups") << "deny";
    std::ofstream("/proc/self/uid_map") << "0 " << uid << " 1";
    std::ofstream("/proc/self/gid_map") << "0 " << gid << " 1";
  }
  if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0)
    return std::string("mount --make-rprivate /: ") + std::strerror(errno);
  return {};
}

/// Forks; the child mounts a tmpfs of 1 MiB on `dir` (when `mount_tmpfs`)
/// in a mount namespace of its own and runs `body`, which reports through
/// `put(key, value)`.
child_report in_child(const std::string& dir, bool mount_tmpfs,
                      const std::function<void(const std::function<void(std::string,
                                                                        std::string)>&)>& body) {
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::close(fds[0]);
    auto put = [&](std::string k, std::string v) {
      auto line = k + "\t" + v + "\n";
      (void)!::write(fds[1], line.data(), line.size());
    };
    if (mount_tmpfs) {
      auto why = private_mounts();
      if (why.empty() && ::mount("tmpfs", dir.c_str(), "tmpfs", 0, "size=1m") != 0)
        why = std::string("mount -t tmpfs: ") + std::strerror(errno);
      if (!why.empty()) {
        put("skip", why);
        ::_exit(skip_code);
      }
    }
    try {
      body(put);
    } catch (const std::exception& e) {
      put("exception", e.what());
    }
    ::_exit(0);
  }
  ::close(fds[1]);
  std::string text;
  char buf[4096];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof(buf))) != 0;)
    if (n > 0)
      text.append(buf, static_cast<size_t>(n));
    else if (errno != EINTR)
      break;
  ::close(fds[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  child_report r;
  for (size_t at = 0; at < text.size();) {
    auto end = text.find('\n', at);
    auto line = text.substr(at, end - at);
    auto tab = line.find('\t');
    r.values[line.substr(0, tab)] = tab == std::string::npos ? "" : line.substr(tab + 1);
    at = end == std::string::npos ? text.size() : end + 1;
  }
  r.skipped = WIFEXITED(status) && WEXITSTATUS(status) == skip_code;
  r.why = r.skipped ? r.values["skip"] : (WIFEXITED(status) && WEXITSTATUS(status) == 0)
                                           ? ""
                                           : "child ended with status " + std::to_string(status);
  return r;
}

std::string outcome(const expected<std::string>& r) {
  return r ? "ok" : describe(r.error());
}

} // namespace

TEST_CASE("storage: a writer killed mid-write leaves a partial directory that is never loaded "
          "and is cleaned up") {
  temp_dir root;
  auto s = make_sample(10);
  REQUIRE(write_sample(root.path(), s, 2));
  auto next = make_sample(20, 2);
  auto r = in_child(root.path(), false, [&](auto& put) {
    auto w = checkpoint_writer::begin(root.path(), next.meta, next.arrays, next.tensors);
    if (!w) {
      put("begin", describe(w.error()));
      return;
    }
    auto parts = next.shards(2);
    put("shard0", describe(w->write_shard(0, parts[0])));
    ::kill(::getpid(), SIGKILL); // between two shards: no destructor runs
  });
  CHECK(r.why == "child ended with status " + std::to_string(SIGKILL));
  CHECK(r.values["shard0"] == "ok");
  auto partials = list_partials(root.path());
  REQUIRE(partials);
  REQUIRE(partials->size() == 1);
  CHECK(partials->front().owner.step == 20);
  CHECK_FALSE(partials->front().writer_alive);
  CHECK(std::filesystem::exists(partials->front().dir + "/shard-0.bin"));
  auto list = list_checkpoints(root.path());
  REQUIRE(list);
  REQUIRE(list->size() == 1);
  CHECK(list->front().step == 10);
  auto n = newest_valid(root.path(), nullptr);
  REQUIRE(n);
  CHECK(n->found->step() == 10);
  CHECK(n->skipped.empty());
  auto removed = cleanup_partials(root.path());
  REQUIRE(removed);
  REQUIRE(removed->size() == 1);
  CHECK(removed->front() == partials->front().dir);
  CHECK_FALSE(std::filesystem::exists(partials->front().dir));
  CHECK(checkpoint::open(root / "step-000000010"));
}

TEST_CASE("storage: the disk filling up during a write is reported; the previous checkpoint "
          "stays valid") {
  temp_dir root;
  auto r = in_child(root.path(), true, [&](auto& put) {
    put("first", outcome(write_sample(root.path(), make_sample(10), 2)));
    // Four times the size: about 1.1 MiB, more than the tmpfs holds.
    put("second", outcome(write_sample(root.path(), make_sample(20, 2, 4), 2)));
    auto partials = list_partials(root.path());
    put("partials", partials ? std::to_string(partials->size()) : describe(partials.error()));
    auto n = newest_valid(root.path(), nullptr, true);
    put("newest", n && n->found ? std::to_string(n->found->step()) : "none");
    put("skipped", n ? std::to_string(n->skipped.size()) : describe(n.error()));
    // Space is free again after the cleanup: a small write succeeds.
    put("third", outcome(write_sample(root.path(), make_sample(30), 1)));
  });
  if (r.skipped) {
    MESSAGE("skipped: the full-disk case needs a tmpfs mount, not permitted here: " << r.why);
    return;
  }
  CHECK(r.why.empty());
  CHECK(r.values["first"] == "ok");
  INFO(r.values["second"]);
  CHECK(contains(r.values["second"],
                 "unreachable: write " + root.path() + "/step-000000020.partial-"));
  CHECK(contains(r.values["second"], "No space left on device"));
  CHECK(r.values["partials"] == "0");
  CHECK(r.values["newest"] == "10");
  CHECK(r.values["skipped"] == "0");
  CHECK(r.values["third"] == "ok");
}

TEST_CASE("storage: a directory that cannot be written is a typed error naming it") {
  temp_dir root;
  // Always: a file where the root directory should be (ENOTDIR).
  {
    std::ofstream(root / "file") << "not a directory";
    auto w = write_sample(root / "file/ckpt", make_sample(1), 1);
    REQUIRE_FALSE(w);
    CHECK(code_of(w.error()) == errc::unreachable);
    CHECK(contains(describe(w.error()), root / "file/ckpt"));
    CHECK(code_of(list_checkpoints(root / "file").error()) == errc::unreachable);
  }
  // A read-only file system (chmod 0555 does not stop root: a tmpfs
  // remounted read-only does). What was written before still loads.
  auto r = in_child(root.path(), true, [&](auto& put) {
    put("first", outcome(write_sample(root.path(), make_sample(10), 2)));
    if (::mount("tmpfs", root.path().c_str(), "tmpfs", MS_REMOUNT | MS_RDONLY, nullptr) != 0) {
      put("remount", std::strerror(errno));
      return;
    }
    put("second", outcome(write_sample(root.path(), make_sample(20), 2)));
    auto n = newest_valid(root.path(), nullptr, true);
    put("newest", n && n->found ? std::to_string(n->found->step()) : "none");
    auto cleaned = cleanup_partials(root.path(), true);
    put("cleanup", cleaned ? std::to_string(cleaned->size()) : describe(cleaned.error()));
    put("remove", describe(remove_checkpoint(root.path(), 10)));
  });
  if (r.skipped) {
    MESSAGE("skipped: the read-only case needs a tmpfs mount, not permitted here: " << r.why);
    return;
  }
  CHECK(r.why.empty());
  CHECK(r.values["first"] == "ok");
  REQUIRE_MESSAGE(r.values.count("second"), "remount read-only: " << r.values["remount"]);
  INFO(r.values["second"]);
  CHECK(contains(r.values["second"],
                 "unreachable: mkdir " + root.path() + "/step-000000020.partial-"));
  CHECK(contains(r.values["second"], "Read-only file system"));
  CHECK(r.values["newest"] == "10");
  CHECK(r.values["cleanup"] == "0");
  CHECK(contains(r.values["remove"], "Read-only file system"));
}
