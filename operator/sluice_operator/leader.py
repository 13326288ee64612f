"""Leader election on a coordination.k8s.io/v1 Lease, the way client-go's leaderelection package does it.

Several operator replicas may run (a rollout, a node drain, replicas: 2 for a quick takeover); only the
one holding the Lease reconciles. The holder renews the Lease every `renew_s`; a candidate takes it once
the record has not changed for `lease_s` by its own clock (never by comparing the holder's timestamps with
its own: clocks of two nodes differ). Every write is a merge patch guarded by the Lease's resourceVersion, so
when two candidates race, the API server lets exactly one win (the other gets 409 Conflict).

A holder that cannot renew for `renew_deadline_s` gives up leadership and the process exits non-zero, so
Kubernetes restarts it as a candidate: two replicas must never both believe they lead. The margin between
renew_deadline_s and lease_s is what keeps the old leader's last pass from overlapping the new one's.
A holder that stops cleanly releases the Lease (holder cleared), so its successor takes over at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from .apply import ApiError, Kind, KubeApi

LEASE_KIND = Kind("coordination.k8s.io/v1", "Lease", "leases")
log = logging.getLogger("sluice.leader")


def _micro_time() -> str:
    # MicroTime: RFC 3339 with microseconds.
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class LeaseElector:
    api: Callable[[], AbstractAsyncContextManager[KubeApi]]  # a fresh client session per attempt
    namespace: str
    name: str
    identity: str
    lease_s: float = 15.0
    renew_deadline_s: float = 10.0
    renew_s: float = 2.0
    on_change: Callable[[bool], None] | None = None  # called with True on gaining, False on losing the lead

    def __post_init__(self) -> None:
        if not self.renew_s < self.renew_deadline_s < self.lease_s:
            raise ValueError("leader election needs renew < renew deadline < lease duration")
        self.is_leader = False
        self._observed: tuple[str, str] | None = None  # (holder, renewTime) last seen
        self._observed_at = 0.0  # time.monotonic() it was first seen

    # -- one attempt ---------------------------------------------------------------------------------
    async def try_acquire_or_renew(self) -> bool:
        """One attempt; True if this identity holds the Lease afterwards."""
        async with self.api() as api:
            lease = await api.get(LEASE_KIND, self.namespace, self.name)
            now = _micro_time()
            if lease is None:
                try:
                    await api.create(LEASE_KIND, self._lease(None, now, transitions=0))
                except ApiError as e:
                    if e.status == 409:  # another candidate created it first
                        return False
                    raise
                return True
            spec = lease.get("spec") or {}
            holder = spec.get("holderIdentity") or ""
            record = (holder, spec.get("renewTime") or "")
            if record != self._observed:
                self._observed, self._observed_at = record, time.monotonic()
            duration = float(spec.get("leaseDurationSeconds") or self.lease_s)
            expired = time.monotonic() - self._observed_at >= duration
            if holder and holder != self.identity and not expired:
                return False
            transitions = int(spec.get("leaseTransitions") or 0) + (holder != self.identity)
            body = self._lease(lease, now, transitions,
                               acquired=spec.get("acquireTime") if holder == self.identity else now)
            try:
                await api.patch_if_unchanged(LEASE_KIND, self.namespace, self.name, body)
            except ApiError as e:
                if e.status == 409:  # someone else wrote it since we read it
                    return False
                raise
            return True

    def _lease(self, current: dict[str, Any] | None, now: str, transitions: int,
               acquired: str | None = None) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if current is not None:
            meta["resourceVersion"] = current["metadata"]["resourceVersion"]
        return {"apiVersion": LEASE_KIND.api_version, "kind": LEASE_KIND.kind, "metadata": meta, "spec": {
            "holderIdentity": self.identity, "leaseDurationSeconds": int(self.lease_s),
            "acquireTime": acquired or now, "renewTime": now, "leaseTransitions": transitions}}

    # -- the lifecycle ---------------------------------------------------------------------------------
    async def acquire(self) -> None:
        """Block until this identity holds the Lease."""
        announced = False
        while True:
            try:
                if await self.try_acquire_or_renew():
                    self._set_leader(True)
                    return
            except Exception as e:  # noqa: BLE001 - the API server is unreachable: keep trying
                log.warning("leader election: %s", e)
            if not announced:
                log.info("waiting for leadership: Lease %s/%s is held by %r", self.namespace, self.name,
                         self._observed[0] if self._observed else None)
                announced = True
            await asyncio.sleep(self.renew_s)

    async def hold(self) -> None:
        """Renew until a renewal has not succeeded for renew_deadline_s; then the lead is lost and this
        returns (the caller stops reconciling and exits)."""
        last_ok = time.monotonic()
        while True:
            await asyncio.sleep(self.renew_s)
            try:
                ok = await asyncio.wait_for(self.try_acquire_or_renew(), self.renew_deadline_s)
            except Exception as e:  # noqa: BLE001 - counted against the deadline below
                log.warning("renewing the Lease failed: %s", e)
                ok = False
            if ok:
                last_ok = time.monotonic()
            elif time.monotonic() - last_ok >= self.renew_deadline_s:
                log.error("lost leadership: the Lease was not renewed for %.0f s", self.renew_deadline_s)
                self._set_leader(False)
                return

    async def release(self) -> None:
        """Clear the holder so a successor need not wait out the lease (best effort)."""
        if not self.is_leader:
            return
        self._set_leader(False)
        try:
            async with self.api() as api:
                lease = await api.get(LEASE_KIND, self.namespace, self.name)
                if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
                    return
                lease["spec"].update(holderIdentity=None, leaseDurationSeconds=1, renewTime=_micro_time())
                await api.patch_if_unchanged(LEASE_KIND, self.namespace, self.name, lease)
        except Exception as e:  # noqa: BLE001 - the successor waits out the lease instead
            log.warning("could not release the Lease: %s", e)

    def _set_leader(self, leading: bool) -> None:
        if leading != self.is_leader:
            log.info("%s leadership (Lease %s/%s, identity %s)", "acquired" if leading else "gave up",
                     self.namespace, self.name, self.identity)
        self.is_leader = leading
        if self.on_change is not None:
            self.on_change(leading)
