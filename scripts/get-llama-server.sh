#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` (an OpenAI-compatible server with --parallel continuous batching) into
# .tools/bin, and converts the bundled model to GGUF for it: a peer for `sluice bench --compare` (see
# docs/BENCHMARKS.md). Idempotent: a no-op when both are there. Optional: nothing in the tests needs it.
#
# No registry ships a llama-server binary, but the sdist of llama-cpp-python (PyPI) vendors llama.cpp's
# source: we build only the server target from it, CPU only (~10 min on 2 cores; see
# ../shared/MACHINE-NOTES.md). Needs cmake, a C++ compiler, and the .venv (for the GGUF conversion).
#
#   bash scripts/get-llama-server.sh
#   .tools/bin/llama-server -m .tools/models/SmolLM2-135M-Instruct-f32.gguf --port 8002 \
#       --parallel 32 --ctx-size 65536 --threads 2 --no-webui
#
# On a CPU with AMX (Sapphire Rapids and later Xeons) serve block-quantized GGUFs (Q4_0/Q4_1/Q8_0...)
# with --no-repack: built by GCC 12, llama.cpp's AMX matmul dies with a general protection fault on its
# first `ldtilecfg` (GCC 12's _tile_loadconfig declares 8 of the tile config's 64 bytes as its input, so
# -O3 drops the stores of the rows/columns and the CPU gets an invalid config; found with gdb, see
# docs/BENCHMARKS.md). --no-repack keeps the weights in the CPU buffer and its AVX-512 VNNI dot products.
#
# LLAMA_CPU_ISA=avx2 builds the same tools for AVX2+FMA+F16C+BMI2 only (no AVX-512, whatever this CPU has)
# into .tools/bin/avx2 from the build tree build-avx2: the peer, and the reference for the bit-exact checks
# (tests/engine/test_ggml_attention.py, tests/engine/test_llama_cpp_parity.py), of sluice's avx2 kernels (SLUICE_CPU_ISA=avx2).
# The default, native, is llama.cpp's own GGML_NATIVE build for this CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}  # pinned: the llama.cpp revision it vendors
ISA=${LLAMA_CPU_ISA:-native}
case "$ISA" in
  native) BIN=.tools/bin; BUILD_DIR=build; ISA_FLAGS=(-DGGML_NATIVE=ON) ;;
  avx2) BIN=.tools/bin/avx2; BUILD_DIR=build-avx2
        ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
                   -DGGML_AVX512=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AVX_VNNI=OFF) ;;
  *) echo "get-llama-server: LLAMA_CPU_ISA must be native or avx2, not $ISA" >&2; exit 1 ;;
esac
MODELS=.tools/models
PY=${PYTHON:-.venv/bin/python}
JOBS=${JOBS:-$(nproc)}

for tool in cmake c++; do
  command -v "$tool" >/dev/null 2>&1 || { echo "get-llama-server: $tool not found" >&2; exit 1; }
done
mkdir -p "$BIN" "$MODELS"
SRC=.tools/src/llama-cpp-python-$VERSION

if [ ! -d "$SRC/vendor/llama.cpp" ]; then
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  echo "get-llama-server: fetching the llama-cpp-python $VERSION sdist (it vendors llama.cpp)"
  # --no-binary for this package only: its build backend (scikit-build-core) comes as a wheel.
  "$PY" -m pip download --quiet --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$tmp"
  mkdir -p .tools/src
  tar -xzf "$tmp"/llama_cpp_python-"$VERSION".tar.gz -C "$tmp"
  rm -rf "$SRC"
  mv "$tmp/llama_cpp_python-$VERSION" "$SRC"
fi

if [ ! -x "$BIN/llama-server" ] || [ ! -x "$BIN/llama-quantize" ] || [ ! -x "$BIN/llama-perplexity" ]; then
  echo "get-llama-server: building llama-server, llama-quantize and llama-perplexity with $JOBS jobs (CPU only; ~10 min on 2 cores)"
  generator=()
  command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
  cmake -S "$SRC/vendor/llama.cpp" -B "$SRC/$BUILD_DIR" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    -DBUILD_SHARED_LIBS=OFF "${ISA_FLAGS[@]}" >/dev/null
  cmake --build "$SRC/$BUILD_DIR" --target llama-server llama-quantize llama-perplexity -j "$JOBS"
  for tool in llama-quantize llama-perplexity llama-server; do  # llama-server last: the check above
    install -m 0755 "$SRC/$BUILD_DIR/bin/$tool" "$BIN/$tool.partial"
    mv -f "$BIN/$tool.partial" "$BIN/$tool"
  done
fi

# The same weights sluice serves (the bundled model, dequantized to float32 once), as an f32 GGUF: the
# comparison is then of engines, not of quantizations. llama.cpp's own converter, from the same source.
F32="$MODELS/SmolLM2-135M-Instruct-f32.gguf"
if [ ! -f "$F32" ]; then
  model_dir=$("$PY" -c 'from sluice_engine.model_fetch import resolve_model; print(resolve_model(None))')
  echo "get-llama-server: converting $model_dir to $F32"
  # The converter imports sentencepiece before it falls back to tokenizer.json: give it one of its own,
  # outside the .venv.
  "$PY" -m pip install --quiet --target .tools/pylib sentencepiece
  PYTHONPATH=.tools/pylib "$PY" "$SRC/vendor/llama.cpp/convert_hf_to_gguf.py" "$model_dir" --outtype f32 \
    --outfile "$F32.partial" >/dev/null
  mv -f "$F32.partial" "$F32"
fi
echo "get-llama-server: $("$BIN/llama-server" --version 2>&1 | head -n 1); model $F32"
