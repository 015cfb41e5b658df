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
broken round-robin. A worker that cannot be reached is taken out of rotation for
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
import contextlib
import dataclasses
import enum
import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Sequence

import aiohttp
from aiohttp import web

from pdkv.errors import InvalidArgument, PdkvError

from ..discovery import Registry as DiscoveryRegistry
from ..discovery import parse_registry_url
from ..credential import Credential
from .aio import HttpServer, ndjson_lines
from .auth import Signer
from .discovery import PoolWatch
from .frontend import OpenAIFrontend, RequestTrace, TokenOut
from .limits import ServerLimits
from .metrics import Registry
from .openai_api import APIError, ModelInfo, TextCodec
from .protocol import (BUSY_CODES, GenerateRequest, GenParams, KVFailed, KVResult, PrefillRequest, Reservation,
                       StreamError, WorkerInfo)
from .rerole import DemandWindow, RerolePolicy, decide

__all__ = ["DEFAULT_HYBRID_THRESHOLD", "Proxy", "ProxyBackend", "ProxyConfig", "ProxyMode"]

log = logging.getLogger("pdkv.serving")

#: Default prompt length (tokens) up to which hybrid mode prefills on the decode
#: worker. Measured with ``python -m pdkv.serving.calibrate`` on the 2-core development
#: machine with SmolLM2-135M (README, "The hybrid threshold"): the KV hop (proxy round
#: trips, shm write, notification) costs a request about 10 ms there, while a local
#: prefill stalls a decode batch of 8 by about 15-25 ms at 8 tokens and 60-80 ms at 16;
#: so only prompts of up to 8 tokens are cheaper to prefill locally.
DEFAULT_HYBRID_THRESHOLD = 8
#: Environment variable with the proxy's client API keys (comma-separated).
API_KEY_ENV = "PDKV_API_KEY"


class ProxyMode(str, enum.Enum):
    """How the proxy serves requests (see the module docstring)."""

    DISAGG = "disagg"
    HYBRID = "hybrid"
    COLOCATED = "colocated"


def _urls(v: Sequence[str] | str) -> tuple[str, ...]:
    items = v.split(",") if isinstance(v, str) else list(v)
    out = []
    for u in items:
        u = u.strip().rstrip("/")
        if not u:
            continue
        if not (u.startswith("http://") or u.startswith("https://")):
            raise InvalidArgument(f"worker URL must start with http:// or https://, got {u!r}")
        out.append(u)
    return tuple(out)


@dataclass(frozen=True)
class ProxyConfig:
    """Proxy settings.

    Attributes
    ----------
    mode : ProxyMode or str
    prefill : sequence of str
        Prefill worker URLs (disagg and hybrid).
    decode : sequence of str
        Decode worker URLs; in colocated mode the engine workers.
    hybrid_threshold : int
        Hybrid: prompts of at most this many tokens are prefilled by the decode worker.
    tokenizer : str, optional
        Model directory to load the tokenizer from (default: the one the workers report,
        if it exists here). Without a tokenizer only token-id prompts are served.
    kv_timeout_s : float
        How long a prefill worker may take to deliver a prompt's KV (queueing, compute
        and transfer) before the decode worker recomputes instead.
    connect_timeout_s : float
        TCP connect to a worker.
    read_timeout_s : float
        Longest silence from a decode worker while tokens are due.
    headers_timeout_s : float
        From sending a request to a worker to its response headers (a decode worker
        answers them once it reserved blocks, which may wait for free ones).
    liveness_s : float
        Interval of the liveness probes, and the silence after which a wait probes the
        worker it waits on.
    probe_timeout_s : float
        Deadline of one liveness probe (``GET /pd/stats``).
    retries : int
        Other workers tried after one failed (migrations included).
    down_cooldown_s : float
        How long an unreachable worker stays out of rotation.
    max_body_bytes : int, optional
        Largest request body (413 above); default: from the model's context (see
        :func:`~pdkv.serving.openai_api.body_limit`).
    registry : str, optional
        ``etcd://host:port``: also route to the workers registered there (see
        :mod:`pdkv.serving.discovery`); ``prefill``/``decode`` may then be empty.
    rerole : RerolePolicy, optional
        Disagg and hybrid: move idle workers between the prefill and decode pools as
        the measured ratio moves (see :mod:`pdkv.serving.rerole`). Off by default.
    secret : str, optional
        The cluster secret the proxy signs every worker call with (default
        ``$PDKV_SECRET``; required to start; see :mod:`pdkv.serving.auth`). Never shown
        in ``repr``.
    api_keys : tuple of str, optional
        Keys clients must send (``Authorization: Bearer <key>``) on the OpenAI routes;
        default ``$PDKV_API_KEY`` (comma-separated), else none: the routes are open.
        ``/health`` stays open.
    """

    mode: ProxyMode
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    hybrid_threshold: int = DEFAULT_HYBRID_THRESHOLD
    tokenizer: str | None = None
    kv_timeout_s: float = 30.0
    connect_timeout_s: float = 3.0
    read_timeout_s: float = 120.0
    headers_timeout_s: float = 90.0
    liveness_s: float = 2.0
    probe_timeout_s: float = 2.0
    retries: int = 2
    down_cooldown_s: float = 2.0
    max_body_bytes: int | None = None
    registry: str | None = None
    rerole: RerolePolicy | None = None
    secret: str | None = field(default=None, repr=False)
    api_keys: tuple[str, ...] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "mode", ProxyMode(self.mode))
        except ValueError:
            raise InvalidArgument(f"mode must be one of {[m.value for m in ProxyMode]}, got {self.mode!r}") \
                from None
        object.__setattr__(self, "prefill", _urls(self.prefill))
        object.__setattr__(self, "decode", _urls(self.decode))
        if self.registry is not None:
            parse_registry_url(self.registry)  # the workers may all come from the registry
        elif not self.decode:
            raise InvalidArgument("the proxy needs at least one decode (or, colocated, engine) worker URL")
        if self.mode is ProxyMode.COLOCATED and self.prefill:
            raise InvalidArgument("colocated mode takes engine workers only (no prefill workers)")
        if self.mode is not ProxyMode.COLOCATED and not self.prefill and self.registry is None:
            raise InvalidArgument(f"{self.mode.value} mode needs at least one prefill worker URL")
        if not isinstance(self.hybrid_threshold, int) or self.hybrid_threshold < 0:
            raise InvalidArgument(f"hybrid_threshold must be an integer >= 0, got {self.hybrid_threshold!r}")
        for k in ("kv_timeout_s", "connect_timeout_s", "read_timeout_s", "down_cooldown_s", "headers_timeout_s",
                  "liveness_s", "probe_timeout_s"):
            if not getattr(self, k) > 0:
                raise InvalidArgument(f"{k} must be > 0, got {getattr(self, k)!r}")
        if self.retries < 0:
            raise InvalidArgument(f"retries must be >= 0, got {self.retries}")
        if self.max_body_bytes is not None and (not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1):
            raise InvalidArgument(f"max_body_bytes must be an integer >= 1, got {self.max_body_bytes!r}")
        if self.api_keys is not None:
            if isinstance(self.api_keys, str):
                object.__setattr__(self, "api_keys", tuple(k.strip() for k in self.api_keys.split(",") if k.strip()))
            else:
                object.__setattr__(self, "api_keys", tuple(self.api_keys))
            if any(not isinstance(k, str) or not k for k in self.api_keys):
                raise InvalidArgument("api_keys must be non-empty strings")
        if self.rerole is not None and (self.mode is ProxyMode.COLOCATED or not isinstance(self.rerole, RerolePolicy)):
            raise InvalidArgument("rerole takes a RerolePolicy, in disagg or hybrid mode only")


