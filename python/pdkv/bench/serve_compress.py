"""``pdkv bench serve --compare-compress MODES``: KV compression vs plain, one run.

The same trace is replayed, rate by rate, against ``disagg-tcp`` (plain: the prefill
worker pushes the KV uncompressed over tcp) and one ``disagg-<mode>`` per compression
mode asked for (``lossless``, ``fp8``, ``auto``: the prefill worker started with
``--compress <mode>``), on the same machine and, with ``--link``, behind the same
emulated link. Every prefill worker runs with ``--transports tcp``, so the KV crosses
tcp (where compression applies) also when all workers share this host. Layer-wise
streaming stays on (the prefill worker's default) in every mode.

What compression changes: fewer bytes on the link, at the cost of CPU to encode and
decode. As with streaming (:mod:`pdkv.bench.serve_stream`), the first token is sampled
by the prefill worker, so TTFT does not wait for the KV; the **time to the second
token** (t2t) and t2t - TTFT are where a shorter KV hop shows, and the ratios
compressed / plain of those p50s are the figures. Outputs are compared token for
token: lossless must be equal; fp8 is lossy and may differ (counted, not an error).

Example::

    pdkv bench serve --compare-compress lossless,fp8 --serve-model tiny-40m --prompt-len 1024 \\
        --output-len 8 --rates 0.1 --num-requests 5 --link 100mbit --out bench/results/compress/serve-100mbit
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from .serve_metrics import BenchResults
from .serve_pair import compare_pair, rows_markdown

__all__ = ["PLAIN", "COMPRESS_MODES", "mode_name", "parse_modes", "modes_for", "prefill_args", "comparing",
           "compare", "markdown", "emit"]

PLAIN = "disagg-tcp"
COMPRESS_MODES = ("lossless", "fp8", "auto")
_PREFIX = "disagg-"


def mode_name(compress: str) -> str:
    """The serving mode that runs disagg with ``--compress compress``."""
    return _PREFIX + compress


def parse_modes(spec: str) -> List[str]:
    """``"lossless,fp8"`` -> ``["lossless", "fp8"]``; ValueError naming what is unknown."""
    modes = [m.strip() for m in spec.split(",") if m.strip()]
    bad = [m for m in modes if m not in COMPRESS_MODES]
    if not modes or bad:
        raise ValueError(f"--compare-compress takes {', '.join(COMPRESS_MODES)} (comma-separated), got {spec!r}")
    return list(dict.fromkeys(modes))


def modes_for(compress_modes: Sequence[str]) -> List[str]:
    """The serving modes of a comparison: plain first, then one per compression mode."""
    return [PLAIN, *(mode_name(m) for m in compress_modes)]


def prefill_args(mode: str) -> Optional[List[str]]:
    """The prefill worker's extra flags for ``mode`` (None: not a mode of this module)."""
    if mode == PLAIN:
        return ["--transports", "tcp"]
    if mode.startswith(_PREFIX) and mode[len(_PREFIX):] in COMPRESS_MODES:
        return ["--transports", "tcp", "--compress", mode[len(_PREFIX):]]
    return None


def comparing(args: argparse.Namespace) -> bool:
    """Whether this run compares compression modes with plain."""
    return bool(getattr(args, "compare_compress", None))


def compare(results: BenchResults) -> Optional[Dict[str, Any]]:
    """Every compressed mode of ``results`` against :data:`PLAIN`, or None when either
    side is missing.

    Returns
    -------
    dict
        ``{"plain": "disagg-tcp", "link", "pairs": [compare_pair(compressed, plain), ...],
        "all_ok", "lossless_outputs_equal"}``: ratios are compressed / plain.
    """
    modes = {run.mode for run in results.runs}
    pairs = [c for m in COMPRESS_MODES if mode_name(m) in modes
             for c in [compare_pair(results, mode_name(m), PLAIN)] if c is not None]
    if not pairs:
        return None
    lossless = [c for c in pairs if c["variant"] == mode_name("lossless")]
    return {"plain": PLAIN, "link": pairs[0]["link"], "pairs": pairs, "all_ok": all(c["all_ok"] for c in pairs),
            "lossless_outputs_equal": all(c["outputs_equal"] for c in lossless) if lossless else None}


def markdown(comparison: Mapping[str, Any]) -> str:
    """The comparison as a markdown section: one pair of tables per compressed mode."""
    link = comparison.get("link")
    where = f"link {link['spec']}" if link else "loopback (no --link)"
    lines = [
        "## KV compression vs plain (same trace, same run)",
        "",
        f"`{PLAIN}` pushes the KV as is over tcp; each `disagg-<mode>` pushes it with the prefill worker's "
        f"`--compress <mode>` ({where}; layer-wise streaming in every mode). The first token comes from the "
        "prefill worker; the second (t2t) needs the KV at the decode worker, so t2t and t2t - TTFT (the KV "
        "hop left after prefill plus one decode step) are where fewer bytes on the link show. Times in ms "
        "(p50 / p90). Ratios are compressed / plain: below 1 compression is faster (throughput: above 1). "
        "Lossless outputs must equal plain's token for token; fp8 is lossy and may differ.",
    ]
    for c in comparison["pairs"]:
        lines += ["", f"### {c['variant']} vs {c['baseline']}", "", *rows_markdown(c)]
    if not comparison["all_ok"]:
        lines += ["", "**Some requests failed**: see the per-mode table and results.json."]
    if comparison["lossless_outputs_equal"] is False:
        lines += ["", "**Lossless outputs differ from plain**: that is a bug (see results.json)."]
    return "\n".join(lines) + "\n"


def emit(comparison: Mapping[str, Any], *, out: Optional[str]) -> None:
    """Prints the section; with ``out`` appends it to ``report.md`` and writes
    ``compress_comparison.json`` next to it."""
    text = markdown(comparison)
    print(text)
    if comparison["lossless_outputs_equal"] is False:
        print("warning: lossless outputs differ from plain", file=sys.stderr)
    if not out:
        return
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "report.md", "a") as f:
        f.write("\n" + text)
    (d / "compress_comparison.json").write_text(json.dumps(comparison, indent=1) + "\n")
