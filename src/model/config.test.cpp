#include "model/config.hpp"
#include "model/data.hpp"

#include <doctest/doctest.h>

#include <cstdio>
#include <fstream>
#include <set>

#include <unistd.h>

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
  CHECK(err("[train]\nexperts = \"sharded\"\n").find("train.experts must be") != std::string::npos);
  for (auto [keys, what] : {std::pair{"sharding = \"full\"", "train.sharding = \"full\""},
                            {"device = \"emulated\"", "train.device = \"emulated\""},
                            {"precision = \"bf16\"", "train.precision = \"bf16\""},
                            {"expert_replicas = 2", "train.expert_replicas"}}) {
    const auto e = err(std::string("[train]\nexperts = \"resident\"\n") + keys + "\n");
    CHECK_MESSAGE(e.find(std::string("train.experts = \"resident\" does not support ") + what)
                    != std::string::npos,
                  e);
  }
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

namespace {

/// The value of `key` in a canonical configuration ("" when absent).
std::string value_of(const config_list& c, const std::string& key) {
  for (auto& [k, v] : c)
    if (k == key)
      return v;
  return {};
}

} // namespace

TEST_CASE("the canonical configuration holds every key that defines a run, in a fixed order") {
  auto c = parse_config("");
  REQUIRE(c);
  auto list = canonical_config(*c, 2, 1);
  REQUIRE(list);
  std::set<std::string> keys;
  for (auto& [k, v] : *list)
    CHECK_MESSAGE(keys.insert(k).second, k << " twice");
  // Every key of a config file but the cosmetic log_every and the path of
  // the data, which may differ between nodes (its identity is there).
  for (auto& k : config_keys())
    if (k != "train.log_every" && k != "data.file")
      CHECK_MESSAGE(keys.count(k) == 1, k << " is not in the canonical configuration");
  CHECK(keys.count("train.log_every") == 0);
  CHECK(keys.count("data.file") == 0);
  for (auto k : {"cmesh.version", "layout.replicas", "layout.ranks_per_group", "data.identity"})
    CHECK_MESSAGE(keys.count(k) == 1, k);
  CHECK(keys.size() == config_keys().size() - 2 + 4);
  CHECK(value_of(*list, "layout.replicas") == "2");
  CHECK(value_of(*list, "layout.ranks_per_group") == "1");
  CHECK(value_of(*list, "data.identity") == "synthetic");
  CHECK(value_of(*list, "model.experts") == "4");
  CHECK(value_of(*list, "train.exact") == "false");
  CHECK(value_of(*list, "model.activations") == "fp32");
  CHECK_FALSE(value_of(*list, "cmesh.version").empty());
  // The same config gives the same text; log_every changes nothing.
  auto again = *c;
  again.train.log_every = 1;
  auto list2 = canonical_config(again, 2, 1);
  REQUIRE(list2);
  CHECK(*list2 == *list);
  CHECK(config_digest(*list2) == config_digest(*list));
  CHECK(config_text(*list).find("train.lr = 0.003\n") != std::string::npos);
}

TEST_CASE("doubles in the canonical configuration read back exactly") {
  run_config c;
  for (double v : {0.003, 0.1 + 0.2, 1e-8, 3e-3 * (1 + 1e-15), 65536.0, 1.0 / 3.0}) {
    CAPTURE(v);
    c.train.lr = v;
    auto list = canonical_config(c, 1, 1);
    REQUIRE(list);
    CHECK(std::stod(value_of(*list, "train.lr")) == v);
  }
  c.train.lr = 0.003;
  CHECK(value_of(*canonical_config(c, 1, 1), "train.lr") == "0.003");
  c.train.lr = 0.1 + 0.2; // not 0.3: the text tells them apart
  CHECK(value_of(*canonical_config(c, 1, 1), "train.lr") == "0.30000000000000004");
}

TEST_CASE("the data's identity is its bytes, not its path") {
  auto a = "/tmp/cmesh_config_data_a_" + std::to_string(::getpid());
  auto b = "/tmp/cmesh_config_data_b_" + std::to_string(::getpid());
  std::ofstream(a) << "the same bytes";
  std::ofstream(b) << "the same bytes";
  run_config c;
  c.data.file = a;
  auto la = canonical_config(c, 1, 1);
  c.data.file = b;
  auto lb = canonical_config(c, 1, 1);
  REQUIRE(la);
  REQUIRE(lb);
  CHECK(*la == *lb);
  CHECK(value_of(*la, "data.identity").find("14 bytes") != std::string::npos);
  std::ofstream(b) << "other bytes!!!"; // same size, other content
  auto lc = canonical_config(c, 1, 1);
  REQUIRE(lc);
  CHECK(value_of(*lc, "data.identity") != value_of(*la, "data.identity"));
  CHECK(value_of(*lc, "data.identity").find("14 bytes") != std::string::npos);
  std::remove(a.c_str());
  std::remove(b.c_str());
  c.data.file = "/nonexistent/data.txt";
  auto missing = canonical_config(c, 1, 1);
  REQUIRE_FALSE(missing);
  CHECK(code_of(missing.error()) == errc::invalid_argument);
  CHECK(describe(missing.error()).find("/nonexistent/data.txt") != std::string::npos);
}

TEST_CASE("differences name each key with the worker's value and the job's") {
  auto job = canonical_config(*parse_config(""), 2, 1);
  REQUIRE(job);
  CHECK(config_differences(*job, *job).empty());

  auto lr = canonical_config(*parse_config("[train]\nlr = 0.01\n"), 2, 1);
  REQUIRE(lr);
  CHECK(config_digest(*lr) != config_digest(*job));
  CHECK(config_differences(*job, *lr) == std::vector<std::string>{"train.lr = 0.01 (the job's: 0.003)"});

  auto two = canonical_config(*parse_config("[model]\nexperts = 8\n[train]\nexact = true\n"), 1, 2);
  REQUIRE(two);
  CHECK(config_differences(*job, *two)
        == std::vector<std::string>{"layout.replicas = 1 (the job's: 2)",
                                    "layout.ranks_per_group = 2 (the job's: 1)",
                                    "model.experts = 8 (the job's: 4)",
                                    "train.exact = true (the job's: false)"});

  // Keys missing on either side (another version's list).
  config_list a{{"x", "1"}, {"y", "2"}};
  config_list b{{"y", "2"}, {"z", "3"}};
  CHECK(config_differences(a, b)
        == std::vector<std::string>{"x missing (the job's: 1)", "z = 3 (the job has no such key)"});
  CHECK(config_differences({}, {}).empty());
  // The order is part of the text the digest covers.
  CHECK(config_digest({{"x", "1"}, {"y", "2"}}) != config_digest({{"y", "2"}, {"x", "1"}}));
}
