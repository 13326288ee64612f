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

Tenants (quota.py) name who a key belongs to, for per-tenant limits, usage and cost:

    tenants:
      team-a:
        keys: [sk-a-1, sk-a-2]
        limits: {requestsPerMinute: 600, tokensPerMinute: 200000}   # over all endpoints together
        endpoints:                                                  # optional: the keys open these only
          default/smollm2: {tokensPerMinute: 50000}                 # ... with these limits on each ({}: none)
      team-b:
        keys: [sk-b]                                                # no `endpoints`: every endpoint
    endpointLimits:                                                 # each tenant's default on an endpoint
      default/smollm2: {tokensPerMinute: 100000}

A tenant's keys open its endpoints as `keys` entries do. Tenant names become metric labels: they are
configured here, never taken from a request.

Key material never reaches a log line or an error message: a file that does not parse is reported by
position only (YAML's own messages quote the offending line).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from .quota import ALL_ENDPOINTS, Limits

log = logging.getLogger("sluice.gateway")
ALL = "*"
TENANT_NAME = re.compile(r"^[a-z0-9]([a-z0-9._-]{0,61}[a-z0-9])?$")
NO_TENANT = "none"  # the label of requests no tenant's key carried (open endpoints, keys outside `tenants`)
LIMIT_FIELDS = {"requestsPerMinute": "requests_per_minute", "tokensPerMinute": "tokens_per_minute"}


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    keys: tuple[str, ...]
    limits: Limits = Limits()  # over all endpoints together
    endpoints: dict[str, Limits] | None = None  # endpoint key or model -> limits there; None: every endpoint
    defaults: dict[str, Limits] = field(default_factory=dict)  # the file's endpointLimits

    def scoped_limits(self, endpoint: str, model: str) -> list[tuple[str, Limits]]:
        """(scope, limits) that apply to a request for this endpoint: the tenant's total, then its own limit on
        the endpoint (by key or model name), else the endpoint's default for every tenant."""
        out = [(ALL_ENDPOINTS, self.limits)]
        own = self.endpoints or {}
        here = own.get(endpoint) or own.get(model) or self.defaults.get(endpoint) or self.defaults.get(model)
        if here is not None:
            out.append((endpoint, here))
        return out


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


def _limits(where: str, value: Any) -> Limits:
    if value is None:
        return Limits()
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a map of requestsPerMinute and tokensPerMinute")
    unknown = set(map(str, value)) - set(LIMIT_FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown limits {sorted(unknown)}; expected {sorted(LIMIT_FIELDS)}")
    out = {}
    for name, attr in LIMIT_FIELDS.items():
        n = value.get(name)
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"{where}.{name}: expected an integer >= 1")
        out[attr] = n
    return Limits(**out)


def parse_tenants(doc: dict[str, Any]) -> dict[str, Tenant]:
    """The file's `tenants` (and `endpointLimits`), checked; key material is never quoted."""
    raw, defaults_raw = doc.get("tenants") or {}, doc.get("endpointLimits") or {}
    if not isinstance(raw, dict) or not isinstance(defaults_raw, dict):
        raise ValueError("`tenants` and `endpointLimits` must be maps")
    defaults = {str(ep): _limits(f"endpointLimits.{ep}", v) for ep, v in defaults_raw.items()}
    tenants, owner = {}, {}
    for name, t in raw.items():
        name = str(name)
        if not TENANT_NAME.match(name) or name == NO_TENANT:
            raise ValueError(f"tenant name {name[:64]!r}: lower-case letters, digits, '.', '_' and '-', at most 63, "
                             f"not {NO_TENANT!r} (it is a metric label)")
        if not isinstance(t, dict):
            raise ValueError(f"tenants.{name}: expected a map with `keys`, `limits`, `endpoints`")
        unknown = set(map(str, t)) - {"keys", "limits", "endpoints"}
        if unknown:
            raise ValueError(f"tenants.{name}: unknown entries {sorted(unknown)}; expected keys, limits, endpoints")
        keys = _key_list(f"tenants.{name}", t.get("keys") or [])
        for k in keys:
            if k in owner and owner[k] != name:
                raise ValueError(f"tenants {owner[k]!r} and {name!r} share a key: a key belongs to one tenant")
            owner[k] = name
        endpoints = t.get("endpoints")
        if endpoints is not None and not isinstance(endpoints, dict):
            raise ValueError(f"tenants.{name}.endpoints: expected a map of endpoint (or model) -> limits")
        tenants[name] = Tenant(name, tuple(keys), _limits(f"tenants.{name}.limits", t.get("limits")),
                               None if endpoints is None else {
                                   str(ep): _limits(f"tenants.{name}.endpoints.{ep}", v)
                                   for ep, v in endpoints.items()}, defaults)
    return tenants


def parse_keys(text: str) -> tuple[dict[str, list[str]], set[str], dict[str, Tenant]]:
    """(keys by endpoint/model/"*", the endpoints or models that need no key, tenants by name)."""
    try:
        doc = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        raise ValueError(_yaml_error(e)) from None
    if not isinstance(doc, dict):
        raise ValueError("an API keys file maps `keys` (endpoint, model or \"*\" -> keys), `open` (a list) and "
                         "`tenants`")
    sections = {"keys", "open", "tenants", "endpointLimits"}
    if isinstance(doc.get("keys"), dict) or (doc and set(doc) <= sections and not isinstance(doc.get("keys"), list)):
        unknown = set(doc) - sections
        if unknown:
            raise ValueError(f"unknown top-level entries {sorted(map(str, unknown))}: expected `keys`, `open`, "
                             "`tenants` and `endpointLimits`")
        entries, opened = doc.get("keys") or {}, doc.get("open") or []
        if not isinstance(opened, list) or not all(isinstance(n, str) and n for n in opened):
            raise ValueError("`open` must be a list of endpoint keys or model names")
    else:  # the flat form: every entry is an endpoint's keys
        entries, opened = doc, []
    keys = {str(name): _key_list(str(name), v) for name, v in entries.items()}
    tenants = parse_tenants(doc) if "tenants" in doc or "endpointLimits" in doc else {}
    for t in tenants.values():  # a tenant's keys open its endpoints (all of them without `endpoints`)
        for name in (t.endpoints.keys() if t.endpoints is not None else (ALL,)):
            keys.setdefault(name, [])
            keys[name] = keys[name] + [k for k in t.keys if k not in keys[name]]
    both = set(opened) & {n for n, v in keys.items() if v}
    if both:
        raise ValueError(f"{sorted(both)} listed both under `open` and with keys")
    return keys, set(opened), tenants


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


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
        self._tenants: dict[str, Tenant] = {}
        self._tenant_by_digest: dict[bytes, Tenant] = {}
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
            keys, opened, tenants = parse_keys(text)
        except ValueError as e:
            if strict:
                raise ValueError(f"--api-keys-file {self.path}: {e}") from None
            log.error("API keys file %s: %s; keeping the previous keys", self.path, e)
            return
        self._keys, self._open, self._tenants = keys, opened, tenants
        # Looked up by the key's digest: a dict probe on a hash reveals nothing about the key by its timing.
        self._tenant_by_digest = {_digest(k): t for t in tenants.values() for k in t.keys}
        count = sum(len(v) for v in keys.values())
        log.info("API keys file %s: %d keys for %d entries, %d open, %d tenants", self.path, count, len(keys),
                 len(opened), len(tenants))
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

    @property
    def tenants(self) -> dict[str, Tenant]:
        if self._file is not None:
            self._reload()
        return self._tenants

    def tenant(self, authorization: str | None) -> Tenant | None:
        """The tenant whose key the request carries (call after `check` let it through), else None."""
        if not self._tenant_by_digest:
            return None
        token = bearer(authorization)
        return self._tenant_by_digest.get(_digest(token)) if token else None

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


class SharedToken:
    """A shared token in a file (a mounted Secret, re-read when it changes): the KEDA external scaler's
    (--scaler-token-file), the gateway replicas' peer port's (--peer-token-file). Off when no file is given."""

    def __init__(self, path: str | None, flag: str = "--scaler-token-file"):
        self.flag = flag
        self._file = WatchedFile(path, flag) if path else None
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
                raise ValueError(f"{self.flag} {self._file.path} is empty")
            log.error("%s %s is empty; keeping the previous token", self.flag, self._file.path)
            return
        self._token = token

    def value(self) -> str | None:
        """The token to present to a peer (None: off)."""
        if self._file is None:
            return None
        self._reload()
        return self._token

    def accepts(self, candidates: list[str]) -> bool:
        if self._file is None:
            return True
        self._reload()
        ok = False
        for c in candidates:
            ok |= _same(self._token, c)
        return ok
