// Unit tests of the trainer's shard split (the step loop itself is tested
// end to end in tests/train.test.cpp and tests/supervision.test.cpp).
#include "actors/trainer.hpp"

#include <doctest/doctest.h>

using namespace cmesh::actors;

TEST_CASE("shards: whole blocks, every element once, in order") {
  for (size_t n : {size_t{1}, size_t{4095}, size_t{4096}, size_t{10000}, size_t{166080},
                   size_t{1} << 20}) {
    for (size_t s : {1, 2, 3, 4, 7}) {
      CAPTURE(n);
      CAPTURE(s);
      auto sh = split_shards(n, s, norm_block);
      REQUIRE(sh.offsets.size() == s);
      REQUIRE(sh.counts.size() == s);
      size_t at = 0;
      for (size_t i = 0; i < s; ++i) {
        CHECK(sh.offsets[i] == at);
        CHECK(sh.offsets[i] % norm_block == 0); // block-aligned: the norm adds the same blocks
        at += sh.counts[i];
      }
      CHECK(at == n);
      // As even as whole blocks allow: no shard but the last exceeds
      // another by more than one block.
      for (size_t i = 0; i + 1 < s; ++i)
        for (size_t j = 0; j + 1 < s; ++j)
          CHECK(sh.counts[i] <= sh.counts[j] + norm_block);
    }
  }
}

TEST_CASE("shards: one rank holds everything") {
  auto sh = split_shards(12345, 1, norm_block);
  CHECK(sh.offsets == std::vector<size_t>{0});
  CHECK(sh.counts == std::vector<size_t>{12345});
}
