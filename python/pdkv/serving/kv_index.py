"""The proxy's fleet KV index: which worker holds which prefix blocks, kept from the
workers' KV events (:mod:`pdkv.serving.kv_events`), and how many leading tokens of a
prompt each worker holds (:meth:`KVIndex.match`).

:class:`KVIndexPoller` polls every worker in rotation with a signed
``GET /pd/kv_events`` each ``kv_events_interval_s`` and feeds the answers to
:class:`KVIndex`. A worker is known by its *epoch* (drawn when its process starts) and
the number of the last event applied. The index takes a snapshot (every hash the
worker's cache holds, in pages) when it does not know the worker yet, when the worker's
epoch changed (it restarted), when an answer skips an event number (an event was lost),
and at least every ``kv_snapshot_interval_s`` whatever happens, so an index that missed
anything converges. A proxy that restarts starts empty and converges the same way.

Nothing a worker sends is trusted beyond its own entries: every hash must be a block
hash, every answer is size-capped, and one worker holds at most
``max_hashes_per_worker`` entries; an answer that breaks a rule is refused (logged with
the reason, counted) and that worker's entries are dropped until a snapshot succeeds.
A worker that leaves the pool, stops answering probes or fails a poll is dropped from
the index at once: routing never prefers a worker for KV it cannot serve.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence
from urllib.parse import urlencode

import aiohttp

from .kv_events import EVENT_KINDS, MAX_EPOCH_CHARS
from .prefix_hash import block_hashes, is_block_hash
from .proxy_client import WorkerClient
from .proxy_pool import PoolWorker

__all__ = ["KVEventsRefused", "KVIndex", "KVIndexPoller"]

log = logging.getLogger("pdkv.serving")

#: Largest block size a worker may report (tokens).
MAX_BLOCK_TOKENS = 1 << 16


class KVEventsRefused(Exception):
    """A worker's ``/pd/kv_events`` answer broke a rule (``reason`` is a short label)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class _Snapshot:
    """A snapshot being read page by page."""

    epoch: str
    seq: int                      # the first page's seq: events are applied from here
    hashes: set[str] = field(default_factory=set)
    after: str = ""               # the last hash received


@dataclass
class _WorkerKV:
    """What the index knows of one worker."""

    url: str
    epoch: str = ""
    seq: int = 0
    salt: str = ""
    block_tokens: int = 0
    hashes: set[str] = field(default_factory=set)
    synced: bool = False          # a whole snapshot was applied (and events since)
    snapshot_at: float = float("-inf")
    pending: _Snapshot | None = None