class _WorkerFailed(Exception):
    """A worker could not be reached or broke its stream."""

    def __init__(self, worker: "_Worker", message: str, *, before_response: bool = False) -> None:
        super().__init__(message)
        self.worker = worker
        self.before_response = before_response


class _WorkerBusy(Exception):
    """A worker answered 503 (e.g. its KV pool is full): try another, keep it in rotation."""


@dataclass
class _Worker:
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


class _Pool:
    """Workers of one role and the least-loaded choice among them."""

    def __init__(self, role: str, urls: Sequence[str]) -> None:
        self.role = role
        self.workers = [_Worker(u, role) for u in urls]
        self._rr = 0

    def pick(self, exclude: set[str]) -> _Worker | None:
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
        self.workers = self.workers + [_Worker(url, self.role, registered_as=registered_as)]
        return True

    def remove_url(self, url: str) -> None:
        self.workers = [w for w in self.workers if w.url != url]

    def remove(self, registered_as: str) -> list[_Worker]:
        """Takes a registered worker out of rotation; requests running there finish."""
        gone = [w for w in self.workers if w.registered_as == registered_as]
        if gone:
            self.workers = [w for w in self.workers if w.registered_as != registered_as]
        return gone


@dataclass
class _PrefillOutcome:
    first_token: int | None = None
    finish: str | None = None
    kv_ok: bool = False
    terminal: bool = True
    error: str = ""


