#!/usr/bin/env bash
# The GPU check (issues 15, 23, 25): one command for a lent, offline GPU machine (H200: ~5 minutes, 9 at most).
#
#   bash benchmarks/gpu_wheels.sh                 # once, on a machine with pip: .whl/ (what the GPU image lacks)
#   bash benchmarks/gpu_check.sh                  # on the GPU machine, from anywhere; output in $OUT
#   bash benchmarks/gpu_check.sh --cpu-dry-run    # no GPU: tiny model, Triton's interpreter, the same control flow
#   bash benchmarks/gpu_check.sh --part features  # the second part (issue 43): the serving features, ~5 minutes
#
# Two parts, each within one budget (a lent GPU's 15 minutes hold both, with the machine's start): `main` (the
# default: the steps below up to triton-tests) and `features` (env, prefill-tiles, lora, offload, structured,
# kv-transfer: what was built since the first GPU run, each through its own benchmark, on the random model where
# it needs one).
#
# Options: --part main|features, --allow-skips (a skipped core step does not fail the run), --skip STEP[,STEP...]
# (leave steps out; a skipped core step still fails the run unless --allow-skips), --budget SECONDS (default 540,
# or GPU_CHECK_BUDGET). Environment: OUT (default bench-results/gpu), PYTHON (default the `python` on PATH),
# WHEELS (default .whl), GPU_CHECK_TESTS (the test modules of the last step), CC (the C compiler env checks).
#
# Steps, by value, each under its own `timeout` shrunk to what is left of the budget; a failing step does not
# stop the others:
#   env            python, torch, CUDA, Triton, a C compiler and `#include <Python.h>` (Triton builds its launcher
#                  with them), the serving packages; wheels from $WHEELS installed into a temp dir on PYTHONPATH.
#                  Anything missing FAILS here, by name.
#   decode-step    benchmarks/decode_step.py: Llama-3.1-8B shape, random bf16 weights, batch 1/16/64, eager vs
#                  CUDA graphs, against the weight-read floor
#   serve          benchmarks/serve_backends.py: `sluice serve` with the triton and torch attention backends,
#                  greedy tokens compared, tok/s of each
#   async          benchmarks/async_scheduling.py: batch 1 and 64, steps one at a time vs async scheduling: ms per
#                  step, the host's work left on the critical path, the same tokens
#   attention      benchmarks/attention_kernels.py: decode bandwidth at 4k-32k context (share of HBM)
#   fused          benchmarks/fused_kernels.py: the fused layer ops against torch's
#   quant-gemm     benchmarks/quant_gpu.py: FP8 (Triton, and FP8 x FP8 on sm90) and AWQ (Triton, dequant) at M 1-64
#   triton-tests   the Triton/CUDA test modules, `pytest -n 8` when pytest-xdist is there, no --maxfail; tests
#                  needing the bundled model skip (SLUICE_OFFLINE=1)
# and in the features part:
#   prefill-tiles  benchmarks/attention_kernels.py --prefill-sweep: prefill at 2k-16k tokens under each of a few
#                  tile / warps / stages configs (128-row tiles, 3-4 stages: what a Hopper wants), the best per shape
#   lora           benchmarks/lora_serving.py: 32 requests x 64 tokens on the base model (LoRA off and on) and
#                  spread over 1, 4 and 16 rank-16 adapters (random, every projection), and 16 adapters on 4 slots
#   offload        benchmarks/kv_offload.py: a rotation of 8 prefixes of 4,000 tokens through a KV pool that holds
#                  3: TTFT with the host offload tier against recomputing, the same first tokens
#   structured     benchmarks/structured_overhead.py: TPOT with and without a JSON schema at batch 1 and 32 (the
#                  grammar's mask applied on the GPU), the random model with a byte-level tokenizer
#   kv-transfer    benchmarks/kv_transfer_engines.py: a prefill and a decode engine (`sluice serve`) on the one
#                  GPU, sealed pushes: 6 prompts of 4,000 tokens through the hop, TTFT against computing them,
#                  every full block loaded from the transfer, the prefill engine's greedy tokens
# The random model (benchmarks/random_model.py, ~16 GB) is written in the background while env finishes, under
# /dev/shm when it has room (else /tmp), and removed at the end. Every step is core: a SKIP fails the run unless
# --allow-skips. $OUT gets each step's log, steps.tsv, and summary.json (step, status, seconds, figures, reason);
# the last lines printed are the summary table and the headline figures.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
ROOT=$PWD
DRY=0 ALLOW_SKIPS=0 SKIP_STEPS="" BUDGET=${GPU_CHECK_BUDGET:-540} PART=main
while (($#)); do
    case "$1" in
        --cpu-dry-run) DRY=1 ;;
        --allow-skips) ALLOW_SKIPS=1 ;;
        --skip) SKIP_STEPS=",${2:?--skip needs a list of steps},"; shift ;;
        --budget) BUDGET=${2:?--budget needs seconds}; shift ;;
        --part) PART=${2:?--part needs main or features}; shift
                [[ "$PART" == main || "$PART" == features ]] || { echo "gpu_check.sh: --part main or features" >&2; exit 2; } ;;
        -h|--help) sed -n '2,50p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
