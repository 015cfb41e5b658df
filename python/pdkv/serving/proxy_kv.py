"""KV-aware routing (``pdkv serve proxy --routing kv``): the proxy picks the workers
that would leave the least work to do, from the fleet KV index
(:mod:`pdkv.serving.kv_index`).

For a prompt of ``n`` tokens the index says how many leading tokens ``m[w]`` each
worker ``w`` holds in its prefix cache. Then:

* **decode** worker: the one with the least ``(n - m[d]) + kv_load_tokens * in_flight``
  (tokens it would receive, plus its load in token units);
* **prefill** worker: the one with the least
  ``(n - max(m[p], have_d)) + load_tokens + kv_load_tokens * in_flight``, where
  ``have_d`` is what the chosen decode worker holds (the prefill worker can read that
  prefix from it instead of computing it: the decode worker's reservation says how
  much, ``Reservation.cached_blocks``);
* ties go round-robin. A worker out of rotation (dead, frozen, cooling down) is never
  a candidate, whatever it holds; the index drops its entries too.
* **session affinity**: when no candidate holds any of the prompt (the index is cold:
  a first turn, a restarted proxy), a request with a session (the OpenAI ``user``
  field, or the ``X-Session-Id`` header) goes to the workers its session's previous
  request went to; without one, to the least-loaded worker (round-robin).
* **third-party lease**: when a worker that is neither the chosen prefill nor decode
  holds at least one block more of the prompt than both, the proxy asks it to pin
  those blocks (``POST /pd/kv_lease``) and passes the lease to the prefill worker as
  ``PrefillRequest.src`` (it reads them through pdkv instead of computing them); the
  lease is released (``POST /pd/kv_release``) when the prefill ends, and expires by
  itself after ``ttl_s`` if that call is lost. A failed lease call only means no
  ``src``.

Each decode pick is counted in ``pdkv_kv_decode_picks_total`` by how it was made:
``kv_prefix`` (the chosen worker held part of the prompt), ``kv_load`` (another held
more, but its load outweighed it), ``kv_session`` (affinity) or ``kv_cold`` (neither).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import aiohttp

from .kv_index import KVIndex
from .metrics import Registry
from .proxy_client import WorkerClient
from .proxy_config import ProxyConfig
from .proxy_metrics import ProxyMetrics
from .proxy_pool import PoolWorker, WorkerPool

__all__ = ["KVRouting", "RoutePlan"]

log = logging.getLogger("pdkv.serving")

#: Longest session id kept (longer ones are refused by the frontend).
MAX_SESSION_CHARS = 256


@dataclass
class RoutePlan:
    """One request's routing facts: its prompt, what each worker holds of it, its session."""

    prompt: list[int]
    matched: dict[str, int]           # worker URL -> leading prompt tokens it holds
    session: str = ""
    how: str = ""                     # how the decode worker was picked (see the module docstring)
    decode_tokens: int = 0            # what the chosen decode worker holds
    lease: dict[str, Any] | None = None
    lease_worker: str = ""


