// gemm through cuBLAS, and the bias helpers around it (see kernels/cuda/ops.hpp).
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/ops.hpp"

#include <climits>
#include <dlfcn.h>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

namespace cmesh::kernels::cuda {

namespace {

// cuBLAS is loaded on first use (dlopen), not linked: its libraries cost a
// process some 150 MiB of resident memory as soon as they are mapped, and
// a CPU run never calls them.
struct cublas_api {
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  decltype(&cublasSgemm_v2) sgemm = nullptr;
  // cublasGemmEx is overloaded in C++ (an inline one takes the old compute
  // type): name the exported one's type.
  cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                            const void*, const void*, cudaDataType, int, const void*,
                            cudaDataType, int, const void*, void*, cudaDataType, int,
                            cublasComputeType_t, cublasGemmAlgo_t) = nullptr;
  decltype(&cublasSetMathMode) set_math_mode = nullptr;
  decltype(&cublasSetAtomicsMode) set_atomics_mode = nullptr;
  decltype(&cublasGetStatusName) status_name = nullptr;
  decltype(&cublasGetStatusString) status_string = nullptr;
  std::string error; // why it could not be loaded
};

const cublas_api& cublas() {
  static const cublas_api api = [] {
    cublas_api a;
    const std::string soname = "libcublas.so." + std::to_string(CUBLAS_VER_MAJOR);
    void* lib = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
#ifdef CMESH_CUDA_LIBRARY_DIR
    if (!lib)
      lib = dlopen((std::string(CMESH_CUDA_LIBRARY_DIR) + "/" + soname).c_str(),
                   RTLD_NOW | RTLD_LOCAL);
#endif
    if (!lib) {
      a.error = "cannot load " + soname + ": " + dlerror();
      return a;
    }
    auto load = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
      if (!fn && a.error.empty())
        a.error = soname + " has no " + name;
    };
    load(a.create, "cublasCreate_v2");
    load(a.destroy, "cublasDestroy_v2");
    load(a.set_stream, "cublasSetStream_v2");
    load(a.sgemm, "cublasSgemm_v2");
    load(a.gemm_ex, "cublasGemmEx");
    load(a.set_math_mode, "cublasSetMathMode");
    load(a.set_atomics_mode, "cublasSetAtomicsMode");
    load(a.status_name, "cublasGetStatusName");
    load(a.status_string, "cublasGetStatusString");
    return a;
  }();
  if (!api.error.empty())
    throw std::runtime_error("cuBLAS: " + api.error);
  return api;
}

void check_cublas(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string(what) + " failed: " + cublas().status_name(status) +
                             ": " + cublas().status_string(status));
}

int as_int(std::size_t v, const char* name) {
  if (v > static_cast<std::size_t>(INT_MAX))
    throw std::invalid_argument(std::string("cuda::gemm: ") + name + " exceeds INT_MAX");
  return static_cast<int>(v);
}

// C = beta * C over [m, n] with leading dimension ldc; beta == 0 writes zeros.
__global__ void scale_matrix_kernel(float* c, std::size_t m, std::size_t n, std::size_t ldc,
                                    float beta) {
  const std::size_t total = m * n;
  for (std::size_t e = detail::thread_index(); e < total; e += detail::thread_stride()) {
    float& v = c[(e / n) * ldc + e % n];
    v = beta == 0.0f ? 0.0f : beta * v;
  }
}

__global__ void add_row_bias_kernel(float* y, const float* __restrict__ bias, std::size_t rows,
                                    std::size_t cols) {
  const std::size_t total = rows * cols;
  for (std::size_t e = detail::thread_index(); e < total; e += detail::thread_stride())
    y[e] += bias[e % cols];
}

// One thread per column, rows in order: the CPU's order of additions.
__global__ void add_column_sums_kernel(float* sums, const float* __restrict__ x,
                                       std::size_t rows, std::size_t cols) {
  for (std::size_t j = detail::thread_index(); j < cols; j += detail::thread_stride()) {
    float s = sums[j];
    for (std::size_t r = 0; r < rows; ++r)
      s += x[r * cols + j];
    sums[j] = s;
  }
}

} // namespace

void load_cublas() { (void)cublas(); }

