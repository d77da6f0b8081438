// The NCCL backend in one process: a one-rank communicator (every operation
// and dtype against the host reductions of collectives/dtype.hpp), abort from
// another thread, poisoning, abort_all. Every case skips, saying why, when the
// machine has no CUDA device (CI). Several ranks: mp_nccl.test.cpp.
#include "collectives/nccl/nccl_communicator.hpp"
#include "core/hash.hpp"

#include "core/env.hpp"
#include "kernels/gpu_test.hpp"

#include <cuda_runtime_api.h>
#include <doctest/doctest.h>

#include <cstring>
#include <thread>

using namespace cmesh;
using namespace cmesh::coll;
using namespace std::chrono_literals;

namespace {

#define SKIP_WITHOUT_DEVICE() CMESH_SKIP_WITHOUT_DEVICE()

/// Device memory of `bytes` (at least 1), freed with the object.
struct dev_buf {
  void* p = nullptr;
  explicit dev_buf(size_t bytes) { REQUIRE(cudaMalloc(&p, std::max<size_t>(bytes, 1)) == cudaSuccess); }
  ~dev_buf() { (void)cudaFree(p); }
  dev_buf(const dev_buf&) = delete;
  dev_buf& operator=(const dev_buf&) = delete;
  template <class T = void>
  T* get() const { return static_cast<T*>(p); }
  void put(const std::vector<uint8_t>& h) const {
    REQUIRE(cudaMemcpy(p, h.data(), h.size(), cudaMemcpyHostToDevice) == cudaSuccess);
  }
  std::vector<uint8_t> take(size_t bytes) const {
    std::vector<uint8_t> h(bytes);
    REQUIRE(cudaMemcpy(h.data(), p, bytes, cudaMemcpyDeviceToHost) == cudaSuccess);
    return h;
  }
};

/// Values whose sums are exact in every dtype.
std::vector<uint8_t> filled(size_t count, dtype t, uint64_t seed) {
  std::vector<uint8_t> out(count * size_of(t));
  for (size_t i = 0; i < count; ++i) {
    auto v = static_cast<int64_t>(splitmix64(seed ^ i) % 33) - 16;
    switch (t) {
      case dtype::float32: reinterpret_cast<float*>(out.data())[i] = static_cast<float>(v) * 0.125f; break;
      case dtype::bfloat16: reinterpret_cast<bf16*>(out.data())[i] = to_bf16(static_cast<float>(v)); break;
      case dtype::int64: reinterpret_cast<int64_t*>(out.data())[i] = v * 1000003; break;
    }
  }
  return out;
}

/// The reduction over the members' inputs, by the host functions.
std::vector<uint8_t> reference(const std::vector<std::vector<uint8_t>>& inputs, size_t count,
                               dtype t, reduce_op op) {
  auto out = inputs.at(0);
  for (size_t m = 1; m < inputs.size(); ++m)
    REQUIRE(reduce_into(out.data(), inputs[m].data(), count, t, op));
  if (op == reduce_op::avg)
    scale_down(out.data(), count, t, inputs.size());
  return out;
}

std::unique_ptr<communicator> one_rank(uint64_t epoch, nccl_options opts = {}) {
  auto id = make_nccl_unique_id();
  REQUIRE_MESSAGE(id, describe(id.error()));
  opts.device = 0;
  auto c = make_nccl_communicator(membership{epoch, {7}}, 7, *id, nullptr, opts);
  REQUIRE_MESSAGE(c, describe(c.error()));
  return std::move(*c);
}

} // namespace

