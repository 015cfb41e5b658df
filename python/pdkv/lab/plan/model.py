"""``pdkv plan``: the prefill:decode split for a trace and an SLO, from measured capacity.

Disaggregated serving only pays off when the two pools are rate-matched: prefill
workers that cannot keep up queue every request's first token, decode workers that
cannot keep up stretch every gap between tokens, and a pool larger than its share of
the load idles. This module turns two measured per-worker facts into a split:

* **prefill**: seconds to prefill a prompt of ``L`` tokens on one worker, fitted as
  ``prefill_fixed_s + L * prefill_s_per_token`` (so its capacity in prompt tokens/s
  depends on the trace's prompt lengths);
* **decode**: seconds per decode step with ``B`` requests in the batch, fitted as
  ``step_fixed_s + B * step_per_seq_s`` (one token per request per step, so a worker
  decodes ``B / step(B)`` tokens/s at inter-token latency ``step(B)``).

The capacities (:class:`pdkv.serving.capacity.Capacity`) come from
:mod:`pdkv.lab.plan.measure` (timed on this machine with the reference engine, or
derived from a ``pdkv bench serve`` results directory); :mod:`pdkv.lab.plan.cli` is
the command.

The queueing arithmetic (each function below says which formula it uses):

* Prefill pool of ``n`` workers at ``rate`` requests/s: each worker gets ``rate / n``
  (a random split; the proxy's least-loaded routing does better, so this is
  conservative) and is an M/G/1 queue: utilisation ``rho = rate/n * E[S]``, mean wait
  ``Wq = rate/n * E[S^2] / (2 (1 - rho))`` (Pollaczek-Khinchine), and the wait's tail
  taken exponential: ``P(wait > t) = rho * exp(-t rho / Wq)``, so its p90 is
  ``Wq / rho * ln(10 rho)`` (0 when ``rho <= 0.1``). TTFT p90 is estimated as the
  p90 prompt's service time plus that wait plus ``ttft_overhead_s`` (proxy and KV hop).
* Decode pool of ``n`` workers: each decodes ``D = rate/n * E[output - 1]`` tokens/s
  (the first token comes from prefill). By Little's law the batch settles where
  ``B / step(B) = D``, i.e. ``B = D a / (1 - D b)`` for ``step = a + b B``; ITL is
  ``step(B)``. Capacity under the ITL objective is ``B* / step(B*)`` with ``B*`` the
  largest batch whose step meets it (and at most ``max_decode_batch``).

Prefix reuse: with a prefix cache, a prompt's cached leading blocks are neither
computed nor moved. ``Workload.prefix_hit_rate`` ``F`` (measured by ``pdkv bench
serve``'s ``prefix_hit_rate``, or a guess) scales every prompt's computed tokens to
``(1 - F) L`` in the prefill pool's service time, and the KV each request moves from
prefill to decode likewise (:func:`recommend` reports both per request). A uniform
scale is the simplest model that keeps the measured total: the computed tokens of the
trace are exactly ``(1 - F)`` of those sent.

A split is **throughput-bound** when the smallest pool that keeps up (``rho < 1``)
also meets the objective, **SLO-bound** when latency needs more workers than
throughput does. Integer worker counts waste capacity; :func:`recommend` reports each
pool's utilisation for the recommended split and its neighbours, and for a fixed
budget of ``N`` workers (:func:`best_split`) the highest rate each split sustains and
what the integer split loses against the ideal fractional one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Optional

from pdkv.errors import InvalidArgument
from pdkv.serving.capacity import Capacity

__all__ = ["Capacity", "PoolLoad", "SplitPrediction", "Workload", "best_split", "predict", "recommend"]

#: Pools are never sized beyond this many workers (a search bound, not a limit of pdkv).
MAX_WORKERS = 256
#: Utilisations this close to 1 count as saturated (10 req/s * 0.1 s is 0.9999999999999997).
_EPS = 1e-9


@dataclass(frozen=True)
class Workload:
    """What the trace asks of the pools.

    Attributes
    ----------
    rate : float
        Requests/s.
    prompt_lens, output_lens : tuple of int
        The trace's lengths (a sample of its distributions); only their moments and p90
        are used.
    prefix_hit_rate : float
        Share of the prompt tokens a prefix cache serves (not computed, not moved), in
        ``[0, 1)``; 0: no reuse.
    """

    rate: float
    prompt_lens: tuple[int, ...]
    output_lens: tuple[int, ...]
    prefix_hit_rate: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rate) and self.rate > 0):
            raise InvalidArgument(f"the trace's rate must be > 0 requests/s, got {self.rate!r}")
        if not self.prompt_lens or len(self.prompt_lens) != len(self.output_lens):
            raise InvalidArgument("the workload needs prompt and output lengths of the same, non-zero, count")
        if min(self.output_lens) < 1 or min(self.prompt_lens) < 1:
            raise InvalidArgument("prompt and output lengths must be >= 1")
        f = self.prefix_hit_rate
        if not (isinstance(f, (int, float)) and math.isfinite(f) and 0 <= f < 1):
            raise InvalidArgument(f"the prefix hit rate must be in [0, 1), got {f!r}")

    @classmethod
    def of_trace(cls, trace: Any, rate: Optional[float] = None, prefix_hit_rate: float = 0.0) -> "Workload":
        """From a :class:`~pdkv.lab.serve.trace.Trace` (``rate``: its nominal rate, else the
        observed one), or a :class:`~pdkv.lab.serve.trace_sessions.SessionTrace` (its turns
        are the requests; ``rate`` is sessions/s, turned into requests/s with the mean
        turns per session)."""
        sessions = getattr(trace, "sessions", None)
        if sessions is not None:
            turns = [t for s in sessions for t in s.turns]
            if not turns:
                raise InvalidArgument("the session trace is empty")
            per_s = (rate if rate is not None else float(trace.info.get("session_rate") or 0)) * len(turns) / len(
                sessions)
            return cls(float(per_s), tuple(max(t.prompt_len, 1) for t in turns), tuple(t.output_len for t in turns),
                       prefix_hit_rate)
        reqs = list(trace)
        if not reqs:
            raise InvalidArgument("the trace is empty")
        r = rate if rate is not None else trace.mean_rate
        return cls(float(r), tuple(max(int(q.prompt_len), 1) for q in reqs), tuple(int(q.output_len) for q in reqs),
                   prefix_hit_rate)

    def with_prefix_hit_rate(self, rate: float) -> "Workload":
        return replace(self, prefix_hit_rate=rate)

    def computed(self, prompt_len: float) -> float:
        """Prompt tokens the prefill pool computes for a prompt of ``prompt_len`` (the rest hit the cache)."""
        return prompt_len * (1 - self.prefix_hit_rate)

    def with_rate(self, rate: float) -> "Workload":
        return replace(self, rate=rate)

    @property
    def mean_decode_tokens(self) -> float:
        """Tokens per request the decode pool produces (the first one comes from prefill)."""
        return sum(o - 1 for o in self.output_lens) / len(self.output_lens)

    @property
    def mean_prompt(self) -> float:
        return sum(self.prompt_lens) / len(self.prompt_lens)

    def p90_prompt(self) -> float:
        s = sorted(self.prompt_lens)
        return float(s[min(len(s) - 1, int(math.ceil(0.9 * len(s))) - 1)])


@dataclass(frozen=True)
class PoolLoad:
    """One pool's predicted state.

    Attributes
    ----------
    workers : int (a float for the fractional sizing)
    utilisation : float
        Busy fraction of each worker (prefill: ``rho``; decode: tokens/s demanded over
        its throughput with a full batch).
    latency_p90_s : float
        Prefill: estimated TTFT p90; decode: estimated ITL (``inf`` if it cannot keep up).
    meets_slo : bool
    """

    workers: float
    utilisation: float
    latency_p90_s: float
    meets_slo: bool


def prefill_pool(cap: Capacity, load: Workload, workers: float, ttft_slo_s: float, overhead_s: float = 0.0) -> PoolLoad:
    """The prefill pool's utilisation and TTFT p90 (M/G/1 per worker, see the module docstring)."""
    lam = load.rate / workers
    services = [cap.prefill_s(load.computed(p)) for p in load.prompt_lens]
    es = sum(services) / len(services)
    es2 = sum(s * s for s in services) / len(services)
    rho = lam * es
    if rho >= 1 - _EPS:
        return PoolLoad(workers, rho, math.inf, False)
    wq = lam * es2 / (2 * (1 - rho))
    wait_p90 = wq / rho * math.log(10 * rho) if rho > 0.1 else 0.0
    ttft = cap.prefill_s(load.computed(load.p90_prompt())) + wait_p90 + overhead_s
    return PoolLoad(workers, rho, ttft, ttft <= ttft_slo_s)


