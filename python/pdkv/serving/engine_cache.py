"""The engine's block-level API: blocks held outside running requests (decode-side
reservations, leases to remote readers, imports of KV pulled from a peer) and the
prefix cache's index, events, eviction hook and statistics (see
:mod:`pdkv.serving.engine` and :mod:`pdkv.serving.prefix_cache`).

:class:`EngineBlocks` is a base class of :class:`~pdkv.serving.engine.Engine`: its
methods share the engine's lock, request table and block manager.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Callable, Sequence

from pdkv.errors import InvalidArgument, NotFound

from .engine_prefix import RequestPrefixes
from .engine_types import KVEventSink, RequestState
from .prefix_cache import EvictHook, PrefixCache

if TYPE_CHECKING:
    from .engine_checks import RequestChecks
    from .engine_requests import RequestTable
    from .kv_pool import PagedKVPool

__all__ = ["EngineBlocks"]

log = logging.getLogger("pdkv.serving")


class EngineBlocks:
    """Reservations, leases, imports and the prefix cache of an engine (a base class).

    Threads: every method may be called from any thread, also while a step runs.
    """

    pool: "PagedKVPool"
    cache_salt: str
    _lock: threading.Lock
    _table: "RequestTable"
    _checks: "RequestChecks"
    _blocks: PrefixCache
    _prefixes: RequestPrefixes
    _wake: Callable[[], None]

    def _init_blocks(self) -> None:
        self._kv_sink: KVEventSink | None = None
        self._sink_lock = threading.RLock()  # events leave in the order they were queued

    # ------------------------------------------------------------------ decode side
    def reserve(self, request_id: str, num_tokens: int) -> list[int]:
        """Decode side: allocates blocks for the KV of a ``num_tokens``-token prompt.

        The prefill side writes the prompt's KV into these blocks; then call
        :meth:`admit_prefilled` (or :meth:`admit_recompute` if the transfer failed, or
        :meth:`release` to give them back).

        Returns
        -------
        list of int
            ``ceil(num_tokens / block_tokens)`` block ids, in token order.

        Raises
        ------
        ResourceExhausted
            Not enough free blocks now (retry later).
        AlreadyExists, InvalidArgument
        """
        if not isinstance(num_tokens, int) or num_tokens < 1:
            raise InvalidArgument(f"num_tokens must be a positive integer, got {num_tokens!r}")
        if num_tokens > self.pool.capacity_tokens:
            raise InvalidArgument(f"{num_tokens} tokens do not fit the KV pool ({self.pool.capacity_tokens} tokens)")
        with self._lock:
            out = self._table.reserve(request_id, num_tokens)
        self._flush_kv_events()
        return out

    def reserve_prefix(self, request_id: str, prompt_ids: Sequence[int]) -> tuple[list[int], int]:
        """Decode side: :meth:`reserve` for ``prompt_ids``, reusing its cached prefix.

        Returns
        -------
        blocks : list of int
            ``ceil(len(prompt_ids) / block_tokens)`` block ids, in token order.
        cached_blocks : int
            The first ``cached_blocks`` of ``blocks`` are this engine's cached blocks of
            the prompt: they hold its KV already (pinned until :meth:`admit_prefilled`
            or :meth:`release`); the peer fills only the others. Always leaves at least
            the block of the prompt's last token to the peer. 0 with the cache off.
            Every block is marked exposed (the evict hook runs before its reuse).

        Raises
        ------
        ResourceExhausted
            Not enough free blocks now (retry later).
        AlreadyExists, InvalidArgument
        """
        prompt = tuple(int(t) for t in prompt_ids)
        if not prompt:
            raise InvalidArgument(f"request {request_id!r} has an empty prompt")
        for t in prompt:
            self._checks.token(t)
        if len(prompt) > self.pool.capacity_tokens:
            raise InvalidArgument(f"{len(prompt)} tokens do not fit the KV pool ({self.pool.capacity_tokens} tokens)")
        with self._lock:
            out = self._table.reserve_prefix(request_id, prompt)
        self._flush_kv_events()
        return out

    def release(self, request_id: str) -> None:
        """Frees the blocks of a reservation or of a finished prefill-only request (full
        blocks stay cached with the prefix cache on).

        Raises
        ------
        NotFound
            ``request_id`` holds no reservation and no finished prefill-only blocks.
        """
        with self._lock:
            if self._table.drop_reservation(request_id):
                self._wake()
            else:
                req = self._table.requests.get(request_id)
                if req is None or req.state is not RequestState.HELD:
                    raise NotFound(f"request {request_id!r} holds no reserved or prefilled blocks")
                self._table.free_held(req)
                self._wake()
        self._flush_kv_events()

    # ------------------------------------------------------------------ remote readers and imports
    def lease(self, lease_id: str, hashes: Sequence[str]) -> list[int]:
        """Pins the cached blocks of the leading run of ``hashes`` for a remote reader.

        Returns
        -------
        list of int
            Their block ids (maybe fewer than ``hashes``; ``[]``: nothing is cached
            and no lease is recorded). They are exposed: once unleased and evicted, the
            evict hook bumps their generations before reuse, so a late read with the
            generations read now fails with :class:`pdkv.StaleBlock`.

        Raises
        ------
        InvalidArgument
            A malformed lease id or hash.
        AlreadyExists
            ``lease_id`` is in use.
        """
        with self._lock:
            return self._blocks.lease(lease_id, hashes)

    def unlease(self, lease_id: str) -> bool:
        """Drops a lease's pins (frees an uncommitted import); False if unknown."""
        with self._lock:
            ok = self._blocks.unlease(lease_id)
            if ok:
                self._wake()
        return ok

    def import_blocks(self, lease_id: str, hashes: Sequence[str]) -> list[int]:
        """Allocates one block per hash under a new lease, for KV pulled from a peer
        (write it into them, then :meth:`commit_import`; :meth:`unlease` ends the lease).

        Raises
        ------
        ResourceExhausted
            Not enough free blocks.
        InvalidArgument
            Malformed id or hashes, no hashes, or the prefix cache is off.
        AlreadyExists
        """
        with self._lock:
            out = self._blocks.import_blocks(lease_id, hashes)
        self._flush_kv_events()
        return out

    def commit_import(self, lease_id: str) -> int:
        """Caches an import's blocks under their hashes (their KV has landed); they
        stay pinned until :meth:`unlease`. Returns the blocks that entered the index.

        Raises
        ------
        NotFound, InvalidArgument
            No such import, or committed already.
        """
        with self._lock:
            n = self._blocks.commit_import(lease_id)
        self._flush_kv_events()
        return n

    # ------------------------------------------------------------------ index, events, stats
    def block_hashes(self, token_ids: Sequence[int]) -> list[str]:
        """The hashes of the full blocks of ``token_ids`` under :attr:`cache_salt`."""
        return self._prefixes.hashes(list(token_ids))

    def cached_prefix_tokens(self, token_ids: Sequence[int]) -> int:
        """Tokens of the leading full blocks of ``token_ids`` cached here now."""
        hashes = self.block_hashes(token_ids)
        with self._lock:
            return len(self._blocks.match(hashes)) * self.pool.block_tokens

    def cache_snapshot(self) -> tuple[str, ...]:
        """Every block hash in the index now (it reflects every event queued so far:
        events delivered after it may repeat what it holds)."""
        with self._lock:
            return self._blocks.snapshot()

    def set_kv_event_sink(self, sink: KVEventSink | None) -> None:
        """Sends every later change of the index to ``sink(KVEvent)``: in order, without
        engine locks held, in whatever thread made the change (it must be quick). None
        stops it (events are dropped then)."""
        with self._sink_lock:
            with self._lock:
                self._blocks.take_events()
                self._kv_sink = sink

    def set_evict_hook(self, hook: EvictHook | None) -> None:
        """``hook(block_ids)`` runs (engine lock held; it may block briefly) before blocks
        that were exposed (leased, or reserved with :meth:`reserve_prefix`) are reused.
        A worker bumps their pdkv generations there."""
        with self._lock:
            self._blocks.set_evict_hook(hook)

    def clear_prefix_cache(self) -> int:
        """Drops every cached block no one holds and empties the index (a ``cleared``
        event); returns the hashes dropped."""
        with self._lock:
            n = self._blocks.clear()
            self._wake()
        self._flush_kv_events()
        return n

    def prefix_stats(self) -> dict[str, Any]:
        """Counters of the prefix cache.

        Returns
        -------
        dict
            ``enabled`` (0/1), ``queries_tokens`` (prompt tokens of requests admitted
            to compute), ``hit_tokens`` (of those, found cached), ``pulled_hit_tokens``
            (of those, in imported blocks), ``computed_prompt_tokens`` (prompt tokens
            computed, again after preemptions), ``readmit_hit_tokens`` (tokens that
            preempted requests found cached when re-admitted), ``cached_blocks`` (hashes in the
            index), ``cached_free_blocks`` (evictable), ``evictions``,
            ``evict_hook_calls``, ``leases``.
        """
        with self._lock:
            return self._prefixes.stats()

    def _flush_kv_events(self) -> None:
        """Delivers the queued index events (call it without the engine lock)."""
        with self._sink_lock:
            with self._lock:
                events = self._blocks.take_events()
                sink = self._kv_sink
            if sink is None:
                return
            for ev in events:
                try:
                    sink(ev)
                except Exception:  # noqa: BLE001 - a sink must not break the engine
                    log.exception("KV event sink failed")
