"""An endpoint's KV key (`--kv-secret-file`) and what is derived from it (docs/security.md, "KV transfer").

Every engine of a disaggregated endpoint (its prefill and decode pools) holds the same key: the operator makes one
Secret per endpoint and mounts it into both. From it come, each under its own label so that none reveals another:
- the transfer key: each KV connection's AEAD key is derived from it and both sides' fresh nonces (channel.py);
- the block-name root: the parent of every prompt's first block name, so names (a hash chain over token ids) cannot
  be computed, or matched against a guessed prompt, without the key;
- the hop key: a decode engine's prefill hop proves with it that `kv_transfer_params.push_to` names the endpoint's
  own receiver (hop_token / check_hop_token); a client without the key cannot make an engine connect anywhere.

Stdlib only (hmac, hashlib): the API process checks hop tokens without importing torch or a crypto library.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass
from pathlib import Path

MIN_SECRET_BYTES = 32
MAX_SECRET_BYTES = 4096
HOP_TOKEN_TTL_S = 300  # a hop token older (or newer) than this is refused: a sniffed one does not last
_VERSION = "v1"


def hkdf(secret: bytes, info: bytes, salt: bytes = b"", length: int = 32) -> bytes:
    """HKDF-SHA256 (RFC 5869), extract then expand."""
    prk = hmac.new(salt or b"\0" * 32, secret, hashlib.sha256).digest()
    out, block, counter = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes([counter]), hashlib.sha256).digest()
        out += block
        counter += 1
    return out[:length]


@dataclass(frozen=True, slots=True)
class KVKey:
    secret: bytes

    @classmethod
    def from_file(cls, path: str | Path) -> KVKey:
        """The key in `path` (a Secret's file: its bytes, a trailing newline dropped). ValueError naming the flag
        when it cannot be read or is too short to be a key."""
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_SECRET_BYTES + 2)
        except OSError as e:
            raise ValueError(f"--kv-secret-file {path}: cannot read it ({e.strerror or e})") from None
        raw = raw.rstrip(b"\r\n")
        if len(raw) > MAX_SECRET_BYTES:
            raise ValueError(f"--kv-secret-file {path}: longer than {MAX_SECRET_BYTES} bytes; is it the key?")
        if len(raw) < MIN_SECRET_BYTES:
            raise ValueError(f"--kv-secret-file {path}: {len(raw)} bytes; a KV key needs at least "
                             f"{MIN_SECRET_BYTES} (e.g. `openssl rand -hex 32`)")
        return cls(raw)

    def transfer_key(self, salt: bytes) -> bytes:
        """A connection's AEAD key: `salt` is both sides' nonces, so each connection has its own."""
        return hkdf(self.secret, b"sluice kv transfer " + _VERSION.encode(), salt)

    def names_root(self) -> int:
        """The parent of a prompt's first block name (core/kv_cache.py hash_block), a signed 64-bit int."""
        return int.from_bytes(hkdf(self.secret, b"sluice kv block names", length=8), "little", signed=True)

    def _hop_mac(self, push_to: str, issued: int) -> str:
        msg = f"{_VERSION}\0{issued}\0{push_to}".encode()
        return hmac.new(hkdf(self.secret, b"sluice kv hop"), msg, hashlib.sha256).hexdigest()

    def hop_token(self, push_to: str, now: float | None = None) -> str:
        """What a decode engine's hop sends beside `push_to`: proof that the endpoint's key holder names it."""
        issued = int(time.time() if now is None else now)
        return f"{_VERSION}.{issued}.{self._hop_mac(push_to, issued)}"

    def check_hop_token(self, push_to: str, token: str | None, now: float | None = None) -> bool:
        """True when `token` was made with this key for exactly `push_to`, within HOP_TOKEN_TTL_S of now."""
        if not token:
            return False
        parts = token.split(".")
        if len(parts) != 3 or parts[0] != _VERSION or not parts[1].isdigit() or len(parts[1]) > 12:
            return False
        issued = int(parts[1])
        if abs((time.time() if now is None else now) - issued) > HOP_TOKEN_TTL_S:
            return False
        return hmac.compare_digest(parts[2], self._hop_mac(push_to, issued))


def load_key(path: str | None) -> KVKey | None:
    return None if path is None else KVKey.from_file(path)
