"""The engine's requests meet its prefix cache: the block hashes of a request's
tokens, the cached blocks a request starts from when it is admitted, the full
blocks it caches as their KV is computed, and the counts behind
:meth:`~pdkv.serving.engine.Engine.prefix_stats` (see :mod:`pdkv.serving.prefix_cache`)."""

from __future__ import annotations

from typing import Sequence

from .engine_types import EngineRequest
from .prefix_cache import PrefixCache
from .prefix_hash import block_hashes

__all__ = ["RequestPrefixes"]


class RequestPrefixes:
    """Prefix caching of one engine's requests (guarded by the engine lock).

    Parameters
    ----------
    cache : PrefixCache
        The engine's block manager.
    block_tokens : int
    salt : str
        The engine's cache salt (block 0 chains from it).
    """

    def __init__(self, cache: PrefixCache, block_tokens: int, salt: str) -> None:
        self.cache = cache
        self.block_tokens = block_tokens
        self.salt = salt
        self.queries_tokens = 0          # prompt tokens of requests admitted to compute
        self.hit_tokens = 0              # of those, found cached (not computed)
        self.pulled_hit_tokens = 0       # of those, in blocks imported from a peer
        self.computed_prompt_tokens = 0  # prompt tokens computed (again after preemptions)
        self.readmit_hit_tokens = 0      # tokens preempted requests found cached when re-admitted

    @property
    def enabled(self) -> bool:
        return self.cache.enabled

    def hashes(self, token_ids: Sequence[int], limit: int | None = None) -> list[str]:
        """Hashes of the full blocks of ``token_ids`` (at most ``limit``)."""
        return block_hashes(token_ids, self.block_tokens, self.salt, limit=limit)

    def _req_hashes(self, req: EngineRequest, n: int) -> list[str]:
        """``req``'s first ``n`` block hashes (extends its chain as its tokens grow)."""
        have = len(req.hashes)
        if n > have:
            bt = self.block_tokens
            parent = req.hashes[-1] if have else None
            req.hashes.extend(block_hashes(req.tokens[have * bt:n * bt], bt, self.salt, parent=parent))
        return req.hashes[:n]

    def max_hit_blocks(self, num_tokens: int) -> int:
        """Most leading blocks of a ``num_tokens``-token sequence a hit may cover: at
        least one token is left to compute (the one the next sample comes from)."""
        return max(num_tokens - 1, 0) // self.block_tokens

    def lookup(self, req: EngineRequest) -> list[int]:
        """The cached blocks a waiting request without KV would start from (a peek)."""
        if not self.enabled or req.block_ids or req.num_computed:
            return []
        return self.cache.match(self._req_hashes(req, self.max_hit_blocks(len(req.tokens))))

    def admit(self, req: EngineRequest, hits: list[int]) -> None:
        """``req`` leaves the waiting queue starting from the cached blocks ``hits``
        (from :meth:`lookup`, acquired here); counts its first admission."""
        if hits:
            self.cache.acquire(hits)
            req.block_ids = list(hits)
            req.num_computed = len(hits) * self.block_tokens
            req.num_inserted = len(hits)
        if req.looked_up:  # a preempted request re-admitted: its prompt was counted the first time
            self.readmit_hit_tokens += len(hits) * self.block_tokens
            return
        req.looked_up = True
        prompt = len(req.handle.prompt_ids)
        hit = min(len(hits) * self.block_tokens, prompt)
        pulled = min(self.cache.take_imported(hits) * self.block_tokens, hit)
        req.handle.num_cached_tokens = hit
        req.handle.num_imported_tokens = pulled
        self.queries_tokens += prompt
        self.hit_tokens += hit
        self.pulled_hit_tokens += pulled

    def computed(self, req: EngineRequest, start: int, n: int) -> None:
        """``req``'s tokens ``[start, start + n)`` have their KV now: counts its prompt
        tokens among them and caches the blocks that became full."""
        prompt = len(req.handle.prompt_ids)
        p = max(0, min(start + n, prompt) - start)
        self.computed_prompt_tokens += p
        req.handle.num_computed_tokens += p
        if not self.enabled or not req.cacheable:
            return
        full = min(req.num_computed // self.block_tokens, len(req.block_ids))
        if full > req.num_inserted:
            hashes = self._req_hashes(req, full)
            self.cache.insert(req.block_ids[req.num_inserted:full], hashes[req.num_inserted:full])
            req.num_inserted = full

    def prefilled(self, req: EngineRequest, cached_blocks: int) -> None:
        """An :meth:`~pdkv.serving.engine.Engine.admit_prefilled` request's prompt KV is
        in its blocks (the first ``cached_blocks`` were cached here): cache the rest."""
        req.handle.num_cached_tokens = min(cached_blocks * self.block_tokens, len(req.handle.prompt_ids))
        req.num_inserted = cached_blocks
        self.computed(req, req.num_computed, 0)

    def stats(self) -> dict[str, int]:
        c = self.cache
        return {"enabled": int(c.enabled), "queries_tokens": self.queries_tokens, "hit_tokens": self.hit_tokens,
                "pulled_hit_tokens": self.pulled_hit_tokens, "computed_prompt_tokens": self.computed_prompt_tokens,
                "readmit_hit_tokens": self.readmit_hit_tokens,
                "cached_blocks": c.num_cached, "cached_free_blocks": c.num_cached_free, "evictions": c.evictions,
                "evict_hook_calls": c.hook_calls, "leases": c.num_leases}
