# The built-in model (included from src/CMakeLists.txt; paths relative to src/).
find_package(tomlplusplus REQUIRED)
cmesh_module(model
  SOURCES model/moe_lm.cpp model/config.cpp model/data.cpp
  DEPS cmesh::kernels tomlplusplus::tomlplusplus PkgConfig::XXHASH
  TESTS model/moe_lm.test.cpp model/config.test.cpp
  TEST_TIMEOUT 300)
# The version is part of a job's canonical configuration (canonical_layout).
target_compile_definitions(cmesh_model PRIVATE CMESH_VERSION="${PROJECT_VERSION}")
