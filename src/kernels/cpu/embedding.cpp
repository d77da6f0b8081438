#include "kernels/embedding.hpp"

namespace cmesh::kernels::cpu {

namespace {

template <class T>
void gather_t(const T* table, const std::int32_t* index, std::size_t count, std::size_t width,
              T* out) {
  for (std::size_t i = 0; i < count; ++i) {
    T* dst = out + i * width;
    if (index[i] < 0) {
      for (std::size_t j = 0; j < width; ++j)
        dst[j] = T(0);
      continue;
    }
    const T* src = table + static_cast<std::size_t>(index[i]) * width;
    for (std::size_t j = 0; j < width; ++j)
      dst[j] = src[j];
  }
}

template <class T>
void scatter_add_t(const T* rows, const std::int32_t* index, std::size_t count, std::size_t width,
                   T* table) {
  for (std::size_t i = 0; i < count; ++i) {
    if (index[i] < 0)
      continue;
    T* dst = table + static_cast<std::size_t>(index[i]) * width;
    const T* src = rows + i * width;
    for (std::size_t j = 0; j < width; ++j)
      dst[j] += src[j];
  }
}

} // namespace

void gather_rows(const float* table, const std::int32_t* index, std::size_t count,
                 std::size_t width, float* out) {
  gather_t(table, index, count, width, out);
}
void gather_rows(const double* table, const std::int32_t* index, std::size_t count,
                 std::size_t width, double* out) {
  gather_t(table, index, count, width, out);
}
void scatter_add_rows(const float* rows, const std::int32_t* index, std::size_t count,
                      std::size_t width, float* table) {
  scatter_add_t(rows, index, count, width, table);
}
void scatter_add_rows(const double* rows, const std::int32_t* index, std::size_t count,
                      std::size_t width, double* table) {
  scatter_add_t(rows, index, count, width, table);
}

} // namespace cmesh::kernels::cpu
