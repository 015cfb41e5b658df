"""The engine's value types: scheduling modes, finish reasons, its config, streamed
token events, step statistics and request handles (see :mod:`pdkv.serving.engine`),
and the engine-internal request state its parts share."""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass
from typing import Callable, Literal

from pdkv.errors import InvalidArgument

from .prefix_hash import is_block_hash
from .sampling import SamplingParams

__all__ = ["EngineConfig", "EngineRequest", "EventCallback", "FinishReason", "KVEvent", "KVEventSink", "LayerSink",
           "RequestHandle", "RequestState", "SchedulingMode", "StepStats", "TokenEvent"]


class SchedulingMode(str, enum.Enum):
    """How prefill and decode share steps (see :mod:`pdkv.serving.engine`)."""

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
    prefix_cache : bool
        Keep the KV of full blocks after their requests end and reuse it for requests
        whose prompts start with the same tokens (see :mod:`pdkv.serving.prefix_cache`).
        Default off: blocks are freed as soon as their request ends.
    cache_salt : str
        The salt block hashes chain from (:func:`pdkv.serving.prefix_hash.cache_salt`, 16
        hex digits); empty: derived from the model's name and config, the block size and
        the dtype. Workers that share KV must use the same salt.
    """

    num_blocks: int
    block_tokens: int = 16
    mode: SchedulingMode = SchedulingMode.COLOCATED
    max_batch_tokens: int = 2048
    max_num_seqs: int = 64
    num_threads: int | None = 1
    eos_token_ids: tuple[int, ...] | None = None
    max_model_len: int | None = None
    prefix_cache: bool = False
    cache_salt: str = ""

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
        if not isinstance(self.prefix_cache, bool):
            raise InvalidArgument(f"prefix_cache must be a bool, got {self.prefix_cache!r}")
        if self.cache_salt and not is_block_hash(self.cache_salt):
            raise InvalidArgument(f"cache_salt must be 16 lowercase hex digits (pdkv.serving.prefix_hash.cache_salt) "
                                  f"or empty, got {self.cache_salt!r:.40}")


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


@dataclass(frozen=True)
class KVEvent:
    """A change of an engine's prefix cache index (what workers publish to the fleet index).

    Attributes
    ----------
    kind : {"stored", "evicted", "cleared"}
        ``stored``: the blocks of ``hashes`` hold their KV here now; ``evicted``: they
        do not any more; ``cleared``: the whole index was dropped (``hashes`` empty).
    hashes : tuple of str
        Block hashes (:mod:`pdkv.serving.prefix_hash`), in chain order for ``stored``.
    """

    kind: Literal["stored", "evicted", "cleared"]
    hashes: tuple[str, ...]


#: ``sink(event)``: called in order, without engine locks held (see :meth:`Engine.set_kv_event_sink`).
KVEventSink = Callable[[KVEvent], None]

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
    num_cached_tokens : int
        Prompt tokens whose KV the engine found in its prefix cache when it admitted the
        request (not computed; imported blocks count once committed), or, for
        :meth:`Engine.admit_prefilled`, the tokens of the reservation's cached blocks.
    num_imported_tokens : int
        Of those, tokens of blocks imported from a peer (:meth:`Engine.import_blocks`).
    num_computed_tokens : int
        Prompt tokens this engine computed for the request (again after a preemption).
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
        self.num_cached_tokens = 0
        self.num_imported_tokens = 0
        self.num_computed_tokens = 0
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


class RequestState(enum.Enum):
    """Where an engine-internal request is."""

    WAITING = "waiting"
    RUNNING = "running"
    HELD = "held"          # prefill-only, finished, blocks kept until release()
    FINISHED = "finished"


class EngineRequest:
    """Engine-internal request state (guarded by the engine lock)."""

    __slots__ = ("handle", "tokens", "num_computed", "block_ids", "state", "prefill_only", "on_event",
                 "abort_requested", "layer_sink", "hashes", "num_inserted", "looked_up", "cacheable")

    def __init__(self, handle: RequestHandle, tokens: list[int], *, prefill_only: bool,
                 on_event: EventCallback | None, layer_sink: LayerSink | None = None) -> None:
        self.handle = handle
        self.tokens = tokens            # prompt + outputs: the next input is tokens[num_computed]
        self.num_computed = 0           # tokens whose KV is in the pool
        self.block_ids: list[int] = []
        self.state = RequestState.WAITING
        self.prefill_only = prefill_only
        self.on_event = on_event
        self.abort_requested = False
        self.layer_sink = layer_sink
        self.hashes: list[str] = []     # prefix cache: hashes of tokens' full blocks so far (chained)
        self.num_inserted = 0           # leading block_ids already cached (or found cached)
        self.looked_up = False          # the prefix cache was asked at its first admission
        self.cacheable = True           # its computed blocks may enter the prefix cache

    @property
    def rid(self) -> str:
        return self.handle.request_id

    @property
    def pending(self) -> int:
        """Tokens to compute before the next sample."""
        return len(self.tokens) - self.num_computed
