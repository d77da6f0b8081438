# Finds the C++ Actor Framework 0.17 (headers, libcaf_core, libcaf_io).
# Debian ships no CMake package for it, so this module locates it by hand.
# Defines CAF::core and CAF::io.
find_path(CAF_INCLUDE_DIR NAMES caf/all.hpp)
find_library(CAF_CORE_LIBRARY NAMES caf_core)
find_library(CAF_IO_LIBRARY NAMES caf_io)
if(CAF_INCLUDE_DIR AND EXISTS "${CAF_INCLUDE_DIR}/caf/config.hpp")
  file(STRINGS "${CAF_INCLUDE_DIR}/caf/config.hpp" _caf_ver REGEX "^#define CAF_VERSION [0-9]+")
  string(REGEX MATCH "[0-9]+" _caf_num "${_caf_ver}")
  if(_caf_num)
    math(EXPR _maj "${_caf_num} / 10000")
    math(EXPR _min "(${_caf_num} / 100) % 100")
    math(EXPR _pat "${_caf_num} % 100")
    set(CAF_VERSION "${_maj}.${_min}.${_pat}")
  endif()
endif()
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(CAF
  REQUIRED_VARS CAF_INCLUDE_DIR CAF_CORE_LIBRARY CAF_IO_LIBRARY
  VERSION_VAR CAF_VERSION)
if(CAF_FOUND)
  if(CAF_VERSION VERSION_LESS 0.17 OR NOT CAF_VERSION VERSION_LESS 0.18)
    message(FATAL_ERROR "cmesh needs CAF 0.17.x, found ${CAF_VERSION}")
  endif()
  if(NOT TARGET CAF::core)
    add_library(CAF::core UNKNOWN IMPORTED)
    set_target_properties(CAF::core PROPERTIES
      IMPORTED_LOCATION "${CAF_CORE_LIBRARY}"
      INTERFACE_INCLUDE_DIRECTORIES "${CAF_INCLUDE_DIR}"
      INTERFACE_LINK_LIBRARIES Threads::Threads)
    add_library(CAF::io UNKNOWN IMPORTED)
    set_target_properties(CAF::io PROPERTIES
      IMPORTED_LOCATION "${CAF_IO_LIBRARY}"
      INTERFACE_LINK_LIBRARIES CAF::core)
  endif()
endif()
mark_as_advanced(CAF_INCLUDE_DIR CAF_CORE_LIBRARY CAF_IO_LIBRARY)