OUT=${OUT:-bench-results/gpu}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
rm -f "$OUT/steps.tsv" "$OUT/summary.json"
PY=${PYTHON:-$(command -v python || command -v python3)}
WHEELS=${WHEELS:-.whl}
export PYTHONPATH="$ROOT/operator:$ROOT/engine_image:$ROOT/autoscaler${PYTHONPATH:+:$PYTHONPATH}"
export SLUICE_OFFLINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
START=$SECONDS
TMP=$(mktemp -d "${TMPDIR:-/tmp}/sluice-gpu-check.XXXXXX")
# An empty model cache of its own: nothing is fetched offline (tests needing the bundled model skip), and
# platformdirs, which only locates the default cache, need not be on the node (benchmarks/gpu_wheels.txt).
export SLUICE_CACHE_DIR=${SLUICE_CACHE_DIR:-$TMP/cache}
# No C++ CPU-kernel builds here (seconds each, nothing a GPU check measures): engines that a test
# starts on CPU take the torch paths.
export SLUICE_CPU_KERNELS=off

if ((DRY)); then
    export TRITON_INTERPRET=1
    PRESET=tiny DEVICE=cpu MODEL_ROOT=$TMP
else
    PRESET=llama-8b DEVICE=cuda
    # 8B in bf16 is 16.1 GB: tmpfs when it has 24 GB free (no disk writes), else the temp dir
    if [[ -d /dev/shm ]] && (( $(df -Pk /dev/shm | awk 'NR==2 {print $4}') > 24 * 1024 * 1024 )); then
        MODEL_ROOT=/dev/shm
    else
        MODEL_ROOT=$TMP
    fi
fi
MODEL_DIR="$MODEL_ROOT/sluice-gpu-check-$PRESET-$$"
GEN_PID=""
cleanup() {
    [[ -n "$GEN_PID" ]] && kill "$GEN_PID" 2>/dev/null
    rm -rf "$MODEL_DIR" "$TMP"
}
trap cleanup EXIT

# record STEP STATUS SECONDS REASON: one line of steps.tsv (tabs and newlines in the reason become spaces)
record() {
    local reason=${4//$'\t'/ }
    printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${reason//$'\n'/ }" >> "$OUT/steps.tsv"
}
skip() { record "$1" SKIP 0 "$2"; echo; echo "=== $1: skipped ($2)"; }
skipped_by_user() { [[ "$SKIP_STEPS" == *",$1,"* ]]; }

# step NAME TIMEOUT_S COMMAND...: run it with its output in $OUT/NAME.log (and on stdout), record the outcome.
step() {
    local name=$1 limit=$2; shift 2
    if skipped_by_user "$name"; then skip "$name" "--skip"; return; fi
    local left=$((BUDGET - (SECONDS - START)))
    if ((left < 15)); then record "$name" SKIP 0 "time budget spent"; return; fi
    ((limit > left)) && limit=$left
    echo; echo "=== $name (timeout ${limit}s): $*"
    local t0=$SECONDS
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]} dt=$((SECONDS - t0)) note
    note=$(grep -E '^(FAILED)$|[0-9]+ (passed|failed)|Error|error:' "$OUT/$name.log" | tail -2 | tr '\n' ';')
    if ((rc == 0)); then record "$name" PASS "$dt" ""
    elif ((rc == 124 || rc == 137)); then record "$name" TIMEOUT "$dt" "killed after ${limit}s; $note"
    else record "$name" FAIL "$dt" "exit $rc; ${note:-see $name.log}"
    fi
}