def decode_pool(cap: Capacity, load: Workload, workers: float, itl_slo_s: float) -> PoolLoad:
    """The decode pool's utilisation (against a full batch's throughput) and ITL
    (Little's law on a linear step time)."""
    demand = load.rate / workers * load.mean_decode_tokens  # tokens/s per worker
    util = demand / cap.decode_tok_s_max()
    if demand * cap.step_per_seq_s >= 1:
        return PoolLoad(workers, util, math.inf, False)
    batch = demand * cap.step_fixed_s / (1 - demand * cap.step_per_seq_s)
    if batch > cap.max_decode_batch:
        return PoolLoad(workers, util, math.inf, False)
    itl = cap.step_s(max(batch, 1.0))
    return PoolLoad(workers, util, itl, itl <= itl_slo_s)


@dataclass(frozen=True)
class SplitPrediction:
    """A ``prefill:decode`` split and its predicted pools."""

    prefill: PoolLoad
    decode: PoolLoad

    @property
    def label(self) -> str:
        return f"{self.prefill.workers}:{self.decode.workers}"

    @property
    def meets_slo(self) -> bool:
        return self.prefill.meets_slo and self.decode.meets_slo

    def to_dict(self) -> dict[str, Any]:
        return {"split": self.label, "meets_slo": self.meets_slo, "prefill": _finite(asdict(self.prefill)),
                "decode": _finite(asdict(self.decode))}