class KVIndex:
    """Block hash -> the workers that hold it, with each worker's epoch and position.

    Not thread-safe: used from the proxy's event loop.

    Parameters
    ----------
    max_hashes_per_worker : int
        Entries one worker may hold in the index (a snapshot or events beyond it are
        refused).
    max_response_hashes : int
        Hashes one answer may carry.
    snapshot_interval_s : float
        A full snapshot of each worker at least this often.
    """

    def __init__(self, *, max_hashes_per_worker: int = 1 << 20, max_response_hashes: int = 16384,
                 snapshot_interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_hashes_per_worker = max_hashes_per_worker
        self.max_response_hashes = max_response_hashes
        self.snapshot_interval_s = snapshot_interval_s
        self._clock = clock
        self._owners: dict[str, set[str]] = {}
        self._workers: dict[str, _WorkerKV] = {}
        self.refusals: collections.Counter[str] = collections.Counter()   # reason -> answers refused
        self.resyncs: collections.Counter[str] = collections.Counter()    # reason -> snapshots taken
        self.drops: collections.Counter[str] = collections.Counter()      # reason -> workers dropped

    # ------------------------------------------------------------------ reading
    def urls(self) -> set[str]:
        """Workers the index has state for."""
        return set(self._workers)

    def holders(self, h: str) -> frozenset[str]:
        """Workers that hold block hash ``h``."""
        return frozenset(self._owners.get(h, ()))

    def blocks(self, url: str | None = None) -> int:
        """Entries of ``url`` (all workers' when None)."""
        if url is None:
            return sum(len(w.hashes) for w in self._workers.values())
        w = self._workers.get(url)
        return len(w.hashes) if w is not None else 0

    def state(self, url: str) -> dict[str, Any] | None:
        """``epoch``, ``seq``, ``salt``, ``block_tokens``, ``synced``, ``blocks`` of a worker."""
        w = self._workers.get(url)
        if w is None:
            return None
        return {"epoch": w.epoch, "seq": w.seq, "salt": w.salt, "block_tokens": w.block_tokens,
                "synced": w.synced, "blocks": len(w.hashes)}

    def match(self, prompt: Sequence[int], urls: Iterable[str]) -> dict[str, int]:
        """The leading tokens of ``prompt`` each of ``urls`` holds in its cache (0 for a
        worker the index does not know or has not synced).

        Hashes are computed once per (salt, block size) among the workers: workers
        with different salts never share KV.
        """
        out: dict[str, int] = {}
        groups: dict[tuple[str, int], list[str]] = {}
        for u in urls:
            out[u] = 0
            w = self._workers.get(u)
            if w is not None and w.synced and w.salt and w.hashes:
                groups.setdefault((w.salt, w.block_tokens), []).append(u)
        for (salt, bt), members in groups.items():
            live = set(members)
            for i, h in enumerate(block_hashes(prompt, bt, salt)):
                have = self._owners.get(h)
                if not have:
                    break
                live &= have
                if not live:
                    break
                for u in live:
                    out[u] = (i + 1) * bt
        return out

    def chain(self, prompt: Sequence[int], url: str, blocks: int) -> list[str]:
        """The first ``blocks`` block hashes of ``prompt`` under worker ``url``'s salt
        (what to ask it to lease); [] for a worker the index does not know."""
        w = self._workers.get(url)
        if w is None or not w.salt:
            return []
        return block_hashes(prompt, w.block_tokens, w.salt, limit=blocks)

    def block_tokens(self, url: str) -> int:
        w = self._workers.get(url)
        return w.block_tokens if w is not None else 0

    # ------------------------------------------------------------------ polling
    def next_query(self, url: str) -> dict[str, str]:
        """The query of the next ``/pd/kv_events`` poll of ``url``: the events after the
        last one applied, or the (next page of a) snapshot."""
        w = self._workers.get(url)
        if w is not None and w.pending is not None:
            return {"snapshot": "1", "after": w.pending.after} if w.pending.after else {"snapshot": "1"}
        if w is None or not w.synced:
            return {"snapshot": "1"}
        if self._clock() - w.snapshot_at >= self.snapshot_interval_s:
            self.resyncs["periodic"] += 1
            return {"snapshot": "1"}
        return {"epoch": w.epoch, "since": str(w.seq)}

    def apply(self, url: str, query: Mapping[str, str], body: Any) -> bool:
        """Applies worker ``url``'s answer to ``query``; True when another page or more
        events are waiting (poll again now).

        Raises
        ------
        KVEventsRefused
            The answer broke a rule; the worker's entries are dropped (the next poll
            starts a snapshot).
        """
        try:
            return self._apply(url, query, body)
        except KVEventsRefused as e:
            self.refusals[e.reason] += 1
            self.drop(url, f"refused: {e.reason}")
            raise

    def drop(self, url: str, reason: str) -> None:
        """Forgets every entry of ``url`` (dead, removed, restarted or misbehaving)."""
        w = self._workers.pop(url, None)
        if w is None:
            return
        self._remove(url, w.hashes)
        self.drops[reason.split(":", 1)[0]] += 1
        log.info("KV index: dropped worker %s (%d blocks): %s", url, len(w.hashes), reason)

    # ------------------------------------------------------------------ internals
    def _head(self, body: Any) -> tuple[str, int, str, int, bool]:
        if not isinstance(body, dict):
            raise KVEventsRefused("malformed", "the answer is not a JSON object")
        epoch, seq, salt, bt, more = (body.get(k) for k in ("epoch", "seq", "salt", "block_tokens", "more"))
        if not isinstance(epoch, str) or not epoch or len(epoch) > MAX_EPOCH_CHARS or \
                not (epoch.isascii() and epoch.isalnum()):
            raise KVEventsRefused("malformed", f"epoch must be 1 to {MAX_EPOCH_CHARS} letters or digits")
        if type(seq) is not int or seq < 0:
            raise KVEventsRefused("malformed", "seq must be an integer >= 0")
        if not isinstance(salt, str) or (salt and not is_block_hash(salt)):
            raise KVEventsRefused("malformed", "salt must be empty or a block hash (16 hex digits)")
        if type(bt) is not int or not 1 <= bt <= MAX_BLOCK_TOKENS:
            raise KVEventsRefused("malformed", f"block_tokens must be an integer in [1, {MAX_BLOCK_TOKENS}]")
        if more is None:
            more = False
        if not isinstance(more, bool):
            raise KVEventsRefused("malformed", "more must be a boolean")
        if ("events" in body) == ("snapshot" in body):
            raise KVEventsRefused("malformed", "the answer must hold exactly one of events and snapshot")
        return epoch, seq, salt, bt, more

    def _hashes(self, v: Any, where: str) -> list[str]:
        if not isinstance(v, list):
            raise KVEventsRefused("malformed", f"{where} must be a list of block hashes")
        if len(v) > self.max_response_hashes:
            raise KVEventsRefused("oversized", f"{where} holds {len(v)} hashes (at most "
                                  f"{self.max_response_hashes} per answer)")
        for h in v:
            if not is_block_hash(h):
                raise KVEventsRefused("bad_hash", f"{where} holds {str(h)[:40]!r}, not a block hash")
        return v

    def _apply(self, url: str, query: Mapping[str, str], body: Any) -> bool:
        epoch, seq, salt, bt, more = self._head(body)
        w = self._workers.get(url)
        if "snapshot" in body:
            page = self._hashes(body["snapshot"], "snapshot")
            after = query.get("after", "")
            if any(h <= after for h in page) if after else False:
                raise KVEventsRefused("malformed", "a snapshot page holds hashes not after the one asked for")
            if w is None:
                w = self._workers[url] = _WorkerKV(url)
            if not after or w.pending is None or w.pending.epoch != epoch:
                if after:  # the worker restarted between pages: start again
                    w.pending = None
                    self.resyncs["epoch"] += 1
                    return True
                if "snapshot" not in query:  # the worker answered our events query with a snapshot
                    self.resyncs["restarted" if w.epoch and w.epoch != epoch else "behind"] += 1
                w.pending = _Snapshot(epoch, seq)
            snap = w.pending
            snap.hashes.update(page)
            if len(snap.hashes) > self.max_hashes_per_worker:
                w.pending = None
                raise KVEventsRefused("too_many", f"the snapshot holds more than {self.max_hashes_per_worker} "
                                      "hashes")
            if page:
                snap.after = page[-1]
            if more and page:
                return True
            w.pending = None
            self._remove(url, w.hashes - snap.hashes)
            self._add(url, snap.hashes - w.hashes)
            w.hashes = snap.hashes
            w.epoch, w.seq, w.salt, w.block_tokens, w.synced = epoch, snap.seq, salt, bt, True
            w.snapshot_at = self._clock()
            return True  # the events since the snapshot began
        events = body["events"]
        if not isinstance(events, list) or len(events) > self.max_response_hashes:
            raise KVEventsRefused("malformed" if not isinstance(events, list) else "oversized",
                                  "events must be a list of at most max_response_hashes events")
        if w is None or not w.synced or w.pending is not None:
            return True  # events we did not ask for: a snapshot comes first (next_query)
        if epoch != w.epoch or salt != w.salt or bt != w.block_tokens:
            self.resyncs["epoch"] += 1
            self.drop(url, "restarted (new epoch, salt or block size)")
            return True
        parsed: list[tuple[str, list[str]]] = []
        total = 0
        expect = w.seq + 1
        for i, e in enumerate(events):
            if not isinstance(e, dict) or type(e.get("seq")) is not int or e.get("kind") not in EVENT_KINDS:
                raise KVEventsRefused("malformed", f"events[{i}] must be {{seq: int, kind: one of "
                                      f"{'/'.join(EVENT_KINDS)}, hashes}}")
            hs = self._hashes(e.get("hashes", []), f"events[{i}].hashes")
            total += len(hs)
            if total > self.max_response_hashes:
                raise KVEventsRefused("oversized", f"the events hold more than {self.max_response_hashes} hashes")
            if e["seq"] != expect:
                self.resyncs["gap"] += 1
                log.warning("KV index: worker %s skipped from event %d to %d (lost events): resync by snapshot",
                            url, expect - 1, e["seq"])
                w.synced = False
                return True
            expect += 1
            parsed.append((e["kind"], hs))
        last = expect - 1
        if seq != last:
            if seq < last or events:
                raise KVEventsRefused("malformed", f"seq {seq} does not follow the events (last {last})")
            self.resyncs["gap"] += 1
            w.synced = False  # it says it is at seq but sent nothing since ours: a hole
            return True
        for kind, hs in parsed:
            if kind == "stored":
                new = set(hs) - w.hashes
                if len(w.hashes) + len(new) > self.max_hashes_per_worker:
                    raise KVEventsRefused("too_many", f"the worker would hold more than "
                                          f"{self.max_hashes_per_worker} hashes")
                w.hashes |= new
                self._add(url, new)
            elif kind == "evicted":
                gone = w.hashes.intersection(hs)
                w.hashes -= gone
                self._remove(url, gone)
            else:  # cleared
                self._remove(url, w.hashes)
                w.hashes = set()
        w.seq = last
        return more

    def _add(self, url: str, hs: Iterable[str]) -> None:
        for h in hs:
            s = self._owners.get(h)
            if s is None:
                self._owners[h] = {url}
            else:
                s.add(url)

    def _remove(self, url: str, hs: Iterable[str]) -> None:
        for h in hs:
            s = self._owners.get(h)
            if s is not None:
                s.discard(url)
                if not s:
                    del self._owners[h]


class KVIndexPoller:
    """Keeps a :class:`KVIndex` up to date by polling the workers' ``/pd/kv_events``.

    Parameters
    ----------
    index : KVIndex
    client : WorkerClient
        Signs every poll.
    workers : callable
        Every worker of both pools now.
    interval_s : float
        Between two polls of each worker.
    timeout_s : float
        Deadline of one poll.
    max_body_bytes : int
        Largest answer read (a bigger one is refused).
    max_pages : int
        Answers read from one worker per round (a long snapshot continues next round).
    """

    def __init__(self, index: KVIndex, client: WorkerClient, workers: Callable[[], list[PoolWorker]], *,
                 interval_s: float = 0.25, timeout_s: float = 2.0, max_body_bytes: int = 4 << 20,
                 max_pages: int = 64) -> None:
        self.index = index
        self._client = client
        self._workers = workers
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.max_body_bytes = max_body_bytes
        self.max_pages = max_pages
        self._unsupported: dict[str, float] = {}   # url -> when it answered 404 (older workers)
        self._last_refusal: dict[str, str] = {}

    async def run(self) -> None:
        """Polls until cancelled."""
        while True:
            await self.poll_once()
            await asyncio.sleep(self.interval_s)

    async def poll_once(self) -> None:
        """One round: drops workers that left the pool or stopped answering, polls the rest."""
        now = time.monotonic()
        ws = [w for w in self._workers() if w.info is not None and w.compatible and w.alive and not w.switching]
        keep = {w.url for w in ws}
        for url in self.index.urls() - keep:
            self.index.drop(url, "left the pool or stopped answering")
        ws = [w for w in ws if now - self._unsupported.get(w.url, float("-inf")) > 30.0]
        await asyncio.gather(*(self._poll(w) for w in ws))

    async def _poll(self, w: PoolWorker) -> None:
        for _ in range(self.max_pages):
            q = self.index.next_query(w.url)
            try:
                body = await self._get(w, q)
            except KVEventsRefused as e:
                self.index.refusals[e.reason] += 1
                self._refused(w, e)
                self.index.drop(w.url, f"refused: {e.reason}")
                return
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                self.index.drop(w.url, f"poll failed: {type(e).__name__}: {e}")
                return
            if body is None:
                return
            try:
                if not self.index.apply(w.url, q, body):
                    self._last_refusal.pop(w.url, None)
                    return
            except KVEventsRefused as e:
                self._refused(w, e)
                return

    async def _get(self, w: PoolWorker, q: Mapping[str, str]) -> Any:
        url = f"{w.url}/pd/kv_events?{urlencode(q)}"
        async with self._client.get(url, timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as r:
            if r.status in (401, 403):
                w.refused(r.status, "/pd/kv_events")
                self.index.drop(w.url, f"/pd/kv_events answered HTTP {r.status}")
                return None
            if r.status == 404:  # a worker without the route: nothing to index
                self._unsupported[w.url] = time.monotonic()
                self.index.drop(w.url, "no /pd/kv_events route")
                return None
            if r.status != 200:
                self.index.drop(w.url, f"/pd/kv_events answered HTTP {r.status}")
                return None
            raw = await r.content.read(self.max_body_bytes + 1)
            if len(raw) > self.max_body_bytes:
                raise KVEventsRefused("oversized", f"the answer is larger than {self.max_body_bytes} bytes")
            try:
                return json.loads(raw)
            except (ValueError, RecursionError):
                raise KVEventsRefused("malformed", "the answer is not JSON") from None

    def _refused(self, w: PoolWorker, e: KVEventsRefused) -> None:
        msg = str(e)
        if self._last_refusal.get(w.url) != msg:  # once per distinct reason, not every 0.25 s
            log.error("KV index: refused %s worker %s's /pd/kv_events answer (%s): %s; its entries are dropped",
                      w.role, w.url, e.reason, msg)
        self._last_refusal[w.url] = msg
