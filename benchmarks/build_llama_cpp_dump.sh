#!/usr/bin/env bash
# Builds benchmarks/llama_cpp_dump.cpp (llama-dump: writes every intermediate tensor of llama.cpp's CPU
# backend, for op-by-op comparisons with Sluice) into .tools/bin/llama-dump, against the static libraries
# that scripts/get-llama-server.sh built (run that first). The libraries are Release (-O3, GGML_NATIVE,
# OpenMP); this file only drives them, so -O2 is enough for it. A few seconds on 2 cores.
#
#   bash benchmarks/build_llama_cpp_dump.sh
#   .tools/bin/llama-dump --model M.gguf --tokens 1,504,3287 --n-gen 4 --out /tmp/dump
set -euo pipefail
ROOT=${SLUICE_ROOT:-$(cd "$(dirname "$0")/.." && pwd)}
TOOLS=${TOOLS:-$ROOT/.tools}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
SRC=$TOOLS/src/llama-cpp-python-$VERSION
LLAMA=$SRC/vendor/llama.cpp
BUILD=$SRC/build
OUT=${OUT:-$TOOLS/bin/llama-dump}

for lib in "$BUILD/src/libllama.a" "$BUILD/ggml/src/libggml.a" "$BUILD/ggml/src/libggml-cpu.a" \
           "$BUILD/ggml/src/libggml-base.a"; do
  [ -f "$lib" ] || { echo "build_llama_cpp_dump: $lib missing (run scripts/get-llama-server.sh)" >&2; exit 1; }
done
mkdir -p "$(dirname "$OUT")"
set -x
/usr/bin/c++ -std=c++17 -O2 -Wall -Wextra \
  -I"$LLAMA/include" -I"$LLAMA/ggml/include" \
  "$ROOT/benchmarks/llama_cpp_dump.cpp" -o "$OUT.partial" \
  "$BUILD/src/libllama.a" "$BUILD/ggml/src/libggml.a" "$BUILD/ggml/src/libggml-cpu.a" "$BUILD/ggml/src/libggml-base.a" \
  -fopenmp -lpthread -ldl -lm
{ set +x; } 2>/dev/null
mv -f "$OUT.partial" "$OUT"
echo "build_llama_cpp_dump: built $OUT"
