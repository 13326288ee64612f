"""LoRA adapters (spec.adapters) in the engine pods: where each one lands, the files the engine and the fetch
sidecars re-read, and those sidecars.

NOTE(design, issue 26): adding an adapter to a live endpoint must load it on the running pods, and removing one
unload it, without a rollout. So nothing about one adapter is in the pod template; it is all in the ConfigMap:
- The engines run `--enable-lora --lora-modules-file /etc/sluice/adapters.json`. adapters.json (name -> the
  adapter's directory in the pod) is a key of the endpoint's ConfigMap, mounted as a directory (never subPath),
  so the kubelet swaps the file in place when the ConfigMap changes (usually within a minute or two). The engine
  polls it, loads an adapter once its directory holds adapter_config.json and adapter_model.safetensors, and
  unloads one the file stops listing (requests already on it finish). The config hash that rolls pods leaves
  these keys out (reconcile.py), as it leaves out objectives.json.
- hf:// and s3:// adapters are fetched while the pod runs, by two native sidecars (init containers with
  restartPolicy Always: they start before the model's fetch, so adapters download beside the model, and live
  as long as the pod): `fetch-adapters` (the engine image, huggingface_hub, its script from the ConfigMap) and
  `fetch-adapters-s3` (the S3 fetch image, `aws s3 sync`). Each polls its own list in the ConfigMap, with
  model.credentialsSecretRef as its environment, as the model's fetch container has (the engine never sees
  it). An adapter is downloaded into a staging directory of this pod, marked complete and renamed into place:
  the engine never sees half an adapter, and pods sharing a pvc or hostPath cache never write into one
  directory. Both sidecars run whenever LoRA is on, whatever the sources, so the first s3:// adapter rolls
  nothing either. A failed fetch is logged and retried; it never stops the pod.
- Where: the model cache's `adapters/` (`hf/<org>/<name>/<revision>`, `s3/<bucket>/<prefix>`), reused like the
  model by every pod on that cache. A shared cache is read-only in serving pods (its Job alone writes it), so
  there adapters go to the pod's scratch directory instead (/tmp/sluice-cache/adapters), fetched by each pod:
  adapters are small. Files of removed adapters stay in the cache.
- pvc:// adapters are read where they are: on the model's own claim (/models/<path>) or a pvc cache's claim
  (/models-cache/<path>), which the pods mount already. Another claim needs a volume (adapter-<hash>, read-only
  at /adapter-claims/<claim>), i.e. a template change: the first adapter on a new claim, and the last one removed
  from it, roll the pods once (docs/operator.md).
- --enable-lora (LoRA slots: device memory, and a low-rank pass over every row of a decode graph) is a flag: it is on while spec.adapters is not empty, or kept on by
  engine.args enable-lora "true". Only with it kept on do the first adapter added and the last removed change
  nothing but the ConfigMap.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from . import model_cache
from .config import OperatorConfig
from .model_cache import CACHE_DIR, COMPLETE_MARKER
from .model_source import CONFIG_DIR, PVC_MODEL_DIR, SCRATCH_CACHE_DIR, credentials_env_from
from .spec import OPERATOR_VOLUME_PREFIX, Adapter, InferenceEndpoint, lora_enabled

ADAPTERS_KEY = "adapters.json"  # the engine's --lora-modules-file
ADAPTERS_PATH = f"{CONFIG_DIR}/{ADAPTERS_KEY}"
FETCH_LIST_KEY = "adapter-fetch.json"  # hf:// adapters, for fetch-adapters
FETCH_S3_LIST_KEY = "adapter-fetch-s3.tsv"  # s3:// adapters, for fetch-adapters-s3: name, dir, uri per line
FETCH_SCRIPT_KEY = "fetch-adapters.py"
# Re-read while the pods run: edits to them must not roll pods (they are left out of the config hash).
LIVE_KEYS = (ADAPTERS_KEY, FETCH_LIST_KEY, FETCH_S3_LIST_KEY)
FETCH_ADAPTERS_CONTAINER = "fetch-adapters"
FETCH_ADAPTERS_S3_CONTAINER = "fetch-adapters-s3"
CLAIMS_DIR = "/adapter-claims"  # pvc:// adapters on a claim mounted for nothing else: /adapter-claims/<claim>
VOLUME_PREFIX = OPERATOR_VOLUME_PREFIX  # their volumes: adapter-<hash of the claim> (pod.volumes may not)
POLL_PERIOD_S = 5
RETRY_S = 60

# Run by the engine image's Python from the endpoint's ConfigMap, for the pod's whole life.
FETCH_ADAPTERS_SCRIPT = f'''\
"""Fetch the endpoint's hf:// LoRA adapters into the cache while the pod runs (the fetch-adapters sidecar).

