"""Per-request timelines and the serving metrics computed from them (TTFT, ITL, goodput).

Definitions
-----------
Every time is in seconds on one monotonic clock whose zero is the start of the run
(:func:`time.perf_counter` in the client), so records of one run compare directly.

A :class:`RequestRecord` holds, for one request: when the trace scheduled it
(``scheduled_s``), when it was actually sent (``send_s``), the arrival time of every
streamed chunk that carried output (``chunk_times_s``) and how many tokens each
carried (``chunk_tokens``), when the stream ended (``end_s``) and the error, if any.

* **TTFT** (time to first token) = first output chunk − ``send_s``. Measured from the
  send, not from the scheduled time: client-side delay (a concurrency cap, an
  overloaded client) is reported separately as **lag** = ``send_s − scheduled_s``.
* **ITL** (inter-token latency) is per token: a chunk that carries *k* tokens after a
  gap *g* since the previous output chunk contributes *k* samples of *g/k* (the
  convention of SGLang's ``bench_serving``), and the *k* − 1 tokens that arrive with
  the first token contribute *k* − 1 samples of 0 (they came at the same instant;
  their wait is in TTFT). A request with *n* output tokens therefore has *n* − 1 ITL
  samples and their mean is its TPOT. Tokens per chunk come from the server's
  per-chunk usage (``continuous_usage_stats``; the record's ``usage_per_chunk``).
  Without it every chunk counts as one token and ITL is **per chunk** (the gap between
  screen updates): a server that streams one token per chunk gives the same numbers,
  one whose detokenizer holds back incomplete text (several tokens in one chunk)
  gives fewer, longer gaps. :attr:`RunSummary.itl_per_token` says which a run
  measured. Aggregate ITL percentiles pool the samples of every successful request.
* **TPOT** (time per output token) = (last chunk − first chunk) / (output tokens − 1),
  for requests with at least two output tokens: the mean decode pace, insensitive to
  chunking.
* **E2E** (end-to-end latency) = ``end_s − send_s``.
* **Output tokens** of a request: the server's ``usage.completion_tokens`` when it
  reports it, otherwise the sum of ``chunk_tokens`` (one per chunk unless the server
  reported per-chunk counts).
* A request **succeeded** when it has no error, received at least one output chunk and
  its stream ended. Latency statistics use successful requests only; failed ones
  count in ``num_errors`` and against goodput.
* **Run duration** = last stream end (or last event of a failed request) − first send.
  ``output_tok_s`` = output tokens of successful requests / duration, ``req_s`` =
  successful requests / duration.
* **Goodput**: a request is *good* when it succeeded, its TTFT ≤ ``SLO.ttft_s`` and the
  ``SLO.itl_percentile``-th percentile of *its own* ITLs ≤ ``SLO.itl_s`` (default: p90
  of that request's gaps; a request with fewer than two chunks has no gaps and meets
  the ITL part). ``goodput_fraction`` = good / all requests sent (failures included),
  ``goodput_rate`` = good / duration (requests/s).

Percentiles use linear interpolation between order statistics (numpy's default), so
p50 of ``[1, 2, 3, 4]`` is 2.5 and p90 of ``[0.1, 0.2]`` is 0.19. Empty samples give
``None`` (JSON ``null``), never NaN.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Union

import numpy as np

__all__ = [
    "SCHEMA",
    "SLO",
    "BenchResults",
    "RequestRecord",
    "RunResult",
    "RunSummary",
    "Stats",
    "error_kind",
    "meets_slo",
    "summarize",
]

#: Version tag of the results JSON written by :meth:`BenchResults.to_dict`.
SCHEMA = "pdkv.lab.serve/1"


def _opt_float(x: Any) -> Optional[float]:
    return None if x is None else float(x)


def _us(x: Optional[float]) -> Optional[float]:
    """Round a time to the microsecond for JSON (half the bytes of a full float, ample precision)."""
    return None if x is None else round(x, 6)


@dataclass
class RequestRecord:
    """The timeline of one request, as the client observed it.

    Attributes
    ----------
    index : int
        Index of the request in its trace (pairs requests across runs).
    scheduled_s : float
        Arrival time from the trace, seconds after the run start.
    prompt_len : int
        Prompt length the trace asked for (tokens).
    max_tokens : int
        Output length requested (``max_tokens``).
    send_s : float or None
        When the HTTP request was sent; ``None`` if it never was.
    chunk_times_s : list of float
        Arrival time of each streamed chunk that carried output, non-decreasing.
    chunk_tokens : list of int
        Tokens in each of those chunks (same length as ``chunk_times_s``); all 1 unless
        ``usage_per_chunk``.
    usage_per_chunk : bool
        The server reported ``usage.completion_tokens`` in every chunk, so
        ``chunk_tokens`` are true token counts and :attr:`itls_s` is per token.
    end_s : float or None
        When the stream ended (``data: [DONE]``, end of body, or the error).
    output_tokens : int
        Output token count: ``usage.completion_tokens`` if reported, else ``sum(chunk_tokens)``.
    prompt_tokens : int or None
        ``usage.prompt_tokens`` if the server reported it.
    finish_reason : str or None
        The last ``finish_reason`` seen (``"length"``, ``"stop"``, ...).
    http_status : int or None
        HTTP status of the response, ``None`` if no response arrived.
    error : str or None
        ``"Kind: message"`` when the request failed (see :func:`error_kind`), else ``None``.
    output_token_ids : list of int or None
        The generated token ids, when the server returned them (``return_token_ids``,
        sent by the streaming comparison to check that two modes answered alike).
    session, turn : int or None
        Session and turn of a session workload's request
        (:mod:`pdkv.lab.serve.trace_sessions`); ``None`` for request traces.
    prompt_token_ids : list of int or None
        The token-id prompt the request sent; kept in memory for the prefix-reuse
        bounds (:func:`pdkv.lab.serve.prefix.hit_rate_max`), not written to results.
    """

    index: int
    scheduled_s: float
    prompt_len: int = 0
    max_tokens: int = 0
    send_s: Optional[float] = None
    chunk_times_s: List[float] = field(default_factory=list)
    chunk_tokens: List[int] = field(default_factory=list)
    end_s: Optional[float] = None
    output_tokens: int = 0
    prompt_tokens: Optional[int] = None
    finish_reason: Optional[str] = None
    http_status: Optional[int] = None
    error: Optional[str] = None
    usage_per_chunk: bool = False
    output_token_ids: Optional[List[int]] = None
    session: Optional[int] = None
    turn: Optional[int] = None
    prompt_token_ids: Optional[List[int]] = field(default=None, repr=False, compare=False)

    def add_chunk(self, t: float, tokens: int = 1) -> None:
        """Record an output chunk that arrived at ``t`` carrying ``tokens`` tokens."""
        self.chunk_times_s.append(t)
        self.chunk_tokens.append(tokens)

    @property
    def ok(self) -> bool:
        """True when the request succeeded (no error, >= 1 output chunk, stream ended)."""
        return self.error is None and bool(self.chunk_times_s) and self.end_s is not None and self.send_s is not None

    @property
    def ttft_s(self) -> Optional[float]:
        """Time to first token (s), ``None`` without a send or an output chunk."""
        if self.send_s is None or not self.chunk_times_s:
            return None
        return self.chunk_times_s[0] - self.send_s

    @property
    def t2t_s(self) -> Optional[float]:
        """Time to the second output token (s): in a disaggregated deployment the first
        token comes from the prefill worker, the second from the decode worker once the
        KV landed, so this is when the KV was ready. ``None`` below two tokens."""
        if self.send_s is None or not self.chunk_times_s:
            return None
        if self.chunk_tokens[0] >= 2:
            return self.chunk_times_s[0] - self.send_s
        if len(self.chunk_times_s) < 2:
            return None
        return self.chunk_times_s[1] - self.send_s

    @property
    def itls_s(self) -> List[float]:
        """Inter-token latencies (s): ``sum(chunk_tokens) - 1`` values (see the module docstring).

        A chunk of *k* tokens after a gap *g* gives *k* values *g/k*; the extra tokens of
        the first chunk give zeros. With one token per chunk these are the chunk gaps.

        Examples
        --------
        >>> r = RequestRecord(0, 0.0, chunk_times_s=[1.0, 1.5, 1.8], chunk_tokens=[2, 2, 1])
        >>> [round(x, 3) for x in r.itls_s]
        [0.0, 0.25, 0.25, 0.3]
        """
        t, k = self.chunk_times_s, self.chunk_tokens
        if not t:
            return []
        out = [0.0] * (max(k[0], 1) - 1)
        for a, b, n in zip(t, t[1:], k[1:]):
            n = max(n, 1)
            out.extend([(b - a) / n] * n)
        return out

    @property
    def e2e_s(self) -> Optional[float]:
        """End-to-end latency (s), ``None`` until the stream ended."""
        if self.send_s is None or self.end_s is None:
            return None
        return self.end_s - self.send_s

    @property
    def tpot_s(self) -> Optional[float]:
        """Mean time per output token after the first (s); ``None`` below two tokens."""
        if len(self.chunk_times_s) < 1 or self.output_tokens < 2:
            return None
        return (self.chunk_times_s[-1] - self.chunk_times_s[0]) / (self.output_tokens - 1)

    @property
    def lag_s(self) -> Optional[float]:
        """How late the client sent the request relative to its schedule (s)."""
        return None if self.send_s is None else self.send_s - self.scheduled_s

    @property
    def last_event_s(self) -> Optional[float]:
        """The latest time anything happened to this request."""
        last_chunk = self.chunk_times_s[-1] if self.chunk_times_s else None
        times = [t for t in (self.end_s, last_chunk, self.send_s) if t is not None]
        return max(times) if times else None

    def to_dict(self) -> Dict[str, Any]:
        """JSON-serialisable form (all fields; times rounded to the microsecond)."""
        return {
            "index": self.index,
            "scheduled_s": _us(self.scheduled_s),
            "prompt_len": self.prompt_len,
            "max_tokens": self.max_tokens,
            "send_s": _us(self.send_s),
            "chunk_times_s": [_us(t) for t in self.chunk_times_s],
            "chunk_tokens": list(self.chunk_tokens),
            "end_s": _us(self.end_s),
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
            "finish_reason": self.finish_reason,
            "http_status": self.http_status,
            "error": self.error,
            "usage_per_chunk": self.usage_per_chunk,
            **({} if self.output_token_ids is None else {"output_token_ids": list(self.output_token_ids)}),
            **({} if self.session is None else {"session": self.session, "turn": self.turn}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RequestRecord":
        """Inverse of :meth:`to_dict`."""
        return cls(
            index=int(d["index"]),
            scheduled_s=float(d["scheduled_s"]),
            prompt_len=int(d.get("prompt_len", 0)),
            max_tokens=int(d.get("max_tokens", 0)),
            send_s=_opt_float(d.get("send_s")),
            chunk_times_s=[float(t) for t in d.get("chunk_times_s", [])],
            chunk_tokens=[int(k) for k in d.get("chunk_tokens", [])],
            end_s=_opt_float(d.get("end_s")),
            output_tokens=int(d.get("output_tokens", 0)),
            prompt_tokens=None if d.get("prompt_tokens") is None else int(d["prompt_tokens"]),
            finish_reason=d.get("finish_reason"),
            http_status=None if d.get("http_status") is None else int(d["http_status"]),
            error=d.get("error"),
            usage_per_chunk=bool(d.get("usage_per_chunk", False)),
            output_token_ids=None if d.get("output_token_ids") is None else [int(t) for t in d["output_token_ids"]],
            session=None if d.get("session") is None else int(d["session"]),
            turn=None if d.get("turn") is None else int(d["turn"]),
        )


def error_kind(error: str) -> str:
    """The kind of an error string: the text before the first ``":"`` (``"HTTP 500"``, ``"Timeout"``, ...)."""
    return error.split(":", 1)[0].strip()


@dataclass(frozen=True)
class SLO:
    """A latency objective for goodput.

    Attributes
    ----------
    ttft_s : float
        Maximum time to first token, seconds.
    itl_s : float
        Maximum of the ``itl_percentile``-th percentile of a request's own ITLs, seconds.
    itl_percentile : float
        Which percentile of a request's ITLs must meet ``itl_s`` (0-100; 90 by default,
        100 means every gap).
    """

    ttft_s: float
    itl_s: float
    itl_percentile: float = 90.0

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.itl_s > 0 and 0 <= self.itl_percentile <= 100):
            raise ValueError(f"bad SLO {self}: times must be > 0, percentile in [0, 100]")

    def describe(self) -> str:
        """E.g. ``"TTFT <= 2 s and p90 ITL <= 100 ms"``."""
        return f"TTFT <= {_fmt_s(self.ttft_s)} and p{self.itl_percentile:g} ITL <= {_fmt_s(self.itl_s)}"

    def to_dict(self) -> Dict[str, Any]:
        """JSON-serialisable form."""
        return {"ttft_s": self.ttft_s, "itl_s": self.itl_s, "itl_percentile": self.itl_percentile}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SLO":
        """Inverse of :meth:`to_dict`."""
        return cls(float(d["ttft_s"]), float(d["itl_s"]), float(d.get("itl_percentile", 90.0)))


def _fmt_s(x: float) -> str:
    return f"{x * 1000:g} ms" if x < 1 else f"{x:g} s"


def meets_slo(record: RequestRecord, slo: SLO) -> bool:
    """Whether ``record`` is *good* under ``slo`` (see the module docstring).

    Parameters
    ----------
    record : RequestRecord
        One request's timeline.
    slo : SLO
        The objective.

    Returns
    -------
    bool
        Succeeded, TTFT <= ``slo.ttft_s`` and percentile of its ITLs <= ``slo.itl_s``.

    Examples
    --------
    TTFT 0.5 s; gaps 0.125, 0.125, 0.25 s, whose p90 is 0.225 s:

    >>> r = RequestRecord(0, 0.0, send_s=1.0, chunk_times_s=[1.5, 1.625, 1.75, 2.0],
    ...                   chunk_tokens=[1, 1, 1, 1], end_s=2.0, output_tokens=4)
    >>> meets_slo(r, SLO(ttft_s=0.5, itl_s=0.25)), meets_slo(r, SLO(ttft_s=0.5, itl_s=0.2))
    (True, False)
    """
    if not record.ok:
        return False
    ttft = record.ttft_s
    if ttft is None or ttft > slo.ttft_s:
        return False
    itls = record.itls_s
    if not itls:
        return True
    return float(np.percentile(np.asarray(itls, dtype=np.float64), slo.itl_percentile)) <= slo.itl_s


@dataclass(frozen=True)
class Stats:
    """Summary statistics of a sample (seconds for latencies); ``None`` when empty.

    Attributes
    ----------
    count : int
        Sample size.
    mean, p50, p90, p99, max : float or None
        Mean, percentiles (linear interpolation) and maximum.
    """

    count: int
    mean: Optional[float]
    p50: Optional[float]
    p90: Optional[float]
    p99: Optional[float]
    max: Optional[float]

    @classmethod
    def of(cls, values: Iterable[float]) -> "Stats":
        """Compute the statistics of ``values``."""
        a = np.asarray(list(values), dtype=np.float64)
        if a.size == 0:
            return cls(0, None, None, None, None, None)
        p50, p90, p99 = np.percentile(a, [50, 90, 99])
        return cls(int(a.size), float(a.mean()), float(p50), float(p90), float(p99), float(a.max()))

    def percentile(self, name: str) -> Optional[float]:
        """``"p50"``, ``"p90"``, ``"p99"``, ``"max"`` or ``"mean"`` by name."""
        if name not in ("mean", "p50", "p90", "p99", "max"):
            raise ValueError(f"unknown statistic {name!r}")
        return getattr(self, name)

    def to_dict(self) -> Dict[str, Any]:
        """JSON-serialisable form."""
        return {
            "count": self.count, "mean": self.mean, "p50": self.p50, "p90": self.p90, "p99": self.p99, "max": self.max
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Stats":
        """Inverse of :meth:`to_dict`."""
        return cls(int(d["count"]), *(_opt_float(d.get(k)) for k in ("mean", "p50", "p90", "p99", "max")))


@dataclass(frozen=True)
class RunSummary:
    """Aggregate metrics of one run (one trace at one rate against one server).

    Attributes
    ----------
    num_requests, num_ok, num_errors : int
        Requests in the run, successful, failed.
    errors : dict of str to int
        Failed requests per :func:`error_kind`.
    duration_s : float
        First send to last event (s); 0 when nothing was sent.
    ttft, itl, e2e, tpot, lag : Stats
        See the module docstring (seconds).
    itl_per_token : bool
        Every successful request had per-chunk usage, so ``itl`` (and the ITL part of
        goodput) is per token; false: per chunk, or a mix (see the module docstring).
    output_tokens : int
        Output tokens of successful requests.
    output_tok_s, req_s : float or None
        Throughput over ``duration_s``; ``None`` when it is 0.
    slo : SLO
        The objective goodput was computed for.
    num_good : int
        Requests meeting ``slo``.
    goodput_fraction : float or None
        ``num_good / num_requests``.
    goodput_rate : float or None
        ``num_good / duration_s`` (requests/s).
    """

    num_requests: int
    num_ok: int
    num_errors: int
    errors: Mapping[str, int]
    duration_s: float
    ttft: Stats
    itl: Stats
    e2e: Stats
    tpot: Stats
    lag: Stats
    itl_per_token: bool
    output_tokens: int
    output_tok_s: Optional[float]
    req_s: Optional[float]
    slo: SLO
    num_good: int
    goodput_fraction: Optional[float]
    goodput_rate: Optional[float]

    def to_dict(self) -> Dict[str, Any]:
        """JSON-serialisable form."""
        return {
            "num_requests": self.num_requests,
            "num_ok": self.num_ok,
            "num_errors": self.num_errors,
            "errors": dict(self.errors),
            "duration_s": self.duration_s,
            "ttft": self.ttft.to_dict(),
            "itl": self.itl.to_dict(),
            "e2e": self.e2e.to_dict(),
            "tpot": self.tpot.to_dict(),
            "lag": self.lag.to_dict(),
            "itl_per_token": self.itl_per_token,
            "output_tokens": self.output_tokens,
            "output_tok_s": self.output_tok_s,
            "req_s": self.req_s,
            "slo": self.slo.to_dict(),
            "num_good": self.num_good,
            "goodput_fraction": self.goodput_fraction,
            "goodput_rate": self.goodput_rate,
        }


def summarize(records: Sequence[RequestRecord], slo: SLO, *, duration_s: Optional[float] = None) -> RunSummary:
    """Aggregate the records of one run.

    Parameters
    ----------
    records : sequence of RequestRecord
        Every request of the run, failed ones included.
    slo : SLO
        Objective for goodput.
    duration_s : float, optional
        Override the measured duration (first send to last event).

    Returns
    -------
    RunSummary
    """
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    errors: Dict[str, int] = {}
    for r in failed:
        kind = error_kind(r.error) if r.error else "Incomplete"
        errors[kind] = errors.get(kind, 0) + 1
    if duration_s is None:
        sends = [r.send_s for r in records if r.send_s is not None]
        lasts = [t for t in (r.last_event_s for r in records) if t is not None]
        duration_s = max(lasts) - min(sends) if sends else 0.0
    good = sum(1 for r in records if meets_slo(r, slo))
    out_tokens = sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: None)
    return RunSummary(
        num_requests=len(records),
        num_ok=len(ok),
        num_errors=len(failed),
        errors=dict(sorted(errors.items())),
        duration_s=float(duration_s),
        ttft=Stats.of(r.ttft_s for r in ok if r.ttft_s is not None),
        itl=Stats.of(g for r in ok for g in r.itls_s),
        e2e=Stats.of(r.e2e_s for r in ok if r.e2e_s is not None),
        tpot=Stats.of(r.tpot_s for r in ok if r.tpot_s is not None),
        lag=Stats.of(r.lag_s for r in records if r.lag_s is not None),
        itl_per_token=bool(ok) and all(r.usage_per_chunk for r in ok),
        output_tokens=out_tokens,
        output_tok_s=per_s(out_tokens),
        req_s=per_s(len(ok)),
        slo=slo,
        num_good=good,
        goodput_fraction=good / len(records) if records else None,
        goodput_rate=per_s(good),
    )


@dataclass
class RunResult:
    """One trace replayed at one rate against one serving mode.

    Attributes
    ----------
    mode : str
        Serving mode or deployment label (``"colocated"``, ``"disagg"``, ``"url"``...).
    rate : float
        Mean request rate of the trace (requests/s).
    records : list of RequestRecord
        Every request's timeline.
    pd_ratio : str or None
        Prefill:decode worker ratio such as ``"1:1"`` for disaggregated modes.
    config : dict
        Free-form JSON-serialisable details of the deployment (cores, chunk size...).
    prefix : dict or None
        Prefix-reuse figures of the run (:func:`pdkv.lab.serve.prefix.prefix_summary`:
        ``prefix_hit_rate``, ``prefix_hit_rate_max``, ``prefill_tokens``, ``kv_bytes``,
        ``outputs_equal``...), merged into the stored ``summary``; ``None`` when not measured.
    """

    mode: str
    rate: float
    records: List[RequestRecord]
    pd_ratio: Optional[str] = None
    config: Dict[str, Any] = field(default_factory=dict)
    prefix: Optional[Dict[str, Any]] = None

    @property
    def candidate(self) -> str:
        """The deployment this run measured: ``mode`` or ``"mode P:D"``."""
        return self.mode if not self.pd_ratio else f"{self.mode} {self.pd_ratio}"

    def summary(self, slo: SLO) -> RunSummary:
        """:func:`summarize` the records under ``slo``."""
        return summarize(self.records, slo)

    def to_dict(self, slo: SLO) -> Dict[str, Any]:
        """JSON-serialisable form, with the summary under ``slo`` (for readers of the file)."""
        return {
            "mode": self.mode,
            "pd_ratio": self.pd_ratio,
            "rate": self.rate,
            "config": dict(self.config),
            "summary": {**self.summary(slo).to_dict(), **(self.prefix or {})},
            **({} if self.prefix is None else {"prefix": dict(self.prefix)}),
            "records": [r.to_dict() for r in self.records],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RunResult":
        """Inverse of :meth:`to_dict` (the stored summary is ignored; it is recomputed)."""
        return cls(
            mode=str(d["mode"]),
            rate=float(d["rate"]),
            records=[RequestRecord.from_dict(r) for r in d.get("records", [])],
            pd_ratio=d.get("pd_ratio"),
            config=dict(d.get("config", {})),
            prefix=None if d.get("prefix") is None else dict(d["prefix"]),
        )


@dataclass
class BenchResults:
    """Everything a ``pdkv bench serve`` run measured.

    Attributes
    ----------
    runs : list of RunResult
        One per (mode, P:D ratio, rate).
    slo : SLO
        The objective used for the stored summaries and by default for reports.
    meta : dict
        JSON-serialisable provenance: command line, trace spec and seed, client
        options, machine, start time.
    """

    runs: List[RunResult]
    slo: SLO
    meta: Dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        """JSON-serialisable form (``schema`` = :data:`SCHEMA`)."""
        return {
            "schema": SCHEMA,
            "slo": self.slo.to_dict(),
            "meta": dict(self.meta),
            "runs": [r.to_dict(self.slo) for r in self.runs],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "BenchResults":
        """Inverse of :meth:`to_dict`.

        Raises
        ------
        ValueError
            ``schema`` is not :data:`SCHEMA`.
        """
        if d.get("schema") != SCHEMA:
            raise ValueError(f"not a {SCHEMA} results file (schema={d.get('schema')!r})")
        return cls([RunResult.from_dict(r) for r in d["runs"]], SLO.from_dict(d["slo"]), dict(d.get("meta", {})))

    def save(self, path: Union[str, "os.PathLike[str]"]) -> None:
        """Write :meth:`to_dict` as indented JSON (strict: no NaN)."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1, allow_nan=False)
            f.write("\n")

    @classmethod
    def load(cls, path: Union[str, "os.PathLike[str]"]) -> "BenchResults":
        """Read a file written by :meth:`save`."""
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

