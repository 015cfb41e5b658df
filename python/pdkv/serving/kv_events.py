"""A worker's KV event log: what its prefix cache stored and evicted, numbered, for the
proxies' fleet index (:mod:`pdkv.serving.kv_index`) to poll at ``GET /pd/kv_events``.

The engine calls :meth:`KVEventLog.record` with each
:class:`~pdkv.serving.engine_types.KVEvent` (``stored``, ``evicted``, ``cleared``), in
order, from its stepping thread. The log gives each one a sequence number and keeps the
last ``max_events`` of them (and at most ``max_hashes`` hashes in all); older ones are
forgotten. Each worker process draws a random *epoch* when it starts, so a proxy can
tell a restarted worker (whose numbers start again from 0) from one it knows.

``GET /pd/kv_events?epoch=<e>&since=<seq>`` answers::

    {"epoch", "seq", "salt", "block_tokens", "events": [{"seq", "kind", "hashes"}], "more"}

with the events after ``since`` (at most ``max_response_hashes`` hashes; ``more`` is true
when more are waiting, and ``seq`` is the last one sent). When ``epoch`` is not this
process's, ``since`` is older than the log keeps (or newer than it has) or absent, it
answers a *snapshot* instead: every hash the cache holds, in pages of
``max_response_hashes`` in ascending order::

    {"epoch", "seq", "salt", "block_tokens", "snapshot": [hashes], "more"}

The next page is ``GET /pd/kv_events?snapshot=1&after=<last hash of the page>``. A
snapshot's ``seq`` is read *before* its hashes: events after it may already be in the
pages, so the proxy applies the events from the first page's ``seq`` on after the last
page; adding or removing a hash twice changes nothing, and every hash's last event
decides, so the result is the cache's state. Pages are keyed by hash (not by offset),
so a hash held throughout is on exactly one page whatever changes between them.

The route is under ``/pd/``: only callers with the cluster credential may read it
(:mod:`pdkv.serving.auth`).
"""

from __future__ import annotations

import bisect
import collections
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from aiohttp import web

from pdkv.errors import InvalidArgument

from .prefix_hash import is_block_hash

__all__ = ["EVENT_KINDS", "KVEventLog", "parse_query", "serve_kv_events"]

log = logging.getLogger("pdkv.serving")

#: The kinds of event the engine reports.
EVENT_KINDS = ("stored", "evicted", "cleared")
#: Longest ``epoch`` a query may carry (the log's own are 16 hex digits).
MAX_EPOCH_CHARS = 64
#: Seconds a sorted snapshot serves the pages after its first.
SNAPSHOT_REUSE_S = 5.0


@dataclass(frozen=True)
class _Entry:
    seq: int
    kind: str
    hashes: tuple[str, ...]


@dataclass(frozen=True)
class KVEventsQuery:
    """A validated ``/pd/kv_events`` query (see :func:`parse_query`)."""

    epoch: str | None
    since: int | None
    snapshot: bool
    after: str


def parse_query(q: Any) -> KVEventsQuery:
    """Validates the query of ``GET /pd/kv_events``.

    Parameters
    ----------
    q : mapping of str to str
        The query parameters (``epoch``, ``since``, ``snapshot``, ``after``).

    Raises
    ------
    InvalidArgument
        A malformed or unknown parameter, naming it.
    """
    known = {"epoch", "since", "snapshot", "after"}
    for k in q.keys():
        if k not in known:
            raise InvalidArgument(f"unknown query parameter {k!r} (known: {', '.join(sorted(known))})")
    epoch = q.get("epoch")
    if epoch is not None and (not epoch or len(epoch) > MAX_EPOCH_CHARS or not (epoch.isascii() and epoch.isalnum())):
        raise InvalidArgument(f"epoch must be 1 to {MAX_EPOCH_CHARS} letters or digits, got {epoch[:80]!r}")
    since_s = q.get("since")
    since: int | None = None
    if since_s is not None:
        if not (since_s.isascii() and since_s.isdigit()) or len(since_s) > 19:
            raise InvalidArgument(f"since must be a non-negative integer, got {since_s[:80]!r}")
        since = int(since_s)
    snap_s = q.get("snapshot", "0")
    if snap_s not in ("0", "1"):
        raise InvalidArgument(f"snapshot must be 0 or 1, got {snap_s[:80]!r}")
    after = q.get("after", "")
    if after and not is_block_hash(after):
        raise InvalidArgument(f"after must be a block hash (16 lowercase hex digits), got {after[:80]!r}")
    if after and snap_s != "1":
        raise InvalidArgument("after is only valid with snapshot=1")
    return KVEventsQuery(epoch, since, snap_s == "1", after)


