// A worker process for the multi-process NCCL tests (mp_nccl.test.cpp), for
// a machine with a GPU. It joins the mesh like tests/coll_node.cpp, builds
// NCCL communicators through the coordinator's key/value store and reports.
// Several of these processes may share one GPU: each sets NCCL_HOSTID to its
// own value before any NCCL call, so NCCL sees one "host" per process and
// connects them through its socket transport.
//
//   cmesh_test_nccl ops <seed> [big]       every operation and dtype, NCCL against the
//                                          host backend on the same data (big: and 4 Mi
//                                          elements)
//   cmesh_test_nccl kill <victim>          64 MiB all_reduces until the victim is
//                                          SIGKILLed, then shrink (or re-init), check
//   cmesh_test_nccl abort                  abort from another thread while rank 0
//                                          waits in an all_reduce nobody else joins
//   cmesh_test_nccl bench <iters> <count>...  the wrapper against raw ncclAllReduce
#include "collectives/host/host_communicator.hpp"
#include "core/hash.hpp"
#include "collectives/nccl/nccl_communicator.hpp"
#include "core/env.hpp"
#include "transport/join.hpp"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <thread>

using namespace cmesh;
using namespace cmesh::coll;
using namespace std::chrono_literals;

namespace {

struct node {
  joined_mesh j;
  uint32_t rank = 0;
  uint32_t size = 0;
  std::shared_ptr<host_context> host;

  void report(const std::string& key, const std::string& value) {
    j.coordinator.report({rank, key, value, mono_ns()});
  }

  [[noreturn]] void fatal(const std::string& what) {
    report("fatal", what);
    std::fprintf(stderr, "cmesh_test_nccl rank %u: %s\n", rank, what.c_str());
    j.coordinator.wait_shutdown(30s);
    std::_Exit(4);
  }

  peer_status status() {
    auto* net = j.net.get();
    return [net](uint32_t r) { return net->peer_error(r); };
  }

  membership everyone(uint64_t epoch) const {
    membership m{epoch, {}};
    for (uint32_t r = 0; r < size; ++r)
      m.ranks.push_back(r);
    return m;
  }

  std::unique_ptr<communicator> make_nccl(membership m, nccl_options o = {}) {
    auto c = make_nccl_communicator(std::move(m), rank, j.coordinator, status(), o);
    if (!c)
      fatal("make_nccl_communicator: " + describe(c.error()));
    return std::move(*c);
  }

