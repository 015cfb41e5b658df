"""Two serving modes replayed on one trace, compared rate by rate: the arithmetic that
``pdkv bench serve --compare-stream`` (:mod:`pdkv.lab.serve.stream`) and
``--compare-compress`` (:mod:`pdkv.lab.serve.compress`) share.

A *variant* mode is measured against a *baseline* mode of the same run: per rate, each
mode's TTFT, time to the second token (t2t: the KV-ready time in pdkv's stack, where
the prefill worker samples the first token), t2t - TTFT, ITL and output throughput;
the ratios variant / baseline of their p50s (below 1: the variant is faster;
throughput: above 1); the per-request t2t the variant saved; and whether both modes'
outputs were the same token for token (requests paired by trace index; the modes are
asked for ``return_token_ids``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence

from pdkv.lab.serve.metrics import BenchResults, RequestRecord, RunResult, Stats

__all__ = ["summary", "compare_pair", "rows_markdown", "ms", "x"]


def _stats(values: Sequence[float]) -> Dict[str, Optional[float]]:
    s = Stats.of(values)
    return {"count": s.count, "p50": s.p50, "p90": s.p90, "mean": s.mean}


def summary(run: RunResult) -> Dict[str, Any]:
    """One mode at one rate: request counts and TTFT / t2t / t2t - TTFT / ITL statistics
    (seconds), output tokens and output tokens per second."""
    ok = [r for r in run.records if r.ok]
    sends = [r.send_s for r in run.records if r.send_s is not None]
    lasts = [t for t in (r.last_event_s for r in run.records) if t is not None]
    duration = max(lasts) - min(sends) if sends and lasts else 0.0
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(run.records),
        "ok": len(ok),
        "ttft_s": _stats([r.ttft_s for r in ok if r.ttft_s is not None]),
        "t2t_s": _stats([r.t2t_s for r in ok if r.t2t_s is not None]),
        # 2nd token minus 1st: the KV hop left after prefill plus one decode step; unlike
        # TTFT and t2t it does not carry the prefill time, which a loaded CPU varies.
        "kv_wait_s": _stats([r.t2t_s - r.ttft_s for r in ok if r.t2t_s is not None and r.ttft_s is not None]),
        "itl_s": _stats([g for r in ok for g in r.itls_s]),
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / duration if duration > 0 else None,
    }


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def _outputs(variant: Sequence[RequestRecord], baseline: Sequence[RequestRecord]) -> Dict[str, Any]:
    """Requests (paired by trace index) whose outputs were compared, and those that differ."""
    other = {r.index: r for r in baseline}
    compared, differ, missing = 0, [], 0
    for r in variant:
        m = other.get(r.index)
        if m is None or r.output_token_ids is None or m.output_token_ids is None:
            missing += 1
            continue
        compared += 1
        if r.output_token_ids != m.output_token_ids:
            differ.append(r.index)
    return {"compared": compared, "differ": differ, "without_token_ids": missing,
            "equal": compared > 0 and not differ and missing == 0}


def _paired_t2t_saved(variant: Sequence[RequestRecord], baseline: Sequence[RequestRecord]) -> Dict[str, Any]:
    """Per request (same trace index): baseline t2t minus variant t2t."""
    other = {r.index: r for r in baseline if r.ok and r.t2t_s is not None}
    saved = [other[r.index].t2t_s - r.t2t_s for r in variant  # type: ignore[operator]
             if r.ok and r.t2t_s is not None and r.index in other]
    return _stats(saved)


def compare_pair(results: BenchResults, variant: str, baseline: str) -> Optional[Dict[str, Any]]:
    """``variant`` against ``baseline`` at every rate both ran, or None when one is missing.

    Returns
    -------
    dict
        ``{"variant", "baseline", "link", "rates": [...], "all_ok", "outputs_equal"}``;
        each rate holds both modes' :func:`summary` (keyed by mode name), ``ratio``
        (variant / baseline of the p50s and of throughput), ``t2t_saved_s``
        (per-request baseline - variant t2t) and ``outputs``.
    """
    by_mode: Dict[str, Dict[float, RunResult]] = {}
    for run in results.runs:
        by_mode.setdefault(run.mode, {})[run.rate] = run
    if variant not in by_mode or baseline not in by_mode:
        return None
    rates: List[Dict[str, Any]] = []
    for rate in sorted(set(by_mode[variant]) & set(by_mode[baseline])):
        v_run, b_run = by_mode[variant][rate], by_mode[baseline][rate]
        v, b = summary(v_run), summary(b_run)
        rates.append({
            "rate": rate,
            variant: v,
            baseline: b,
            "ratio": {
                "ttft_p50": _ratio(v["ttft_s"]["p50"], b["ttft_s"]["p50"]),
                "t2t_p50": _ratio(v["t2t_s"]["p50"], b["t2t_s"]["p50"]),
                "t2t_p90": _ratio(v["t2t_s"]["p90"], b["t2t_s"]["p90"]),
                "kv_wait_p50": _ratio(v["kv_wait_s"]["p50"], b["kv_wait_s"]["p50"]),
                "itl_p50": _ratio(v["itl_s"]["p50"], b["itl_s"]["p50"]),
                "output_tok_s": _ratio(v["output_tok_s"], b["output_tok_s"]),
            },
            "t2t_saved_s": _paired_t2t_saved(v_run.records, b_run.records),
            "outputs": _outputs(v_run.records, b_run.records),
        })
    if not rates:
        return None
    all_ok = all(r[mode]["ok"] == r[mode]["requests"] for r in rates for mode in (variant, baseline))
    link = (results.meta.get("deployment") or {}).get("link") if isinstance(results.meta, Mapping) else None
    return {"variant": variant, "baseline": baseline, "link": link, "rates": rates, "all_ok": all_ok,
            "outputs_equal": all(r["outputs"]["equal"] for r in rates)}


def ms(v: Optional[float]) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def x(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}"


def rows_markdown(comparison: Mapping[str, Any]) -> List[str]:
    """The two tables of a :func:`compare_pair` result: per rate and mode, then the ratios."""
    variant, baseline = comparison["variant"], comparison["baseline"]
    lines = [
        "| rate | mode | ok | TTFT | t2t (KV ready) | t2t - TTFT | ITL | output tok/s |",
        "|--:|---|--:|--:|--:|--:|--:|--:|",
    ]
    for r in comparison["rates"]:
        for mode in (variant, baseline):
            m = r[mode]
            lines.append(
                f"| {r['rate']:g} | {mode} | {m['ok']}/{m['requests']} | {ms(m['ttft_s']['p50'])} / "
                f"{ms(m['ttft_s']['p90'])} | {ms(m['t2t_s']['p50'])} / {ms(m['t2t_s']['p90'])} | "
                f"{ms(m['kv_wait_s']['p50'])} / {ms(m['kv_wait_s']['p90'])} | "
                f"{ms(m['itl_s']['p50'])} / {ms(m['itl_s']['p90'])} | {x(m['output_tok_s'])} |")
    lines += [
        "",
        "| rate | TTFT p50 ratio | t2t p50 ratio | t2t p90 ratio | t2t - TTFT p50 ratio | ITL p50 ratio | "
        "throughput ratio | t2t saved per request p50 (ms) | outputs equal |",
        "|--:|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    for r in comparison["rates"]:
        q, o = r["ratio"], r["outputs"]
        same = "yes" if o["equal"] else f"NO ({len(o['differ'])} differ, {o['without_token_ids']} unchecked)"
        lines.append(f"| {r['rate']:g} | {x(q['ttft_p50'])} | {x(q['t2t_p50'])} | {x(q['t2t_p90'])} | "
                     f"{x(q['kv_wait_p50'])} | "
                     f"{x(q['itl_p50'])} | {x(q['output_tok_s'])} | {ms(r['t2t_saved_s']['p50'])} | "
                     f"{same} ({o['compared']} requests) |")
    return lines
