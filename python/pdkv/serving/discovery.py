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
Re-roling (:class:`RoleSwitch`, every prefill and decode worker, with or without a
registry): ``POST /pd/role {"role": "prefill" | "decode"}`` drains the worker the same
way (new work gets 503, in-flight requests finish), switches it to the other role
(both share its agent, KV pool and engine) and, when registered, publishes it again
as ``serving`` in the new role. A proxy with ``rerole`` on sends it
(:mod:`pdkv.serving.rerole`). See docs/discovery.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
from typing import Any, Callable

from aiohttp import web

from ..discovery import Publication, Registry, Watch
from ..errors import PdkvError
from .aio import json_error
from .limits import BODY_KEY
from .roles import RoleSwitchable, WorkerRole

__all__ = ["WorkerRegistration", "PoolWatch", "RoleSwitch", "NEW_WORK_PATHS", "ROLE_PATHS", "wait_idle"]

log = logging.getLogger("pdkv.serving.discovery")

#: Routes that start new work; a draining worker refuses them (503).
NEW_WORK_PATHS = ("/pd/prefill", "/pd/generate", "/pd/decode", "/v1/completions", "/v1/chat/completions")

#: Worker-protocol routes and the role that serves them (a prefill or decode worker has
#: them all; :class:`RoleSwitch` answers those of the other role with 404).
ROLE_PATHS = {"/pd/prefill": "prefill", "/pd/check_peer": "prefill", "/pd/decode": "decode",
              "/pd/kv_failed": "decode", "/pd/generate": "decode"}


async def wait_idle(worker: RoleSwitchable, timeout: float | None = None) -> bool:
    """Waits until ``worker`` has no request in flight or in its engine for 0.2 s (a
    request that just arrived is counted by then); False if ``timeout`` passed first."""
    loop = asyncio.get_running_loop()
    end = None if timeout is None else loop.time() + timeout
    idle_since = None
    while True:
        eng = worker.engine
        idle = worker.in_flight == 0 and (eng is None or eng.num_waiting + eng.num_running == 0)
        now = loop.time()
        if not idle:
            idle_since = None
        elif idle_since is None:
            idle_since = now
        elif now - idle_since >= 0.2:
            return True
        if end is not None and now > end:
            return False
        await asyncio.sleep(0.05)


class WorkerRegistration:
    """A worker's entry in etcd and its drain state."""

    def __init__(self, worker: RoleSwitchable, registry: Registry) -> None:
        self.worker = worker
        self.registry = registry
        self.id = f"{worker.role.value}-{os.getpid()}-{secrets.token_hex(3)}"
        self.state = "serving"
        self._publication: Publication | None = None
        self._drain_task: asyncio.Task | None = None

    def record(self) -> dict[str, Any]:
        w = self.worker
        eng = w.engine
        load = {"in_flight": w.in_flight}
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
        return web.json_response({"id": self.id, "state": self.state, "in_flight": self.worker.in_flight})

    async def publish_now(self) -> None:
        """Writes the record (state, role) now instead of at the next refresh; etcd
        away: the refresh thread writes it when etcd returns."""
        pub = self._publication
        if pub is not None:
            try:
                await asyncio.get_running_loop().run_in_executor(None, pub.refresh)
            except PdkvError as e:
                log.warning("publishing %s now failed (retried by the refresh): %s", self.id, e)

    async def _drain(self) -> None:
        await self.publish_now()  # proxies stop routing here as soon as they see it
        await wait_idle(self.worker)
        await self._deregister()
        self.state = "drained"
        log.info("worker %s drained and deregistered", self.id)


