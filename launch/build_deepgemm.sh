#!/usr/bin/env bash
# Build DeepGEMM 2.8.2 against this machine's torch and install it, so grouped_fp8's blockwise experts can run
# on it (fp8stack.backends.deepgemm). The source is PyPI's deepinfer-gemm 2.8.2 sdist: DeepGEMM's sources with
# CUTLASS and DeepJIT included (GitHub's release needs git submodules). Its host extension is one C++ file;
# the kernels are compiled at run time by DeepJIT with nvcc. Needs nvcc (CUDA 12.9+), a C++20 compiler with
# <format> (GCC 13+) and Python headers. Without elfutils' headers (libdw-dev), launch/deepgemm/ supplies the
# declarations DeepJIT's stack traces use (it loads libdw.so.1 itself at run time, if present).
# The sdist is pinned by its SHA-256 (PyPI's own digest): an archive that does not match is refused before
# anything is unpacked or installed (exit 2, one line).
# Usage: launch/build_deepgemm.sh [SDIST] [TARGET]   (make deepgemm: into the venv's site-packages)
#   SDIST   the deepinfer_gemm-2.8.2.tar.gz (default: downloaded from its pinned PyPI address)
#   TARGET  site directory to install into (default: this Python's purelib)
# Environment: PYTHON (default python3).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-python3}
VERSION=2.8.2
SHA256=aad050965750f809b8dbb744a8db54fc4eba0eb3bc99d565fa9b41010fe25351
URL=https://files.pythonhosted.org/packages/c3/81/8211cfa3e92b0f5be337116fe15da8a6fa232161899a628fe100d8895fa0/deepinfer_gemm-$VERSION.tar.gz
SDIST=${1:-}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
if [ -z "$SDIST" ]; then
  SDIST=$WORK/deepinfer_gemm-$VERSION.tar.gz
  "$PYTHON" -c "import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])" "$URL" "$SDIST"
fi
if [ ! -f "$SDIST" ]; then
  echo "build_deepgemm.sh: $SDIST is not a file: pass the deepinfer_gemm-$VERSION.tar.gz sdist, or no argument to download it" >&2
  exit 2
fi
ACTUAL=$("$PYTHON" -c "import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], 'rb').read()).hexdigest())" "$SDIST")
if [ "$ACTUAL" != "$SHA256" ]; then
  echo "build_deepgemm.sh: $SDIST has SHA-256 $ACTUAL, not deepinfer-gemm $VERSION's pinned $SHA256: pass the genuine sdist (PyPI's), or no argument to download it" >&2
  exit 2
fi
TARGET=${2:-$("$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")}
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
tar xzf "$SDIST" -C "$WORK"
cd "$WORK/deepinfer_gemm-$VERSION"
# As DeepGEMM's setup.py lays out the package: CUTLASS's cute and cutlass headers beside its own, for DeepJIT.
cp -r third-party/cutlass/include/cute third-party/cutlass/include/cutlass deep_gemm/include/
if ! echo '#include <elfutils/libdwfl.h>' | c++ -E -x c++ - > /dev/null 2>&1; then
  cp -r "$HERE/deepgemm/elfutils" deep_gemm/include/
fi
TORCH=$("$PYTHON" -c "import os, torch; print(os.path.dirname(torch.__file__))")
ABI=$("$PYTHON" -c "import torch; print(int(torch.compiled_with_cxx11_abi()))")
PYINC=$("$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
c++ -std=c++20 -O3 -fPIC -shared -Wno-psabi -Wno-deprecated-declarations -D_GLIBCXX_USE_CXX11_ABI="$ABI" \
  -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H \
  -I"$CUDA_HOME/include" -I"$CUDA_HOME/include/cccl" -I"$TORCH/include" -I"$TORCH/include/torch/csrc/api/include" \
  -I"$PYINC" -Ideep_gemm/include -Ithird-party/deep_jit/include -Ithird-party/cutlass/include \
  csrc/python_api.cpp -o deep_gemm/_C.so \
  -L"$CUDA_HOME/lib64" -L"$TORCH/lib" -lcudart -lc10 -ltorch -ltorch_cpu -ltorch_python -lc10_cuda -ltorch_cuda
mkdir -p "$TARGET"
rm -rf "$TARGET/deep_gemm" "$TARGET"/deepinfer_gemm-*.dist-info
cp -r deep_gemm "$TARGET/"
mkdir -p "$TARGET/deepinfer_gemm-$VERSION.dist-info"
printf 'Metadata-Version: 2.1\nName: deepinfer-gemm\nVersion: %s\n' "$VERSION" > "$TARGET/deepinfer_gemm-$VERSION.dist-info/METADATA"
echo "deep_gemm $VERSION installed into $TARGET"
