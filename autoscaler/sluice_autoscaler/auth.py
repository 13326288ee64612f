"""Gateway API keys per endpoint, and the external scaler's shared token. Both are files (mounted Secrets)
re-read when they change, so rotating a key needs no restart.

API keys are off unless --api-keys-file is given. Once it is, every endpoint is closed: a request needs a
key that the file gives for its endpoint (by endpoint key or model name) or for `"*"`. Endpoints that should
stay open are listed under `open` (opt-out, per endpoint):

    keys:
      default/smollm2: [sk-team-a, sk-team-b]
      "*": [sk-admin]
    open: [default/public-demo]

The older flat form (the `keys` map alone at the top level) is read too, with nothing open.

Key material never reaches a log line or an error message: a file that does not parse is reported by
position only (YAML's own messages quote the offending line).
"""

from __future__ import annotations

import hmac
import logging
import os
from typing import Any

import yaml

log = logging.getLogger("sluice.gateway")
ALL = "*"


class WatchedFile:
    """A small file re-read when its stat changes (a Secret mount swaps a symlink: new inode)."""

    def __init__(self, path: str, flag: str):
        self.path, self.flag = path, flag
        self._stamp: tuple[int, int, int] | None = None

    def changed(self, strict: bool = False) -> str | None:
        """The new text when the file changed since the last call, else None."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            if strict:
                raise ValueError(f"{self.flag} {self.path} does not exist") from None
            return None  # a Secret mount mid-update; keep what we have
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if stamp == self._stamp:
            return None
        try:
            with open(self.path) as f:
                text = f.read()
        except OSError as e:
            if strict:
                raise ValueError(f"{self.flag} {self.path}: {e.strerror}") from None
            log.error("%s %s: %s; keeping the previous contents", self.flag, self.path, e.strerror)
            return None
        self._stamp = stamp
        return text


def _yaml_error(e: yaml.YAMLError) -> str:
    """Where a YAML file is broken, without quoting it (the line may hold a key)."""
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(e, "problem", None) or "invalid YAML"
    return f"{problem}{where}"


def _key_list(name: str, keys: Any) -> list[str]:
    if isinstance(keys, str):
        keys = [keys]
    if not isinstance(keys, list) or not all(isinstance(k, str) and k for k in keys):
        raise ValueError(f"API keys for {name!r}: expected a list of non-empty strings")
    return keys


def parse_keys(text: str) -> tuple[dict[str, list[str]], set[str]]:
    """(keys by endpoint/model/"*", the endpoints or models that need no key)."""
    try:
        doc = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ValueError(_yaml_error(e)) from None
    if not isinstance(doc, dict):
        raise ValueError("an API keys file maps `keys` (endpoint, model or \"*\" -> keys) and `open` (a list)")
    if isinstance(doc.get("keys"), dict) or (set(doc) == {"open"} and isinstance(doc["open"], list)):
        unknown = set(doc) - {"keys", "open"}
        if unknown:
            raise ValueError(f"unknown top-level entries {sorted(map(str, unknown))}: expected `keys` and `open`")
        entries, opened = doc.get("keys") or {}, doc.get("open") or []
        if not isinstance(opened, list) or not all(isinstance(n, str) and n for n in opened):
            raise ValueError("`open` must be a list of endpoint keys or model names")
    else:  # the flat form: every entry is an endpoint's keys
        entries, opened = doc, []
    keys = {str(name): _key_list(str(name), v) for name, v in entries.items()}
    both = set(opened) & set(keys)
    if both:
        raise ValueError(f"{sorted(both)} listed both under `open` and with keys")
    return keys, set(opened)


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class ApiKeys:
    def __init__(self, path: str | None):
        self.path = path
        self._keys: dict[str, list[str]] = {}
        self._open: set[str] = set()
        self._file = WatchedFile(path, "--api-keys-file") if path else None
        if path:
            self._reload(strict=True)

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def _reload(self, strict: bool = False) -> None:
        assert self._file is not None
        text = self._file.changed(strict)
        if text is None:
            return
        try:
            keys, opened = parse_keys(text)
        except ValueError as e:
            if strict:
                raise ValueError(f"--api-keys-file {self.path}: {e}") from None
            log.error("API keys file %s: %s; keeping the previous keys", self.path, e)
            return
        self._keys, self._open = keys, opened
        count = sum(len(v) for v in keys.values())
        log.info("API keys file %s: %d keys for %d entries, %d open", self.path, count, len(keys), len(opened))
        if not count and not opened:
            log.warning("API keys file %s holds no key and opens nothing: every endpoint refuses every request",
                        self.path)

    def _valid(self, key: str, model: str) -> list[str] | None:
        """Keys that open this endpoint, or None when it is open (no file, or listed under `open`)."""
        if self._file is None:
            return None
        self._reload()
        if key in self._open or model in self._open:
            return None
        return [k for n in (key, model, ALL) for k in self._keys.get(n, ())]

    def is_protected(self, key: str, model: str) -> bool:
        return self._valid(key, model) is not None

    def precheck(self, authorization: str | None) -> str | None:
        """Before the body is read (the model is in it): None when the request may go on. With nothing open,
        a request must carry a key valid for some endpoint; with an open endpoint anything may go on."""
        if self._file is None:
            return None
        self._reload()
        if self._open:
            return None
        token = bearer(authorization)
        if token is None:
            return ("an API key is required: send it as 'Authorization: Bearer <key>' "
                    "(the OpenAI SDKs send their api_key that way)")
        ok = False
        for keys in self._keys.values():
            for k in keys:  # every key, no early exit; constant time per comparison
                ok |= _same(k, token)
        return None if ok else "the API key is not valid"

    def check(self, key: str, model: str, authorization: str | None) -> str | None:
        """None when the request may pass; else why not (for the 401 message)."""
        valid = self._valid(key, model)
        if valid is None:
            return None
        if not authorization:
            return (f"model '{model}' requires an API key: send it as 'Authorization: Bearer <key>' "
                    "(the OpenAI SDKs send their api_key that way)")
        token = bearer(authorization)
        if token is None:
            return "the Authorization header must be 'Bearer <key>'"
        ok = False
        for k in valid:
            ok |= _same(k, token)
        if not ok:
            return f"the API key is not valid for model '{model}'"
        return None


class ScalerToken:
    """The shared token of the KEDA external scaler (--scaler-token-file): off when no file is given."""

    def __init__(self, path: str | None):
        self._file = WatchedFile(path, "--scaler-token-file") if path else None
        self._token = ""
        if self._file is not None:
            self._reload(strict=True)

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def _reload(self, strict: bool = False) -> None:
        assert self._file is not None
        text = self._file.changed(strict)
        if text is None:
            return
        token = text.strip()
        if not token:
            if strict:
                raise ValueError(f"--scaler-token-file {self._file.path} is empty")
            log.error("--scaler-token-file %s is empty; keeping the previous token", self._file.path)
            return
        self._token = token

    def accepts(self, candidates: list[str]) -> bool:
        if self._file is None:
            return True
        self._reload()
        ok = False
        for c in candidates:
            ok |= _same(self._token, c)
        return ok
