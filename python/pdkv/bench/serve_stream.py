"""``pdkv bench serve --compare-stream``: layer-wise KV streaming vs one write, one run.

The same trace is replayed, rate by rate, against ``disagg`` (the prefill worker
streams each layer's KV while later layers compute, its default) and
``disagg-nostream`` (``--no-stream-layers``: one write after prefill), on the same
machine and, with ``--link``, behind the same emulated link. This module turns the
two modes' records into the comparison the report carries.

What streaming changes: in pdkv's stack the first token is sampled by the prefill
worker and relayed at once, so TTFT does not wait for the KV in either mode. The
decode worker produces the second token once the KV landed, so the **time to the
second token** (``t2t``, the client-side KV-ready time) is what streaming shortens.
Both are reported per mode, with ITL and output throughput, and the ratios
streamed / monolithic (below 1: streaming is faster). Both modes are asked for token
ids (``return_token_ids``) and every request's output must be the same token for
token (greedy decoding); the comparison counts the requests that differ.

Example::

    pdkv bench serve --compare-stream --serve-model tiny-40m --prompt-len 1024 --output-len 16 \\
        --rates 0.5 --num-requests 8 --link 1gbit --out bench/results/stream/serve-tiny-1gbit
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from .serve_metrics import BenchResults, RequestRecord, RunResult, Stats

__all__ = ["STREAMED", "MONOLITHIC", "comparing", "compare", "markdown", "emit"]

STREAMED = "disagg"
MONOLITHIC = "disagg-nostream"


def comparing(args: argparse.Namespace) -> bool:
    """Whether this run measures both modes of the comparison."""
    modes = {m.strip() for m in str(getattr(args, "modes", "")).split(",")}
    return bool(getattr(args, "compare_stream", False)) or {STREAMED, MONOLITHIC} <= modes


def _stats(values: Sequence[float]) -> Dict[str, Optional[float]]:
    s = Stats.of(values)
    return {"count": s.count, "p50": s.p50, "p90": s.p90, "mean": s.mean}


def _mode_summary(run: RunResult) -> Dict[str, Any]:
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


def _outputs(streamed: Sequence[RequestRecord], monolithic: Sequence[RequestRecord]) -> Dict[str, Any]:
    """Requests (paired by trace index) whose outputs were compared, and those that differ."""
    other = {r.index: r for r in monolithic}
    compared, differ, missing = 0, [], 0
    for r in streamed:
        m = other.get(r.index)
        if m is None or r.output_token_ids is None or m.output_token_ids is None:
            missing += 1
            continue
        compared += 1
        if r.output_token_ids != m.output_token_ids:
            differ.append(r.index)
    return {"compared": compared, "differ": differ, "without_token_ids": missing,
            "equal": compared > 0 and not differ and missing == 0}


def _paired_t2t_saved(streamed: Sequence[RequestRecord], monolithic: Sequence[RequestRecord]) -> Dict[str, Any]:
    """Per request (same trace index): monolithic t2t minus streamed t2t."""
    other = {r.index: r for r in monolithic if r.ok and r.t2t_s is not None}
    saved = [other[r.index].t2t_s - r.t2t_s for r in streamed  # type: ignore[operator]
             if r.ok and r.t2t_s is not None and r.index in other]
    return _stats(saved)


def compare(results: BenchResults) -> Optional[Dict[str, Any]]:
    """The comparison of every rate both modes ran, or None when one mode is missing.

    Returns
    -------
    dict
        ``{"streamed": "disagg", "monolithic": "disagg-nostream", "rates": [...],
        "all_ok": bool, "outputs_equal": bool}``; each rate holds both modes' summaries
        (``ttft_s``, ``t2t_s``, ``itl_s`` statistics in seconds, ``output_tok_s``),
        ``ratio`` (streamed / monolithic of the p50s and of throughput),
        ``t2t_saved_s`` (per-request monolithic - streamed t2t) and ``outputs``.
    """
    by_mode: Dict[str, Dict[float, RunResult]] = {}
    for run in results.runs:
        by_mode.setdefault(run.mode, {})[run.rate] = run
    if STREAMED not in by_mode or MONOLITHIC not in by_mode:
        return None
    rates: List[Dict[str, Any]] = []
    for rate in sorted(set(by_mode[STREAMED]) & set(by_mode[MONOLITHIC])):
        s_run, m_run = by_mode[STREAMED][rate], by_mode[MONOLITHIC][rate]
        s, m = _mode_summary(s_run), _mode_summary(m_run)
        rates.append({
            "rate": rate,
            STREAMED: s,
            MONOLITHIC: m,
            "ratio": {
                "ttft_p50": _ratio(s["ttft_s"]["p50"], m["ttft_s"]["p50"]),
                "t2t_p50": _ratio(s["t2t_s"]["p50"], m["t2t_s"]["p50"]),
                "t2t_p90": _ratio(s["t2t_s"]["p90"], m["t2t_s"]["p90"]),
                "kv_wait_p50": _ratio(s["kv_wait_s"]["p50"], m["kv_wait_s"]["p50"]),
                "itl_p50": _ratio(s["itl_s"]["p50"], m["itl_s"]["p50"]),
                "output_tok_s": _ratio(s["output_tok_s"], m["output_tok_s"]),
            },
            "t2t_saved_s": _paired_t2t_saved(s_run.records, m_run.records),
            "outputs": _outputs(s_run.records, m_run.records),
        })
    if not rates:
        return None
    all_ok = all(r[mode]["ok"] == r[mode]["requests"] for r in rates for mode in (STREAMED, MONOLITHIC))
    link = (results.meta.get("deployment") or {}).get("link") if isinstance(results.meta, Mapping) else None
    return {"streamed": STREAMED, "monolithic": MONOLITHIC, "link": link, "rates": rates, "all_ok": all_ok,
            "outputs_equal": all(r["outputs"]["equal"] for r in rates)}


def _ms(x: Optional[float]) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _x(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:.2f}"


def markdown(comparison: Mapping[str, Any]) -> str:
    """The comparison as a markdown section (one row per rate and mode, then the ratios)."""
    link = comparison.get("link")
    where = f"link {link['spec']}" if link else "loopback (no --link)"
    lines = [
        "## Layer-wise streaming vs one write (same trace, same run)",
        "",
        f"`{STREAMED}` streams each layer's KV while later layers compute; `{MONOLITHIC}` writes it "
        f"once after prefill ({where}). The first token comes from the prefill worker in both; "
        "the second token (t2t) needs the KV at the decode worker: that is the KV-ready time streaming "
        "shortens. t2t - TTFT is the KV hop left after prefill plus one decode step, free of the prefill "
        "time's noise. Times in ms (p50 / p90).",
        "",
        "| rate | mode | ok | TTFT | t2t (KV ready) | t2t - TTFT | ITL | output tok/s |",
        "|--:|---|--:|--:|--:|--:|--:|--:|",
    ]
    for r in comparison["rates"]:
        for mode in (STREAMED, MONOLITHIC):
            m = r[mode]
            lines.append(
                f"| {r['rate']:g} | {mode} | {m['ok']}/{m['requests']} | {_ms(m['ttft_s']['p50'])} / "
                f"{_ms(m['ttft_s']['p90'])} | {_ms(m['t2t_s']['p50'])} / {_ms(m['t2t_s']['p90'])} | "
                f"{_ms(m['kv_wait_s']['p50'])} / {_ms(m['kv_wait_s']['p90'])} | "
                f"{_ms(m['itl_s']['p50'])} / {_ms(m['itl_s']['p90'])} | {_x(m['output_tok_s'])} |")
    lines += [
        "",
        "| rate | TTFT p50 ratio | t2t p50 ratio | t2t p90 ratio | t2t - TTFT p50 ratio | ITL p50 ratio | "
        "throughput ratio | t2t saved per request p50 (ms) | outputs equal |",
        "|--:|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    for r in comparison["rates"]:
        q, o = r["ratio"], r["outputs"]
        same = "yes" if o["equal"] else f"NO ({len(o['differ'])} differ, {o['without_token_ids']} unchecked)"
        lines.append(f"| {r['rate']:g} | {_x(q['ttft_p50'])} | {_x(q['t2t_p50'])} | {_x(q['t2t_p90'])} | "
                     f"{_x(q['kv_wait_p50'])} | "
                     f"{_x(q['itl_p50'])} | {_x(q['output_tok_s'])} | {_ms(r['t2t_saved_s']['p50'])} | "
                     f"{same} ({o['compared']} requests) |")
    lines += ["", "Ratios are streamed / monolithic: below 1 streaming is faster (throughput: above 1)."]
    if not comparison["all_ok"]:
        lines.append("**Some requests failed**: see the per-mode table and results.json.")
    return "\n".join(lines) + "\n"


def emit(comparison: Mapping[str, Any], *, out: Optional[str]) -> None:
    """Prints the section; with ``out`` appends it to ``report.md`` and writes
    ``stream_comparison.json`` next to it."""
    text = markdown(comparison)
    print(text)
    if not comparison["outputs_equal"]:
        print("warning: streamed and monolithic outputs differ (or were not all checked)", file=sys.stderr)
    if not out:
        return
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "report.md", "a") as f:
        f.write("\n" + text)
    (d / "stream_comparison.json").write_text(json.dumps(comparison, indent=1) + "\n")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m pdkv.bench.serve_stream DIR``: the comparison again from DIR/results.json
    (rewrites DIR/stream_comparison.json and the section of DIR/report.md; prints it)."""
    ap = argparse.ArgumentParser(prog="python -m pdkv.bench.serve_stream", description=main.__doc__)
    ap.add_argument("dir", type=Path, help="a `pdkv bench serve --compare-stream --out` directory")
    args = ap.parse_args(argv)
    results = BenchResults.load(args.dir / "results.json")
    comparison = compare(results)
    if comparison is None:
        raise SystemExit(f"{args.dir}/results.json holds no {STREAMED} and {MONOLITHIC} runs of the same rate")
    (args.dir / "stream_comparison.json").write_text(json.dumps(comparison, indent=1) + "\n")
    text = markdown(comparison)
    report = args.dir / "report.md"
    if report.exists():
        head = report.read_text().split("\n" + text.splitlines()[0])[0]
        report.write_text(head.rstrip("\n") + "\n\n" + text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
