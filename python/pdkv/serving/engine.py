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
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from pdkv.errors import AlreadyExists, InvalidArgument, NotFound, ResourceExhausted
from pdkv.layout import KVGeometry

from .attention import BATCH_KWARG, PAGED_ATTENTION, PagedBatch, SeqSpan
from .kv_pool import PagedKVPool
from .sampling import SamplingParams, new_seed, sample_tokens

__all__ = ["Engine", "EngineConfig", "FinishReason", "LayerSink", "RequestHandle", "SchedulingMode", "StepStats",
           "TokenEvent"]

log = logging.getLogger("pdkv.serving")


class SchedulingMode(str, enum.Enum):
    """How prefill and decode share steps (see the module docstring)."""

    COLOCATED = "colocated"
    CHUNKED = "chunked"


class FinishReason(str, enum.Enum):
    """Why a request stopped."""

    STOP = "stop"            #: sampled an EOS or stop token (it is the last output token)
    LENGTH = "length"        #: generated ``max_tokens`` tokens
    ABORT = "abort"          #: :meth:`Engine.abort`
    ERROR = "error"          #: the model's forward raised during a step with this request
    PREFILLED = "prefilled"  #: prefill-only request: prompt KV and first token are ready


@dataclass(frozen=True)
class EngineConfig:
    """Engine sizing and policy.

    Attributes
    ----------
    num_blocks : int
        KV pool size in blocks.
    block_tokens : int
        Tokens per block.
    mode : SchedulingMode or str
        ``"colocated"`` or ``"chunked"``.
    max_batch_tokens : int
        Most tokens one step computes (chunked: the budget prefill chunks share with
        decodes; colocated: how many whole prompts one prefill step packs, though a
        longer prompt still runs alone). Must be >= ``max_num_seqs`` in chunked mode so
        that a prefill always progresses.
    max_num_seqs : int
        Most requests holding running state at once (decoding or mid-prefill).
    num_threads : int, optional
        Torch intra-op threads, pinned at every step (fp32 results depend on the
        thread count: pin it identically in every worker and in references). None
        leaves torch's setting alone.
    eos_token_ids : tuple of int, optional
        Tokens that end requests (unless ``ignore_eos``); default: the model's
        ``generation_config.eos_token_id`` (else ``config.eos_token_id``).
    max_model_len : int, optional
        Longest prompt + output; default: the config's ``max_position_embeddings``.
    """

    num_blocks: int
    block_tokens: int = 16
    mode: SchedulingMode = SchedulingMode.COLOCATED
    max_batch_tokens: int = 2048
    max_num_seqs: int = 64
    num_threads: int | None = 1
    eos_token_ids: tuple[int, ...] | None = None
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "mode", SchedulingMode(self.mode))
        except ValueError:
            raise InvalidArgument(f"mode must be one of {[m.value for m in SchedulingMode]}, got {self.mode!r}") \
                from None
        for name in ("num_blocks", "block_tokens", "max_batch_tokens", "max_num_seqs"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise InvalidArgument(f"{name} must be a positive integer, got {v!r}")
        if self.mode is SchedulingMode.CHUNKED and self.max_batch_tokens < self.max_num_seqs:
            raise InvalidArgument(f"chunked mode needs max_batch_tokens ({self.max_batch_tokens}) >= "
                                  f"max_num_seqs ({self.max_num_seqs})")
        if self.num_threads is not None and self.num_threads < 1:
            raise InvalidArgument(f"num_threads must be >= 1 or None, got {self.num_threads}")
        if self.eos_token_ids is not None:
            object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))


@dataclass(frozen=True)
class TokenEvent:
    """One streamed token (or the end of a request that ended without one).

    Attributes
    ----------
    request_id : str
    token_id : int or None
        The sampled token; None only for a terminal event without a token (abort,
        error, or a request admitted already finished).
    index : int
        Position of the token in the request's output (0 = first token).
    time : float
        ``time.perf_counter()`` when the step that produced it finished.
    finish_reason : FinishReason or None
        Set on the request's last event.
    """

    request_id: str
    token_id: int | None
    index: int
    time: float
    finish_reason: FinishReason | None = None


