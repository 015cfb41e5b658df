"""``pdkv plan``: the prefill:decode split for a trace and an SLO, from measured capacity.

The command around :mod:`pdkv.lab.plan.model` (the queueing arithmetic, described
there): it builds the trace and SLO from ``pdkv bench serve``'s flags, gets the
per-worker capacity (:mod:`pdkv.lab.plan.measure`: measured here, from a results
directory, or from a ``plan.json``), prints the recommendation and, with ``--sweep``,
runs each split and compares (:mod:`pdkv.lab.plan.sweep`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional, Sequence

from pdkv.errors import InvalidArgument
from pdkv.lab.plan import measure as plan_measure
from pdkv.lab.plan import model
from pdkv.lab.plan import sweep as plan_sweep
from pdkv.lab.plan.model import Slo, Workload, best_split, recommend
from pdkv.lab.serve import cli as serve_cli
from pdkv.lab.serve.modes import resolve_model
from pdkv.lab.serve.prefix import kv_bytes_per_token
from pdkv.serving.capacity import Capacity

__all__ = ["add_arguments", "format_report", "main", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    serve_cli.add_arguments(parser)  # the trace and SLO flags of `pdkv bench serve`
    g = parser.add_argument_group("plan")
    g.add_argument("--serve-model", default="tiny-4m",
                   help="model whose workers are measured: a directory, smollm2 or a generated one (default tiny-4m)")
    g.add_argument("--from-results", metavar="DIR",
                   help="derive capacity from a `pdkv bench serve` results directory instead of measuring")
    g.add_argument("--capacity", metavar="JSON", help="read capacity from a file `pdkv plan --out` wrote")
    g.add_argument("--workers", type=int, help="also rank every split of this many workers (default: the "
                   "recommended split's total)")
    g.add_argument("--prefix-hit-rate", metavar="F|RESULTS", default="0",
                   help="share of prompt tokens a prefix cache serves, in [0, 1): scales the prompt tokens prefill "
                   "computes and the KV moved to decode; or a `pdkv bench serve --prefix-cache` results directory "
                   "or results.json whose measured prefix_hit_rate to use (default 0: no reuse)")
    g.add_argument("--ttft-overhead", type=float, default=0.0,
                   help="seconds the proxy and the KV hop add to TTFT (default 0)")
    g.add_argument("--max-decode-batch", type=int, default=64, help="decode workers' --max-num-seqs (default 64)")
    g.add_argument("--sweep", metavar="SPLITS",
                   help="also run disagg at these P:D splits on the trace, e.g. 1:1,1:2,2:1, and compare")
    g.add_argument("--worker-arg", action="append", default=[],
                   help="extra option for every swept worker, e.g. --worker-arg=--num-blocks=1024 (repeatable)")
    g.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin swept workers to cores")


def _capacity(args: argparse.Namespace, load: Workload, model_dir: Optional[Path]) -> Capacity:
    if args.capacity:
        try:
            return Capacity.from_dict(json.loads(Path(args.capacity).read_text())["capacity"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InvalidArgument(f"--capacity {args.capacity}: {type(e).__name__}: {e}") from None
    if args.from_results:
        return plan_measure.from_results(Path(args.from_results), max_decode_batch=args.max_decode_batch)
    assert model_dir is not None
    return plan_measure.measure(model_dir, load, max_decode_batch=args.max_decode_batch)


def parse_prefix_hit_rate(spec: str) -> tuple[float, str]:
    """``--prefix-hit-rate``: a number in [0, 1), or a results file/directory to read it from.

    Returns
    -------
    (float, str)
        The rate and where it came from.

    Raises
    ------
    InvalidArgument
        A number outside [0, 1), or neither a number nor a readable results file.
    """
    try:
        f = float(spec)
    except ValueError:
        p = Path(spec)
        if not p.exists():
            raise InvalidArgument(f"--prefix-hit-rate takes a number in [0, 1) or a results directory, got "
                                  f"{spec!r} (no such file)") from None
        return plan_measure.prefix_hit_rate_from_results(p)
    if not (math.isfinite(f) and 0 <= f < 1):
        raise InvalidArgument(f"--prefix-hit-rate must be in [0, 1), got {spec}")
    return f, "given"


def format_report(rec: dict[str, Any], budget: Optional[dict[str, Any]], cap: Capacity,
                  prefix: Optional[dict[str, Any]] = None) -> str:
    lines = [f"capacity ({cap.source}): prefill {cap.prefill_fixed_s * 1e3:.2f} ms + "
             f"{cap.prefill_s_per_token * 1e6:.1f} us/token; decode step {cap.step_fixed_s * 1e3:.2f} ms + "
             f"{cap.step_per_seq_s * 1e3:.3f} ms/request",
             f"per worker: {rec['prefill_tok_s_per_worker']:.0f} prompt tokens/s, "
             f"{rec['decode_tok_s_per_worker']:.0f} decode tokens/s within the ITL objective",
             *([f"prefix hit rate {rec['prefix_hit_rate']:.1%} ({(prefix or {}).get('source', 'given')}): "
                f"prefill computes {rec['computed_prompt_tokens_per_request']:.0f} of "
                f"{rec['prompt_tokens_per_request']:.0f} prompt tokens per request, and moves their KV"
                + (f" ({prefix['kv_bytes_per_request'] / 1e6:.2f} MB per request)"
                   if prefix and prefix.get("kv_bytes_per_request") is not None else "")]
              if rec.get("prefix_hit_rate") else []),
             f"at {rec['rate']:g} req/s: ideal {rec['ideal_prefill_workers']:.2f} prefill : "
             f"{rec['ideal_decode_workers']:.2f} decode workers (prefill {rec['prefill_bound']}-bound, "
             f"decode {rec['decode_bound']}-bound)"]
    if rec["split"] is None:
        lines.append(f"no split meets the SLO: {rec['why']}")
    else:
        lines.append(f"recommended split {rec['split']} (capacity left idle by integer counts: "
                     f"{rec['integer_loss']:.0%})")
        lines.append("split   meets  prefill util  TTFT p90 est  decode util  ITL est")
        for s in [rec["recommended"], *rec["neighbours"]]:
            lines.append(_split_row(s))
    if budget is not None:
        lines.append(f"budget {budget['workers']} workers: best split {budget['best']} sustains "
                     f"{budget['best_max_rate']:.3g} req/s within the SLO; the ideal fractional split "
                     f"{budget['fractional_max_rate']:.3g} req/s (integer loss "
                     f"{(budget['integer_loss'] or 0):.0%})")
        for row in budget["splits"]:
            lines.append(f"  {row['split']:>5}: max {row['max_rate']:.3g} req/s")
    return "\n".join(lines)


def _split_row(s: dict[str, Any]) -> str:
    def ms(v: Optional[float]) -> str:
        return "inf" if v is None else f"{v * 1e3:.0f} ms"

    def pct(v: Optional[float]) -> str:
        return "inf" if v is None else f"{v:.0%}"

    p, d = s["prefill"], s["decode"]
    return (f"{s['split']:>5}   {'yes' if s['meets_slo'] else 'no':5}  {pct(p['utilisation']):>12}  "
            f"{ms(p['latency_p90_s']):>12}  {pct(d['utilisation']):>11}  {ms(d['latency_p90_s']):>7}")


def run(args: argparse.Namespace, argv: Sequence[str]) -> dict[str, Any]:
    """Everything ``pdkv plan`` prints, as one JSON-serialisable dict."""
    try:
        slo_b = serve_cli.slo_from_args(args)
        traces, trace_info = serve_cli.build_traces(args)
    except (ValueError, OSError) as e:
        raise InvalidArgument(str(e)) from None
    rate, trace = traces[0]
    hit_rate, hit_source = parse_prefix_hit_rate(str(args.prefix_hit_rate))
    load = Workload.of_trace(trace, rate, prefix_hit_rate=hit_rate)
    rate = load.rate  # a session workload's sessions/s become requests/s
    slo = Slo(slo_b.ttft_s, slo_b.itl_s, args.ttft_overhead)
    model_dir = None
    if not (args.capacity or args.from_results) or args.sweep:
        cache = Path(os.environ.get("PDKV_CACHE_DIR", Path.home() / ".cache" / "pdkv")) / "models"
        model_dir = resolve_model(args.serve_model, cache)
    cap = _capacity(args, load, model_dir)
    rec = recommend(cap, load, slo)
    per_token = kv_bytes_per_token(model_dir)  # known when the model is at hand (measuring or sweeping)
    prefix = {"hit_rate": hit_rate, "source": hit_source, "kv_bytes_per_token": per_token,
              "kv_bytes_per_request": None if per_token is None else per_token * rec["kv_tokens_moved_per_request"]}
    workers = args.workers or (sum(int(x) for x in rec["split"].split(":")) if rec["split"] else None)
    budget = best_split(cap, load, slo, workers) if workers and workers >= 2 else None
    out: dict[str, Any] = {"trace": trace_info, "rate": rate, "num_requests": len(trace),
                           "slo": asdict(slo), "capacity": cap.to_dict(), "recommendation": rec, "budget": budget,
                           "prefix": prefix}
    print(format_report(rec, budget, cap, prefix), flush=True)
    if args.sweep:
        assert model_dir is not None
        out["sweep"] = plan_sweep.sweep(args, model_dir, trace, rate, cap, load, slo, slo_b)
        print(plan_sweep.format_sweep(out["sweep"]), flush=True)
    if args.out:
        d = Path(args.out)
        d.mkdir(parents=True, exist_ok=True)
        (d / "plan.json").write_text(json.dumps(_finite_tree(out), indent=1, allow_nan=False) + "\n")
        print(f"wrote {d / 'plan.json'}", file=sys.stderr)
    return out


def _finite_tree(v: Any) -> Any:
    """``v`` with every infinite or NaN float replaced by None (strict JSON)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: _finite_tree(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite_tree(x) for x in v]
    return v


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="pdkv plan", description=model.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.list_presets:
        return serve_cli.run_from_args(args, argv)
    if args.url:
        parser.error("pdkv plan measures its own workers (or reads --from-results / --capacity); --url is not used")
    if args.workers is not None and args.workers < 2:
        parser.error(f"--workers must be >= 2, got {args.workers}")
    run(args, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
