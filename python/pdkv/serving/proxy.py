"""The OpenAI-compatible proxy in front of prefill and decode workers.

Modes (:class:`ProxyMode`):

``disagg``
    Every request: a decode worker reserves blocks, a prefill worker computes the
    prompt, answers the first token (streamed to the client at once) and pushes the KV
    into the reserved blocks through pdkv; the decode worker continues.
``hybrid``
    Prompts of at most ``hybrid_threshold`` tokens are prefilled by the decode worker
    itself (no KV hop); longer ones go the disaggregated way.
``colocated``
    Requests go to engine workers (``pdkv serve colocated`` or decode workers) that
    prefill and decode themselves (the engine's ``colocated`` or ``chunked``
    scheduling is the worker's setting).

Routing: the least-loaded worker of a pool serves the next request (decode: fewest
requests in flight; prefill: fewest prompt tokens waiting for their first token), ties
broken round-robin; with ``routing="kv"``, the worker that would leave the least work
by the KV it holds and its load (:mod:`pdkv.serving.proxy_kv`). A worker that cannot be reached is taken out of rotation for
``down_cooldown_s`` and the request is retried on another one. A prefill worker
that fails or a KV transfer that fails never fails the request: the decode worker
recomputes the prompt (``/pd/kv_failed``).

Faults: every wait on a worker has a deadline (``connect_timeout_s``,
``headers_timeout_s``, ``kv_timeout_s``, ``read_timeout_s``), and a worker that
stops answering (frozen, not only dead) is found sooner by liveness probes: every
``liveness_s`` the proxy GETs each worker's ``/pd/stats`` with a ``probe_timeout_s``
deadline, and so does any wait that has been silent for ``liveness_s``. A worker that
misses a probe leaves rotation until it answers one again; the waits on it fail at
once. A decode worker that fails after the client got tokens does not fail the
request: the stream is *migrated* -- another decode worker prefills the prompt plus
the tokens already sent and continues with the same seed (``index_offset``: the
same random draws), ``max_tokens`` reduced by what was sent, so the client receives
the complete answer. Only when no decode worker is left does it get an error. An
``{"error": ...}`` line in a decode worker's stream is handled by whose fault it is
(:class:`~pdkv.serving.protocol.StreamError`): the worker's (5xx: internal error,
shutting down, out of KV blocks, transport) migrates the stream like a dead worker;
the request's (4xx: invalid input, context too long) goes to the client as is.

The proxy learns the model from the workers (``/pd/info``) and loads the tokenizer
from the model directory they report (or ``tokenizer``), so it needs no model of its
own; it never imports torch for itself (transformers' tokenizer loading may).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, AsyncIterator, Coroutine

from aiohttp import web

from pdkv.errors import PdkvError

from .aio import HttpServer
from .frontend import OpenAIFrontend, RequestTrace, TokenOut
from .limits import ServerLimits
from .metrics import Registry
from .openai_api import ModelInfo, TextCodec
from .protocol import GenParams
from .proxy_client import WorkerClient
from .proxy_config import ProxyConfig, ProxyMode, Routing
from .proxy_kv import KVRouting
from .kv_index import KVIndex, KVIndexPoller
from .proxy_discovery import WorkerDiscovery
from .proxy_links import LinkHealth
from .proxy_liveness import Liveness
from .proxy_metrics import ProxyMetrics
from .proxy_pool import PoolWorker, WorkerPool
from .proxy_prefill import PrefillLeg
from .proxy_rerole import Reroler
from .proxy_routing import Router
from .rerole import DemandWindow

__all__ = ["Proxy", "ProxyBackend", "ProxyConfig", "ProxyMode"]

log = logging.getLogger("pdkv.serving")

#: Environment variable with the proxy's client API keys (comma-separated).
API_KEY_ENV = "PDKV_API_KEY"


class ProxyBackend:
    """Routes generation requests to workers (the proxy's :class:`~pdkv.serving.frontend.Backend`).

    A thin composition of its parts, each in its own module: the worker pools
    (:mod:`~pdkv.serving.proxy_pool`), signed calls to the workers
    (:mod:`~pdkv.serving.proxy_client`), liveness probes and deadlines
    (:mod:`~pdkv.serving.proxy_liveness`), discovery of the workers and the model
    (:mod:`~pdkv.serving.proxy_discovery`), routing, retries and migration
    (:mod:`~pdkv.serving.proxy_routing`, :mod:`~pdkv.serving.proxy_prefill`), the
    prefill -> decode link health (:mod:`~pdkv.serving.proxy_links`), role changes
    (:mod:`~pdkv.serving.proxy_rerole`) and metrics (:mod:`~pdkv.serving.proxy_metrics`).

    Parameters
    ----------
    config : ProxyConfig
    registry : Registry
        The proxy's metrics are added to it.
    """

    def __init__(self, config: ProxyConfig, registry: Registry) -> None:
        self.config = config
        self.mode = config.mode.value
        self.prefill = WorkerPool("prefill", config.prefill)
        self.decode = WorkerPool("decode", config.decode)
        self._tasks: list[asyncio.Task] = []
        self.client = WorkerClient(config.secret, config.connect_timeout_s)
        self.discovery = WorkerDiscovery(config, self.prefill, self.decode, self.client, self._spawn)
        self.metrics = ProxyMetrics(registry, self._workers, self.discovery.rejected_records)
        m = self.metrics
        self.liveness = Liveness(config, self.client, self._workers, m.m_failures)
        self.links = LinkHealth(config, self.prefill, self.decode, self.client, m.m_peer_auth, m.m_peer_transport)
        demand: DemandWindow | None = None
        self.reroler: Reroler | None = None
        if config.rerole is not None:
            demand = DemandWindow(config.rerole)
            self.reroler = Reroler(config.rerole, demand, self.prefill, self.decode, self.client, m.m_reroles)
        self.kv: KVRouting | None = None
        self.kv_poller: KVIndexPoller | None = None
        if config.routing is Routing.KV:
            index = KVIndex(snapshot_interval_s=config.kv_snapshot_interval_s)
            self.kv_poller = KVIndexPoller(index, self.client, self._workers, interval_s=config.kv_events_interval_s,
                                           timeout_s=config.probe_timeout_s)
            self.kv = KVRouting(config, index, self.prefill, self.decode, self.client, m, registry)
        leg = PrefillLeg(config, self.prefill, self.client, self.liveness, self.links, m, self.kv)
        self.router = Router(config, self.decode, leg, self.client, self.liveness, m, demand, self.kv)

    def _workers(self) -> list[PoolWorker]:
        return self.prefill.workers + self.decode.workers

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        self._tasks.append(asyncio.ensure_future(coro))

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Opens the HTTP client and starts discovering the workers.

        Raises
        ------
        InvalidArgument
            No cluster secret (``secret`` or ``$PDKV_SECRET``): workers refuse unsigned calls.
        """
        self.client.start()
        self.discovery.start()
        self._spawn(self.discovery.run())
        self._spawn(self.liveness.run())
        if self.reroler is not None:
            self._spawn(self.reroler.run())
        if self.kv_poller is not None:
            self._spawn(self.kv_poller.run())

    async def close(self) -> None:
        await self.discovery.close()
        self._tasks.extend(w.probe for w in self._workers() if w.probe is not None)
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - shutting down
                pass
        if self.kv is not None:
            await self.kv.close()
        await self.client.close()

    async def wait_ready(self, timeout: float) -> bool:
        """Waits until the model is known (a decode worker answered)."""
        return await self.discovery.wait_ready(timeout)

    async def rerole_once(self) -> str | None:
        """One round of re-roling (see :meth:`~pdkv.serving.proxy_rerole.Reroler.rerole_once`);
        None when re-roling is off or nothing moved."""
        return await self.reroler.rerole_once() if self.reroler is not None else None

    # ------------------------------------------------------------------ Backend protocol
    def model_info(self) -> ModelInfo | None:
        return self.discovery.model_info()

    def codec(self) -> TextCodec | None:
        return self.discovery.codec()

    def health(self) -> tuple[bool, dict[str, Any]]:
        now = time.monotonic()
        ok = self.discovery.ready and self.decode.any_up() and \
            (self.config.mode is ProxyMode.COLOCATED or self.prefill.any_up())
        workers = [{"url": w.url, "role": w.role, "up": w.usable(now), "in_flight": w.in_flight,
                    "served": w.served, "registered_as": w.registered_as, "error": w.error,
                    "switching": w.switching}
                   for w in self._workers()]
        links = self.link_health()
        bad = [{"url": w.url, "role": w.role, "problem": w.misconfigured} for w in self._workers() if w.misconfigured]
        out: dict[str, Any] = {"workers": workers, "model": self.discovery.model_name(),
                               "peer_links": links, "misconfigured_workers": bad}
        if self.kv is not None:  # the fleet KV index: workers it knows and blocks it holds
            out["kv_index"] = {"workers": len(self.kv.index.urls()), "blocks": self.kv.index.blocks()}
        if ok and (bad or any(not x["ok"] for x in links)):
            # serving, but KV between these pairs is recomputed, or some workers cannot serve their routes
            out["status"] = "degraded"
        return ok, out

    def link_health(self) -> list[dict[str, Any]]:
        """Each prefill -> decode worker pair seen so far (see :meth:`LinkHealth.report`)."""
        return self.links.report()

    async def check_links(self, timeout: float) -> list[dict[str, Any]]:
        """Checks every prefill -> decode pair now; returns the failed ones (see
        :meth:`~pdkv.serving.proxy_links.LinkHealth.check_all`)."""
        return await self.links.check_all(timeout)

    async def refresh_metrics(self) -> None:
        await self.metrics.refresh(self.client)

    def generate(self, rid: str, prompt: list[int], params: GenParams, trace: RequestTrace
                 ) -> AsyncIterator[TokenOut]:
        return self.router.generate(rid, prompt, params, trace)


def api_keys(config: ProxyConfig) -> tuple[str, ...]:
    """The proxy's client API keys: ``config.api_keys``, else ``$PDKV_API_KEY``
    (comma-separated), else none."""
    if config.api_keys is not None:
        return tuple(config.api_keys)
    return tuple(k for k in (x.strip() for x in os.environ.get(API_KEY_ENV, "").split(",")) if k)


class Proxy:
    """The proxy server: :class:`~pdkv.serving.frontend.OpenAIFrontend` over a
    :class:`ProxyBackend` (a :class:`~pdkv.serving.aio.Serveable`).

    Parameters
    ----------
    config : ProxyConfig
    limits : ServerLimits, optional
        Connection limit and idle/header/body deadlines of its HTTP server.

    Examples
    --------
    >>> cfg = ProxyConfig("disagg", prefill=["http://127.0.0.1:8100"], decode=["http://127.0.0.1:8200"])
    >>> with ServerThread(Proxy(cfg), port=8000) as t:   # doctest: +SKIP
    ...     ...                                           # OpenAI API at t.url
    """

    def __init__(self, config: ProxyConfig, *, limits: ServerLimits | None = None) -> None:
        self.config = config
        self.limits = limits or ServerLimits()
        self.registry = Registry()
        self.backend = ProxyBackend(config, self.registry)
        self.frontend = OpenAIFrontend(self.backend, self.registry, max_body_bytes=config.max_body_bytes,
                                       body_timeout_s=self.limits.body_timeout_s, api_keys=api_keys(config))
        self._http: HttpServer | None = None
        self.url = ""

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        await self.backend.start()
        app = web.Application()  # the frontend sets each request's body limit
        self.frontend.add_routes(app)
        self._http = HttpServer(app, limits=self.limits)
        try:
            self.url = await self._http.start(host, port)
        except BaseException:
            await self.backend.close()
            raise
        watch = self.backend.discovery.pool_watch
        if watch is not None:
            try:
                await watch.announce(self.url, self.config.mode.value)
            except PdkvError as e:  # etcd away: serve anyway (the watch retries); only the listing lacks us
                log.warning("proxy not registered in %s: %s", self.config.registry, e)
        log.info("proxy (%s) serving on %s", self.config.mode.value, self.url)
        return self.url

    async def wait_ready(self, timeout: float) -> bool:
        """Waits until the workers reported their model (see :meth:`ProxyBackend.wait_ready`)."""
        return await self.backend.wait_ready(timeout)

    async def close(self) -> None:
        if self._http is not None:
            http, self._http = self._http, None
            await http.close()
        await self.backend.close()
