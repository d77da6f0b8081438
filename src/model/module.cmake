# The built-in model (included from src/CMakeLists.txt; paths relative to src/).
find_package(tomlplusplus REQUIRED)
cmesh_module(model
  SOURCES model/moe_lm.cpp model/config.cpp model/data.cpp
  DEPS cmesh::kernels tomlplusplus::tomlplusplus
  TESTS model/moe_lm.test.cpp model/config.test.cpp
  TEST_TIMEOUT 300)