class ProxyBackend:
    """Routes generation requests to workers (the proxy's :class:`~pdkv.serving.frontend.Backend`).

    Parameters
    ----------
    config : ProxyConfig
    registry : Registry
        The proxy's metrics are added to it.
    """

    def __init__(self, config: ProxyConfig, registry: Registry) -> None:
        self.config = config
        self.mode = config.mode.value
        self.prefill = _Pool("prefill", config.prefill)
        self.decode = _Pool("decode", config.decode)
        self._info: ModelInfo | None = None
        self._codec: TextCodec | None = None
        self._codec_loaded = False
        self._session: aiohttp.ClientSession | None = None
        self._credential = Credential.from_env(config.secret)
        self._signer = Signer(self._credential) if self._credential is not None else None
        self._tasks: list[asyncio.Task] = []
        self._ready = asyncio.Event()
        self._pool_watch: PoolWatch | None = None
        self._demand = DemandWindow(config.rerole) if config.rerole is not None else None
        r = registry
        self.m_reroles = r.counter("pdkv_worker_reroles_total", "Workers moved between the prefill and decode pools "
                                   "(from -> to), and switches given up (result).", ("from", "to", "result"))
        self.m_routed = r.counter("pdkv_routed_requests_total",
                                  "Requests by route: disagg (prefill worker + KV transfer) or local.", ("route",))
        self.m_kv = r.counter("pdkv_kv_transfers_total", "KV transfers by result (ok, failed, none).", ("result",))
        self.m_kv_bytes = r.counter("pdkv_kv_transfer_bytes_total", "KV bytes moved, by transport.", ("transport",))
        self.m_kv_time = r.histogram("pdkv_kv_transfer_span_seconds", "KV transfer span, post to completion "
                                     "(a layer-wise stream: from its open, overlapping the prefill).", ("transport",))
        self.m_kv_tail = r.histogram("pdkv_kv_transfer_tail_seconds", "KV transfer time after the prefill ended "
                                     "(what it adds to the second token).", ("transport",))
        self.m_kv_wire_time = r.histogram("pdkv_kv_transfer_wire_seconds", "KV transfer time with bytes on the "
                                          "wire.", ("transport",))
        self.m_recompute = r.counter("pdkv_kv_recomputes_total",
                                     "Prompts recomputed on the decode worker because their KV did not arrive.",
                                     ("reason",))
        self.m_failures = r.counter("pdkv_worker_failures_total",
                                    "Times a worker was taken out of rotation because it failed a request or a "
                                    "liveness probe, by worker.",
                                    ("role", "worker"))
        self.m_retries = r.counter("pdkv_request_retries_total", "Requests moved to another worker.")
        self.m_migrations = r.counter("pdkv_request_migrations_total",
                                      "Streams continued on another decode worker after tokens were sent.")
        r.gauge("pdkv_worker_in_flight", "Requests the proxy has in flight at each worker.", ("role", "worker")) \
            .set_function(lambda: [((w.role, w.url), w.in_flight) for w in self._workers()])
        self.m_up = r.gauge("pdkv_worker_up", "1 if the worker answered the last poll.", ("role", "worker"))
        self.m_queue = r.gauge("pdkv_worker_queue_depth", "Requests queued in each worker's engine.",
                               ("role", "worker"))
        self.m_running = r.gauge("pdkv_worker_running", "Requests in each worker's running batch.",
                                 ("role", "worker"))
        self.m_free = r.gauge("pdkv_worker_free_kv_blocks", "Free KV blocks of each worker.", ("role", "worker"))
        # Prefill -> decode links: (prefill URL, decode URL) -> health (see link_health()).
        self._links: dict[tuple[str, str], dict[str, Any]] = {}
        self._traces: dict[str, RequestTrace] = {}  # request id -> its trace, while it runs
        self.m_peer_auth = r.counter("pdkv_peer_auth_failures_total",
                                     "KV transfers or link checks that failed because the decode worker's agent "
                                     "refused the prefill worker's secret, by worker pair.", ("prefill", "decode"))
        self.m_peer_transport = r.counter("pdkv_peer_transport_errors_total",
                                          "KV transfers or link checks that failed in the transport (connection, "
                                          "protocol, timeout), by worker pair.", ("prefill", "decode"))
        r.counter("pdkv_discovery_rejected_records_total", "etcd records ignored because they were unsigned, "
                  "wrongly signed, moved, altered, on another lease, future-dated or replayed, by kind and reason.",
                  ("kind", "reason")) \
            .set_function(lambda: self._pool_watch.rejected_records() if self._pool_watch is not None else [])

    def _workers(self) -> list[_Worker]:
        return self.prefill.workers + self.decode.workers

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Opens the HTTP client and starts discovering the workers.

        Raises
        ------
        InvalidArgument
            No cluster secret (``secret`` or ``$PDKV_SECRET``): workers refuse unsigned calls.
        """
        if self._signer is None:
            raise InvalidArgument("the proxy needs the cluster secret to call its workers: set PDKV_SECRET (the "
                                  "value the workers have) or pass --secret")
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=False))
        if self.config.registry is not None:
            self._pool_watch = PoolWatch(DiscoveryRegistry(self.config.registry, credential=self._credential),
                                         self._apply_registration)
        self._tasks.append(asyncio.ensure_future(self._discover_loop()))
        self._tasks.append(asyncio.ensure_future(self._liveness_loop()))
        if self.config.rerole is not None:
            self._tasks.append(asyncio.ensure_future(self._rerole_loop()))

    async def close(self) -> None:
        if self._pool_watch is not None:
            watch, self._pool_watch = self._pool_watch, None
            await watch.close()
        self._tasks.extend(w.probe for w in self._workers() if w.probe is not None)
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - shutting down
                pass
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def wait_ready(self, timeout: float) -> bool:
        """Waits until the model is known (a decode worker answered)."""
        try:
            await asyncio.wait_for(self._ready.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    def _timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s,
                                     connect=self.config.connect_timeout_s)

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._signer is None:
            raise APIError(503, "the proxy is not started", code="service_unavailable")
        return self._session

    def _post(self, url: str, body: Any, **kw: Any) -> Any:
        """A signed ``POST`` of JSON ``body`` to a worker (``async with`` or await it)."""
        assert self._signer is not None
        return self._signer.post(self.session, url, json=body, **kw)

    def _get(self, url: str, **kw: Any) -> Any:
        """A signed ``GET`` to a worker."""
        assert self._signer is not None
        return self._signer.get(self.session, url, **kw)

    def _refused(self, w: _Worker, status: int, what: str) -> None:
        """Records that ``w`` answered 401/403 to a signed call: it does not accept the
        proxy's secret (or has none), so it cannot serve; ``/health`` lists it."""
        why = (f"{what} answered HTTP {status} to the proxy's signed call: the worker does not accept the "
               "proxy's cluster secret (PDKV_SECRET differs, or the worker has none)")
        if w.misconfigured != why:
            log.error("%s worker %s: %s", w.role, w.url, why)
        w.misconfigured = why

    # ------------------------------------------------------------------ liveness
    async def _liveness_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.liveness_s)
            await asyncio.gather(*(self._alive(w) for w in self._workers() if w.info is not None))

    def _alive(self, w: _Worker) -> "asyncio.Future[bool]":
        """Whether ``w`` answers ``GET /pd/stats`` within ``probe_timeout_s`` (one probe
        per worker at a time, shared by all who ask). A miss takes it out of rotation
        until it answers again."""
        if w.probe is None or w.probe.done():
            w.probe = asyncio.ensure_future(self._probe(w))
        return asyncio.shield(w.probe)

    async def _probe(self, w: _Worker) -> bool:
        t = self.config.probe_timeout_s
        try:
            async with self._get(w.url + "/pd/stats", timeout=aiohttp.ClientTimeout(total=t)) as r:
                raw = await r.read()
                ok = r.status == 200
                why = f"/pd/stats answered HTTP {r.status}"
                if r.status in (401, 403):
                    self._refused(w, r.status, "/pd/stats")
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
            self._mark_down(w, why)
        w.alive = ok
        return ok

    def _check_role(self, w: _Worker, raw: bytes) -> None:
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
                w.info = None  # fetched again: _update_model puts it back into rotation
            return
        why = f"is a {role} worker now, but is in the proxy's {w.role} pool"
        if w.misconfigured != why:
            log.error("worker %s %s: out of rotation", w.url, why)
        w.misconfigured = why
        w.compatible = False
        w.info = None  # fetched again; _update_model keeps it out while the role differs

    async def _bounded(self, w: _Worker, aw: Any, limit: float, what: str) -> Any:
        """Awaits ``aw`` (a wait on worker ``w``) for at most ``limit`` seconds; each
        ``liveness_s`` of silence, probes ``w`` and gives up if it does not answer.

        Raises
        ------
        _WorkerFailed
            The deadline passed or the worker stopped answering.
        """
        task = asyncio.ensure_future(aw)
        t0 = time.monotonic()
        try:
            while True:
                left = limit - (time.monotonic() - t0)
                if left <= 0:
                    raise _WorkerFailed(w, f"no {what} within {limit:g} s")
                done, _ = await asyncio.wait({task}, timeout=min(left, self.config.liveness_s))
                if done:
                    return task.result()
                fresh = time.monotonic() - w.alive_at < self.config.liveness_s / 2
                if not w.alive or not (fresh or await self._alive(w)):
                    raise _WorkerFailed(w, f"no {what} for {time.monotonic() - t0:.1f} s and the worker does not "
                                        f"answer liveness probes ({w.error})")
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    # ------------------------------------------------------------------ re-roling
    async def _rerole_loop(self) -> None:
        policy = self.config.rerole
        assert policy is not None and self._demand is not None
        while True:
            await asyncio.sleep(policy.interval_s)
            try:
                await self.rerole_once()
            except Exception:  # noqa: BLE001 - a failed round must not end the re-roling
                log.exception("re-roling")

    async def rerole_once(self) -> str | None:
        """One round of :mod:`pdkv.serving.rerole`: moves at most one worker; returns
        the role it moved to (None: nothing moved)."""
        policy = self.config.rerole
        assert policy is not None and self._demand is not None
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

    async def _rerole(self, src: _Pool, dst: _Pool) -> bool:
        """Drains the least-loaded worker of ``src`` (out of rotation, its requests
        finish), switches its role (``POST /pd/role``) and puts it into ``dst``."""
        policy = self.config.rerole
        assert policy is not None
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
                async with self._post(w.url + "/pd/role", {"role": dst.role, "timeout": left},
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

    # ------------------------------------------------------------------ discovery
    def _pool_for(self, role: str) -> _Pool | None:
        if self.config.mode is ProxyMode.COLOCATED:
            return self.decode if role == "colocated" else None
        return {"prefill": self.prefill, "decode": self.decode}.get(role)

    def _apply_registration(self, worker_id: str, record: dict[str, Any] | None) -> None:
        """A change under ``/pdkv/workers/`` (see :class:`~pdkv.serving.discovery.PoolWatch`):
        a serving worker enters rotation; a removed or draining one leaves it."""
        serving = record is not None and record.get("state") == "serving" and isinstance(record.get("url"), str)
        if not serving:
            for pool in (self.prefill, self.decode):
                for w in pool.remove(worker_id):
                    why = "deregistered or expired" if record is None else f"is {record.get('state')}"
                    log.info("%s worker %s (%s) %s: out of rotation", w.role, w.url, worker_id, why)
            self._update_model()
            return
        assert record is not None
        pool = self._pool_for(str(record.get("role")))
        if pool is None:
            log.debug("registered worker %s (%s) does not serve this proxy's %s mode", worker_id,
                      record.get("role"), self.mode)
            return
        try:
            url = _urls([record["url"]])[0]
        except (InvalidArgument, IndexError):
            log.warning("registered worker %s has an invalid URL %r: ignored", worker_id, record.get("url"))
            return
        if pool.add(url, worker_id):
            log.info("%s worker %s (%s) registered: into rotation", pool.role, url, worker_id)

    async def _discover_loop(self) -> None:
        while True:
            missing = [w for w in self._workers() if w.info is None]
            if missing:
                await asyncio.gather(*(self._fetch_info(w) for w in missing))
                self._update_model()
            await asyncio.sleep(0.2 if any(w.info is None for w in self._workers()) else 2.0)

    async def _fetch_info(self, w: _Worker) -> None:
        try:
            async with self._get(w.url + "/pd/info", timeout=aiohttp.ClientTimeout(total=2.0)) as r:
                if r.status != 200:
                    w.error = f"/pd/info answered HTTP {r.status}"
                    if r.status in (401, 403):
                        self._refused(w, r.status, "/pd/info")
                    return
                info = WorkerInfo.from_json(await r.json())
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, InvalidArgument) as e:
            w.error = f"{type(e).__name__}: {e}"
            return
        w.info = info
        w.error = ""
        if w.misconfigured and not w.misconfigured.startswith("is a "):
            w.misconfigured = ""  # it accepts our signature now
        log.info("%s worker %s: model %s, pid %d", info.role, w.url, info.model, info.pid)

    def _update_model(self) -> None:
        known = [w for w in self._workers() if w.info is not None]
        if not known:
            return
        ref = next((w.info for w in self.decode.workers if w.info is not None), None)
        if ref is None:
            return
        want_decode = ("colocated", "decode") if self.config.mode is ProxyMode.COLOCATED else ("decode",)
        for w in known:
            assert w.info is not None
            problem = ""
            want = want_decode if w.role == "decode" else ("prefill",)
            if w.info.role not in want:
                problem = f"is a {w.info.role} worker, expected {' or '.join(want)}"
                w.misconfigured = f"is a {w.info.role} worker, but is in the proxy's {w.role} pool"
            elif w.misconfigured.startswith("is a "):
                w.misconfigured = ""
            elif w.info.model != ref.model:
                problem = f"serves model {w.info.model!r}, the others {ref.model!r}"
            elif self.config.mode is not ProxyMode.COLOCATED and not w.info.kv_compatible(ref):
                problem = f"has a KV geometry ({w.info.kv}) that cannot exchange blocks with {ref.kv}"
            if problem and w.compatible:
                log.error("worker %s %s: not used", w.url, problem)
            w.compatible = not problem
            w.error = problem or w.error
        usable = [w.info for w in known if w.compatible and w.info is not None]
        dec = [i for i in (w.info for w in self.decode.workers if w.compatible) if i is not None]
        pre = [i for i in (w.info for w in self.prefill.workers if w.compatible) if i is not None]
        if not dec:
            return
        dcap = min(i.capacity_tokens for i in dec)
        pcap = min((i.capacity_tokens for i in pre), default=dcap)
        self._info = ModelInfo(ref.model, ref.vocab_size, min(i.max_model_len for i in usable),
                               min(dcap, pcap), dcap, aliases=ref.aliases)
        if not self._codec_loaded:
            self._codec_loaded = True
            self._tasks.append(asyncio.ensure_future(self._load_codec(ref)))

    async def _load_codec(self, ref: WorkerInfo) -> None:
        path = self.config.tokenizer or ref.model_dir
        if path and os.path.isdir(path) and any(os.path.exists(os.path.join(path, f))
                                                for f in ("tokenizer.json", "tokenizer_config.json",
                                                          "tokenizer.model")):
            try:
                self._codec = await asyncio.get_running_loop().run_in_executor(None, TextCodec.load, path)
            except Exception as e:  # noqa: BLE001 - serve token ids without a tokenizer
                log.warning("cannot load a tokenizer from %s (%s: %s); serving token-id prompts only", path,
                            type(e).__name__, e)
        else:
            log.warning("no tokenizer found (%s); serving token-id prompts only; pass --tokenizer DIR",
                        path or "the workers report no model directory")
        self._ready.set()

    # ------------------------------------------------------------------ Backend protocol
    def model_info(self) -> ModelInfo | None:
        return self._info if self._ready.is_set() else None

    def codec(self) -> TextCodec | None:
        return self._codec

    def health(self) -> tuple[bool, dict[str, Any]]:
        now = time.monotonic()
        ok = self._ready.is_set() and self.decode.any_up() and \
            (self.config.mode is ProxyMode.COLOCATED or self.prefill.any_up())
        workers = [{"url": w.url, "role": w.role, "up": w.usable(now), "in_flight": w.in_flight,
                    "served": w.served, "registered_as": w.registered_as, "error": w.error,
                    "switching": w.switching}
                   for w in self._workers()]
        links = self.link_health()
        bad = [{"url": w.url, "role": w.role, "problem": w.misconfigured} for w in self._workers() if w.misconfigured]
        out: dict[str, Any] = {"workers": workers, "model": self._info.name if self._info else None,
                               "peer_links": links, "misconfigured_workers": bad}
        if ok and (bad or any(not x["ok"] for x in links)):
            # serving, but KV between these pairs is recomputed, or some workers cannot serve their routes
            out["status"] = "degraded"
        return ok, out

    # ------------------------------------------------------------------ prefill -> decode links
    def link_health(self) -> list[dict[str, Any]]:
        """Each prefill -> decode worker pair seen so far: ``auth_failures``,
        ``transport_errors`` (counts), ``last_error`` and ``ok`` (the last KV transfer or
        link check between them succeeded)."""
        return [{"prefill": p, "decode": d, **v} for (p, d), v in sorted(self._links.items())]

    def _link_event(self, prefill: str, decode: str, error: str) -> str:
        """Records a transfer or check outcome between two workers ('' error: success);
        returns its kind: ok, auth, transport or other."""
        link = self._links.setdefault((prefill, decode), {"auth_failures": 0, "transport_errors": 0,
                                                          "last_error": "", "ok": True})
        if not error:
            link["ok"] = True
            return "ok"
        link["ok"] = False
        link["last_error"] = error
        kind = _error_kind(error)
        if kind == "auth":
            link["auth_failures"] += 1
            self.m_peer_auth.inc((prefill, decode))
        elif kind == "transport":
            link["transport_errors"] += 1
            self.m_peer_transport.inc((prefill, decode))
        return kind

    async def check_links(self, timeout: float) -> list[dict[str, Any]]:
        """Asks every prefill worker to connect to every decode worker's agent now
        (``/pd/check_peer``: metadata and transport handshake, both authenticated).
        Waits up to ``timeout`` s for the workers to report their info first; workers
        that do not are skipped. Returns the failed pairs (``prefill``, ``decode``,
        ``kind``, ``error``)."""
        if self.config.mode is ProxyMode.COLOCATED:
            return []
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while any(w.info is None for w in self._workers()) and loop.time() < end:
            await asyncio.sleep(0.1)

        async def check(p: _Worker, d: _Worker) -> dict[str, Any] | None:
            assert d.info is not None and d.info.agent is not None
            body = {"agent": d.info.agent.get("address", ""), "timeout": max(min(end - loop.time(), 10.0), 1.0)}
            for attempt in range(4):
                try:
                    async with self._post(p.url + "/pd/check_peer", body,
                                          timeout=aiohttp.ClientTimeout(total=body["timeout"] + 5)) as r:
                        res = await r.json(content_type=None) if r.status == 200 else \
                            {"ok": False, "error": f"/pd/check_peer answered HTTP {r.status}"}
                        if r.status in (401, 403):
                            self._refused(p, r.status, "/pd/check_peer")
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                    res = {"ok": False, "error": f"prefill worker unreachable: {type(e).__name__}: {e}"}
                err = "" if res.get("ok") else str(res.get("error") or "unknown error")
                # An agent briefly refuses a whole host after failed authentications
                # under many agent names there (guard.h): no verdict on this pair yet.
                if "too many failed authentications" not in err or attempt == 3:
                    break
                await asyncio.sleep(0.5 * (attempt + 1))
            kind = self._link_event(p.url, d.url, err)
            return None if kind == "ok" else {"prefill": p.url, "decode": d.url, "kind": kind, "error": err}

        pairs = [(p, d) for p in self.prefill.workers if p.info is not None and p.compatible
                 for d in self.decode.workers if d.info is not None and d.compatible and d.info.agent]
        got = await asyncio.gather(*(check(p, d) for p, d in pairs))
        return [x for x in got if x is not None]

    async def refresh_metrics(self) -> None:
        async def poll(w: _Worker) -> None:
            labels = (w.role, w.url)
            try:
                async with self._get(w.url + "/pd/stats", timeout=aiohttp.ClientTimeout(total=1.0)) as r:
                    st = await r.json() if r.status == 200 else None
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                st = None
            self.m_up.set(1 if st is not None else 0, labels)
            if isinstance(st, dict):
                w.stats = st
                self.m_queue.set(st.get("waiting", 0), labels)
                self.m_running.set(st.get("running", 0), labels)
                self.m_free.set(st.get("free_blocks", 0), labels)

        await asyncio.gather(*(poll(w) for w in self._workers()))

    def generate(self, rid: str, prompt: list[int], params: GenParams, trace: RequestTrace
                 ) -> AsyncIterator[TokenOut]:
        if self.config.mode is ProxyMode.COLOCATED or (self.config.mode is ProxyMode.HYBRID
                                                        and len(prompt) <= self.config.hybrid_threshold):
            self.m_routed.inc(("local",))
            return self._retrying(rid, prompt, params, trace, disagg=False)
        self.m_routed.inc(("disagg",))
        if self._demand is not None:
            self._demand.prefill(len(prompt))
        return self._traced(rid, trace, self._retrying(rid, prompt, params, trace, disagg=True))

    async def _traced(self, rid: str, trace: RequestTrace, gen: AsyncIterator[TokenOut]) -> AsyncIterator[TokenOut]:
        """``gen``, with ``trace`` findable by request id while it runs (see _kv_failed)."""
        self._traces[rid] = trace
        try:
            async for tok in gen:
                yield tok
        finally:
            self._traces.pop(rid, None)
            await gen.aclose()  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ routing
    def _mark_down(self, w: _Worker, why: str) -> None:
        """Takes ``w`` out of rotation for ``down_cooldown_s``. One failure is counted
        per fall out of rotation: the requests that were waiting on a worker a probe
        just took out report the same failure again."""
        now = time.monotonic()
        in_rotation = w.alive and now >= w.down_until
        w.down_until = now + self.config.down_cooldown_s
        if not in_rotation:
            return
        w.error = why
        self.m_failures.inc((w.role, w.url))
        log.warning("%s worker %s failed (%s); out of rotation for %.1f s", w.role, w.url, why,
                    self.config.down_cooldown_s)

    async def _retrying(self, rid: str, prompt: list[int], params: GenParams, trace: RequestTrace, *,
                        disagg: bool) -> AsyncIterator[TokenOut]:
        """Serves the request on one decode worker after another until one completes it.

        A worker that fails before any token was sent is simply replaced. One that
        fails after ``sent`` tokens is replaced by a *migration*: the next worker
        prefills ``prompt + sent`` itself and continues with ``max_tokens`` reduced by
        ``len(sent)`` and ``index_offset`` raised by it (the same seed, so the same
        random draws); the client's stream (detokenizer, stop strings, usage) goes on
        as if nothing happened.
        """
        exclude: set[str] = set()
        sent: list[int] = []
        finished = False
        last = ""
        for attempt in range(self.config.retries + 1):
            d = self.decode.pick(exclude)
            if d is None:
                break
            arid = rid if attempt == 0 else f"{rid}.r{attempt}"
            trace.decode_worker = d.url
            if sent:
                left = params.max_tokens - len(sent)
                if left < 1:  # cannot happen (the last token carries the finish reason)
                    yield TokenOut(None, "length")
                    return
                trace.route = "local"
                trace.extra["migrated_after_tokens"] = len(sent)
                self.m_migrations.inc()
                log.warning("request %s: continuing on decode worker %s after %d tokens (%s)", rid, d.url,
                            len(sent), last)
                gen = self._local_on(d, arid, prompt + sent, dataclasses.replace(
                    params, max_tokens=left, index_offset=params.index_offset + len(sent)), trace)
            else:
                trace.route = "disagg" if disagg else "local"
                gen = self._disagg_on(d, arid, prompt, params, trace) if disagg else \
                    self._local_on(d, arid, prompt, params, trace)
            try:
                async for tok in gen:
                    if tok.token_id is not None:
                        sent.append(tok.token_id)
                        if self._demand is not None and (len(sent) > 1 or not disagg):
                            self._demand.decode_tokens()  # disagg: the first token is the prefill's
                    finished = finished or tok.finish_reason is not None
                    yield tok
                return
            except _WorkerBusy as e:
                last = f"{d.url}: {e}"
            except _WorkerFailed as e:
                last = f"{e.worker.url}: {e}"
                self._mark_down(e.worker, str(e))
                if finished:
                    return  # the answer is complete: only the worker's statistics were lost
            finally:
                await gen.aclose()
            exclude.add(d.url)
            trace.retries += 1
            self.m_retries.inc()
        if sent:
            raise APIError(502, f"no decode worker is left to continue the stream after {len(sent)} tokens "
                           f"(last error: {last})", code="worker_failed")
        raise APIError(503, f"no decode worker could serve the request"
                       f"{' (last error: ' + last + ')' if last else ' (none is available)'}",
                       code="no_worker_available")

    async def _open_stream(self, d: _Worker, path: str, body: dict) -> aiohttp.ClientResponse:
        """POSTs ``body`` to a decode/engine worker and returns its 200 streaming response;
        a request the worker never received raises _WorkerFailed (safe to retry)."""
        try:
            r = await self._bounded(d, self._post(d.url + path, body, timeout=self._timeout()),
                                    self.config.headers_timeout_s, "response headers")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise _WorkerFailed(d, f"{type(e).__name__}: {e}", before_response=True) from None
        try:
            await self._check_status(d, r)
        except BaseException:
            _done_with(r)
            raise
        return r

    async def _check_status(self, w: _Worker, r: aiohttp.ClientResponse) -> None:
        if r.status == 200:
            return
        try:
            body = await r.json(content_type=None)
            msg = body["error"]["message"]
        except (ValueError, KeyError, TypeError, aiohttp.ClientError):
            msg = f"HTTP {r.status}"
        if r.status == 503:
            raise _WorkerBusy(msg)
        if r.status in (401, 403):
            self._refused(w, r.status, r.url.path)
            raise _WorkerFailed(w, f"HTTP {r.status}: {msg}", before_response=True)
        if 400 <= r.status < 500:
            raise APIError(400 if r.status != 409 else 409, f"{w.role} worker refused the request: {msg}",
                           code="invalid_request")
        raise _WorkerFailed(w, f"HTTP {r.status}: {msg}")

    async def _lines(self, w: _Worker, r: aiohttp.ClientResponse, timeout: float, what: str
                     ) -> AsyncIterator[dict[str, Any]]:
        """The NDJSON lines of worker ``w``'s response, each awaited for at most
        ``timeout`` s (see :meth:`_bounded`); transport failures become
        :class:`_WorkerFailed`."""
        lines = ndjson_lines(r.content, timeout=None)
        try:
            while True:
                try:
                    line = await self._bounded(w, _next(lines), timeout, what)
                except (aiohttp.ClientError, ConnectionError, OSError) as e:
                    raise _WorkerFailed(w, f"{type(e).__name__}: {e}") from None
                if line is _END:
                    return
                yield line
        finally:
            await lines.aclose()  # type: ignore[attr-defined]

    @contextlib.asynccontextmanager
    async def _decode_stream(self, d: _Worker, path: str, body: dict) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """Opens decode worker ``d``'s NDJSON stream at ``path`` (counted in its
        ``in_flight``) and yields its lines."""
        d.in_flight += 1
        try:
            r = await self._open_stream(d, path, body)
            try:
                yield self._lines(d, r, self.config.read_timeout_s, "token")
            finally:
                _done_with(r)
        finally:
            d.in_flight -= 1

    async def _local_on(self, d: _Worker, rid: str, prompt: list[int], params: GenParams, trace: RequestTrace
                        ) -> AsyncIterator[TokenOut]:
        body = GenerateRequest(rid, tuple(prompt), params).to_json()
        async with self._decode_stream(d, "/pd/generate", body) as lines:
            async for line in lines:
                _raise_worker_error(d, line)
                if "done" in line:
                    d.served += 1
                    trace.extra.update(_dict(line["done"]))
                    return
                if "t" in line or "f" in line:
                    yield TokenOut(line.get("t"), line.get("f"))
            raise _WorkerFailed(d, "the stream ended before the request finished")

    async def _disagg_on(self, d: _Worker, rid: str, prompt: list[int], params: GenParams, trace: RequestTrace
                         ) -> AsyncIterator[TokenOut]:
        body = GenerateRequest(rid, tuple(prompt), params, self.config.kv_timeout_s).to_json()
        async with self._decode_stream(d, "/pd/decode", body) as lines:
            try:
                first = await lines.__anext__()
            except StopAsyncIteration:
                raise _WorkerFailed(d, "the decode worker closed the stream before reserving") from None
            _raise_worker_error(d, first)
            try:
                res = Reservation.from_json(first.get("reserved"))
            except InvalidArgument as e:
                raise _WorkerFailed(d, f"bad reservation: {e}") from None
            out = _PrefillOutcome()
            async for tok in self._prefill(rid, prompt, params, res, trace, out):
                yield tok
            if not out.kv_ok:
                await self._kv_failed(d, KVFailed(rid, out.first_token, out.error, out.terminal))
            next_index = 0 if out.first_token is None else 1
            finished = out.finish is not None
            async for line in lines:
                _raise_worker_error(d, line)
                if "done" in line:
                    done = _dict(line["done"])
                    d.served += 1
                    if done.get("recomputed"):
                        trace.recomputed = True
                        trace.recompute_reason = str(done.get("recompute_reason", ""))
                        self.m_recompute.inc((trace.recompute_reason or "unknown",))
                        if not trace.kv_error:  # e.g. the KV timed out: the decode worker says why
                            trace.kv_error = str(done.get("kv_error") or trace.recompute_reason or "")
                    trace.extra["kv_wait_s"] = done.get("kv_wait_s")
                    return
                if "t" in line:
                    i = int(line.get("i", next_index))
                    if i < next_index:
                        continue  # already sent (the prefill side's first token)
                    next_index = i + 1
                if finished or not ("t" in line or "f" in line):
                    continue
                finished = line.get("f") is not None
                yield TokenOut(line.get("t"), line.get("f"))
            raise _WorkerFailed(d, "the stream ended before the request finished")

    async def _kv_failed(self, d: _Worker, kf: KVFailed) -> None:
        trace = self._traces.get(kf.rid.split(".r", 1)[0])
        if trace is not None and not trace.kv_error:
            trace.kv_error = kf.error or "the KV did not arrive (no reason given)"  # the recompute's cause
        try:
            async with self._post(d.url + "/pd/kv_failed", kf.to_json(),
                                  timeout=aiohttp.ClientTimeout(total=self.config.connect_timeout_s + 2)) as r:
                await r.read()
                if r.status in (401, 403):
                    self._refused(d, r.status, "/pd/kv_failed")
                if r.status != 200:
                    raise _WorkerFailed(d, f"/pd/kv_failed answered HTTP {r.status}")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise _WorkerFailed(d, f"{type(e).__name__}: {e}") from None

    async def _prefill(self, rid: str, prompt: list[int], params: GenParams, res: Reservation,
                       trace: RequestTrace, out: _PrefillOutcome) -> AsyncIterator[TokenOut]:
        """Runs the prompt on a prefill worker: yields the first token, fills ``out``.

        Never raises for a prefill-side failure: ``out.kv_ok`` stays False and the
        caller makes the decode worker recompute.
        """
        cfg = self.config
        body = PrefillRequest(rid, tuple(prompt), params, res, cfg.kv_timeout_s).to_json()
        exclude: set[str] = set()
        out.error = "no prefill worker is available"
        for _attempt in range(cfg.retries + 1):
            p = self.prefill.pick(exclude)
            if p is None:
                return
            trace.prefill_worker = p.url
            p.in_flight += 1
            p.load_tokens += len(prompt)
            waiting = True
            try:
                try:
                    r = await self._bounded(p, self._post(p.url + "/pd/prefill", body, timeout=self._timeout()),
                                            cfg.headers_timeout_s, "response headers")
                except (aiohttp.ClientError, OSError) as e:
                    # It never got the request: no write can come from it; try another.
                    self._mark_down(p, f"{type(e).__name__}: {e}")
                    exclude.add(p.url)
                    out.error = f"prefill worker {p.url}: {type(e).__name__}: {e}"
                    self.m_retries.inc()
                    continue
                try:
                    if r.status != 200:
                        if r.status in (401, 403):
                            self._refused(p, r.status, "/pd/prefill")
                            self._mark_down(p, f"/pd/prefill answered HTTP {r.status}")
                        out.error = f"prefill worker {p.url} answered HTTP {r.status}: {await r.text()}"[:500]
                        out.terminal = True
                        self.m_kv.inc(("failed",))
                        return
                    async for line in self._lines(p, r, cfg.kv_timeout_s, "first token or KV result"):
                        if "first" in line:
                            f = _dict(line["first"])
                            out.first_token = int(f["t"])
                            out.finish = f.get("f")
                            waiting = False
                            p.load_tokens -= len(prompt)
                            yield TokenOut(out.first_token, out.finish)
                        elif "kv" in line:
                            kv = KVResult.from_json(line["kv"])
                            self._record_kv(kv, trace)
                            out.kv_ok, out.terminal, out.error = kv.ok, True, kv.error
                            p.served += 1
                            return
                        elif "error" in line:
                            out.error = f"prefill worker {p.url}: {_msg(line)}"
                            out.terminal = True  # it failed before writing anything
                            self.m_kv.inc(("failed",))
                            return
                    raise _WorkerFailed(p, "the stream ended before the KV result")
                finally:
                    _done_with(r)
            except _WorkerFailed as e:
                # It had the request: a write may still come, so the decode worker must
                # not reuse the blocks at once (terminal=False).
                self._mark_down(p, str(e))
                out.error = f"prefill worker {p.url}: {e}"
                out.terminal = False
                self.m_kv.inc(("failed",))
                return
            finally:
                p.in_flight -= 1
                if waiting:
                    p.load_tokens -= len(prompt)

    def _record_kv(self, kv: KVResult, trace: RequestTrace) -> None:
        if trace.prefill_worker and trace.decode_worker and (kv.posted or kv.error):
            self._link_event(trace.prefill_worker, trace.decode_worker, "" if kv.ok else kv.error)
        trace.kv_bytes = kv.bytes
        trace.kv_seconds = kv.seconds
        trace.kv_tail_seconds = kv.tail_seconds
        trace.kv_wire_seconds = kv.wire_seconds
        trace.kv_transport = kv.transport
        trace.kv_error = kv.error
        if kv.ok:
            self.m_kv.inc(("ok" if kv.posted else "none",))
            if kv.posted and kv.bytes:
                self.m_kv_bytes.inc((kv.transport,), kv.bytes)
                self.m_kv_time.observe(kv.seconds, (kv.transport,))
                self.m_kv_tail.observe(kv.tail_seconds, (kv.transport,))
                self.m_kv_wire_time.observe(kv.wire_seconds, (kv.transport,))
        else:
            self.m_kv.inc(("failed",))