EventCallback = Callable[[TokenEvent], None]

#: ``sink(layer, token_start, token_end, block_ids)``: called in the stepping thread,
#: during the model's forward, right after ``layer``'s K/V of the request's tokens
#: ``[token_start, token_end)`` were written into its blocks ``block_ids`` (its whole
#: block table, in token order). Layers come in order, once per step that computes
#: the request's tokens. It must be quick and must not raise (log instead): it runs
#: inside the forward.
LayerSink = Callable[[int, int, int, tuple], None]


@dataclass(frozen=True)
class StepStats:
    """What one :meth:`Engine.step` did.

    Attributes
    ----------
    num_seqs : int
        Requests in the step.
    num_prefill_tokens, num_decode_tokens : int
        Tokens computed for prompts (whole or chunks, recomputes included) and for
        decoding (one per decoding request).
    num_sampled : int
        Tokens sampled.
    num_preempted : int
        Requests preempted to make room.
    elapsed_s : float
        Wall time of the step.
    """

    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_sampled: int
    num_preempted: int
    elapsed_s: float


class RequestHandle:
    """A request's state as seen from outside the engine (read it; do not modify it).

    Attributes
    ----------
    request_id : str
    prompt_ids : tuple of int
    params : SamplingParams
    seed : int
        The seed of its random draws (``params.seed`` or a random one); give it to
        the decode side of a disaggregated request to sample the same tokens.
    output_ids : list of int
        Tokens generated so far (for :meth:`Engine.admit_prefilled` requests the first
        is the one produced by the prefill side).
    token_times : list of float
        ``time.perf_counter()`` of each output token.
    arrival_time : float
        ``time.perf_counter()`` when the engine accepted the request.
    finish_reason : FinishReason or None
    block_ids : tuple of int
        For finished prefill-only requests: the blocks holding the prompt's KV, in
        token order, valid until :meth:`Engine.release`. Empty otherwise.
    num_preemptions : int
        Times it was preempted and recomputed.
    recomputed : bool
        Admitted through :meth:`Engine.admit_recompute`.
    """

    def __init__(self, request_id: str, prompt_ids: tuple[int, ...], params: SamplingParams, seed: int) -> None:
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.params = params
        self.seed = seed
        self.output_ids: list[int] = []
        self.token_times: list[float] = []
        self.arrival_time = time.perf_counter()
        self.finish_reason: FinishReason | None = None
        self.block_ids: tuple[int, ...] = ()
        self.num_preemptions = 0
        self.recomputed = False
        self.error: BaseException | None = None
        self._done = threading.Event()

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the request finishes; False if ``timeout`` passed first."""
        return self._done.wait(timeout)

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first output token (None before it)."""
        return self.token_times[0] - self.arrival_time if self.token_times else None

    def __repr__(self) -> str:
        return (f"RequestHandle({self.request_id!r}, prompt={len(self.prompt_ids)} tokens, "
                f"output={len(self.output_ids)} tokens, finish_reason={self.finish_reason})")


class _State(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    HELD = "held"          # prefill-only, finished, blocks kept until release()
    FINISHED = "finished"


class _Request:
    """Engine-internal request state (guarded by the engine lock)."""

    __slots__ = ("handle", "tokens", "num_computed", "block_ids", "state", "prefill_only", "on_event",
                 "abort_requested", "layer_sink")

    def __init__(self, handle: RequestHandle, tokens: list[int], *, prefill_only: bool,
                 on_event: EventCallback | None, layer_sink: LayerSink | None = None) -> None:
        self.handle = handle
        self.tokens = tokens            # prompt + outputs: the next input is tokens[num_computed]
        self.num_computed = 0           # tokens whose KV is in the pool
        self.block_ids: list[int] = []
        self.state = _State.WAITING
        self.prefill_only = prefill_only
        self.on_event = on_event
        self.abort_requested = False
        self.layer_sink = layer_sink

    @property
    def rid(self) -> str:
        return self.handle.request_id

    @property
    def pending(self) -> int:
        """Tokens to compute before the next sample."""
        return len(self.tokens) - self.num_computed


def _eos_ids(model: Any) -> tuple[int, ...]:
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(t) for t in (eos if isinstance(eos, (list, tuple)) else [eos]))


