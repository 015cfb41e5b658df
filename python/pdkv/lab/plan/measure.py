"""Per-worker prefill and decode capacity for :mod:`pdkv.lab.plan.model`.

Two sources:

:func:`measure`
    Times the reference engine (what a ``pdkv serve prefill|decode`` worker runs) in
    this process on one pinned thread, the way one worker uses one core: prefill-only
    requests at the trace's prompt lengths (its 10th, 50th, 90th percentiles and
    maximum), and decode steps at batch sizes 1, 2, 4, 8, 16 at the trace's mean
    context (prompt plus half the output). Each point is the
    fastest of a few repeats (other load on the machine only ever adds time); the
    fits are least squares, clamped to non-negative coefficients.
:func:`from_results`
    Derives the same fits from the disaggregated runs of a ``pdkv bench serve``
    results directory (client-side timelines, so HTTP and KV-hop costs are included):
    prefill from the requests that queued least (the quarter with the lowest
    TTFT per prompt token), decode from each run's mean decode batch per worker
    (request-seconds of decoding over the run's span, Little's law) against its
    median inter-token latency. One run gives one decode point: the step is then
    taken as independent of the batch, which overestimates large batches. A run with
    a measured prefix hit rate ``F`` (``pdkv bench serve --prefix-cache``) computed only
    ``(1 - F)`` of its prompt tokens: its prefill points count that many tokens.
:func:`prefix_hit_rate_from_results`
    The measured prefix hit rate of a results file, for ``pdkv plan --prefix-hit-rate``.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from pathlib import Path
from typing import Any, Sequence

from pdkv.errors import InvalidArgument
from pdkv.lab.plan.model import Workload
from pdkv.lab.serve.metrics import BenchResults
from pdkv.serving.capacity import Capacity

__all__ = ["fit_line", "from_results", "measure", "prefix_hit_rate_from_results"]


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares ``y = a + b x`` with ``a, b >= 0`` (one point: ``b = 0``)."""
    if not xs or len(xs) != len(ys):
        raise InvalidArgument("fit_line needs the same, non-zero, number of x and y values")
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    b = max(b, 0.0)
    a = my - b * mx
    if a < 0:  # through the origin instead
        a = 0.0
        sx2 = sum(x * x for x in xs)
        b = sum(x * y for x, y in zip(xs, ys)) / sx2 if sx2 > 0 else my
    return a, b


def _quantile_lengths(lens: Sequence[int], limit: int) -> list[int]:
    s = sorted(lens)
    picks = {s[int(q * (len(s) - 1))] for q in (0.1, 0.5, 0.9)} | {s[-1]}
    return sorted(min(max(p, 1), limit) for p in picks)


def measure(model_dir: str | Path, load: Workload, *, max_decode_batch: int = 64, repeats: int = 3,
            dtype: str = "float32", seed: int = 0) -> Capacity:
    """Times one worker's prefill and decode on this machine (see the module docstring)."""
    import torch

    from pdkv.serving.engine import Engine, EngineConfig
    from pdkv.serving.models import load_model, pin_threads
    from pdkv.serving.sampling import SamplingParams

    pin_threads(1)
    model = load_model(model_dir, dtype=dtype)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    max_len = int(getattr(model.config, "max_position_embeddings", 4096))
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(min(100, vocab - 1), vocab) for _ in range(n)]

    lengths = _quantile_lengths(load.prompt_lens, max_len - 2)
    longest = max(lengths)
    points: dict[str, Any] = {"prefill": [], "decode": []}
    with torch.inference_mode():
        eng = Engine(model, EngineConfig(num_blocks=longest // 16 + 4, block_tokens=16, max_batch_tokens=longest,
                                         num_threads=1))
        eng.generate([prompt(8)], SamplingParams(max_tokens=1))  # warm-up
        for n in lengths:
            best = math.inf
            for _ in range(repeats):
                t = time.perf_counter()
                eng.generate([prompt(n)], SamplingParams(max_tokens=1))
                best = min(best, time.perf_counter() - t)
            points["prefill"].append([n, best])
        context = int(min(load.mean_prompt + sum(load.output_lens) / len(load.output_lens) / 2, max_len - 64))
        for b in _decode_batches(max_decode_batch):
            points["decode"].append([b, _decode_step_s(Engine, EngineConfig, SamplingParams, model, prompt, b,
                                                       context, repeats)])
    pa, pb = fit_line([p[0] for p in points["prefill"]], [p[1] for p in points["prefill"]])
    da, db = fit_line([p[0] for p in points["decode"]], [p[1] for p in points["decode"]])
    return Capacity(pa, pb, da, db, max_decode_batch, source=f"measured: {Path(model_dir).name}, 1 thread",
                    points=points)


