#!/usr/bin/env bash
# Build DeepGEMM 2.8.2 against this machine's torch and install it, so grouped_fp8's blockwise experts can run
# on it (fp8stack.backends.deepgemm). The source is PyPI's deepinfer-gemm 2.8.2 sdist: DeepGEMM's sources with
# CUTLASS and DeepJIT included (GitHub's release needs git submodules). Its host extension is one C++ file;
# the kernels are compiled at run time by DeepJIT with nvcc. Needs nvcc (CUDA 12.9+), a C++20 compiler with
# <format> (GCC 13+) and Python headers. Without elfutils' headers (libdw-dev), launch/deepgemm/ supplies the
# declarations DeepJIT's stack traces use (it loads libdw.so.1 itself at run time, if present).
# Usage: launch/build_deepgemm.sh [SDIST] [TARGET]
#   SDIST   the deepinfer_gemm-2.8.2.tar.gz (default: downloaded from PyPI)
#   TARGET  site directory to install into (default: this Python's purelib)
# Environment: PYTHON (default python3).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-python3}
VERSION=2.8.2
SDIST=${1:-}
TARGET=${2:-$("$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")}
CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
if [ -z "$SDIST" ]; then
  SDIST=$WORK/deepinfer_gemm-$VERSION.tar.gz
  "$PYTHON" - "$SDIST" "$VERSION" <<'PY'
import json, sys, urllib.parse, urllib.request
index = "https://pypi.org/pypi/deepinfer-gemm/json"
release = json.load(urllib.request.urlopen(index))["releases"][sys.argv[2]]
url = next(f["url"] for f in release if f["packagetype"] == "sdist")
urllib.request.urlretrieve(urllib.parse.urljoin(index, url), sys.argv[1])
PY
fi
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