class KVEventLog:
    """The bounded, numbered log of one worker's KV events (thread-safe).

    Parameters
    ----------
    snapshot : callable
        Returns every block hash the cache holds now (``engine.cache_snapshot``).
    salt : callable
        Returns the cache's salt (``engine.cache_salt``; '' when the cache is off).
    block_tokens : int
        Tokens per block.
    max_events : int
        Events kept (older ones are forgotten: a proxy that is further behind gets a
        snapshot).
    max_hashes : int
        Hashes kept over all retained events.
    max_response_hashes : int
        Hashes per answer (events or one snapshot page).
    epoch : str, optional
        Default: 16 random hex digits (each process its own).
    """

    def __init__(self, snapshot: Callable[[], Any], salt: Callable[[], str], block_tokens: int, *,
                 max_events: int = 4096, max_hashes: int = 65536, max_response_hashes: int = 4096,
                 epoch: str | None = None) -> None:
        for k, v in (("max_events", max_events), ("max_hashes", max_hashes),
                     ("max_response_hashes", max_response_hashes), ("block_tokens", block_tokens)):
            if not isinstance(v, int) or v < 1:
                raise InvalidArgument(f"{k} must be an integer >= 1, got {v!r}")
        self._snapshot = snapshot
        self._salt = salt
        self.block_tokens = block_tokens
        self.max_events = max_events
        self.max_hashes = max_hashes
        self.max_response_hashes = max_response_hashes
        self.epoch = epoch or secrets.token_hex(8)
        self._lock = threading.Lock()
        self._events: collections.deque[_Entry] = collections.deque()
        self._held = 0          # hashes in _events
        self._seq = 0           # the last event's number (0: none yet)
        self.dropped = 0        # events forgotten to stay within the caps
        self.refused = 0        # malformed events from the engine (logged, not kept)
        self._sorted: tuple[float, list[str]] | None = None  # (when, the last snapshot sorted)

    @property
    def seq(self) -> int:
        with self._lock:
            return self._seq

    def record(self, event: Any) -> None:
        """Appends one engine event (the engine's KV event sink; any thread).

        A malformed event (unknown kind, a hash that is not a block hash) is logged and
        dropped, and the log is *reset*: its numbers jump so that every proxy takes a
        snapshot (the cache's true state) instead of trusting a log with a hole.
        """
        kind = getattr(event, "kind", None)
        hashes = tuple(getattr(event, "hashes", ()) or ())
        ok = kind in EVENT_KINDS and all(is_block_hash(h) for h in hashes)
        step = self.max_response_hashes
        with self._lock:
            if not ok:
                self._seq += 1
                self.refused += 1
                self._events.clear()
                self._held = 0
            else:
                # An event longer than an answer (an engine-wide eviction) is split: every
                # answer stays within max_response_hashes.
                for i in range(0, max(len(hashes), 1), step):
                    self._seq += 1
                    self._events.append(_Entry(self._seq, kind, hashes[i:i + step]))
                self._held += len(hashes)
                while self._events and (len(self._events) > self.max_events or self._held > self.max_hashes):
                    old = self._events.popleft()
                    self._held -= len(old.hashes)
                    self.dropped += 1
        if not ok:
            log.error("KV event refused (kind %r, %d hashes): not a valid event; proxies will resync from a "
                      "snapshot", kind, len(hashes))

    def query(self, q: KVEventsQuery) -> dict[str, Any]:
        """The answer to one ``GET /pd/kv_events`` (see the module docstring)."""
        head = {"epoch": self.epoch, "salt": self._salt() or "", "block_tokens": self.block_tokens}
        with self._lock:
            seq = self._seq
            first = self._events[0].seq if self._events else seq + 1
            if not q.snapshot and q.epoch == self.epoch and q.since is not None and first - 1 <= q.since <= seq:
                events: list[dict[str, Any]] = []
                n = 0
                last = q.since
                for e in self._events:
                    if e.seq <= q.since:
                        continue
                    if events and n + len(e.hashes) > self.max_response_hashes:
                        break
                    events.append({"seq": e.seq, "kind": e.kind, "hashes": list(e.hashes)})
                    n += len(e.hashes)
                    last = e.seq
                return {**head, "seq": last, "events": events, "more": last < seq}
        # A snapshot page: ``seq`` read before the hashes (see the module docstring). The
        # sorted snapshot is kept for the next pages (SNAPSHOT_REUSE_S): one sort per
        # snapshot, not per page. Pages of an older snapshot are as good as fresh ones:
        # the proxy replays the events from its first page's seq on.
        now = time.monotonic()
        with self._lock:
            cached = self._sorted
        if q.after and cached is not None and now - cached[0] < SNAPSHOT_REUSE_S:
            hashes = cached[1]
        else:
            hashes = sorted(self._snapshot())
            with self._lock:
                self._sorted = (now, hashes)
        i = bisect.bisect_right(hashes, q.after) if q.after else 0
        page = hashes[i:i + self.max_response_hashes]
        return {**head, "seq": seq, "snapshot": page, "more": i + len(page) < len(hashes)}

    async def handle(self, request: web.Request) -> web.Response:
        """``GET /pd/kv_events`` (400 for a malformed query)."""
        try:
            q = parse_query(request.query)
        except InvalidArgument as e:
            return web.json_response({"error": {"message": str(e), "type": "invalid_request_error",
                                                "param": None, "code": "invalid_query"}}, status=400)
        return web.json_response(self.query(q))


def serve_kv_events(app: web.Application, engine: Any) -> KVEventLog:
    """Creates ``engine``'s event log, makes it the engine's KV event sink and serves it
    at ``GET /pd/kv_events`` on ``app`` (a worker's routes).

    An engine without a prefix cache API (``set_kv_event_sink``) serves an empty
    snapshot with an empty salt: proxies then know it holds nothing to reuse.
    """
    snapshot = getattr(engine, "cache_snapshot", None) or tuple
    kv = KVEventLog(snapshot, lambda: str(getattr(engine, "cache_salt", "") or ""),
                    int(engine.pool.geometry.block_tokens))
    sink = getattr(engine, "set_kv_event_sink", None)
    if sink is not None:
        sink(kv.record)
    app.router.add_get("/pd/kv_events", kv.handle)
    return kv
