"""The engine flags an InferenceEndpoint may pass through `spec.engine.args`.

NOTE: this mirrors `add_engine_args` in engine_image/sluice_engine/entrypoints/serve_cli.py (a contract, docs/engine-flags.md)
instead of importing it, so the operator never needs the engine (or torch) installed. A test compares the two.
"""

from __future__ import annotations

import re

# Flags the operator renders itself from dedicated spec fields; `engine.args` may not set them.
OPERATOR_OWNED_FLAGS: dict[str, str] = {
    "model": "model.uri",
    "served-model-name": "model.servedName",
    "dtype": "engine.dtype",
    "max-model-len": "engine.maxModelLen",
    "quantization": "engine.quantization",
    "kv-cache-dtype": "engine.kvCacheDtype",
    "device": "accelerator.type",
    "host": "(always 0.0.0.0 in a pod)",
    "port": "(always 8000 in a pod)",
    "slo-ttft-ms": "slo.ttftMs",
    "slo-tpot-ms": "slo.tpotMs",
    "gpu-hour-usd": "cost.gpuHourUSD",
    "otlp-traces-endpoint": "tracing.otlpEndpoint",
    "trace-sample-ratio": "tracing.sampleRatio",
    "objectives-file": "slo and cost (the ConfigMap's objectives.json, re-read while the engine runs)",
    "tensor-parallel-size": "parallelism.tensor",
    "pipeline-parallel-size": "parallelism.pipeline",
    # A multi-node replica's rendezvous: from the layout and the env LeaderWorkerSet injects into each pod.
    "nnodes": "parallelism (the LeaderWorkerSet group size)",
    "node-rank": "(LWS_WORKER_INDEX in a LeaderWorkerSet)",
    "master-addr": "(LWS_LEADER_ADDRESS in a LeaderWorkerSet)",
    "master-port": "(always 29500 in a pod, the container port named dist)",
    # Not rendered: the ServiceMonitor labels every series with sluice_dev_endpoint (and the Prometheus
    # operator's own `endpoint` target label would shadow this one).
    "endpoint-label": "(the ServiceMonitor's sluice_dev_endpoint label)",
    # LoRA adapters come from the spec (fetched into the model cache like the model), not from paths typed here:
    # the ConfigMap's adapters.json, which the engine re-reads while it runs (adapters.py).
    "lora-modules": "spec.adapters",
    "lora-modules-file": "spec.adapters (the ConfigMap's adapters.json, re-read while the engine runs)",
    # Loading adapters through the API would load them on the one pod a request reached: replicas behind a
    # Service would differ. The endpoint's adapters are spec.adapters, on every replica.
    "allow-runtime-lora-updates": "spec.adapters (every replica loads and unloads the same adapters)",
    # Both only matter with run-time adapter loading, which is off in a pod (above).
    "lora-root": "spec.adapters (run-time loads are off in a pod)",
    "admin-api-key": "spec.adapters (run-time loads, which the admin key guards, are off in a pod)",
    # Prefill/decode disaggregation: the operator renders both pools and wires them (disaggregation.py); an
    # endpoint does not set the roles piecemeal.
    "kv-role": "spec.disaggregation",
    "kv-host": "spec.disaggregation (the decode pod's IP)",
    "kv-port": "spec.disaggregation (always 8100 in a pod, the container port named kv)",
    "prefill-url": "spec.disaggregation (the prefill pool's Service)",
    "prefill-min-prompt-tokens": "spec.disaggregation.decode.minPromptTokens",
    "kv-secret-file": "spec.disaggregation (the endpoint's KV Secret <name>-kv, made by the operator)",
    # A key on the command line is in the pod spec for anyone who may read pods: the engine reads it from its
    # environment instead.
    "api-key": "(pod.env SLUICE_API_KEY, valueFrom a Secret)",
}

# flag (without the leading dashes) -> the value type it takes, or the tuple of its choices.
# `bool` marks a switch: "true" renders the bare flag, "false" leaves it out.
PASSTHROUGH_FLAGS: dict[str, type | tuple[str, ...]] = {
    "block-size": int,
    "kv-cache-memory": str,
    "gpu-memory-utilization": float,
    "max-num-seqs": int,
    "max-num-batched-tokens": int,
    "no-prefix-caching": bool,
    # The KV offload tier: host memory per rank, in the pod's memory (size the container's memory for it).
    "kv-offload-bytes": str,
    # A decode engine's hop to the prefill pool (spec.disaggregation): past this, the prompt is computed there.
    "prefill-timeout": float,
    "max-queue-len": int,
    # The waiting queue's order: fcfs, or priority (a request's `priority`, lower first; e.g. what a Gateway API
    # Inference Extension picker passes on from an InferenceObjective).
    "scheduling-policy": ("fcfs", "priority"),
    "step-timeout": float,
    "shutdown-timeout": float,
    "attention-backend": ("auto", "cpu", "torch", "triton"),
    # The CPU GGUF formats' GEMM float order: fast trades llama.cpp's bits for ~1.3x batch throughput.
    "numerics": ("exact", "fast"),
    "enforce-eager": bool,
    "cuda-graph-max-batch": int,
    "warmup": ("auto", "full", "minimal", "off"),
    "seed": int,
    "log-level": ("debug", "info", "warning", "error"),
    "speculative-method": ("ngram", "draft"),
    # A path inside the pod (e.g. a directory next to the model on its volume) or what --model accepts:
    # the operator does not fetch drafts yet.
    "draft-model": str,
    "num-speculative-tokens": int,
    "ngram-min": int,
    "ngram-max": int,
    "speculative-disable-batch-size": int,
    "distributed-timeout": float,
    # "false" renders --no-engine-process / --no-async-scheduling (NEGATABLE_SWITCHES), "true" the flag itself
    # (engine-process is on by default; async-scheduling by device: on for CUDA, off on CPU).
    "engine-process": bool,
    "async-scheduling": bool,
    # On whenever spec.adapters lists one; "true" keeps it on without adapters, so that adding the first (or
    # removing the last) changes no flag and rolls no pod. The operator renders it once (workload.serve_args).
    "enable-lora": bool,
    "max-loras": int,
    "max-lora-rank": int,
    "max-cpu-loras": int,
}

