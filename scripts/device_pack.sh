#!/usr/bin/env bash
# Packs what scripts/device_check.sh runs into one archive, for a GPU machine
# that has the CUDA driver, runtime and NCCL but none of the build's other
# packages (CAF, UCX, OpenBLAS, spdlog, ...): the GPU binaries, stripped of
# debug information, and every shared library they load that is neither the C
# library nor part of CUDA or NCCL, with UCX's transport modules.
#
#   scripts/device_pack.sh [ARCHIVE] [BUILD_DIR]
#       (defaults .devpack/cmesh-gpu.tar.xz and build/)
#
# On the GPU machine: CMESH_DEVICE_PREBUILT=ARCHIVE scripts/device_check.sh
# unpacks it and runs the same checks without configuring or building. The
# binaries need a C library at least as new as this machine's.
set -euo pipefail
cd "$(dirname "$0")/.."

ARCHIVE=${1:-.devpack/cmesh-gpu.tar.xz}
BUILD=${2:-build}
JOBS=${JOBS:-$(nproc)}

if ! grep -q '^CMESH_WITH_CUDA:BOOL=ON' "$BUILD/CMakeCache.txt" 2>/dev/null \
   || ! grep -q '^NCCL_LIBRARY:FILEPATH=/' "$BUILD/CMakeCache.txt"; then
  echo "device_pack: $BUILD is not configured with CUDA and NCCL (nvcc and nccl.h needed)" >&2
  exit 1
fi
cmake --build "$BUILD" -j"$JOBS" --target \
  test_kernels test_collectives_nccl cmesh_test_nccl test_mp_nccl test_model cmesh \
  cmesh_bench_recovery

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
root=$stage/cmesh-gpu
mkdir -p "$root/bin" "$root/lib" "$root/ucx" "$root/cxx"

bins=("$BUILD/src/kernels/test_kernels" "$BUILD/src/test_collectives_nccl"
      "$BUILD/src/test_mp_nccl" "$BUILD/src/test_model"
      "$BUILD/bin/cmesh" "$BUILD/bin/cmesh_test_nccl" "$BUILD/bin/cmesh_bench_recovery")
for b in "${bins[@]}"; do
  objcopy --strip-debug "$b" "$root/bin/$(basename "$b")"
done

# The C library, the loader, the C++ runtime and CUDA's own libraries come
# from the GPU machine; everything else travels.
keep_out='^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|libpthread\.|librt\.|libutil\.|libresolv\.|libstdc\+\+|libgcc_s|libcuda|libcudart|libnccl|libcublas|libnvidia)'
copy_deps() {
  ldd "$1" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | while read -r name path; do
    if ! [[ $name =~ $keep_out ]] && [ ! -e "$root/lib/$name" ]; then
      cp -L "$path" "$root/lib/$name"
    fi
  done
}
for b in "$root"/bin/*; do copy_deps "$b"; done

# UCX loads its transports from a directory fixed at its build; the checks
# point UCX_MODULE_DIR at this copy. A module whose libraries are missing
# (InfiniBand on a machine without it) is skipped by UCX itself.
ucx_dir=$(dirname "$(ldd "$root/bin/cmesh" | awk '$1 ~ /^libuct\.so/ {print $3}')")/ucx
for m in "$ucx_dir"/libuct_*.so.0; do
  [ -e "$m" ] || continue
  cp -L "$m" "$root/ucx/"
  copy_deps "$m"
done
for l in "$root"/lib/*; do copy_deps "$l"; done
# The C++ runtime, for a machine whose own is older than this one's.
for l in libstdc++.so.6 libgcc_s.so.1; do
  cp -L "$(ldd "$root/bin/cmesh" | awk -v n="$l" '$1 == n {print $3}')" "$root/cxx/$l"
done

git rev-parse HEAD >"$root/COMMIT" 2>/dev/null || echo unknown >"$root/COMMIT"
mkdir -p "$(dirname "$ARCHIVE")"
tar -C "$stage" -cf - cmesh-gpu | xz -T"$JOBS" -6 >"$ARCHIVE"
echo "device_pack: $ARCHIVE ($(du -h "$ARCHIVE" | cut -f1)), commit $(cat "$root/COMMIT")"
ls -l "$root/bin" "$root/lib" "$root/ucx"
