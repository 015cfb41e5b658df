"""A continuous-batching inference engine over a paged KV pool.

The engine runs a Hugging Face causal LM (loaded with
``attn_implementation=PAGED_ATTENTION``, see :mod:`pdkv.serving.models`) one *step*
at a time. A step packs every scheduled request's new tokens into one sequence
(batch 1), runs the model once, writes K/V straight into the pool and samples one
token for every request whose pending tokens are all computed. Requests join and
leave between any two steps.

Scheduling modes (:class:`SchedulingMode`):

``colocated``
    Prefill first: while prompts wait and fit, a step prefills whole prompts (as many
    as fit in ``max_batch_tokens``, at least one) and decodes pause; otherwise a step
    decodes every running request.
``chunked``
    Every step decodes all running requests first, then spends what is left of the
    ``max_batch_tokens`` budget on prompt chunks (an unfinished prefill continues
    before a new one starts), like vLLM's chunked prefill.

KV blocks are allocated as tokens are computed. When a decode needs a block and none
is free, the most recently admitted request is preempted: its blocks are freed and
its prompt plus the tokens generated so far are recomputed later (output is
unchanged).

Prefix cache (``EngineConfig(prefix_cache=True)``, :mod:`pdkv.serving.prefix_cache`):
every full block is cached under the hash of all tokens up to its end as soon as its
KV is computed (prompt and output tokens alike), and stays cached after its request
ends until an allocation finds no free block (least recently used first). A request
admitted from the waiting queue (new, preempted or recomputed) starts from the
cached blocks of its leading tokens, shared with every other request that holds them,
and computes only the rest (at least one token). Index changes go to
:meth:`Engine.set_kv_event_sink`; remote readers pin blocks with :meth:`Engine.lease`,
pulled KV enters with :meth:`Engine.import_blocks`.

Disaggregation hooks (the prefill and decode workers are built on these):

* prefill side: ``add_request(..., prefill_only=True)`` computes the prompt and the
  first token, then keeps the prompt's blocks (:attr:`RequestHandle.block_ids`) until
  :meth:`Engine.release`, so pdkv can ship them; with ``layer_sink=`` the engine also
  reports each layer as soon as its K/V are in the pool (:data:`LayerSink`), so they
  can be shipped while later layers compute;
* decode side: :meth:`Engine.reserve` allocates blocks for a prompt of ``N`` tokens
  (the prefill side writes into them), then :meth:`Engine.admit_prefilled` starts
  decoding from the shipped KV and the first token;
* recompute fallback: :meth:`Engine.admit_recompute` prefills locally a request
  whose KV transfer failed.

Threads: :meth:`Engine.step` may run in any one thread at a time (typically a
worker's background loop, see :meth:`Engine.wait_for_work`); every other public
method may be called from any thread, also while a step runs. Event callbacks run in
the stepping thread, after the step, without engine locks held: they must be quick
(e.g. ``loop.call_soon_threadsafe(queue.put_nowait, event)``).

:class:`Engine` composes its parts, each in its own module: the value types
(:mod:`~pdkv.serving.engine_types`), request checks (:mod:`~pdkv.serving.engine_checks`),
the scheduler with its block growth and preemption (:mod:`~pdkv.serving.engine_scheduler`),
the request table and how requests finish (:mod:`~pdkv.serving.engine_requests`),
the model side: pool, batch packing, layer sinks, forward and sampling
(:mod:`~pdkv.serving.engine_runner`), the prefix cache's request side
(:mod:`~pdkv.serving.engine_prefix`) and the block-level API: reservations, leases,
imports, cache events and statistics (:mod:`~pdkv.serving.engine_cache`).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from typing import Any, Sequence

from pdkv.errors import InvalidArgument

from .engine_cache import EngineBlocks
from .engine_checks import RequestChecks, eos_ids
from .engine_prefix import RequestPrefixes
from .engine_requests import RequestTable
from .engine_runner import ModelRunner
from .engine_scheduler import Scheduler
from .engine_types import (EngineConfig, EngineRequest, EventCallback, FinishReason, KVEvent, LayerSink,
                           RequestHandle, RequestState, SchedulingMode, StepStats, TokenEvent)
from .kv_pool import PagedKVPool
from .prefix_cache import PrefixCache
from .prefix_hash import cache_salt
from .sampling import SamplingParams, new_seed

__all__ = ["Engine", "EngineConfig", "FinishReason", "KVEvent", "LayerSink", "RequestHandle", "SchedulingMode",
           "StepStats", "TokenEvent", "default_cache_salt"]


def default_cache_salt(model: Any, block_tokens: int) -> str:
    """The salt an engine derives for ``model`` (:attr:`EngineConfig.cache_salt` empty):
    its ``name_or_path`` plus a digest of its config, the block size and its dtype."""
    cfg = model.config
    d = {k: v for k, v in cfg.to_dict().items() if not k.startswith("_") and k not in ("transformers_version",
                                                                                       "name_or_path", "dtype",
                                                                                       "torch_dtype")}
    digest = hashlib.blake2b(json.dumps(d, sort_keys=True, default=str).encode(), digest_size=8).hexdigest()
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return cache_salt(f"{getattr(cfg, 'name_or_path', '')}#{digest}", block_tokens=block_tokens, dtype=dtype)


class Engine(EngineBlocks):
    """Continuous-batching engine for one Hugging Face causal LM and one paged KV pool.

    Parameters
    ----------
    model : transformers.PreTrainedModel
        A causal LM whose ``config._attn_implementation`` is :data:`PAGED_ATTENTION`
        (load it with :func:`pdkv.serving.load_model`, or call
        ``model.set_attn_implementation(register_paged_attention())``). The pool is
        created on its device, in its dtype.
    config : EngineConfig
    block_order : sequence of int, optional
        Initial free-list order of the pool's blocks (tests use a shuffled one).
    pool : PagedKVPool, optional
        A pool to compute into instead of a new one (for example
        :meth:`PagedKVPool.shared`, in pdkv-allocated memory). Its geometry must be the
        model's at ``config.num_blocks`` and ``config.block_tokens``, in the model's dtype
        and on its device; ``block_order`` must then be None.

    Examples
    --------
    >>> engine = Engine(model, EngineConfig(num_blocks=256, mode="chunked"))  # doctest: +SKIP
    >>> h = engine.add_request("r1", [1, 2, 3], SamplingParams(max_tokens=8))  # doctest: +SKIP
    >>> engine.run_until_idle(); h.output_ids                                  # doctest: +SKIP
    """

    def __init__(self, model: Any, config: EngineConfig, *, block_order: Sequence[int] | None = None,
                 pool: PagedKVPool | None = None) -> None:
        self._runner = ModelRunner(model, config, block_order=block_order, pool=pool)
        self.model = model
        self.config = config
        self.pool = self._runner.pool
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.eos_token_ids = config.eos_token_ids if config.eos_token_ids is not None else eos_ids(model)
        self.max_model_len = config.max_model_len or getattr(model.config, "max_position_embeddings", None) \
            or (1 << 62)
        self._checks = RequestChecks(self.vocab_size, self.max_model_len, self.pool)
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._step_lock = threading.Lock()
        #: The salt block hashes chain from (:attr:`EngineConfig.cache_salt` or derived).
        self.cache_salt = config.cache_salt or default_cache_salt(model, config.block_tokens)
        self._blocks = PrefixCache(self.pool.allocator, enabled=config.prefix_cache)
        self._prefixes = RequestPrefixes(self._blocks, config.block_tokens, self.cache_salt)
        self._init_blocks()
        self._sched = Scheduler(config, self.pool, self._prefixes)
        self._table = RequestTable(self.pool, self._sched, self.eos_token_ids)
        self._stalled = False  # the last step could schedule none of the waiting requests
        self.num_recomputes = 0
        self.num_steps = 0

    @property
    def num_preemptions(self) -> int:
        """Requests preempted (their blocks freed, recomputed later) so far."""
        return self._sched.num_preemptions

    # ------------------------------------------------------------------ admission
    def add_request(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams | None = None, *,
                    on_event: EventCallback | None = None, prefill_only: bool = False,
                    layer_sink: LayerSink | None = None) -> RequestHandle:
        """Queues a request.

        Parameters
        ----------
        request_id : str
            Unique among the engine's live requests and reservations.
        prompt_ids : sequence of int
            ``[N]`` token ids, ``N >= 1``.
        params : SamplingParams, optional
            Defaults to ``SamplingParams()`` (greedy, 16 tokens).
        on_event : callable, optional
            Called with a :class:`TokenEvent` for every token (see the module
            docstring for the threading rule).
        prefill_only : bool
            Stop after the first token and keep the prompt's blocks until
            :meth:`release` (the prefill side of disaggregation). The request finishes
            with :attr:`FinishReason.PREFILLED` unless the first token already ends it.
        layer_sink : LayerSink, optional
            Told about each layer of the request's K/V as soon as it is in the pool
            (a prefill worker streams it, docs/streaming.md).

        Raises
        ------
        InvalidArgument
            Empty prompt, token ids outside the vocabulary, or a request that cannot
            fit the pool or ``max_model_len``.
        AlreadyExists
            ``request_id`` is in use.
        """
        params = params or SamplingParams()
        prompt = self._checks.prompt(request_id, prompt_ids, params, prefill_only=prefill_only)
        handle = RequestHandle(request_id, prompt, params, params.seed if params.seed is not None else new_seed())
        req = EngineRequest(handle, list(prompt), prefill_only=prefill_only, on_event=on_event, layer_sink=layer_sink)
        with self._lock:
            self._table.check_new_id(request_id)
            self._table.requests[request_id] = req
            self._sched.waiting.append(req)
            self._wake()
        return handle

    def validate(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, *,
                 prefill_only: bool = False) -> tuple[int, ...]:
        """Checks a request as :meth:`add_request` would, without queuing it (a decode
        worker checks a prompt before it reserves blocks for it).

        Returns
        -------
        tuple of int
            The prompt.

        Raises
        ------
        InvalidArgument
        """
        return self._checks.prompt(request_id, prompt_ids, params, prefill_only=prefill_only)

    def admit_prefilled(self, request_id: str, prompt_ids: Sequence[int], first_token: int,
                        params: SamplingParams | None = None, *, seed: int | None = None,
                        on_event: EventCallback | None = None, cache_kv: bool = True) -> RequestHandle:
        """Decode side: starts decoding a request whose prompt KV is in its reserved blocks.

        Parameters
        ----------
        request_id : str
            A reservation made with :meth:`reserve` (or :meth:`reserve_prefix`) for
            ``len(prompt_ids)`` tokens.
        prompt_ids : sequence of int
            ``[N]`` the prompt whose KV was written into the reserved blocks.
        first_token : int
            The token the prefill side sampled (output position 0); no event is emitted
            for it here.
        params : SamplingParams, optional
        seed : int, optional
            The prefill side's :attr:`RequestHandle.seed` (default ``params.seed`` or a
            random one), so sampled output equals a single-engine run.
        on_event : callable, optional
        cache_kv : bool
            With the prefix cache on, cache the prompt's full blocks (and the blocks
            its decoding fills). False for KV that is not exactly what this engine
            would compute (e.g. shipped with lossy compression): nothing of the request
            enters the cache then, so no other request reuses it.

        Raises
        ------
        NotFound
            No reservation under ``request_id``.
        InvalidArgument
            The reservation does not match the prompt, or bad tokens/params.
        """
        params = params or SamplingParams()
        prompt = self._checks.prompt(request_id, prompt_ids, params, prefill_only=False)
        self._checks.token(first_token)
        seed = seed if seed is not None else (params.seed if params.seed is not None else new_seed())
        handle = RequestHandle(request_id, prompt, params, seed)
        handle.output_ids.append(int(first_token))
        handle.token_times.append(handle.arrival_time)
        req = EngineRequest(handle, list(prompt) + [int(first_token)], prefill_only=False, on_event=on_event)
        req.cacheable = bool(cache_kv)
        events: list[tuple[EngineRequest, TokenEvent]] = []
        with self._lock:
            req.block_ids = self._table.take_reservation(request_id, len(prompt))
            req.num_computed = len(prompt)
            self._prefixes.prefilled(req, self._table.take_cached_count(request_id))
            self._table.requests[request_id] = req
            reason = self._table.finish_reason(req, int(first_token))
            if reason is not None:
                self._table.finish(req, reason, events, token=None)
            else:
                # Queued (max_num_seqs applies) ahead of new prompts: it already holds its KV.
                self._sched.prefilled.append(req)
                self._wake()
        self._table.emit(events)
        self._flush_kv_events()
        return handle

    def admit_recompute(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams | None = None, *,
                        first_token: int | None = None, seed: int | None = None,
                        on_event: EventCallback | None = None) -> RequestHandle:
        """Decode side: prefills locally a request whose KV transfer failed.

        Frees ``request_id``'s reservation if there is one, then queues the request.
        With ``first_token`` (already sent to the client by the prefill side) it
        computes the prompt plus that token and continues from output position 1; the
        first token is not re-sampled and no event is emitted for it.

        Returns
        -------
        RequestHandle
            With :attr:`RequestHandle.recomputed` set.
        """
        params = params or SamplingParams()
        prompt = self._checks.prompt(request_id, prompt_ids, params, prefill_only=False)
        if first_token is not None:
            self._checks.token(first_token)
        seed = seed if seed is not None else (params.seed if params.seed is not None else new_seed())
        handle = RequestHandle(request_id, prompt, params, seed)
        handle.recomputed = True
        tokens = list(prompt)
        if first_token is not None:
            handle.output_ids.append(int(first_token))
            handle.token_times.append(handle.arrival_time)
            tokens.append(int(first_token))
        req = EngineRequest(handle, tokens, prefill_only=False, on_event=on_event)
        events: list[tuple[EngineRequest, TokenEvent]] = []
        with self._lock:
            if self._table.drop_reservation(request_id):
                self._wake()
            self._table.check_new_id(request_id)
            self.num_recomputes += 1
            self._table.requests[request_id] = req
            reason = self._table.finish_reason(req, int(first_token)) if first_token is not None else None
            if reason is not None:
                self._table.finish(req, reason, events, token=None)
            else:
                self._sched.waiting.append(req)
                self._wake()
        self._table.emit(events)
        return handle

    def abort(self, request_id: str) -> bool:
        """Stops a request (its last event has :attr:`FinishReason.ABORT`); also
        releases reservations and held prefill blocks. Returns False if unknown."""
        events: list[tuple[EngineRequest, TokenEvent]] = []
        with self._lock:
            if self._table.drop_reservation(request_id):
                self._wake()
                return True
            req = self._table.requests.get(request_id)
            if req is None:
                return False
            if req.state is RequestState.HELD:
                self._table.free_held(req)
                self._wake()
            elif req.state is RequestState.WAITING:
                self._sched.dequeue(req)
                self._table.finish(req, FinishReason.ABORT, events, token=None)
            else:  # running: finished by the stepping thread (a step may be using its blocks now)
                req.abort_requested = True
                self._wake()
        self._table.emit(events)
        return True

    # ------------------------------------------------------------------ stepping
    def has_work(self) -> bool:
        """True while requests are waiting or running."""
        with self._lock:
            return self._sched.has_queued() or bool(self._sched.running)

    def wait_for_work(self, timeout: float | None = None) -> bool:
        """Blocks until a :meth:`step` can make progress (or ``timeout`` passes).

        A step can make progress when requests are running, or waiting requests may
        now fit: after a step that could schedule nothing (every waiting request needs
        blocks that reservations or prefilled requests hold), this waits for a new
        request, a release or an abort.

        Returns
        -------
        bool
            True when a step can make progress.
        """
        with self._work:
            return self._work.wait_for(self._ready, timeout)

    def _ready(self) -> bool:
        return bool(self._sched.running) or (self._sched.has_queued() and not self._stalled)

    def _wake(self) -> None:
        """Something changed that may let a stalled step progress (lock held)."""
        self._stalled = False
        self._work.notify_all()

    def step(self) -> StepStats | None:
        """Schedules, runs the model once over the packed batch, samples, streams events.

        Returns
        -------
        StepStats or None
            None if there was nothing to do.

        Raises
        ------
        Exception
            Whatever the model's forward raised; the requests of that step are finished
            with :attr:`FinishReason.ERROR` (their handles hold the exception) first.
        """
        with self._step_lock:
            t0 = time.perf_counter()
            self._runner.pin_threads()
            events: list[tuple[EngineRequest, TokenEvent]] = []
            with self._lock:
                for req in self._sched.take_aborted():
                    self._table.finish(req, FinishReason.ABORT, events, token=None)
                preempted_before = self._sched.num_preemptions
                sched = self._sched.schedule()
                num_preempted = self._sched.num_preemptions - preempted_before
                self._stalled = not sched and self._sched.has_queued()
                inputs = self._runner.prepare(sched) if sched else None
            if inputs is None:
                self._table.emit(events)
                self._flush_kv_events()
                return None
            try:
                samplers, tokens = self._runner.forward(inputs)
            except BaseException as exc:
                with self._lock:
                    self._table.fail_step(sched, exc, events)
                self._table.emit(events)
                self._flush_kv_events()
                raise
            now = time.perf_counter()
            with self._lock:
                n_prefill, n_decode = self._table.record_step(sched, samplers, tokens, now, events)
                self.num_steps += 1
            self._table.emit(events)
            self._flush_kv_events()
            return StepStats(len(sched), n_prefill, n_decode, len(tokens), num_preempted,
                             time.perf_counter() - t0)

    def run_until_idle(self, max_steps: int | None = None) -> int:
        """Steps in the calling thread until no request is waiting or running, or a step
        can schedule nothing (waiting requests need blocks held by reservations or
        prefilled requests that only :meth:`release` frees).

        Returns
        -------
        int
            Steps run.
        """
        steps = 0
        while max_steps is None or steps < max_steps:
            if self.step() is None:
                break
            steps += 1
        return steps

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None
                 = None) -> list[list[int]]:
        """Runs ``prompts`` to completion in the calling thread (all admitted at once).

        Returns
        -------
        list of list of int
            Output token ids per prompt.
        """
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidArgument(f"{len(prompts)} prompts but {len(plist)} sampling params")
        base = f"gen-{time.perf_counter_ns()}"
        handles = [self.add_request(f"{base}-{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, plist))]
        self.run_until_idle()
        return [list(h.output_ids) for h in handles]

    # ------------------------------------------------------------------ introspection
    @property
    def num_waiting(self) -> int:
        with self._lock:
            return self._sched.num_queued()

    @property
    def num_running(self) -> int:
        with self._lock:
            return len(self._sched.running)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free ones plus cached ones no request holds."""
        with self._lock:
            return self._blocks.num_free
