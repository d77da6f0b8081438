// A worker process for the multi-process collectives tests. It joins the
// mesh, builds host communicators through the coordinator and reports.
//
//   cmesh_test_coll ops <seed> <big_elems>   every operation, dtype and size
//   cmesh_test_coll kill <victim>            64 MiB all_reduces until a rank dies,
//                                            then rebuild without it and check
//   cmesh_test_coll stop <victim>            all_reduces with a short timeout
//   cmesh_test_coll abort                    abort from another thread
//   cmesh_test_coll exact                    exact mode over 4x1, 2x2, 1x4, and sharded 2x2
#include "collectives/exact.hpp"
#include "core/hash.hpp"
#include "collectives/host/host_communicator.hpp"
#include "core/env.hpp"
#include "transport/join.hpp"

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <xxhash.h>

#include <cstring>
#include <thread>

using namespace cmesh;
using namespace cmesh::coll;
using namespace std::chrono_literals;

namespace {

struct node {
  joined_mesh j;
  std::shared_ptr<host_context> ctx;
  uint32_t rank = 0;
  uint32_t size = 0;

  void report(const std::string& key, const std::string& value) {
    j.coordinator.report({rank, key, value, mono_ns()});
  }

  peer_status status() {
    auto* net = j.net.get();
    return [net](uint32_t r) { return net->peer_error(r); };
  }

  std::unique_ptr<communicator> make(membership m, host_options o = {}) {
    auto c = make_host_communicator(ctx, std::move(m), j.coordinator, status(), o);
    if (!c) {
      report("fatal", describe(c.error()));
      std::exit(4);
    }
    return std::move(*c);
  }

  membership everyone(uint64_t epoch) const {
    membership m{epoch, {}};
    for (uint32_t r = 0; r < size; ++r)
      m.ranks.push_back(r);
    return m;
  }
};

// Inputs whose sums over a few ranks are exact in every dtype, so results
// can be compared bit for bit with a serial reference whatever the order.
int64_t value_int(uint64_t seed, size_t member, size_t i) {
  return static_cast<int64_t>(splitmix64(seed ^ (uint64_t{member} << 48) ^ i) % 33) - 16;
}

void fill(void* buf, size_t count, dtype t, uint64_t seed, size_t member) {
  for (size_t i = 0; i < count; ++i) {
    auto v = value_int(seed, member, i);
    switch (t) {
      case dtype::float32: static_cast<float*>(buf)[i] = static_cast<float>(v) * 0.125f; break;
      case dtype::bfloat16: static_cast<bf16*>(buf)[i] = to_bf16(static_cast<float>(v)); break;
      case dtype::int64: static_cast<int64_t*>(buf)[i] = v * 1000003; break;
    }
  }
}

/// Serial reference of a reduction over members 0..n-1, element i.
void reference(void* out, size_t count, dtype t, reduce_op op, uint64_t seed, size_t n,
               size_t first = 0) {
  const size_t es = size_of(t);
  std::vector<uint8_t> tmp(count * es);
  fill(out, count, t, seed, 0);
  (void)first;
  for (size_t m = 1; m < n; ++m) {
    fill(tmp.data(), count, t, seed, m);
    (void)reduce_into(out, tmp.data(), count, t, op);
  }
  if (op == reduce_op::avg)
    scale_down(out, count, t, n);
}

struct checker {
  explicit checker(node& n) : nd(n) {}
  node& nd;
  size_t checks = 0;
  std::string failure;

  void expect(bool ok, const std::string& what) {
    ++checks;
    if (!ok && failure.empty())
      failure = what;
  }