Polls the list the operator keeps in the endpoint's ConfigMap. An adapter not complete yet is downloaded into a
staging directory of this pod, marked complete, and renamed into place: the engine, which loads an adapter once
its files are there, never reads half of one. A failed download is retried later; nothing here stops the pod.
"""
import json
import os
import shutil
import socket
import time
from pathlib import Path

MARKER = "{COMPLETE_MARKER}"
POLL_S, RETRY_S = {POLL_PERIOD_S}, {RETRY_S}


def wanted(path):
    try:
        return json.loads(Path(path).read_text()).get("adapters") or []
    except (OSError, ValueError) as e:
        print(f"cannot read {{path}}: {{e}}", flush=True)
        return []


def fetch(adapter):
    """Whether it downloaded the adapter (False: it was complete already)."""
    final = Path(adapter["dir"])
    if (final / MARKER).is_file():
        return False
    from huggingface_hub import snapshot_download

    staging = final.with_name(f"{{final.name}}.partial-{{socket.gethostname()}}")
    snapshot_download(adapter["repo"], revision=adapter["revision"] or None, local_dir=staging)
    if not (staging / "adapter_config.json").is_file():
        raise RuntimeError("the repository has no adapter_config.json: not a PEFT adapter")
    (staging / MARKER).write_text(json.dumps({{"source": adapter["repo"], "revision": adapter["revision"]}}) + "\\n")
    try:
        staging.rename(final)
    except OSError:
        if not (final / MARKER).is_file():
            raise
        shutil.rmtree(staging, ignore_errors=True)  # another pod on this cache was first
    return True


def main():
    retry_at = {{}}
    while True:
        for adapter in wanted(os.environ["SLUICE_ADAPTER_LIST"]):
            key = (adapter["repo"], adapter["revision"], adapter["dir"])
            if time.monotonic() < retry_at.get(key, 0):
                continue
            try:
                if fetch(adapter):
                    print(f"adapter {{adapter['name']}} ready in {{adapter['dir']}}", flush=True)
            except Exception as e:  # network, Hub rate limits, a missing repository: tried again later
                retry_at[key] = time.monotonic() + RETRY_S
                print(f"adapter {{adapter['name']}}: hf://{{adapter['repo']}} failed ({{e}}); retrying in "
                      f"{{RETRY_S}} s", flush=True)
        time.sleep(POLL_S)


if __name__ == "__main__":
    main()
'''

# The same for s3:// in the S3 fetch image's shell ($0: the list). `read` gives the uri the rest of the line, so
# a uri may hold anything; the name and the directory hold no tab. After a pass with a failure it waits longer.
FETCH_ADAPTERS_S3_SCRIPT = f'''\
tab="$(printf '\\t')"; host="$(cat /etc/hostname)"
while :; do
  wait_s={POLL_PERIOD_S}
  if [ -f "$0" ]; then
    while IFS="$tab" read -r name dir uri; do
      [ -n "$uri" ] || continue
      [ -f "$dir/{COMPLETE_MARKER}" ] && continue
      staging="$dir.partial-$host"
      if aws s3 sync --only-show-errors "$uri" "$staging" </dev/null && [ -f "$staging/adapter_config.json" ]; then
        echo "$uri" > "$staging/{COMPLETE_MARKER}"
        if mv -T "$staging" "$dir" 2>/dev/null || [ -f "$dir/{COMPLETE_MARKER}" ]; then
          rm -rf "$staging"; echo "adapter $name ready in $dir"; continue
        fi
      fi
      echo "adapter $name: $uri failed (or holds no adapter_config.json); retrying in {RETRY_S} s"; wait_s={RETRY_S}
    done < "$0"
  fi
  sleep "$wait_s"
done
'''


def _segments(location: str) -> str:
    """A uri's location as a relative directory: no empty, '.' or '..' segment, and no whitespace (the s3 list is
    tab-separated). Only the local directory is so cleaned; the fetch uses the uri as written."""
    parts = ("".join("_" if c.isspace() else c for c in p) for p in location.split("/"))
    return "/".join(p for p in parts if p not in ("", ".", ".."))


def adapters_root(ep: InferenceEndpoint) -> str:
    """Where fetched adapters land: the model cache, or the pod's scratch when the cache is read-only (shared)."""
    return f"{SCRATCH_CACHE_DIR if model_cache.uses_shared_cache(ep) else CACHE_DIR}/adapters"


def _pvc_dir(ep: InferenceEndpoint, claim: str) -> str:
    """Where a claim holding pvc:// adapters is mounted in the engine container."""
    model, cache = ep.spec.model, ep.spec.model.cache
    if model.scheme == "pvc" and model.location.partition("/")[0] == claim:
        return PVC_MODEL_DIR
    if cache.type == "pvc" and cache.claim_name == claim:
        return CACHE_DIR
    return f"{CLAIMS_DIR}/{claim}"


def adapter_dir(ep: InferenceEndpoint, adapter: Adapter) -> str:
    """The adapter's directory in the pod, as the engine's adapters.json names it."""
    if adapter.scheme == "pvc":
        claim, _, path = adapter.location.partition("/")
        return f"{_pvc_dir(ep, claim)}/{path}"
    if adapter.scheme == "hf":
        return f"{adapters_root(ep)}/hf/{_segments(adapter.location)}/{_segments(adapter.revision or 'main')}"
    return f"{adapters_root(ep)}/s3/{_segments(adapter.location)}"