cublas_handle::cublas_handle() {
  const auto& api = cublas();
  check_cublas(api.create(&handle_), "cublasCreate");
  // Full fp32 (no TF32 tensor-op shortcut) and no atomics: reproducible.
  const cublasStatus_t math = api.set_math_mode(handle_, CUBLAS_DEFAULT_MATH);
  const cublasStatus_t atomics = api.set_atomics_mode(handle_, CUBLAS_ATOMICS_NOT_ALLOWED);
  if (math != CUBLAS_STATUS_SUCCESS || atomics != CUBLAS_STATUS_SUCCESS) {
    (void)api.destroy(handle_);
    handle_ = nullptr;
    check_cublas(math != CUBLAS_STATUS_SUCCESS ? math : atomics, "cublasSet*Mode");
  }
}

cublas_handle::~cublas_handle() {
  if (handle_)
    (void)cublas().destroy(handle_);
}

cublas_handle::cublas_handle(cublas_handle&& other) noexcept
    : handle_(std::exchange(other.handle_, nullptr)) {}

cublas_handle& cublas_handle::operator=(cublas_handle&& other) noexcept {
  if (this != &other) {
    if (handle_)
      (void)cublas().destroy(handle_);
    handle_ = std::exchange(other.handle_, nullptr);
  }
  return *this;
}

void gemm(cublas_handle& handle, bool trans_a, bool trans_b, std::size_t m, std::size_t n,
          std::size_t k, float alpha, const float* a, std::size_t lda, const float* b,
          std::size_t ldb, float beta, float* c, std::size_t ldc, cudaStream_t stream,
          gemm_math math) {
  if (m == 0 || n == 0)
    return;
  if (k == 0) {
    // An empty inner dimension leaves beta * C; cuBLAS would reject lda = 0.
    scale_matrix_kernel<<<detail::grid_for(m * n), detail::block_threads, 0, stream>>>(c, m, n,
                                                                                      ldc, beta);
    detail::check_launch();
    return;
  }
  const int im = as_int(m, "m"), in = as_int(n, "n"), ik = as_int(k, "k");
  const int ilda = as_int(lda, "lda"), ildb = as_int(ldb, "ldb"), ildc = as_int(ldc, "ldc");
  const auto& api = cublas();
  check_cublas(api.set_stream(handle.get(), stream), "cublasSetStream");
  // Column-major view: C^T[n,m] = op(B)^T[n,k] * op(A)^T[k,m]. A row-major
  // matrix is its transpose in column-major, so each operand keeps its flag.
  const cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (math == gemm_math::bf16_inputs) {
    // fp32 in and out; the library rounds the operands to bf16 and runs the
    // products on tensor cores with fp32 accumulation.
    check_cublas(api.gemm_ex(handle.get(), op_b, op_a, in, im, ik, &alpha, b, CUDA_R_32F, ildb, a,
                             CUDA_R_32F, ilda, &beta, c, CUDA_R_32F, ildc,
                             CUBLAS_COMPUTE_32F_FAST_16BF, CUBLAS_GEMM_DEFAULT),
                 "cublasGemmEx (bf16 inputs)");
    return;
  }
  check_cublas(api.sgemm(handle.get(), op_b, op_a, in, im, ik, &alpha, b, ildb, a, ilda, &beta, c,
                         ildc),
               "cublasSgemm");
}

void add_row_bias(float* y, const float* bias, std::size_t rows, std::size_t cols,
                  cudaStream_t stream) {
  if (rows == 0 || cols == 0)
    return;
  add_row_bias_kernel<<<detail::grid_for(rows * cols), detail::block_threads, 0, stream>>>(
    y, bias, rows, cols);
  detail::check_launch();
}

void add_column_sums(float* sums, const float* x, std::size_t rows, std::size_t cols,
                     cudaStream_t stream) {
  if (rows == 0 || cols == 0)
    return;
  // Small blocks: the parallelism is the column count, spread it over SMs.
  constexpr unsigned threads = 64;
  add_column_sums_kernel<<<detail::grid_for(cols, threads), threads, 0, stream>>>(sums, x, rows,
                                                                                 cols);
  detail::check_launch();
}

} // namespace cmesh::kernels::cuda
