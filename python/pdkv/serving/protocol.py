"""The HTTP protocol between the proxy and the workers (torch-free).

Workers speak JSON in and newline-delimited JSON (NDJSON) out, one object per line,
flushed as it happens. Every endpoint lives under ``/pd/``:

``POST /pd/generate`` (decode and colocated workers)
    Body :class:`GenerateRequest`. The worker prefills the prompt itself and streams
    token lines ``{"t": token, "i": index}`` (the last one with ``"f": finish_reason``),
    then ``{"done": {...}}`` with the request's statistics.
``POST /pd/decode`` (decode workers)
    Body :class:`GenerateRequest` (with ``kv_timeout_s``). The worker reserves blocks
    for the prompt and answers ``{"reserved": {...}}`` (:class:`Reservation`: block ids
    and the worker's pdkv agent address) at once; it then waits for the pdkv
    notification that the prompt's KV has landed (the notification carries the first
    token, :class:`KVReady`), or for ``/pd/kv_failed``, or for its timeout, and streams
    tokens from index 1 (from 0 if it had to compute the first token too), then
    ``{"done": {...}}``.
``POST /pd/kv_failed`` (decode workers)
    Body :class:`KVFailed`: the KV of a reserved request will not arrive; recompute it
    locally.
``POST /pd/prefill`` (prefill workers)
    Body :class:`PrefillRequest`. The worker prefills, answers ``{"first": {...}}``
    with the first token as soon as it is sampled, pushes the prompt's KV blocks into
    the decode worker's reserved blocks with ``Agent.write(..., notify=KVReady)``, and
    ends with ``{"kv": {...}}`` (:class:`KVResult`).
``POST /pd/kv_lease``, ``POST /pd/kv_release`` (prefill and decode workers)
    Body :class:`LeaseRequest`: pin the leading run of the given block hashes that this
    worker's prefix cache holds, for ``ttl_s`` seconds or until ``/pd/kv_release``
    (:class:`LeaseRelease`), and answer ``{"lease": {...}}`` (:class:`KVLease`: the
    block ids and their generations), so that another worker may read them
    (``PrefillRequest.src``; docs/serving.md, "Cross-worker reuse").
``GET /pd/info``, ``GET /pd/stats``
    Static facts (:class:`WorkerInfo`) and live load (queue depth, free blocks).

An error before streaming starts is an HTTP status with ``{"error": {"message",
"type", "code"}}``; after it started, an ``{"error": {...}}`` line ends the stream
(:class:`StreamError`). Its ``status`` says whose fault it is: 4xx, the request's (the
proxy answers the client with it); 5xx, the worker's (the proxy continues the stream
on another decode worker, exactly as if this one had died).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from pdkv.errors import InvalidArgument

from .prefix_hash import is_block_hash

__all__ = ["BUSY_CODES", "DEFAULT_LIMITS", "STREAM_ERROR_STATUS", "GenParams", "GenerateRequest", "KVFailed",
           "KVLease", "KVReady", "KVResult", "LeaseRelease", "LeaseRequest", "PrefillRequest", "ProtocolLimits",
           "Reservation", "StreamError", "WorkerInfo", "dumps_line", "loads", "require"]


@dataclass(frozen=True)
class ProtocolLimits:
    """Server-side caps on what a ``/pd/*`` body may ask for (a worker's
    ``WorkerConfig.protocol_limits``). A value past its cap is refused (400) with a
    message naming the field and the cap; nothing is clamped silently.

    Attributes
    ----------
    max_kv_timeout_s : float
        ``kv_timeout_s`` of ``/pd/decode`` and ``/pd/prefill``: how long a decode worker
        holds reserved blocks for a KV that may never come (``pdkv serve decode
        --max-kv-timeout``). A proxy's ``--kv-timeout`` must not exceed it.
    max_rid_chars, max_name_chars, max_error_chars : int
        Request ids; agent names and addresses; a ``kv_failed`` error text.
    max_prompt_tokens, max_new_tokens, max_stop_token_ids, max_blocks : int
        Prompt length, ``max_tokens``, ``stop_token_ids`` entries, reserved blocks (and
        generations) of one request.
    max_block_tokens, max_index_offset : int
    max_lease_ttl_s : float
        ``ttl_s`` of ``/pd/kv_lease``: how long a lease may pin blocks for a reader.
    max_lease_hashes : int
        Block hashes of one ``/pd/kv_lease`` body.
    """

    max_kv_timeout_s: float = 60.0
    max_rid_chars: int = 256
    max_name_chars: int = 256
    max_error_chars: int = 4096
    max_prompt_tokens: int = 1 << 22
    max_new_tokens: int = 1 << 22
    max_stop_token_ids: int = 256
    max_blocks: int = 1 << 20
    max_block_tokens: int = 1 << 16
    max_index_offset: int = 1 << 22
    max_lease_ttl_s: float = 300.0
    max_lease_hashes: int = 1 << 16

    def __post_init__(self) -> None:
        for k, v in asdict(self).items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
                raise InvalidArgument(f"protocol limit {k} must be a finite number > 0, got {v!r}")


#: The caps a worker applies unless configured otherwise.
DEFAULT_LIMITS = ProtocolLimits()


def loads(data: bytes | str, *, where: str) -> Any:
    """``json.loads`` that raises only :class:`InvalidArgument` (not JSON, not UTF-8,
    nested too deeply, a number too long for Python's int conversion...)."""
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError, TypeError, MemoryError) as e:
        raise InvalidArgument(f"{where} is not JSON ({type(e).__name__}): {bytes(data[:80])!r}"
                              if isinstance(data, (bytes, bytearray)) else
                              f"{where} is not JSON ({type(e).__name__})") from None


def _cap(v: Any, cap: float, *, where: str, name: str, unit: str = "") -> Any:
    if v > cap:
        raise InvalidArgument(f"{where}: {name} is {v:g}{unit}, above this worker's cap of {cap:g}{unit}"
                              if isinstance(v, float) else
                              f"{where}: {name} is {v}, above this worker's cap of {cap}{unit}")
    return v


def _str(obj: Mapping[str, Any], key: str, cap: int, *, where: str) -> str:
    v = require(obj, key, str, where=where)
    if len(v) > cap:
        raise InvalidArgument(f"{where}: {key} has {len(v)} characters, above this worker's cap of {cap}")
    return v


def _finite(v: Any, *, where: str, name: str) -> float:
    try:
        f = float(v)
    except OverflowError:  # an integer past float's range
        f = math.inf
    if not math.isfinite(f):
        raise InvalidArgument(f"{where}: {name} must be a finite number, got {v!r}")
    return f


def require(obj: Mapping[str, Any], key: str, kind: type | tuple[type, ...], *, where: str) -> Any:
    """``obj[key]`` checked to be of ``kind`` (bool is never an int here).

    Raises
    ------
    InvalidArgument
        Missing or of the wrong type.
    """
    if not isinstance(obj, Mapping) or key not in obj:
        raise InvalidArgument(f"{where}: missing field {key!r}")
    v = obj[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(v, bool) and bool not in kinds:
        raise InvalidArgument(f"{where}: field {key!r} must be {' or '.join(k.__name__ for k in kinds)}, got a bool")
    if not isinstance(v, kinds):
        raise InvalidArgument(f"{where}: field {key!r} must be {' or '.join(k.__name__ for k in kinds)}, "
                              f"got {type(v).__name__}")
    return v


def _int_list(v: Any, *, where: str, name: str, cap: int | None = None) -> tuple[int, ...]:
    if not isinstance(v, list):
        raise InvalidArgument(f"{where}: {name} must be a list of integers")
    if cap is not None and len(v) > cap:
        raise InvalidArgument(f"{where}: {name} has {len(v)} entries, above this worker's cap of {cap}")
    if not all(isinstance(t, int) and not isinstance(t, bool) and -(1 << 63) <= t < (1 << 64) for t in v):
        raise InvalidArgument(f"{where}: {name} must be a list of integers (64-bit)")
    return tuple(v)


def dumps_line(obj: Any) -> bytes:
    """One NDJSON line."""
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


#: HTTP status of each code a worker puts in an ``{"error": ...}`` line. 5xx: the
#: worker failed (internal error, shutting down, out of KV blocks, transport): the
#: request would succeed elsewhere. 4xx: the request itself is at fault.
STREAM_ERROR_STATUS: dict[str, int] = {
    "internal_error": 500,
    "transport_error": 502,
    "shutting_down": 503,
    "kv_pool_full": 503,
    "invalid_request": 400,
    "context_length_exceeded": 400,
}
#: Worker-fault codes that mean "busy", not "broken": the worker stays in rotation.
BUSY_CODES = frozenset({"kv_pool_full"})


@dataclass(frozen=True)
class StreamError:
    """An ``{"error": {"message", "type", "code", "status"}}`` line that ends a worker's
    stream.

    Attributes
    ----------
    message : str
    code : str
        One of :data:`STREAM_ERROR_STATUS` (an unknown code from another version counts
        as an internal error of the worker).
    status : int
        The HTTP status the error stands for; 4xx is the request's fault.
    """

    message: str
    code: str = "internal_error"
    status: int = 500

    @classmethod
    def of(cls, code: str, message: str) -> "StreamError":
        """The error for a known ``code`` (its status from :data:`STREAM_ERROR_STATUS`)."""
        if code not in STREAM_ERROR_STATUS:
            raise InvalidArgument(f"unknown stream error code {code!r}; known: {sorted(STREAM_ERROR_STATUS)}")
        return cls(message, code, STREAM_ERROR_STATUS[code])

    @property
    def request_fault(self) -> bool:
        """True if the request is at fault (retrying it elsewhere would fail the same way)."""
        return 400 <= self.status < 500

    def to_line(self) -> bytes:
        kind = "invalid_request_error" if self.request_fault else "server_error"
        return dumps_line({"error": {"message": self.message, "type": kind, "code": self.code,
                                     "status": self.status}})

    @classmethod
    def from_line(cls, line: Mapping[str, Any]) -> "StreamError":
        """Reads the ``error`` member of a stream line; never raises (a malformed or
        unknown error is the worker's fault)."""
        err = line.get("error")
        if not isinstance(err, Mapping):
            return cls(str(err))
        message = str(err.get("message", err))
        code = err.get("code")
        code = code if isinstance(code, str) and code else "internal_error"
        status = err.get("status")
        if not (isinstance(status, int) and not isinstance(status, bool) and 400 <= status <= 599):
            status = STREAM_ERROR_STATUS.get(code, 500)
        return cls(message, code, status)


@dataclass(frozen=True)
class GenParams:
    """Sampling and stopping parameters as they travel between processes (torch-free;
    :class:`pdkv.serving.sampling.SamplingParams` adds validation, see it for the meaning;
    ``SamplingParams.of(params)`` is the engine's form of one)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    #: Output position of the request's first token: a request migrated after ``n``
    #: tokens continues with ``index_offset = n``, so its random draws (keyed by seed
    #: and output position) are those of the uninterrupted request.
    index_offset: int = 0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["stop_token_ids"] = list(self.stop_token_ids)
        return d

    @classmethod
    def from_json(cls, obj: Any, *, where: str = "params", limits: ProtocolLimits = DEFAULT_LIMITS) -> "GenParams":
        if not isinstance(obj, Mapping):
            raise InvalidArgument(f"{where} must be an object")
        seed = obj.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 1 << 64):
            raise InvalidArgument(f"{where}: seed must be an integer in [0, 2**64) or null")
        offset = obj.get("index_offset", 0)
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise InvalidArgument(f"{where}: index_offset must be an integer >= 0")
        _cap(offset, limits.max_index_offset, where=where, name="index_offset")
        max_tokens = require(obj, "max_tokens", int, where=where)
        if max_tokens < 1:
            raise InvalidArgument(f"{where}: max_tokens must be >= 1")
        _cap(max_tokens, limits.max_new_tokens, where=where, name="max_tokens")
        return cls(max_tokens=max_tokens,
                   temperature=_finite(require(obj, "temperature", (int, float), where=where), where=where,
                                       name="temperature"),
                   top_p=_finite(require(obj, "top_p", (int, float), where=where), where=where, name="top_p"),
                   seed=seed,
                   stop_token_ids=_int_list(obj.get("stop_token_ids", []), where=where, name="stop_token_ids",
                                            cap=limits.max_stop_token_ids),
                   ignore_eos=bool(require(obj, "ignore_eos", bool, where=where)),
                   index_offset=offset)


@dataclass(frozen=True)
class GenerateRequest:
    """Body of ``/pd/generate`` and ``/pd/decode``.

    Attributes
    ----------
    rid : str
        Request id, unique across the deployment (the proxy makes them).
    prompt : tuple of int
        Prompt token ids.
    params : GenParams
        ``params.seed`` is always set by the proxy, so that prefill, decode and a
        recompute sample the same tokens.
    kv_timeout_s : float
        ``/pd/decode`` only: how long the prefill side may take to deliver the KV; the
        decode worker waits this long plus a margin, then recomputes.
    """

    rid: str
    prompt: tuple[int, ...]
    params: GenParams
    kv_timeout_s: float = 30.0

    def to_json(self) -> dict[str, Any]:
        return {"rid": self.rid, "prompt": list(self.prompt), "params": self.params.to_json(),
                "kv_timeout_s": self.kv_timeout_s}

    @classmethod
    def from_json(cls, obj: Any, *, limits: ProtocolLimits = DEFAULT_LIMITS) -> "GenerateRequest":
        where = "request"
        if not isinstance(obj, Mapping):
            raise InvalidArgument(f"{where} must be a JSON object")
        rid = _str(obj, "rid", limits.max_rid_chars, where=where)
        if not rid:
            raise InvalidArgument("request: rid is empty")
        kv = obj.get("kv_timeout_s", 30.0)
        if isinstance(kv, bool) or not isinstance(kv, (int, float)) or not kv > 0:
            raise InvalidArgument("request: kv_timeout_s must be a finite number > 0")
        kv = _cap(_finite(kv, where=where, name="kv_timeout_s"), limits.max_kv_timeout_s, where=where,
                  name="kv_timeout_s", unit=" s")
        return cls(rid, _int_list(require(obj, "prompt", list, where=where), where=where, name="prompt",
                                  cap=limits.max_prompt_tokens),
                   GenParams.from_json(require(obj, "params", dict, where=where), limits=limits), kv)


def _block_tokens(obj: Mapping[str, Any], limits: ProtocolLimits, where: str) -> int:
    bt = require(obj, "block_tokens", int, where=where)
    if bt < 1:
        raise InvalidArgument(f"{where}: block_tokens must be >= 1")
    return _cap(bt, limits.max_block_tokens, where=where, name="block_tokens")


def _count(obj: Mapping[str, Any], key: str, cap: int, *, where: str, default: int = 0) -> int:
    v = obj.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise InvalidArgument(f"{where}: {key} must be an integer >= 0")
    return _cap(v, cap, where=where, name=key)


@dataclass(frozen=True)
class Reservation:
    """Where a decode worker wants a prompt's KV: its agent, the reserved blocks and
    their generations (docs/generations.md: the prefill worker writes with them, so a
    write that arrives after the decode worker gave up and reused the blocks fails
    instead of landing; empty: unchecked).

    ``cached_blocks``: the first ``cached_blocks`` of ``blocks`` already hold the
    prompt's KV on the decode worker (its prefix cache had them). The prefill worker
    pushes only ``blocks[cached_blocks:]``, and may *read* ``blocks[:cached_blocks]``
    (with their generations) into its own cache instead of computing them."""

    blocks: tuple[int, ...]
    agent: str          #: ``host:port`` prefill workers ``connect()`` to
    name: str           #: the agent's name
    block_tokens: int   #: tokens per block of the decode worker's pool
    generations: tuple[int, ...] = ()  #: one per block, or empty
    cached_blocks: int = 0  #: leading blocks that hold the prompt's KV already

    def __post_init__(self) -> None:
        if self.generations and len(self.generations) != len(self.blocks):
            raise InvalidArgument(f"reservation: {len(self.generations)} generations for {len(self.blocks)} blocks")
        if not 0 <= self.cached_blocks <= len(self.blocks):
            raise InvalidArgument(f"reservation: cached_blocks is {self.cached_blocks}, not in [0, "
                                  f"{len(self.blocks)}] (the reserved blocks)")

    def to_json(self) -> dict[str, Any]:
        out = {"blocks": list(self.blocks), "agent": self.agent, "name": self.name, "block_tokens": self.block_tokens}
        if self.generations:
            out["generations"] = list(self.generations)
        if self.cached_blocks:
            out["cached_blocks"] = self.cached_blocks
        return out

    @classmethod
    def from_json(cls, obj: Any, *, limits: ProtocolLimits = DEFAULT_LIMITS) -> "Reservation":
        where = "reservation"
        if not isinstance(obj, Mapping):
            raise InvalidArgument(f"{where} must be a JSON object")
        gens = obj.get("generations", [])
        if not isinstance(gens, list):
            raise InvalidArgument(f"{where}: 'generations' must be a list of integers")
        bt = _block_tokens(obj, limits, where)
        return cls(_int_list(require(obj, "blocks", list, where=where), where=where, name="blocks",
                             cap=limits.max_blocks),
                   _str(obj, "agent", limits.max_name_chars, where=where),
                   _str(obj, "name", limits.max_name_chars, where=where), bt,
                   _int_list(gens, where=where, name="generations", cap=limits.max_blocks),
                   _count(obj, "cached_blocks", limits.max_blocks, where=where))


@dataclass(frozen=True)
class KVLease:
    """Blocks of a worker's prefix cache pinned for a reader (``/pd/kv_lease``): the
    worker's agent holds prompt blocks ``[start, start + len(blocks))`` in ``blocks``,
    readable with ``generations`` (one per block) until the lease is released or
    expires -- after that a read fails with ``StaleBlock`` once the blocks are reused.

    Attributes
    ----------
    lease_id : str
        The id the lease was asked under (release it with it).
    agent, name : str
        The holder's agent address and name.
    block_tokens : int
        Tokens per block of the holder's pool.
    start : int
        The prompt block the first of ``blocks`` holds.
    blocks, generations : tuple of int
    """

    lease_id: str
    agent: str
    name: str
    block_tokens: int
    start: int
    blocks: tuple[int, ...]
    generations: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.generations) != len(self.blocks):
            raise InvalidArgument(f"kv lease: {len(self.generations)} generations for {len(self.blocks)} blocks")
        if self.start < 0:
            raise InvalidArgument(f"kv lease: start is {self.start}, must be >= 0")

    @property
    def end(self) -> int:
        """One past the last prompt block it holds."""
        return self.start + len(self.blocks)

    def to_json(self) -> dict[str, Any]:
        return {"lease_id": self.lease_id, "agent": self.agent, "name": self.name, "block_tokens": self.block_tokens,
                "start": self.start, "blocks": list(self.blocks), "generations": list(self.generations)}

    @classmethod
    def from_json(cls, obj: Any, *, limits: ProtocolLimits = DEFAULT_LIMITS) -> "KVLease":
        where = "kv lease"
        if not isinstance(obj, Mapping):
            raise InvalidArgument(f"{where} must be a JSON object")
        return cls(_lease_id(obj, limits, where), _str(obj, "agent", limits.max_name_chars, where=where),
                   _str(obj, "name", limits.max_name_chars, where=where), _block_tokens(obj, limits, where),
                   _count(obj, "start", limits.max_blocks, where=where),
                   _int_list(require(obj, "blocks", list, where=where), where=where, name="blocks",
                             cap=limits.max_blocks),
                   _int_list(require(obj, "generations", list, where=where), where=where, name="generations",
                             cap=limits.max_blocks))


#: Longest lease id (the holder's engine keeps it with a prefix of its own).
MAX_LEASE_ID_CHARS = 100


def _lease_id(obj: Mapping[str, Any], limits: ProtocolLimits, where: str) -> str:
    v = _str(obj, "lease_id", min(limits.max_rid_chars, MAX_LEASE_ID_CHARS), where=where)
    if not v or not v.isprintable():
        raise InvalidArgument(f"{where}: lease_id must be a non-empty printable string")
    return v


@dataclass(frozen=True)
class LeaseRequest:
    """Body of ``/pd/kv_lease``: pin the leading run of ``hashes`` (prompt blocks
    ``start, start + 1, ...``) that the worker's prefix cache holds.

    Attributes
    ----------
    lease_id : str
        Chosen by the caller, unique while the lease lives (409 otherwise).
    hashes : tuple of str
        Block hashes (:mod:`pdkv.serving.prefix_hash`), in prompt order.
    ttl_s : float
        The lease ends by itself this long after it was granted.
    start : int
        The prompt block ``hashes[0]`` stands for (echoed in :class:`KVLease`).
    """

    lease_id: str
    hashes: tuple[str, ...]
    ttl_s: float = 10.0
    start: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"lease_id": self.lease_id, "hashes": list(self.hashes), "ttl_s": self.ttl_s, "start": self.start}

    @classmethod
    def from_json(cls, obj: Any, *, limits: ProtocolLimits = DEFAULT_LIMITS) -> "LeaseRequest":
        where = "kv_lease"
        if not isinstance(obj, Mapping):
            raise InvalidArgument(f"{where} must be a JSON object")
        hashes = require(obj, "hashes", list, where=where)
        _cap(len(hashes), limits.max_lease_hashes, where=where, name="the number of hashes")
        if not all(isinstance(h, str) and is_block_hash(h) for h in hashes):
            raise InvalidArgument(f"{where}: hashes must be block hashes (16 lowercase hex digits each)")
        ttl = obj.get("ttl_s", 10.0)
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
            raise InvalidArgument(f"{where}: ttl_s must be a finite number > 0")
        ttl = _finite(ttl, where=where, name="ttl_s")
        if not ttl > 0:
            raise InvalidArgument(f"{where}: ttl_s must be a finite number > 0")
        _cap(ttl, limits.max_lease_ttl_s, where=where, name="ttl_s", unit=" s")
        return cls(_lease_id(obj, limits, where), tuple(hashes), ttl,
                   _count(obj, "start", limits.max_blocks, where=where))


@dataclass(frozen=True)
class LeaseRelease:
    """Body of ``/pd/kv_release``: end a lease (its blocks may be evicted again)."""

    lease_id: str

    def to_json(self) -> dict[str, Any]:
        return {"lease_id": self.lease_id}

    @classmethod
    def from_json(cls, obj: Any, *, limits: ProtocolLimits = DEFAULT_LIMITS) -> "LeaseRelease":
        if not isinstance(obj, Mapping):
            raise InvalidArgument("kv_release must be a JSON object")
        return cls(_lease_id(obj, limits, "kv_release"))


@dataclass(frozen=True)
class PrefillRequest:
    """Body of ``/pd/prefill``.

    Attributes
    ----------
    rid, prompt, params
        As in :class:`GenerateRequest`.
    dst : Reservation
        The decode worker's blocks to write the prompt's KV into.
    kv_timeout_s : float
        The KV must have landed this many seconds after the prefill worker received the
        request: a prefill that finishes later does not write at all, and the write's
        own timeout is what is left. (The decode worker waits longer than this before
        it reuses the blocks.)
    src : KVLease or None
        A third worker's lease on blocks of this prompt: the prefill worker may read
        them instead of computing them (the proxy's KV-aware routing asks for it). The
        prefill worker does not release it (the proxy does, or its ttl ends it).
    """

    rid: str
    prompt: tuple[int, ...]
    params: GenParams
    dst: Reservation
    kv_timeout_s: float = 30.0
    src: KVLease | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"rid": self.rid, "prompt": list(self.prompt), "params": self.params.to_json(),
               "dst": self.dst.to_json(), "kv_timeout_s": self.kv_timeout_s}
        if self.src is not None:
            out["src"] = self.src.to_json()
        return out

    @classmethod
    def from_json(cls, obj: Any, *, limits: ProtocolLimits = DEFAULT_LIMITS) -> "PrefillRequest":
        g = GenerateRequest.from_json(obj, limits=limits)
        src = obj.get("src")
        return cls(g.rid, g.prompt, g.params,
                   Reservation.from_json(require(obj, "dst", dict, where="request"), limits=limits), g.kv_timeout_s,
                   None if src is None else KVLease.from_json(src, limits=limits))


@dataclass(frozen=True)
class KVReady:
    """The pdkv notification a prefill worker attaches to its KV write (JSON bytes).

    ``kv`` is False when no KV was written because the first token already ends the
    request (the decode worker then only finishes it). ``lossy`` is True when the KV
    may have travelled lossily compressed (fp8): the decode worker then keeps it out of
    its prefix cache, so no other request reuses it."""

    rid: str
    first_token: int
    seed: int
    kv: bool = True
    lossy: bool = False

    def encode(self) -> bytes:
        out: dict[str, Any] = {"rid": self.rid, "t": self.first_token, "seed": self.seed, "kv": self.kv}
        if self.lossy:
            out["lossy"] = True
        return json.dumps(out, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes, *, limits: ProtocolLimits = DEFAULT_LIMITS) -> "KVReady":
        """Raises only :class:`InvalidArgument`, whatever ``data`` holds."""
        where = "notification"
        if not isinstance(data, (bytes, bytearray, memoryview, str)):
            raise InvalidArgument(f"{where} must be bytes, not {type(data).__name__}")
        obj = loads(bytes(data) if not isinstance(data, str) else data, where=where)
        if not isinstance(obj, Mapping):
            raise InvalidArgument(f"{where} is not a JSON object")
        kv = obj.get("kv", True)
        lossy = obj.get("lossy", False)
        if not isinstance(kv, bool) or not isinstance(lossy, bool):
            raise InvalidArgument(f"{where}: kv and lossy must be bools")
        t = require(obj, "t", int, where=where)
        seed = require(obj, "seed", int, where=where)
        if not (0 <= t < 1 << 63 and 0 <= seed < 1 << 64):
            raise InvalidArgument(f"{where}: t or seed out of range")
        return cls(_str(obj, "rid", limits.max_rid_chars, where=where), t, seed, kv, lossy)


@dataclass(frozen=True)
class KVFailed:
    """Body of ``/pd/kv_failed``.

    Attributes
    ----------
    rid : str
    first_token : int or None
        The first token if the prefill side produced (and the client got) one.
    error : str
        Why, for logs and metrics.
    terminal : bool
        True when no byte of the transfer can still land (it failed, was never posted,
        or its process is gone): the blocks may be reused at once. False when the
        prefill side is merely unresponsive: the decode worker bumps the reserved
        blocks' generations first (a late write then fails instead of landing).
    """

    rid: str
    first_token: int | None = None
    error: str = ""
    terminal: bool = True

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Any, *, limits: ProtocolLimits = DEFAULT_LIMITS) -> "KVFailed":
        where = "kv_failed"
        if not isinstance(obj, Mapping):
            raise InvalidArgument(f"{where} must be a JSON object")
        ft = obj.get("first_token")
        if ft is not None and (not isinstance(ft, int) or isinstance(ft, bool) or not 0 <= ft < 1 << 63):
            raise InvalidArgument("kv_failed: first_token must be an integer >= 0 or null")
        err = obj.get("error", "")
        if not isinstance(err, str):
            raise InvalidArgument("kv_failed: error must be a string")
        if len(err) > limits.max_error_chars:
            raise InvalidArgument(f"kv_failed: error has {len(err)} characters, above this worker's cap of "
                                  f"{limits.max_error_chars}")
        terminal = obj.get("terminal", True)
        if not isinstance(terminal, bool):
            raise InvalidArgument("kv_failed: terminal must be a bool")
        return cls(_str(obj, "rid", limits.max_rid_chars, where=where), ft, err, terminal)


def _nonneg(v: Any, where: str, name: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 1 << 63:
        raise InvalidArgument(f"{where}: {name} must be an integer >= 0")
    return v


@dataclass(frozen=True)
class KVResult:
    """The prefill worker's account of its KV write (the ``{"kv": ...}`` line).

    Attributes
    ----------
    ok : bool
        The bytes landed (or nothing had to be written and the notification went out).
    posted : bool
        A write was started (False: skipped because the first token ends the request,
        the deadline passed, or the peer was unreachable).
    bytes : int
    seconds : float
        The transfer's span: post (a layer-wise stream: its open, before the prefill's
        first layer) to completion (the notification delivered). A stream's span
        overlaps the prefill's compute.
    transport : str
        ``"shm"``, ``"tcp"``, ... (empty if no peer was reached).
    error : str
        Why it failed (empty if ok).
    tail_seconds : float
        What the transfer added after the prefill ended: from the later of the post of
        the last layer and the stream's close with the first token (one write after
        prefill: from its post) to completion; <= seconds.
    wire_seconds : float
        Time the bytes were on the wire: the union of the stream's batch transfers
        (post to completion each; one write: its time); <= seconds.
    cached_tokens : int
        Prompt tokens the prefill worker did not compute because its prefix cache held
        their KV (pulled ones included).
    pulled_tokens, pulled_bytes : int
        Of those, the tokens whose KV it read from another worker first, and the bytes
        read (0 when no pull happened or the pull failed).
    computed_tokens : int
        Prompt tokens it computed.
    skipped_blocks : int
        Reserved blocks not written because the decode worker held them already
        (``Reservation.cached_blocks``).
    """

    ok: bool
    posted: bool
    bytes: int = 0
    seconds: float = 0.0
    transport: str = ""
    error: str = ""
    tail_seconds: float = 0.0
    wire_seconds: float = 0.0
    cached_tokens: int = 0
    pulled_tokens: int = 0
    pulled_bytes: int = 0
    computed_tokens: int = 0
    skipped_blocks: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Any) -> "KVResult":
        where = "kv result"
        if not isinstance(obj, Mapping):
            raise InvalidArgument(f"{where} must be a JSON object")
        reuse = [_nonneg(obj.get(k, 0), where, k) for k in ("cached_tokens", "pulled_tokens", "pulled_bytes",
                                                              "computed_tokens", "skipped_blocks")]
        try:
            return cls(bool(require(obj, "ok", bool, where=where)), bool(obj.get("posted", False)),
                       int(obj.get("bytes", 0)), float(obj.get("seconds", 0.0)), str(obj.get("transport", ""))[:4096],
                       str(obj.get("error", ""))[:4096], float(obj.get("tail_seconds", 0.0)),
                       float(obj.get("wire_seconds", 0.0)), *reuse)
        except (TypeError, ValueError, OverflowError, RecursionError) as e:
            raise InvalidArgument(f"{where}: {type(e).__name__}") from None


@dataclass(frozen=True)
class WorkerInfo:
    """What ``/pd/info`` reports: the worker's role, model and KV geometry."""

    role: str
    model: str
    model_dir: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    kv: dict[str, Any] = field(default_factory=dict)   # num_layers, kv_heads, head_dim, dtype, block_tokens, ...
    engine_mode: str = ""
    agent: dict[str, Any] | None = None                # name, address, transports
    pid: int = 0
    aliases: tuple[str, ...] = ()                      # other names clients may use for the model
    prefix_cache: bool = False                         # caches prompt blocks (docs/serving.md, "Prefix cache")
    cache_salt: str = ""                               # its block hashes' salt ("" when unknown)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["aliases"] = list(self.aliases)
        return d

    @classmethod
    def from_json(cls, obj: Any) -> "WorkerInfo":
        where = "worker info"
        if not isinstance(obj, Mapping):
            raise InvalidArgument(f"{where} must be a JSON object")
        try:
            return cls._from_json(obj, where)
        except (TypeError, ValueError, OverflowError, RecursionError, AttributeError) as e:
            raise InvalidArgument(f"{where}: {type(e).__name__}: {e}"[:300]) from None

    @classmethod
    def _from_json(cls, obj: Mapping[str, Any], where: str) -> "WorkerInfo":
        return cls(require(obj, "role", str, where=where), require(obj, "model", str, where=where),
                   str(obj.get("model_dir", "")), require(obj, "vocab_size", int, where=where),
                   require(obj, "max_model_len", int, where=where),
                   _int_list(obj.get("eos_token_ids", []), where=where, name="eos_token_ids"),
                   dict(obj.get("kv") or {}), str(obj.get("engine_mode", "")), obj.get("agent"),
                   int(obj.get("pid", 0)),
                   tuple(str(a) for a in (obj.get("aliases") or ()) if isinstance(a, str)),
                   _bool(obj.get("prefix_cache", False), where=where, name="prefix_cache"),
                   _salt(obj.get("cache_salt", ""), where=where))

    @property
    def capacity_tokens(self) -> int:
        """Tokens the worker's KV pool holds."""
        return int(self.kv.get("num_blocks", 0)) * int(self.kv.get("block_tokens", 0))

    def kv_compatible(self, other: "WorkerInfo") -> bool:
        """True when blocks can be copied byte for byte between the two pools (same
        layers, heads, head size and dtype; block sizes may differ)."""
        keys = ("num_layers", "kv_heads", "head_dim", "dtype")
        return all(self.kv.get(k) == other.kv.get(k) for k in keys)


def _bool(v: Any, *, where: str, name: str) -> bool:
    if not isinstance(v, bool):
        raise InvalidArgument(f"{where}: {name} must be true or false, got {type(v).__name__}")
    return v


def _salt(v: Any, *, where: str) -> str:
    if v != "" and not is_block_hash(v):
        raise InvalidArgument(f"{where}: cache_salt must be 16 lowercase hex digits or empty")
    return v
