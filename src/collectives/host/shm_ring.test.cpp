#include "collectives/host/shm_ring.hpp"

#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <vector>

using namespace cmesh;
using namespace cmesh::coll;

TEST_CASE("shm_ring: messages in order through a full ring and around it") {
  auto rx = shm_ring::create(4, 256);
  REQUIRE(rx);
  auto tx = shm_ring::attach(rx->locator());
  REQUIRE(tx);
  uint64_t tag = 0;
  size_t bytes = 0;
  CHECK(rx->peek(tag, bytes) == nullptr);
  uint64_t next_read = 0;
  for (uint64_t i = 0; i < 40; ++i) {
    uint8_t* slot = tx->reserve();
    if (slot == nullptr) { // full: exactly 4 unread
      CHECK(i - next_read == 4);
      const uint8_t* d = rx->peek(tag, bytes);
      REQUIRE(d != nullptr);
      CHECK(tag == next_read);
      CHECK(bytes == next_read % 200);
      CHECK((bytes == 0 || d[bytes - 1] == static_cast<uint8_t>(next_read)));
      rx->release();
      ++next_read;
      slot = tx->reserve();
      REQUIRE(slot != nullptr);
    }
    std::memset(slot, static_cast<int>(i), i % 200);
    tx->publish(i, i % 200);
  }
  while (const uint8_t* d = rx->peek(tag, bytes)) {
    CHECK(tag == next_read);
    CHECK((bytes == 0 || d[0] == static_cast<uint8_t>(next_read)));
    rx->release();
    ++next_read;
  }
  CHECK(next_read == 40);
}

TEST_CASE("shm_ring: a writer in another process") {
  auto rx = shm_ring::create(2, 4096);
  REQUIRE(rx);
  auto where = rx->locator();
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    // The child maps the parent's segment as a peer process would.
    where.pid = ::getppid();
    auto tx = shm_ring::attach(where);
    if (!tx)
      ::_exit(2);
    for (uint64_t i = 0; i < 100; ++i) {
      uint8_t* s;
      while ((s = tx->reserve()) == nullptr)
        ;
      std::memset(s, static_cast<int>(i), 4096);
      tx->publish(i, 4096);
    }
    ::_exit(0);
  }
  uint64_t got = 0, tag = 0;
  size_t bytes = 0;
  bool right = true;
  while (got < 100) {
    const uint8_t* d = rx->peek(tag, bytes);
    if (d == nullptr)
      continue;
    right &= tag == got && bytes == 4096 && d[0] == static_cast<uint8_t>(got)
             && d[4095] == static_cast<uint8_t>(got);
    rx->release();
    ++got;
  }
  int st = 0;
  ::waitpid(pid, &st, 0);
  CHECK(right);
  CHECK(WIFEXITED(st));
  CHECK(WEXITSTATUS(st) == 0);
}

TEST_CASE("shm_ring: a wrong nonce, geometry or process is a typed error") {
  auto rx = shm_ring::create(2, 1024);
  REQUIRE(rx);
  auto where = rx->locator();
  auto bad_nonce = where;
  bad_nonce.nonce ^= 1;
  auto a = shm_ring::attach(bad_nonce);
  REQUIRE_FALSE(a);
  CHECK(code_of(a.error()) == errc::invalid_argument);
  auto bad_size = where;
  bad_size.slot_bytes = 2048;
  auto b = shm_ring::attach(bad_size);
  REQUIRE_FALSE(b);
  CHECK(code_of(b.error()) == errc::invalid_argument);
  auto no_fd = where;
  no_fd.fd = 100000;
  auto c = shm_ring::attach(no_fd);
  REQUIRE_FALSE(c);
  CHECK(code_of(c.error()) == errc::unreachable);
  auto silly = where;
  silly.slots = 0;
  CHECK_FALSE(shm_ring::attach(silly));
}
