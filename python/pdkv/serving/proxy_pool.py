"""The proxy's view of its workers: one :class:`PoolWorker` per worker URL, grouped
by role into :class:`WorkerPool` s that pick the least-loaded usable worker, and the
two ways a call to a worker fails (:class:`WorkerFailed`, :class:`WorkerBusy`)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from .protocol import WorkerInfo

__all__ = ["PoolWorker", "WorkerBusy", "WorkerFailed", "WorkerPool"]

log = logging.getLogger("pdkv.serving")


class WorkerFailed(Exception):
    """A worker could not be reached or broke its stream."""

    def __init__(self, worker: "PoolWorker", message: str, *, before_response: bool = False) -> None:
        super().__init__(message)
        self.worker = worker
        self.before_response = before_response


class WorkerBusy(Exception):
    """A worker answered 503 (e.g. its KV pool is full): try another, keep it in rotation."""


@dataclass
class PoolWorker:
    """One worker as the proxy sees it: what it serves, its load and whether it is in rotation."""

    url: str
    role: str                      # "prefill" or "decode" (engine workers in colocated mode)
    info: WorkerInfo | None = None
    error: str = ""                # why it is excluded (incompatible) or last failure
    compatible: bool = True
    in_flight: int = 0
    load_tokens: int = 0           # prefill: prompt tokens waiting for their first token
    down_until: float = 0.0
    alive: bool = True             # answered its last liveness probe
    alive_at: float = 0.0          # when it last answered one (monotonic)
    probe: "asyncio.Task[bool] | None" = None  # the liveness probe in flight
    served: int = 0
    stats: dict[str, Any] = field(default_factory=dict)
    registered_as: str = ""        # its id in the registry ('' when configured by URL)
    switching: bool = False        # being re-roled: out of rotation until it is in its new pool
    misconfigured: str = ""        # why it cannot serve its pool's routes (401 to our signature, wrong role)

    def usable(self, now: float) -> bool:
        return self.info is not None and self.compatible and self.alive and now >= self.down_until \
            and not self.switching

    def refused(self, status: int, what: str) -> None:
        """Records that this worker answered 401/403 to a signed call: it does not accept
        the proxy's secret (or has none), so it cannot serve; ``/health`` lists it."""
        why = (f"{what} answered HTTP {status} to the proxy's signed call: the worker does not accept the "
               "proxy's cluster secret (PDKV_SECRET differs, or the worker has none)")
        if self.misconfigured != why:
            log.error("%s worker %s: %s", self.role, self.url, why)
        self.misconfigured = why


class WorkerPool:
    """Workers of one role and the least-loaded choice among them."""

    def __init__(self, role: str, urls: Sequence[str]) -> None:
        self.role = role
        self.workers = [PoolWorker(u, role) for u in urls]
        self._rr = 0

    def pick(self, exclude: set[str]) -> PoolWorker | None:
        now = time.monotonic()
        cands = [w for w in self.workers if w.usable(now) and w.url not in exclude]
        if not cands:
            return None
        self._rr += 1
        n = len(self.workers)
        order = {w.url: (i - self._rr) % n for i, w in enumerate(self.workers)}
        key = (lambda w: (w.load_tokens, w.in_flight, order[w.url])) if self.role == "prefill" else \
            (lambda w: (w.in_flight, order[w.url]))
        return min(cands, key=key)

    def any_up(self) -> bool:
        now = time.monotonic()
        return any(w.usable(now) for w in self.workers)

    def add(self, url: str, registered_as: str) -> bool:
        """Puts a registered worker into rotation (False if it already is). A worker
        restarted at the same URL registers under a new id: the URL follows the newest
        id, so the old id's expiry later removes nothing. Configured URLs stay as they are."""
        for w in self.workers:
            if w.url == url:
                if w.registered_as and w.registered_as != registered_as:
                    w.registered_as = registered_as
                    w.info = None  # a new process: fetch its /pd/info again
                return False
        self.workers = self.workers + [PoolWorker(url, self.role, registered_as=registered_as)]
        return True

    def remove_url(self, url: str) -> None:
        self.workers = [w for w in self.workers if w.url != url]

    def remove(self, registered_as: str) -> list[PoolWorker]:
        """Takes a registered worker out of rotation; requests running there finish."""
        gone = [w for w in self.workers if w.registered_as == registered_as]
        if gone:
            self.workers = [w for w in self.workers if w.registered_as != registered_as]
        return gone