def extra_claims(ep: InferenceEndpoint) -> list[str]:
    """Claims of pvc:// adapters that the pods mount for nothing else."""
    claims = {a.location.partition("/")[0] for a in ep.spec.adapters if a.scheme == "pvc"}
    return sorted(c for c in claims if _pvc_dir(ep, c) == f"{CLAIMS_DIR}/{c}")


def claim_volume(claim: str) -> str:
    # A volume name is a DNS label (<= 63); a claim name may be a 253-character subdomain.
    return VOLUME_PREFIX + hashlib.sha256(claim.encode()).hexdigest()[:12]


def claim_volumes(ep: InferenceEndpoint) -> list[dict[str, Any]]:
    return [{"name": claim_volume(c), "persistentVolumeClaim": {"claimName": c, "readOnly": True}}
            for c in extra_claims(ep)]


def claim_mounts(ep: InferenceEndpoint) -> list[dict[str, Any]]:
    return [{"name": claim_volume(c), "mountPath": f"{CLAIMS_DIR}/{c}", "readOnly": True} for c in extra_claims(ep)]


# -- the ConfigMap's keys --------------------------------------------------------------------------------------
def engine_file(ep: InferenceEndpoint) -> str:
    """spec.adapters as the engine's --lora-modules-file."""
    return json.dumps({"adapters": [{"name": a.name, "path": adapter_dir(ep, a)} for a in ep.spec.adapters]},
                      indent=1)


def fetch_list(ep: InferenceEndpoint) -> str:
    """The hf:// adapters, for fetch-adapters."""
    return json.dumps({"adapters": [
        {"name": a.name, "repo": a.location, "revision": a.revision or "", "dir": adapter_dir(ep, a)}
        for a in ep.spec.adapters if a.scheme == "hf"]}, indent=1)


def fetch_s3_list(ep: InferenceEndpoint) -> str:
    """The s3:// adapters, for fetch-adapters-s3: `name<TAB>dir<TAB>uri` per line."""
    return "".join(f"{a.name}\t{adapter_dir(ep, a)}\t{a.source}\n" for a in ep.spec.adapters if a.scheme == "s3")


def config_data(ep: InferenceEndpoint) -> dict[str, str]:
    """The ConfigMap's adapter keys; none while LoRA is off."""
    if not lora_enabled(ep.spec):
        return {}
    return {ADAPTERS_KEY: engine_file(ep), FETCH_LIST_KEY: fetch_list(ep), FETCH_S3_LIST_KEY: fetch_s3_list(ep),
            FETCH_SCRIPT_KEY: FETCH_ADAPTERS_SCRIPT}


def config_items(ep: InferenceEndpoint) -> list[dict[str, str]]:
    """The keys the pods mount (every container that mounts the config volume sees them)."""
    return [{"key": k, "path": k} for k in config_data(ep)]


# -- the pods' side --------------------------------------------------------------------------------------------
def sidecars(ep: InferenceEndpoint, cfg: OperatorConfig, security: dict[str, Any]) -> list[dict[str, Any]]:
    """The two fetch sidecars (native: init containers that keep running), while LoRA is on."""
    if not lora_enabled(ep.spec):
        return []
    # Their own /tmp (HOME, HF_HOME), not the engine's (model_cache.FETCH_HOME_MOUNT). With a shared cache the
    # adapters land in the engine's scratch directory: only that directory of the engine's /tmp is mounted.
    mounts = [model_cache.cache_mount(ep), dict(model_cache.FETCH_HOME_MOUNT),
              {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}]
    if model_cache.uses_shared_cache(ep):
        mounts.insert(2, {"name": "tmp", "mountPath": SCRATCH_CACHE_DIR,
                          "subPath": SCRATCH_CACHE_DIR.removeprefix("/tmp/")})
    hf: dict[str, Any] = {
        "name": FETCH_ADAPTERS_CONTAINER,
        "image": ep.spec.engine.image or cfg.engine_image,
        "restartPolicy": "Always",
        "command": ["python", f"{CONFIG_DIR}/{FETCH_SCRIPT_KEY}"],
        "env": [{"name": "SLUICE_ADAPTER_LIST", "value": f"{CONFIG_DIR}/{FETCH_LIST_KEY}"},
                {"name": "HF_HOME", "value": "/tmp/huggingface"},
                {"name": "HOME", "value": "/tmp"}],
        "volumeMounts": mounts,
    }
    s3: dict[str, Any] = {
        "name": FETCH_ADAPTERS_S3_CONTAINER,
        "image": cfg.s3_fetch_image,
        "restartPolicy": "Always",
        "command": ["sh", "-c", FETCH_ADAPTERS_S3_SCRIPT, f"{CONFIG_DIR}/{FETCH_S3_LIST_KEY}"],
        "env": [{"name": "HOME", "value": "/tmp"}],
        "volumeMounts": [dict(m) for m in mounts],
    }
    out = [hf, s3]
    for c in out:
        if ep.spec.model.credentials_secret_ref:
            c["envFrom"] = credentials_env_from(ep)
        c["securityContext"] = security
    return out
