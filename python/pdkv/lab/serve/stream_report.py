"""Tables and a plot from :mod:`pdkv.lab.serve.streambench` reports (issue 15's measurements).

``python -m pdkv.lab.serve.stream_report DIR [--plot FILE.png]`` reads every ``*.json``
report in DIR (``bench/stream_sweep.sh`` writes them) and prints a markdown table: per
model, prompt length and link, the prefill time, when the decode side holds the KV
(streamed vs one write after prefill), the transfer left exposed after prefill, the
share of it streaming hid, whether the target (exposed <= one layer's transfer +
10% of the whole) holds, and the stream's throughput relative to one write of the same
bytes with nothing computing. ``--plot`` also draws the exposed transfer per path (matplotlib, optional).

Where the target stops holding: streaming leaves about
``max(one layer's transfer, whole transfer - prefill + one layer's transfer)`` after
prefill, so the bound (one layer + 10% of the whole) holds while the whole transfer
takes at most ``prefill / 0.9``: while the link carries at least
``0.9 * KV bytes / prefill time``. Each row gives that rate for its measured prefill
(``target holds down to``) and the per-layer times on the link and in compute.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

_LINK_ORDER = {"lo": 0, "10gbit": 1, "1gbit": 2, "100mbit": 3}


def load(directory: Path) -> list[dict[str, Any]]:
    """Every report in ``directory``, ordered by model, prompt length, then link speed."""
    reports = [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))]
    reports = [r for r in reports if "streamed" in r and "preset" in r]  # streambench reports only
    for r in reports:
        r["link_name"] = r.get("link", {}).get("spec", "lo") if r.get("link") else "lo"
    return sorted(reports, key=lambda r: (r["preset"], r["prompt_len"], _LINK_ORDER.get(r["link_name"], 9)))


def min_link_bps(report: dict[str, Any]) -> float:
    """The slowest link (bit/s) at which the target still holds for this row's prefill
    time: the whole transfer must take at most prefill / 0.9 (module docstring)."""
    return 0.9 * report["kv_bytes"] * 8 / report["streamed"]["prefill_s"]


def per_layer_s(report: dict[str, Any]) -> tuple[float, float]:
    """(one layer on the link alone, one layer of prefill compute), seconds."""
    layers = report["layers"]
    return report["monolithic"]["transfer_only_s"] / layers, report["streamed"]["prefill_s"] / layers


def _rate(bps: float) -> str:
    return f"{bps / 1e9:.1f} Gbit/s" if bps >= 1e9 else f"{bps / 1e6:.0f} Mbit/s"


def where_target_stops(reports: list[dict[str, Any]]) -> str:
    """One sentence per (model, prompt): the link rate below which the target fails,
    and the rows measured below it or missing it."""
    lines = []
    for r in reports:
        link_layer, compute_layer = per_layer_s(r)
        regime = "link-bound" if link_layer > compute_layer else "compute-bound"
        lines.append(f"- {r['preset']} {r['prompt_len']} tokens on {r['link_name']}: a layer takes "
                     f"{link_layer * 1e3:.1f} ms on the link vs {compute_layer * 1e3:.1f} ms of compute ({regime}); "
                     f"the target holds down to about {_rate(min_link_bps(r))} for this prefill time; "
                     f"measured: {'met' if r['target_met'] else 'missed'}.")
    return "\n".join(lines)


def table(reports: list[dict[str, Any]]) -> str:
    ms = lambda s: f"{s * 1e3:.0f}" if s >= 0.01 else f"{s * 1e3:.1f}"  # noqa: E731
    rows = ["| model | prompt | link | KV MiB | prefill ms | KV ready: streamed / one write (ms) | ratio | "
            "exposed after prefill: streamed / one write (ms) | hidden | target | transfer alone: stream / write GB/s "
            "| layer: link / compute (ms) | target holds down to |",
            "|---|--:|---|--:|--:|--:|--:|--:|--:|---|--:|--:|--:|"]
    for r in reports:
        s, m = r["streamed"], r["monolithic"]
        hidden = "-" if r["hidden_share"] is None else f"{100 * r['hidden_share']:.0f}%"
        rows.append(f"| {r['preset']} | {r['prompt_len']} | {r['link_name']} | {r['kv_bytes'] / 2**20:.0f} | "
                    f"{ms(m['prefill_s'])} | {ms(s['kv_ready_s'])} / {ms(m['kv_ready_s'])} | "
                    f"{r['kv_ready_ratio']:.2f} | {ms(s['exposed_s'])} / {ms(m['exposed_s'])} | {hidden} | "
                    f"{'met' if r['target_met'] else 'missed'} | {r['transfer_only_throughput_ratio']:.2f} | "
                    f"{ms(per_layer_s(r)[0])} / {ms(per_layer_s(r)[1])} | {_rate(min_link_bps(r))} |")
    return "\n".join(rows)


def plot(reports: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['preset']}\n{r['prompt_len']} tok\n{r['link_name']}" for r in reports]
    x = list(range(len(reports)))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(reports)), 4.5))
    # The transfer left after prefill (KV at the decode side minus first token), per path:
    # prefill times themselves vary with the machine's load, this difference does not.
    ax.bar([i - 0.2 for i in x], [r["monolithic"]["exposed_s"] * 1e3 for r in reports], 0.4,
           label="one write after prefill")
    ax.bar([i + 0.2 for i in x], [r["streamed"]["exposed_s"] * 1e3 for r in reports], 0.4,
           label="layer-wise streaming")
    ax.scatter([i + 0.2 for i in x], [r["target_exposed_s"] * 1e3 for r in reports], marker="_", s=300,
               color="black", zorder=3, label="target: one layer + 10% of the write")
    ax.set_yscale("log")
    ax.set_ylabel("transfer exposed after prefill (ms)")
    ax.set_xticks(x)
    ax.set_xticklabels(labels, fontsize=7)
    ax.legend(fontsize=8)
    ax.set_title("pdkv: KV transfer left after prefill, streaming vs one write (medians, same run)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdkv.lab.serve.stream_report", description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--plot", type=Path, default=None, help="also draw the exposed transfer times into this PNG")
    args = ap.parse_args(argv)
    reports = load(args.dir)
    if not reports:
        raise SystemExit(f"no streambench reports (*.json) in {args.dir}")
    print(table(reports))
    print()
    print(where_target_stops(reports))
    if args.plot:
        plot(reports, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
