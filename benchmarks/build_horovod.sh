#!/usr/bin/env bash
# Builds Horovod 0.28.1 from the PyPI sdist with PyTorch + Gloo support only
# (CPU; no MPI, TensorFlow, MXNet, or CUDA) against torch 2.13.0 (CPU wheel).
# It installs into a separate venv (default .venv-horovod in the repository, or $1), never .venv.
#
# Why the patches are needed:
#  * Horovod 0.28.1 sets CMAKE_CXX_STANDARD 14 in CMakeLists.txt (used for
#    horovod/common) and again in horovod/torch/CMakeLists.txt (used for the
#    torch extension). torch >= 2.1 headers require C++17, so the script changes
#    both settings to 17. These are the only source patches needed for torch 2.13.
#  * cmake is pinned to <4 (not a source patch): CMake 4 rejects
#    third_party/gloo's cmake_minimum_required(VERSION 2.8.12).
#
# Usage: benchmarks/build_horovod.sh [VENV_DIR]
#   Env overrides: PYTHON (python3), TORCH_SPEC (torch==2.13.0+cpu),
#                  HVD_BUILD_DIR (temp dir, deleted afterwards unless set).
# Uses the pip config of the machine (find-links /opt/wheels holds the CPU torch
# wheel). Everything runs under nice -n 19 with a single make job.
# Took about 6 minutes to compile on 2 shared cores (plus pip installs).
set -euo pipefail

VENV="${1:-$(cd "$(dirname "$0")/.." && pwd)/.venv-horovod}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0+cpu}"
HVD_VERSION=0.28.1
HVD_SDIST_SHA256=92a43f5a94c43907a56805bad15f19700c62ffc83b7ca483f9e104e229f67ef0

if [[ -n "${HVD_BUILD_DIR:-}" ]]; then
    BUILD_DIR="$HVD_BUILD_DIR"
    mkdir -p "$BUILD_DIR"
else
    BUILD_DIR="$(mktemp -d /tmp/hvd-build.XXXXXX)"
    trap 'rm -rf "$BUILD_DIR"' EXIT
fi

NICE=(nice -n 19)
start=$(date +%s)

# 1. Plain venv (no --system-site-packages) with torch (CPU), numpy, cmake<4.
if [[ ! -x "$VENV/bin/python" ]]; then
    "${NICE[@]}" "$PYTHON" -m venv "$VENV"
fi
PIP=("${NICE[@]}" "$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip
"${PIP[@]}" install -q "$TORCH_SPEC" numpy 'cmake>=3.13,<4' setuptools wheel \
    cloudpickle psutil pyyaml packaging

# 2. Download and unpack the sdist (check its hash).
cd "$BUILD_DIR"
if [[ ! -f "horovod-$HVD_VERSION.tar.gz" ]]; then
    "${PIP[@]}" download -q --no-deps --no-binary :all: -d . "horovod==$HVD_VERSION"
fi
echo "$HVD_SDIST_SHA256  horovod-$HVD_VERSION.tar.gz" | sha256sum -c -
rm -rf "horovod-$HVD_VERSION"
tar xzf "horovod-$HVD_VERSION.tar.gz"
SRC="$BUILD_DIR/horovod-$HVD_VERSION"

# 3. Patch: C++14 -> C++17 (sed only changes 14 to 17, so rerunning it is harmless).
sed -i 's/^set(CMAKE_CXX_STANDARD 14)$/set(CMAKE_CXX_STANDARD 17)/' "$SRC/CMakeLists.txt"
sed -i 's/^\( *\)set(CMAKE_CXX_STANDARD 14)$/\1set(CMAKE_CXX_STANDARD 17)/' \
    "$SRC/horovod/torch/CMakeLists.txt"
grep -q '^set(CMAKE_CXX_STANDARD 17)$' "$SRC/CMakeLists.txt"
grep -q '^ *set(CMAKE_CXX_STANDARD 17)$' "$SRC/horovod/torch/CMakeLists.txt"
if grep -q 'CMAKE_CXX_STANDARD 14' "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"; then
    echo "patch failed: C++14 still present" >&2
    exit 1
fi

# 4. Build + install (MAKEFLAGS set => setup.py does not add its default -j8).
export PATH="$VENV/bin:$PATH"
export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
       HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_CPU_OPERATIONS=gloo \
       MAKEFLAGS=-j1
cd "$SRC"
"${PIP[@]}" install --no-build-isolation --no-cache-dir .

# 5. Check from outside the source tree (otherwise the unbuilt ./horovod is imported).
cd /
"$VENV/bin/python" -c 'import horovod.torch as hvd; assert hvd.gloo_built(); print("horovod.torch OK")'
"$VENV/bin/horovodrun" --check-build
echo "build_horovod.sh: done in $(( $(date +%s) - start ))s -> $VENV"
