#include "model/config.hpp"
#include "model/data.hpp"

#include <doctest/doctest.h>

#include <set>

using namespace cmesh;
using namespace cmesh::model;

TEST_CASE("the default config is valid and an empty file gives it") {
  auto c = parse_config("");
  REQUIRE(c);
  CHECK(c->model.experts == 4);
  CHECK_FALSE(validate(*c, 2, 1));
  CHECK_FALSE(validate(*c, 2, 2));
}

TEST_CASE("keys are read") {
  auto c = parse_config(R"(
[model]
d_model = 32
experts = 8
capacity_factor = 2.0
[train]
steps = 10
exact = true
sharding = "optimizer"
[data]
file = "x.txt"
)");
  REQUIRE(c);
  CHECK(c->model.d_model == 32);
  CHECK(c->model.experts == 8);
  CHECK(c->model.capacity_factor == 2.0);
  CHECK(c->train.steps == 10);
  CHECK(c->train.exact);
  CHECK(c->data.file == "x.txt");
  auto full = parse_config("[train]\nsharding = \"full\"\nprecision = \"bf16\"\n");
  REQUIRE(full);
  CHECK(full->train.sharding == "full");
  CHECK(full->train.precision == "bf16");
  CHECK(full->model.activations == "bf16"); // follows the precision
  CHECK(parse_config("")->model.activations == "fp32");
  auto wide = parse_config("[model]\nactivations = \"fp32\"\n[train]\nprecision = \"bf16\"\n");
  REQUIRE(wide);
  CHECK(wide->model.activations == "fp32");
  auto narrow = parse_config("[model]\nactivations = \"bf16\"\n");
  REQUIRE(narrow);
  CHECK(narrow->model.activations == "bf16");
  CHECK(narrow->train.precision == "fp32");
  // Products: bf16 on a device with bf16 activations, unless given.
  CHECK(full->model.products == "auto");
  CHECK(bf16_products(full->model, true));
  CHECK_FALSE(bf16_products(full->model, false)); // the CPU multiplies in fp32
  CHECK_FALSE(bf16_products(wide->model, true));  // fp32 activations
  auto fp32_products =
    parse_config("[model]\nactivations = \"bf16\"\nproducts = \"fp32\"\n");
  REQUIRE(fp32_products);
  CHECK_FALSE(bf16_products(fp32_products->model, true));
  auto bf16_everywhere = parse_config("[model]\nproducts = \"bf16\"\n");
  REQUIRE(bf16_everywhere);
  CHECK(bf16_products(bf16_everywhere->model, false));
  CHECK(full->train.expert_placement == "balanced"); // the default
  CHECK(full->train.overlap);                        // the default
  auto plain = parse_config("[train]\nsharding = \"full\"\noverlap = false\n");
  REQUIRE(plain);
  CHECK_FALSE(plain->train.overlap);
  auto placed = parse_config("[train]\nexpert_placement = \"static\"\nexpert_replicas = 3\n");
  REQUIRE(placed);
  CHECK(placed->train.expert_placement == "static");
  CHECK(placed->train.expert_replicas == 3);
  CHECK(placed->train.gradient_collectives == "device"); // the default
  auto emulated = parse_config("[train]\ndevice = \"emulated\"\ngradient_collectives = \"host\"\n");
  REQUIRE(emulated);
  CHECK(emulated->train.device == "emulated");
  CHECK(emulated->train.gradient_collectives == "host");
}