_TRANSPORT_ERRORS = ("PeerConnectionError", "TransferTimeout", "ProtocolError", "VersionMismatch", "StalePeer",
                     "prefill worker unreachable")


def _error_kind(error: str) -> str:
    """The kind of a KV error as the prefill worker words it (``"Type: message"``)."""
    if error.startswith("AuthFailed"):
        return "auth"
    if error.startswith(_TRANSPORT_ERRORS):
        return "transport"
    return "other"


def _done_with(r: aiohttp.ClientResponse) -> None:
    """Returns the connection to the pool if the body was read to the end, else closes
    it (the worker sees the disconnect and cancels the request)."""
    if r.content.at_eof():
        r.release()
    else:
        r.close()


def _raise_worker_error(d: _Worker, line: dict[str, Any]) -> None:
    """An ``{"error": ...}`` line from decode worker ``d``: the request's fault (4xx)
    goes to the client as is; the worker's fault raises :class:`_WorkerBusy` (out of
    KV blocks: it stays in rotation) or :class:`_WorkerFailed`, and the stream is
    continued on another worker like that of a dead one."""
    if "error" not in line:
        return
    err = StreamError.from_line(line)
    if err.request_fault:
        raise APIError(err.status, f"decode worker {d.url}: {err.message}", code=err.code)
    if err.code in BUSY_CODES:
        raise _WorkerBusy(f"{err.code}: {err.message}")
    raise _WorkerFailed(d, f"it ended the stream with {err.code}: {err.message}")


def _msg(line: dict[str, Any]) -> str:
    err = line.get("error")
    if isinstance(err, dict):
        return str(err.get("message", err))
    return str(err)


def _dict(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


_END = object()


async def _next(it: AsyncIterator[Any]) -> Any:
    try:
        return await it.__anext__()
    except StopAsyncIteration:  # not through a Task: return a marker instead
        return _END


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
        if self.backend._pool_watch is not None:
            try:
                await self.backend._pool_watch.announce(self.url, self.config.mode.value)
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
