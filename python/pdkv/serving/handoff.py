"""The KV hand-off between a prefill and a decode worker, without HTTP.

A decode worker's :class:`KVReceiver` reserves blocks for a prompt and hands out a
:class:`~pdkv.serving.protocol.Reservation` (block ids, their generations, its agent's
address); a prefill worker's :class:`KVSender` computes nothing itself but pushes the
prompt's KV from its engine's blocks into those reserved blocks with one
:meth:`pdkv.Agent.write`, whose notification (:class:`~pdkv.serving.protocol.KVReady`:
first token and seed) reaches the receiver after the last byte landed. The receiver
then admits the request into its engine with that KV, or -- when the KV failed
(:class:`~pdkv.serving.protocol.KVFailed`) or did not come in time -- recomputes the
prompt.

With layer-wise streaming (the default, :class:`LayerStreamer`) the sender opens a
:meth:`pdkv.Agent.open_stream` when the prompt's last prefill step starts and posts
each layer the moment the engine wrote it, so the transfer runs while the later layers
compute; the first token's :class:`~pdkv.serving.protocol.KVReady` is the stream's
notification, sent once every layer landed (docs/streaming.md).

A late write never lands in reused blocks: a receiver that gives up on a reservation's
KV while a write may still be on its way bumps the blocks' generations
(:meth:`pdkv.Agent.bump_generations`) and reuses them at once; the write then fails
with ``StaleBlock`` at its agent before any byte lands. A sender releases its
blocks only once the write reading them is over.

Both classes run in one asyncio event loop and call the agent's blocking methods on a
thread pool; neither knows about HTTP (the worker's aiohttp handlers are a thin layer
over them, :mod:`pdkv.serving.worker`).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import pdkv
from pdkv.errors import InvalidArgument, NotFound, PdkvError, ResourceExhausted

from .engine import Engine, RequestHandle, TokenEvent
from .kv_pull import PrefixPuller, PullConfig, PullCostModel, push_span
from .layer_streamer import LayerStreamer
from .metrics import Registry
from .protocol import KVFailed, KVLease, KVReady, KVResult, PrefillRequest, Reservation
from .sampling import SamplingParams

__all__ = ["Arrival", "KVReceiver", "KVSender", "LayerStreamer", "Ticket", "error_kind", "peer_label"]

log = logging.getLogger("pdkv.serving")


def peer_label(address: str) -> str:
    """An opaque, stable id for a peer agent's address: what public surfaces (``/health``,
    ``/metrics`` labels) show instead of the address itself."""
    return "peer-" + hashlib.sha256(address.encode("utf-8", "surrogatepass")).hexdigest()[:12]


def error_kind(e: BaseException) -> str:
    """``"auth"`` (the peer refused our secret), ``"transport"`` (connection, protocol or
    timeout), or ``"other"``."""
    if isinstance(e, pdkv.AuthFailed):
        return "auth"
    if isinstance(e, (pdkv.PeerConnectionError, pdkv.TransferTimeout, pdkv.ProtocolError, pdkv.VersionMismatch,
                      pdkv.StalePeer, ConnectionError, TimeoutError)):
        return "transport"
    return "other"


def _release_quietly(engine: Any, rid: str) -> None:
    """Frees a request's blocks; a request already gone (aborted, or it ended without
    holding blocks) is not an error."""
    try:
        engine.release(rid)
    except NotFound:
        pass


class _Background:
    """Tasks that must outlive the coroutine that started them (a request's cleanup must
    run even when its handler is cancelled because the client went away)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def cancel_all(self) -> None:
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        for t in tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - shutting down
                pass


async def _in_thread(executor: ThreadPoolExecutor, fn: Callable[[], Any]) -> Any:
    return await asyncio.get_running_loop().run_in_executor(executor, fn)


async def _wait_transfer(executor: ThreadPoolExecutor, xfer: pdkv.Transfer) -> None:
    """Waits for a transfer (bounded by its own timeout) without blocking the loop;
    raises its error if it failed."""
    if not xfer.done:
        await _in_thread(executor, lambda: xfer.wait(None))
    else:
        xfer.wait(0)


