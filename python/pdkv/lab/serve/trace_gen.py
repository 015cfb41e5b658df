"""Traces and their synthetic generation: :class:`TraceRequest`, :class:`Trace`,
:class:`TraceSpec` and :func:`generate_trace`.

A synthetic trace is a pure function of its spec and seed; see the determinism
section of :mod:`pdkv.lab.serve.trace`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Literal, Mapping, Optional, Tuple

import numpy as np

from pdkv.lab.serve.trace_dist import ArrivalProcess, LengthDist, arrival_from_dict, check_rate, length_dist_from_dict
from pdkv.lab.serve.trace_prompts import Prompt, text_prompt, token_prompt
from pdkv.lab.serve.trace_rng import (
    BLOCK,
    STREAM_ARRIVAL,
    STREAM_OUTPUT_LEN,
    STREAM_PROMPT_LEN,
    blocked,
    stream_rng,
)

__all__ = ["Trace", "TraceRequest", "TraceSpec", "generate_trace"]


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
        check_rate(rate)
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
    >>> from pdkv.lab.serve.trace import get_preset
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
        gaps = spec.arrival.unit_gaps(stream_rng(seed, STREAM_ARRIVAL, block), BLOCK) / rate
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
    prompt_lens = blocked(seed, STREAM_PROMPT_LEN, n, spec.prompt_len.sample)
    output_lens = blocked(seed, STREAM_OUTPUT_LEN, n, spec.output_len.sample)
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
