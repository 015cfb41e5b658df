"""Request traces for ``pdkv bench serve``: seeded synthetic generation, presets, JSONL replay.

A trace is a list of requests, each with an arrival time (seconds from the start of
the run), a prompt length and an output length (tokens). Synthetic traces come from
a :class:`TraceSpec`: an arrival process (:class:`Poisson`, bursty :class:`Gamma`,
:class:`Periodic`) and two length distributions (:class:`Fixed`, :class:`Uniform`,
clipped :class:`LogNormal`, :class:`Mixture`).

Determinism
-----------
Everything is a pure function of the seed. Random numbers are drawn in blocks of
:data:`BLOCK` requests, each block from its own stream keyed by
``(seed, stream, block)``, so:

* the same ``(spec, seed)`` always gives the same trace, on any machine;
* the first *k* requests do not depend on how many requests are generated;
* arrivals are unit-mean gaps divided by the rate, so the trace at rate ``r2`` is the
  trace at rate ``r1`` with its timestamps multiplied by ``r1 / r2`` (common random
  numbers: a rate sweep compares the same requests, not new samples).

Prompts are generated deterministically from ``(seed, request index)``:
:func:`token_prompt` gives token ids of the exact length (``/v1/completions`` takes a
list of ids as ``prompt``), :func:`text_prompt` gives text of about that many tokens
(common English words, one token each in most BPE vocabularies) for servers that only
accept text, such as ``/v1/chat/completions``.

Presets and saturation
----------------------
The presets are sized for the reference setup of issue 6: a ~40M-parameter Llama on
one pinned CPU core, where a 1024-token prefill takes ~0.8 s and a decode step for 8
requests ~50 ms (:class:`CostModel`). On that core, prefill alone saturates at one
1024-token prompt every ~0.8 s (one every 0.5 s is well past it). A request costs
about ``prompt_len * 0.78 ms + (output_len - 1) * 6.25 ms`` of core time at batch 8;
the utilisation ``rho = rate * mean cost`` must stay below 1. Each preset's default
rate keeps ``rho`` near 0.5 on **one** core (so a two-core deployment runs at about a
quarter of its capacity, and a rate sweep up to 2x the default stays unsaturated on
two cores). The numbers below are :func:`saturation_rate` for one core:

================  =====================================  =======  =====  ===========
preset            lengths (prompt / output, tokens)      rate     rho    saturation
================  =====================================  =======  =====  ===========
``chat-short``    lognormal med 128 / med 48             1.0/s    0.45   2.24/s
``rag-long``      lognormal med 1024 / med 48            0.4/s    0.46   0.86/s
``mixed``         80% med 128 + 20% med 1024 / med 64    0.6/s    0.43   1.38/s
``prefill-heavy`` uniform 512-1536 / uniform 16-64       0.5/s    0.52   0.96/s
``chat-bursty``   as ``chat-short``, gamma CV 3          1.0/s    0.45   2.24/s
================  =====================================  =======  =====  ===========

(``rho`` and ``saturation`` are for one core; ``tests/lab`` checks this table
against :func:`utilisation` and :func:`saturation_rate`.)

The decode term assumes full batches of 8; at lower concurrency a step serves fewer
requests for about the same cost, so real utilisation is somewhat higher than
``rho``. Short Poisson bursts exceed the mean rate: ``chat-bursty`` (CV 3) queues
much more than ``chat-short`` at the same mean rate, by design.

JSONL format
------------
One JSON object per line: ``timestamp`` (seconds; ``time_scale`` converts other units),
``prompt_len`` or ``prompt`` (text or a list of token ids), ``output_len``. The aliases
``input_length``/``output_length`` (the Mooncake trace format) are accepted.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Dict, Iterable, List, Literal, Mapping, Optional, Tuple, Union

import numpy as np

__all__ = [
    "BLOCK",
    "PRESETS",
    "ArrivalProcess",
    "CostModel",
    "Fixed",
    "Gamma",
    "LengthDist",
    "LogNormal",
    "Mixture",
    "Periodic",
    "Poisson",
    "Prompt",
    "Trace",
    "TraceRequest",
    "TraceSpec",
    "Uniform",
    "arrival_from_dict",
    "generate_trace",
    "get_preset",
    "length_dist_from_dict",
    "load_trace",
    "parse_arrival",
    "parse_length_dist",
    "saturation_rate",
    "save_trace",
    "text_prompt",
    "token_prompt",
    "utilisation",
]

#: Requests per random-number block (see the module docstring on determinism).
BLOCK = 1024

# Stream ids: each kind of random draw has its own stream so that they never interact.
_STREAM_ARRIVAL = 1
_STREAM_PROMPT_LEN = 2
_STREAM_OUTPUT_LEN = 3
_STREAM_PROMPT_CONTENT = 4

Prompt = Union[str, List[int]]


def _block_rng(seed: int, stream: int, block: int) -> np.random.Generator:
    return np.random.default_rng([int(seed) & 0xFFFFFFFFFFFFFFFF, stream, block])


def _blocked(seed: int, stream: int, n: int, draw: Any) -> np.ndarray:
    """Concatenate ``draw(rng, BLOCK)`` over blocks and keep the first ``n`` values."""
    parts = [draw(_block_rng(seed, stream, b), BLOCK) for b in range((n + BLOCK - 1) // BLOCK)]
    if not parts:
        return np.zeros(0)
    return np.concatenate(parts)[:n]


def _norm_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


# --------------------------------------------------------------------------------------
# Length distributions
# --------------------------------------------------------------------------------------


class LengthDist:
    """A distribution of token counts (integers >= 1).

    Subclasses are frozen dataclasses; ``spec()`` returns the string that
    :func:`parse_length_dist` reads back, ``to_dict()`` the JSON form that
    :func:`length_dist_from_dict` reads back.
    """

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Draw ``n`` lengths.

        Parameters
        ----------
        rng : numpy.random.Generator
            Source of randomness; consumed sequentially.
        n : int
            Number of values.

        Returns
        -------
        numpy.ndarray
            ``[n]`` int64, every value >= 1.
        """
        raise NotImplementedError

    def mean(self) -> float:
        """Exact expected value of :meth:`sample` (before integer rounding for continuous laws)."""
        raise NotImplementedError

    def spec(self) -> str:
        """The compact string form, e.g. ``"lognormal:128:0.5:16:512"``."""
        raise NotImplementedError

    def to_dict(self) -> Dict[str, Any]:
        """JSON-serialisable form."""
        raise NotImplementedError