def _finite(d: dict[str, Any]) -> dict[str, Any]:
    """JSON has no infinity: unbounded values become None."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


@dataclass(frozen=True)
class Slo:
    """The objective the split must meet (p90 TTFT and p90 ITL, seconds)."""

    ttft_s: float
    itl_s: float
    ttft_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.itl_s > 0 and self.ttft_overhead_s >= 0):
            raise InvalidArgument(f"SLO times must be > 0 (overhead >= 0), got {self}")


def predict(cap: Capacity, load: Workload, slo: Slo, num_prefill: int, num_decode: int) -> SplitPrediction:
    """Both pools of the split ``num_prefill:num_decode`` at the workload's rate."""
    if num_prefill < 1 or num_decode < 1:
        raise InvalidArgument(f"a split needs at least one worker per pool, got {num_prefill}:{num_decode}")
    return SplitPrediction(prefill_pool(cap, load, num_prefill, slo.ttft_s, slo.ttft_overhead_s),
                           decode_pool(cap, load, num_decode, slo.itl_s))


def _smallest(fits: Any) -> Optional[int]:
    return next((n for n in range(1, MAX_WORKERS + 1) if fits(n)), None)


def _fractional(fits: Any) -> float:
    """The smallest real ``n`` for which ``fits(n)`` holds (``fits`` is monotone in
    ``n``; bisection), ``inf`` if not even MAX_WORKERS fit."""
    if not fits(float(MAX_WORKERS)):
        return math.inf
    lo, hi = 0.0, float(MAX_WORKERS)
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


@dataclass(frozen=True)
class PoolSizing:
    """The smallest pool that keeps up, the smallest that meets the SLO, and which binds."""

    throughput_workers: Optional[int]  # smallest n with utilisation < 1
    slo_workers: Optional[int]         # smallest n that meets the objective
    ideal: float                       # the fractional n that meets it exactly (rate-matched)

    @property
    def bound(self) -> str:
        if self.slo_workers is None:
            return "infeasible"
        return "slo" if self.throughput_workers is not None and self.slo_workers > self.throughput_workers \
            else "throughput"


def _sizing(pool: Any) -> PoolSizing:
    return PoolSizing(_smallest(lambda n: pool(n).utilisation < 1 - _EPS), _smallest(lambda n: pool(n).meets_slo),
                      _fractional(lambda n: pool(n).meets_slo))


def size_pools(cap: Capacity, load: Workload, slo: Slo) -> tuple[PoolSizing, PoolSizing]:
    """(prefill, decode) sizings for the workload's rate."""
    return (_sizing(lambda n: prefill_pool(cap, load, n, slo.ttft_s, slo.ttft_overhead_s)),
            _sizing(lambda n: decode_pool(cap, load, n, slo.itl_s)))