class KVRouting:
    """Picks decode and prefill workers by the KV they hold and their load.

    Parameters
    ----------
    config : ProxyConfig
    index : KVIndex
    prefill, decode : WorkerPool
    client : WorkerClient
        Signs the lease calls.
    metrics : ProxyMetrics
        ``m_kv_picks`` counts each decode pick by how it was made.
    registry : Registry
        The routing's own metrics are added to it.
    max_sessions : int
        Sessions remembered for affinity (least recently used forgotten first).
    """

    def __init__(self, config: ProxyConfig, index: KVIndex, prefill: WorkerPool, decode: WorkerPool,
                 client: WorkerClient, metrics: ProxyMetrics, registry: Registry, *, max_sessions: int = 65536,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.index = index
        self.prefill = prefill
        self.decode = decode
        self._client = client
        self._metrics = metrics
        self._clock = clock
        self.max_sessions = max_sessions
        self._sessions: collections.OrderedDict[str, tuple[str, str]] = collections.OrderedDict()
        self._rr = 0
        self._tasks: set[asyncio.Task] = set()
        r = registry
        self.m_matched = r.counter("pdkv_kv_route_matched_tokens_total",
                                   "Prompt tokens the chosen workers already held (decode: in its cache; prefill: "
                                   "in its cache or readable from the decode worker; lease: leased from a third "
                                   "worker), by who held them.", ("held_by",))
        self.m_leases = r.counter("pdkv_kv_leases_total", "Leases asked of third workers, by result (ok, empty, "
                                  "failed).", ("result",))
        r.gauge("pdkv_kv_index_blocks", "Blocks the fleet KV index holds for each worker.", ("worker",)) \
            .set_function(lambda: [((u,), index.blocks(u)) for u in sorted(index.urls())])
        r.counter("pdkv_kv_index_refusals_total", "Workers' /pd/kv_events answers the index refused, by reason.",
                  ("reason",)).set_function(lambda: [((k,), v) for k, v in sorted(index.refusals.items())])
        r.counter("pdkv_kv_index_resyncs_total", "Snapshots the index took, by why (periodic, behind, restarted, "
                  "gap).", ("reason",)).set_function(lambda: [((k,), v) for k, v in sorted(index.resyncs.items())])

    # ------------------------------------------------------------------ picks
    def plan(self, prompt: list[int], session: str = "") -> RoutePlan:
        """What every worker in rotation holds of ``prompt``."""
        now = self._clock()
        urls = [w.url for w in self.prefill.workers + self.decode.workers if w.usable(now)]
        return RoutePlan(prompt, self.index.match(prompt, urls), session[:MAX_SESSION_CHARS])

    def _order(self, pool: WorkerPool) -> dict[str, int]:
        self._rr += 1
        n = max(len(pool.workers), 1)
        return {w.url: (i - self._rr) % n for i, w in enumerate(pool.workers)}

    def _candidates(self, pool: WorkerPool, exclude: set[str]) -> list[PoolWorker]:
        now = self._clock()
        return [w for w in pool.workers if w.usable(now) and w.url not in exclude]

    def _affine(self, plan: RoutePlan, cands: list[PoolWorker], slot: int) -> PoolWorker | None:
        if not plan.session:
            return None
        prev = self._sessions.get(plan.session)
        if prev is None:
            return None
        return next((w for w in cands if w.url == prev[slot]), None)

    def _remember(self, plan: RoutePlan, slot: int, url: str) -> None:
        if not plan.session:
            return
        prev = self._sessions.pop(plan.session, ("", ""))
        self._sessions[plan.session] = (url, prev[1]) if slot == 0 else (prev[0], url)
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)

    def pick_decode(self, plan: RoutePlan, exclude: set[str]) -> PoolWorker | None:
        """The decode worker for ``plan`` (None when none is usable)."""
        cands = self._candidates(self.decode, exclude)
        if not cands:
            return None
        n = len(plan.prompt)
        m = plan.matched
        if any(m.get(w.url, 0) for w in cands):
            order = self._order(self.decode)
            k = self.config.kv_load_tokens
            d = min(cands, key=lambda w: (n - m.get(w.url, 0) + k * w.in_flight, order[w.url]))
            best = max(m.get(w.url, 0) for w in cands)
            plan.how = "kv_prefix" if m.get(d.url, 0) >= best else "kv_load"
        else:
            d = self._affine(plan, cands, 0)
            plan.how = "kv_session" if d is not None else "kv_cold"
            if d is None:
                d = self.decode.pick(exclude)
                if d is None:
                    return None
        plan.decode_tokens = m.get(d.url, 0)
        self._metrics.m_kv_picks.inc((plan.how,))
        if plan.decode_tokens:
            self.m_matched.inc(("decode",), plan.decode_tokens)
        self._remember(plan, 0, d.url)
        return d

    def pick_prefill(self, plan: RoutePlan, decode_tokens: int, exclude: set[str]) -> PoolWorker | None:
        """The prefill worker for ``plan`` once the decode worker is known: it holds
        ``decode_tokens`` of the prompt (the index's figure or its reservation's)."""
        cands = self._candidates(self.prefill, exclude)
        if not cands:
            return None
        n = len(plan.prompt)
        m = plan.matched
        if any(m.get(w.url, 0) for w in cands) or decode_tokens:
            order = self._order(self.prefill)
            k = self.config.kv_load_tokens
            p = min(cands, key=lambda w: (n - max(m.get(w.url, 0), decode_tokens) + w.load_tokens
                                          + k * w.in_flight, order[w.url]))
        else:
            p = self._affine(plan, cands, 1) or self.prefill.pick(exclude)
            if p is None:
                return None
        held = max(m.get(p.url, 0), decode_tokens)
        if held:
            self.m_matched.inc(("prefill",), held)
        self._remember(plan, 1, p.url)
        return p

    # ------------------------------------------------------------------ third-party leases
    def third(self, plan: RoutePlan, prefill_url: str, decode_url: str, have: int) -> tuple[str, int] | None:
        """The worker (not ``prefill_url`` nor ``decode_url``) holding the most of the
        prompt, when that is at least one block more than ``have``; with its tokens."""
        st = self.index.state(prefill_url) or self.index.state(decode_url)
        now = self._clock()
        best: tuple[str, int] | None = None
        for w in self.prefill.workers + self.decode.workers:
            if w.url in (prefill_url, decode_url) or not w.usable(now):
                continue
            t = plan.matched.get(w.url, 0)
            ws = self.index.state(w.url)
            if not t or ws is None or (st is not None and (ws["salt"], ws["block_tokens"]) !=
                                       (st["salt"], st["block_tokens"])):
                continue
            if t >= have + ws["block_tokens"] and (best is None or t > best[1]):
                best = (w.url, t)
        return best

    async def lease(self, rid: str, plan: RoutePlan, prefill_url: str, decode_url: str, have: int
                    ) -> dict[str, Any] | None:
        """Asks the best third worker to pin the prompt's blocks it holds; the lease
        (``KVLease`` JSON, to pass as ``PrefillRequest.src``) or None. Never raises for
        the worker's failure."""
        found = self.third(plan, prefill_url, decode_url, have)
        if found is None:
            return None
        url, tokens = found
        bt = max(self.index.block_tokens(url), 1)
        start = have // bt  # the blocks the prefill worker lacks: from the first one neither holds
        hashes = self.index.chain(plan.prompt, url, tokens // bt)[start:]
        lease_id = f"{rid}.lease"
        body = {"lease_id": lease_id, "hashes": hashes, "ttl_s": self.config.kv_timeout_s + 5.0, "start": start}
        try:
            async with self._client.post(url + "/pd/kv_lease", body, timeout=aiohttp.ClientTimeout(
                    total=self.config.connect_timeout_s + 2.0)) as r:
                raw = await r.json(content_type=None) if r.status == 200 else None
                if r.status != 200:
                    log.info("lease of %d blocks at %s: HTTP %d", len(hashes), url, r.status)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as e:
            log.info("lease of %d blocks at %s failed: %s: %s", len(hashes), url, type(e).__name__, e)
            raw = None
        lease = check_lease(raw.get("lease") if isinstance(raw, dict) else None, lease_id, start, len(hashes))
        if lease is None or not lease["blocks"]:
            self.m_leases.inc(("failed" if lease is None else "empty",))
            if raw is not None:
                self.release(url, lease_id)
            return None
        self.m_leases.inc(("ok",))
        self.m_matched.inc(("lease",), (lease["start"] + len(lease["blocks"])) * lease["block_tokens"])
        plan.lease, plan.lease_worker = lease, url
        return lease

    def release(self, url: str, lease_id: str) -> None:
        """Releases a lease in the background (best effort: its TTL is the backstop)."""
        async def go() -> None:
            try:
                async with self._client.post(url + "/pd/kv_release", {"lease_id": lease_id},
                                             timeout=aiohttp.ClientTimeout(total=self.config.connect_timeout_s + 2.0)
                                             ) as r:
                    await r.read()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                log.info("release of lease %s at %s failed (%s: %s); it expires by itself", lease_id, url,
                         type(e).__name__, e)

        t = asyncio.ensure_future(go())
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - shutting down
                pass


def check_lease(v: Any, lease_id: str, start: int, num_hashes: int) -> dict[str, Any] | None:
    """``v`` if it is a well-formed ``KVLease`` for ``lease_id`` covering prompt blocks
    within ``[start, start + num_hashes)`` (what was asked), else None (the prefill
    worker validates it again)."""
    if not isinstance(v, dict) or v.get("lease_id") != lease_id:
        return None
    blocks, gens, first, bt = v.get("blocks"), v.get("generations"), v.get("start"), v.get("block_tokens")
    if not isinstance(blocks, list) or not isinstance(gens, list) or len(gens) != len(blocks):
        return None
    if type(first) is not int or first < start or first + len(blocks) > start + num_hashes or type(bt) is not int \
            or bt < 1:
        return None
    if not all(type(b) is int and b >= 0 for b in blocks) or not all(type(g) is int and g >= 0 for g in gens):
        return None
    return v
