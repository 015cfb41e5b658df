"""The engine's scheduler: which requests compute how many tokens in the next step,
in ``colocated`` or ``chunked`` mode (see :mod:`pdkv.serving.engine`), the KV blocks
they grow into as they compute, and preemption when a decode finds no free block.
A request leaving the waiting queue starts from the blocks of its prefix found in
the prefix cache (:mod:`pdkv.serving.engine_prefix`)."""

from __future__ import annotations

from collections import deque

from .engine_prefix import RequestPrefixes
from .engine_types import EngineConfig, EngineRequest, RequestState, SchedulingMode
from .kv_pool import PagedKVPool

__all__ = ["Scheduler"]


class Scheduler:
    """The waiting and running requests of one engine (guarded by the engine lock).

    Parameters
    ----------
    config : EngineConfig
        ``mode``, ``max_batch_tokens`` and ``max_num_seqs``.
    pool : PagedKVPool
        Its geometry (tokens per block).
    prefixes : RequestPrefixes
        The block manager blocks are allocated from (and preempted requests' blocks
        freed to), and the prefix lookup of admitted requests.
    """

    def __init__(self, config: EngineConfig, pool: PagedKVPool, prefixes: RequestPrefixes) -> None:
        self.config = config
        self.pool = pool
        self.prefixes = prefixes
        self.blocks = prefixes.cache
        self.waiting: deque[EngineRequest] = deque()     # new, preempted and recompute requests
        self.prefilled: deque[EngineRequest] = deque()   # admit_prefilled: KV present, waiting for a slot
        self.running: list[EngineRequest] = []
        self.num_preemptions = 0

    def has_queued(self) -> bool:
        """Requests wait for a slot (new, preempted, recompute or prefilled ones)."""
        return bool(self.waiting or self.prefilled)

    def num_queued(self) -> int:
        return len(self.waiting) + len(self.prefilled)

    def dequeue(self, req: EngineRequest) -> None:
        """Takes a waiting request out of its queue (an abort)."""
        (self.prefilled if req in self.prefilled else self.waiting).remove(req)

    def take_aborted(self) -> list[EngineRequest]:
        """Removes the running requests whose abort was requested; the caller finishes them."""
        aborted = [r for r in self.running if r.abort_requested]
        for req in aborted:
            self.running.remove(req)
        return aborted

    def remove_running(self, req: EngineRequest) -> None:
        """Takes ``req`` out of the running batch if it is in it."""
        if req.state is RequestState.RUNNING:
            self.running.remove(req)

    def _preempt(self, req: EngineRequest) -> None:
        """Frees a running request's blocks and requeues it at the front (recompute)."""
        self.running.remove(req)
        self.blocks.free(req.block_ids)  # its full blocks stay cached: it may find them again
        req.block_ids = []
        req.num_computed = 0
        req.num_inserted = 0
        req.state = RequestState.WAITING
        req.handle.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _grow(self, req: EngineRequest, n: int, scheduled: set[int]) -> bool:
        """Allocates blocks for ``n`` more tokens of a running request, preempting the
        latest-admitted unscheduled requests if needed. False if ``req`` itself had to go."""
        need = self.pool.blocks_for(req.num_computed + n) - len(req.block_ids)
        alloc = self.blocks
        while need > alloc.num_free:
            victim = next((r for r in reversed(self.running) if id(r) not in scheduled and r is not req), None)
            if victim is None:
                self._preempt(req)
                return False
            self._preempt(victim)
        req.block_ids.extend(alloc.alloc(need))
        return True

    def _admit_waiting(self, budget: int, *, whole: bool, batch: list) -> int:
        """Moves waiting requests to running while they fit (lock held): first those
        admitted with their KV present (they hold blocks, so they go first and cannot be
        blocked by a new prompt waiting for blocks), then the others, in order. A waiting
        request starts from the cached blocks of its prefix (only blocks whose KV is
        computed are cached, so a request admitted in this same step is never read)."""
        alloc = self.blocks
        for queue in (self.prefilled, self.waiting):
            while queue and budget > 0 and len(self.running) < self.config.max_num_seqs:
                req = queue[0]
                hits = self.prefixes.lookup(req) if queue is self.waiting else []
                base = len(hits) * self.pool.block_tokens if hits else req.num_computed
                pending = len(req.tokens) - base
                n = pending if whole else min(pending, budget)
                if whole and batch and n > budget:
                    break
                need = self.pool.blocks_for(base + n) - (len(hits) if hits else len(req.block_ids))
                if need > alloc.num_free - alloc.num_evictable_among(hits):
                    break
                queue.popleft()
                if queue is self.waiting:
                    self.prefixes.admit(req, hits)
                req.block_ids.extend(alloc.alloc(need))
                req.state = RequestState.RUNNING
                self.running.append(req)
                batch.append((req, n))
                budget -= n
        return budget

    def schedule(self) -> list[tuple[EngineRequest, int]]:
        """Picks ``(request, tokens to compute)`` pairs for this step (lock held)."""
        batch: list[tuple[EngineRequest, int]] = []
        budget = self.config.max_batch_tokens
        if self.config.mode is SchedulingMode.COLOCATED:
            self._admit_waiting(budget, whole=True, batch=batch)
            if batch:
                return batch
            budget = len(self.running)  # decode step: one token each
        # Decodes first, then unfinished prefills, in admission order.
        order = sorted(self.running, key=lambda r: r.pending > 1)
        scheduled: set[int] = set()
        for req in order:
            if budget <= 0:
                break
            if req.state is not RequestState.RUNNING:
                continue  # preempted by an earlier request of this loop
            n = min(req.pending, budget)
            if not self._grow(req, n, scheduled):
                continue
            scheduled.add(id(req))
            batch.append((req, n))
            budget -= n
        if self.config.mode is SchedulingMode.CHUNKED:
            self._admit_waiting(budget, whole=False, batch=batch)
        return batch