def recommend(cap: Capacity, load: Workload, slo: Slo) -> dict[str, Any]:
    """The smallest split meeting ``slo`` at the workload's rate, with each pool's
    sizing, the utilisation of the recommended split and of its neighbours, and the
    capacity the integer counts leave idle."""
    pre, dec = size_pools(cap, load, slo)
    out: dict[str, Any] = {"rate": load.rate, "ideal_prefill_workers": pre.ideal, "ideal_decode_workers": dec.ideal,
                           "prefill_bound": pre.bound, "decode_bound": dec.bound,
                           "prefill_tok_s_per_worker": load.mean_prompt / (
                               sum(cap.prefill_s(load.computed(p)) for p in load.prompt_lens) / len(load.prompt_lens)),
                           "decode_tok_s_per_worker": cap.decode_tok_s(slo.itl_s),
                           "prefix_hit_rate": load.prefix_hit_rate,
                           "prompt_tokens_per_request": load.mean_prompt,
                           "computed_prompt_tokens_per_request": load.computed(load.mean_prompt),
                           # prefill -> decode: the blocks the decode worker lacks (the cached prefix stays put)
                           "kv_tokens_moved_per_request": load.computed(load.mean_prompt)}
    if pre.slo_workers is None or dec.slo_workers is None:
        out["split"] = None
        out["why"] = ("no prefill pool meets the TTFT objective" if pre.slo_workers is None else
                      "no decode pool meets the ITL objective")
        return out
    p, d = pre.slo_workers, dec.slo_workers
    out["split"] = f"{p}:{d}"
    out["recommended"] = predict(cap, load, slo, p, d).to_dict()
    neighbours = [(p + dp, d + dd) for dp, dd in ((-1, 0), (1, 0), (0, -1), (0, 1), (-1, 1), (1, -1))
                  if p + dp >= 1 and d + dd >= 1]
    out["neighbours"] = [predict(cap, load, slo, a, b).to_dict() for a, b in neighbours]
    # What rounding each pool up to whole workers costs: capacity provisioned beyond
    # the exactly rate-matched fractional pools.
    out["integer_loss"] = 1 - (pre.ideal + dec.ideal) / (p + d)
    return out


def max_rate(cap: Capacity, load: Workload, slo: Slo, num_prefill: int, num_decode: int) -> float:
    """The highest rate (requests/s, same lengths) the split sustains within ``slo``
    (bisection; 0 when it cannot meet it at any rate)."""
    ok = lambda r: predict(cap, load.with_rate(r), slo, num_prefill, num_decode).meets_slo  # noqa: E731
    lo, hi = 0.0, load.rate
    while ok(hi):
        lo, hi = hi, hi * 2
        if hi > 1e9:
            return math.inf
    if lo == 0.0 and not ok(hi * 1e-6):
        return 0.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def fractional_max_rate(cap: Capacity, load: Workload, slo: Slo, workers: float) -> float:
    """The highest rate at which exactly rate-matched fractional pools of ``workers``
    in all meet ``slo`` (what no integer split can beat; bisection)."""
    def fits(r: float) -> bool:
        pre, dec = size_pools(cap, load.with_rate(r), slo)
        return pre.ideal + dec.ideal <= workers

    lo, hi = 0.0, load.rate
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > 1e9:
            return math.inf
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def best_split(cap: Capacity, load: Workload, slo: Slo, workers: int) -> dict[str, Any]:
    """For a budget of ``workers`` (>= 2): every split's highest sustainable rate, the
    best split, and what its integer counts lose against the fractional optimum."""
    if workers < 2:
        raise InvalidArgument(f"a disaggregated budget needs at least 2 workers, got {workers}")
    rows = []
    for p in range(1, workers):
        r = max_rate(cap, load, slo, p, workers - p)
        at = predict(cap, load, slo, p, workers - p).to_dict()
        rows.append({"split": f"{p}:{workers - p}", "max_rate": r, "at_trace_rate": at})
    best = max(rows, key=lambda x: x["max_rate"])
    fractional = fractional_max_rate(cap, load, slo, workers)
    return {"workers": workers, "splits": rows, "best": best["split"], "best_max_rate": best["max_rate"],
            "fractional_max_rate": fractional,
            "integer_loss": 1 - best["max_rate"] / fractional if 0 < fractional < math.inf else None}