@dataclass(frozen=True)
class Fixed(LengthDist):
    """Always ``value`` tokens.

    Parameters
    ----------
    value : int
        Token count, >= 1.
    """

    value: int

    def __post_init__(self) -> None:
        if int(self.value) != self.value or self.value < 1:
            raise ValueError(f"Fixed length must be an integer >= 1, got {self.value!r}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:  # noqa: D102
        return np.full(n, self.value, dtype=np.int64)

    def mean(self) -> float:  # noqa: D102
        return float(self.value)

    def spec(self) -> str:  # noqa: D102
        return f"fixed:{self.value}"

    def to_dict(self) -> Dict[str, Any]:  # noqa: D102
        return {"kind": "fixed", "value": self.value}


@dataclass(frozen=True)
class Uniform(LengthDist):
    """Integers uniform on ``[low, high]`` (both inclusive).

    Parameters
    ----------
    low, high : int
        Bounds, ``1 <= low <= high``.
    """

    low: int
    high: int

    def __post_init__(self) -> None:
        if not (1 <= self.low <= self.high):
            raise ValueError(f"Uniform needs 1 <= low <= high, got [{self.low}, {self.high}]")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:  # noqa: D102
        return rng.integers(self.low, self.high + 1, size=n, dtype=np.int64)

    def mean(self) -> float:  # noqa: D102
        return (self.low + self.high) / 2.0

    def spec(self) -> str:  # noqa: D102
        return f"uniform:{self.low}:{self.high}"

    def to_dict(self) -> Dict[str, Any]:  # noqa: D102
        return {"kind": "uniform", "low": self.low, "high": self.high}


@dataclass(frozen=True)
class LogNormal(LengthDist):
    """Log-normal lengths, rounded to integers and clipped to ``[min, max]``.

    ``log(X) ~ Normal(log(median), sigma**2)``; values outside the bounds are set to
    the bound (clipping, not resampling: the probability mass beyond ``max`` lands
    exactly on ``max``).

    Parameters
    ----------
    median : float
        Median of the unclipped law (tokens), > 0.
    sigma : float
        Standard deviation of ``log(X)``, >= 0. 0.25 is narrow, 1.0 is heavy-tailed.
    min, max : int
        Clipping bounds, ``1 <= min <= max``.
    """

    median: float
    sigma: float
    min: int
    max: int

    def __post_init__(self) -> None:
        if self.median <= 0 or self.sigma < 0 or not (1 <= self.min <= self.max):
            raise ValueError(f"bad LogNormal parameters: {self}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:  # noqa: D102
        x = rng.lognormal(math.log(self.median), self.sigma, size=n)
        return np.clip(np.rint(x), self.min, self.max).astype(np.int64)

    def mean(self) -> float:  # noqa: D102
        a, b, mu, s = float(self.min), float(self.max), math.log(self.median), self.sigma
        if s == 0.0:
            return min(max(self.median, a), b)
        za, zb = (math.log(a) - mu) / s, (math.log(b) - mu) / s
        inner = math.exp(mu + s * s / 2) * (_norm_cdf(zb - s) - _norm_cdf(za - s))
        return a * _norm_cdf(za) + b * (1.0 - _norm_cdf(zb)) + inner

    def spec(self) -> str:  # noqa: D102
        return f"lognormal:{self.median:g}:{self.sigma:g}:{self.min}:{self.max}"

    def to_dict(self) -> Dict[str, Any]:  # noqa: D102
        return {"kind": "lognormal", "median": self.median, "sigma": self.sigma, "min": self.min, "max": self.max}


@dataclass(frozen=True)
class Mixture(LengthDist):
    """Each length comes from component *i* with probability ``weights[i]``.

    Parameters
    ----------
    components : tuple of (float, LengthDist)
        ``(weight, dist)`` pairs; weights are > 0 and are normalised to sum to 1.

    Examples
    --------
    80% short, 20% long prompts:

    >>> round(Mixture(((0.8, Fixed(128)), (0.2, Fixed(1024)))).mean(), 1)
    307.2
    """

    components: Tuple[Tuple[float, LengthDist], ...]

    def __post_init__(self) -> None:
        if not self.components or any(w <= 0 for w, _ in self.components):
            raise ValueError("Mixture needs at least one component, every weight > 0")

    @property
    def weights(self) -> np.ndarray:
        """``[k]`` float64 normalised weights."""
        w = np.array([w for w, _ in self.components], dtype=np.float64)
        return w / w.sum()

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:  # noqa: D102
        which = rng.choice(len(self.components), size=n, p=self.weights)
        out = np.empty(n, dtype=np.int64)
        for i, (_, dist) in enumerate(self.components):
            values = dist.sample(rng, n)  # always n draws, so the stream position is fixed
            out[which == i] = values[which == i]
        return out

    def mean(self) -> float:  # noqa: D102
        return float(sum(w * d.mean() for w, (_, d) in zip(self.weights, self.components)))

    def spec(self) -> str:  # noqa: D102
        return "+".join(f"{w:g}*{d.spec()}" for w, d in self.components)

    def to_dict(self) -> Dict[str, Any]:  # noqa: D102
        return {"kind": "mixture", "components": [{"weight": w, "dist": d.to_dict()} for w, d in self.components]}


def length_dist_from_dict(d: Mapping[str, Any]) -> LengthDist:
    """Rebuild a length distribution from :meth:`LengthDist.to_dict` output.

    Raises
    ------
    ValueError
        Unknown ``kind``.
    """
    kind = d.get("kind")
    if kind == "fixed":
        return Fixed(int(d["value"]))
    if kind == "uniform":
        return Uniform(int(d["low"]), int(d["high"]))
    if kind == "lognormal":
        return LogNormal(float(d["median"]), float(d["sigma"]), int(d["min"]), int(d["max"]))
    if kind == "mixture":
        return Mixture(tuple((float(c["weight"]), length_dist_from_dict(c["dist"])) for c in d["components"]))
    raise ValueError(f"unknown length distribution kind {kind!r}")


def parse_length_dist(spec: str) -> LengthDist:
    """Parse a length distribution from its compact string form.

    Parameters
    ----------
    spec : str
        One of ``"N"`` or ``"fixed:N"``; ``"uniform:LOW:HIGH"``;
        ``"lognormal:MEDIAN:SIGMA:MIN:MAX"``; or a mixture
        ``"W1*SPEC1+W2*SPEC2"`` such as ``"0.8*fixed:128+0.2*fixed:1024"``.

    Returns
    -------
    LengthDist

    Raises
    ------
    ValueError
        Malformed spec.
    """
    s = spec.strip()
    try:
        if "+" in s or "*" in s:
            parts = []
            for term in s.split("+"):
                w, _, sub = term.partition("*")
                if not sub:
                    raise ValueError("each mixture term is WEIGHT*SPEC")
                parts.append((float(w), parse_length_dist(sub)))
            return Mixture(tuple(parts))
        kind, _, rest = s.partition(":")
        args = rest.split(":") if rest else []
        if not rest and kind.isdigit():
            return Fixed(int(kind))
        if kind == "fixed" and len(args) == 1:
            return Fixed(int(args[0]))
        if kind == "uniform" and len(args) == 2:
            return Uniform(int(args[0]), int(args[1]))
        if kind == "lognormal" and len(args) == 4:
            return LogNormal(float(args[0]), float(args[1]), int(args[2]), int(args[3]))
    except ValueError as exc:
        raise ValueError(f"bad length distribution {spec!r}: {exc}") from None
    raise ValueError(
        f"bad length distribution {spec!r}: expected N, fixed:N, uniform:LO:HI, "
        "lognormal:MEDIAN:SIGMA:MIN:MAX or W*SPEC+W*SPEC"
    )


# --------------------------------------------------------------------------------------
# Arrival processes
# --------------------------------------------------------------------------------------


class ArrivalProcess:
    """Inter-arrival times: i.i.d. unit-mean gaps divided by ``rate`` (requests/s).

    The first request arrives at t = 0; request *i* at ``sum(gaps[:i]) / rate``.
    """

    rate: float
    #: Coefficient of variation of the gaps (std / mean): 0 periodic, 1 Poisson, > 1 bursty.
    cv: float

    def unit_gaps(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """Draw ``n`` gaps with mean 1 (seconds at rate 1).

        Returns
        -------
        numpy.ndarray
            ``[n]`` float64, >= 0.
        """
        raise NotImplementedError

    def with_rate(self, rate: float) -> "ArrivalProcess":
        """The same process at another mean rate (requests/s)."""
        return replace(self, rate=rate)  # type: ignore[type-var]

    def spec(self) -> str:
        """Compact string form read by :func:`parse_arrival` (without the rate)."""
        raise NotImplementedError

    def to_dict(self) -> Dict[str, Any]:
        """JSON-serialisable form."""
        return {"kind": self.spec().split(":")[0], "rate": self.rate, "cv": self.cv}


def _check_rate(rate: float) -> None:
    if not (rate > 0 and math.isfinite(rate)):
        raise ValueError(f"arrival rate must be a finite number > 0 requests/s, got {rate!r}")


@dataclass(frozen=True)
class Poisson(ArrivalProcess):
    """Poisson arrivals: exponential gaps, CV 1.

    Parameters
    ----------
    rate : float
        Mean requests per second, > 0.
    """

    rate: float
    cv: ClassVar[float] = 1.0

    def __post_init__(self) -> None:
        _check_rate(self.rate)

    def unit_gaps(self, rng: np.random.Generator, n: int) -> np.ndarray:  # noqa: D102
        return rng.standard_exponential(n)

    def spec(self) -> str:  # noqa: D102
        return "poisson"


@dataclass(frozen=True)
class Gamma(ArrivalProcess):
    """Gamma-distributed gaps with a given coefficient of variation (burstiness).

    Shape ``k = 1 / cv**2``, scale ``1 / (rate * k)``: the mean rate is ``rate``
    whatever the CV. ``cv = 1`` has the law of Poisson arrivals; ``cv = 3`` sends
    most requests in tight bursts separated by long idle gaps.

    Parameters
    ----------
    rate : float
        Mean requests per second, > 0.
    cv : float
        Coefficient of variation of the gaps, > 0.
    """

    rate: float
    cv: float = 2.0

    def __post_init__(self) -> None:
        _check_rate(self.rate)
        if not (self.cv > 0 and math.isfinite(self.cv)):
            raise ValueError(f"gamma CV must be > 0, got {self.cv!r}")

    def unit_gaps(self, rng: np.random.Generator, n: int) -> np.ndarray:  # noqa: D102
        k = 1.0 / (self.cv * self.cv)
        return rng.standard_gamma(k, n) / k

    def spec(self) -> str:  # noqa: D102
        return f"gamma:{self.cv:g}"


@dataclass(frozen=True)
class Periodic(ArrivalProcess):
    """One request exactly every ``1 / rate`` seconds (CV 0).

    Parameters
    ----------
    rate : float
        Requests per second, > 0.
    """

    rate: float
    cv: ClassVar[float] = 0.0

    def __post_init__(self) -> None:
        _check_rate(self.rate)

    def unit_gaps(self, rng: np.random.Generator, n: int) -> np.ndarray:  # noqa: D102
        return np.ones(n)

    def spec(self) -> str:  # noqa: D102
        return "periodic"


def parse_arrival(spec: str, rate: float) -> ArrivalProcess:
    """Parse ``"poisson"``, ``"periodic"`` or ``"gamma:CV"`` into an arrival process.

    Parameters
    ----------
    spec : str
        Process name, with the CV for gamma (``"gamma:2"``).
    rate : float
        Mean requests per second.

    Raises
    ------
    ValueError
        Unknown process or bad parameter.
    """
    kind, _, arg = spec.strip().partition(":")
    if kind == "poisson" and not arg:
        return Poisson(rate)
    if kind == "periodic" and not arg:
        return Periodic(rate)
    if kind == "gamma":
        return Gamma(rate, float(arg) if arg else 2.0)
    raise ValueError(f"bad arrival process {spec!r}: expected poisson, periodic or gamma:CV")


def arrival_from_dict(d: Mapping[str, Any]) -> ArrivalProcess:
    """Rebuild an arrival process from :meth:`ArrivalProcess.to_dict` output."""
    kind = d.get("kind")
    if kind == "gamma":
        return Gamma(float(d["rate"]), float(d["cv"]))
    return parse_arrival(str(kind), float(d["rate"]))


# --------------------------------------------------------------------------------------
# Traces
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace.

    Attributes
    ----------
    index : int
        Position in the trace (0-based); keys the prompt content and pairs requests
        across runs of the same trace.
    arrival_s : float
        Send time, seconds after the start of the run.
    prompt_len : int
        Prompt length in tokens. For a replayed text prompt without ``prompt_len`` it
        is the whitespace word count (an estimate).
    output_len : int
        Output tokens to request (``max_tokens``).
    prompt : str or list of int or None
        Explicit prompt from a replayed trace; ``None`` for synthetic requests, whose
        prompt is generated from the trace seed (:meth:`Trace.prompt`).
    """

    index: int
    arrival_s: float
    prompt_len: int
    output_len: int
    prompt: Optional[Prompt] = None

    def to_dict(self) -> Dict[str, Any]:
        """The JSONL record (``timestamp``, ``prompt_len``, ``output_len`` and ``prompt`` if set)."""
        d: Dict[str, Any] = {"timestamp": self.arrival_s, "prompt_len": self.prompt_len, "output_len": self.output_len}
        if self.prompt is not None:
            d["prompt"] = self.prompt
        return d


@dataclass(frozen=True)
class Trace:
    """An ordered list of requests plus how it was made.

    Attributes
    ----------
    requests : tuple of TraceRequest
        Sorted by arrival time, indices ``0..n-1``.
    seed : int
        Seed of the prompt content (and of the synthetic draws).
    info : dict
        JSON-serialisable provenance: preset, spec, rate, duration, source file.
    """

    requests: Tuple[TraceRequest, ...]
    seed: int = 0
    info: Mapping[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Any:
        return iter(self.requests)

    @property
    def duration_s(self) -> float:
        """Time of the last arrival (s); 0 for an empty trace."""
        return self.requests[-1].arrival_s if self.requests else 0.0

    @property
    def mean_rate(self) -> float:
        """Observed arrival rate ``(n - 1) / (last - first)`` in requests/s (``nan`` if undefined)."""
        if len(self.requests) < 2:
            return float("nan")
        span = self.requests[-1].arrival_s - self.requests[0].arrival_s
        return (len(self.requests) - 1) / span if span > 0 else float("inf")

    def scaled_to_rate(self, rate: float) -> "Trace":
        """Rescale arrival times so that :attr:`mean_rate` becomes ``rate``.

        Lengths and prompts are unchanged; only timestamps are multiplied.

        Raises
        ------
        ValueError
            Fewer than two requests, or all arriving at once.
        """
        _check_rate(rate)
        current = self.mean_rate
        if not (math.isfinite(current) and current > 0):
            raise ValueError("cannot rescale a trace with fewer than two distinct arrival times")
        factor = current / rate
        t0 = self.requests[0].arrival_s
        reqs = tuple(replace(r, arrival_s=(r.arrival_s - t0) * factor) for r in self.requests)
        return Trace(reqs, self.seed, {**self.info, "rate": rate, "rescaled_from": current})

    def prompt(
        self,
        request: TraceRequest,
        *,
        kind: Literal["tokens", "text"] = "tokens",
        vocab_size: int = 1000,
        first_id: int = 100,
    ) -> Prompt:
        """The prompt to send for ``request``.

        Parameters
        ----------
        request : TraceRequest
            A request of this trace.
        kind : {"tokens", "text"}
            Token ids of exactly ``prompt_len`` (:func:`token_prompt`) or text of about
            ``prompt_len`` tokens (:func:`text_prompt`). An explicit replayed prompt is
            returned as is.
        vocab_size, first_id : int
            Token ids are drawn from ``[first_id, vocab_size)``.
        """
        if request.prompt is not None:
            return request.prompt
        if kind == "tokens":
            return token_prompt(
                request.prompt_len, seed=self.seed, index=request.index, vocab_size=vocab_size, first_id=first_id
            )
        if kind == "text":
            return text_prompt(request.prompt_len, seed=self.seed, index=request.index)
        raise ValueError(f"prompt kind must be 'tokens' or 'text', got {kind!r}")


@dataclass(frozen=True)
class TraceSpec:
    """How to generate a synthetic trace.

    Attributes
    ----------
    name : str
        Preset name or a label.
    description : str
        One line for humans.
    arrival : ArrivalProcess
        Arrival process, carrying the default rate.
    prompt_len, output_len : LengthDist
        Token-count distributions.
    """

    name: str
    description: str
    arrival: ArrivalProcess
    prompt_len: LengthDist
    output_len: LengthDist

    @property
    def rate(self) -> float:
        """Default mean rate, requests/s."""
        return self.arrival.rate

    def with_rate(self, rate: float) -> "TraceSpec":
        """The same spec at another mean rate."""
        return replace(self, arrival=self.arrival.with_rate(rate))

    def generate(
        self, *, seed: int = 0, duration_s: Optional[float] = None, num_requests: Optional[int] = None
    ) -> Trace:
        """Shorthand for :func:`generate_trace`."""
        return generate_trace(self, seed=seed, duration_s=duration_s, num_requests=num_requests)

    def to_dict(self) -> Dict[str, Any]:
        """JSON-serialisable form."""
        return {
            "name": self.name,
            "description": self.description,
            "arrival": self.arrival.to_dict(),
            "prompt_len": self.prompt_len.to_dict(),
            "output_len": self.output_len.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TraceSpec":
        """Inverse of :meth:`to_dict`."""
        return cls(
            str(d["name"]),
            str(d.get("description", "")),
            arrival_from_dict(d["arrival"]),
            length_dist_from_dict(d["prompt_len"]),
            length_dist_from_dict(d["output_len"]),
        )


def generate_trace(
    spec: TraceSpec,
    *,
    seed: int = 0,
    duration_s: Optional[float] = None,
    num_requests: Optional[int] = None,
) -> Trace:
    """Generate a deterministic synthetic trace.

    Parameters
    ----------
    spec : TraceSpec
        Arrival process (with its rate) and length distributions.
    seed : int
        Seed; the same ``(spec, seed, duration_s, num_requests)`` gives the same trace.
    duration_s : float, optional
        Keep the requests arriving in ``[0, duration_s)``.
    num_requests : int, optional
        Keep at most this many requests. At least one of the two limits is required;
        with both, whichever is reached first.

    Returns
    -------
    Trace
        Requests sorted by arrival, the first at t = 0.

    Raises
    ------
    ValueError
        Neither limit given, or a limit is negative.

    Examples
    --------
    >>> trace = generate_trace(get_preset("chat-short"), seed=0, num_requests=3)
    >>> [r.index for r in trace], trace.requests[0].arrival_s
    ([0, 1, 2], 0.0)
    >>> trace.requests == generate_trace(get_preset("chat-short"), seed=0, num_requests=3).requests
    True
    """
    if duration_s is None and num_requests is None:
        raise ValueError("give duration_s, num_requests or both")
    if (duration_s is not None and not duration_s >= 0) or (num_requests is not None and num_requests < 0):
        raise ValueError("duration_s and num_requests must be >= 0")
    rate = spec.arrival.rate
    # Arrival times, block by block, until a limit is reached.
    times: List[np.ndarray] = []
    t_next, count, block = 0.0, 0, 0
    while True:
        gaps = spec.arrival.unit_gaps(_block_rng(seed, _STREAM_ARRIVAL, block), BLOCK) / rate
        # Request i arrives after gaps[0..i-1]: the first of the whole trace at t = 0.
        t = t_next + np.concatenate(([0.0], np.cumsum(gaps[:-1])))
        t_next = float(t[-1] + gaps[-1])
        times.append(t)
        count += BLOCK
        block += 1
        if num_requests is not None and count >= num_requests:
            break
        if duration_s is not None and t_next >= duration_s:
            break
    arrivals = np.concatenate(times)
    if duration_s is not None:
        arrivals = arrivals[arrivals < duration_s]
    if num_requests is not None:
        arrivals = arrivals[:num_requests]
    n = len(arrivals)
    prompt_lens = _blocked(seed, _STREAM_PROMPT_LEN, n, spec.prompt_len.sample)
    output_lens = _blocked(seed, _STREAM_OUTPUT_LEN, n, spec.output_len.sample)
    reqs = tuple(
        TraceRequest(i, float(arrivals[i]), int(prompt_lens[i]), int(output_lens[i])) for i in range(n)
    )
    info = {
        "preset": spec.name,
        "spec": spec.to_dict(),
        "seed": seed,
        "rate": rate,
        "duration_s": duration_s,
        "num_requests": num_requests,
    }
    return Trace(reqs, seed, info)


# --------------------------------------------------------------------------------------
# Prompt content
# --------------------------------------------------------------------------------------

# Short, frequent English words: with a leading space, most are a single token in
# common BPE vocabularies (GPT-2, Llama, Mistral, Qwen, SmolLM).
_WORDS = (
    "the of and to in is was for on that with as by at from his it an were are which this be has had "
    "not but he one or all their new first two its they time after there been who more year also may "
    "over other most some made when many about city can used would out state only world then her into "
    "during she these like such school known under being family work film about part around team since "
    "while both same three well through life later high left music early main game name place back "
    "house north south east west day group each very where last found small large number between what "
    "water light night river great long good old best land road book war line end power"
).split()


def token_prompt(
    length: int, *, seed: int = 0, index: int = 0, vocab_size: int = 1000, first_id: int = 100
) -> List[int]:
    """Deterministic token ids, exactly ``length`` of them.

    Parameters
    ----------
    length : int
        Number of ids, >= 0.
    seed, index : int
        Content key: the same ``(seed, index)`` gives the same ids; different indices
        give different prompts (no shared prefix for a prefix cache to exploit).
    vocab_size, first_id : int
        Ids are uniform on ``[first_id, vocab_size)``. The defaults are valid and
        avoid special tokens in every common vocabulary (ids 100..999).

    Returns
    -------
    list of int
    """
    if not 0 <= first_id < vocab_size:
        raise ValueError(f"need 0 <= first_id < vocab_size, got {first_id}, {vocab_size}")
    rng = np.random.default_rng([int(seed) & 0xFFFFFFFFFFFFFFFF, _STREAM_PROMPT_CONTENT, int(index)])
    return rng.integers(first_id, vocab_size, size=length).tolist()


def text_prompt(length: int, *, seed: int = 0, index: int = 0) -> str:
    """Deterministic English-like text of about ``length`` tokens.

    ``length`` space-separated common words; most tokenizers give one token per word,
    so the prompt is usually close to ``length`` tokens (the server's
    ``usage.prompt_tokens`` reports the exact count).

    Parameters
    ----------
    length : int
        Number of words, >= 0.
    seed, index : int
        Content key, as in :func:`token_prompt`.

    Returns
    -------
    str
    """
    rng = np.random.default_rng([int(seed) & 0xFFFFFFFFFFFFFFFF, _STREAM_PROMPT_CONTENT, int(index)])
    picks = rng.integers(0, len(_WORDS), size=length)
    return " ".join(_WORDS[i] for i in picks)


# --------------------------------------------------------------------------------------
# JSONL
# --------------------------------------------------------------------------------------


def save_trace(trace: Union[Trace, Iterable[TraceRequest]], path: Union[str, "os.PathLike[str]"]) -> None:
    """Write a trace as JSONL (one :meth:`TraceRequest.to_dict` per line)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in trace:
            f.write(json.dumps(r.to_dict()) + "\n")


def _first(d: Mapping[str, Any], *keys: str) -> Any:
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    return None


def load_trace(
    path: Union[str, "os.PathLike[str]"],
    *,
    time_scale: float = 1.0,
    seed: int = 0,
    default_output_len: Optional[int] = None,
) -> Trace:
    """Read a JSONL trace for replay.

    Parameters
    ----------
    path : path-like
        One JSON object per line; blank lines are skipped.
    time_scale : float
        Multiplies ``timestamp`` to get seconds (0.001 for milliseconds).
    seed : int
        Seed for prompts generated from ``prompt_len`` (lines without ``prompt``).
    default_output_len : int, optional
        Used when a line has no ``output_len``; otherwise that line is an error.

    Returns
    -------
    Trace
        Sorted by timestamp (stable), shifted so the first request is at t = 0,
        re-indexed ``0..n-1``.

    Raises
    ------
    ValueError
        A line that is not a JSON object or lacks a required field (message names the line).
    """
    rows: List[Tuple[float, int, TraceRequest]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                if not isinstance(d, dict):
                    raise ValueError("not a JSON object")
                ts = _first(d, "timestamp", "arrival_s", "time")
                if ts is None:
                    raise ValueError("missing 'timestamp'")
                prompt = d.get("prompt")
                if prompt is not None and not (
                    isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))
                ):
                    raise ValueError("'prompt' must be text or a list of token ids")
                plen = _first(d, "prompt_len", "input_length", "prompt_tokens")
                if plen is None:
                    if prompt is None:
                        raise ValueError("needs 'prompt_len' or 'prompt'")
                    plen = len(prompt) if isinstance(prompt, list) else len(prompt.split())
                olen = _first(d, "output_len", "output_length", "max_tokens")
                if olen is None:
                    if default_output_len is None:
                        raise ValueError("missing 'output_len'")
                    olen = default_output_len
                if int(olen) < 1 or int(plen) < 0:
                    raise ValueError("output_len must be >= 1 and prompt_len >= 0")
            except (ValueError, TypeError, KeyError) as exc:
                raise ValueError(f"{path}:{lineno}: {exc}") from None
            rows.append((float(ts) * time_scale, lineno, TraceRequest(0, 0.0, int(plen), int(olen), prompt)))
    rows.sort(key=lambda r: (r[0], r[1]))
    t0 = rows[0][0] if rows else 0.0
    reqs = tuple(replace(r, index=i, arrival_s=ts - t0) for i, (ts, _, r) in enumerate(rows))
    return Trace(reqs, seed, {"source": os.fspath(path), "time_scale": time_scale, "seed": seed})


# --------------------------------------------------------------------------------------
# Cost model and presets
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CostModel:
    """A first-order cost model of one serving core, for sizing presets.

    Defaults are the issue-6 measurements of a ~40M-parameter Llama on one pinned CPU
    core: a 1024-token prefill takes ~0.8 s, a decode step for 8 requests ~50 ms.

    Attributes
    ----------
    prefill_s_per_token : float
        Prefill seconds per prompt token (linear; attention is negligible at this size).
    decode_step_s : float
        Seconds per decode step of a full batch.
    decode_batch : int
        Requests per decode step at that cost. Lower concurrency makes each token
        dearer, so :func:`utilisation` is a lower bound.
    """

    prefill_s_per_token: float = 0.8 / 1024
    decode_step_s: float = 0.050
    decode_batch: int = 8

    def request_cost_s(self, prompt_len: float, output_len: float) -> float:
        """Core-seconds for one request; the first output token comes from prefill."""
        decode_tokens = max(output_len - 1.0, 0.0)
        return prompt_len * self.prefill_s_per_token + decode_tokens * self.decode_step_s / self.decode_batch


def utilisation(
    spec: TraceSpec, *, rate: Optional[float] = None, cores: int = 1, model: CostModel = CostModel()
) -> float:
    """Expected busy fraction of ``cores`` cores serving ``spec`` at ``rate``.

    Parameters
    ----------
    spec : TraceSpec
        Trace parameters (mean lengths are exact, see :meth:`LengthDist.mean`).
    rate : float, optional
        Requests/s; the spec's rate by default.
    cores : int
        Cores sharing the load perfectly.
    model : CostModel
        Per-token costs.

    Returns
    -------
    float
        ``rate * cost(mean prompt, mean output) / cores``; 1.0 is saturation.
    """
    r = spec.rate if rate is None else rate
    return r * model.request_cost_s(spec.prompt_len.mean(), spec.output_len.mean()) / cores


def saturation_rate(spec: TraceSpec, *, cores: int = 1, model: CostModel = CostModel()) -> float:
    """Request rate (requests/s) at which :func:`utilisation` reaches 1."""
    return cores / model.request_cost_s(spec.prompt_len.mean(), spec.output_len.mean())


_SHORT_PROMPT = LogNormal(128, 0.5, 16, 512)
_LONG_PROMPT = LogNormal(1024, 0.25, 512, 2048)

#: Named trace specs; see the module docstring for their load on the reference core.
PRESETS: Mapping[str, TraceSpec] = {
    s.name: s
    for s in (
        TraceSpec(
            "chat-short",
            "Chat turns: short prompts (median 128 tokens) and short answers (median 48), Poisson.",
            Poisson(1.0),
            _SHORT_PROMPT,
            LogNormal(48, 0.5, 8, 256),
        ),
        TraceSpec(
            "rag-long",
            "Retrieval-augmented: long prompts (median 1024 tokens) with short answers (median 48), Poisson.",
            Poisson(0.4),
            _LONG_PROMPT,
            LogNormal(48, 0.5, 16, 192),
        ),
        TraceSpec(
            "mixed",
            "80% chat prompts (median 128) and 20% long documents (median 1024), answers median 64, Poisson.",
            Poisson(0.6),
            Mixture(((0.8, _SHORT_PROMPT), (0.2, _LONG_PROMPT))),
            LogNormal(64, 0.6, 8, 256),
        ),
        TraceSpec(
            "prefill-heavy",
            "Long prompts (512-1536, mean 1024) with very short answers (16-64): prefill dominates, Poisson.",
            Poisson(0.5),
            Uniform(512, 1536),
            Uniform(16, 64),
        ),
        TraceSpec(
            "chat-bursty",
            "chat-short arriving in bursts: gamma gaps with CV 3 at the same mean rate.",
            Gamma(1.0, 3.0),
            _SHORT_PROMPT,
            LogNormal(48, 0.5, 8, 256),
        ),
    )
}


def get_preset(name: str) -> TraceSpec:
    """Look up a preset by name.

    Raises
    ------
    ValueError
        Unknown name (the message lists the presets).
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}") from None
