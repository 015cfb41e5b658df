"""Cross-worker prefix reuse: reading KV another worker holds instead of computing it.

Three pieces, none of which knows HTTP:

:class:`PullCostModel`
    Decides whether reading ``n`` blocks from a peer beats computing their tokens:
    ``latency + bytes / bandwidth(peer) < tokens / prefill_speed``, with the peer's
    bandwidth measured from this worker's earlier transfers to and from it (an
    exponentially weighted average; a conservative default before the first one) and
    the prefill speed measured from the engine's prefill steps (no pull before the
    first one, unless the policy is ``always``).
:class:`PrefixPuller`
    The prefill side. For a :class:`~pdkv.serving.protocol.PrefillRequest` it compares
    its own cached prefix (``L`` blocks) with what the decode worker's reservation holds
    (``Reservation.cached_blocks``) and what a third worker's lease holds
    (``PrefillRequest.src``); when one reaches further (``R > L``) and the cost model
    agrees, it allocates blocks for ``[L, R)`` under an engine lease
    (``Engine.import_blocks``), reads them with :meth:`pdkv.Agent.read` *with the
    holder's generations*, and commits them to its prefix cache
    (``Engine.commit_import``): the request then finds ``R`` blocks cached and computes
    only the rest. Any failure -- ``StaleBlock`` (the holder evicted or reused a block),
    a dead, frozen or restarted peer, no room -- drops the import (``Engine.unlease``)
    and the request computes those tokens itself: never wrong output.
:class:`LeaseTable`
    The holder side of ``/pd/kv_lease``: pins blocks for readers under namespaced
    engine lease ids, each with a deadline (expired leases are unleased), and a bound
    on the number of live leases.

Only pools of the same block size are read from (``block_tokens`` equal); other pulls
are skipped.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import math
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import pdkv
from pdkv.errors import AlreadyExists, InvalidArgument, PdkvError, ResourceExhausted

from .metrics import Registry
from .protocol import KVLease, LeaseRequest, PrefillRequest

__all__ = ["LeaseTable", "PrefixPuller", "PullConfig", "PullCostModel", "PullOutcome", "PullPlan", "PullPolicy",
           "push_span"]

log = logging.getLogger("pdkv.serving")

#: Engine lease ids of leases granted to peers (``/pd/kv_lease``) and of this worker's
#: own imports: the two never collide, whatever id a peer asks for.
PEER_LEASE_PREFIX = "peer:"
IMPORT_LEASE_PREFIX = "import:"


class PullPolicy(str, enum.Enum):
    """When a prefill worker reads a prefix another worker holds."""

    AUTO = "auto"      #: when the cost model says reading is faster than computing
    ALWAYS = "always"  #: whenever another worker holds more of the prompt (tests, benchmarks)
    OFF = "off"        #: never


@dataclass(frozen=True)
class PullConfig:
    """Settings of cross-worker pulls (``WorkerConfig.kv_pull``).

    Attributes
    ----------
    policy : PullPolicy or str
    default_bandwidth : float
        Bytes/s assumed for a peer before any transfer to or from it was measured
        (conservative: well below a local shm or tcp link).
    latency_s : float
        Fixed cost of one pull (connection check, round trip, commit), seconds.
    timeout_s : float
        Longest a pull's read may take (at most half of the request's KV deadline);
        a frozen peer costs this much, then the tokens are computed.
    min_tokens : int
        Pull only when it saves at least this many tokens of compute.
    """

    policy: PullPolicy = PullPolicy.AUTO
    default_bandwidth: float = 2e8
    latency_s: float = 0.002
    timeout_s: float = 2.0
    min_tokens: int = 1

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "policy", PullPolicy(self.policy))
        except ValueError:
            raise InvalidArgument(f"kv pull policy must be one of {[p.value for p in PullPolicy]}, "
                                  f"got {self.policy!r}") from None
        for k in ("default_bandwidth", "timeout_s"):
            if not 0 < getattr(self, k) < float("inf"):
                raise InvalidArgument(f"kv pull {k} must be a finite number > 0, got {getattr(self, k)!r}")
        if not 0 <= self.latency_s < float("inf"):
            raise InvalidArgument(f"kv pull latency_s must be a finite number >= 0, got {self.latency_s!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 1:
            raise InvalidArgument(f"kv pull min_tokens must be an integer >= 1, got {self.min_tokens!r}")


class PullCostModel:
    """Link bandwidth per peer and the engine's prefill speed, both measured.

    Parameters
    ----------
    config : PullConfig
    alpha : float
        Weight of a new measurement in the moving averages.

    Thread safety: observations and queries may come from any thread (a float store
    is atomic; a lost update only delays an average).
    """

    #: Transfers smaller than this are not used for bandwidth (latency dominates them).
    MIN_SAMPLE_BYTES = 4096

    def __init__(self, config: PullConfig, *, alpha: float = 0.3) -> None:
        self.config = config
        self.alpha = alpha
        self._bandwidth: dict[str, float] = {}
        self.prefill_tokens_per_s: float | None = None

    def bandwidth(self, peer: str) -> float:
        """Bytes/s to and from ``peer`` (its agent address): measured, or the default."""
        return self._bandwidth.get(peer, self.config.default_bandwidth)

    def observe_transfer(self, peer: str, nbytes: int, seconds: float) -> None:
        """A transfer of ``nbytes`` with ``peer`` took ``seconds`` (post to completion)."""
        if nbytes < self.MIN_SAMPLE_BYTES or not seconds > 0:
            return
        bw = nbytes / seconds
        old = self._bandwidth.get(peer)
        self._bandwidth[peer] = bw if old is None else (1 - self.alpha) * old + self.alpha * bw

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """The engine computed ``tokens`` prompt tokens in ``seconds`` (one step)."""
        if tokens <= 0 or not seconds > 0:
            return
        tps = tokens / seconds
        old = self.prefill_tokens_per_s
        self.prefill_tokens_per_s = tps if old is None else (1 - self.alpha) * old + self.alpha * tps

    def pull_seconds(self, peer: str, nbytes: int) -> float:
        """Predicted seconds to read ``nbytes`` from ``peer``."""
        return self.config.latency_s + nbytes / self.bandwidth(peer)

    def compute_seconds(self, tokens: int) -> float | None:
        """Predicted seconds to compute ``tokens`` prompt tokens (None: not measured yet)."""
        tps = self.prefill_tokens_per_s
        return None if tps is None else tokens / tps

    def worth_pulling(self, peer: str, nbytes: int, tokens: int) -> bool:
        """True when reading ``nbytes`` from ``peer`` should beat computing ``tokens``."""
        policy = self.config.policy
        if policy is PullPolicy.OFF or tokens < self.config.min_tokens:
            return False
        if policy is PullPolicy.ALWAYS:
            return True
        compute = self.compute_seconds(tokens)
        return compute is not None and self.pull_seconds(peer, nbytes) < compute


def push_span(req: PrefillRequest, local_block_tokens: int) -> tuple[int, int, int]:
    """What the KV push of ``req`` moves, skipping the blocks the decode worker holds
    (``req.dst.cached_blocks``): ``(first local block, first remote block, tokens)``.

    A push starts on a block boundary of both sides. With different block sizes the
    decode worker's cached blocks may end inside one of this worker's blocks: the push
    then starts at the last boundary the two share before that, and rewrites the few
    decode blocks after it (fewer than ``lcm(block sizes) / decode block size``) with the
    KV of the same tokens."""
    dst = req.dst
    common = math.lcm(dst.block_tokens, local_block_tokens)
    skip_tokens = dst.cached_blocks * dst.block_tokens // common * common
    return skip_tokens // local_block_tokens, skip_tokens // dst.block_tokens, max(len(req.prompt) - skip_tokens, 0)


@dataclass(frozen=True)
class PullPlan:
    """A pull the prefill worker decided on: prompt blocks ``[first, end)`` read from
    ``holder`` (the decode worker's reservation or a third worker's lease)."""

    source: str                    #: ``"decode"`` or ``"lease"``
    holder: Any                    #: the Reservation or KVLease (``agent``, ``name``)
    first: int                     #: first prompt block to read (= the local hit)
    end: int                       #: one past the last
    remote: tuple[int, ...]        #: the holder's block ids of ``[first, end)``
    generations: tuple[int, ...]   #: their generations
    hashes: tuple[str, ...]        #: their block hashes

    @property
    def num_blocks(self) -> int:
        return self.end - self.first


@dataclass
class PullOutcome:
    """What a pull did (:meth:`PrefixPuller.pull`).

    Attributes
    ----------
    plan : PullPlan
    lease_id : str
        The engine lease that pins the imported blocks until :meth:`PrefixPuller.done`.
    ok : bool
        The blocks were read and committed to the prefix cache.
    tokens, nbytes : int
        Tokens and bytes read (0 unless ok).
    reason : str
        ``"ok"``, or why it failed: ``"stale"``, ``"peer"``, ``"timeout"``, ``"no_room"``,
        ``"error"``.
    error : str
    """

    plan: PullPlan
    lease_id: str
    ok: bool = False
    tokens: int = 0
    nbytes: int = 0
    reason: str = ""
    error: str = ""
    seconds: float = 0.0


def failure_reason(e: BaseException) -> str:
    """The ``reason`` label of a failed pull."""
    if isinstance(e, pdkv.StaleBlock):
        return "stale"
    if isinstance(e, (pdkv.TransferTimeout, TimeoutError)):
        return "timeout"
    if isinstance(e, (pdkv.PeerConnectionError, pdkv.StalePeer, pdkv.AuthFailed, pdkv.ProtocolError,
                      pdkv.VersionMismatch, ConnectionError)):
        return "peer"
    if isinstance(e, ResourceExhausted):
        return "no_room"
    return "error"


Connect = Callable[[Any, float], Awaitable[str]]


class PrefixPuller:
    """The prefill side of cross-worker reuse (see the module docstring).

    Parameters
    ----------
    agent : pdkv.Agent
        Owns this worker's pool (region ``"kv"``).
    engine : Engine
        With the prefix cache on: ``block_hashes``, ``cached_prefix_tokens``,
        ``import_blocks``, ``commit_import``, ``unlease``.
    executor : ThreadPoolExecutor
        For the blocking calls (allocation may evict blocks and wait for their
        generations' bump; reads are waited for there).
    connect : callable
        ``await connect(holder, timeout) -> peer name`` (the sender's connection
        cache; ``holder`` has ``agent`` and ``name``).
    cost : PullCostModel
    registry : Registry, optional
        Gets ``pdkv_kv_pulls_total{result}``, ``pdkv_kv_pull_bytes_total`` and
        ``pdkv_kv_pulled_tokens_total``.
    read_options : pdkv.XferOptions, optional
        Options of the reads; a worker whose agent may compress lossily asks for
        lossless responses (pulled KV enters its cache and is reused as is).
    """

    def __init__(self, agent: pdkv.Agent, engine: Any, *, executor: ThreadPoolExecutor, connect: Connect,
                 cost: PullCostModel, registry: Registry | None = None,
                 read_options: pdkv.XferOptions | None = None) -> None:
        self.agent = agent
        self.read_options = read_options
        self.engine = engine
        self.cost = cost
        self._executor = executor
        self._connect = connect
        self._ids = itertools.count()
        self._tag = secrets.token_hex(3)
        self.pulled_tokens = 0
        self.pulled_bytes = 0
        self.ok_pulls = 0
        self.failures: dict[str, int] = {}  # failed pulls by reason
        r = registry or Registry()
        self.m_pulls = r.counter("pdkv_kv_pulls_total", "Prefix pulls from other workers, by result ('ok', or "
                                 "why the tokens were computed instead: stale, peer, timeout, no_room, error).",
                                 ("result",))
        r.counter("pdkv_kv_pull_bytes_total", "KV bytes read from other workers' caches.") \
            .set_function(lambda: [((), self.pulled_bytes)])
        r.counter("pdkv_kv_pulled_tokens_total", "Prompt tokens whose KV was read from another worker instead "
                  "of computed.").set_function(lambda: [((), self.pulled_tokens)])

    def counts(self) -> dict[str, int]:
        """Pulls by outcome (``ok`` and each failure reason) so far."""
        return {"ok": self.ok_pulls, **self.failures}

    @property
    def enabled(self) -> bool:
        return self.cost.config.policy is not PullPolicy.OFF and self.engine.config.prefix_cache

    def plan(self, req: PrefillRequest) -> PullPlan | None:
        """The pull worth doing for ``req``, or None (nothing reaches further than the
        local cache, different block sizes, or computing is cheaper)."""
        if not self.enabled:
            return None
        bt = self.engine.pool.block_tokens
        prompt = req.prompt
        hashes = self.engine.block_hashes(prompt)
        # The engine computes at least one prompt token: a hit never covers the last one.
        limit = min(len(hashes), (len(prompt) - 1) // bt)
        local = min(self.engine.cached_prefix_tokens(prompt) // bt, limit)
        best: PullPlan | None = None
        dst = req.dst
        if dst.block_tokens == bt and dst.generations and dst.cached_blocks > local:
            end = min(dst.cached_blocks, limit)
            if end > local:
                best = PullPlan("decode", dst, local, end, tuple(dst.blocks[local:end]),
                                tuple(dst.generations[local:end]), tuple(hashes[local:end]))
        src = req.src
        if src is not None and src.block_tokens == bt and src.start <= local:
            end = min(src.end, limit)
            if end > local and (best is None or end > best.end):
                a, b = local - src.start, end - src.start
                best = PullPlan("lease", src, local, end, tuple(src.blocks[a:b]), tuple(src.generations[a:b]),
                                tuple(hashes[local:end]))
        if best is None:
            return None
        nbytes = best.num_blocks * self._block_bytes()
        if not self.cost.worth_pulling(best.holder.agent, nbytes, best.num_blocks * bt):
            return None
        return best

    def _block_bytes(self) -> int:
        g = self.engine.pool.geometry
        return g.num_layers * g.kv_parts * g.block_bytes

    async def pull(self, req: PrefillRequest, plan: PullPlan, *, deadline: float) -> PullOutcome:
        """Reads ``plan``'s blocks into this worker's prefix cache by event-loop time
        ``deadline`` (at most ``timeout_s``). Never raises for a failure: the outcome
        says (and the import is dropped). Call :meth:`done` once the request holds the
        blocks (or gave up)."""
        loop = asyncio.get_running_loop()
        out = PullOutcome(plan, f"{IMPORT_LEASE_PREFIX}{self._tag}-{next(self._ids)}")
        xfer: pdkv.Transfer | None = None
        importing: asyncio.Future | None = None
        t0 = loop.time()
        timeout = min(self.cost.config.timeout_s, max(deadline - t0, 0.0))
        try:
            if timeout <= 0:
                raise pdkv.TransferTimeout("no time left before the KV deadline")
            peer = await self._connect(plan.holder, timeout)
            importing = loop.run_in_executor(self._executor,
                                             lambda: self.engine.import_blocks(out.lease_id, list(plan.hashes)))
            local = await asyncio.shield(importing)
            if len(local) != plan.num_blocks:
                raise ResourceExhausted(f"the engine imported {len(local)} of {plan.num_blocks} blocks")
            remaining = max(t0 + timeout - loop.time(), 0.001)
            xfer = self.agent.read(peer, pdkv.Blocks("kv", local),
                                   pdkv.Blocks("kv", list(plan.remote), generations=list(plan.generations)),
                                   options=self.read_options, timeout=remaining)
            if not xfer.done:
                await _in_thread(self._executor, lambda: xfer.wait(None))
            else:
                xfer.wait(0)
            self.engine.commit_import(out.lease_id)
        except asyncio.CancelledError:
            # The client went away: a read still in flight lands in blocks the lease holds
            # until it is over (then the import is dropped).
            asyncio.ensure_future(self._drop_after(out, importing, xfer))
            raise
        except (PdkvError, ConnectionError, TimeoutError) as e:
            self.done(out)  # frees an uncommitted import
            out.reason = failure_reason(e)
            out.error = f"{type(e).__name__}: {e}"
            self.failures[out.reason] = self.failures.get(out.reason, 0) + 1
            self.m_pulls.inc((out.reason,))
            log.info("request %s: pulling %d blocks from %s failed (%s); computing them", req.rid, plan.num_blocks,
                     plan.source, out.error)
            return out
        out.seconds = loop.time() - t0
        out.ok = True
        out.reason = "ok"
        out.tokens = plan.num_blocks * self.engine.pool.block_tokens
        out.nbytes = xfer.bytes_total
        self.pulled_tokens += out.tokens
        self.pulled_bytes += out.nbytes
        self.ok_pulls += 1
        self.m_pulls.inc(("ok",))
        self.cost.observe_transfer(plan.holder.agent, xfer.bytes_total, xfer.elapsed)
        return out

    async def _drop_after(self, out: PullOutcome, importing: asyncio.Future | None,
                          xfer: pdkv.Transfer | None) -> None:
        """Drops a cancelled pull's import once nothing can still write into it."""
        try:
            if importing is not None:
                await asyncio.wait([importing])
            if xfer is not None and not xfer.done:
                await _in_thread(self._executor, lambda: xfer.wait(None))
        except PdkvError:
            pass
        finally:
            self.done(out)

    def done(self, outcome: PullOutcome | None) -> None:
        """Ends the pull's engine lease (its blocks stay cached; an uncommitted import
        is freed). Idempotent."""
        if outcome is not None:
            self.engine.unlease(outcome.lease_id)


async def _in_thread(executor: ThreadPoolExecutor, fn: Callable[[], Any]) -> Any:
    return await asyncio.get_running_loop().run_in_executor(executor, fn)


class LeaseTable:
    """Leases this worker grants to readers of its prefix cache (``/pd/kv_lease``).

    Parameters
    ----------
    agent : pdkv.Agent
        Its generations go with the leased blocks.
    engine : Engine
        ``lease`` / ``unlease`` (the prefix cache on).
    address : str
        The agent address readers connect to.
    max_leases : int
        Live leases at most (past it: ResourceExhausted, 503).
    max_blocks : int, optional
        Blocks all live leases may pin together (default: a quarter of the engine's
        pool). A lease is granted only the leading hashes that fit what is left (maybe
        none), so readers holding leases can never pin the blocks the engine needs to
        keep serving.
    clock : callable
        ``time.monotonic`` (tests pass their own).

    Thread safety: call it from one thread (the worker's event loop).
    """

    def __init__(self, agent: pdkv.Agent, engine: Any, *, address: str, max_leases: int = 1024,
                 max_blocks: int | None = None, clock: Callable[[], float] = time.monotonic,
                 registry: Registry | None = None) -> None:
        if not isinstance(max_leases, int) or max_leases < 1:
            raise InvalidArgument(f"max_leases must be an integer >= 1, got {max_leases!r}")
        if max_blocks is None:
            max_blocks = max(1, int(engine.pool.num_blocks) // 4)
        if not isinstance(max_blocks, int) or isinstance(max_blocks, bool) or max_blocks < 0:
            raise InvalidArgument(f"max_blocks must be an integer >= 0, got {max_blocks!r}")
        self.max_blocks = max_blocks
        self._pinned: dict[str, int] = {}  # lease id -> blocks it pins
        self.agent = agent
        self.engine = engine
        self.address = address
        self.max_leases = max_leases
        self._clock = clock
        self._leases: dict[str, float] = {}  # lease id -> deadline (clock time)
        self.counts = {"granted": 0, "released": 0, "expired": 0, "refused": 0}
        r = registry or Registry()
        r.gauge("pdkv_kv_leases", "Leases on this worker's cached blocks held by readers now.") \
            .set_function(lambda: [((), len(self._leases))])
        r.counter("pdkv_kv_leases_served_total", "Leases on this worker's cached blocks granted to readers, by "
                  "how they went (granted, released, expired, refused).", ("result",)) \
            .set_function(lambda: [((k,), v) for k, v in self.counts.items()])

    def __len__(self) -> int:
        return len(self._leases)

    def grant(self, req: LeaseRequest) -> KVLease:
        """Pins the leading run of ``req.hashes`` this worker holds (maybe none).

        Raises
        ------
        AlreadyExists
            A live lease has this id.
        ResourceExhausted
            ``max_leases`` leases are live.
        """
        self.expire()
        if req.lease_id in self._leases:
            self.counts["refused"] += 1
            raise AlreadyExists(f"lease {req.lease_id!r} is live already")
        if len(self._leases) >= self.max_leases:
            self.counts["refused"] += 1
            raise ResourceExhausted(f"{len(self._leases)} leases are live, this worker's cap")
        room = self.max_blocks - sum(self._pinned.values())
        hashes = list(req.hashes)[:max(0, room)]
        ids = list(self.engine.lease(PEER_LEASE_PREFIX + req.lease_id, hashes)) if hashes else []
        self._leases[req.lease_id] = self._clock() + req.ttl_s
        self._pinned[req.lease_id] = len(ids)
        self.counts["granted"] += 1
        gens = tuple(self.agent.generations("kv", ids)) if ids else ()
        return KVLease(req.lease_id, self.address, self.agent.name, self.engine.pool.block_tokens, req.start,
                       tuple(ids), gens)

    def release(self, lease_id: str) -> bool:
        """Ends a lease; False if no live lease has this id."""
        if self._leases.pop(lease_id, None) is None:
            return False
        self._pinned.pop(lease_id, None)
        self.engine.unlease(PEER_LEASE_PREFIX + lease_id)
        self.counts["released"] += 1
        return True

    def expire(self) -> int:
        """Ends the leases past their ttl; returns how many."""
        now = self._clock()
        gone = [k for k, t in self._leases.items() if t <= now]
        for k in gone:
            del self._leases[k]
            self._pinned.pop(k, None)
            self.engine.unlease(PEER_LEASE_PREFIX + k)
        self.counts["expired"] += len(gone)
        return len(gone)

    async def run(self, interval_s: float = 0.5) -> None:
        """Expires leases every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                self.expire()
            except Exception:  # noqa: BLE001 - keep expiring
                log.exception("expiring KV leases failed")

    def close(self) -> None:
        """Ends every lease (the worker stops)."""
        for k in list(self._leases):
            self._leases.pop(k)
            self._pinned.pop(k, None)
            self.engine.unlease(PEER_LEASE_PREFIX + k)

