#!/usr/bin/env bash
# llama.cpp peer: built from the llama-cpp-python 0.3.36 sdist's vendored tree
# (the ggml a Python user of llama.cpp gets), with the tools the benchmark
# uses: llama-bench, llama-batched-bench, llama-quantize, and llama-server
# (the memory scenario's peer). Output in
# .peers/llama.cpp (ignored by git). Never part of jaxserve's install or tests.
#   JOBS=2 benchmarks/peers/setup_llamacpp.sh
#
# AMX stays off (-mno-amx-*, which override -march=native whatever their
# order): on a Xeon with AMX this ggml's AMX int8 path crashed
# (SIGSEGV in ggml_backend_amx_mul_mat) on SmolLM2's Q8_0 and Q4_1 files in
# llama-batched-bench, while F32 ran; without it the Q8_0/Q4_x products take
# the AVX-512 VNNI kernels and the weight repacking, as on CPUs without AMX.
# LLAMA_AMX=1 builds it in anyway.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=.peers/llama.cpp
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
JOBS=${JOBS:-2}
PY=${PY:-.venv/bin/python}
mkdir -p "$ROOT"
if [ ! -d "$ROOT/src" ]; then
  "$PY" -m pip download -q --no-binary llama-cpp-python --no-deps -d "$ROOT/sdist" "llama-cpp-python==$VERSION"
  mkdir -p "$ROOT/unpack"
  tar -xzf "$ROOT"/sdist/llama_cpp_python-"$VERSION".tar.gz -C "$ROOT/unpack"
  mv "$ROOT/unpack/llama_cpp_python-$VERSION/vendor/llama.cpp" "$ROOT/src"
  rm -rf "$ROOT/unpack"
fi
NO_AMX=""
if [ "${LLAMA_AMX:-0}" != 1 ]; then
  NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
cmake -S "$ROOT/src" -B "$ROOT/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" \
  -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF
cmake --build "$ROOT/build" -j "$JOBS" --target llama-bench llama-batched-bench llama-quantize llama-server
ls -la "$ROOT/build/bin/"
"$ROOT/build/bin/llama-bench" --help >/dev/null && echo "llama.cpp tools ready in $ROOT/build/bin"
