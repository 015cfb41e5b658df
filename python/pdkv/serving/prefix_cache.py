"""The engine's block manager with prefix caching: reference-counted KV blocks, an
index from block hashes (:mod:`pdkv.serving.prefix_hash`) to the blocks holding
their KV, and an LRU of cached blocks no request holds.

A block is in one of three states:

*free*
    never cached (or its hash was dropped): in the pool's
    :class:`~pdkv.serving.kv_pool.BlockAllocator`, handed out first;
*held*
    reference count > 0: requests, reservations and leases hold it (a cached block
    may be held by several at once: they share its KV);
*cached free*
    reference count 0 but its hash is in the index: kept for a later request with the
    same prefix, in least-recently-used order. An allocation evicts the oldest ones
    only when no free block is left.

A block's hash is inserted (:meth:`PrefixCache.insert`) only once the KV of all its
tokens is computed, so a lookup never finds a block still being written. Blocks that
were *exposed* (their ids handed to a peer that may read them later: leases, decode
reservations) are passed to the evict hook before they are reused, which bumps their
pdkv generations so that a late read fails with :class:`pdkv.StaleBlock` instead of
reading another prompt's KV.

Changes of the index are queued as :class:`~pdkv.serving.engine_types.KVEvent`
(``stored``, ``evicted``, ``cleared``); the engine takes them under its lock
(:meth:`PrefixCache.take_events`) and delivers them after it drops its locks.

With ``enabled=False`` the manager is the plain allocator: nothing is ever hashed,
freed blocks go straight back to the allocator's free list (same order as before).

Thread safety: none; the engine guards it with its lock.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from pdkv.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted

from .engine_types import KVEvent
from .kv_pool import BlockAllocator
from .prefix_hash import is_block_hash

__all__ = ["EvictHook", "PrefixCache"]

log = logging.getLogger("pdkv.serving")

#: ``hook(block_ids)``: called (engine lock held) before exposed blocks are reused.
EvictHook = Callable[[list[int]], None]

#: Longest lease id accepted.
MAX_LEASE_ID_CHARS = 128


@dataclass
class _Lease:
    blocks: list[int]
    hashes: list[str]
    imported: bool = False          # import_blocks: blocks allocated for KV pulled from a peer
    committed: bool = False         # commit_import ran: their hashes are in the index


class PrefixCache:
    """Reference-counted blocks over a :class:`BlockAllocator`, with a hash index.

    Parameters
    ----------
    allocator : BlockAllocator
        The pool's free list (never-cached free blocks come from it, in its order).
    enabled : bool
        Cache full blocks by hash; False: a plain reference-counted allocator.
    """

    def __init__(self, allocator: BlockAllocator, *, enabled: bool) -> None:
        self.allocator = allocator
        self.enabled = enabled
        self.num_blocks = allocator.num_blocks
        self._ref: dict[int, int] = {}                       # held and cached-free blocks: references
        self._index: dict[str, int] = {}                     # hash -> block
        self._hash: dict[int, str] = {}                      # block -> hash
        self._lru: OrderedDict[int, None] = OrderedDict()    # cached free blocks, oldest first
        self._exposed: set[int] = set()
        self._imported: set[int] = set()                     # committed imports not hit yet
        self._leases: dict[str, _Lease] = {}
        self._events: list[KVEvent] = []
        self._hook: EvictHook | None = None
        self.evictions = 0
        self.hook_calls = 0

    # ------------------------------------------------------------------ counts
    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now: free plus cached blocks no one holds."""
        return self.allocator.num_free + len(self._lru)

    @property
    def num_cached(self) -> int:
        """Blocks whose hash is in the index (held or not)."""
        return len(self._index)

    @property
    def num_cached_free(self) -> int:
        """Cached blocks no one holds (evictable)."""
        return len(self._lru)

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    def refcount(self, block: int) -> int:
        """References to ``block`` (0 for free and cached free blocks)."""
        return self._ref.get(block, 0)

    def lru_order(self) -> list[int]:
        """Cached free blocks, the next to be evicted first."""
        return list(self._lru)

    # ------------------------------------------------------------------ allocate / free
    def alloc(self, n: int) -> list[int]:
        """Takes ``n`` blocks (reference count 1 each): free ones first, then the least
        recently used cached ones, evicted (their hashes leave the index; exposed ones
        go through the evict hook first).

        Raises
        ------
        ResourceExhausted
            Fewer than ``n`` blocks can be had (nothing is allocated or evicted then).
        """
        if not isinstance(n, int) or n < 0:
            raise InvalidArgument(f"cannot allocate {n!r} blocks")
        if n > self.num_free:
            raise ResourceExhausted(f"KV pool exhausted: {n} blocks requested, {self.num_free} free "
                                    f"of {self.num_blocks}")
        k = min(n, self.allocator.num_free)
        out = self.allocator.alloc(k)
        victims = [self._lru.popitem(last=False)[0] for _ in range(n - k)]
        if victims:
            hashes = tuple(self._hash.pop(b) for b in victims)
            for h in hashes:
                del self._index[h]
            self._imported.difference_update(victims)
            self.evictions += len(victims)
            self._events.append(KVEvent("evicted", hashes))
        out.extend(victims)
        self._bump_exposed(out)
        for b in out:
            self._ref[b] = 1
        return out

    def _bump_exposed(self, blocks: Iterable[int]) -> None:
        """Runs the evict hook on the exposed blocks among ``blocks`` (about to be reused)."""
        exposed = [b for b in blocks if b in self._exposed]
        if not exposed:
            return
        self._exposed.difference_update(exposed)
        if self._hook is None:
            return
        self.hook_calls += 1
        try:
            self._hook(exposed)
        except Exception:  # noqa: BLE001 - the generations are bumped even when the wait times out
            log.exception("prefix cache: evict hook failed for blocks %s", exposed)

    def free(self, blocks: Iterable[int]) -> None:
        """Drops one reference to each block; a block no one holds goes to the LRU if
        cached (the blocks of one call in reverse order: give them in token order, so a
        prefix's tail is evicted before its head), else back to the allocator.

        Raises
        ------
        InvalidArgument
            A block is not held (double free or foreign id); nothing changes then.
        """
        ids = list(blocks)
        need: dict[int, int] = {}
        for b in ids:
            need[b] = need.get(b, 0) + 1
        bad = [b for b, c in need.items() if self._ref.get(b, 0) < c]
        if bad:
            raise InvalidArgument(f"freeing blocks that are not held (or too often): {sorted(bad)}")
        back: list[int] = []
        cached: list[int] = []
        for b in ids:
            r = self._ref[b] - 1
            if r:
                self._ref[b] = r
                continue
            del self._ref[b]
            (cached if b in self._hash else back).append(b)
        # A request's blocks come in token order: its last blocks are evicted first, so
        # the longest shareable prefix (a chain's head) stays cached the longest.
        for b in reversed(cached):
            self._lru[b] = None
        if back:
            self.allocator.free(back)

    def acquire(self, blocks: Iterable[int]) -> None:
        """Adds a reference to each (cached) block, taking it off the LRU if it was there."""
        for b in blocks:
            if b in self._lru:
                del self._lru[b]
                self._ref[b] = 1
            elif b in self._ref:
                self._ref[b] += 1
            else:
                raise InvalidArgument(f"block {b} is neither held nor cached")

    # ------------------------------------------------------------------ index
    def match(self, hashes: Sequence[str]) -> list[int]:
        """The blocks of the leading run of ``hashes`` that is in the index (a peek:
        nothing is acquired)."""
        out: list[int] = []
        if not self.enabled:
            return out
        for h in hashes:
            b = self._index.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def num_evictable_among(self, blocks: Iterable[int]) -> int:
        """How many of ``blocks`` are cached free (acquiring them shrinks :attr:`num_free`)."""
        return sum(1 for b in blocks if b in self._lru)

    def take_imported(self, blocks: Iterable[int]) -> int:
        """How many of ``blocks`` came from a committed import and were not hit before
        (they count as pulled once: later hits are local)."""
        got = [b for b in blocks if b in self._imported]
        self._imported.difference_update(got)
        return len(got)

    def insert(self, blocks: Sequence[int], hashes: Sequence[str]) -> int:
        """Puts held blocks whose KV is complete into the index (one ``stored`` event).
        A block already cached or a hash already held by another block is skipped.

        Returns
        -------
        int
            Blocks inserted.
        """
        if not self.enabled:
            return 0
        stored: list[str] = []
        for b, h in zip(blocks, hashes):
            if b in self._hash or h in self._index:
                continue
            if b not in self._ref:
                raise InvalidArgument(f"block {b} is not held: only held blocks can be cached")
            self._index[h] = b
            self._hash[b] = h
            stored.append(h)
        if stored:
            self._events.append(KVEvent("stored", tuple(stored)))
        return len(stored)

    def hash_of(self, block: int) -> str | None:
        return self._hash.get(block)

    def snapshot(self) -> tuple[str, ...]:
        """Every hash in the index now."""
        return tuple(self._index)

    def expose(self, blocks: Iterable[int]) -> None:
        """Marks blocks as handed to a peer: the evict hook runs before they are reused."""
        self._exposed.update(blocks)

    def set_evict_hook(self, hook: EvictHook | None) -> None:
        self._hook = hook

    def clear(self) -> int:
        """Empties the index (one ``cleared`` event): cached free blocks go back to the
        allocator (exposed ones through the evict hook first); held blocks stay held but
        are no longer shared. Returns the hashes dropped."""
        n = len(self._index)
        free = list(self._lru)
        self._lru.clear()
        self._bump_exposed(free)
        self._index.clear()
        self._hash.clear()
        self._imported.clear()
        if free:
            self.allocator.free(free)
        if self.enabled:
            self._events.append(KVEvent("cleared", ()))
        return n

    def take_events(self) -> list[KVEvent]:
        """The events queued since the last call, in order."""
        out, self._events = self._events, []
        return out

    # ------------------------------------------------------------------ leases and imports
    def _check_lease(self, lease_id: str, hashes: Sequence[str]) -> list[str]:
        if not isinstance(lease_id, str) or not lease_id or len(lease_id) > MAX_LEASE_ID_CHARS:
            raise InvalidArgument(f"lease_id must be a non-empty string of at most {MAX_LEASE_ID_CHARS} "
                                  f"characters, got {lease_id!r:.80}")
        if isinstance(hashes, (str, bytes)) or not isinstance(hashes, Sequence):
            raise InvalidArgument(f"hashes must be a sequence of block hashes, got {type(hashes).__name__}")
        if len(hashes) > self.num_blocks:
            raise InvalidArgument(f"{len(hashes)} hashes but the pool has {self.num_blocks} blocks")
        bad = [h for h in hashes if not is_block_hash(h)]
        if bad:
            raise InvalidArgument(f"malformed block hash {bad[0]!r:.40} (16 lowercase hex digits expected)")
        if lease_id in self._leases:
            raise AlreadyExists(f"lease {lease_id!r} exists")
        return list(hashes)

    def lease(self, lease_id: str, hashes: Sequence[str]) -> list[int]:
        """Pins the cached blocks of the leading run of ``hashes`` for a remote reader and
        marks them exposed; returns their ids (maybe fewer than ``hashes``, maybe none:
        then no lease is recorded).

        Raises
        ------
        InvalidArgument
            A malformed lease id or hash, or more hashes than the pool has blocks.
        AlreadyExists
            ``lease_id`` is in use.
        """
        hashes = self._check_lease(lease_id, hashes)
        blocks = self.match(hashes)
        if not blocks:
            return []
        self.acquire(blocks)
        self.expose(blocks)
        self._leases[lease_id] = _Lease(blocks, hashes[:len(blocks)])
        return list(blocks)

    def import_blocks(self, lease_id: str, hashes: Sequence[str]) -> list[int]:
        """Allocates one block per hash, held under ``lease_id``, for KV pulled from a
        peer; :meth:`commit_import` caches them once the KV landed.

        Raises
        ------
        InvalidArgument, AlreadyExists
            As :meth:`lease`; also when the cache is off.
        ResourceExhausted
            Not enough blocks.
        """
        hashes = self._check_lease(lease_id, hashes)
        if not self.enabled:
            raise InvalidArgument("the prefix cache is off: nothing can be imported")
        if not hashes:
            raise InvalidArgument("import_blocks needs at least one hash")
        blocks = self.alloc(len(hashes))
        self._leases[lease_id] = _Lease(blocks, hashes, imported=True)
        return list(blocks)

    def commit_import(self, lease_id: str) -> int:
        """Caches an import's blocks under their hashes (they stay pinned until
        :meth:`unlease`); returns how many entered the index (a hash already cached
        elsewhere is skipped).

        Raises
        ------
        NotFound
            No import under ``lease_id``.
        InvalidArgument
            Already committed.
        """
        lease = self._leases.get(lease_id)
        if lease is None or not lease.imported:
            raise NotFound(f"no import under lease {lease_id!r}")
        if lease.committed:
            raise InvalidArgument(f"import {lease_id!r} is committed already")
        lease.committed = True
        before = set(self._hash)
        n = self.insert(lease.blocks, lease.hashes)
        self._imported.update(b for b in lease.blocks if b in self._hash and b not in before)
        return n

    def unlease(self, lease_id: str) -> bool:
        """Drops a lease's pins (an uncommitted import's blocks are freed); False if
        ``lease_id`` is unknown."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self.free(lease.blocks)
        return True

    def lease_blocks(self, lease_id: str) -> list[int] | None:
        lease = self._leases.get(lease_id)
        return None if lease is None else list(lease.blocks)