class Engine:
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
        impl = getattr(model.config, "_attn_implementation", None)
        if impl != PAGED_ATTENTION:
            raise InvalidArgument(
                f"the model uses attn_implementation={impl!r}; the engine needs {PAGED_ATTENTION!r} "
                f"(load it with pdkv.serving.load_model, or call "
                f"model.set_attn_implementation(pdkv.serving.register_paged_attention()))")
        self.model = model
        self.config = config
        param = next(model.parameters())
        if pool is None:
            pool = PagedKVPool.from_hf_config(model.config, num_blocks=config.num_blocks,
                                              block_tokens=config.block_tokens, dtype=param.dtype,
                                              device=param.device, block_order=block_order)
        else:
            want = KVGeometry.from_hf_config(model.config, num_blocks=config.num_blocks,
                                                  block_tokens=config.block_tokens, dtype=param.dtype)
            if block_order is not None:
                raise InvalidArgument("give block_order to the pool, not to the engine, when passing a pool")
            if pool.geometry != want or pool.device != param.device:
                raise InvalidArgument(f"the pool ({pool.geometry}, on {pool.device}) does not match the model "
                                      f"and config ({want}, on {param.device})")
        self.pool = pool
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.eos_token_ids = config.eos_token_ids if config.eos_token_ids is not None else _eos_ids(model)
        self.max_model_len = config.max_model_len or getattr(model.config, "max_position_embeddings", None) \
            or (1 << 62)
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._step_lock = threading.Lock()
        self._waiting: deque[_Request] = deque()     # new, preempted and recompute requests
        self._prefilled: deque[_Request] = deque()   # admit_prefilled: KV present, waiting for a slot
        self._running: list[_Request] = []
        self._requests: dict[str, _Request] = {}     # waiting, running and held
        self._reserved: dict[str, list[int]] = {}    # decode-side reservations
        self._stalled = False  # the last step could schedule none of the waiting requests
        self.num_preemptions = 0
        self.num_recomputes = 0
        self.num_steps = 0

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
        prompt = self._check_prompt(request_id, prompt_ids, params, prefill_only=prefill_only)
        handle = RequestHandle(request_id, prompt, params, params.seed if params.seed is not None else new_seed())
        req = _Request(handle, list(prompt), prefill_only=prefill_only, on_event=on_event, layer_sink=layer_sink)
        with self._lock:
            self._check_new_id(request_id)
            self._requests[request_id] = req
            self._waiting.append(req)
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
        return self._check_prompt(request_id, prompt_ids, params, prefill_only=prefill_only)

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
            self._check_new_id(request_id)
            blocks = self.pool.allocator.alloc(self.pool.blocks_for(num_tokens))
            self._reserved[request_id] = blocks
            return list(blocks)

    def admit_prefilled(self, request_id: str, prompt_ids: Sequence[int], first_token: int,
                        params: SamplingParams | None = None, *, seed: int | None = None,
                        on_event: EventCallback | None = None) -> RequestHandle:
        """Decode side: starts decoding a request whose prompt KV is in its reserved blocks.

        Parameters
        ----------
        request_id : str
            A reservation made with :meth:`reserve` for ``len(prompt_ids)`` tokens.
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

        Raises
        ------
        NotFound
            No reservation under ``request_id``.
        InvalidArgument
            The reservation does not match the prompt, or bad tokens/params.
        """
        params = params or SamplingParams()
        prompt = self._check_prompt(request_id, prompt_ids, params, prefill_only=False)
        self._check_token(first_token)
        seed = seed if seed is not None else (params.seed if params.seed is not None else new_seed())
        handle = RequestHandle(request_id, prompt, params, seed)
        handle.output_ids.append(int(first_token))
        handle.token_times.append(handle.arrival_time)
        req = _Request(handle, list(prompt) + [int(first_token)], prefill_only=False, on_event=on_event)
        events: list[tuple[_Request, TokenEvent]] = []
        with self._lock:
            blocks = self._reserved.get(request_id)
            if blocks is None:
                raise NotFound(f"no reservation for request {request_id!r} (call reserve() first)")
            if len(blocks) != self.pool.blocks_for(len(prompt)):
                raise InvalidArgument(f"request {request_id!r} reserved {len(blocks)} blocks but its "
                                      f"{len(prompt)}-token prompt needs {self.pool.blocks_for(len(prompt))}")
            del self._reserved[request_id]
            req.block_ids = blocks
            req.num_computed = len(prompt)
            self._requests[request_id] = req
            reason = self._finish_reason(req, int(first_token))
            if reason is not None:
                self._finish(req, reason, events, token=None)
            else:
                # Queued (max_num_seqs applies) ahead of new prompts: it already holds its KV.
                self._prefilled.append(req)
                self._wake()
        self._emit(events)
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
        prompt = self._check_prompt(request_id, prompt_ids, params, prefill_only=False)
        if first_token is not None:
            self._check_token(first_token)
        seed = seed if seed is not None else (params.seed if params.seed is not None else new_seed())
        handle = RequestHandle(request_id, prompt, params, seed)
        handle.recomputed = True
        tokens = list(prompt)
        if first_token is not None:
            handle.output_ids.append(int(first_token))
            handle.token_times.append(handle.arrival_time)
            tokens.append(int(first_token))
        req = _Request(handle, tokens, prefill_only=False, on_event=on_event)
        events: list[tuple[_Request, TokenEvent]] = []
        with self._lock:
            blocks = self._reserved.pop(request_id, None)
            if blocks is not None:
                self.pool.allocator.free(blocks)
                self._wake()
            self._check_new_id(request_id)
            self.num_recomputes += 1
            self._requests[request_id] = req
            reason = self._finish_reason(req, int(first_token)) if first_token is not None else None
            if reason is not None:
                self._finish(req, reason, events, token=None)
            else:
                self._waiting.append(req)
                self._wake()
        self._emit(events)
        return handle

    def release(self, request_id: str) -> None:
        """Frees the blocks of a reservation or of a finished prefill-only request.

        Raises
        ------
        NotFound
            ``request_id`` holds no reservation and no finished prefill-only blocks.
        """
        with self._lock:
            blocks = self._reserved.pop(request_id, None)
            if blocks is not None:
                self.pool.allocator.free(blocks)
                self._wake()
                return
            req = self._requests.get(request_id)
            if req is None or req.state is not _State.HELD:
                raise NotFound(f"request {request_id!r} holds no reserved or prefilled blocks")
            self.pool.allocator.free(req.block_ids)
            req.block_ids = []
            req.state = _State.FINISHED
            del self._requests[request_id]
            self._wake()

    def abort(self, request_id: str) -> bool:
        """Stops a request (its last event has :attr:`FinishReason.ABORT`); also
        releases reservations and held prefill blocks. Returns False if unknown."""
        events: list[tuple[_Request, TokenEvent]] = []
        with self._lock:
            if request_id in self._reserved:
                self.pool.allocator.free(self._reserved.pop(request_id))
                self._wake()
                return True
            req = self._requests.get(request_id)
            if req is None:
                return False
            if req.state is _State.HELD:
                self.pool.allocator.free(req.block_ids)
                req.block_ids = []
                req.state = _State.FINISHED
                del self._requests[request_id]
                self._wake()
            elif req.state is _State.WAITING:
                (self._prefilled if req in self._prefilled else self._waiting).remove(req)
                self._finish(req, FinishReason.ABORT, events, token=None)
            else:  # running: finished by the stepping thread (a step may be using its blocks now)
                req.abort_requested = True
                self._wake()
        self._emit(events)
        return True

    # ------------------------------------------------------------------ stepping
    def has_work(self) -> bool:
        """True while requests are waiting or running."""
        with self._lock:
            return bool(self._waiting or self._prefilled or self._running)

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
        return bool(self._running) or (bool(self._waiting or self._prefilled) and not self._stalled)

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
            if self.config.num_threads is not None and torch.get_num_threads() != self.config.num_threads:
                torch.set_num_threads(self.config.num_threads)
            events: list[tuple[_Request, TokenEvent]] = []
            with self._lock:
                self._handle_aborts(events)
                preempted_before = self.num_preemptions
                sched = self._schedule()
                num_preempted = self.num_preemptions - preempted_before
                self._stalled = not sched and bool(self._waiting or self._prefilled)
                plan = self._build_inputs(sched) if sched else None
            if plan is None:
                self._emit(events)
                return None
            input_ids, positions, batch, sample_rows = plan
            try:
                with torch.inference_mode():
                    out = self.model(input_ids=input_ids, position_ids=positions, use_cache=False,
                                     logits_to_keep=torch.tensor([r for r, _ in sample_rows], dtype=torch.int64,
                                                                 device=input_ids.device),
                                     **{BATCH_KWARG: batch})
                    logits = out.logits[0]  # [num samples, vocab]
                    samplers = [req for _, req in sample_rows]
                    tokens = sample_tokens(logits, [r.handle.params for r in samplers],
                                           [r.handle.seed for r in samplers],
                                           [r.handle.params.index_offset + len(r.handle.output_ids)
                                            for r in samplers]) if samplers else []
            except BaseException as exc:
                with self._lock:
                    for req, _n in sched:
                        req.handle.error = exc
                        self._remove_running(req)
                        self._finish(req, FinishReason.ERROR, events, token=None)
                self._emit(events)
                raise
            now = time.perf_counter()
            n_prefill = n_decode = 0
            with self._lock:
                sampled = dict(zip((id(r) for r in samplers), tokens))
                for req, n in sched:
                    was_decode = req.num_computed > 0 and req.pending == 1
                    req.num_computed += n
                    n_decode += n if was_decode else 0
                    n_prefill += 0 if was_decode else n
                    if req.abort_requested:
                        self._remove_running(req)
                        self._finish(req, FinishReason.ABORT, events, token=None)
                        continue
                    tok = sampled.get(id(req))
                    if tok is None:
                        continue
                    req.tokens.append(tok)
                    req.handle.output_ids.append(tok)
                    req.handle.token_times.append(now)
                    reason = self._finish_reason(req, tok)
                    if reason is None and req.prefill_only:
                        reason = FinishReason.PREFILLED
                    if reason is None:
                        events.append((req, TokenEvent(req.rid, tok, len(req.handle.output_ids) - 1, now)))
                    else:
                        self._remove_running(req)
                        self._finish(req, reason, events, token=tok, now=now)
                self.num_steps += 1
            self._emit(events)
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
            return len(self._waiting) + len(self._prefilled)

    @property
    def num_running(self) -> int:
        with self._lock:
            return len(self._running)

    @property
    def num_free_blocks(self) -> int:
        with self._lock:
            return self.pool.allocator.num_free

    # ------------------------------------------------------------------ internals
    def _check_prompt(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams, *,
                      prefill_only: bool) -> tuple[int, ...]:
        if not isinstance(request_id, str) or not request_id:
            raise InvalidArgument(f"request_id must be a non-empty string, got {request_id!r}")
        if not isinstance(params, SamplingParams):
            raise InvalidArgument(f"params must be SamplingParams, got {type(params).__name__}")
        prompt = tuple(int(t) for t in prompt_ids)
        if not prompt:
            raise InvalidArgument(f"request {request_id!r} has an empty prompt")
        for t in prompt:
            self._check_token(t)
        total = len(prompt) + (0 if prefill_only else params.max_tokens)
        if total > self.max_model_len:
            raise InvalidArgument(f"request {request_id!r}: prompt ({len(prompt)}) + max_tokens "
                                  f"({params.max_tokens}) exceeds the model's {self.max_model_len} positions")
        # The last sampled token never needs KV.
        kv_tokens = len(prompt) if prefill_only else len(prompt) + params.max_tokens - 1
        if kv_tokens > self.pool.capacity_tokens:
            raise InvalidArgument(f"request {request_id!r} needs KV for up to {kv_tokens} tokens but the pool "
                                  f"holds {self.pool.capacity_tokens} ({self.pool.num_blocks} blocks of "
                                  f"{self.pool.block_tokens})")
        return prompt

    def _check_token(self, t: int) -> None:
        if not 0 <= int(t) < self.vocab_size:
            raise InvalidArgument(f"token id {t} is outside the vocabulary [0, {self.vocab_size})")

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self._requests or request_id in self._reserved:
            raise AlreadyExists(f"request id {request_id!r} is in use")

    def _finish_reason(self, req: _Request, tok: int) -> FinishReason | None:
        p = req.handle.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids):
            return FinishReason.STOP
        if len(req.handle.output_ids) >= p.max_tokens:
            return FinishReason.LENGTH
        return None

    def _finish(self, req: _Request, reason: FinishReason, events: list, *, token: int | None,
                now: float | None = None) -> None:
        """Marks ``req`` finished (lock held); frees its blocks unless prefill-only."""
        h = req.handle
        h.finish_reason = reason
        if req.prefill_only and reason not in (FinishReason.ABORT, FinishReason.ERROR):
            req.state = _State.HELD
            h.block_ids = tuple(req.block_ids)
        else:
            if req.block_ids:
                self.pool.allocator.free(req.block_ids)
            req.block_ids = []
            req.state = _State.FINISHED
            self._requests.pop(req.rid, None)
        index = len(h.output_ids) - 1 if token is not None else len(h.output_ids)
        events.append((req, TokenEvent(req.rid, token, index, now or time.perf_counter(), reason)))

    def _remove_running(self, req: _Request) -> None:
        if req.state is _State.RUNNING:
            self._running.remove(req)

    def _handle_aborts(self, events: list) -> None:
        for req in [r for r in self._running if r.abort_requested]:
            self._running.remove(req)
            self._finish(req, FinishReason.ABORT, events, token=None)

    def _preempt(self, req: _Request) -> None:
        """Frees a running request's blocks and requeues it at the front (recompute)."""
        self._running.remove(req)
        self.pool.allocator.free(req.block_ids)
        req.block_ids = []
        req.num_computed = 0
        req.state = _State.WAITING
        req.handle.num_preemptions += 1
        self.num_preemptions += 1
        self._waiting.appendleft(req)

    def _grow(self, req: _Request, n: int, scheduled: set[int]) -> bool:
        """Allocates blocks for ``n`` more tokens of a running request, preempting the
        latest-admitted unscheduled requests if needed. False if ``req`` itself had to go."""
        need = self.pool.blocks_for(req.num_computed + n) - len(req.block_ids)
        alloc = self.pool.allocator
        while need > alloc.num_free:
            victim = next((r for r in reversed(self._running) if id(r) not in scheduled and r is not req), None)
            if victim is None:
                self._preempt(req)
                return False
            self._preempt(victim)
        req.block_ids.extend(alloc.alloc(need))
        return True

    def _admit_waiting(self, budget: int, *, whole: bool, batch: list) -> int:
        """Moves waiting requests to running while they fit (lock held): first those
        admitted with their KV present (they hold blocks, so they go first and cannot be
        blocked by a new prompt waiting for blocks), then the others, in order."""
        alloc = self.pool.allocator
        for queue in (self._prefilled, self._waiting):
            while queue and budget > 0 and len(self._running) < self.config.max_num_seqs:
                req = queue[0]
                n = req.pending if whole else min(req.pending, budget)
                if whole and batch and n > budget:
                    break
                need = self.pool.blocks_for(req.num_computed + n) - len(req.block_ids)
                if need > alloc.num_free:
                    break
                queue.popleft()
                req.block_ids.extend(alloc.alloc(need))
                req.state = _State.RUNNING
                self._running.append(req)
                batch.append((req, n))
                budget -= n
        return budget

    def _schedule(self) -> list[tuple[_Request, int]]:
        """Picks ``(request, tokens to compute)`` pairs for this step (lock held)."""
        batch: list[tuple[_Request, int]] = []
        budget = self.config.max_batch_tokens
        if self.config.mode is SchedulingMode.COLOCATED:
            self._admit_waiting(budget, whole=True, batch=batch)
            if batch:
                return batch
            budget = len(self._running)  # decode step: one token each
        # Decodes first, then unfinished prefills, in admission order.
        order = sorted(self._running, key=lambda r: r.pending > 1)
        scheduled: set[int] = set()
        for req in order:
            if budget <= 0:
                break
            if req.state is not _State.RUNNING:
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

    def _build_inputs(self, sched: list[tuple[_Request, int]]):
        """Packs the scheduled tokens (lock held): ids ``[1, T]``, positions ``[1, T]``,
        the :class:`PagedBatch`, and ``(packed row, request)`` of the rows to sample."""
        ids: list[int] = []
        pos: list[int] = []
        spans: list[SeqSpan] = []
        sample_rows: list[tuple[int, _Request]] = []
        sinks: list[tuple[LayerSink, int, int, tuple[int, ...]]] = []
        for req, n in sched:
            start = req.num_computed
            spans.append(SeqSpan(len(ids), n, start + n, tuple(req.block_ids)))
            if req.layer_sink is not None:
                sinks.append((req.layer_sink, start, start + n, tuple(req.block_ids)))
            ids.extend(req.tokens[start:start + n])
            pos.extend(range(start, start + n))
            if start + n == len(req.tokens):
                sample_rows.append((len(ids) - 1, req))
        device = self.pool.device
        batch = PagedBatch.build(self.pool, spans)
        if sinks:
            batch.on_layer_written = self._layer_hook(sinks)
        input_ids = torch.tensor([ids], dtype=torch.int64, device=device)
        positions = torch.tensor([pos], dtype=torch.int64, device=device)
        return input_ids, positions, batch, sample_rows

    def _layer_hook(self, sinks: list[tuple[LayerSink, int, int, tuple[int, ...]]]) -> Callable[[int], None]:
        """The step's ``on_layer_written``: tells each sink of the step's requests."""
        device = self.pool.device

        def on_layer_written(layer: int) -> None:
            if device.type == "cuda":  # the pool writes are queued on the stream: land them first
                torch.cuda.current_stream(device).synchronize()
            for sink, start, end, blocks in sinks:
                try:
                    sink(layer, start, end, blocks)
                except Exception:  # noqa: BLE001 - a sink must not break the forward
                    log.exception("layer sink failed (layer %d)", layer)

        return on_layer_written

    def _emit(self, events: Iterable[tuple[_Request, TokenEvent]]) -> None:
        """Runs callbacks and wakes waiters; called without the lock."""
        for req, ev in events:
            if ev.finish_reason is not None:
                req.handle._done.set()
            if req.on_event is not None:
                req.on_event(ev)
