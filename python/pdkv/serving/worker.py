"""Prefill, decode and colocated workers: one engine behind an aiohttp server.

A :class:`Worker` owns one :class:`~pdkv.serving.engine.Engine`, stepped by a
background thread, and serves the worker protocol of :mod:`pdkv.serving.protocol`:

``prefill``
    ``/pd/prefill``: runs the prompt prefill-only, answers the first token at once,
    and **pushes** the prompt's KV blocks into the decode worker's reserved blocks:
    layer by layer while the prompt computes (``stream_layers``, the default: a
    :meth:`pdkv.Agent.open_stream` fed by the engine's layer sink), or with one
    :meth:`pdkv.Agent.write` after the prefill. Either way the notification (carrying
    the first token and the seed) reaches the decode worker after the last byte
    landed. Its blocks are released when the write is over.
``decode``
    ``/pd/decode``: reserves blocks, hands out their ids and its agent's address,
    waits for the notification and continues decoding with continuous batching. If
    the KV does not come (``/pd/kv_failed`` from the proxy, or a timeout) it
    recomputes the prompt locally and the request still completes. Also
    ``/pd/generate`` (prefill locally: hybrid mode's short prompts).
``colocated``
    ``/pd/generate`` plus the OpenAI API itself (``/v1/...``), so one process is a
    complete server (``pdkv serve colocated``).

Both prefill and decode workers keep their KV pool in memory their pdkv agent
allocates (:meth:`PagedKVPool.shared`), so a worker on the same host is reached with
the ``shm`` transport (one memcpy) and others over tcp.

The KV hand-off itself (reservations, generations, pushes, releases) is
:mod:`pdkv.serving.handoff` (:class:`~pdkv.serving.handoff.KVSender` in a prefill
worker, :class:`~pdkv.serving.handoff.KVReceiver` in a decode worker), which knows no
HTTP; the handlers (:mod:`pdkv.serving.worker_handlers`) parse requests, stream NDJSON
and map errors to statuses.

A stream that fails after it started ends with an ``{"error": ...}`` line
(:class:`~pdkv.serving.protocol.StreamError`) whose code says whose fault it is; the
proxy continues the stream elsewhere when it is the worker's.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import os
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from aiohttp import web

import pdkv
from pdkv.errors import InvalidArgument

from ..credential import Credential
from ..discovery import Registry as DiscoveryRegistry
from .aio import HttpServer
from .auth import DEFAULT_MAX_NONCES, DEFAULT_WINDOW_S, WorkerAuth
from .discovery import RoleSwitch, WorkerRegistration
from .engine import Engine, EngineConfig, FinishReason
from .frontend import OpenAIFrontend, RequestTrace, TokenOut, openai_error_middleware
from .handoff import KVReceiver, KVSender, peer_label
from .kv_events import serve_kv_events
from .kv_pull import LeaseTable, PullConfig
from .kv_pool import PagedKVPool
from .limits import ServerLimits, read_body
from .metrics import CONTENT_TYPE, Registry
from .openai_api import APIError, ModelInfo, TextCodec, body_limit
from .protocol import STREAM_ERROR_STATUS, GenParams, ProtocolLimits, WorkerInfo
from .roles import WorkerRole
from .sampling import SamplingParams
from .worker_handlers import EngineEvents, ProtocolHandlers, failure_message

__all__ = ["LocalBackend", "Worker", "WorkerConfig", "WorkerRole"]

log = logging.getLogger("pdkv.serving")

#: Seconds the evict hook waits for transfers still reading blocks it invalidates.
EVICT_BUMP_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class WorkerConfig:
    """A worker's settings.

    Attributes
    ----------
    role : WorkerRole or str
    engine : EngineConfig
    model_name : str
        The name clients use for the model (listed by ``/v1/models``).
    model_aliases : tuple of str
        Other names clients may use (``pdkv serve``: the ``--model`` argument as given).
    agent_listen : str
        ``host:port`` of the pdkv agent (prefill and decode; use an address the other
        workers can reach).
    agent_advertise : str, optional
        The address a decode worker tells prefill workers to connect to (default: its
        agent's own address); for NAT or port forwarding.
    secret : str, optional
        pdkv secret shared by every prefill and decode worker (default
        ``$PDKV_SECRET``; one of them is required).
    kv_margin_s : float
        Decode: how much longer than the request's ``kv_timeout_s`` to wait for the KV.
    reserve_wait_s : float
        Decode: how long a request may wait for free blocks before a 503.
    stream_layers : bool
        Prefill: stream each layer's KV to the decode worker while later layers compute
        (default); False pushes the whole KV with one write after the prefill.
    kv_compress : pdkv.TcpCompression, optional
        Prefill: compression of the KV it pushes over tcp (docs/compression.md): its
        ``mode`` (``off``, ``lossless``, ``fp8``, ``auto``), ``policy``, ``codec``,
        ``level``, ``checksum``, ``chunk_bytes`` and ``threads`` are used as given; the
        KV's ``dtype`` and the FP8 grouping (``fp8_heads`` = KV heads, ``fp8_head_dim``,
        ``fp8_rows_per_group`` = block tokens: one scale per block per head) are set
        from the worker's pool. Applies to streamed and one-write pushes alike; only
        tcp compresses (same-host peers use shm unless ``transports`` excludes it), and
        GPU pools go plain. Default: off.
    transports : tuple of str, optional
        Prefill and decode: the agent's transports in order of preference (default:
        every available one; ``("tcp",)`` makes same-host workers talk over tcp, e.g.
        to compress between them).
    debug_drop_kv : bool
        Prefill, testing only: skip the KV write and its notification but report
        success (the decode worker then times out and recomputes).
    debug_error_after : int, optional
        Decode and colocated, testing only: every token stream of the worker protocol
        (``/pd/generate``, ``/pd/decode``) ends after this many token lines with an
        ``{"error": ...}`` line of code ``debug_error_code``, as if the worker failed
        there (fault injection for the proxy's migration).
    debug_error_code : str
        The code of that line (a key of
        :data:`~pdkv.serving.protocol.STREAM_ERROR_STATUS`; default
        ``"internal_error"``).
    max_body_bytes : int, optional
        Largest request body, for the OpenAI routes (colocated) and the worker protocol
        alike (413 above). Default: from the model's context
        (:func:`~pdkv.serving.openai_api.body_limit`).
    limits : ServerLimits
        Connection limit and idle/header/body deadlines of the HTTP server.
    registry : str, optional
        ``etcd://host:port``: register under ``/pdkv/workers/<id>`` (role, model,
        capacity, load) with a lease of ``registry_ttl`` seconds, and serve ``/pd/drain``
        (see :mod:`pdkv.serving.discovery`, docs/discovery.md).
    registry_ttl : int
        Seconds a registration outlives the worker's last refresh (>= 2).
    accepted_secrets : tuple of str
        Further secrets whose signatures the worker's ``/pd/*`` routes accept (rotation;
        default ``$PDKV_ACCEPTED_SECRETS``). The agent proves ``secret`` only.
    auth_window_s : float
        Seconds a signed call's timestamp may be off this worker's clock
        (:mod:`pdkv.serving.auth`).
    auth_max_nonces : int
        Signed calls remembered at once for replay detection (each for twice
        ``auth_window_s``); past it signed calls get 503 until older ones expire.
    protocol_limits : ProtocolLimits
        Caps on the timeouts, sizes and counts in ``/pd/*`` bodies (400 above), e.g.
        ``max_kv_timeout_s`` (default 60 s).
    prefix_cache : bool
        Cache the KV of full blocks and reuse it for prompts that start with the same
        tokens (overrides ``engine.prefix_cache``; default on). Blocks handed to peers
        get their pdkv generations bumped before they are reused.
    cache_salt : str
        The salt of the block hashes (16 hex digits; default: ``engine.cache_salt``, or
        derived from the model, block size and dtype). Workers share KV only when their
        salts are equal.
    kv_pull : PullConfig
        Prefill: when to read a prompt's prefix from the worker that holds it instead
        of computing it (:mod:`pdkv.serving.kv_pull`; ``pdkv serve prefill --kv-pull``).
    max_kv_leases : int
        Prefill and decode: leases on this worker's cached blocks (``/pd/kv_lease``)
        live at once; past it a lease is refused (503).
    """

    role: WorkerRole
    engine: EngineConfig
    model_name: str
    model_aliases: tuple[str, ...] = ()
    agent_listen: str = "127.0.0.1:0"
    agent_advertise: str | None = None
    secret: str | None = None
    kv_margin_s: float = 2.0
    reserve_wait_s: float = 60.0
    stream_layers: bool = True
    kv_compress: pdkv.TcpCompression | None = None
    transports: tuple[str, ...] | None = None
    debug_drop_kv: bool = False
    debug_error_after: int | None = None
    debug_error_code: str = "internal_error"
    max_body_bytes: int | None = None
    limits: ServerLimits = field(default_factory=ServerLimits)
    registry: str | None = None
    registry_ttl: int = 10
    accepted_secrets: tuple[str, ...] | None = None
    auth_window_s: float = DEFAULT_WINDOW_S
    auth_max_nonces: int = DEFAULT_MAX_NONCES
    protocol_limits: ProtocolLimits = field(default_factory=ProtocolLimits)
    prefix_cache: bool = True
    cache_salt: str = ""
    kv_pull: PullConfig = field(default_factory=PullConfig)
    max_kv_leases: int = 1024

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "role", WorkerRole(self.role))
        except ValueError:
            raise InvalidArgument(f"role must be one of {[r.value for r in WorkerRole]}, got {self.role!r}") \
                from None
        if not self.model_name:
            raise InvalidArgument("model_name is empty")
        object.__setattr__(self, "model_aliases", tuple(a for a in self.model_aliases if a and a != self.model_name))
        if not 0 < self.auth_window_s <= 3600:
            raise InvalidArgument(f"auth_window_s must be in (0, 3600], got {self.auth_window_s!r}")
        if not isinstance(self.auth_max_nonces, int) or self.auth_max_nonces < 1:
            raise InvalidArgument(f"auth_max_nonces must be an integer >= 1, got {self.auth_max_nonces!r}")
        if not isinstance(self.protocol_limits, ProtocolLimits):
            raise InvalidArgument("protocol_limits must be a ProtocolLimits")
        if not isinstance(self.kv_pull, PullConfig):
            raise InvalidArgument("kv_pull must be a PullConfig")
        if not isinstance(self.max_kv_leases, int) or isinstance(self.max_kv_leases, bool) or self.max_kv_leases < 1:
            raise InvalidArgument(f"max_kv_leases must be an integer >= 1, got {self.max_kv_leases!r}")
        for k in ("kv_margin_s", "reserve_wait_s"):
            if not getattr(self, k) >= 0:
                raise InvalidArgument(f"{k} must be >= 0, got {getattr(self, k)!r}")
        if self.max_body_bytes is not None and (not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1):
            raise InvalidArgument(f"max_body_bytes must be an integer >= 1, got {self.max_body_bytes!r}")
        if self.debug_error_after is not None and (not isinstance(self.debug_error_after, int)
                                                   or isinstance(self.debug_error_after, bool)
                                                   or self.debug_error_after < 0):
            raise InvalidArgument(f"debug_error_after must be an integer >= 0, got {self.debug_error_after!r}")
        if self.kv_compress is not None and not isinstance(self.kv_compress, pdkv.TcpCompression):
            raise InvalidArgument(f"kv_compress must be a pdkv.TcpCompression, got {type(self.kv_compress).__name__}")
        if self.transports is not None:
            if isinstance(self.transports, str) or not self.transports:
                raise InvalidArgument(f"transports must be a non-empty sequence of names, got {self.transports!r}")
            object.__setattr__(self, "transports", tuple(self.transports))
        if self.registry is not None:  # checked here: before a CLI loads the model
            DiscoveryRegistry(self.registry, ttl=self.registry_ttl)
        if not isinstance(self.prefix_cache, bool):
            raise InvalidArgument(f"prefix_cache must be a bool, got {self.prefix_cache!r}")
        if not isinstance(self.engine, EngineConfig):
            raise InvalidArgument(f"engine must be an EngineConfig, got {type(self.engine).__name__}")
        # EngineConfig checks the salt (16 lowercase hex digits or empty).
        object.__setattr__(self, "engine", dataclasses.replace(
            self.engine, prefix_cache=self.prefix_cache, cache_salt=self.cache_salt or self.engine.cache_salt))
        if self.debug_error_code not in STREAM_ERROR_STATUS:
            raise InvalidArgument(f"debug_error_code must be one of {sorted(STREAM_ERROR_STATUS)}, "
                                  f"got {self.debug_error_code!r}")


def lossy_compression(requested: pdkv.TcpCompression | None) -> bool:
    """True when pushes with ``requested`` compression may be lossy (fp8)."""
    if requested is None:
        return False
    mode = str(requested.mode)
    return mode == "fp8" or (mode == "auto" and str(requested.policy) == "lossy-allowed")


def kv_compression(requested: pdkv.TcpCompression | None, geometry: pdkv.KVGeometry) -> pdkv.TcpCompression:
    """``requested`` (a copy; default: off) with the KV's dtype and the FP8 grouping of
    ``geometry``'s NHD blocks: one scale per block (``block_tokens`` rows) per KV head."""
    z = pdkv.TcpCompression() if requested is None else copy.copy(requested)
    z.dtype = geometry.dtype
    z.fp8_heads = geometry.kv_heads
    z.fp8_head_dim = geometry.head_dim
    z.fp8_rows_per_group = geometry.block_tokens
    return z


class Worker:
    """One engine served over HTTP in a prefill, decode or colocated role.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        Loaded with the engine's paged attention (:func:`pdkv.serving.load_model`).
    config : WorkerConfig
    codec : TextCodec, optional
        The tokenizer (a colocated worker needs it for text prompts).
    model_dir : str
        Reported in ``/pd/info`` (the proxy loads the tokenizer from it if it can).
    block_order : sequence of int, optional
        Initial free-list order of the KV pool (tests scatter blocks with it).

    Notes
    -----
    :meth:`start` creates the agent, the pool, the engine, its stepping thread and the
    KV hand-off (a :class:`~pdkv.serving.handoff.KVSender` in a prefill worker, a
    :class:`~pdkv.serving.handoff.KVReceiver` in a decode worker); :meth:`close` stops
    them. Run it with :func:`pdkv.serving.aio.run_until_signal` or
    :class:`pdkv.serving.aio.ServerThread`.
    """

    def __init__(self, model: Any, config: WorkerConfig, *, codec: TextCodec | None = None, model_dir: str = "",
                 block_order: Any = None) -> None:
        self.model = model
        self.config = config
        self.codec = codec
        self.model_dir = str(model_dir)
        self.block_order = block_order
        self.agent: pdkv.Agent | None = None
        self.engine: Engine | None = None
        self.sender: KVSender | None = None      # prefill
        self.receiver: KVReceiver | None = None  # decode
        self.leases: LeaseTable | None = None    # prefill and decode: readers' leases on cached blocks
        self.url = ""
        self.registry = Registry()
        self._http: HttpServer | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._tasks: list[asyncio.Task] = []
        # Threads that wait for transfers and connect to peers (blocking native calls).
        self._executor = ThreadPoolExecutor(max_workers=16, thread_name_prefix="pdkv-wait")
        self.in_flight = 0  # requests its handlers serve now
        self._closed = False
        self._body_limit = body_limit(None, config.max_body_bytes)
        self._setup_metrics()
        self._role = config.role  # prefill <-> decode may switch (RoleSwitch, POST /pd/role)
        # Who may call /pd/*: the cluster credential (None: nobody; see pdkv.serving.auth).
        self.credential = Credential.from_env(config.secret, config.accepted_secrets)
        self.m_auth_refused = self.registry.counter(
            "pdkv_http_auth_refusals_total", "Calls to /pd/* refused by the signature check, by problem.",
            ("problem",))
        self.auth = WorkerAuth(self.credential, self.read_raw, window_s=config.auth_window_s,
                               max_nonces=config.auth_max_nonces,
                               on_refuse=lambda problem: self.m_auth_refused.inc((problem,)))
        self.registration = None if config.registry is None else WorkerRegistration(
            self, DiscoveryRegistry(config.registry, ttl=config.registry_ttl, credential=self.credential))

    # ------------------------------------------------------------------ lifecycle
    @property
    def role(self) -> WorkerRole:
        return self._role

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Builds the agent, pool and engine, starts stepping and serving; returns the URL."""
        cfg = self.config
        pool = self._make_agent_and_pool() if cfg.role is not WorkerRole.COLOCATED else None
        self.engine = Engine(self.model, cfg.engine, block_order=self.block_order, pool=pool)
        if self.agent is not None:  # a cached block handed to a peer is never reused under its old generation
            agent = self.agent
            self.engine.set_evict_hook(lambda ids: agent.bump_generations("kv", ids, timeout=EVICT_BUMP_TIMEOUT_S))
        self._thread = threading.Thread(target=self._step_loop, name=f"engine-{cfg.role.value}", daemon=True)
        self._thread.start()
        if self.agent is not None:
            self.leases = LeaseTable(self.agent, self.engine, address=self.agent_address,
                                     max_leases=cfg.max_kv_leases, registry=self.registry)
            self._tasks.append(asyncio.ensure_future(self.leases.run()))
        self._start_handoff()
        self._body_limit = body_limit(self.model_info(), cfg.max_body_bytes)
        app = web.Application(client_max_size=self._body_limit)
        self._routes(app)
        if self.registration is not None:
            self.registration.add_routes(app)
        app.middlewares.insert(0, self.auth.middleware)  # outermost: before any gate or handler
        self._http = HttpServer(app, limits=cfg.limits)
        self.url = await self._http.start(host, port)
        if self.registration is not None:
            await self.registration.start()
        log.info("%s worker serving %s on %s%s", cfg.role.value, cfg.model_name, self.url,
                 f" (pdkv agent {self.agent.name} at {self.agent_address})" if self.agent else "")
        return self.url

    def _start_handoff(self) -> None:
        """The KV hand-off side of the current role. A side stays when the role switches
        away (see :meth:`switch_role`), so switching back reuses it."""
        cfg = self.config
        if self._role is WorkerRole.PREFILL and self.sender is None:
            assert self.agent is not None and self.engine is not None
            self.sender = KVSender(self.agent, self.engine, executor=self._executor, registry=self.registry,
                                   drop_kv=cfg.debug_drop_kv, stream_layers=cfg.stream_layers, pull=cfg.kv_pull,
                                   lossy_kv=lossy_compression(cfg.kv_compress))
        if self._role is WorkerRole.DECODE and self.receiver is None:
            assert self.agent is not None and self.engine is not None
            self.receiver = KVReceiver(self.agent, self.engine, executor=self._executor, address=self.agent_address,
                                       registry=self.registry)
            self._tasks.append(asyncio.ensure_future(self.receiver.run_notifications()))

    def switch_role(self, role: WorkerRole) -> None:
        """Prefill <-> decode, for an idle worker (:class:`~pdkv.serving.discovery.RoleSwitch`
        drains it first): both roles share the agent, the pool and the engine."""
        if self._role is WorkerRole.COLOCATED or role is WorkerRole.COLOCATED:
            raise InvalidArgument("only prefill and decode workers switch roles")
        self._role = role
        self._start_handoff()

    def _make_agent_and_pool(self) -> PagedKVPool:
        """Prefill and decode: the pdkv agent and a KV pool registered with it (in memory
        the agent allocates on CPU, so same-host peers use shm)."""
        cfg = self.config
        secret = cfg.secret if cfg.secret is not None else os.environ.get("PDKV_SECRET")
        if not secret:
            raise InvalidArgument("prefill and decode workers need a shared pdkv secret: set PDKV_SECRET "
                                  "(the same value in every prefill and decode worker) or pass --secret")
        name = f"{cfg.role.value}-{os.getpid()}-{secrets.token_hex(3)}"
        param = next(self.model.parameters())
        geometry = pdkv.KVGeometry.from_hf_config(self.model.config, num_blocks=cfg.engine.num_blocks,
                                                  block_tokens=cfg.engine.block_tokens, dtype=param.dtype)
        tcp = pdkv.TcpOptions(compress=kv_compression(cfg.kv_compress, geometry))
        self.agent = pdkv.Agent(name, secret=secret, accepted_secrets=cfg.accepted_secrets, listen=cfg.agent_listen,
                                transports=cfg.transports, options=[tcp])
        if param.device.type == "cpu":
            pool = PagedKVPool.shared(self.agent, geometry, block_order=self.block_order)
        else:
            pool = PagedKVPool(geometry, device=param.device, block_order=self.block_order)
            pool.register(self.agent)
        self.block_order = None  # the pool has it
        return pool

    async def close(self) -> None:
        """Stops serving, aborts what runs, stops the engine thread, closes the agent."""
        if self._closed:
            return
        self._closed = True
        if self.registration is not None:  # proxies stop routing here first
            await self.registration.close()
        if self._http is not None:
            await self._http.close()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - shutting down
                pass
        for side in (self.sender, self.receiver):
            if side is not None:
                await side.close()
        if self.leases is not None:
            self.leases.close()
        self._stop.set()
        loop = asyncio.get_running_loop()
        if self._thread is not None:
            await loop.run_in_executor(None, self._thread.join)
        if self.agent is not None:
            agent, self.agent = self.agent, None
            await loop.run_in_executor(None, agent.close)
        self._executor.shutdown(wait=True)

    def _step_loop(self) -> None:
        engine = self.engine
        assert engine is not None
        while not self._stop.is_set():
            if not engine.wait_for_work(0.1):
                continue
            try:
                stats = engine.step()
                if stats is not None and self.sender is not None and not stats.num_decode_tokens:
                    self.sender.cost.observe_prefill(stats.num_prefill_tokens, stats.elapsed_s)
            except Exception:  # noqa: BLE001 - the step's requests got ERROR events; keep serving
                log.exception("engine step failed")

    # ------------------------------------------------------------------ facts
    @property
    def agent_address(self) -> str:
        """The address prefill workers connect to ('' without an agent)."""
        if self.agent is None:
            return ""
        return self.config.agent_advertise or self.agent.address

    def info(self) -> WorkerInfo:
        """What ``/pd/info`` reports."""
        eng = self.started_engine()
        g = eng.pool.geometry
        agent = None
        if self.agent is not None:
            agent = {"name": self.agent.name, "address": self.agent_address, "transports": self.agent.transports}
        return WorkerInfo(role=self.role.value, model=self.config.model_name, model_dir=self.model_dir,
                          vocab_size=eng.vocab_size, max_model_len=int(eng.max_model_len),
                          eos_token_ids=tuple(eng.eos_token_ids),
                          kv={"num_layers": g.num_layers, "kv_heads": g.kv_heads, "head_dim": g.head_dim,
                              "dtype": g.dtype, "block_tokens": g.block_tokens, "num_blocks": g.num_blocks},
                          engine_mode=eng.config.mode.value, agent=agent, pid=os.getpid(),
                          aliases=self.config.model_aliases, prefix_cache=eng.config.prefix_cache,
                          cache_salt=eng.cache_salt)

    def model_info(self) -> ModelInfo:
        eng = self.started_engine()
        cap = eng.pool.capacity_tokens
        return ModelInfo(self.config.model_name, eng.vocab_size, int(min(eng.max_model_len, 1 << 40)), cap, cap,
                         aliases=self.config.model_aliases)

    def stats(self) -> dict[str, Any]:
        """Live load (``/pd/stats``)."""
        eng = self.started_engine()
        rx = self.receiver
        return {"role": self.role.value, "waiting": eng.num_waiting, "running": eng.num_running,
                "free_blocks": eng.num_free_blocks, "num_blocks": eng.pool.num_blocks, "in_flight": self.in_flight,
                "awaiting_kv": rx.awaiting if rx else 0, "invalidated_reservations": rx.invalidated if rx else 0,
                "steps": eng.num_steps, "preemptions": eng.num_preemptions, "recomputes": eng.num_recomputes,
                "peers": self.links(), "kv_leases": len(self.leases) if self.leases else 0,
                "kv_pulls": self.sender.puller.counts() if self.sender else {}}

    def healthy(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closed

    def links(self) -> dict[str, dict[str, Any]]:
        """Prefill: the health of its links to decode workers' agents, by agent address
        (see :meth:`KVSender.links`); empty in other roles."""
        return self.sender.links() if self.sender is not None else {}

    def started_engine(self) -> Engine:
        """The engine (InvalidArgument before :meth:`start`)."""
        if self.engine is None:
            raise InvalidArgument("the worker is not started")
        return self.engine

    # ------------------------------------------------------------------ metrics
    def _setup_metrics(self) -> None:
        """The engine's gauges (the hand-off adds its own metrics when it starts)."""
        r = self.registry
        r.gauge("pdkv_engine_waiting", "Requests queued in the engine (the worker's queue depth).") \
            .set_function(lambda: [((), self.engine.num_waiting if self.engine else 0)])
        r.gauge("pdkv_engine_running", "Requests in the engine's running batch.") \
            .set_function(lambda: [((), self.engine.num_running if self.engine else 0)])
        r.gauge("pdkv_engine_free_blocks", "Free KV blocks.") \
            .set_function(lambda: [((), self.engine.num_free_blocks if self.engine else 0)])
        r.counter("pdkv_engine_steps_total", "Engine steps.") \
            .set_function(lambda: [((), self.engine.num_steps if self.engine else 0)])
        r.counter("pdkv_engine_preemptions_total", "Requests preempted (recomputed later) for lack of blocks.") \
            .set_function(lambda: [((), self.engine.num_preemptions if self.engine else 0)])
        self._setup_prefix_metrics()

    def _prefix_stat(self, key: str) -> int:
        return self.engine.prefix_stats()[key] if self.engine else 0

    def _setup_prefix_metrics(self) -> None:
        """The prefix cache's counters (docs/serving.md, "Prefix cache")."""
        r, st = self.registry, self._prefix_stat
        if self.config.role is not WorkerRole.COLOCATED:  # a colocated worker's OpenAI frontend counts them
            r.counter("pdkv_prompt_tokens_total", "Prompt tokens of the requests admitted to compute here.") \
                .set_function(lambda: [((), st("queries_tokens"))])
        r.counter("pdkv_prefill_computed_tokens_total", "Prompt tokens the engine computed (again after "
                  "preemptions).").set_function(lambda: [((), st("computed_prompt_tokens"))])
        r.counter("pdkv_prefix_hit_tokens_total", "Prompt tokens not computed because their KV was cached here "
                  "(local) or imported from a peer (pulled).", ("source",)) \
            .set_function(lambda: [(("local",), st("hit_tokens") - st("pulled_hit_tokens")),
                                   (("pulled",), st("pulled_hit_tokens"))])
        r.gauge("pdkv_prefix_cache_blocks", "KV blocks in the prefix cache's index (held or evictable).") \
            .set_function(lambda: [((), st("cached_blocks"))])
        r.counter("pdkv_prefix_evictions_total", "Cached blocks evicted to make room.") \
            .set_function(lambda: [((), st("evictions"))])

    # ------------------------------------------------------------------ routes
    def _routes(self, app: web.Application) -> None:
        app.router.add_get("/pd/info", self._h_info)
        app.router.add_get("/pd/stats", self._h_stats)
        self.kv_events = serve_kv_events(app, self.started_engine())  # GET /pd/kv_events (the fleet index)
        h = ProtocolHandlers(self)
        if self.role is not WorkerRole.COLOCATED:  # both roles' routes; RoleSwitch answers the other's 404
            app.router.add_post("/pd/prefill", h.prefill)
            app.router.add_post("/pd/check_peer", h.check_peer)
            app.router.add_post("/pd/decode", h.decode)
            app.router.add_post("/pd/kv_failed", h.kv_failed)
            app.router.add_post("/pd/kv_lease", h.kv_lease)
            app.router.add_post("/pd/kv_release", h.kv_release)
            RoleSwitch(self).add_routes(app)
        app.router.add_post("/pd/generate", h.generate)
        if self.role is WorkerRole.COLOCATED:
            OpenAIFrontend(LocalBackend(self), self.registry, max_body_bytes=self.config.max_body_bytes,
                           body_timeout_s=self.config.limits.body_timeout_s).add_routes(app)
        else:
            app.middlewares.append(openai_error_middleware())
            app.router.add_get("/health", self._h_health)
            app.router.add_get("/metrics", self._h_metrics)

    async def _h_health(self, request: web.Request) -> web.Response:
        ok = self.healthy()
        body: dict[str, Any] = {"status": "ok" if ok else "unavailable", "role": self.role.value}
        if self.role is WorkerRole.PREFILL:
            # Public: opaque peer ids (no agent address, no error text); /pd/stats has the details.
            links = self.links()
            body["peers"] = {peer_label(a): {k: v[k] for k in ("ok", "auth_failures", "transport_errors")}
                             for a, v in links.items()}
            if ok and any(not v["ok"] for v in links.values()):
                body["status"] = "degraded"  # serving, but some KV is recomputed (see peers)
        return web.json_response(body, status=200 if ok else 503)

    async def _h_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.registry.render().encode(), headers={"Content-Type": CONTENT_TYPE})

    async def _h_info(self, request: web.Request) -> web.Response:
        return web.json_response(self.info().to_json())

    async def _h_stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats())

    async def read_raw(self, request: web.Request) -> bytes:
        """The body's bytes (aiohttp's 413 past the body limit, 408 past the body deadline)."""
        return await read_body(request, self._body_limit, self.config.limits.body_timeout_s)


class LocalBackend:
    """The OpenAI frontend's backend inside a colocated worker: its own engine.

    Parameters
    ----------
    worker : Worker
    """

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.mode = worker.config.engine.mode.value

    def model_info(self) -> ModelInfo | None:
        return self.worker.model_info() if self.worker.engine is not None else None

    def codec(self) -> TextCodec | None:
        return self.worker.codec

    def health(self) -> tuple[bool, dict[str, Any]]:
        ok = self.worker.healthy()
        return ok, {"workers": [{"url": self.worker.url, "role": "colocated", "up": ok}]}

    async def refresh_metrics(self) -> None:
        return None

    async def generate(self, rid: str, prompt: list[int], params: GenParams, trace: RequestTrace
                       ) -> AsyncIterator[TokenOut]:
        eng = self.worker.started_engine()
        trace.route = "engine"
        trace.decode_worker = self.worker.url
        events = EngineEvents(asyncio.get_running_loop())
        try:
            h = eng.add_request(rid, prompt, SamplingParams.of(params), on_event=events)
        except InvalidArgument as e:
            raise APIError.bad(str(e)) from None
        finished = False
        self.worker.in_flight += 1
        try:
            while True:
                ev = await events.queue.get()
                if ev.finish_reason in (FinishReason.ABORT, FinishReason.ERROR):
                    finished = True
                    raise APIError(500, failure_message(h, ev), code="engine_error")
                if ev.token_id is not None:
                    fin = ev.finish_reason.value if ev.finish_reason is not None else None
                    yield TokenOut(ev.token_id, fin)
                if ev.finish_reason is not None:
                    finished = True
                    trace.extra.update(preemptions=h.num_preemptions, cached_tokens=h.num_cached_tokens,
                                       computed_tokens=h.num_computed_tokens)
                    return
        finally:
            self.worker.in_flight -= 1
            if not finished:
                eng.abort(rid)

