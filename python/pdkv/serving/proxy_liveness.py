"""Which workers are alive: the proxy's liveness probes (``GET /pd/stats`` every
``liveness_s``), the deadline on every wait on a worker (a wait silent for
``liveness_s`` probes the worker it waits on), and taking a failed worker out of
rotation for ``down_cooldown_s`` (see :mod:`pdkv.serving.proxy`, "Faults")."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any, AsyncIterator, Callable

import aiohttp

from .aio import ndjson_lines
from .metrics import Counter
from .proxy_client import END, WorkerClient, next_or_end
from .proxy_config import ProxyConfig, ProxyMode
from .proxy_pool import PoolWorker, WorkerFailed

__all__ = ["Liveness"]

log = logging.getLogger("pdkv.serving")


class Liveness:
    """Probes workers and bounds every wait on one.

    Parameters
    ----------
    config : ProxyConfig
    client : WorkerClient
    workers : callable
        Returns every worker of both pools now.
    failures : Counter
        ``pdkv_worker_failures_total`` (role, worker).
    """

    def __init__(self, config: ProxyConfig, client: WorkerClient, workers: Callable[[], list[PoolWorker]],
                 failures: Counter) -> None:
        self.config = config
        self._client = client
        self._workers = workers
        self._failures = failures

    async def run(self) -> None:
        """Probes every worker whose info is known each ``liveness_s`` (until cancelled)."""
        while True:
            await asyncio.sleep(self.config.liveness_s)
            await asyncio.gather(*(self.alive(w) for w in self._workers() if w.info is not None))

    def alive(self, w: PoolWorker) -> "asyncio.Future[bool]":
        """Whether ``w`` answers ``GET /pd/stats`` within ``probe_timeout_s`` (one probe
        per worker at a time, shared by all who ask). A miss takes it out of rotation
        until it answers again."""
        if w.probe is None or w.probe.done():
            w.probe = asyncio.ensure_future(self._probe(w))
        return asyncio.shield(w.probe)

    async def _probe(self, w: PoolWorker) -> bool:
        t = self.config.probe_timeout_s
        try:
            async with self._client.get(w.url + "/pd/stats", timeout=aiohttp.ClientTimeout(total=t)) as r:
                raw = await r.read()
                ok = r.status == 200
                why = f"/pd/stats answered HTTP {r.status}"
                if r.status in (401, 403):
                    w.refused(r.status, "/pd/stats")
                elif ok:
                    self._check_role(w, raw)
        except asyncio.TimeoutError:
            ok, why = False, f"no answer to a liveness probe within {t:g} s"
        except (aiohttp.ClientError, OSError) as e:
            ok, why = False, f"liveness probe failed: {type(e).__name__}: {e}"
        if ok:
            w.alive_at = time.monotonic()
            if not w.alive:
                log.info("%s worker %s answers again; back in rotation", w.role, w.url)
        elif w.alive:
            self.mark_down(w, why)
        w.alive = ok
        return ok

    def _check_role(self, w: PoolWorker, raw: bytes) -> None:
        """Compares the role a worker's ``/pd/stats`` reports with the pool it is in (a
        worker re-roled by someone else): a mismatch takes it out of rotation and
        ``/health`` lists it; its ``/pd/info`` is fetched again."""
        try:
            role = json.loads(raw).get("role")
        except (ValueError, AttributeError, RecursionError):
            return
        if not isinstance(role, str) or w.switching:
            return
        want = ("colocated", "decode") if self.config.mode is ProxyMode.COLOCATED and w.role == "decode" else \
            (w.role,)
        if role in want:
            if w.misconfigured.startswith("is a "):  # back in its pool's role
                w.misconfigured = ""
                w.info = None  # fetched again: WorkerDiscovery.update_model puts it back into rotation
            return
        why = f"is a {role} worker now, but is in the proxy's {w.role} pool"
        if w.misconfigured != why:
            log.error("worker %s %s: out of rotation", w.url, why)
        w.misconfigured = why
        w.compatible = False
        w.info = None  # fetched again; WorkerDiscovery.update_model keeps it out while the role differs

    async def bounded(self, w: PoolWorker, aw: Any, limit: float, what: str) -> Any:
        """Awaits ``aw`` (a wait on worker ``w``) for at most ``limit`` seconds; each
        ``liveness_s`` of silence, probes ``w`` and gives up if it does not answer.

        Raises
        ------
        WorkerFailed
            The deadline passed or the worker stopped answering.
        """
        task = asyncio.ensure_future(aw)
        t0 = time.monotonic()
        try:
            while True:
                left = limit - (time.monotonic() - t0)
                if left <= 0:
                    raise WorkerFailed(w, f"no {what} within {limit:g} s")
                done, _ = await asyncio.wait({task}, timeout=min(left, self.config.liveness_s))
                if done:
                    return task.result()
                fresh = time.monotonic() - w.alive_at < self.config.liveness_s / 2
                if not w.alive or not (fresh or await self.alive(w)):
                    raise WorkerFailed(w, f"no {what} for {time.monotonic() - t0:.1f} s and the worker does not "
                                        f"answer liveness probes ({w.error})")
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    async def lines(self, w: PoolWorker, r: aiohttp.ClientResponse, timeout: float, what: str
                    ) -> AsyncIterator[dict[str, Any]]:
        """The NDJSON lines of worker ``w``'s response, each awaited for at most
        ``timeout`` s (see :meth:`bounded`); transport failures become
        :class:`WorkerFailed`."""
        lines = ndjson_lines(r.content, timeout=None)
        try:
            while True:
                try:
                    line = await self.bounded(w, next_or_end(lines), timeout, what)
                except (aiohttp.ClientError, ConnectionError, OSError) as e:
                    raise WorkerFailed(w, f"{type(e).__name__}: {e}") from None
                if line is END:
                    return
                yield line
        finally:
            await lines.aclose()  # type: ignore[attr-defined]

    def mark_down(self, w: PoolWorker, why: str) -> None:
        """Takes ``w`` out of rotation for ``down_cooldown_s``. One failure is counted
        per fall out of rotation: the requests that were waiting on a worker a probe
        just took out report the same failure again."""
        now = time.monotonic()
        in_rotation = w.alive and now >= w.down_until
        w.down_until = now + self.config.down_cooldown_s
        if not in_rotation:
            return
        w.error = why
        self._failures.inc((w.role, w.url))
        log.warning("%s worker %s failed (%s); out of rotation for %.1f s", w.role, w.url, why,
                    self.config.down_cooldown_s)
