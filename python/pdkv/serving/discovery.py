"""Serving pools from etcd: workers register, proxies watch, drained workers leave.

A worker started with ``WorkerConfig(registry="etcd://...")`` keeps
``/pdkv/workers/<id>`` = ``{url, role, model, capacity_tokens, load, state}`` under a
lease (load refreshed every TTL/3 s). A proxy started with
``ProxyConfig(registry="etcd://...")`` watches that prefix: a worker that registers
enters rotation, one whose key goes away (lease expired, deregistered) or whose state
is ``draining`` leaves it. Requests already running on a worker that leaves rotation
finish there.

Draining (``POST /pd/drain`` on the worker): the worker publishes ``draining`` at once,
answers new work with 503 (a proxy that has not seen the change yet retries another
worker), waits for its in-flight requests to finish, then deletes its key. ``GET
/pd/drain`` reports ``{"state": "serving" | "draining" | "drained", "in_flight": n}``.
See docs/discovery.md.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from typing import TYPE_CHECKING, Any, Callable

from aiohttp import web

from ..discovery import Publication, Registry, Watch
from .aio import json_error

if TYPE_CHECKING:
    from .worker import Worker

__all__ = ["WorkerRegistration", "PoolWatch", "NEW_WORK_PATHS"]

log = logging.getLogger("pdkv.serving.discovery")

#: Routes that start new work; a draining worker refuses them (503).
NEW_WORK_PATHS = ("/pd/prefill", "/pd/generate", "/pd/decode", "/v1/completions", "/v1/chat/completions")


class WorkerRegistration:
    """A worker's entry in etcd and its drain state."""

    def __init__(self, worker: "Worker", registry: Registry) -> None:
        self.worker = worker
        self.registry = registry
        self.id = f"{worker.role.value}-{os.getpid()}-{secrets.token_hex(3)}"
        self.state = "serving"
        self._publication: Publication | None = None
        self._drain_task: asyncio.Task | None = None

    def record(self) -> dict[str, Any]:
        w = self.worker
        eng = w.engine
        load = {"in_flight": w._in_flight}
        if eng is not None:
            load.update(waiting=eng.num_waiting, running=eng.num_running, free_blocks=eng.num_free_blocks)
        return {"url": w.url, "role": w.role.value, "model": w.config.model_name,
                "capacity_tokens": eng.pool.capacity_tokens if eng is not None else 0,
                "load": load, "state": self.state, "pid": os.getpid()}

    def add_routes(self, app: web.Application) -> None:
        app.middlewares.append(self._refuse_new_work_while_draining)
        app.router.add_post("/pd/drain", self._h_drain)
        app.router.add_get("/pd/drain", self._h_drain_state)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._publication = await loop.run_in_executor(
            None, lambda: self.registry.publish("workers", self.id, self.record))
        log.info("registered as %s in %s", self.id, self.registry.url)

    async def close(self) -> None:
        if self._drain_task is not None:
            self._drain_task.cancel()
        await self._deregister()

    async def _deregister(self) -> None:
        pub, self._publication = self._publication, None
        if pub is not None:
            await asyncio.get_running_loop().run_in_executor(None, pub.close)

    @web.middleware
    async def _refuse_new_work_while_draining(self, request: web.Request, handler: Callable) -> Any:
        if self.state != "serving" and request.method == "POST" and request.path in NEW_WORK_PATHS:
            return json_error(503, f"worker {self.id} is draining", code="draining")
        return await handler(request)

    async def _h_drain(self, request: web.Request) -> web.Response:
        if self.state == "serving":
            self.state = "draining"
            self._drain_task = asyncio.ensure_future(self._drain())
        return await self._h_drain_state(request)

    async def _h_drain_state(self, request: web.Request) -> web.Response:
        return web.json_response({"id": self.id, "state": self.state, "in_flight": self.worker._in_flight})

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        pub = self._publication
        if pub is not None:  # proxies stop routing here as soon as they see it
            await loop.run_in_executor(None, pub.refresh)
        idle_since = None
        while True:
            eng = self.worker.engine
            idle = self.worker._in_flight == 0 and (eng is None or eng.num_waiting + eng.num_running == 0)
            now = loop.time()
            if not idle:
                idle_since = None
            elif idle_since is None:
                idle_since = now
            elif now - idle_since >= 0.2:  # a request that just arrived is counted by now
                break
            await asyncio.sleep(0.05)
        await self._deregister()
        self.state = "drained"
        log.info("worker %s drained and deregistered", self.id)


class PoolWatch:
    """A proxy's watch of ``/pdkv/workers/``: calls ``apply(id, record or None)`` in the
    proxy's event loop for every registration, change and removal. :meth:`announce`
    also registers the proxy itself under ``/pdkv/proxies/<id>`` (``url``, ``mode``)."""

    def __init__(self, registry: Registry, apply: Callable[[str, dict[str, Any] | None], None]) -> None:
        self.registry = registry
        self._apply = apply
        self._loop = asyncio.get_running_loop()
        self._watch: Watch = registry.watch("workers", self._from_thread)
        self._publication: Publication | None = None

    async def announce(self, url: str, mode: str) -> None:
        record = {"url": url, "mode": mode, "pid": os.getpid()}
        proxy_id = f"proxy-{os.getpid()}-{secrets.token_hex(3)}"
        self._publication = await self._loop.run_in_executor(
            None, lambda: self.registry.publish("proxies", proxy_id, lambda: record))

    def _from_thread(self, worker_id: str, record: dict[str, Any] | None) -> None:
        self._loop.call_soon_threadsafe(self._apply, worker_id, record)

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        pub, self._publication = self._publication, None
        if pub is not None:
            await loop.run_in_executor(None, pub.close)
        await loop.run_in_executor(None, self._watch.close)