def _decode_batches(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16 (at most ``max_batch``): the step time is linear in the batch, so
    the fit extrapolates to the batch the ITL objective allows."""
    return [b for b in (1, 2, 4, 8, 16) if b <= max_batch] or [1]


def _decode_step_s(Engine: Any, EngineConfig: Any, SamplingParams: Any, model: Any, prompt: Any, batch: int,
                   context: int, repeats: int) -> float:
    """Fastest decode-only step of ``batch`` requests at ``context`` tokens."""
    steps = 4 + 2 * repeats
    eng = Engine(model, EngineConfig(num_blocks=batch * ((context + steps + 32) // 16 + 1) + 4, block_tokens=16,
                                     max_batch_tokens=max(context, 64) * batch, max_num_seqs=batch, num_threads=1))
    params = SamplingParams(max_tokens=steps + 4, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"d{i}", prompt(context), params)
    while eng.num_waiting:
        eng.step()
    eng.step()  # every request decodes from here on
    times = []
    for _ in range(2 * repeats):
        t = time.perf_counter()
        st = eng.step()
        dt = time.perf_counter() - t
        if st is not None and st.num_prefill_tokens == 0 and st.num_decode_tokens == batch:
            times.append(dt)
    for i in range(batch):
        eng.abort(f"d{i}")
    eng.run_until_idle()
    if not times:
        raise InvalidArgument(f"no decode-only step of {batch} requests could be timed")
    return min(times)


def from_results(results_dir: Path, *, max_decode_batch: int = 64) -> Capacity:
    """Capacity from the disagg/hybrid runs of a ``pdkv bench serve`` results directory."""

    path, results = _load(results_dir, "--from-results")
    runs = [r for r in results.runs if r.pd_ratio and r.mode in ("disagg", "hybrid")]
    if not runs:
        raise InvalidArgument(f"{path} has no disaggregated run (mode disagg or hybrid with a P:D ratio)")
    per_token: list[tuple[float, int, float]] = []
    decode_points: list[list[float]] = []
    for run in runs:
        ok = [rec for rec in run.records if rec.ok and rec.prompt_len > 0]
        keep = 1 - float((run.prefix or {}).get("prefix_hit_rate") or 0.0)  # share of prompt tokens computed
        per_token += [(rec.ttft_s / max(rec.prompt_len * keep, 1.0), max(rec.prompt_len * keep, 1.0), rec.ttft_s)
                      for rec in ok]
        num_decode = int(str(run.pd_ratio).split(":")[1])
        point = _decode_point(ok, num_decode)
        if point is not None:
            decode_points.append(point)
    if len(per_token) < 4 or not decode_points:
        raise InvalidArgument(f"{path}: too few successful disaggregated requests to derive capacity")
    least_queued = sorted(per_token)[: max(4, len(per_token) // 4)]
    pa, pb = fit_line([x[1] for x in least_queued], [x[2] for x in least_queued])
    da, db = fit_line([p[0] for p in decode_points], [p[1] for p in decode_points])
    return Capacity(pa, pb, da, db, max_decode_batch, source=f"derived from {path}",
                    points={"prefill_least_queued": [[x[1], x[2]] for x in least_queued],
                            "decode": decode_points})


def _load(results_dir: Path, flag: str) -> tuple[Path, BenchResults]:
    path = results_dir / "results.json" if results_dir.is_dir() else results_dir
    try:
        return path, BenchResults.load(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InvalidArgument(f"{flag} {results_dir}: {type(e).__name__}: {e}") from None


#: Modes whose measured hit rate :func:`prefix_hit_rate_from_results` prefers, best first.
_HIT_RATE_MODES = ("disagg-kv", "disagg", "hybrid", "colocated", "chunked")


def prefix_hit_rate_from_results(results_dir: Path) -> tuple[float, str]:
    """The measured prefix hit rate of a ``pdkv bench serve`` results file, and which runs it came from.

    Takes the runs of the first mode of ``disagg-kv``, ``disagg``, ``hybrid``,
    ``colocated``, ``chunked`` (else any mode) that measured a ``prefix_hit_rate``, and
    returns their hit rate weighted by prompt tokens sent (computed tokens over all of
    them).

    Raises
    ------
    InvalidArgument
        Unreadable file, or no run with a measured hit rate (a run whose workers do not
        expose the prefix counters, or without ``--prefix-cache``).
    """
    path, results = _load(results_dir, "--prefix-hit-rate")
    measured = [r for r in results.runs
                if r.prefix and r.prefix.get("prefix_hit_rate") is not None and r.prefix.get("prompt_tokens")]
    if not measured:
        raise InvalidArgument(f"{path} has no run with a measured prefix_hit_rate (run `pdkv bench serve` with "
                              "--prefix-cache on workers that expose pdkv_prefill_computed_tokens_total)")
    modes = {r.mode for r in measured}
    mode = next((m for m in _HIT_RATE_MODES if m in modes), sorted(modes)[0])
    runs = [r for r in measured if r.mode == mode]
    sent = sum(r.prefix["prompt_tokens"] for r in runs)  # type: ignore[index]
    hit = sum(r.prefix["prompt_tokens"] * r.prefix["prefix_hit_rate"] for r in runs)  # type: ignore[index]
    return hit / sent, f"{mode} in {path} ({len(runs)} run{'s' if len(runs) > 1 else ''})"


def _decode_point(records: list, num_decode: int) -> list[float] | None:
    """[mean decode batch per worker, median inter-token latency] of one run."""
    itls = [g for rec in records for g in rec.itls_s if g > 0]
    spans = [(rec.chunk_times_s[0], rec.end_s) for rec in records if len(rec.chunk_times_s) > 1]
    if not itls or not spans:
        return None
    t0 = min(s for s, _ in spans)
    t1 = max(e for _, e in spans)
    if t1 <= t0:
        return None
    busy = sum(e - s for s, e in spans)
    return [busy / (t1 - t0) / num_decode, statistics.median(itls)]
