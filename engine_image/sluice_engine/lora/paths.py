"""`--lora-root DIR`: the one directory adapters may be loaded from at run time (POST /v1/load_lora_adapter).

Without it, the route would read any directory the server's process can, and its errors ("not a directory",
"no adapter_config.json in ...") would tell a caller which paths exist. So a path is resolved first (symlinks
followed, `..` folded; a relative one is taken under the root) and must be the resolved root or lie under it;
one that does not is refused with the same message whether or not it exists, before anything else reads it. The
server checks it (entrypoints/openai/server.py) and the engine core again where it loads (engine/core_loop.py).

Adapters named at start (--lora-modules, --lora-modules-file, which the operator writes) are the deployer's own
config: they are not held to the root.
"""

from __future__ import annotations

import os


class LoRAPathRefused(ValueError):
    """A run-time load outside --lora-root (or with none set). The message never depends on what is on disk."""

    param = "lora_path"


# One message for every refused path: an existing and a missing one must be told apart by nothing.
OUTSIDE_ROOT = "lora_path must be a directory under the server's --lora-root: run-time loads read only from there"
NO_ROOT = "loading LoRA adapters at run time needs --lora-root (the directory they may be loaded from)"


def resolve_under_root(path: str, root: str | None) -> str:
    """`path` resolved (symlinks followed), if it lies under the resolved `root`; LoRAPathRefused otherwise.

    The caller loads from the path returned, not the one given, so a symlink checked here is not followed again
    to somewhere else. (Someone who may write under the root can still swap a directory between this check and the
    load: the root is the deployer's to keep writable only by whoever places adapters.)"""
    if not root:
        raise LoRAPathRefused(NO_ROOT)
    try:
        base = os.path.realpath(root)
        # os.path.join keeps an absolute path as it is and puts a relative one under the root.
        resolved = os.path.realpath(os.path.join(base, path))
    except (ValueError, OSError):  # a NUL byte, a path too long to resolve: refused like any other
        raise LoRAPathRefused(OUTSIDE_ROOT) from None
    if os.path.commonpath([resolved, base]) != base:
        raise LoRAPathRefused(OUTSIDE_ROOT)
    return resolved