TEST_CASE("nccl: a one-rank communicator computes every operation and dtype like the host") {
  SKIP_WITHOUT_DEVICE();
  for (bool block_path : {false, true}) {
    CAPTURE(block_path);
    nccl_options opts;
    opts.force_block_path = block_path;
    auto comm = one_rank(1, opts);
    CHECK(comm->size() == 1);
    CHECK(comm->index() == 0);
    auto info = nccl_info_of(*comm);
    REQUIRE(info);
    CHECK(info->made_by == nccl_info::origin::init);
    CHECK(info->comm != nullptr);
    for (dtype t : {dtype::float32, dtype::bfloat16, dtype::int64}) {
      const size_t es = size_of(t);
      for (size_t count : {size_t{1}, size_t{1000}, size_t{65539}}) {
        CAPTURE(to_string(t));
        CAPTURE(count);
        const size_t bytes = count * es;
        dev_buf a(bytes), b(bytes);
        for (reduce_op op : {reduce_op::sum, reduce_op::avg, reduce_op::max}) {
          CAPTURE(to_string(op));
          auto in = filled(count, t, count * 3 + static_cast<size_t>(op));
          a.put(in);
          REQUIRE_FALSE(comm->all_reduce(a.get(), count, t, op));
          CHECK(a.take(bytes) == reference({in}, count, t, op));
          // reduce_scatter with one member: its block is everything
          a.put(in);
          REQUIRE_FALSE(comm->reduce_scatter(a.get(), b.get(), {count}, t, op));
          CHECK(b.take(bytes) == reference({in}, count, t, op));
        }
        auto in = filled(count, t, count * 5);
        a.put(in);
        REQUIRE(cudaMemset(b.get(), 0, bytes) == cudaSuccess);
        REQUIRE_FALSE(comm->all_gather(a.get(), b.get(), {count}, t));
        CHECK(b.take(bytes) == in);
        a.put(in);
        REQUIRE_FALSE(comm->broadcast(a.get(), count, t, 0));
        CHECK(a.take(bytes) == in);
        CHECK(code_of(comm->broadcast(a.get(), count, t, 1)) == errc::invalid_argument);
        REQUIRE(cudaMemset(b.get(), 0, bytes) == cudaSuccess);
        REQUIRE_FALSE(comm->all_to_allv(a.get(), {count}, b.get(), {count}, t));
        CHECK(b.take(bytes) == in);
        REQUIRE_FALSE(comm->all_to_all(a.get(), b.get(), count, t));
        CHECK(b.take(bytes) == in);
      }
    }
    CHECK_FALSE(comm->barrier());
    // Zero elements, and argument errors that do not poison.
    CHECK_FALSE(comm->all_reduce(nullptr, 0, dtype::float32, reduce_op::sum));
    CHECK(code_of(comm->reduce_scatter(nullptr, nullptr, {1, 2}, dtype::float32, reduce_op::sum))
          == errc::invalid_argument);
    CHECK_FALSE(comm->poisoned());
    CHECK_FALSE(comm->barrier());
  }
}

TEST_CASE("nccl: abort from another thread returns aborted promptly and poisons") {
  SKIP_WITHOUT_DEVICE();
  // How the failing operation stops the NCCL communicator: ncclCommAbort's
  // teardown in the background (the default when there is no revoke), the
  // same waited for, and the defaults (ncclCommRevoke where the library has it).
  struct variant {
    const char* name;
    bool revoke, background;
    int64_t bound_ms; // generous: NCCL's own teardown takes about 500 ms
  };
  for (const variant v : {variant{"abort, teardown in the background", false, true, 250},
                          variant{"abort, teardown waited for", false, false, 3000},
                          variant{"defaults", true, true, 3000}}) {
    CAPTURE(v.name);
    nccl_options opts;
    opts.revoke_on_failure = v.revoke;
    opts.abort_in_background = v.background;
    auto comm = one_rank(2, opts);
    const size_t count = size_t{16} << 20; // 64 MiB of float32
    dev_buf a(count * 4);
    REQUIRE(cudaMemset(a.get(), 0, count * 4) == cudaSuccess);
    std::atomic<int64_t> t_abort{0};
    std::thread aborter([&] {
      std::this_thread::sleep_for(200ms);
      t_abort = mono_ns();
      comm->abort({});
    });
    caf::error e;
    int iters = 0;
    while (!e && iters < 1000000) {
      e = comm->all_reduce(a.get(), count, dtype::float32, reduce_op::sum, {10s});
      ++iters;
    }
    const int64_t t_ret = mono_ns();
    aborter.join();
    const int64_t ms = (t_ret - t_abort.load()) / 1000000;
    MESSAGE("aborted (" << std::string(v.name) << ") after " << iters << " all_reduces; returned " << ms
                        << " ms after abort()");
    CHECK(code_of(e) == errc::aborted);
    CHECK(ms < v.bound_ms);
    CHECK(code_of(comm->poisoned()) == errc::aborted);
    // Every later operation is refused at once.
    CHECK(code_of(comm->barrier()) == errc::poisoned);
    CHECK(code_of(comm->all_reduce(a.get(), 4, dtype::float32, reduce_op::sum)) == errc::poisoned);
    CHECK(code_of(comm->broadcast(a.get(), 4, dtype::float32, 0)) == errc::poisoned);
    CHECK(code_of(comm->all_gather(a.get(), a.get(), {4}, dtype::float32)) == errc::poisoned);
    CHECK(code_of(comm->all_to_all(a.get(), a.get(), 4, dtype::float32)) == errc::poisoned);
    // The teardown left behind finishes.
    const int64_t t_drain = mono_ns();
    CHECK(drain_background_aborts(20s));
    MESSAGE("aborted (" << std::string(v.name) << "): background teardown done " << (mono_ns() - t_drain) / 1000000
                        << " ms later");
  }
}

