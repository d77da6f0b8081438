#include "actors/collective_lane.hpp"

#include "core/error.hpp"

#include <doctest/doctest.h>

#include <atomic>
#include <thread>
#include <vector>

using namespace cmesh;
using namespace cmesh::actors;

TEST_CASE("collective lane: jobs run in order on one thread other than the caller's") {
  collective_lane lane(2);
  std::vector<int> order;
  std::vector<std::thread::id> threads;
  std::vector<collective_lane::ticket> tickets;
  for (int i = 0; i < 50; ++i)
    tickets.push_back(lane.submit([&, i] {
      order.push_back(i); // only the lane's thread touches it until drain()
      threads.push_back(std::this_thread::get_id());
      return caf::error{};
    }));
  CHECK_FALSE(lane.wait(tickets[10]));
  CHECK_FALSE(lane.drain());
  REQUIRE(order.size() == 50);
  for (int i = 0; i < 50; ++i)
    CHECK(order[i] == i);
  for (auto id : threads) {
    CHECK(id == threads.front());
    CHECK(id != std::this_thread::get_id());
  }
  CHECK(lane.jobs_run() == 50);
}

TEST_CASE("collective lane: the caller computes while a job runs") {
  collective_lane lane;
  std::atomic<bool> release{false}, started{false};
  auto t = lane.submit([&] {
    started = true;
    while (!release.load())
      std::this_thread::yield();
    return caf::error{};
  });
  while (!started.load())
    std::this_thread::yield();
  // The job is still running: submit returned at once.
  release = true;
  CHECK_FALSE(lane.wait(t));
}

TEST_CASE("collective lane: the first failure latches, later jobs are skipped until drain") {
  collective_lane lane(3);
  int ran = 0;
  lane.submit([&] { ++ran; return caf::error{}; });
  auto bad = lane.submit([&] {
    ++ran;
    return make_error(errc::peer_lost, "rank 3 lost");
  });
  auto skipped = lane.submit([&] { ++ran; return caf::error{}; });
  auto e = lane.wait(skipped);
  REQUIRE(e);
  CHECK(code_of(e) == errc::peer_lost);
  CHECK(code_of(lane.wait(bad)) == errc::peer_lost);
  CHECK(ran == 2);
  auto d = lane.drain();
  CHECK(code_of(d) == errc::peer_lost);
  // Cleared: the next job runs.
  CHECK_FALSE(lane.run([&] { ++ran; return caf::error{}; }));
  CHECK(ran == 3);
  CHECK_FALSE(lane.drain());
}

TEST_CASE("collective lane: a job that throws is a typed error, not a dead thread") {
  collective_lane lane;
  auto e = lane.run([]() -> caf::error { throw std::runtime_error("boom"); });
  CHECK(code_of(e) == errc::aborted);
  CHECK(code_of(lane.drain()) == errc::aborted);
  CHECK_FALSE(lane.run([] { return caf::error{}; }));
}

TEST_CASE("collective lane: destroyed with jobs queued, it runs them and joins") {
  std::atomic<int> ran{0};
  {
    collective_lane lane(8);
    for (int i = 0; i < 8; ++i)
      lane.submit([&] {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        ++ran;
        return caf::error{};
      });
  }
  CHECK(ran.load() == 8);
}

TEST_CASE("collective lane: run on an idle lane runs on the caller's thread, else after the queue") {
  collective_lane lane;
  std::thread::id where;
  CHECK_FALSE(lane.run([&] {
    where = std::this_thread::get_id();
    return caf::error{};
  }));
  CHECK(where == std::this_thread::get_id()); // idle: no hand-over
  // Behind a queued job: on the lane's thread, after it.
  std::atomic<bool> release{false};
  std::vector<int> order;
  lane.submit([&] {
    while (!release.load())
      std::this_thread::yield();
    order.push_back(1);
    return caf::error{};
  });
  std::thread releaser([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    release = true;
  });
  CHECK_FALSE(lane.run([&] {
    where = std::this_thread::get_id();
    order.push_back(2);
    return caf::error{};
  }));
  releaser.join();
  CHECK(where != std::this_thread::get_id());
  CHECK(order == std::vector<int>{1, 2});
  // A latched error: an idle run does not run its job either.
  lane.run([] { return make_error(errc::timeout, "slow peer"); });
  bool ran = false;
  auto e = lane.run([&] {
    ran = true;
    return caf::error{};
  });
  CHECK(code_of(e) == errc::timeout);
  CHECK_FALSE(ran);
  CHECK(code_of(lane.drain()) == errc::timeout);
  CHECK(lane.jobs_run() == 4); // all but the one skipped
}
