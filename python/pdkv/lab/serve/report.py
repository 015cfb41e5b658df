"""Reports for ``pdkv bench serve``: results JSON, a markdown table, PNG plots, a recommendation.

:func:`write_report` writes, into one directory:

* ``results.json``: :class:`~pdkv.lab.serve.metrics.BenchResults` with every
  request's timeline, so any other SLO can be evaluated later;
* ``report.md``: provenance, the SLO, :func:`markdown_table`, :func:`sanity_notes` and
  :func:`recommend`'s text;
* ``itl_cdf.png``: the ITL distribution of each mode (one panel per rate);
* ``rate_sweep.png``: goodput, p90 ITL and p90 TTFT against the request rate.

Plots use matplotlib's object API with the Agg canvas (no pyplot, no global backend
change, no display needed).

How the recommendation is made
------------------------------
A *candidate* is a serving mode with its P:D ratio when it has one. Candidates are
compared on the rates every one of them ran. Each candidate's score is the fraction
of those requests that met the SLO (:func:`~pdkv.lab.serve.metrics.meets_slo`): all
candidates replay the same trace, so this is their goodput on the same work. Ties
break on the best per-rate goodput (requests/s), then on the lower p90 ITL.

Noise: since every candidate served the same requests, the best and each other
candidate are compared request by request (McNemar's test): with *b* requests good
only under the best and *c* good only under the other, the difference is within noise
when ``|b - c| <= 2 * sqrt(b + c)`` (about 95% confidence; a one-request difference
is always noise). Requests of one run are not independent (they queue behind each
other), so this test is optimistic: repeat runs before trusting a small margin. When
requests cannot be paired (different traces), a two-proportion test is used instead.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from pdkv.lab.serve.metrics import SLO, BenchResults, RequestRecord, RunResult, RunSummary, meets_slo, summarize

__all__ = [
    "CandidateScore",
    "Recommendation",
    "markdown_table",
    "plot_itl_cdf",
    "plot_rate_sweep",
    "recommend",
    "sanity_notes",
    "write_report",
]

#: Client lag (send time minus scheduled time, p99) above which a run is flagged.
LAG_WARN_S = 0.05

PathLike = Union[str, "os.PathLike[str]"]


# --------------------------------------------------------------------------------------
# Grouping
# --------------------------------------------------------------------------------------


def _candidates(results: BenchResults) -> Dict[str, List[RunResult]]:
    """Runs per candidate, in first-appearance order."""
    out: Dict[str, List[RunResult]] = {}
    for run in results.runs:
        out.setdefault(run.candidate, []).append(run)
    return out


def _records_at(runs: Sequence[RunResult], rate: float) -> List[Tuple[Tuple[float, int, int], RequestRecord]]:
    """Records of the runs at ``rate``, keyed by (rate, repeat, request index)."""
    out = []
    repeat = 0
    for run in runs:
        if math.isclose(run.rate, rate, rel_tol=1e-9):
            out.extend(((rate, repeat, rec.index), rec) for rec in run.records)
            repeat += 1
    return out


def _fmt(x: Optional[float], scale: float = 1.0, digits: int = 3) -> str:
    if x is None:
        return "-"
    v = x * scale
    return f"{v:.{digits}g}" if abs(v) < 10 ** digits else f"{v:.0f}"


def _fmt_rate(r: float) -> str:
    return f"{r:g}"


# --------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------


def markdown_table(results: BenchResults, slo: Optional[SLO] = None) -> str:
    """One markdown table: a row per (mode, P:D, rate), grouped by mode.

    Columns: requests and errors; TTFT p50/p90/p99 (s); ITL p50/p90/p99 (ms); E2E
    p50/p90/p99 (s); output tokens/s; requests/s; goodput as the fraction of requests
    meeting ``slo`` and as good requests/s.

    Parameters
    ----------
    results : BenchResults
        Measured runs.
    slo : SLO, optional
        Objective for the goodput column; ``results.slo`` by default.

    Returns
    -------
    str
        GitHub-flavoured markdown, ending with a newline.
    """
    slo = slo or results.slo
    trace = results.meta.get("trace") if isinstance(results.meta, Mapping) else None
    sessions = isinstance(trace, Mapping) and trace.get("workload") not in (None, "requests")
    head = [
        "Mode", "P:D", "Rate (sessions/s)" if sessions else "Rate (req/s)", "Requests", "Errors",
        "TTFT p50 (s)", "TTFT p90 (s)", "TTFT p99 (s)",
        "ITL p50 (ms)", "ITL p90 (ms)", "ITL p99 (ms)",
        "E2E p50 (s)", "E2E p90 (s)", "E2E p99 (s)",
        "Out tok/s", "Req/s", "Goodput",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 2 + ["--:"] * (len(head) - 2)) + "|"]
    for runs in _candidates(results).values():
        for run in sorted(runs, key=lambda r: r.rate):
            s = run.summary(slo)
            gp = "-" if s.goodput_fraction is None else f"{100 * s.goodput_fraction:.1f}% ({_fmt(s.goodput_rate)}/s)"
            row = [
                run.mode, run.pd_ratio or "-", _fmt_rate(run.rate), str(s.num_requests), str(s.num_errors),
                _fmt(s.ttft.p50), _fmt(s.ttft.p90), _fmt(s.ttft.p99),
                _fmt(s.itl.p50, 1e3), _fmt(s.itl.p90, 1e3), _fmt(s.itl.p99, 1e3),
                _fmt(s.e2e.p50), _fmt(s.e2e.p90), _fmt(s.e2e.p99),
                _fmt(s.output_tok_s, digits=4), _fmt(s.req_s), gp,
            ]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def sanity_notes(results: BenchResults) -> List[str]:
    """Warnings about runs whose numbers should not be taken at face value.

    Flags runs with failed requests (and their kinds), runs whose ITL is per chunk
    rather than per token (the server did not report per-chunk usage), and runs where
    the client sent requests late (p99 of ``send_s - scheduled_s`` above :data:`LAG_WARN_S`: a
    concurrency cap, or a client starved of CPU, changed the offered load).

    Parameters
    ----------
    results : BenchResults
        Measured runs.

    Returns
    -------
    list of str
        One line per problem; empty when every run is clean.
    """
    notes = []
    for run in results.runs:
        s = run.summary(results.slo)
        where = f"{run.candidate} @ {_fmt_rate(run.rate)} req/s"
        if s.num_errors:
            kinds = ", ".join(f"{k} x{n}" for k, n in s.errors.items())
            notes.append(f"{where}: {s.num_errors} of {s.num_requests} requests failed ({kinds}).")
        if s.num_ok and not s.itl_per_token:
            n = sum(1 for r in run.records if r.ok and r.usage_per_chunk)
            notes.append(
                f"{where}: ITL is per chunk, not per token: {s.num_ok - n} of {s.num_ok} requests had no "
                "per-chunk usage (continuous_usage_stats), so a chunk of several tokens counted as one."
            )
        if s.lag.p99 is not None and s.lag.p99 > LAG_WARN_S:
            notes.append(
                f"{where}: the client sent requests late (lag p99 {s.lag.p99 * 1e3:.0f} ms, max "
                f"{(s.lag.max or 0) * 1e3:.0f} ms), so the offered load was lower than the trace's."
            )
    return notes


# --------------------------------------------------------------------------------------
# Recommendation
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CandidateScore:
    """How one candidate did on the compared rates.

    Attributes
    ----------
    candidate : str
        ``mode`` or ``"mode P:D"``.
    mode : str
        Serving mode.
    pd_ratio : str or None
        P:D ratio, if any.
    good, total : int
        Requests meeting the SLO, and requests sent, over the compared rates.
    best_goodput_rate : float or None
        Highest good requests/s at any compared rate.
    per_rate : dict
        ``rate -> {"good", "total", "itl_p90_s", "ttft_p90_s", "goodput_rate"}``.
    """

    candidate: str
    mode: str
    pd_ratio: Optional[str]
    good: int
    total: int
    best_goodput_rate: Optional[float]
    per_rate: Mapping[float, Mapping[str, Any]]

    @property
    def fraction(self) -> float:
        """``good / total`` (0 when nothing was sent)."""
        return self.good / self.total if self.total else 0.0

    def to_dict(self) -> Dict[str, Any]:
        """JSON-serialisable form (rates become string keys)."""
        return {
            "candidate": self.candidate,
            "mode": self.mode,
            "pd_ratio": self.pd_ratio,
            "good": self.good,
            "total": self.total,
            "fraction": self.fraction,
            "best_goodput_rate": self.best_goodput_rate,
            "per_rate": {_fmt_rate(k): dict(v) for k, v in self.per_rate.items()},
        }


@dataclass(frozen=True)
class Recommendation:
    """The candidate with the highest goodput for an SLO, and why.

    Attributes
    ----------
    slo : SLO
        The objective.
    rates : list of float
        Rates every candidate ran (the comparison set); empty when there is none.
    ranking : list of CandidateScore
        Best first.
    within_noise : list of str
        Candidates whose difference from the best is within noise.
    comparisons : dict
        ``candidate -> {"method", "best_only", "other_only", "threshold", "within_noise"}``
        for every candidate but the best.
    text : str
        The explanation, with the numbers.
    """

    slo: SLO
    rates: List[float]
    ranking: List[CandidateScore]
    within_noise: List[str]
    comparisons: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    text: str = ""

    @property
    def best(self) -> Optional[CandidateScore]:
        """The winner, ``None`` when there were no runs."""
        return self.ranking[0] if self.ranking else None

    def __str__(self) -> str:
        return self.text

    def to_dict(self) -> Dict[str, Any]:
        """JSON-serialisable form."""
        return {
            "slo": self.slo.to_dict(),
            "rates": list(self.rates),
            "best": self.best.candidate if self.best else None,
            "ranking": [c.to_dict() for c in self.ranking],
            "within_noise": list(self.within_noise),
            "comparisons": {k: dict(v) for k, v in self.comparisons.items()},
            "text": self.text,
        }


_Scored = Tuple[CandidateScore, Dict[Any, bool]]  # a score, and each request's outcome by (rate, repeat, index)


def _score(candidate: str, runs: Sequence[RunResult], rates: Sequence[float], slo: SLO) -> _Scored:
    good = total = 0
    per_rate: Dict[float, Dict[str, Any]] = {}
    outcome: Dict[Any, bool] = {}
    best_rate: Optional[float] = None
    for rate in rates:
        keyed = _records_at(runs, rate)
        recs = [r for _, r in keyed]
        for key, rec in keyed:
            outcome[key] = meets_slo(rec, slo)
        s: RunSummary = summarize(recs, slo)
        g = sum(outcome[k] for k, _ in keyed)
        good += g
        total += len(recs)
        # Goodput rate per run (durations do not add across repeats): mean over repeats.
        rates_gp = [run.summary(slo).goodput_rate for run in runs if math.isclose(run.rate, rate, rel_tol=1e-9)]
        rates_gp = [x for x in rates_gp if x is not None]
        gp = sum(rates_gp) / len(rates_gp) if rates_gp else None
        if gp is not None and (best_rate is None or gp > best_rate):
            best_rate = gp
        per_rate[rate] = {
            "good": g, "total": len(recs), "itl_p90_s": s.itl.p90, "ttft_p90_s": s.ttft.p90, "goodput_rate": gp
        }
    first = runs[0]
    return CandidateScore(candidate, first.mode, first.pd_ratio, good, total, best_rate, per_rate), outcome


def _compare(best: _Scored, other: _Scored) -> Dict[str, Any]:
    (bs, bo), (os_, oo) = best, other
    common = bo.keys() & oo.keys()
    if common:
        b = sum(1 for k in common if bo[k] and not oo[k])
        c = sum(1 for k in common if oo[k] and not bo[k])
        threshold = max(2.0 * math.sqrt(b + c), 1.0)
        return {
            "method": "paired", "best_only": b, "other_only": c, "threshold": threshold,
            "within_noise": abs(b - c) <= threshold,
        }
    # Unpaired: two-proportion z-test at ~95%.
    n1, n2 = max(bs.total, 1), max(os_.total, 1)
    p = (bs.good + os_.good) / (n1 + n2)
    se = math.sqrt(max(p * (1 - p), 0.0) * (1 / n1 + 1 / n2))
    diff = abs(bs.fraction - os_.fraction)
    threshold = max(2.0 * se, 1.0 / min(n1, n2))
    return {
        "method": "unpaired", "best_only": None, "other_only": None, "threshold": threshold,
        "within_noise": diff <= threshold,
    }


def recommend(results: BenchResults, slo: Optional[SLO] = None) -> Recommendation:
    """Pick the mode (and P:D ratio) with the highest goodput for ``slo``, and explain it.

    Parameters
    ----------
    results : BenchResults
        Runs of one trace at one or more rates against one or more candidates.
    slo : SLO, optional
        Objective; ``results.slo`` by default. Goodput is recomputed from the records,
        so any SLO can be asked of stored results.

    Returns
    -------
    Recommendation
        Ranking, noise comparisons and a human-readable ``text`` (see the module
        docstring for the method).
    """
    slo = slo or results.slo
    groups = _candidates(results)
    if not groups:
        return Recommendation(slo, [], [], [], {}, "No runs to compare.")
    rate_sets = [{round(r.rate, 12) for r in runs} for runs in groups.values()]
    common = sorted(set.intersection(*rate_sets))
    note = ""
    if not common:
        note = "The candidates ran at no common rate; each is scored on all of its own rates, so compare with care.\n"
    scored = {
        name: _score(name, runs, common if common else sorted({round(r.rate, 12) for r in runs}), slo)
        for name, runs in groups.items()
    }

    def key(item: _Scored) -> Tuple[float, float, float]:
        cs = item[0]
        itl = [v["itl_p90_s"] for v in cs.per_rate.values() if v["itl_p90_s"] is not None]
        return (-cs.fraction, -(cs.best_goodput_rate or 0.0), max(itl) if itl else math.inf)

    order = sorted(scored.values(), key=key)
    best = order[0]
    comparisons = {o[0].candidate: _compare(best, o) for o in order[1:]}
    noise = [name for name, c in comparisons.items() if c["within_noise"]]
    ranking = [o[0] for o in order]
    text = note + _explain(slo, common, ranking, comparisons, noise)
    return Recommendation(slo, list(common), ranking, noise, comparisons, text)


def _explain(
    slo: SLO,
    rates: Sequence[float],
    ranking: Sequence[CandidateScore],
    comparisons: Mapping[str, Mapping[str, Any]],
    noise: Sequence[str],
) -> str:
    best = ranking[0]
    all_rates = sorted({r for cs in ranking for r in cs.per_rate})
    if rates:
        rate_txt = "compared at " + ", ".join(_fmt_rate(r) for r in rates) + " req/s"
    else:
        rate_txt = "each candidate scored on its own rates"
    lines = [f"SLO: {slo.describe()}; {rate_txt}."]
    if best.good == 0:
        lines.append(
            f"No candidate met the SLO for any request. Closest: {best.candidate} "
            "(lowest p90 ITL). Loosen the SLO or lower the rates."
        )
    else:
        lines.append(
            f"Recommended: {best.candidate}: {best.good} of {best.total} requests "
            f"({100 * best.fraction:.1f}%) met the SLO"
            + (f", best goodput {best.best_goodput_rate:.3g} req/s." if best.best_goodput_rate is not None else ".")
        )
    lines.append("")
    lines.append("Per rate (good/total, p90 ITL, p90 TTFT):")
    for rate in all_rates:
        cells = []
        for cs in ranking:
            v = cs.per_rate.get(rate)
            if v is None:
                continue
            cells.append(
                f"{cs.candidate} {v['good']}/{v['total']}, {_fmt(v['itl_p90_s'], 1e3)} ms, {_fmt(v['ttft_p90_s'])} s"
            )
        lines.append(f"  {_fmt_rate(rate)} req/s: " + "; ".join(cells))
    if len(ranking) == 1:
        lines.append("")
        lines.append("Only one candidate was measured; there is nothing to compare it with.")
        return "\n".join(lines) + "\n"
    lines.append("")
    for cs in ranking[1:]:
        c = comparisons[cs.candidate]
        head = f"{cs.candidate}: {cs.good}/{cs.total} ({100 * cs.fraction:.1f}%)."
        if c["method"] == "paired":
            b, o = c["best_only"], c["other_only"]
            detail = (
                f" On the same requests, {best.candidate} met the SLO for {b} that {cs.candidate} "
                f"missed, and missed {o} that it met"
            )
            test = f"|{b} - {o}| {'<=' if c['within_noise'] else '>'} max(1, 2*sqrt({b} + {o})) = {c['threshold']:.1f}"
        else:
            detail = f" Difference {100 * (best.fraction - cs.fraction):.1f} points (requests not paired)"
            test = f"{'within' if c['within_noise'] else 'beyond'} {100 * c['threshold']:.1f} points"
        verdict = (
            f"; within noise ({test}): treat them as equal."
            if c["within_noise"]
            else f"; beyond noise ({test})."
        )
        lines.append(head + detail + verdict)
    if noise:
        lines.append("")
        lines.append(
            f"{best.candidate} is not clearly better than {', '.join(noise)}: choose on other grounds "
            "(cost, simplicity) or repeat the runs with more requests to separate them."
        )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------


def _figure(ncols: int, nrows: int = 1, size: Tuple[float, float] = (4.2, 3.4)) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(size[0] * ncols, size[1] * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def plot_itl_cdf(results: BenchResults, path: PathLike, *, slo: Optional[SLO] = None) -> Path:
    """Plot the ITL CDF of every candidate, one panel per rate, log-scaled time axis.

    Parameters
    ----------
    results : BenchResults
        Measured runs.
    path : path-like
        PNG to write.
    slo : SLO, optional
        Draws the ITL objective as a vertical line; ``results.slo`` by default.

    Returns
    -------
    pathlib.Path
        ``path``.
    """
    import numpy as np

    slo = slo or results.slo
    groups = _candidates(results)
    rates = sorted({round(r.rate, 12) for r in results.runs}) or [0.0]
    ncols = min(len(rates), 3)
    nrows = (len(rates) + ncols - 1) // ncols
    fig, axes = _figure(ncols, nrows)
    for i, rate in enumerate(rates):
        ax = axes[i // ncols][i % ncols]
        for name, runs in groups.items():
            itl = np.sort([g * 1e3 for _, rec in _records_at(runs, rate) if rec.ok for g in rec.itls_s])
            if itl.size == 0:
                continue
            itl = np.maximum(itl, 1e-3)  # log axis: a zero gap (multi-token chunk) plots at 1 us
            ax.step(itl, np.arange(1, itl.size + 1) / itl.size, where="post", label=name)
        ax.axvline(slo.itl_s * 1e3, color="grey", linestyle="--", linewidth=1, label=f"SLO {slo.itl_s * 1e3:g} ms")
        ax.set_xscale("log")
        ax.set_ylim(0, 1.01)
        ax.set_xlabel("inter-token latency (ms)")
        ax.set_ylabel("fraction of gaps")
        ax.set_title(f"ITL CDF at {_fmt_rate(rate)} req/s")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    for j in range(len(rates), nrows * ncols):
        axes[j // ncols][j % ncols].set_visible(False)
    fig.savefig(path, dpi=110)
    return Path(path)


def plot_rate_sweep(results: BenchResults, path: PathLike, *, slo: Optional[SLO] = None) -> Path:
    """Plot goodput, p90 ITL and p90 TTFT against the request rate, one line per candidate.

    Parameters
    ----------
    results : BenchResults
        Measured runs.
    path : path-like
        PNG to write.
    slo : SLO, optional
        Goodput objective (and the dashed SLO lines); ``results.slo`` by default.

    Returns
    -------
    pathlib.Path
        ``path``.
    """
    slo = slo or results.slo
    fig, axes = _figure(3)
    ax_gp, ax_itl, ax_ttft = axes[0]
    for name, runs in _candidates(results).items():
        rates = sorted({round(r.rate, 12) for r in runs})
        sums = [summarize([rec for _, rec in _records_at(runs, rate)], slo) for rate in rates]
        gp = [100 * s.goodput_fraction if s.goodput_fraction is not None else float("nan") for s in sums]
        itl = [s.itl.p90 * 1e3 if s.itl.p90 is not None else float("nan") for s in sums]
        ttft = [s.ttft.p90 if s.ttft.p90 is not None else float("nan") for s in sums]
        ax_gp.plot(rates, gp, marker="o", label=name)
        ax_itl.plot(rates, itl, marker="o", label=name)
        ax_ttft.plot(rates, ttft, marker="o", label=name)
    ax_gp.set_ylabel("requests meeting the SLO (%)")
    ax_gp.set_ylim(-2, 102)
    ax_gp.set_title(f"Goodput ({slo.describe()})", fontsize="small")
    ax_itl.axhline(slo.itl_s * 1e3, color="grey", linestyle="--", linewidth=1, label="SLO")
    ax_itl.set_ylabel("p90 inter-token latency (ms)")
    ax_itl.set_title("p90 ITL")
    ax_ttft.axhline(slo.ttft_s, color="grey", linestyle="--", linewidth=1, label="SLO")
    ax_ttft.set_ylabel("p90 time to first token (s)")
    ax_ttft.set_title("p90 TTFT")
    for ax in (ax_gp, ax_itl, ax_ttft):
        ax.set_xlabel("request rate (req/s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    fig.savefig(path, dpi=110)
    return Path(path)


# --------------------------------------------------------------------------------------
# Everything
# --------------------------------------------------------------------------------------


def write_report(
    results: BenchResults,
    out_dir: PathLike,
    *,
    slo: Optional[SLO] = None,
    plots: bool = True,
    title: str = "pdkv bench serve",
) -> Dict[str, Path]:
    """Write results JSON, markdown report and plots into ``out_dir``.

    Parameters
    ----------
    results : BenchResults
        Measured runs (with ``meta`` such as the command line).
    out_dir : path-like
        Created if missing; existing files of the same names are replaced.
    slo : SLO, optional
        Objective for goodput and the recommendation; ``results.slo`` by default
        (the JSON then stores this SLO).
    plots : bool
        Draw the PNGs. Without matplotlib they are skipped and the report says so.
    title : str
        Heading of ``report.md``.

    Returns
    -------
    dict of str to pathlib.Path
        ``"json"``, ``"markdown"`` and, when drawn, ``"itl_cdf"`` and ``"rate_sweep"``.
    """
    slo = slo or results.slo
    if slo != results.slo:
        results = BenchResults(results.runs, slo, results.meta)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: Dict[str, Path] = {"json": out / "results.json", "markdown": out / "report.md"}
    results.save(paths["json"])
    plot_note = ""
    if plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            plot_note = "\nPlots skipped: matplotlib is not installed (`pip install matplotlib`).\n"
        else:
            paths["itl_cdf"] = plot_itl_cdf(results, out / "itl_cdf.png", slo=slo)
            paths["rate_sweep"] = plot_rate_sweep(results, out / "rate_sweep.png", slo=slo)
    rec = recommend(results, slo)
    meta = results.meta
    md = [f"# {title}", ""]
    if meta.get("command"):
        md += ["Command:", "", "```", str(meta["command"]), "```", ""]
    trace = meta.get("trace")
    if isinstance(trace, Mapping):
        desc = trace.get("description") or trace.get("preset") or trace.get("source") or ""
        md += [f"Trace: {desc} (seed {trace.get('seed', '-')})", ""]
    for k in ("url", "model", "started_at"):
        if meta.get(k):
            md.append(f"- {k}: {meta[k]}")
    per_token = all(r.summary(slo).itl_per_token for r in results.runs if r.summary(slo).num_ok)
    itl_unit = (
        "ITL is per token (tokens per chunk from the server's per-chunk usage; a chunk of k tokens "
        "after a gap g counts k gaps of g/k)."
        if per_token else "ITL is per chunk: the server did not report per-chunk usage (see Checks)."
    )
    md += ["", f"SLO: {slo.describe()}. {itl_unit}", "", markdown_table(results, slo)]
    notes = sanity_notes(results)
    if notes:
        md += ["## Checks", ""] + [f"- {n}" for n in notes] + [""]
    md += ["## Recommendation", "", "```", rec.text.rstrip(), "```", ""]
    if "itl_cdf" in paths:
        md += ["![ITL CDF](itl_cdf.png)", "", "![Goodput and p90 ITL against rate](rate_sweep.png)", ""]
    md.append(plot_note)
    paths["markdown"].write_text("\n".join(md).rstrip() + "\n", encoding="utf-8")
    return paths
