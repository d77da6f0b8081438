# One helper builds every module of src/ as a library and registers its tests.
#
#   cmesh_module(<name> SOURCES ... [DEPS ...] [TESTS ...] [TEST_DEPS ...]
#                [TEST_TIMEOUT seconds] [TEST_LABELS ...])
#
# builds the library cmesh_<name> (alias cmesh::<name>) with src/ on its
# include path, and, when TESTS are given, one doctest executable
# test_<name> registered with CTest under a timeout.
function(cmesh_module name)
  cmake_parse_arguments(M "" "TEST_TIMEOUT" "SOURCES;DEPS;TESTS;TEST_DEPS;TEST_LABELS" ${ARGN})
  add_library(cmesh_${name} ${M_SOURCES})
  add_library(cmesh::${name} ALIAS cmesh_${name})
  target_include_directories(cmesh_${name} PUBLIC ${PROJECT_SOURCE_DIR}/src)
  target_link_libraries(cmesh_${name} PUBLIC ${M_DEPS})
  set_target_properties(cmesh_${name} PROPERTIES POSITION_INDEPENDENT_CODE ON)
  if(M_TESTS)
    cmesh_test(${name} SOURCES ${M_TESTS} DEPS cmesh_${name} ${M_TEST_DEPS}
               TIMEOUT ${M_TEST_TIMEOUT} LABELS unit ${M_TEST_LABELS})
  endif()
endfunction()

#   cmesh_test(<name> SOURCES ... DEPS ... [TIMEOUT seconds] [LABELS ...] [SERIAL])
function(cmesh_test name)
  cmake_parse_arguments(T "SERIAL" "TIMEOUT" "SOURCES;DEPS;LABELS" ${ARGN})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 120)
  endif()
  add_executable(test_${name} ${T_SOURCES})
  target_link_libraries(test_${name} PRIVATE cmesh_doctest_main ${T_DEPS})
  add_test(NAME ${name} COMMAND test_${name})
  set_tests_properties(${name} PROPERTIES TIMEOUT ${T_TIMEOUT} LABELS "${T_LABELS}"
    ENVIRONMENT "CMESH_BIN_DIR=${PROJECT_BINARY_DIR}/bin;UCX_WARN_UNUSED_ENV_VARS=n")
  if(T_SERIAL)
    set_tests_properties(${name} PROPERTIES RUN_SERIAL TRUE)
  endif()
endfunction()
