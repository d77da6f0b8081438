#!/usr/bin/env bash
# Installs what cmesh needs from Debian's archive and builds it into build/.
# Usage: scripts/setup.sh [extra cmake args...]
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO=sudo; fi
export DEBIAN_FRONTEND=noninteractive
packages=(
  build-essential cmake pkg-config git
  libcaf-dev libucx-dev ucx-utils libmsgpack-cxx-dev libboost-dev doctest-dev
  libopenblas-dev libxxhash-dev libspdlog-dev libfmt-dev libcli11-dev libtomlplusplus-dev
  clang libclang-rt-14-dev
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  $SUDO apt-get update
  $SUDO apt-get install -y --no-install-recommends "${missing[@]}"
fi
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo "$@"
cmake --build build -j"$(nproc)"