  std::unique_ptr<communicator> make_host(membership m) {
    if (!host) {
      auto ctx = host_context::create(rank);
      if (!ctx)
        fatal("host_context: " + describe(ctx.error()));
      host = *ctx;
    }
    auto c = make_host_communicator(host, std::move(m), j.coordinator, status());
    if (!c)
      fatal("make_host_communicator: " + describe(c.error()));
    return std::move(*c);
  }
};

void cuda_or_die(node& nd, cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    nd.fatal(fmt::format("{}: {}", what, cudaGetErrorString(e)));
}

/// Device memory, freed with the object.
struct dev_buf {
  node& nd;
  void* p = nullptr;
  dev_buf(node& n, size_t bytes) : nd(n) {
    cuda_or_die(nd, cudaMalloc(&p, std::max<size_t>(bytes, 1)), "cudaMalloc");
  }
  ~dev_buf() { (void)cudaFree(p); }
  dev_buf(const dev_buf&) = delete;
  dev_buf& operator=(const dev_buf&) = delete;
  void put(const void* h, size_t bytes) {
    cuda_or_die(nd, cudaMemcpy(p, h, bytes, cudaMemcpyHostToDevice), "cudaMemcpy to device");
  }
  void take(void* h, size_t bytes) {
    cuda_or_die(nd, cudaMemcpy(h, p, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy to host");
  }
  uint8_t* at(size_t byte_offset) { return static_cast<uint8_t*>(p) + byte_offset; }
};

// Small integers (scaled): sums over a few ranks are exact in every dtype, so
// NCCL and the host backend must agree bit for bit whatever their order.
void fill(void* buf, size_t count, dtype t, uint64_t seed, size_t member) {
  for (size_t i = 0; i < count; ++i) {
    auto v = static_cast<int64_t>(splitmix64(seed ^ (uint64_t{member} << 48) ^ i) % 33) - 16;
    switch (t) {
      case dtype::float32: static_cast<float*>(buf)[i] = static_cast<float>(v) * 0.125f; break;
      case dtype::bfloat16: static_cast<bf16*>(buf)[i] = to_bf16(static_cast<float>(v)); break;
      case dtype::int64: static_cast<int64_t*>(buf)[i] = v * 1000003; break;
    }
  }
}

double as_double(const void* buf, size_t i, dtype t) {
  switch (t) {
    case dtype::float32: return static_cast<const float*>(buf)[i];
    case dtype::bfloat16: return from_bf16(static_cast<const bf16*>(buf)[i]);
    case dtype::int64: return static_cast<double>(static_cast<const int64_t*>(buf)[i]);
  }
  return 0;
}

/// Bit-exact, except float averages: NCCL multiplies by 1/n before summing,
/// the host divides the sum, so the last bits may differ.
std::string differs(const void* got, const void* want, size_t count, dtype t, reduce_op op) {
  const size_t bytes = count * size_of(t);
  if (std::memcmp(got, want, bytes) == 0)
    return {};
  if (op == reduce_op::avg && t != dtype::int64) {
    const double rel = t == dtype::float32 ? 1e-5 : 4.0 / 128;
    for (size_t i = 0; i < count; ++i) {
      double g = as_double(got, i, t), w = as_double(want, i, t);
      if (std::fabs(g - w) > rel * std::max(1.0, std::fabs(w)))
        return fmt::format("element {}: {} vs {}", i, g, w);
    }
    return {};
  }
  for (size_t i = 0; i < count; ++i) {
    double g = as_double(got, i, t), w = as_double(want, i, t);
    if (std::memcmp(static_cast<const uint8_t*>(got) + i * size_of(t),
                    static_cast<const uint8_t*>(want) + i * size_of(t), size_of(t)) != 0)
      return fmt::format("element {}: {} vs {}", i, g, w);
  }
  return "differs";
}

struct checker {
  size_t checks = 0;
  std::string failure;

  void ok(const caf::error& e, const std::string& what) {
    ++checks;
    if (e && failure.empty())
      failure = what + ": " + describe(e);
  }
  void same(const std::string& diff, const std::string& what) {
    ++checks;
    if (!diff.empty() && failure.empty())
      failure = what + " differs: " + diff;
  }
};

std::vector<size_t> uneven_counts(size_t total, size_t n, uint64_t seed) {
  std::vector<size_t> c(n, 0);
  size_t left = total;
  for (size_t i = 0; i + 1 < n; ++i) {
    c[i] = left == 0 ? 0 : splitmix64(seed + i) % (left + 1);
    left -= c[i];
  }
  c[n - 1] = left;
  return c;
}

// -- ops ----------------------------------------------------------------------------------

int run_ops(node& nd, uint64_t seed, bool big) {
  auto host = nd.make_host(nd.everyone(1));
  auto gpu = nd.make_nccl(nd.everyone(1));
  const size_t n = gpu->size(), me = gpu->index();
  checker ck;
  std::vector<size_t> sizes{1, 3, 1000, 65539, 262147};
  if (big)
    sizes.push_back((size_t{1} << 22) + 7); // 16 MiB of float32

  const size_t max_elems = n * sizes.back() + 1;
  dev_buf din(nd, max_elems * 8), dout(nd, max_elems * 8);
  for (dtype t : {dtype::float32, dtype::bfloat16, dtype::int64}) {
    const size_t es = size_of(t);
    for (size_t count : sizes) {
      auto tag = fmt::format("{} n={}", to_string(t), count);
      std::vector<uint8_t> h(count * n * es + 1), h2(count * n * es + 1), got(count * n * es + 1);
      // all_reduce, every op
      for (reduce_op op : {reduce_op::sum, reduce_op::avg, reduce_op::max}) {
        uint64_t s = seed ^ (count * 31 + static_cast<size_t>(op) * 7 + static_cast<size_t>(t));
        fill(h.data(), count, t, s, me);
        din.put(h.data(), count * es);
        ck.ok(gpu->all_reduce(din.p, count, t, op), "nccl all_reduce " + tag);
        din.take(got.data(), count * es);
        ck.ok(host->all_reduce(h.data(), count, t, op), "host all_reduce " + tag);
        ck.same(differs(got.data(), h.data(), count, t, op),
                fmt::format("all_reduce {} {}", to_string(op), tag));
      }
      // reduce_scatter: equal blocks of `count`, then uneven blocks of `count` in all
      for (bool even : {true, false}) {
        for (reduce_op op : {reduce_op::sum, reduce_op::avg, reduce_op::max}) {
          uint64_t s = seed ^ (count * 131 + even + static_cast<size_t>(op) * 3);
          auto counts = even ? std::vector<size_t>(n, count) : uneven_counts(count, n, s);
          size_t total = 0;
          for (auto c : counts)
            total += c;
          fill(h.data(), total, t, s, me);
          din.put(h.data(), total * es);
          ck.ok(gpu->reduce_scatter(din.p, dout.p, counts, t, op),
                fmt::format("nccl reduce_scatter {} {}", even ? "even" : "uneven", tag));
          dout.take(got.data(), counts[me] * es);
          ck.ok(host->reduce_scatter(h.data(), h2.data(), counts, t, op),
                "host reduce_scatter " + tag);
          ck.same(differs(got.data(), h2.data(), counts[me], t, op),
                  fmt::format("reduce_scatter {} {} {}", even ? "even" : "uneven",
                              to_string(op), tag));
          // In place: the output is this member's own block of the input
          // (the trainer sums a device gradient so).
          size_t off = 0;
          for (size_t i = 0; i < me; ++i)
            off += counts[i];
          din.put(h.data(), total * es);
          ck.ok(gpu->reduce_scatter(din.p, din.at(off * es), counts, t, op),
                fmt::format("nccl reduce_scatter in place {} {}", even ? "even" : "uneven", tag));
          cuda_or_die(nd,
                      cudaMemcpy(got.data(), din.at(off * es), counts[me] * es,
                                 cudaMemcpyDeviceToHost),
                      "cudaMemcpy to host");
          ck.same(differs(got.data(), h2.data(), counts[me], t, op),
                  fmt::format("reduce_scatter in place {} {} {}", even ? "even" : "uneven",
                              to_string(op), tag));
        }
      }
      // all_gather: equal and uneven blocks
      for (bool even : {true, false}) {
        uint64_t s = seed ^ (count * 151 + even);
        auto counts = even ? std::vector<size_t>(n, count) : uneven_counts(count, n, s);
        size_t total = 0;
        for (size_t i = 0; i < n; ++i)
          total += counts[i];
        fill(h.data(), counts[me], t, s, me);
        din.put(h.data(), counts[me] * es);
        cuda_or_die(nd, cudaMemset(dout.p, 0xee, total * es), "cudaMemset");
        ck.ok(gpu->all_gather(din.p, dout.p, counts, t), "nccl all_gather " + tag);
        dout.take(got.data(), total * es);
        ck.ok(host->all_gather(h.data(), h2.data(), counts, t), "host all_gather " + tag);
        ck.same(differs(got.data(), h2.data(), total, t, reduce_op::sum),
                fmt::format("all_gather {} {}", even ? "even" : "uneven", tag));
        // In place: the input is this member's own block of the output (the
        // trainer gathers a device's weights so).
        size_t off = 0;
        for (size_t i = 0; i < me; ++i)
          off += counts[i];
        cuda_or_die(nd, cudaMemset(dout.p, 0xee, total * es), "cudaMemset");
        cuda_or_die(nd,
                    cudaMemcpy(dout.at(off * es), h.data(), counts[me] * es,
                               cudaMemcpyHostToDevice),
                    "cudaMemcpy to device");
        ck.ok(gpu->all_gather(dout.at(off * es), dout.p, counts, t),
              "nccl all_gather in place " + tag);
        dout.take(got.data(), total * es);
        ck.same(differs(got.data(), h2.data(), total, t, reduce_op::sum),
                fmt::format("all_gather in place {} {}", even ? "even" : "uneven", tag));
      }
      // broadcast from every root
      for (size_t root = 0; root < n; ++root) {
        uint64_t s = seed ^ (count * 171 + root);
        fill(h.data(), count, t, s, me);
        din.put(h.data(), count * es);
        ck.ok(gpu->broadcast(din.p, count, t, root), "nccl broadcast " + tag);
        din.take(got.data(), count * es);
        ck.ok(host->broadcast(h.data(), count, t, root), "host broadcast " + tag);
        ck.same(differs(got.data(), h.data(), count, t, reduce_op::sum),
                fmt::format("broadcast from {} {}", root, tag));
      }
      // all_to_allv: member i sends amount(i, j) elements to j
      {
        uint64_t s = seed ^ (count * 191);
        auto amount = [&](size_t from, size_t to) { return splitmix64(s + from * 64 + to) % (count + 1); };
        std::vector<size_t> sc(n), rc(n);
        size_t stot = 0, rtot = 0;
        for (size_t j = 0; j < n; ++j) {
          sc[j] = amount(me, j);
          rc[j] = amount(j, me);
          stot += sc[j];
          rtot += rc[j];
        }
        std::vector<uint8_t> in(stot * es + 1), want(rtot * es + 1), back(rtot * es + 1);
        fill(in.data(), stot, t, s, me);
        din.put(in.data(), stot * es);
        ck.ok(gpu->all_to_allv(din.p, sc, dout.p, rc, t), "nccl all_to_allv " + tag);
        dout.take(back.data(), rtot * es);
        ck.ok(host->all_to_allv(in.data(), sc, want.data(), rc, t), "host all_to_allv " + tag);
        ck.same(differs(back.data(), want.data(), rtot, t, reduce_op::sum), "all_to_allv " + tag);
      }
    }
  }
  ck.ok(gpu->barrier(), "nccl barrier");
  ck.ok(host->barrier(), "host barrier");
  ck.ok(gpu->poisoned(), "nccl poisoned()");
  nd.report("ops", ck.failure.empty() ? fmt::format("ok {}", ck.checks) : "FAIL " + ck.failure);
  return ck.failure.empty() ? 0 : 1;
}

// -- kill ---------------------------------------------------------------------------------

// The victim is SIGKILLed or SIGSTOPped from outside (mp_nccl.test.cpp); the
// survivors see the same thing either way: an all_reduce that fails.
int run_kill(node& nd, uint32_t victim) {
  const size_t count = size_t{16} << 20; // 64 MiB of float32
  auto comm = nd.make_nccl(nd.everyone(1));
  nd.report("revoke", nccl_can_revoke() ? "yes" : "no");
  dev_buf buf(nd, count * 4);
  cuda_or_die(nd, cudaMemset(buf.p, 0, count * 4), "cudaMemset");
  caf::error err;
  for (int iter = 0; iter < 1000000 && !err; ++iter) {
    err = comm->all_reduce(buf.p, count, dtype::float32, reduce_op::sum, {30s});
    if (iter == 0)
      nd.report("looping", "");
  }
  const int64_t t_err = mono_ns();
  nd.report("error", fmt::format("{} {} {}", to_string(code_of(err)), t_err, describe(err)));
  // The survivors' communicator: nothing is needed from the dead rank.
  const int64_t t0 = mono_ns();
  auto next = shrink(*comm, {victim}, 2, &nd.j.coordinator, nd.status());
  const int64_t t1 = mono_ns();
  if (!next) {
    nd.report("rebuilt", "FAIL " + describe(next.error()));
    return 1;
  }
  auto info = nccl_info_of(**next);
  const size_t small = size_t{1} << 18;
  std::vector<float> h(small, 2.0f);
  dev_buf b(nd, small * 4);
  b.put(h.data(), small * 4);
  auto e2 = (*next)->all_reduce(b.p, small, dtype::float32, reduce_op::sum);
  std::fill(h.begin(), h.end(), 0.0f);
  b.take(h.data(), small * 4);
  const float want = 2.0f * static_cast<float>((*next)->size());
  bool right = !e2 && std::all_of(h.begin(), h.end(), [&](float x) { return x == want; });
  nd.report("rebuilt", fmt::format("{} {:.1f} {} {}", right ? "ok" : "FAIL " + describe(e2),
                                   (t1 - t0) / 1e6,
                                   info ? to_string(info->made_by) : std::string_view("?"),
                                   (*next)->size()));
  nd.report("after", std::string(to_string(code_of(comm->barrier()))));
  return right ? 0 : 1;
}

// -- abort --------------------------------------------------------------------------------

int run_abort(node& nd) {
  auto comm = nd.make_nccl(nd.everyone(1));
  if (nd.rank != 0) {
    // Never joins the operation rank 0 starts.
    nd.j.coordinator.wait_shutdown(120s);
    return 0;
  }
  const size_t count = size_t{1} << 16;
  dev_buf buf(nd, count * 4);
  std::atomic<int64_t> t_abort{0};
  std::thread aborter([&] {
    std::this_thread::sleep_for(300ms);
    t_abort = mono_ns();
    comm->abort({});
  });
  auto e = comm->all_reduce(buf.p, count, dtype::float32, reduce_op::sum, {60s});
  const int64_t t_ret = mono_ns();
  aborter.join();
  auto after = comm->barrier();
  nd.report("abort", fmt::format("{} {:.1f} {}", to_string(code_of(e)),
                                 (t_ret - t_abort.load()) / 1e6, to_string(code_of(after))));
  return 0;
}

// -- bench --------------------------------------------------------------------------------

/// Waits like a careful raw NCCL user of a non-blocking communicator: the
/// launch (ncclInProgress) first, then the stream.
bool raw_wait(ncclComm_t c, cudaStream_t s) {
  ncclResult_t st = ncclInProgress;
  do {
    if (ncclCommGetAsyncError(c, &st) != ncclSuccess)
      return false;
  } while (st == ncclInProgress);
  return st == ncclSuccess && cudaStreamSynchronize(s) == cudaSuccess;
}

int run_bench(node& nd, int iters, const std::vector<size_t>& counts) {
  auto comm = nd.make_nccl(nd.everyone(1));
  auto info = nccl_info_of(*comm);
  if (!info || info->comm == nullptr)
    nd.fatal("no NCCL handle");
  ncclComm_t raw = info->comm;
  auto* stream = static_cast<cudaStream_t>(info->stream);

  // A blocking communicator too, the way most code uses NCCL.
  ncclComm_t blocking = nullptr;
  {
    ncclUniqueId id;
    const std::string key = "bench/blocking-uid";
    if (nd.rank == 0) {
      if (ncclGetUniqueId(&id) != ncclSuccess)
        nd.fatal("ncclGetUniqueId");
      auto* p = reinterpret_cast<const unsigned char*>(&id);
      if (auto e = nd.j.coordinator.kv_put(key, wire::bytes(p, p + sizeof(id))))
        nd.fatal("kv_put: " + describe(e));
    } else {
      auto v = nd.j.coordinator.kv_get(key, 60s);
      if (!v || v->size() != sizeof(id))
        nd.fatal("kv_get of the blocking uid");
      std::memcpy(&id, v->data(), sizeof(id));
    }
    if (auto r = ncclCommInitRank(&blocking, static_cast<int>(nd.size), id,
                                  static_cast<int>(nd.rank));
        r != ncclSuccess)
      nd.fatal(std::string("ncclCommInitRank: ") + ncclGetErrorString(r));
  }
  cudaStream_t bstream = nullptr;
  cuda_or_die(nd, cudaStreamCreateWithFlags(&bstream, cudaStreamNonBlocking), "stream");

  for (size_t count : counts) {
    dev_buf buf(nd, count * 4);
    cuda_or_die(nd, cudaMemset(buf.p, 0, count * 4), "cudaMemset");
    auto time_it = [&](auto&& one) {
      (void)comm->barrier();
      const int64_t t0 = mono_ns();
      for (int i = 0; i < iters; ++i)
        if (!one())
          nd.fatal(fmt::format("bench all_reduce of {} failed", count));
      return (mono_ns() - t0) / 1e3 / iters;
    };
    auto wrapper = [&] { return !comm->all_reduce(buf.p, count, dtype::float32, reduce_op::sum); };
    auto raw_nb = [&] {
      auto r = ncclAllReduce(buf.p, buf.p, count, ncclFloat32, ncclSum, raw, stream);
      return (r == ncclSuccess || r == ncclInProgress) && raw_wait(raw, stream);
    };
    auto raw_b = [&] {
      return ncclAllReduce(buf.p, buf.p, count, ncclFloat32, ncclSum, blocking, bstream)
               == ncclSuccess
             && cudaStreamSynchronize(bstream) == cudaSuccess;
    };
    for (int i = 0; i < 5; ++i) { // warm up every path (connections are made lazily)
      wrapper();
      raw_nb();
      raw_b();
    }
    double w = 1e300, r = 1e300, b = 1e300;
    for (int round = 0; round < 3; ++round) { // interleaved; the best of three
      w = std::min(w, time_it(wrapper));
      r = std::min(r, time_it(raw_nb));
      b = std::min(b, time_it(raw_b));
    }
    nd.report(fmt::format("bench{}", count),
              fmt::format("wrapper_us={:.2f} raw_nonblocking_us={:.2f} raw_blocking_us={:.2f} "
                          "ratio={:.3f} ratio_vs_blocking={:.3f}",
                          w, r, b, w / r, w / b));
  }
  (void)cudaStreamDestroy(bstream);
  (void)ncclCommDestroy(blocking);
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: cmesh_test_nccl ops|kill|abort|bench ARGS\n");
    return 2;
  }
  std::string scenario = argv[1];
  std::string env_error;
  auto place = read_launch_env(env_error);
  // Before any NCCL call: one NCCL "host" per process, so that several ranks
  // may share one GPU (NCCL then uses its socket transport between them).
  const std::string hostid = "cmesh-host-" + std::to_string(place.rank);
  setenv("NCCL_HOSTID", hostid.c_str(), 1);

  auto j = join_mesh({});
  if (!j) {
    std::fprintf(stderr, "cmesh_test_nccl: %s\n", describe(j.error()).c_str());
    return 3;
  }
  node nd{std::move(*j), 0, 0, nullptr};
  nd.rank = static_cast<uint32_t>(nd.j.place.rank);
  nd.size = static_cast<uint32_t>(nd.j.place.world_size);
  if (auto e = nd.j.net->start()) {
    std::fprintf(stderr, "cmesh_test_nccl: %s\n", describe(e).c_str());
    return 3;
  }
  int rc = 2;
  if (scenario == "ops") {
    const bool big = argc > 3 && std::string(argv[3]) == "big";
    rc = run_ops(nd, argc > 2 ? std::stoull(argv[2]) : 1, big);
  } else if (scenario == "kill") {
    rc = run_kill(nd, static_cast<uint32_t>(std::stoul(argv[2])));
  } else if (scenario == "abort") {
    rc = run_abort(nd);
  } else if (scenario == "bench") {
    int iters = argc > 2 ? std::stoi(argv[2]) : 100;
    std::vector<size_t> counts;
    for (int i = 3; i < argc; ++i)
      counts.push_back(std::stoull(argv[i]));
    if (counts.empty())
      counts = {1024, size_t{16} << 20};
    rc = run_bench(nd, iters, counts);
  }
  nd.j.coordinator.wait_shutdown(120s);
  nd.j.net->begin_shutdown();
  nd.j.net->stop();
  return rc;
}