# ---------------------------------------------------------------------- decode side
@dataclass
class Ticket:
    """One reservation of a :class:`KVReceiver`, from :meth:`KVReceiver.reserve` to
    :meth:`KVReceiver.finish`.

    Attributes
    ----------
    rid : str
    blocks : list of int
        The reserved block ids (in the receiver's pool).
    reservation : Reservation
        What the prefill side needs to push the KV.
    started : float
        Event-loop time the reservation was asked for.
    deadline : float
        Event-loop time after which the KV is given up and the prompt recomputed.
    outcome : asyncio.Future
        Set by the KV's notification or a :class:`KVFailed`.
    admitted : bool
        The engine took the blocks over (:meth:`KVReceiver.admit`).
    """

    rid: str
    blocks: list[int]
    reservation: Reservation
    started: float
    deadline: float
    outcome: "asyncio.Future[KVReady | KVFailed]" = field(repr=False)
    admitted: bool = False

    @property
    def writable(self) -> list[int]:
        """The blocks a prefill write may land in (not the cached ones, which the
        engine's eviction hook invalidates when it reuses them)."""
        return self.blocks[self.reservation.cached_blocks:]


@dataclass(frozen=True)
class Arrival:
    """How a reservation's KV turned out (:meth:`KVReceiver.wait`).

    Attributes
    ----------
    ready : KVReady or None
        The KV landed (None: recompute).
    failed : KVFailed or None
        The prefill side reported that the KV will not come.
    wait_s : float
        From asking for the reservation to this outcome.
    reason : str
        ``""`` (landed), ``"kv_failed"`` or ``"kv_timeout"``.
    error : str
        The cause of a recompute, for the client's statistics.
    """

    ready: KVReady | None
    failed: KVFailed | None
    wait_s: float
    reason: str = ""
    error: str = ""