# Switches that are on by default in the engine (argparse's BooleanOptionalAction): "false" renders --no-<flag>.
NEGATABLE_SWITCHES = frozenset({"engine-process", "async-scheduling"})

# What the CRD can type-check and CEL can read: x-kubernetes-int-or-string. So a float is written as a
# string ("0.85") and a switch as "true" or "false", as they would be on a command line.
ArgValue = int | str


# What a quoted integer or number may look like: the same regular expressions in the CRD's CEL rules
# (value_rules) and here, so the API server and `sluice render` agree (Python's int() and float() would also
# take " 1_000 ", "nan" and "inf").
INT_PATTERN = r"^[-+]?[0-9]+$"
MAX_VALUE_LENGTH = 256  # the CRD's maxLength of a value (CEL's cost estimate needs a bound for matches())
NUMBER_PATTERN = r"^[-+]?([0-9]+([.][0-9]*)?|[.][0-9]+)([eE][-+]?[0-9]+)?$"


def _is_int(value: ArgValue) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or re.fullmatch(INT_PATTERN[1:-1], value) is not None


def _is_number(value: ArgValue) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or re.fullmatch(NUMBER_PATTERN[1:-1], value) is not None


def _flags(kind: type) -> list[str]:
    return [f for f, k in PASSTHROUGH_FLAGS.items() if k is kind]


def _cel_names(names: list[str] | tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{n}'" for n in names) + "]"


def value_rules() -> list[dict[str, str]]:
    """CEL rules for the CRD's `engine.args` map: each value fits its flag's type, as check_arg says."""
    rules = [
        {"rule": f"self.all(k, !(k in {_cel_names(_flags(int))}) || type(self[k]) == int || "
                 f"(type(self[k]) == string && self[k].matches('{INT_PATTERN}')))",
         "message": "engine.args: " + ", ".join(_flags(int)) + " take an integer"},
        {"rule": f"self.all(k, !(k in {_cel_names(_flags(float))}) || type(self[k]) == int || "
                 f"(type(self[k]) == string && self[k].matches('{NUMBER_PATTERN}')))",
         "message": "engine.args: " + ", ".join(_flags(float)) + ' take a number (quote a fraction: "0.85")'},
        {"rule": f"self.all(k, !(k in {_cel_names(_flags(bool))}) || "
                 "(type(self[k]) == string && self[k] in ['true', 'false']))",
         "message": "engine.args: " + ", ".join(_flags(bool)) + ' are switches: "true" or "false"'},
    ]
    for flag, kind in PASSTHROUGH_FLAGS.items():
        if isinstance(kind, tuple):
            rules.append({"rule": f"!('{flag}' in self) || (type(self['{flag}']) == string && "
                                  f"self['{flag}'] in {_cel_names(kind)})",
                          "message": f"engine.args: {flag} takes one of " + ", ".join(kind)})
    return rules



def check_arg(flag: str, value: object) -> None:
    """Raise ValueError (naming the flag) unless `flag: value` is a valid `engine.args` entry."""
    if flag in OPERATOR_OWNED_FLAGS:
        raise ValueError(f"{flag!r} is set by the operator from {OPERATOR_OWNED_FLAGS[flag]}; set it there")
    if flag not in PASSTHROUGH_FLAGS:
        raise ValueError(f"{flag!r} is not an engine flag; known: {', '.join(PASSTHROUGH_FLAGS)}")
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"{flag!r}: values are integers or strings; quote it: \"{str(value).lower()}\"")
    if isinstance(value, str) and len(value) > MAX_VALUE_LENGTH:
        raise ValueError(f"{flag!r}: a value is at most {MAX_VALUE_LENGTH} characters")
    kind = PASSTHROUGH_FLAGS[flag]
    if isinstance(kind, tuple):
        ok, want = value in kind, "one of " + ", ".join(kind)
    elif kind is bool:
        ok, want = value in ("true", "false"), 'a switch: "true" or "false"'
    elif kind is int:
        ok, want = _is_int(value), "an integer"
    elif kind is float:
        ok, want = _is_number(value), 'a number (quote a fraction: "0.85")'
    else:
        ok, want = True, "a string"
    if not ok:
        raise ValueError(f"{flag!r} takes {want}, not {value!r}")


def render_args(args: dict[str, ArgValue]) -> list[str]:
    """`engine.args` as command-line arguments, in the map's order."""
    out: list[str] = []
    for flag, value in args.items():
        if PASSTHROUGH_FLAGS.get(flag) is bool:
            if value == "true":
                out.append(f"--{flag}")
            elif flag in NEGATABLE_SWITCHES:
                out.append(f"--no-{flag}")
        else:
            out += [f"--{flag}", str(value)]
    return out
