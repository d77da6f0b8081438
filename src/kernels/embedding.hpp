// Row gathers and scatter-adds by index: embedding lookups (and their
// gradient), the context window of the built-in model, and the token
// permutation of MoE layers are all this.
// Also compiled by nvcc (C++17): keep this header free of C++20.
#pragma once

#include <cstddef>
#include <cstdint>

namespace cmesh::kernels::cpu {

/// out[i] = table[index[i]] for i < count, rows of `width`; a negative index
/// gives a row of zeros (a position before the start of a sequence).
void gather_rows(const float* table, const std::int32_t* index, std::size_t count,
                 std::size_t width, float* out);
void gather_rows(const double* table, const std::int32_t* index, std::size_t count,
                 std::size_t width, double* out);

/// table[index[i]] += rows[i] for i < count, in order of i (so repeated
/// indices sum deterministically); negative indices are skipped.
void scatter_add_rows(const float* rows, const std::int32_t* index, std::size_t count,
                      std::size_t width, float* table);
void scatter_add_rows(const double* rows, const std::int32_t* index, std::size_t count,
                      std::size_t width, double* table);

} // namespace cmesh::kernels::cpu
