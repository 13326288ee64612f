"""Gateway API keys per endpoint (off unless --api-keys-file is given). The file, e.g. a mounted Secret,
maps an endpoint key or model name to its keys; `"*"` holds keys valid for every endpoint:

    default/smollm2: [sk-team-a, sk-team-b]
    "*": [sk-admin]

An endpoint that no entry names (and no `"*"` entry) stays open. The file is re-read when it changes, so
rotating a key needs no restart.
"""

from __future__ import annotations

import hmac
import logging
import os

import yaml

log = logging.getLogger("sluice.gateway")
ALL = "*"


def parse_keys(text: str) -> dict[str, list[str]]:
    doc = yaml.safe_load(text) or {}
    if not isinstance(doc, dict):
        raise ValueError("an API keys file maps an endpoint (or model, or \"*\") to a list of keys")
    out: dict[str, list[str]] = {}
    for name, keys in doc.items():
        if isinstance(keys, str):
            keys = [keys]
        if not isinstance(keys, list) or not all(isinstance(k, str) and k for k in keys):
            raise ValueError(f"API keys for {name!r}: expected a list of non-empty strings")
        out[str(name)] = keys
    return out


class ApiKeys:
    def __init__(self, path: str | None):
        self.path = path
        self._keys: dict[str, list[str]] = {}
        self._stamp: tuple[int, int, int] | None = None
        if path:
            self._reload(strict=True)

    def _reload(self, strict: bool = False) -> None:
        assert self.path is not None
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            if strict:
                raise ValueError(f"--api-keys-file {self.path} does not exist") from None
            return  # a Secret mount mid-update; keep the keys we have
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp == self._stamp:
            return
        try:
            with open(self.path) as f:
                keys = parse_keys(f.read())
        except (OSError, ValueError, yaml.YAMLError) as e:
            if strict:
                raise ValueError(f"--api-keys-file {self.path}: {e}") from None
            log.error("API keys file %s: %s; keeping the previous keys", self.path, e)
            return
        self._stamp, self._keys = stamp, keys

    def _valid(self, key: str, model: str) -> list[str] | None:
        """Keys that open this endpoint, or None when it is open."""
        if self.path:
            self._reload()
        names = [n for n in (key, model, ALL) if n in self._keys]
        if not names:
            return None
        return [k for n in names for k in self._keys[n]]

    def is_protected(self, key: str, model: str) -> bool:
        return self._valid(key, model) is not None

    def check(self, key: str, model: str, authorization: str | None) -> str | None:
        """None when the request may pass; else why not (for the 401 message)."""
        valid = self._valid(key, model)
        if valid is None:
            return None
        if not authorization:
            return (f"model '{model}' requires an API key: send it as 'Authorization: Bearer <key>' "
                    "(the OpenAI SDKs send their api_key that way)")
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return "the Authorization header must be 'Bearer <key>'"
        # Compare against every key (no early exit) in constant time per key.
        ok = False
        for k in valid:
            ok |= hmac.compare_digest(k.encode(), token.encode())
        if not ok:
            return f"the API key is not valid for model '{model}'"
        return None
