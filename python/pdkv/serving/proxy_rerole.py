"""Role changes: the proxy's side of :mod:`pdkv.serving.rerole` -- each
``interval_s`` it compares the measured prefill and decode demand with the pools and
moves at most one idle worker from one pool to the other (drained, ``POST
/pd/role``, then put into its new pool)."""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from .metrics import Counter
from .proxy_client import WorkerClient
from .proxy_pool import WorkerPool
from .rerole import DemandWindow, RerolePolicy, decide

__all__ = ["Reroler"]

log = logging.getLogger("pdkv.serving")


class Reroler:
    """Moves workers between the prefill and decode pools as demand moves.

    Parameters
    ----------
    policy : RerolePolicy
    demand : DemandWindow
        Filled by the router with the prompt tokens and decoded tokens it serves.
    prefill, decode : WorkerPool
    client : WorkerClient
    reroles : Counter
        ``pdkv_worker_reroles_total`` (from, to, result).
    """

    def __init__(self, policy: RerolePolicy, demand: DemandWindow, prefill: WorkerPool, decode: WorkerPool,
                 client: WorkerClient, reroles: Counter) -> None:
        self.policy = policy
        self._demand = demand
        self.prefill = prefill
        self.decode = decode
        self._client = client
        self.m_reroles = reroles

    async def run(self) -> None:
        """Re-roles every ``interval_s`` (until cancelled)."""
        policy = self.policy
        while True:
            await asyncio.sleep(policy.interval_s)
            try:
                await self.rerole_once()
            except Exception:  # noqa: BLE001 - a failed round must not end the re-roling
                log.exception("re-roling")

    async def rerole_once(self) -> str | None:
        """One round of :mod:`pdkv.serving.rerole`: moves at most one worker; returns
        the role it moved to (None: nothing moved)."""
        policy = self.policy
        need_p, need_d, requests = self._demand.needs()
        if requests < policy.min_requests:
            return None
        now = time.monotonic()
        n_p = sum(w.usable(now) for w in self.prefill.workers)
        n_d = sum(w.usable(now) for w in self.decode.workers)
        to = decide(need_p, need_d, n_p, n_d, policy.hysteresis)
        if to is None:
            return None
        src, dst = (self.decode, self.prefill) if to == "prefill" else (self.prefill, self.decode)
        log.info("measured need %.2f prefill : %.2f decode workers over %.0f s; have %d:%d: moving one %s worker "
                 "to %s", need_p, need_d, policy.window_s, n_p, n_d, src.role, to)
        return to if await self._rerole(src, dst) else None

    async def _rerole(self, src: WorkerPool, dst: WorkerPool) -> bool:
        """Drains the least-loaded worker of ``src`` (out of rotation, its requests
        finish), switches its role (``POST /pd/role``) and puts it into ``dst``."""
        policy = self.policy
        now = time.monotonic()
        cands = [w for w in src.workers if w.usable(now)]
        if len(cands) < 2:
            return False
        w = min(cands, key=lambda x: (x.in_flight, x.load_tokens))
        w.switching = True
        ok = False
        try:
            end = time.monotonic() + policy.drain_timeout_s
            while w.in_flight > 0 and time.monotonic() < end:
                await asyncio.sleep(0.05)
            left = max(end - time.monotonic(), 1.0)
            try:
                async with self._client.post(w.url + "/pd/role", {"role": dst.role, "timeout": left},
                                             timeout=aiohttp.ClientTimeout(total=left + 10)) as r:
                    body = await r.json(content_type=None)
                    ok = r.status == 200 and body.get("role") == dst.role
                    why = "" if ok else f"HTTP {r.status}: {body}"
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                why = f"{type(e).__name__}: {e}"
            if not ok:
                log.warning("re-roling %s worker %s to %s failed (%s); it stays a %s worker", src.role, w.url,
                            dst.role, why, src.role)
                self.m_reroles.inc((src.role, dst.role, "failed"))
                return False
            src.remove_url(w.url)
            dst.add(w.url, w.registered_as)
            self.m_reroles.inc((src.role, dst.role, "ok"))
            log.info("worker %s moved from the %s pool to the %s pool", w.url, src.role, dst.role)
            return True
        finally:
            w.switching = False
