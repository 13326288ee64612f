"""The wheels that travel to the offline GPU node (benchmarks/gpu_wheels.txt, downloaded by gpu_wheels.sh) are
exactly what the serving path imports beyond the node's image (benchmarks/gpu_image_packages.txt): no missing
one (a ModuleNotFoundError on the GPU, with no network to fix it), no extra one (the image's own, or a package
nothing imports). CPU, no network: a subprocess imports what `sluice serve` loads on a CUDA start, and the
GPU check's own scripts and runner, and records which package imported which.

The venv's versions of the carried packages may differ from the pins (fastapi 0.136+ imports opentelemetry,
pydantic's own pins move): a carried package's imports are required of the list only where the venv holds its
pinned version, and accepted from it either way. gpu_wheels.sh checks the pinned wheels' own requirements.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WHEEL_LIST = ROOT / "benchmarks" / "gpu_wheels.txt"
IMAGE_LIST = ROOT / "benchmarks" / "gpu_image_packages.txt"

# What `sluice serve` imports on a CUDA start: the dispatcher and its flags, serve_cli.run's imports, the engine
# with the Triton attention, layer ops and GEMMs, CUDA graphs and warm-up, structured output with xgrammar (its
# Triton kernel is warmed at start-up on CUDA), tensor parallelism; uvicorn's runtime parts come from
# uvicorn.Config.load() below. Then the GPU check's scripts and its test runner.
SERVING_MODULES = [
    "sluice_engine.entrypoints.cli", "sluice_engine.entrypoints.serve_cli", "uvicorn", "sluice_engine.entrypoints.openai.draining_server",
    "sluice_engine.entrypoints.openai.server", "sluice_engine.engine.async_engine", "sluice_engine.engine.core_process", "sluice_engine.engine.llm_engine", "sluice_engine.worker.model_runner",
    "sluice_engine.attention.triton_paged", "sluice_engine.layer_ops.triton_ops", "sluice_engine.quant.triton_gemm",
    "sluice_engine.models.gpu_quant_loader", "sluice_engine.worker.cuda_graphs", "sluice_engine.worker.warmup",
    "sluice_engine.structured", "xgrammar", "sluice_engine.executor.launcher",
]
CHECK_SCRIPTS = ["random_model", "decode_step", "serve_backends", "attention_kernels", "fused_kernels", "quant_gpu"]
CHECK_MODULES = [*CHECK_SCRIPTS, "pytest"]  # and pytest-xdist, the image's (not in the venv)
# Imported by none of the engine's modules on the serving path: each only where a feature that needs it runs.
NOT_ON_SERVING_PATH = ["platformdirs", "gguf", "transformers", "xgrammar", "matplotlib", "kopf", "aiohttp", "grpc"]

# Runs in a fresh interpreter: records (importer's top-level package, imported top-level package) for every import
# that loads a module, with the probe itself standing for the serving path.
PROBE = r"""
import builtins, importlib, json, sys
sys.path.insert(0, sys.argv[1])
edges = set()

class Recorder:
    def find_spec(self, name, path=None, target=None):
        frame = sys._getframe(1)
        while frame is not None and (frame.f_code.co_filename.startswith("<frozen")
                                     or frame.f_code is recording_import.__code__
                                     or frame.f_globals.get("__name__", "").startswith("importlib")):
            frame = frame.f_back
        importer = frame.f_globals.get("__name__", "") if frame is not None else ""
        edges.add((importer.split(".")[0], name.split(".")[0]))
        return None

def recording_import(name, globals=None, locals=None, fromlist=(), level=0):
    # every import statement, also of a module already loaded (the finder sees only the first)
    if level == 0 and globals is not None:
        edges.add((globals.get("__name__", "").split(".")[0], name.split(".")[0]))
    return real_import(name, globals, locals, fromlist, level)

sys.meta_path.insert(0, Recorder())  # importlib.import_module's imports too
real_import, builtins.__import__ = builtins.__import__, recording_import
for module in json.loads(sys.argv[2]):
    importlib.import_module(module)
import uvicorn
uvicorn.Config(lambda scope, receive, send: None, log_config=None).load()
loaded = {m.split(".")[0] for m in sys.modules}
print(json.dumps(sorted([a, b] for a, b in edges if a != b and b in loaded)))
"""


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def listed(path: Path) -> list[str]:
    return [word for line in path.read_text().splitlines() for word in line.split("#")[0].split()]


def pins() -> dict[str, str]:
    return {norm(name): version for name, version in (pin.split("==") for pin in listed(WHEEL_LIST))}


def image() -> set[str]:
    return {norm(name) for name in listed(IMAGE_LIST)}


def import_edges(modules: list[str]) -> set[tuple[str, str]]:
    out = subprocess.run([sys.executable, "-c", PROBE, str(ROOT / "benchmarks"), json.dumps(modules)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return {(a, b) for a, b in json.loads(out.stdout.splitlines()[-1])}


def reached(edges: set[tuple[str, str]], follow) -> set[str]:
    """The distributions reached from the probe and the project's packages, going on through a distribution's own
    imports only where follow(distribution) says so."""
    by_module = {m: {norm(d) for d in ds} for m, ds in importlib.metadata.packages_distributions().items()}
    own = {"__main__", "sluice_engine", *CHECK_SCRIPTS}
    frontier, seen, dists = list(own), set(own), set()
    while frontier:
        module = frontier.pop()
        if module not in own and not any(follow(d) for d in by_module.get(module, ())):
            continue  # the standard library's, or an image package's: its imports are the image's business
        for importer, imported in edges:
            if importer == module and imported not in seen:
                seen.add(imported)
                dists |= by_module.get(imported, set()) - {"sluice"}
                frontier.append(imported)
    return dists


def test_wheel_list_is_the_serving_path_beyond_the_image():
    pinned, held = pins(), image()
    assert not set(pinned) & held, f"carried though the image has them: {sorted(set(pinned) & held)}"
    edges = import_edges(SERVING_MODULES + CHECK_MODULES)

    def installed(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    required = reached(edges, lambda d: d in pinned and installed(d) == pinned[d]) - held
    accepted = reached(edges, lambda d: d in pinned) - held
    assert not required - set(pinned), f"imported on the serving path, in neither list: {sorted(required - set(pinned))}"
    assert not set(pinned) - accepted, f"listed, imported by nothing on the serving path: {sorted(set(pinned) - accepted)}"


def test_engine_modules_import_no_package_their_serving_path_does_not_use():
    engine_modules = ["sluice_engine.engine.llm_engine", "sluice_engine.worker.model_runner", "sluice_engine.cpu_kernels",
                      "sluice_engine.engine.async_engine", "sluice_engine.entrypoints.openai.server", "sluice_engine.entrypoints.serve_cli"]
    imported = {b for a, b in import_edges(engine_modules)}
    assert not imported & set(NOT_ON_SERVING_PATH), sorted(imported & set(NOT_ON_SERVING_PATH))


def test_wheel_list_and_image_list_parse():
    pinned = pins()
    assert len(pinned) == len(listed(WHEEL_LIST)), "a distribution pinned twice"
    assert all(re.fullmatch(r"[0-9][0-9a-z.+]*", v) for v in pinned.values()), pinned
    assert {"torch", "triton", "tqdm", "typing-extensions"} <= image()