TEST_CASE("bad configs give clear errors") {
  auto err = [](const std::string& text) {
    auto c = parse_config(text);
    REQUIRE_FALSE(c);
    CHECK(code_of(c.error()) == errc::invalid_argument);
    return describe(c.error());
  };
  CHECK(err("[model]\nd_modle = 3\n").find("unknown key 'd_modle' in [model]") != std::string::npos);
  CHECK(err("[modle]\n").find("unknown section [modle]") != std::string::npos);
  CHECK(err("[model]\nd_model = \"big\"\n").find("model.d_model must be an integer")
        != std::string::npos);
  CHECK(err("[model]\nd_model = 0\n").find("at least 1") != std::string::npos);
  CHECK(err("[model]\ntop_k = 5\n").find("exceeds model.experts") != std::string::npos);
  CHECK(err("[train]\nglobal_batch = 30\nmicro_batch = 4\n").find("not a multiple")
        != std::string::npos);
  CHECK(err("[train]\nprecision = \"fp8\"\n").find("precision") != std::string::npos);
  CHECK(err("[train]\nexact = true\nprecision = \"bf16\"\n").find("exact mode") != std::string::npos);
  CHECK(err("[model]\nactivations = \"bf16\"\n[train]\nexact = true\n")
          .find("exact mode needs model.activations") != std::string::npos);
  CHECK(err("[model]\nproducts = \"bf16\"\n[train]\nexact = true\n")
          .find("exact mode needs model.products") != std::string::npos);
  CHECK(err("[model]\nproducts = \"tf32\"\n").find("model.products must be")
        != std::string::npos);
  CHECK(err("[model]\nactivations = \"fp16\"\n").find("model.activations must be")
        != std::string::npos);
  CHECK(err("[train]\nexpert_placement = \"random\"\n").find("train.expert_placement must be")
        != std::string::npos);
  CHECK(err("[train]\nexpert_replicas = -1\n").find("train.expert_replicas") != std::string::npos);
  CHECK(err("[train]\ndevice = \"tpu\"\n").find(
          "train.device must be \"cpu\", \"cuda\" or \"emulated\"")
        != std::string::npos);
  CHECK(err("[train]\ngradient_collectives = \"nccl\"\n")
          .find("train.gradient_collectives must be \"device\" or \"host\"")
        != std::string::npos);
  CHECK(err("[train]\ndevice = \"emulated\"\nsharding = \"full\"\n")
          .find("not supported with device \"emulated\"")
        != std::string::npos);
  CHECK(err("[train]\ndevice = \"cuda\"\nsharding = \"full\"\n").find("not supported")
        != std::string::npos);
  CHECK(err("[train]\nsharding = \"zero3\"\n").find("train.sharding must be") != std::string::npos);
  CHECK(err("[train]\nexact = true\nsharding = \"full\"\n").find("train.sharding = \"optimizer\"")
        != std::string::npos);
  CHECK(err("[train]\noverlap = 1\n").find("train.overlap must be true or false")
        != std::string::npos);
  CHECK(err("[train]\nexact = \"yes\"\n").find("train.exact must be true or false")
        != std::string::npos);
  CHECK(err("[model\n").find("config:") != std::string::npos);
}

TEST_CASE("impossible layouts are refused") {
  auto c = parse_config("[model]\nexperts = 6\n[train]\nglobal_batch = 8\nmicro_batch = 4\n");
  REQUIRE(c);
  auto e = validate(*c, 1, 4);
  CHECK(describe(e).find("does not divide over 4 ranks") != std::string::npos);
  CHECK(describe(validate(*c, 3, 1)).find("cannot feed 3 replica groups") != std::string::npos);
  CHECK_FALSE(validate(*c, 2, 3));
}

TEST_CASE("the loader is a pure function of (seed, step, micro-batch)") {
  auto corpus = corpus::synthetic(1 << 16);
  train_config t;
  t.micro_batch = 3;
  t.seq_len = 16;
  // Steps a..b give the same samples whether the run is continuous or
  // restarted at any step in between: nothing depends on earlier steps.
  std::vector<batch> continuous;
  for (uint64_t s = 5; s < 12; ++s)
    continuous.push_back(make_micro_batch(*corpus, t, s, 1));
  for (uint64_t restart = 5; restart < 12; ++restart)
    for (uint64_t s = restart; s < 12; ++s)
      CHECK(make_micro_batch(*corpus, t, s, 1).tokens == continuous[s - 5].tokens);
  CHECK(make_micro_batch(*corpus, t, 5, 1).tokens != make_micro_batch(*corpus, t, 6, 1).tokens);
  t.seed = 2;
  CHECK(make_micro_batch(*corpus, t, 5, 1).tokens != continuous[0].tokens);
}

TEST_CASE("micro-batches are dealt exactly once over any membership") {
  for (size_t micro : {1u, 7u, 8u, 16u})
    for (size_t groups = 1; groups <= micro && groups <= 5; ++groups)
      for (size_t ranks = 1; ranks <= 3; ++ranks) {
        std::multiset<size_t> seen;
        for (size_t g = 0; g < groups; ++g)
          for (size_t r = 0; r < ranks; ++r)
            for (auto m : micro_batches_of(micro, groups, g, ranks, r))
              seen.insert(m);
        CHECK(seen.size() == micro);
        for (size_t m = 0; m < micro; ++m)
          CHECK(seen.count(m) == 1);
      }
}

TEST_CASE("a data file shorter than a sample is refused") {
  auto c = corpus::load({"/nonexistent/file.txt"}, 16);
  REQUIRE_FALSE(c);
  CHECK(describe(c.error()).find("cannot read") != std::string::npos);
}
