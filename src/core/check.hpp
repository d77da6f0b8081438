// Programmer errors crash loudly, printing both sides, file and line.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <sstream>

namespace cmesh::detail {

[[noreturn]] inline void check_failed(const char* file, int line, const char* expr,
                                      const std::string& values) {
  std::fprintf(stderr, "%s:%d: CHECK failed: %s %s\n", file, line, expr, values.c_str());
  std::fflush(stderr);
  std::abort();
}

template <class A, class B>
std::string both(const A& a, const B& b) {
  std::ostringstream os;
  os << "(" << a << " vs " << b << ")";
  return os.str();
}

} // namespace cmesh::detail

#define CMESH_CHECK(cond)                                                      \
  do {                                                                         \
    if (!(cond))                                                               \
      ::cmesh::detail::check_failed(__FILE__, __LINE__, #cond, "");            \
  } while (false)

#define CMESH_CHECK_OP(a, op, b)                                               \
  do {                                                                         \
    const auto& cmesh_a_ = (a);                                                \
    const auto& cmesh_b_ = (b);                                                \
    if (!(cmesh_a_ op cmesh_b_))                                               \
      ::cmesh::detail::check_failed(__FILE__, __LINE__, #a " " #op " " #b,     \
                                    ::cmesh::detail::both(cmesh_a_, cmesh_b_)); \
  } while (false)

#define CMESH_CHECK_EQ(a, b) CMESH_CHECK_OP(a, ==, b)
#define CMESH_CHECK_NE(a, b) CMESH_CHECK_OP(a, !=, b)
#define CMESH_CHECK_LT(a, b) CMESH_CHECK_OP(a, <, b)
#define CMESH_CHECK_LE(a, b) CMESH_CHECK_OP(a, <=, b)
#define CMESH_CHECK_GE(a, b) CMESH_CHECK_OP(a, >=, b)

#ifdef NDEBUG
#define CMESH_DCHECK(cond) ((void)0)
#else
#define CMESH_DCHECK(cond) CMESH_CHECK(cond)
#endif