class PoolWatch:
    """A proxy's watch of ``/pdkv/workers/``: calls ``apply(id, record or None)`` in the
    proxy's event loop for every registration, change and removal. :meth:`announce`
    also registers the proxy itself under ``/pdkv/proxies/<id>`` (``url``, ``mode``); a
    proxy started while etcd is away keeps trying and is listed once etcd returns.

    With a credential (``PDKV_SECRET``) the registry ignores worker records that are
    not signed with the cluster secret (see :class:`pdkv.discovery.Registry`): a forged
    registration never enters rotation; :meth:`rejected_records` counts them."""

    def __init__(self, registry: Registry, apply: Callable[[str, dict[str, Any] | None], None], *,
                 retry_s: float = 1.0, idle_s: float = 30.0) -> None:
        self.registry = registry
        self._apply = apply
        self._retry_s = retry_s
        self._loop = asyncio.get_running_loop()
        self._watch: Watch = registry.watch("workers", self._from_thread, retry_s=retry_s, idle_s=idle_s)
        self._publication: Publication | None = None
        self._announcing: asyncio.Task | None = None
        self._closing = asyncio.Event()

    async def announce(self, url: str, mode: str) -> None:
        """Publishes the proxy now; raises (PdkvError) if etcd cannot be reached, and
        then keeps trying in the background every ``retry_s``."""
        record = {"url": url, "mode": mode, "pid": os.getpid()}
        proxy_id = f"proxy-{os.getpid()}-{secrets.token_hex(3)}"
        try:
            self._publication = await self._publish(proxy_id, record)
        except PdkvError:
            self._announcing = asyncio.ensure_future(self._announce_until_published(proxy_id, record))
            raise

    async def _publish(self, proxy_id: str, record: dict[str, Any]) -> Publication:
        return await self._loop.run_in_executor(
            None, lambda: self.registry.publish("proxies", proxy_id, lambda: record))

    async def _announce_until_published(self, proxy_id: str, record: dict[str, Any]) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._closing.wait(), self._retry_s)
                return
            try:
                pub = await self._publish(proxy_id, record)
            except PdkvError:
                continue  # still away: the watch logs the outage once
            if self._closing.is_set():  # closed while that attempt ran: take it back
                await self._loop.run_in_executor(None, pub.close)
                return
            self._publication = pub
            log.info("proxy %s registered in %s (etcd is back)", proxy_id, self.registry.url)
            return

    def rejected_records(self) -> list[tuple[tuple[str, str], int]]:
        """Records the watch (and this proxy's registration) refused, by (kind, reason):
        the proxy's ``pdkv_discovery_rejected_records_total``."""
        return self.registry.rejected_records()

    def _from_thread(self, worker_id: str, record: dict[str, Any] | None) -> None:
        self._loop.call_soon_threadsafe(self._apply, worker_id, record)

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        self._closing.set()
        if self._announcing is not None:  # returns within one publish attempt (etcd's timeout)
            await self._announcing
        pub, self._publication = self._publication, None
        if pub is not None:
            await loop.run_in_executor(None, pub.close)
        await loop.run_in_executor(None, self._watch.close)


class RoleSwitch:
    """``POST /pd/role`` of a prefill or decode worker (see the module docstring), and
    the gate that answers the other role's routes with 404 and refuses new work while
    the worker drains for a switch."""

    def __init__(self, worker: RoleSwitchable) -> None:
        self.worker = worker
        self.switching = False

    def add_routes(self, app: web.Application) -> None:
        app.middlewares.append(self._gate)
        app.router.add_post("/pd/role", self._h_role)

    @web.middleware
    async def _gate(self, request: web.Request, handler: Callable) -> Any:
        need = ROLE_PATHS.get(request.path)
        if need is not None and request.method == "POST":
            role = self.worker.role.value
            if need != role:
                return json_error(404, f"{request.path} is served by {need} workers; this one is a {role} worker",
                                  code="wrong_role")
            if self.switching and request.path in NEW_WORK_PATHS:
                return json_error(503, f"the worker is switching from {role} to another role", code="draining")
        return await handler(request)

    async def _h_role(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(request.get(BODY_KEY) or await request.read())  # read by the auth check
            new = WorkerRole(body["role"])
            timeout = float(body.get("timeout", 60.0))
            if new is WorkerRole.COLOCATED or not 0 < timeout <= 3600:
                raise ValueError
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return json_error(400, 'expected {"role": "prefill" | "decode", "timeout": seconds (0, 3600]}',
                              code="invalid_request")
        w, reg = self.worker, self.worker.registration
        old = w.role
        if new is old:
            return web.json_response({"role": old.value, "switched": False})
        if self.switching or (reg is not None and reg.state != "serving"):
            return json_error(409, "the worker is already switching or draining", code="busy")
        self.switching = True
        try:
            if reg is not None:  # proxies watching the registry stop routing here
                reg.state = "draining"
                await reg.publish_now()
            if not await wait_idle(w, timeout):
                return json_error(503, f"still busy after {timeout:g} s; stays a {old.value} worker",
                                  code="busy")
            w.switch_role(new)
            log.info("worker %s switched from %s to %s", w.url, old.value, new.value)
        finally:
            self.switching = False
            if reg is not None:
                reg.state = "serving"
                await reg.publish_now()  # in the new role (or back in the old one)
        return web.json_response({"role": new.value, "switched": True, "from": old.value})
