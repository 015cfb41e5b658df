"""``pdkv plan --sweep 1:1,1:2,2:1``: run the disaggregated deployment at each split on
the same trace and compare what was measured with what :mod:`pdkv.lab.plan.model` predicted.

Each split is a :class:`pdkv.serving.launch.Deployment` (a disagg proxy, ``P`` prefill
and ``D`` decode worker processes on 127.0.0.1, pinned to cores where there are
enough), warmed up, then given the trace once. Per split the sweep reports the
measured TTFT p90, ITL p90, goodput (requests meeting the SLO) and errors next to the
planner's prediction for that split.

"Best split found by the sweep" answers the planner's own question: the split with the
fewest workers in which at least 90% of the requests met the SLO (ties: the higher
goodput); when none did, the split with the highest goodput fraction (none if no
request met the SLO anywhere). The planner's
pick for the same question is the smallest predicted-feasible swept split.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any, Optional

import aiohttp

from pdkv.errors import InvalidArgument
from pdkv.lab.plan.model import Slo, Workload, predict
from pdkv.lab.serve import cli as serve_cli
from pdkv.lab.serve.client import fetch_model, wait_until_ready
from pdkv.serving.capacity import Capacity
from pdkv.serving.launch import Deployment

__all__ = ["format_sweep", "parse_splits", "pick_measured", "pick_predicted", "sweep"]

#: Fraction of a split's requests that must meet the SLO for it to count as meeting it.
GOOD_FRACTION = 0.9


def parse_splits(spec: str) -> list[tuple[int, int]]:
    """``"1:1,1:2,2:1"`` -> [(1, 1), (1, 2), (2, 1)]."""
    out = []
    for part in spec.split(","):
        part = part.strip()
        try:
            p, d = (int(x) for x in part.split(":"))
        except ValueError:
            raise InvalidArgument(f"a split looks like P:D (e.g. 1:2), got {part!r}") from None
        if p < 1 or d < 1:
            raise InvalidArgument(f"a split needs at least one worker per pool, got {part!r}")
        out.append((p, d))
    if not out:
        raise InvalidArgument("--sweep needs at least one P:D split")
    return out


async def _run_split(url: str, trace: Any, rate: float, args: argparse.Namespace, label: str) -> Any:
    await wait_until_ready(url, timeout_s=120)
    async with aiohttp.ClientSession() as session:
        model = args.model or await fetch_model(session, url)
    client = serve_cli.client_kwargs(args, model)
    if args.warmup > 0:
        await serve_cli.warmup(url, requests=args.warmup, **client)
    runs = await serve_cli.run_sweep(url, [(rate, trace)], mode="disagg", pd_ratio=label, cooldown_s=0.0,
                                     progress=args.progress, config={"mode": "disagg", "pd": label}, **client)
    return runs[0]


def sweep(args: argparse.Namespace, model_dir: Path, trace: Any, rate: float, cap: Capacity, load: Workload,
          slo: Slo, bench_slo: Any) -> dict[str, Any]:
    """Runs every split of ``args.sweep`` and returns the comparison (see the module docstring)."""
    worker_args = [a for w in args.worker_arg for a in w.split("=", 1)]
    vocab = json.loads((model_dir / "config.json").read_text()).get("vocab_size")
    if vocab and args.vocab_size > vocab:  # token-id prompts stay inside the model's vocabulary
        args.vocab_size = int(vocab)
    rows = []
    for p, d in parse_splits(args.sweep):
        label = f"{p}:{d}"
        print(f"== sweep disagg {label}", file=sys.stderr, flush=True)
        with Deployment("disagg", model_dir, num_prefill=p, num_decode=d, worker_args=worker_args,
                        pin=args.pin) as dep:
            run = asyncio.run(_run_split(dep.url, trace, rate, args, label))
        s = run.summary(bench_slo)
        rows.append({"split": label, "workers": p + d,
                     "measured": {"ttft_p90_s": s.ttft.p90, "itl_p90_s": s.itl.p90, "num_requests": s.num_requests,
                                  "num_errors": s.num_errors, "errors": dict(s.errors),
                                  "goodput_fraction": s.goodput_fraction,
                                  "goodput_rate": s.goodput_rate},
                     "predicted": predict(cap, load, slo, p, d).to_dict()})
    return {"rate": rate, "good_fraction": GOOD_FRACTION, "splits": rows,
            "best_measured": pick_measured(rows), "planner_pick": pick_predicted(rows)}


def pick_measured(rows: list[dict[str, Any]]) -> Optional[str]:
    """The fewest-worker split with goodput fraction >= GOOD_FRACTION (ties: higher
    goodput), else the highest goodput fraction (None: no request met it anywhere)."""
    if not rows:
        return None
    frac = lambda r: r["measured"]["goodput_fraction"] or 0.0  # noqa: E731
    good = [r for r in rows if frac(r) >= GOOD_FRACTION]
    if good:
        return min(good, key=lambda r: (r["workers"], -frac(r)))["split"]
    best = max(rows, key=frac)
    return best["split"] if frac(best) > 0 else None


def pick_predicted(rows: list[dict[str, Any]]) -> Optional[str]:
    """The fewest-worker swept split the planner predicts meets the SLO (ties: the lower
    of the two pools' utilisation maxima), else None."""
    ok = [r for r in rows if r["predicted"]["meets_slo"]]
    if not ok:
        return None

    def worst_util(r: dict[str, Any]) -> float:
        u = [r["predicted"][k]["utilisation"] for k in ("prefill", "decode")]
        return max(x if x is not None else float("inf") for x in u)

    return min(ok, key=lambda r: (r["workers"], worst_util(r)))["split"]


def format_sweep(result: dict[str, Any]) -> str:
    def ms(v: Optional[float]) -> str:
        return "-" if v is None else f"{v * 1e3:.0f} ms"

    lines = [f"sweep at {result['rate']:g} req/s (meets SLO = at least {result['good_fraction']:.0%} good requests)",
             "split  measured: TTFT p90  ITL p90  good    errors | predicted: TTFT p90  ITL     meets"]
    for r in result["splits"]:
        m, p = r["measured"], r["predicted"]
        lines.append(f"{r['split']:>5}  {ms(m['ttft_p90_s']):>17}  {ms(m['itl_p90_s']):>7}  "
                     f"{(m['goodput_fraction'] or 0):>5.0%}  {m['num_errors']:>6} | "
                     f"{ms(p['prefill']['latency_p90_s']):>18}  {ms(p['decode']['latency_p90_s']):>6}  "
                     f"{'yes' if p['meets_slo'] else 'no'}")
    for r in result["splits"]:
        if r["measured"]["num_errors"]:
            lines.append(f"{r['split']} errors: {r['measured']['errors']}")
    lines.append(f"best split measured: {result['best_measured']}; planner's pick among these: "
                 f"{result['planner_pick'] or 'none predicted to meet the SLO'}")
    return "\n".join(lines)
