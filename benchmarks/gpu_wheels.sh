#!/usr/bin/env bash
# The wheels the GPU check needs beyond its node's image, downloaded on a CPU machine with network, to travel with
# the repository to an offline GPU node (benchmarks/gpu_check.sh installs them from .whl/ when it is there):
#
#   bash benchmarks/gpu_wheels.sh [DIR]     # DIR defaults to .whl/ at the repository root (git-ignored)
#
# Downloads exactly the pins of benchmarks/gpu_wheels.txt, for CPython 3.12 manylinux x86-64 whatever this machine
# runs, then checks DIR: one wheel per pinned distribution and nothing else (a second version, or a wheel the list
# does not name, fails: remove it), every wheel's own requirements met by another wheel there or by the image
# (benchmarks/gpu_image_packages.txt), and at most 64 MiB in all. Prints each wheel and the total.
# Uses the `python3` on PATH (PYTHON= to override) for pip and the checks.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR=${1:-$ROOT/.whl}
PY=${PYTHON:-python3}
LIST=$ROOT/benchmarks/gpu_wheels.txt
IMAGE=$ROOT/benchmarks/gpu_image_packages.txt
MAX_BYTES=$((64 * 1024 * 1024))

mapfile -t PINS < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$LIST" | grep -v '^$')
mkdir -p "$DIR"
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: --dest "$DIR" \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    "${PINS[@]}"

"$PY" - "$DIR" "$LIST" "$IMAGE" "$MAX_BYTES" <<'PYEOF'
"""Checks the downloaded folder against the pins and the image; prints each wheel and the total."""
import re
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

try:
    from packaging.requirements import Requirement
except ImportError:  # a bare interpreter: pip's own copy
    from pip._vendor.packaging.requirements import Requirement


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def names(path: str) -> list[str]:
    return [w for line in open(path) for w in line.split("#")[0].split()]


folder, max_bytes = Path(sys.argv[1]), int(sys.argv[4])
pins = dict(pin.split("==") for pin in names(sys.argv[2]))
pins = {norm(k): v for k, v in pins.items()}
image = {norm(n) for n in names(sys.argv[3])}
# The node: CPython 3.12 on Linux x86-64, no extras asked for.
env = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "sys_platform": "linux", "platform_system": "Linux",
       "platform_machine": "x86_64", "os_name": "posix", "extra": ""}

errors: list[str] = []
found: dict[str, list[Path]] = {}
for wheel in sorted(folder.glob("*.whl")):
    found.setdefault(norm(wheel.name.split("-")[0]), []).append(wheel)
for dist, wheels in sorted(found.items()):
    if len(wheels) > 1:
        errors.append(f"{dist}: {len(wheels)} versions ({', '.join(w.name for w in wheels)}): keep one")
    elif dist not in pins:
        errors.append(f"{wheels[0].name}: not in {sys.argv[2]} (remove it)")
    elif wheels[0].name.split("-")[1] != pins[dist]:
        errors.append(f"{wheels[0].name}: the list pins {dist}=={pins[dist]}")
for dist in sorted(set(pins) - set(found)):
    errors.append(f"{dist}=={pins[dist]}: no wheel")
total = 0
for dist, wheels in sorted(found.items()):
    for wheel in wheels:
        size = wheel.stat().st_size
        total += size
        print(f"{size / 2**20:8.2f} MiB  {wheel.name}")
        with zipfile.ZipFile(wheel) as z:
            meta_name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            meta = Parser().parsestr(z.read(meta_name).decode())
        for line in meta.get_all("Requires-Dist") or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate(env):
                continue
            need = norm(req.name)
            if need in image:
                continue  # the image's version is the image's business (it holds one set that works)
            if need not in pins:
                errors.append(f"{wheel.name} requires {req}: neither in the list nor in the image")
            elif not req.specifier.contains(pins[need], prereleases=True):
                errors.append(f"{wheel.name} requires {req}: the list pins {need}=={pins[need]}")
print(f"{total / 2**20:8.2f} MiB  total, {sum(map(len, found.values()))} wheels in {folder} "
      f"(limit {max_bytes / 2**20:.0f} MiB)")
if total > max_bytes:
    errors.append(f"{total / 2**20:.2f} MiB in all: over the {max_bytes / 2**20:.0f} MiB limit")
for e in errors:
    print("FAIL:", e, file=sys.stderr)
sys.exit(1 if errors else 0)
PYEOF