class KVReceiver:
    """The decode side of the hand-off: reservations, their KV, and their cleanup.

    Parameters
    ----------
    agent : pdkv.Agent
        Owns the pool's memory (region ``"kv"``); its notifications announce landed KV.
    engine : Engine
        Decodes the admitted requests (reserve, admit, release).
    executor : ThreadPoolExecutor
        For the agent's blocking calls.
    address : str
        The agent address handed out in reservations.
    registry : Registry, optional
        Gets ``pdkv_kv_wait_seconds``, ``pdkv_kv_recomputes_total`` and
        ``pdkv_kv_invalidated_total``.
    """

    def __init__(self, agent: pdkv.Agent, engine: Engine, *, executor: ThreadPoolExecutor, address: str,
                 registry: Registry | None = None) -> None:
        self.agent = agent
        self.engine = engine
        self.address = address
        self.invalidated = 0  # reservations whose blocks' generations were bumped (KV given up)
        self._executor = executor
        self._waiting: dict[str, asyncio.Future] = {}
        self._background = _Background()
        self.dropped: collections.Counter = collections.Counter()  # notifications ignored, by reason
        self._drop_log: dict[str, tuple[float, int]] = {}  # reason -> (last logged, suppressed since)
        r = registry or Registry()
        self.m_dropped = r.counter("pdkv_notifications_dropped_total",
                                   "Agent notifications ignored (malformed, or for no waiting request), by reason.",
                                   ("reason",))
        self.m_kv_wait = r.histogram("pdkv_kv_wait_seconds",
                                     "From reserving blocks to the notification that the KV landed.")
        self.m_recompute = r.counter("pdkv_kv_recomputes_total",
                                     "Prompts recomputed because their KV did not arrive.", ("reason",))
        r.counter("pdkv_kv_invalidated_total",
                  "Reservations whose KV was given up: their blocks' generations were bumped, so a late "
                  "write fails (StaleBlock) instead of landing, and the blocks were reused at once.") \
            .set_function(lambda: [((), self.invalidated)])

    @property
    def awaiting(self) -> int:
        """Reservations waiting for their KV now."""
        return len(self._waiting)

    async def reserve(self, rid: str, prompt: Sequence[int] | int, *, wait_s: float, kv_timeout_s: float,
                      margin_s: float = 0.0) -> Ticket:
        """Reserves blocks for ``prompt``, waiting up to ``wait_s`` for free ones; the
        KV is then awaited until ``kv_timeout_s + margin_s`` after now. From here on a
        notification for ``rid`` is caught; call :meth:`finish` in every case.

        With the engine's prefix cache on, the leading blocks it holds of ``prompt``
        are part of the reservation (``Reservation.cached_blocks``): the prefill side
        writes only the others, and may read these. An int ``prompt`` is a length:
        blocks for that many tokens, none of them cached.

        Raises
        ------
        ResourceExhausted
            No blocks came free within ``wait_s``.
        AlreadyExists
            ``rid`` is already known to the engine.
        """
        loop = asyncio.get_running_loop()
        started = loop.time()
        blocks, cached = await self._reserve_blocks(rid, prompt, started + wait_s)
        gens = tuple(self.agent.generations("kv", blocks))
        res = Reservation(tuple(blocks), self.address, self.agent.name, self.engine.pool.block_tokens, gens, cached)
        ticket = Ticket(rid, blocks, res, started, started + kv_timeout_s + margin_s, loop.create_future())
        self._waiting[rid] = ticket.outcome
        return ticket

    async def _reserve_blocks(self, rid: str, prompt: Sequence[int] | int, deadline: float
                              ) -> tuple[list[int], int]:
        loop = asyncio.get_running_loop()
        eng = self.engine
        while True:
            try:
                if isinstance(prompt, int):
                    return eng.reserve(rid, prompt), 0
                if eng.config.prefix_cache:
                    # In a thread: reusing a block a reader was given waits for its generation bump.
                    blocks, cached = await _in_thread(self._executor, lambda: eng.reserve_prefix(rid, list(prompt)))
                    return list(blocks), int(cached)
                return eng.reserve(rid, len(prompt)), 0
            except ResourceExhausted:
                if loop.time() >= deadline:
                    raise
                await asyncio.sleep(0.01)

    async def wait(self, ticket: Ticket) -> Arrival:
        """Waits for the KV until the ticket's deadline. On anything but a landed KV or a
        terminal failure, the blocks' generations are bumped before this returns (a
        write may still be on its way: after the bump it cannot land)."""
        loop = asyncio.get_running_loop()
        try:
            outcome = await asyncio.wait_for(asyncio.shield(ticket.outcome), max(ticket.deadline - loop.time(), 0.0))
        except asyncio.TimeoutError:
            outcome = None
        self._waiting.pop(ticket.rid, None)
        wait_s = loop.time() - ticket.started
        if isinstance(outcome, KVReady):
            self.m_kv_wait.observe(wait_s)
            return Arrival(outcome, None, wait_s)
        if isinstance(outcome, KVFailed):
            arrival = Arrival(None, outcome, wait_s, "kv_failed", outcome.error or "the proxy gave no reason")
            log.warning("request %s: KV failed (%s); recomputing", ticket.rid, arrival.error)
        else:
            arrival = Arrival(None, None, wait_s, "kv_timeout", f"no KV within {wait_s:.1f} s")
            log.warning("request %s: no KV within %.1f s; recomputing", ticket.rid, wait_s)
        if not (outcome is not None and outcome.terminal):
            await self._invalidate(ticket.writable)
        return arrival

    def admit(self, ticket: Ticket, arrival: Arrival, prompt: Sequence[int], params: SamplingParams,
              on_event: Callable[[TokenEvent], None]) -> RequestHandle:
        """Hands the reserved blocks to the engine: decoding from the landed KV, or
        recomputing the prompt (with the prefill side's first token, if it sent one)."""
        if arrival.ready is not None:
            h = self.engine.admit_prefilled(ticket.rid, prompt, arrival.ready.first_token, params,
                                            seed=arrival.ready.seed, on_event=on_event,
                                            cache_kv=not arrival.ready.lossy)
        else:
            first = arrival.failed.first_token if arrival.failed is not None else None
            h = self.engine.admit_recompute(ticket.rid, prompt, params, first_token=first, seed=params.seed,
                                            on_event=on_event)
            self.m_recompute.inc((arrival.reason,))
        ticket.admitted = True
        return h

    def finish(self, ticket: Ticket) -> None:
        """Ends a reservation. Not admitted (client gone, error): its blocks are
        released -- at once if no write can still land in them, else after bumping
        their generations (in the background: the caller may be cancelled)."""
        self._waiting.pop(ticket.rid, None)
        fut = ticket.outcome
        if not ticket.admitted:
            outcome = fut.result() if fut.done() and not fut.cancelled() else None
            if isinstance(outcome, KVReady) or (isinstance(outcome, KVFailed) and outcome.terminal):
                self._release(ticket.rid)
            else:
                self._background.spawn(self._invalidate_and_release(ticket.rid, ticket.writable))
        if not fut.done():
            fut.cancel()

    def kv_failed(self, kf: KVFailed) -> str:
        """The prefill side says a reservation's KV will not come: ``"recomputing"``,
        ``"settled"`` (its outcome was already known) or ``"unknown"``."""
        fut = self._waiting.get(kf.rid)
        if fut is None:
            return "unknown"
        if fut.done():
            return "settled"
        fut.set_result(kf)
        return "recomputing"

    def deliver(self, data: bytes, peer: str = "") -> bool:
        """Delivers one agent notification (a :class:`KVReady`); False if it was ignored.
        Never raises, whatever ``data`` holds: a malformed one is logged (rate-limited)
        and counted in ``pdkv_notifications_dropped_total``."""
        try:
            kv = KVReady.decode(data)
        except InvalidArgument as e:
            self._drop("malformed", "ignoring a notification from %s: %s", peer, e)
            return False
        except Exception as e:  # noqa: BLE001 - a decoder bug must not end the notification loop
            self._drop("error", "ignoring a notification from %s that failed to decode: %s: %s", peer,
                       type(e).__name__, e)
            return False
        fut = self._waiting.get(kv.rid)
        if fut is None or fut.done():
            self._drop("unknown_request", "notification for request %.80r, which is not waiting for KV (ignored)",
                       kv.rid)
            return False
        fut.set_result(kv)
        return True

    def _drop(self, reason: str, msg: str, *args: Any) -> None:
        """Counts a dropped notification; logs at most one per reason every 10 s (a
        flooding peer cannot flood the log), with the count suppressed since."""
        self.dropped[reason] += 1
        self.m_dropped.inc((reason,))
        now = time.monotonic()
        last, quiet = self._drop_log.get(reason, (-1e9, 0))
        if now - last < 10.0:
            self._drop_log[reason] = (last, quiet + 1)
            return
        self._drop_log[reason] = (now, 0)
        log.warning(msg + (f" ({quiet} more like it suppressed)" if quiet else ""), *args)

    async def run_notifications(self) -> None:
        """Delivers the agent's notifications until cancelled; survives any payload."""
        async for n in self.agent.notifications():
            try:
                self.deliver(n.data, n.peer)
            except Exception:  # noqa: BLE001 - deliver does not raise; belt and braces for the loop
                log.exception("delivering a notification failed (dropped)")

    async def close(self) -> None:
        """Cancels pending cleanups (the worker is shutting down with its pool)."""
        await self._background.cancel_all()

    async def _invalidate(self, blocks: list[int]) -> None:
        """Bumps the generations of reserved blocks whose KV this worker gave up on;
        returns once no write accepted under the old generations can still land in
        them (every such write has a deadline), so the blocks may be reused at once."""
        await _in_thread(self._executor, lambda: self.agent.bump_generations("kv", blocks, timeout=None))
        self.invalidated += 1

    async def _invalidate_and_release(self, rid: str, blocks: list[int]) -> None:
        try:
            await self._invalidate(blocks)
        finally:
            self._release(rid)

    def _release(self, rid: str) -> None:
        _release_quietly(self.engine, rid)