TEST_CASE("nccl: abort before an operation; a second communicator is unaffected") {
  SKIP_WITHOUT_DEVICE();
  auto c1 = one_rank(3);
  auto c2 = one_rank(4);
  c1->abort(make_error(errc::aborted, "test says stop"));
  auto e = c1->barrier();
  CHECK(code_of(e) == errc::aborted);
  CHECK(describe(e).find("test says stop") != std::string::npos);
  CHECK(code_of(c1->barrier()) == errc::poisoned);
  CHECK_FALSE(c2->barrier());
  CHECK_FALSE(c2->poisoned());
}

TEST_CASE("nccl: abort_all aborts several communicators in one group") {
  SKIP_WITHOUT_DEVICE();
  auto c1 = one_rank(5);
  auto c2 = one_rank(6);
  REQUIRE_FALSE(c1->barrier());
  REQUIRE_FALSE(c2->barrier());
  std::vector<communicator*> all{c1.get(), c2.get()};
  const int64_t t0 = mono_ns();
  CHECK_FALSE(abort_all(all));
  MESSAGE("abort_all of 2 took " << (mono_ns() - t0) / 1e6 << " ms");
  for (auto* c : all) {
    CHECK(code_of(c->poisoned()) == errc::aborted);
    CHECK(code_of(c->barrier()) == errc::poisoned);
    auto info = nccl_info_of(*c);
    REQUIRE(info);
    CHECK(info->comm == nullptr);
  }
  // Aborting again is harmless.
  CHECK_FALSE(abort_all(all));
}

TEST_CASE("nccl: construction errors") {
  SKIP_WITHOUT_DEVICE();
  auto id = make_nccl_unique_id();
  REQUIRE(id);
  CHECK(code_of(make_nccl_communicator(membership{1, {}}, 0, *id, nullptr).error())
        == errc::invalid_argument);
  CHECK(code_of(make_nccl_communicator(membership{1, {1, 2}}, 0, *id, nullptr).error())
        == errc::invalid_argument);
  CHECK(code_of(make_nccl_communicator(membership{1, {0, 0}}, 0, *id, nullptr).error())
        == errc::invalid_argument);
  nccl_options bad;
  bad.device = 1 << 20;
  CHECK(code_of(make_nccl_communicator(membership{1, {0}}, 0, *id, nullptr, bad).error())
        == errc::invalid_argument);
  // A member that never arrives: the creation's watchdog gives up.
  nccl_options quick;
  quick.init_timeout = 2s;
  const int64_t t0 = mono_ns();
  auto lonely = make_nccl_communicator(membership{1, {0, 1}}, 0, *id, nullptr, quick);
  REQUIRE_FALSE(lonely);
  MESSAGE("init without the other member: " << describe(lonely.error()) << " after "
                                            << (mono_ns() - t0) / 1e6 << " ms");
  CHECK(code_of(lonely.error()) == errc::timeout);
  // The abort flag stops a creation too.
  auto id2 = make_nccl_unique_id();
  REQUIRE(id2);
  std::atomic<bool> stop{false};
  nccl_options stoppable;
  stoppable.abort_flag = &stop;
  std::thread t([&] {
    std::this_thread::sleep_for(300ms);
    stop = true;
  });
  auto stopped = make_nccl_communicator(membership{1, {0, 1}}, 0, *id2, nullptr, stoppable);
  t.join();
  REQUIRE_FALSE(stopped);
  CHECK(code_of(stopped.error()) == errc::aborted);
}

TEST_CASE("nccl: a peer reported lost fails the creation with peer_lost naming it") {
  SKIP_WITHOUT_DEVICE();
  auto id = make_nccl_unique_id();
  REQUIRE(id);
  peer_status st = [](uint32_t r) -> caf::error {
    return r == 9 ? make_error(errc::peer_lost, "endpoint failed") : caf::error{};
  };
  auto c = make_nccl_communicator(membership{1, {0, 9}}, 0, *id, st);
  REQUIRE_FALSE(c);
  CHECK(code_of(c.error()) == errc::peer_lost);
  CHECK(describe(c.error()).find("rank 9") != std::string::npos);
}
