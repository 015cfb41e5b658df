"""The engine's request table: every live request (waiting, running, or finished
prefill-only and holding its blocks) and every decode-side reservation by id, how a
request finishes (its blocks freed or held, its last event), and what a step's
sampled tokens do to the requests that computed in it (see :mod:`pdkv.serving.engine`)."""

from __future__ import annotations

import time
from typing import Iterable

from pdkv.errors import AlreadyExists, InvalidArgument, NotFound

from .engine_scheduler import Scheduler
from .engine_types import EngineRequest, FinishReason, RequestState, TokenEvent
from .kv_pool import PagedKVPool

__all__ = ["RequestTable"]


class RequestTable:
    """Live requests and reservations of one engine (guarded by the engine lock).

    Parameters
    ----------
    pool : PagedKVPool
        Its geometry (blocks per prompt).
    scheduler : Scheduler
        Finished running requests leave its running batch; its block manager
        (:attr:`Scheduler.blocks`) gets their blocks back, and its
        :attr:`Scheduler.prefixes` caches the blocks they computed.
    eos_token_ids : tuple of int
        Tokens that end requests (unless ``ignore_eos``).
    """

    def __init__(self, pool: PagedKVPool, scheduler: Scheduler, eos_token_ids: tuple[int, ...]) -> None:
        self.pool = pool
        self._sched = scheduler
        self.blocks = scheduler.blocks
        self.prefixes = scheduler.prefixes
        self.eos_token_ids = eos_token_ids
        self.requests: dict[str, EngineRequest] = {}     # waiting, running and held
        self.reserved: dict[str, list[int]] = {}         # decode-side reservations
        self.reserved_cached: dict[str, int] = {}        # their leading blocks cached here (reserve_prefix)

    def check_new_id(self, request_id: str) -> None:
        """Raises AlreadyExists if ``request_id`` names a live request or a reservation."""
        if request_id in self.requests or request_id in self.reserved:
            raise AlreadyExists(f"request id {request_id!r} is in use")

    def reserve(self, request_id: str, num_tokens: int) -> list[int]:
        """Allocates the blocks of a ``num_tokens``-token prompt under a new id
        (ResourceExhausted when too few are free); returns them in token order."""
        self.check_new_id(request_id)
        blocks = self.blocks.alloc(self.pool.blocks_for(num_tokens))
        self.reserved[request_id] = blocks
        return list(blocks)

    def reserve_prefix(self, request_id: str, prompt: tuple[int, ...]) -> tuple[list[int], int]:
        """Like :meth:`reserve` for ``prompt``, starting from its leading blocks cached
        here (shared, exposed to the peer); returns the blocks and how many are cached."""
        self.check_new_id(request_id)
        p = self.prefixes
        hits = p.cache.match(p.hashes(prompt, limit=p.max_hit_blocks(len(prompt))))
        p.cache.acquire(hits)
        try:
            new = self.blocks.alloc(self.pool.blocks_for(len(prompt)) - len(hits))
        except BaseException:
            self.blocks.free(hits)
            raise
        blocks = hits + new
        p.cache.expose(blocks)
        self.reserved[request_id] = blocks
        self.reserved_cached[request_id] = len(hits)
        return list(blocks), len(hits)
    def take_reservation(self, request_id: str, num_tokens: int) -> list[int]:
        """Ends ``request_id``'s reservation and returns its blocks, which a
        ``num_tokens``-token prompt's KV fills.

        Raises
        ------
        NotFound
            No reservation under ``request_id``.
        InvalidArgument
            It holds another number of blocks than the prompt needs.
        """
        blocks = self.reserved.get(request_id)
        if blocks is None:
            raise NotFound(f"no reservation for request {request_id!r} (call reserve() first)")
        if len(blocks) != self.pool.blocks_for(num_tokens):
            raise InvalidArgument(f"request {request_id!r} reserved {len(blocks)} blocks but its "
                                  f"{num_tokens}-token prompt needs {self.pool.blocks_for(num_tokens)}")
        del self.reserved[request_id]
        return blocks

    def take_cached_count(self, request_id: str) -> int:
        """Forgets how many leading blocks of ``request_id``'s reservation were cached."""
        return self.reserved_cached.pop(request_id, 0)
    def drop_reservation(self, request_id: str) -> bool:
        """Frees ``request_id``'s reservation; False if it has none."""
        blocks = self.reserved.pop(request_id, None)
        if blocks is None:
            return False
        self.reserved_cached.pop(request_id, None)
        self.blocks.free(blocks)
        return True

    def free_held(self, req: EngineRequest) -> None:
        """Frees the blocks of a finished prefill-only request and forgets it."""
        self.blocks.free(req.block_ids)
        req.block_ids = []
        req.state = RequestState.FINISHED
        del self.requests[req.rid]

    def finish_reason(self, req: EngineRequest, tok: int) -> FinishReason | None:
        """Why ``req`` ends with its new output token ``tok`` (None: it goes on)."""
        p = req.handle.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            return FinishReason.STOP
        if len(req.handle.output_ids) >= p.max_tokens:
            return FinishReason.LENGTH
        return None

    def finish(self, req: EngineRequest, reason: FinishReason, events: list, *, token: int | None,
               now: float | None = None) -> None:
        """Marks ``req`` finished (lock held); frees its blocks unless prefill-only."""
        h = req.handle
        h.finish_reason = reason
        if req.prefill_only and reason not in (FinishReason.ABORT, FinishReason.ERROR):
            req.state = RequestState.HELD
            h.block_ids = tuple(req.block_ids)
        else:
            if req.block_ids:
                self.blocks.free(req.block_ids)
            req.block_ids = []
            req.state = RequestState.FINISHED
            self.requests.pop(req.rid, None)
        index = len(h.output_ids) - 1 if token is not None else len(h.output_ids)
        events.append((req, TokenEvent(req.rid, token, index, now or time.perf_counter(), reason)))

    def fail_step(self, sched: list[tuple[EngineRequest, int]], exc: BaseException, events: list) -> None:
        """Finishes a step's requests with :attr:`FinishReason.ERROR` (its forward raised ``exc``)."""
        for req, _n in sched:
            req.handle.error = exc
            self._sched.remove_running(req)
            self.finish(req, FinishReason.ERROR, events, token=None)

    def record_step(self, sched: list[tuple[EngineRequest, int]], samplers: list[EngineRequest], tokens: list[int],
                    now: float, events: list) -> tuple[int, int]:
        """Applies a step to its requests: their computed tokens, their sampled tokens
        (``tokens[i]`` for ``samplers[i]``) and the aborts and finishes that follow.
        Returns the prompt tokens and decode tokens the step computed."""
        n_prefill = n_decode = 0
        sampled = dict(zip((id(r) for r in samplers), tokens))
        for req, n in sched:
            was_decode = req.num_computed > 0 and req.pending == 1
            req.num_computed += n
            self.prefixes.computed(req, req.num_computed - n, n)
            n_decode += n if was_decode else 0
            n_prefill += 0 if was_decode else n
            if req.abort_requested:
                self._sched.remove_running(req)
                self.finish(req, FinishReason.ABORT, events, token=None)
                continue
            tok = sampled.get(id(req))
            if tok is None:
                continue
            req.tokens.append(tok)
            req.handle.output_ids.append(tok)
            req.handle.token_times.append(now)
            reason = self.finish_reason(req, tok)
            if reason is None and req.prefill_only:
                reason = FinishReason.PREFILLED
            if reason is None:
                events.append((req, TokenEvent(req.rid, tok, len(req.handle.output_ids) - 1, now)))
            else:
                self._sched.remove_running(req)
                self.finish(req, reason, events, token=tok, now=now)
        return n_prefill, n_decode

    @staticmethod
    def emit(events: Iterable[tuple[EngineRequest, TokenEvent]]) -> None:
        """Runs callbacks and wakes waiters; called without the lock."""
        for req, ev in events:
            if ev.finish_reason is not None:
                req.handle._done.set()
            if req.on_event is not None:
                req.on_event(ev)