  void expect_ok(const caf::error& e, const std::string& what) {
    expect(!e, what + ": " + describe(e));
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

void check_ops(node& nd, communicator& comm, checker& ck, uint64_t seed, size_t big) {
  const size_t n = comm.size();
  const size_t me = comm.index();
  std::vector<size_t> sizes{1, 2, 3, 5, 1000, 4097, 65539, (size_t{1} << 20) + 7};
  if (big > 0)
    sizes.push_back(big);
  for (dtype t : {dtype::float32, dtype::bfloat16, dtype::int64}) {
    const size_t es = size_of(t);
    for (size_t count : sizes) {
      bool is_big = count == big && big > 0;
      auto tag = fmt::format("{} n={}", to_string(t), count);
      std::vector<uint8_t> buf(count * es), ref(count * es);
      // all_reduce, every op (the big size only for sum)
      for (reduce_op op : {reduce_op::sum, reduce_op::avg, reduce_op::max}) {
        if (is_big && op != reduce_op::sum)
          continue;
        uint64_t s = seed ^ (count * 31 + static_cast<size_t>(op) * 7 + static_cast<size_t>(t));
        fill(buf.data(), count, t, s, me);
        ck.expect_ok(comm.all_reduce(buf.data(), count, t, op), "all_reduce " + tag);
        reference(ref.data(), count, t, op, s, n);
        ck.expect(buf == ref, fmt::format("all_reduce {} {} differs", to_string(op), tag));
      }
      if (is_big && t != dtype::float32)
        continue;
      // reduce_scatter with uneven blocks
      {
        uint64_t s = seed ^ (count * 131);
        auto counts = uneven_counts(count, n, s);
        fill(buf.data(), count, t, s, me);
        size_t off = 0;
        for (size_t i = 0; i < me; ++i)
          off += counts[i];
        std::vector<uint8_t> out(counts[me] * es + 1);
        // A member with an empty block may pass a null buffer (training does).
        ck.expect_ok(comm.reduce_scatter(buf.data(), counts[me] ? out.data() : nullptr, counts, t,
                                         reduce_op::sum),
                     "reduce_scatter " + tag);
        reference(ref.data(), count, t, reduce_op::sum, s, n);
        ck.expect(std::memcmp(out.data(), ref.data() + off * es, counts[me] * es) == 0,
                  "reduce_scatter differs " + tag);
        // In place: the output is this member's own block of the input.
        fill(buf.data(), count, t, s, me);
        ck.expect_ok(comm.reduce_scatter(buf.data(), buf.data() + off * es, counts, t,
                                         reduce_op::sum),
                     "reduce_scatter in place " + tag);
        ck.expect(std::memcmp(buf.data() + off * es, ref.data() + off * es, counts[me] * es) == 0,
                  "reduce_scatter in place differs " + tag);
      }
      // all_gather with uneven blocks
      {
        uint64_t s = seed ^ (count * 151);
        auto counts = uneven_counts(count, n, s);
        std::vector<uint8_t> all(count * es), mine(counts[me] * es + 1);
        fill(all.data(), count, t, s, 0); // member i contributes its block of this
        size_t off = 0;
        for (size_t i = 0; i < me; ++i)
          off += counts[i];
        std::memcpy(mine.data(), all.data() + off * es, counts[me] * es);
        std::fill(buf.begin(), buf.end(), 0xee);
        ck.expect_ok(comm.all_gather(counts[me] ? mine.data() : nullptr, buf.data(), counts, t),
                     "all_gather " + tag);
        ck.expect(buf == all, "all_gather differs " + tag);
        // In place: the input is this member's own block of the output.
        std::fill(buf.begin(), buf.end(), 0xee);
        std::memcpy(buf.data() + off * es, mine.data(), counts[me] * es);
        ck.expect_ok(comm.all_gather(buf.data() + off * es, buf.data(), counts, t),
                     "all_gather in place " + tag);
        ck.expect(buf == all, "all_gather in place differs " + tag);
      }
      // broadcast from each root (two roots for the big one)
      for (size_t root = 0; root < n; ++root) {
        if (is_big && root > 1)
          break;
        uint64_t s = seed ^ (count * 171 + root);
        fill(ref.data(), count, t, s, root);
        if (me == root)
          buf = ref;
        else
          std::fill(buf.begin(), buf.end(), 0);
        ck.expect_ok(comm.broadcast(buf.data(), count, t, root), "broadcast " + tag);
        ck.expect(buf == ref, fmt::format("broadcast from {} differs {}", root, tag));
      }
      // all_to_allv: member i sends count_ij elements to j
      if (count <= (size_t{1} << 20) + 7) {
        uint64_t s = seed ^ (count * 191);
        auto amount = [&](size_t from, size_t to) { return splitmix64(s + from * 64 + to) % (count + 1); };
        std::vector<size_t> sc(n), rc(n);
        for (size_t j = 0; j < n; ++j) {
          sc[j] = amount(me, j);
          rc[j] = amount(j, me);
        }
        size_t stot = 0, rtot = 0;
        for (size_t j = 0; j < n; ++j) {
          stot += sc[j];
          rtot += rc[j];
        }
        std::vector<uint8_t> in(stot * es + 1), out(rtot * es + 1, 0), expect(rtot * es + 1, 0);
        // block for j is filled from stream (me, j)
        size_t off = 0;
        for (size_t j = 0; j < n; ++j) {
          fill(in.data() + off * es, sc[j], t, s + j, me);
          off += sc[j];
        }
        off = 0;
        for (size_t j = 0; j < n; ++j) {
          fill(expect.data() + off * es, rc[j], t, s + me, j);
          off += rc[j];
        }
        ck.expect_ok(comm.all_to_allv(in.data(), sc, out.data(), rc, t), "all_to_allv " + tag);
        ck.expect(out == expect, "all_to_allv differs " + tag);
      }
    }
  }
  ck.expect_ok(comm.barrier(), "barrier");
  // int64 overflow is a typed error, and the communicator stays usable.
  std::vector<int64_t> huge(3, std::numeric_limits<int64_t>::max() / 2 + 1);
  auto e = comm.all_reduce(huge.data(), huge.size(), dtype::int64, reduce_op::sum);
  if (n > 1)
    ck.expect(code_of(e) == errc::overflow, "int64 overflow gave " + describe(e));
  ck.expect_ok(comm.barrier(), "barrier after overflow");
  (void)nd;
}

int run_ops(node& nd, uint64_t seed, size_t big) {
  auto comm = nd.make(nd.everyone(1));
  checker ck{nd};
  check_ops(nd, *comm, ck, seed, big);
  nd.report("path", coll::uses_shared_memory_ring(*comm) ? "shm" : "ucx");
  nd.report("ops", ck.failure.empty() ? fmt::format("ok {}", ck.checks) : "FAIL " + ck.failure);
  return ck.failure.empty() ? 0 : 1;
}

int run_kill(node& nd, uint32_t victim) {
  const size_t count = 16 << 20; // 64 MiB of float32
  std::vector<float> buf(count);
  auto comm = nd.make(nd.everyone(1));
  caf::error err;
  for (int iter = 0; iter < 100000 && !err; ++iter) {
    std::fill(buf.begin(), buf.end(), 1.0f);
    err = comm->all_reduce(buf.data(), count, dtype::float32, reduce_op::sum, {30s});
    if (iter == 0)
      nd.report("looping", "");
  }
  auto t_err = mono_ns();
  nd.report("error", fmt::format("{} {} {}", to_string(code_of(err)), t_err, describe(err)));
  // Rebuild for the survivors: nothing is needed from the dead rank.
  membership m{2, {}};
  for (uint32_t r = 0; r < nd.size; ++r)
    if (r != victim)
      m.ranks.push_back(r);
  auto t0 = mono_ns();
  auto next = nd.make(m);
  auto t1 = mono_ns();
  std::vector<float> small(1 << 18);
  std::fill(small.begin(), small.end(), 2.0f);
  auto e2 = next->all_reduce(small.data(), small.size(), dtype::float32, reduce_op::sum);
  bool right = !e2 && std::all_of(small.begin(), small.end(),
                                   [&](float x) { return x == 2.0f * m.size(); });
  nd.report("rebuilt", fmt::format("{} {:.1f}", right ? "ok" : "FAIL " + describe(e2),
                                   (t1 - t0) / 1e6));
  return 0;
}

int run_stop(node& nd) {
  std::vector<float> buf(1 << 20);
  auto comm = nd.make(nd.everyone(1));
  caf::error err;
  for (int iter = 0; iter < 1000000 && !err; ++iter) {
    err = comm->all_reduce(buf.data(), buf.size(), dtype::float32, reduce_op::sum, {400ms});
    if (iter == 0)
      nd.report("looping", "");
  }
  nd.report("error", fmt::format("{} {} {}", to_string(code_of(err)), mono_ns(), describe(err)));
  auto again = comm->barrier();
  nd.report("after", std::string(to_string(code_of(again))));
  return 0;
}

int run_abort(node& nd) {
  auto comm = nd.make(nd.everyone(1));
  if (nd.rank != 0) {
    // Never joins the operation rank 0 starts.
    nd.j.coordinator.wait_shutdown(60s);
    return 0;
  }
  std::vector<float> buf(1 << 16);
  int64_t t_abort = 0;
  std::thread aborter([&] {
    std::this_thread::sleep_for(300ms);
    t_abort = mono_ns();
    comm->abort({});
  });
  auto e = comm->all_reduce(buf.data(), buf.size(), dtype::float32, reduce_op::sum, {60s});
  auto t_ret = mono_ns();
  aborter.join();
  auto after = comm->barrier();
  nd.report("abort", fmt::format("{} {:.1f} {}", to_string(code_of(e)), (t_ret - t_abort) / 1e6,
                                 to_string(code_of(after))));
  return 0;
}

int run_exact(node& nd) {
  // Four micro-batch gradients of very different magnitudes; whoever holds
  // them, the exact sum must come out bit for bit the same.
  const size_t count = 100003;
  std::vector<std::vector<float>> grads(4, std::vector<float>(count));
  for (size_t k = 0; k < 4; ++k)
    for (size_t i = 0; i < count; ++i) {
      double u = static_cast<double>(splitmix64(k * 1000003 + i) % 2000001) / 1e6 - 1.0;
      grads[k][i] = static_cast<float>(u * std::pow(10.0, static_cast<int>(splitmix64(i + 7 * k) % 9) - 4));
    }
  struct layout {
    uint64_t epoch;
    uint32_t ranks;
  };
  for (layout l : {layout{11, 4}, layout{12, 2}, layout{13, 1}}) {
    if (nd.rank >= l.ranks)
      continue;
    membership m{l.epoch, {}};
    for (uint32_t r = 0; r < l.ranks; ++r)
      m.ranks.push_back(r);
    auto comm = nd.make(m);
    std::vector<std::span<const float>> mine;
    for (size_t k = 0; k < 4; ++k)
      if (k % l.ranks == nd.rank)
        mine.emplace_back(grads[k]);
    std::vector<float> out(count);
    auto e = exact_all_reduce(*comm, mine, out, 4);
    nd.report(fmt::format("exact{}x{}", l.ranks, 4 / l.ranks),
              e ? "FAIL " + describe(e) : fmt::format("{:016x}", XXH64(out.data(), count * 4, 0)));
    if (l.ranks == 4) {
      // A non-finite contribution is an overflow for every member.
      std::vector<float> bad(count, 1.0f);
      if (nd.rank == 2)
        bad[5] = std::numeric_limits<float>::infinity();
      std::vector<std::span<const float>> one{bad};
      auto ov = exact_all_reduce(*comm, one, out, 4);
      nd.report("exact_overflow", std::string(to_string(code_of(ov))));
    }
  }
  // HSDP: 2 groups x 2 ranks, each rank keeps one shard of the sum; the
  // group and the shard's holders are subcommunicators of everyone, on
  // host contexts of their own. The gathered shards give the same bits.
  {
    auto world = nd.make({14, {0, 1, 2, 3}});
    std::vector<std::shared_ptr<host_context>> ctxs;
    for (int i = 0; i < 2; ++i) {
      auto c = host_context::create(nd.rank);
      if (!c) {
        nd.report("exact_sharded", "FAIL " + describe(c.error()));
        return 0;
      }
      ctxs.push_back(std::move(*c));
    }
    const uint32_t g = nd.rank / 2, p = nd.rank % 2;
    auto group = make_host_subcommunicator(*world, ctxs[0], {14, {2 * g, 2 * g + 1}}, nd.status());
    auto cross = make_host_subcommunicator(*world, ctxs[1], {14, {p, p + 2}}, nd.status());
    if (!group || !cross) {
      nd.report("exact_sharded", "FAIL " + describe(!group ? group.error() : cross.error()));
      return 0;
    }
    std::vector<std::span<const float>> mine{grads[nd.rank]};
    std::vector<size_t> counts{50000, count - 50000};
    std::vector<float> out(count);
    auto e = exact_reduce_scatter(*world, **group, **cross, mine, count, counts,
                                  std::span<float>(out).subspan(p * 50000, counts[p]), 4);
    if (!e)
      e = (*group)->all_gather(out.data() + p * 50000, out.data(), counts, dtype::float32);
    nd.report("exact_sharded",
              e ? "FAIL " + describe(e) : fmt::format("{:016x}", XXH64(out.data(), count * 4, 0)));
  }
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: cmesh_test_coll ops|kill|stop|abort|exact ARGS\n");
    return 2;
  }
  std::string scenario = argv[1];
  auto j = join_mesh({});
  if (!j) {
    std::fprintf(stderr, "cmesh_test_coll: %s\n", describe(j.error()).c_str());
    return 3;
  }
  node nd{std::move(*j), nullptr, 0, 0};
  nd.rank = static_cast<uint32_t>(nd.j.place.rank);
  nd.size = static_cast<uint32_t>(nd.j.place.world_size);
  auto ctx = host_context::create(nd.rank);
  if (!ctx) {
    std::fprintf(stderr, "cmesh_test_coll: %s\n", describe(ctx.error()).c_str());
    return 3;
  }
  nd.ctx = *ctx;
  if (auto e = nd.j.net->start())
    return 3;
  int rc = 2;
  if (scenario == "ops")
    rc = run_ops(nd, argc > 2 ? std::stoull(argv[2]) : 1, argc > 3 ? std::stoull(argv[3]) : 0);
  else if (scenario == "kill")
    rc = run_kill(nd, static_cast<uint32_t>(std::stoul(argv[2])));
  else if (scenario == "stop")
    rc = run_stop(nd);
  else if (scenario == "abort")
    rc = run_abort(nd);
  else if (scenario == "exact")
    rc = run_exact(nd);
  nd.j.coordinator.wait_shutdown(120s);
  nd.j.net->begin_shutdown();
  nd.j.net->stop();
  return rc;
}