# ---------------------------------------------------------------------- prefill side
def _new_link() -> dict[str, Any]:
    return {"auth_failures": 0, "transport_errors": 0, "last_error": "", "ok": True}


class KVSender:
    """The prefill side of the hand-off: connections to decode workers' agents, KV
    pushes, the health of each link, and the release of pushed blocks.

    Parameters
    ----------
    agent : pdkv.Agent
        Owns the engine pool's memory (region ``"kv"``).
    engine : Engine
        Holds the prompts' blocks until their push is over (release).
    executor : ThreadPoolExecutor
        For the agent's blocking calls.
    registry : Registry, optional
        Gets ``pdkv_kv_transfers_total``, ``pdkv_kv_transfer_bytes_total``,
        ``pdkv_kv_transfer_{span,tail,wire}_seconds``, ``pdkv_peer_auth_failures_total`` and
        ``pdkv_peer_transport_errors_total``.
    drop_kv : bool
        Testing only: report success without writing anything.
    stream_layers : bool
        Stream each layer while the prompt computes (:meth:`layer_streamer`); False:
        one write after the prefill (the monolithic path).
    pull : PullConfig, optional
        Reading prefixes other workers hold (:attr:`puller`; default: the cost model
        decides). Pushes skip the blocks the decode worker holds either way.
    lossy_kv : bool
        The agent may compress pushes lossily (fp8): every :class:`KVReady` says so
        (the decode worker keeps such KV out of its prefix cache), and pulls ask for
        lossless responses (pulled KV enters this worker's cache).
    """

    def __init__(self, agent: pdkv.Agent, engine: Engine, *, executor: ThreadPoolExecutor,
                 registry: Registry | None = None, drop_kv: bool = False, stream_layers: bool = True,
                 pull: PullConfig | None = None, lossy_kv: bool = False) -> None:
        self.agent = agent
        self.lossy_kv = lossy_kv
        self.engine = engine
        self.drop_kv = drop_kv
        self.stream_layers = stream_layers
        self._executor = executor
        self._peers: dict[str, str] = {}             # decode agent address -> peer name
        self._peer_locks: dict[str, asyncio.Lock] = {}
        self._links: dict[str, dict[str, Any]] = {}  # decode agent address -> its link's health
        self._background = _Background()
        r = registry or Registry()
        self.cost = PullCostModel(pull or PullConfig())
        self.puller = PrefixPuller(agent, engine, executor=executor, connect=self._peer, cost=self.cost, registry=r,
                                   read_options=pdkv.XferOptions(compress="lossless") if lossy_kv else None)
        self.skipped_blocks = 0
        r.counter("pdkv_kv_pushed_skipped_blocks_total", "Reserved blocks not pushed because the decode worker "
                  "held their KV already.").set_function(lambda: [((), self.skipped_blocks)])
        self.m_kv = r.counter("pdkv_kv_transfers_total", "KV pushes to decode workers, by result.", ("result",))
        self.m_kv_bytes = r.counter("pdkv_kv_transfer_bytes_total", "KV bytes pushed, by transport.", ("transport",))
        self.m_kv_time = r.histogram("pdkv_kv_transfer_span_seconds", "Span of each KV push, post to completion "
                                     "(a layer-wise stream: from its open, overlapping the prefill).",
                                     ("transport",))
        self.m_kv_tail = r.histogram("pdkv_kv_transfer_tail_seconds", "Time each KV push added after the "
                                     "prefill ended (its last layer posted and first token sampled) to "
                                     "completion.", ("transport",))
        self.m_kv_wire_time = r.histogram("pdkv_kv_transfer_wire_seconds", "Time each KV push had bytes on the "
                                          "wire (the union of its batch transfers).", ("transport",))
        self.m_kv_wire = r.counter("pdkv_kv_wire_bytes_total", "Bytes the KV pushes put on the wire (compressed "
                                   "size when compressed; tcp counts them), by transport and codec ('none': "
                                   "sent as is).", ("transport", "codec"))
        self.m_kv_streamed = r.counter("pdkv_kv_streamed_total", "KV pushes by how they went: streamed layer by "
                                       "layer, or one write after prefill (monolithic, or a stream that fell "
                                       "back).", ("path",))
        self.m_peer_auth = r.counter("pdkv_peer_auth_failures_total",
                                     "Decode workers' agents that refused this worker's secret, by peer id "
                                     "(an opaque hash of the agent address; the KV is then recomputed).",
                                     ("peer",))
        self.m_peer_transport = r.counter("pdkv_peer_transport_errors_total",
                                          "Failed connections and transfers to decode workers' agents, by peer "
                                          "id (an opaque hash of the agent address).", ("peer",))

    # ------------------------------------------------------------------ links
    def links(self) -> dict[str, dict[str, Any]]:
        """The health of its links to decode workers' agents, by agent address
        (``auth_failures``, ``transport_errors``, ``last_error``, ``ok``: the last
        attempt succeeded)."""
        return {k: dict(v) for k, v in self._links.items()}

    def link_event(self, address: str, error: BaseException | None) -> str:
        """Records a connection or transfer outcome to a decode agent; returns its kind
        (``"ok"``, ``"auth"``, ``"transport"`` or ``"other"``)."""
        link = self._links.setdefault(address, _new_link())
        if error is None:
            link["ok"] = True
            return "ok"
        kind = error_kind(error)
        link["ok"] = False
        link["last_error"] = f"{type(error).__name__}: {error}"
        if kind == "auth":
            link["auth_failures"] += 1
            self.m_peer_auth.inc((peer_label(address),))
        elif kind == "transport":
            link["transport_errors"] += 1
            self.m_peer_transport.inc((peer_label(address),))
        return kind

    async def check_peer(self, address: str, timeout: float) -> tuple[str, str]:
        """Connects to a decode worker's agent now (metadata, then the transport
        handshake, both authenticated); returns ``(kind, error)``, kind ``"ok"`` on
        success."""
        agent = self.agent

        def check() -> None:
            name = agent.connect(address, timeout=timeout)
            agent.warm_up(name, timeout=timeout)

        try:
            await _in_thread(self._executor, check)
        except PdkvError as e:
            self._peers.pop(address, None)
            return self.link_event(address, e), f"{type(e).__name__}: {e}"
        self.link_event(address, None)
        return "ok", ""

    async def _peer(self, dst: Reservation | KVLease, timeout: float) -> str:
        """The agent peer name of a decode worker, or of a lease's holder (connects once
        per address)."""
        name = self._peers.get(dst.agent)
        if name == dst.name:
            return name
        lock = self._peer_locks.setdefault(dst.agent, asyncio.Lock())
        async with lock:
            name = self._peers.get(dst.agent)
            if name != dst.name:
                name = await _in_thread(self._executor, lambda: self.agent.connect(dst.agent, timeout=timeout))
                self._peers[dst.agent] = name
                if name != dst.name:
                    raise pdkv.StalePeer(f"the agent at {dst.agent} is {name!r}, not {dst.name!r}")
            return name

    # ------------------------------------------------------------------ push
    async def layer_streamer(self, req: PrefillRequest, deadline: float) -> LayerStreamer | None:
        """A :class:`LayerStreamer` for ``req`` (give it to ``Engine.add_request`` as
        ``layer_sink``), or None when streaming is off or the decode worker's agent cannot
        be reached now (:meth:`push` then writes once, and reports the failure).
        ``deadline`` is event-loop time."""
        if not self.stream_layers or self.drop_kv:
            return None
        loop = asyncio.get_running_loop()
        remaining = deadline - loop.time()
        if remaining <= 0:
            return None
        try:
            peer = await self._peer(req.dst, min(remaining, 5.0))
        except PdkvError:
            return None
        return LayerStreamer(self.agent, peer, req, deadline=time.monotonic() + (deadline - loop.time()),
                             plan=self._plan(req), block_tokens=self.engine.pool.block_tokens)

    def _plan(self, req: PrefillRequest) -> pdkv.PlanOptions | None:
        if req.dst.block_tokens != self.engine.pool.block_tokens:
            return pdkv.PlanOptions(num_tokens=push_span(req, self.engine.pool.block_tokens)[2])
        return None

    async def push(self, req: PrefillRequest, handle: RequestHandle, first_token: int, *, with_kv: bool,
                   deadline: float, posted: list[pdkv.Transfer], streamer: LayerStreamer | None = None) -> KVResult:
        """Writes the prompt's KV from ``handle``'s blocks into ``req.dst`` (or, without
        ``with_kv``, only the notification), by event-loop time ``deadline``. Every
        transfer it posts is appended to ``posted`` at once: the blocks must not be
        freed before it is over, even if this coroutine is cancelled (see
        :meth:`finish`). With a ``streamer`` whose layers all went out, closing its
        stream is the push (a stream that failed or was not opened falls back to one
        write). Never raises for a transfer failure: the result says."""
        loop = asyncio.get_running_loop()
        ready = KVReady(req.rid, first_token, handle.seed, kv=with_kv, lossy=with_kv and self.lossy_kv)
        if streamer is not None:
            result = await self._push_streamed(req, ready, streamer, posted)
            if result is not None:
                return result
        if self.drop_kv:
            self.m_kv.inc(("dropped",))
            return KVResult(ok=True, posted=False, error="debug: KV dropped on purpose")
        remaining = deadline - loop.time()
        if remaining <= 0:
            self.m_kv.inc(("late",))
            return KVResult(False, False, error=f"prefill finished {-remaining:.2f} s after the KV deadline")
        xfer = None
        transport = ""
        for attempt in range(2):
            try:
                peer = await self._peer(req.dst, min(remaining, 5.0))
                transport = self.agent.peer_transport(peer)
                xfer = self._post(peer, req, handle, ready, with_kv=with_kv,
                                  timeout=max(deadline - loop.time(), 0.001))
                posted.append(xfer)
                await _wait_transfer(self._executor, xfer)
                break
            except pdkv.StalePeer as e:
                self._peers.pop(req.dst.agent, None)
                if attempt == 0 and (xfer is None or xfer.done):
                    xfer = None
                    continue  # the decode worker restarted: fetch its metadata again
                return self._failed(req, e, posted=xfer is not None, transport=transport)
            except PdkvError as e:
                if isinstance(e, (pdkv.PeerConnectionError, pdkv.AuthFailed)):
                    self._peers.pop(req.dst.agent, None)
                log.warning("request %s: KV push to %s failed: %s: %s", req.rid, req.dst.agent, type(e).__name__, e)
                return self._failed(req, e, posted=xfer is not None, transport=transport)
        assert xfer is not None
        self.link_event(req.dst.agent, None)
        self.m_kv.inc(("ok",))
        self.m_kv_bytes.inc((transport,), xfer.bytes_total)
        self._observe_times(xfer.elapsed, xfer.elapsed, xfer.elapsed, transport)  # all of it after the prefill
        self._count_wire([xfer], transport)
        return self._landed(req, KVResult(True, True, xfer.bytes_total, xfer.elapsed, transport,
                                          tail_seconds=xfer.elapsed, wire_seconds=xfer.elapsed), with_kv)

    async def _push_streamed(self, req: PrefillRequest, ready: KVReady, streamer: LayerStreamer,
                             posted: list[pdkv.Transfer]) -> KVResult | None:
        """Waits for the earlier chunks' streams, then closes the last one with the
        notification and waits for it: the result, or None to fall back to one write
        (the streams were never complete, or their peer restarted)."""
        transport = ""
        if streamer.usable:
            xfers = streamer.transfers
            posted.extend(xfers)
            transport = xfers[-1].transport
            try:
                for earlier in streamer.earlier:  # the notification must follow every chunk's bytes
                    await _wait_transfer(self._executor, earlier)
                streamer.close(ready.encode())  # raises the stream's error if a batch already failed
                await _wait_transfer(self._executor, xfers[-1])
            except pdkv.StalePeer:
                self._peers.pop(req.dst.agent, None)  # the decode worker restarted: fall back
            except PdkvError as e:
                if isinstance(e, (pdkv.PeerConnectionError, pdkv.AuthFailed)):
                    self._peers.pop(req.dst.agent, None)
                log.warning("request %s: KV stream to %s failed: %s: %s", req.rid, req.dst.agent, type(e).__name__, e)
                streamer.cancel()  # later chunks' streams must not land after the failure is reported
                return self._failed(req, e, posted=True, transport=transport)
            else:
                nbytes = sum(x.bytes_total for x in xfers)
                span, tail, wire = streamer.timings()
                self.link_event(req.dst.agent, None)
                self.m_kv.inc(("ok",))
                self.m_kv_streamed.inc(("streamed",))
                self.m_kv_bytes.inc((transport,), nbytes)
                self._observe_times(span, tail, wire, transport)
                self._count_wire(xfers, transport)
                return self._landed(req, KVResult(True, True, nbytes, span, transport, tail_seconds=tail,
                                                  wire_seconds=wire), True)
        # Not streamed in full: nothing of it may still be in flight when one write
        # replaces it (the same bytes, but a deadline of its own).
        pending = streamer.cancel()
        if streamer.error is not None:
            log.info("request %s: layer streaming stopped (%s: %s); writing the KV at once", req.rid,
                     type(streamer.error).__name__, streamer.error)
        for x in pending:
            if all(x is not p for p in posted):
                posted.append(x)
            try:
                await _wait_transfer(self._executor, x)
            except PdkvError:
                pass
        return None

    def _post(self, peer: str, req: PrefillRequest, handle: RequestHandle, ready: KVReady, *, with_kv: bool,
              timeout: float) -> pdkv.Transfer:
        local_first, remote_first, _ = push_span(req, self.engine.pool.block_tokens)
        if not with_kv or remote_first >= len(req.dst.blocks):  # nothing to write: decode holds every block
            return self.agent.notify(peer, ready.encode(), timeout=timeout)
        self.m_kv_streamed.inc(("monolithic",))
        gens = list(req.dst.generations[remote_first:]) or None
        return self.agent.write(peer, pdkv.Blocks("kv", handle.block_ids[local_first:]),
                                pdkv.Blocks("kv", req.dst.blocks[remote_first:], generations=gens),
                                plan=self._plan(req), notify=ready.encode(), timeout=timeout)

    def _landed(self, req: PrefillRequest, result: KVResult, with_kv: bool) -> KVResult:
        """Counts a landed push: the blocks it skipped (decode held them) and the link's
        bandwidth (the pull cost model's)."""
        self.cost.observe_transfer(req.dst.agent, result.bytes, result.wire_seconds)
        skipped = push_span(req, self.engine.pool.block_tokens)[1] if with_kv else 0
        if not skipped:
            return result
        self.skipped_blocks += skipped
        return dataclasses.replace(result, skipped_blocks=skipped)

    def _observe_times(self, span: float, tail: float, wire: float, transport: str) -> None:
        self.m_kv_time.observe(span, (transport,))
        self.m_kv_tail.observe(tail, (transport,))
        self.m_kv_wire_time.observe(wire, (transport,))

    def _count_wire(self, xfers: Sequence[pdkv.Transfer], transport: str) -> None:
        for x in xfers:
            self.m_kv_wire.inc((transport, x.compression or "none"), x.wire_bytes)

    def _failed(self, req: PrefillRequest, e: PdkvError, *, posted: bool, transport: str) -> KVResult:
        self.link_event(req.dst.agent, e)
        self.m_kv.inc(("failed",))
        return KVResult(False, posted, error=f"{type(e).__name__}: {e}", transport=transport)

    # ------------------------------------------------------------------ release
    def finish(self, rid: str, handle: RequestHandle, posted: list[pdkv.Transfer],
               streamer: LayerStreamer | None = None) -> None:
        """Ends a prefill request: aborts it if it is still running, else releases its
        blocks -- once the writes reading them are over (in the background: the caller
        may be cancelled). A stream never closed is cancelled."""
        if streamer is not None:
            for x in streamer.cancel():
                if all(x is not p for p in posted):
                    posted.append(x)
        pending = [x for x in posted if not x.done]
        if not handle.finished:
            self.engine.abort(rid)
        elif pending:
            self._background.spawn(self._release_after(rid, pending))
        else:
            self._release(rid)

    async def _release_after(self, rid: str, xfers: list[pdkv.Transfer]) -> None:
        try:
            for xfer in xfers:
                try:
                    await _wait_transfer(self._executor, xfer)
                except PdkvError:
                    pass
        finally:
            self._release(rid)

    def _release(self, rid: str) -> None:
        _release_quietly(self.engine, rid)

    async def close(self) -> None:
        """Cancels pending releases (the worker is shutting down with its pool)."""
        await self._background.cancel_all()