# -- env ---------------------------------------------------------------------------------------------------
# Wheels first: what the image lacks (benchmarks/gpu_wheels.sh), into a temp target on PYTHONPATH. The wheels are
# cp312 manylinux x86-64 (the GPU image's Python): another Python (a dry run on a dev machine) still installs them
# for that target, to prove the set installs, but does not import them.
install_wheels() {
    local whls=("$WHEELS"/*.whl)
    [[ -e "${whls[0]}" ]] || { echo "wheels: none in $WHEELS (run benchmarks/gpu_wheels.sh where pip works)"; return 0; }
    local dup
    dup=$(for w in "${whls[@]}"; do basename "$w" | cut -d- -f1 | tr 'A-Z_.' 'a-z--'; done | sort | uniq -d)
    [[ -z "$dup" ]] || { echo "wheels: more than one version of: $dup"; return 1; }
    local pyver site="$TMP/site"
    pyver=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")' 2>/dev/null) || pyver="?"
    local pip=("$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check
               --target "$site")
    if [[ "$pyver" == 3.12 ]]; then
        "${pip[@]}" "${whls[@]}" || { echo "wheels: pip install from $WHEELS failed"; return 1; }
        export PYTHONPATH="$site:$PYTHONPATH"
        echo "wheels: ${#whls[@]} from $WHEELS installed into $site (on PYTHONPATH)"
    elif ((DRY)); then
        local pip_py=$PY
        "$PY" -m pip --version >/dev/null 2>&1 || pip_py=$(command -v python3)
        "$pip_py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
            --target "$site" --only-binary=:all: --implementation cp --python-version 3.12 \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 "${whls[@]}" \
            || { echo "wheels: pip install (for CPython 3.12) from $WHEELS failed"; return 1; }
        echo "wheels: ${#whls[@]} from $WHEELS install for CPython 3.12 into $site (dry run on Python $pyver: not imported)"
    else
        echo "wheels: $WHEELS holds CPython 3.12 wheels but $PY is Python $pyver"; return 1
    fi
}

env_check() {
    local t0=$SECONDS problems=()
    echo "date: $(date -u +%FT%TZ)  mode: $( ((DRY)) && echo cpu-dry-run || echo gpu)  python: $PY  budget: ${BUDGET}s"
    echo "git: $(git rev-parse --short HEAD 2>/dev/null || echo '?') $(git status --porcelain 2>/dev/null | wc -l) changed files"
    echo "model dir: $MODEL_DIR  ($(df -h "$MODEL_ROOT" | awk 'NR==2 {print $4}') free)"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | head -3
    if [[ -z "$PY" ]] || ! "$PY" -c 'import sys' 2>/dev/null; then
        problems+=("no python (set PYTHON)")
    else
        local wheels_said
        wheels_said=$(install_wheels 2>&1) || problems+=("$(tail -1 <<<"$wheels_said")")
        echo "$wheels_said"
        local report
        report=$("$PY" - "$DRY" <<'EOF'
import importlib, sys
dry = sys.argv[1] == "1"
print("python", sys.version.split()[0])
need = ["torch", "triton", "numpy", "safetensors", "tokenizers", "jinja2", "prometheus_client", "pytest",
        "fastapi", "uvicorn", "pydantic", "xgrammar"]
missing = []
for mod in need + ["xdist", "transformers"]:
    try:
        m = importlib.import_module(mod)
        print(f"  {mod:<18} {getattr(m, '__version__', '')}")
    except Exception as e:  # noqa: BLE001 - any import failure is "missing" here
        print(f"  {mod:<18} MISSING ({type(e).__name__}: {e})")
        if mod in need:
            missing.append(mod)
problems = [f"missing: {' '.join(missing)}"] if missing else []
try:
    import torch
    cuda = torch.cuda.is_available()
    print("torch cuda:", torch.version.cuda, "available:", cuda, torch.cuda.get_device_name(0) if cuda else "")
    if not cuda and not dry:
        problems.append("no CUDA device visible to torch")
except Exception:  # noqa: BLE001 - reported as missing above
    pass
try:
    import sluice_engine.engine.llm_engine, sluice_engine.entrypoints.openai.server  # noqa: E401,F401 - the serving path imports
    print("sluice_engine: the serving path imports")
except Exception as e:  # noqa: BLE001
    problems.append(f"sluice_engine does not import ({type(e).__name__}: {e})")
print("PROBLEMS:", "; ".join(problems))
EOF
        ) || true
        echo "$report"
        local p
        p=$(sed -n 's/^PROBLEMS: //p' <<<"$report")
        [[ -n "$p" ]] && problems+=("$p")
        [[ "$report" == *"PROBLEMS:"* ]] || problems+=("the environment probe did not run")
        # Triton compiles a small C launcher per kernel signature at first launch: it needs a C compiler and
        # Python's headers. Check both now rather than in the first kernel.
        local cc inc
        cc=${CC:-$(command -v cc || command -v gcc || command -v clang || true)}
        [[ -n "$cc" ]] && ! command -v "$cc" >/dev/null && cc=""
        inc=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])' 2>/dev/null || true)
        if [[ -z "$cc" ]]; then
            problems+=("no C compiler (cc/gcc/clang): Triton cannot build its launcher")
        elif ! printf '#include <Python.h>\nint main(void) { return Py_IsInitialized(); }\n' \
                | "$cc" -fsyntax-only -I"$inc" -x c - 2>"$TMP/cc.err"; then
            problems+=("#include <Python.h> does not compile with $cc -I$inc: $(head -c 200 "$TMP/cc.err")")
        else
            echo "C compiler: $cc; Python.h: $inc/Python.h compiles"
        fi
        if command -v nvcc >/dev/null; then echo "nvcc: $(command -v nvcc)"; fi
    fi
    local dt=$((SECONDS - t0))
    if ((${#problems[@]})); then
        local joined
        joined=$(printf '%s; ' "${problems[@]}")
        echo "ENV FAILED: $joined"
        record env FAIL "$dt" "${joined%; }"
        return 1
    fi
    record env PASS "$dt" ""
}
echo "=== env"
env_check 2>&1 | tee "$OUT/env.log"
ENV_OK=$([[ "$(tail -1 "$OUT/steps.tsv" | cut -f2)" == PASS ]] && echo 1 || echo 0)
# the wheels' PYTHONPATH was exported in a pipeline's subshell: export it again here
[[ -d "$TMP/site" ]] && grep -q 'on PYTHONPATH' "$OUT/env.log" && export PYTHONPATH="$TMP/site:$PYTHONPATH"

# The random model, in the background (it needs the GPU for a few seconds only).
if [[ "$PART" == main ]]; then MODEL_STEPS=(decode-step serve async); else MODEL_STEPS=(lora offload structured kv-transfer); fi
needs_model=0
for s in "${MODEL_STEPS[@]}"; do skipped_by_user "$s" || needs_model=1; done
if ((ENV_OK && needs_model)); then
    # features: a byte-level tokenizer, so the structured step's grammar can spell JSON (the others send token ids)
    "$PY" benchmarks/random_model.py "$MODEL_DIR" --preset "$PRESET" --device "$( ((DRY)) && echo cpu || echo auto)" \
        --tokenizer "$( [[ "$PART" == features ]] && echo bytes || echo words)" \
        > "$OUT/random_model.log" 2>&1 &
    GEN_PID=$!
fi

# wait_model: 0 when the random model is written (waits for the writer, within the budget)
MODEL_STATE=""
wait_model() {
    if [[ -z "$MODEL_STATE" ]]; then
        if [[ -z "$GEN_PID" ]]; then MODEL_STATE="not generated (env failed)"
        else
            while kill -0 "$GEN_PID" 2>/dev/null && ((SECONDS - START < BUDGET - 20)); do sleep 1; done
            if kill -0 "$GEN_PID" 2>/dev/null; then
                kill "$GEN_PID"; MODEL_STATE="still writing when the budget ran out"
            elif wait "$GEN_PID"; then MODEL_STATE=ok
            else MODEL_STATE="random_model.py failed: $(tail -1 "$OUT/random_model.log")"
            fi
            GEN_PID=""
            cat "$OUT/random_model.log"
        fi
    fi
    [[ "$MODEL_STATE" == ok ]]
}

needs_env() { ((ENV_OK)) || { skip "$1" "env failed: $(grep -m1 '^env' "$OUT/steps.tsv" | cut -f4)"; return 1; }; }

# -- decode-step: eager vs CUDA graphs --------------------------------------------------------------------
if [[ "$PART" != main ]]; then :
elif skipped_by_user decode-step; then skip decode-step "--skip"
elif needs_env decode-step; then
    if ! wait_model; then skip decode-step "no random model: $MODEL_STATE"
    elif ((DRY)); then
        step decode-step 120 "$PY" benchmarks/decode_step.py --preset tiny --device cpu --model-dir "$MODEL_DIR" \
            --steps 8 --json "$OUT/decode_step.json"
    else
        step decode-step 120 "$PY" benchmarks/decode_step.py --preset llama-8b --device cuda --model-dir "$MODEL_DIR" \
            --steps 64 --kv-cache-memory 4G --json "$OUT/decode_step.json"
    fi
fi

# -- serve: sluice serve, triton vs torch attention --------------------------------------------------------
if [[ "$PART" != main ]]; then :
elif skipped_by_user serve; then skip serve "--skip"
elif needs_env serve; then
    if ! wait_model; then skip serve "no random model: $MODEL_STATE"
    else
        step serve 150 "$PY" benchmarks/serve_backends.py --preset "$PRESET" --device "$DEVICE" --model-dir "$MODEL_DIR" \
            --kv-cache-memory "$( ((DRY)) && echo 64M || echo 2G)" --log-dir "$OUT" --json "$OUT/serve.json" \
            $( ((DRY)) && echo --prompts 2 --max-tokens 8)  # the interpreter: ~10 s a decode step (CI's time)
    fi
fi
# -- async: async scheduling vs steps one at a time -------------------------------------------------------------
if [[ "$PART" != main ]]; then :
elif skipped_by_user async; then skip async "--skip"
elif needs_env async; then
    if ! wait_model; then skip async "no random model: $MODEL_STATE"
    elif ((DRY)); then
        step async 120 "$PY" benchmarks/async_scheduling.py --model "$MODEL_DIR" --device cpu --batch 4 --max-tokens 8 \
            --reps 1 --kv-cache-memory 64M --json "$OUT/async.json"
    else
        step async 100 "$PY" benchmarks/async_scheduling.py --model "$MODEL_DIR" --batch 1,64 --max-tokens 32 --reps 2 \
            --kv-cache-memory 2G --json "$OUT/async.json"
    fi
fi
# -- prefill-tiles: the prefill kernel's tile, warps and stages (features; no model: runs while it is written) ---
if [[ "$PART" != features ]]; then :
elif needs_env prefill-tiles; then
    if ((DRY)); then step prefill-tiles 60 "$PY" benchmarks/attention_kernels.py --cpu-smoke --prefill-sweep
    else step prefill-tiles 120 "$PY" benchmarks/attention_kernels.py --prefill-sweep --json "$OUT/prefill_tiles.json"
    fi
fi
# -- lora: base vs 1, 4 and 16 adapters (features) ------------------------------------------------------------
if [[ "$PART" != features ]]; then :
elif skipped_by_user lora; then skip lora "--skip"
elif needs_env lora; then
    if ! wait_model; then skip lora "no random model: $MODEL_STATE"
    elif ((DRY)); then
        step lora 120 "$PY" benchmarks/lora_serving.py --model "$MODEL_DIR" --token-ids --device cpu --requests 4 \
            --max-tokens 4 --reps 1 --rank 8 --kv-cache-memory 4M --json "$OUT/lora.json"
    else  # three 8B engines at once: 48 GB of weights and 2 GB of KV each
        step lora 180 "$PY" benchmarks/lora_serving.py --model "$MODEL_DIR" --token-ids --requests 32 \
            --max-tokens 64 --reps 2 --kv-cache-memory 2G --json "$OUT/lora.json"
    fi
fi
# -- offload: a rotation of long prefixes, the host tier vs recomputing (features) -----------------------------
if [[ "$PART" != features ]]; then :
elif skipped_by_user offload; then skip offload "--skip"
elif needs_env offload; then
    if ! wait_model; then skip offload "no random model: $MODEL_STATE"
    elif ((DRY)); then
        step offload 60 "$PY" benchmarks/kv_offload.py --model "$MODEL_DIR" --token-ids --device cpu --prefixes 6 \
            --prefix-tokens 128 --rounds 2 --kv-cache-memory 512KiB --kv-offload-bytes 8MiB --json "$OUT/kv_offload.json"
    else  # 8B: 128 KiB of bf16 KV a token, a prefix ~0.5 GB; the pool holds 3, the tier all 8
        step offload 120 "$PY" benchmarks/kv_offload.py --model "$MODEL_DIR" --token-ids --prefixes 8 \
            --prefix-tokens 4000 --rounds 3 --kv-cache-memory 1600MiB --kv-offload-bytes 6GiB --json "$OUT/kv_offload.json"
    fi
fi
# -- structured: a JSON schema's cost per token, its mask applied on the device (features) ---------------------
if [[ "$PART" != features ]]; then :
elif skipped_by_user structured; then skip structured "--skip"
elif needs_env structured; then
    if ! wait_model; then skip structured "no random model: $MODEL_STATE"
    elif ((DRY)); then
        step structured 60 "$PY" benchmarks/structured_overhead.py --model "$MODEL_DIR" --device cpu --batch-sizes 1 \
            --rounds 1 --kv-cache-memory 8MiB --json "$OUT/structured.json"
    else
        step structured 120 "$PY" benchmarks/structured_overhead.py --model "$MODEL_DIR" --batch-sizes 1 32 --rounds 3 \
            --kv-cache-memory 2G --json "$OUT/structured.json"
    fi
fi
# -- kv-transfer: prefill engine -> decode engine on the one device (features) ---------------------------------
if [[ "$PART" != features ]]; then :
elif skipped_by_user kv-transfer; then skip kv-transfer "--skip"
elif needs_env kv-transfer; then
    if ! wait_model; then skip kv-transfer "no random model: $MODEL_STATE"
    elif ((DRY)); then
        step kv-transfer 90 "$PY" benchmarks/kv_transfer_engines.py --model "$MODEL_DIR" --device cpu --prompts 3 \
            --prompt-tokens 300 --kv-cache-memory 4M --kv-offload-bytes 16MiB --log-dir "$OUT/kv-transfer-logs" \
            --json "$OUT/kv_transfer.json"
    else  # two 8B engines: 32 GB of weights, 4 GB of KV each; 6 x 0.5 GB of prompt blocks through the decode tier
        step kv-transfer 180 "$PY" benchmarks/kv_transfer_engines.py --model "$MODEL_DIR" --prompts 6 \
            --prompt-tokens 4000 --kv-cache-memory 4G --kv-offload-bytes 8GiB --log-dir "$OUT/kv-transfer-logs" \
            --json "$OUT/kv_transfer.json"
    fi
fi
# the model is not needed past here: free the tmpfs
[[ -n "$GEN_PID" ]] && kill "$GEN_PID" 2>/dev/null
GEN_PID=""
rm -rf "$MODEL_DIR"

# -- kernels -------------------------------------------------------------------------------------------------
if [[ "$PART" != main ]]; then :
elif needs_env attention; then
    if ((DRY)); then step attention 60 "$PY" benchmarks/attention_kernels.py --cpu-smoke
    else step attention 70 "$PY" benchmarks/attention_kernels.py --decode-batches 1 16 64 \
            --decode-contexts 4096 16384 32768 --json "$OUT/attention.json"
    fi
fi
if [[ "$PART" != main ]]; then :
elif needs_env fused; then
    if ((DRY)); then step fused 60 "$PY" benchmarks/fused_kernels.py --cpu-smoke
    else step fused 45 "$PY" benchmarks/fused_kernels.py --batches 1 16 64 --json "$OUT/fused.json"
    fi
fi
if [[ "$PART" != main ]]; then :
elif needs_env quant-gemm; then
    if ((DRY)); then step quant-gemm 60 "$PY" benchmarks/quant_gpu.py --cpu-smoke --ms 1 16
    else step quant-gemm 60 "$PY" benchmarks/quant_gpu.py --ms 1 16 64 --json "$OUT/quant_gpu.json"
    fi
fi

# -- the Triton / CUDA test modules ---------------------------------------------------------------------------
# The engine tests among them build no C++ on CUDA; on CPU (dry run) one quick module shows the step works.
if ((DRY)); then
    read -r -a TESTS <<< "${GPU_CHECK_TESTS:-tests/engine/test_layer_ops_triton.py}"
else
    read -r -a TESTS <<< "${GPU_CHECK_TESTS:-tests/engine/test_triton_attention.py tests/engine/test_layer_ops_triton.py \
tests/engine/test_quant_triton.py tests/engine/test_cuda_graphs.py tests/engine/test_fp8_kv_cache.py tests/engine/test_sampler_syncs.py \
tests/engine/test_layer_ops_model.py tests/engine/test_quant_model.py tests/engine/test_input_buffers.py tests/engine/test_lora_kernels.py}"
fi
if [[ "$PART" == main ]] && needs_env triton-tests; then
    PYTEST_ARGS=(-v -p no:cacheprovider --continue-on-collection-errors -rfEs -o addopts="" --durations=10
                 --junitxml "$OUT/triton-tests.xml")
    # xdist spreads the cold Triton compiles over 8 processes (~150 of them: serial, they alone took minutes)
    "$PY" -c 'import xdist' 2>/dev/null && PYTEST_ARGS+=(-n "$( ((DRY)) && echo 2 || echo 8)")
    step triton-tests 150 "$PY" -m pytest "${PYTEST_ARGS[@]}" "${TESTS[@]}"
fi

# -- summary ---------------------------------------------------------------------------------------------------
echo
echo "=== GPU check summary ($( ((DRY)) && echo cpu-dry-run || echo gpu), part $PART, $((SECONDS - START))s of ${BUDGET}s; logs in $OUT)"
if ! "$PY" benchmarks/gpu_check_summary.py "$OUT" "$( ((DRY)) && echo cpu-dry-run || echo gpu)" "$ALLOW_SKIPS" "$PART" \
        2>"$TMP/summary.err"; then
    # no usable Python: the table from the records, and a summary.json without figures
    cat "$TMP/summary.err"
    printf '%-14s %-8s %6s  %s\n' step status secs reason
    while IFS=$'\t' read -r s st t r; do printf '%-14s %-8s %6s  %s\n' "$s" "$st" "$t" "${r:0:150}"; done < "$OUT/steps.tsv"
    {
        echo '{"figures": {}, "steps": ['
        sep=""
        while IFS=$'\t' read -r s st t r; do
            r=${r//\\/\\\\}; r=${r//\"/\\\"}
            printf '%s{"step": "%s", "status": "%s", "seconds": %s, "reason": "%s"}' "$sep" "$s" "$st" "$t" "$r"
            sep=$',\n'
        done < "$OUT/steps.tsv"
        echo ']}'
    } > "$OUT/summary.json"
fi
# Exit status: any FAIL or TIMEOUT; any SKIP of a core step (every step is one) unless --allow-skips.
rc=0
while IFS=$'\t' read -r s st _ _; do
    case "$st" in
        PASS) ;;
        SKIP) ((ALLOW_SKIPS)) || { echo "core step $s was skipped (--allow-skips to accept)"; rc=1; } ;;
        *) rc=1 ;;
    esac
done < "$OUT/steps.tsv"
echo "$( ((rc)) && echo 'GPU CHECK FAILED' || echo 'GPU CHECK PASSED')"
exit "$rc"
