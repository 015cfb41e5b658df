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
from typing import Any, Dict, Mapping, Optional, Sequence

from pdkv.lab.serve.metrics import BenchResults
from pdkv.lab.serve.pair import compare_pair, rows_markdown

__all__ = ["STREAMED", "MONOLITHIC", "comparing", "compare", "markdown", "emit"]

STREAMED = "disagg"
MONOLITHIC = "disagg-nostream"


def comparing(args: argparse.Namespace) -> bool:
    """Whether this run measures both modes of the comparison."""
    modes = {m.strip() for m in str(getattr(args, "modes", "")).split(",")}
    return bool(getattr(args, "compare_stream", False)) or {STREAMED, MONOLITHIC} <= modes


def compare(results: BenchResults) -> Optional[Dict[str, Any]]:
    """The comparison of every rate both modes ran, or None when one mode is missing.

    Returns
    -------
    dict
        :func:`pdkv.lab.serve.pair.compare_pair` of streamed against monolithic, plus
        ``"streamed": "disagg", "monolithic": "disagg-nostream"``: each rate holds both
        modes' summaries (``ttft_s``, ``t2t_s``, ``itl_s`` statistics in seconds,
        ``output_tok_s``), ``ratio`` (streamed / monolithic of the p50s and of
        throughput), ``t2t_saved_s`` (per-request monolithic - streamed t2t) and
        ``outputs``.
    """
    c = compare_pair(results, STREAMED, MONOLITHIC)
    return None if c is None else {"streamed": STREAMED, "monolithic": MONOLITHIC, **c}


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
        *rows_markdown({"variant": STREAMED, "baseline": MONOLITHIC, **comparison}),
        "",
        "Ratios are streamed / monolithic: below 1 streaming is faster (throughput: above 1).",
    ]
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
    """``python -m pdkv.lab.serve.stream DIR``: the comparison again from DIR/results.json
    (rewrites DIR/stream_comparison.json and the section of DIR/report.md; prints it)."""
    ap = argparse.ArgumentParser(prog="python -m pdkv.lab.serve.stream", description=main.__doc__)
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
