"""``pdkv bench serve --compare-compress MODES``: KV compression vs plain, one run.

The same trace is replayed, rate by rate, against ``disagg-tcp`` (plain: the prefill
worker pushes the KV uncompressed over tcp) and one ``disagg-<mode>`` per compression
mode asked for (``lossless``, ``fp8``, ``auto``: the prefill worker started with
``--compress <mode>``), on the same machine and, with ``--link``, behind the same
emulated link. Every prefill worker runs with ``--transports tcp``, so the KV crosses
tcp (where compression applies) also when all workers share this host. Layer-wise
streaming stays on (the prefill worker's default) in every mode.

What compression changes: fewer bytes on the link, at the cost of CPU to encode and
decode. As with streaming (:mod:`pdkv.lab.serve.stream`), the first token is sampled
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
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence

from pdkv.lab.serve.metrics import BenchResults
from pdkv.lab.serve.pair import compare_pair, rows_markdown

__all__ = ["PLAIN", "COMPRESS_MODES", "mode_name", "parse_modes", "modes_for", "prefill_args", "comparing",
           "parse_kv_wire", "fetch_kv_wire", "wire_summary", "compare", "markdown", "emit"]

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


_WIRE_LINE = re.compile(r'^pdkv_kv_wire_bytes_total\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)$')
_KV_LINE = re.compile(r'^pdkv_kv_transfer_bytes_total\{[^}]*\}\s+(?P<value>\S+)$')


def parse_kv_wire(metrics_text: str) -> Dict[str, Any]:
    """A prefill worker's ``/metrics`` -> ``{"kv_bytes": KV bytes pushed, "wire_bytes":
    {codec: bytes on the wire}}`` (``pdkv_kv_transfer_bytes_total`` and
    ``pdkv_kv_wire_bytes_total``, summed over transports; codec ``none``: sent as is)."""
    kv = 0.0
    wire: Dict[str, float] = {}
    for line in metrics_text.splitlines():
        m = _WIRE_LINE.match(line)
        if m:
            codec = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"])).get("codec", "")
            wire[codec] = wire.get(codec, 0.0) + float(m["value"])
            continue
        m = _KV_LINE.match(line)
        if m:
            kv += float(m["value"])
    return {"kv_bytes": kv, "wire_bytes": wire}


def merge_kv_wire(parts: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """Several workers' :func:`parse_kv_wire` results, summed."""
    wire: Dict[str, float] = {}
    for p in parts:
        for codec, n in p["wire_bytes"].items():
            wire[codec] = wire.get(codec, 0.0) + n
    return {"kv_bytes": sum(p["kv_bytes"] for p in parts), "wire_bytes": wire}


async def fetch_kv_wire(prefill_urls: Sequence[str]) -> Optional[Dict[str, Any]]:
    """The prefill workers' KV and wire bytes so far (:func:`parse_kv_wire`, summed), or
    None when a worker's ``/metrics`` cannot be read (the report then goes without)."""
    import aiohttp

    parts = []
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            for url in prefill_urls:
                async with session.get(url.rstrip("/") + "/metrics") as r:
                    parts.append(parse_kv_wire(await r.text()))
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        print(f"warning: could not read a prefill worker's /metrics: {exc}", file=sys.stderr)
        return None
    return merge_kv_wire(parts)


def wire_summary(kv_wire: Optional[Mapping[str, Any]]) -> Optional[Dict[str, Any]]:
    """``{"ratio": KV bytes / wire bytes, "codecs": {codec: share of the wire bytes}}``."""
    if not kv_wire or not kv_wire["kv_bytes"]:
        return None
    total = sum(kv_wire["wire_bytes"].values())
    if not total:
        return None
    return {"ratio": kv_wire["kv_bytes"] / total,
            "codecs": {c: n / total for c, n in sorted(kv_wire["wire_bytes"].items())}}


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
        "all_ok", "lossless_outputs_equal"}``: ratios are compressed / plain; each pair
        also has ``wire``: per mode, :func:`wire_summary` of its prefill workers'
        counters (None when they were not read).
    """
    modes = {run.mode for run in results.runs}
    pairs = [c for m in COMPRESS_MODES if mode_name(m) in modes
             for c in [compare_pair(results, mode_name(m), PLAIN)] if c is not None]
    if not pairs:
        return None
    for c in pairs:  # the prefill workers' counters over each mode's whole run (warm-up included)
        c["wire"] = {m: wire_summary(next((r.config.get("kv_wire") for r in results.runs if r.mode == m), None))
                     for m in (c["variant"], c["baseline"])}
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
        wire = [f"{m} {_wire_text(w)}" for m, w in c.get("wire", {}).items() if w is not None]
        if wire:
            lines += ["", "KV bytes / wire bytes over the mode's run (warm-up included), and the codecs that carried "
                      "them: " + "; ".join(wire) + "."]
    if not comparison["all_ok"]:
        lines += ["", "**Some requests failed**: see the per-mode table and results.json."]
    if comparison["lossless_outputs_equal"] is False:
        lines += ["", "**Lossless outputs differ from plain**: that is a bug (see results.json)."]
    return "\n".join(lines) + "\n"


def _wire_text(w: Mapping[str, Any]) -> str:
    shares = ", ".join(f"{c} {share:.0%}" for c, share in w["codecs"].items())
    return f"{w['ratio']:.2f}x ({shares})"


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
