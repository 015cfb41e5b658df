"""``pdkv bench serve --url``: sweep request rates against one OpenAI-compatible server.

Example (every flag is optional except ``--url``)::

    pdkv bench serve --url http://127.0.0.1:8000 --preset mixed --rates 0.5,1,2 \\
        --duration 60 --out bench/results/serve-x

For each rate it generates the preset's trace at that rate (same seed, so the same
requests, only closer together: see :mod:`pdkv.lab.serve.trace`), replays it with
:func:`~pdkv.lab.serve.client.run_trace`, waits for every answer, and then writes
``results.json``, ``report.md``, ``itl_cdf.png``, ``rate_sweep.png`` and the traces it
used (``traces/rate-<r>.jsonl``) into ``--out``, and prints the table and the
recommendation.

A driver that launches the serving modes itself (the multi-mode ``pdkv bench serve``)
reuses the pieces::

    add_arguments(parser)                  # plus its own --modes etc.
    args = parser.parse_args(argv)
    traces, info = build_traces(args)      # the same (rate, trace) list for every mode
    runs = []
    for mode in modes:                     # launch mode, wait_until_ready(url), then:
        runs += asyncio.run(run_sweep(url, traces, mode=mode, pd_ratio=...,
                                      **client_kwargs(args, model)))
    results = BenchResults(runs, slo_from_args(args),
                           build_meta(args, model=model, trace_info=info, started_at=t0, argv=argv))
    emit_results(results, out=args.out, traces=traces)
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import math
import os
import platform
import shlex
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from pdkv.lab.serve import prefix as serve_prefix
from pdkv.lab.serve.client import ServerUnavailable, fetch_model, normalize_base_url, run_trace, wait_until_ready
from pdkv.lab.serve.client_sessions import run_sessions
from pdkv.lab.serve.metrics import SLO, BenchResults, RunResult
from pdkv.lab.serve.report import markdown_table, recommend, sanity_notes, write_report
from pdkv.lab.serve.trace import (
    PRESETS,
    Trace,
    TraceRequest,
    TraceSpec,
    get_preset,
    load_trace,
    parse_arrival,
    parse_length_dist,
    saturation_rate,
    save_trace,
    utilisation,
)
from pdkv.lab.serve.trace_sessions import (
    SESSION_PRESETS,
    WORKLOADS,
    SessionTrace,
    get_session_preset,
    load_session_trace,
)

__all__ = [
    "add_arguments",
    "build_meta",
    "build_traces",
    "client_kwargs",
    "emit_results",
    "main",
    "run_from_args",
    "run_sweep",
    "slo_from_args",
    "warmup",
]


async def warmup(
    url: str, *, model: str, requests: int = 2, prompt_len: int = 16, output_len: int = 4, **client_kwargs: Any
) -> None:
    """Send a few small requests one after the other and discard them.

    First requests often pay one-off costs (lazy initialisation, allocator growth,
    connection set-up) that do not belong in the measurement.

    Parameters
    ----------
    url : str
        Server base URL.
    model : str
        Model name.
    requests : int
        How many.
    prompt_len, output_len : int
        Their size in tokens.
    **client_kwargs
        Passed to :func:`~pdkv.lab.serve.client.run_trace` (endpoint, prompt kind...).
    """
    for i in range(requests):
        await run_trace(url, [TraceRequest(i, 0.0, prompt_len, output_len)], model=model, **client_kwargs)


async def run_sweep(
    url: str,
    traces: Sequence[Tuple[float, Union[Trace, SessionTrace]]],
    *,
    mode: str = "url",
    pd_ratio: Optional[str] = None,
    config: Optional[Dict[str, Any]] = None,
    cooldown_s: float = 1.0,
    progress: bool = True,
    metrics_urls: Sequence[str] = (),
    block_tokens: int = 16,
    kv_token_bytes: Optional[int] = None,
    **client_kwargs: Any,
) -> List[RunResult]:
    """Replay one trace per rate against ``url``, one rate after the other.

    Parameters
    ----------
    url : str
        Server base URL.
    traces : sequence of (float, Trace or SessionTrace)
        ``(rate, trace)`` pairs, run in the given order. A
        :class:`~pdkv.lab.serve.trace_sessions.SessionTrace` is run by
        :func:`~pdkv.lab.serve.client_sessions.run_sessions` (its rate is in sessions/s).
    mode : str
        Label of the deployment (``"colocated"``, ``"disagg"``, ``"url"``...).
    pd_ratio : str, optional
        Prefill:decode ratio label for disaggregated deployments (``"1:1"``).
    config : dict, optional
        Details of the deployment stored with each run.
    cooldown_s : float
        Pause between rates, so one rate's tail does not bleed into the next.
    progress : bool
        Progress line on stderr.
    metrics_urls : sequence of str
        Workers whose ``/metrics`` are read before and after each rate: each run then
        gets its prefix-reuse figures (:func:`pdkv.lab.serve.prefix.prefix_summary`).
        Session workloads get them without workers too (the worker figures are then
        ``None``).
    block_tokens : int
        The workers' KV block size, for the perfect-cache bound.
    kv_token_bytes : int, optional
        The model's KV bytes per token (to relate ``kv_bytes`` to the new tokens' KV).
    **client_kwargs
        Passed to :func:`~pdkv.lab.serve.client.run_trace` (``model``,
        ``concurrency``, ``endpoint``, ...).

    Returns
    -------
    list of RunResult
        One per rate, in order.
    """
    runs: List[RunResult] = []
    for i, (rate, trace) in enumerate(traces):
        if i and cooldown_s > 0:
            await asyncio.sleep(cooldown_s)
        sessions = isinstance(trace, SessionTrace)
        label = f"{mode}{' ' + pd_ratio if pd_ratio else ''} @ {rate:g} {'sessions' if sessions else 'req'}/s"
        before = await serve_prefix.fetch_counters(metrics_urls) if metrics_urls else None
        if sessions:
            records = await run_sessions(url, trace, progress=progress, label=label, **client_kwargs)
        else:
            records = await run_trace(url, trace, progress=progress, label=label, **client_kwargs)
        run = RunResult(mode=mode, rate=rate, records=records, pd_ratio=pd_ratio, config=dict(config or {}))
        if before is not None:
            await asyncio.sleep(0.2)  # counters are bumped as a request ends; let the last ones land
            after = await serve_prefix.fetch_counters(metrics_urls)
            run.prefix = serve_prefix.prefix_summary(records, serve_prefix.metric_deltas(before, after),
                                                     block_tokens=block_tokens, kv_token_bytes=kv_token_bytes)
        elif sessions:
            run.prefix = serve_prefix.prefix_summary(records, None, block_tokens=block_tokens)
        runs.append(run)
    return runs


def _floats(text: str) -> List[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise argparse.ArgumentTypeError(f"rates must be > 0, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``--url`` mode's options to ``parser`` (for a parent CLI)."""
    src = parser.add_argument_group("trace")
    src.add_argument("--preset", default="mixed", help=f"trace preset: {', '.join(PRESETS)} (default: mixed)")
    src.add_argument(
        "--workload", choices=WORKLOADS, default="requests",
        help="requests: independent requests of --preset (default); multi-turn | agentic: sessions whose next turn "
        "is sent after the previous answer plus a think time, with the history (answer included) as its prefix "
        "(see docs/benchmarks.md, prefix reuse). For sessions, --rates is new sessions per second",
    )
    src.add_argument("--trace", metavar="JSONL", help="replay this JSONL trace instead of a preset")
    src.add_argument("--time-scale", type=float, default=1.0, help="multiply --trace timestamps by this to get seconds")
    src.add_argument(
        "--rates", type=_floats,
        help="comma-separated request rates (req/s); default: the preset's rate, or the trace as recorded",
    )
    src.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per rate (default 60)")
    src.add_argument("--num-requests", type=int, help="at most this many requests per rate")
    src.add_argument("--seed", type=int, default=0, help="trace seed (default 0)")
    src.add_argument("--arrival", help="override the arrival process: poisson, periodic or gamma:CV")
    src.add_argument(
        "--prompt-len",
        help="override prompt lengths, e.g. 1024, uniform:64:512, lognormal:256:0.5:16:2048, 0.8*128+0.2*1024",
    )
    src.add_argument("--output-len", help="override output lengths (same syntax)")
    src.add_argument(
        "--list-presets", action="store_true", help="print the presets and their estimated saturation, then exit"
    )
    ses = parser.add_argument_group("sessions (--workload multi-turn | agentic)")
    ses.add_argument("--sessions", type=int, help="at most this many sessions per rate (default: --duration of arrivals)")
    ses.add_argument("--turns", help="turns per session, a length spec (e.g. 4, uniform:3:6)")
    ses.add_argument("--think-time", type=float, help="mean seconds between an answer and the next turn (exponential)")
    ses.add_argument("--shared-len", type=int, help="tokens of the prefix shared by every session")
    ses.add_argument("--turn-len", help="new tokens of each later turn (user message or tool output), a length spec; "
                     "--prompt-len sets the first message, --output-len the answers")
    ses.add_argument("--max-context", type=int, help="end a session before a turn whose prompt + answer would pass "
                     "this many tokens (default 2000)")
    ses.add_argument("--block-tokens", type=int, default=16,
                     help="the workers' KV block size, for the perfect-cache hit rate (default 16)")

    cli = parser.add_argument_group("client")
    cli.add_argument("--url", help="OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    cli.add_argument("--model", help="model name (default: the first one /v1/models lists)")
    cli.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    cli.add_argument(
        "--prompt-format", choices=("tokens", "text"),
        help="token-id or text prompts (default: tokens for completions, text for chat)",
    )
    cli.add_argument(
        "--vocab-size", type=int, default=1000, help="token ids are drawn from [100, VOCAB_SIZE) (default 1000)"
    )
    cli.add_argument("--concurrency", type=int, help="cap on requests in flight (default: none)")
    cli.add_argument("--temperature", type=float, default=0.0)
    cli.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false", help='do not send "ignore_eos": true')
    cli.add_argument(
        "--no-continuous-usage", dest="continuous_usage", action="store_false",
        help='do not send stream_options "continuous_usage_stats": true (for servers that reject it); '
        "multi-token chunks then count as one token and ITL is per chunk",
    )
    cli.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request (default 600)")
    cli.add_argument("--warmup", type=int, default=2, help="small requests sent before measuring (default 2)")
    cli.add_argument("--wait-ready", type=float, default=0.0, help="wait up to this many seconds for /health first")
    cli.add_argument("--cooldown", type=float, default=1.0, help="pause between rates in seconds (default 1)")
    cli.add_argument("--mode-name", default="url", help="label of this deployment in the results (default: url)")
    cli.add_argument("--worker-metrics", metavar="URLS",
                     help="comma-separated worker URLs whose /metrics give the prefix-reuse figures (hit rate, "
                     "prefill tokens, KV bytes) of a --url run")
    cli.add_argument("--no-progress", dest="progress", action="store_false")

    out = parser.add_argument_group("report")
    out.add_argument("--ttft-slo", type=float, default=2.0, help="TTFT objective in seconds (default 2)")
    out.add_argument("--itl-slo", type=float, default=0.1, help="ITL objective in seconds (default 0.1)")
    out.add_argument(
        "--itl-percentile", type=float, default=90.0,
        help="per-request ITL percentile checked against --itl-slo (default 90)",
    )
    out.add_argument("--out", help="directory for results.json, report.md, PNGs and traces")
    out.add_argument("--no-plots", dest="plots", action="store_false")


def build_traces(args: argparse.Namespace) -> Tuple[List[Tuple[float, Trace]], Dict[str, Any]]:
    """Build the ``(rate, trace)`` list and the trace provenance from parsed arguments.

    Raises
    ------
    ValueError
        Bad preset, length or arrival specification, or a trace that cannot be rescaled.
    """
    if getattr(args, "workload", "requests") != "requests" or (args.trace and str(args.trace).endswith(".json")):
        return build_session_traces(args)  # a saved session trace is .json (request traces are .jsonl)
    if args.trace:
        base = load_trace(args.trace, time_scale=args.time_scale, seed=args.seed)
        if args.num_requests is not None:
            base = Trace(base.requests[: args.num_requests], base.seed, base.info)
        info = {**base.info, "description": f"replay of {args.trace}"}
        if not args.rates:
            observed = base.mean_rate
            return [(observed if math.isfinite(observed) else 0.0, base)], info
        return [(r, base.scaled_to_rate(r)) for r in args.rates], info
    spec: TraceSpec = get_preset(args.preset)
    overrides: Dict[str, Any] = {}
    if args.arrival:
        overrides["arrival"] = parse_arrival(args.arrival, spec.rate)
    if args.prompt_len:
        overrides["prompt_len"] = parse_length_dist(args.prompt_len)
    if args.output_len:
        overrides["output_len"] = parse_length_dist(args.output_len)
    if overrides:  # "preset*": the preset with some parameters replaced
        changed = ", ".join(f"{k} -> {v.spec()}" for k, v in overrides.items())
        description = f"{spec.description} Overridden: {changed}."
        spec = replace(spec, name=spec.name + "*", description=description, **overrides)
    rates = args.rates or [spec.rate]
    traces = [
        (r, spec.with_rate(r).generate(seed=args.seed, duration_s=args.duration, num_requests=args.num_requests))
        for r in rates
    ]
    info = {
        "preset": spec.name,
        "description": f"{spec.name}: {spec.description}",
        "spec": spec.to_dict(),
        "seed": args.seed,
        "duration_s": args.duration,
        "num_requests": args.num_requests,
    }
    return traces, info


def build_session_traces(args: argparse.Namespace) -> Tuple[List[Tuple[float, Any]], Dict[str, Any]]:
    """The ``(rate, SessionTrace)`` list of ``--workload multi-turn | agentic`` and its provenance.

    ``--rates`` are new sessions per second. Each rate gets the content seed
    ``--seed + i`` (its i-th place in ``--rates``): a deployment keeps its prefix cache
    from one rate to the next, so the same prompts again would hit what the previous
    rate left behind, and no rate would measure a cold start. All modes still run the
    same sessions at the same rate. ``--trace FILE`` replays a session trace that an
    earlier run saved (``traces/rate-<r>.json``).

    Raises
    ------
    ValueError
        A bad length spec or option, or a session workload combined with options it cannot use.
    """
    if args.endpoint != "completions" or (args.prompt_format or "tokens") != "tokens":
        raise ValueError("session workloads send token-id prompts to /v1/completions "
                         "(no --endpoint chat, no --prompt-format text)")
    if args.arrival:
        raise ValueError("--arrival does not apply to session workloads (sessions start as a Poisson process)")
    if args.trace:
        base = load_session_trace(args.trace)
        info = {**base.info, "description": f"replay of {args.trace}"}
        rate = float(base.info.get("session_rate") or 0)
        if not args.rates:
            return [(rate, base)], info
        return [(r, base.scaled_to_rate(r)) for r in args.rates], info
    spec = get_session_preset(args.workload)
    overrides: Dict[str, Any] = {}
    for flag, key in (("prompt_len", "first_len"), ("turn_len", "turn_len"), ("output_len", "output_len"),
                      ("turns", "turns")):
        if getattr(args, flag, None):
            overrides[key] = parse_length_dist(getattr(args, flag))
    for flag, key in (("think_time", "think_s"), ("shared_len", "shared_len"), ("max_context", "max_context")):
        if getattr(args, flag, None) is not None:
            overrides[key] = getattr(args, flag)
    if args.sessions is not None and args.sessions < 1:
        raise ValueError(f"--sessions must be >= 1, got {args.sessions}")
    if args.num_requests is not None:
        raise ValueError("--num-requests does not apply to session workloads: use --sessions")
    if args.block_tokens < 1:
        raise ValueError(f"--block-tokens must be >= 1, got {args.block_tokens}")
    if overrides:
        spec = replace(spec, name=spec.name + "*", **overrides)
    rates = args.rates or [spec.rate]
    traces = [(r, spec.with_rate(r).generate(seed=args.seed + i, duration_s=None if args.sessions else args.duration,
                                             num_sessions=args.sessions))
              for i, r in enumerate(rates)]
    info = {
        "workload": spec.name,
        "description": f"{spec.name}: {spec.description}",
        "spec": spec.to_dict(),
        "seed": args.seed,
        "seeds": {f"{r:g}": args.seed + i for i, (r, _) in enumerate(traces)},
        "duration_s": None if args.sessions else args.duration,
        "num_sessions": args.sessions,
        "requests": {f"{r:g}": t.num_requests for r, t in traces},
    }
    return traces, info


def _list_presets() -> str:
    lines = ["preset          rate    rho(1 core)  saturation(1 core)  prompt / output"]
    for name, s in PRESETS.items():
        lines.append(
            f"{name:<15} {s.rate:<7g} {utilisation(s):<12.2f} {saturation_rate(s):<19.2f} "
            f"{s.prompt_len.spec()} / {s.output_len.spec()}"
        )
    lines.append("(rho and saturation from pdkv.lab.serve.trace.CostModel: a ~40M model on one CPU core)")
    lines.append("")
    lines.append("session workload (--workload)  sessions/s  description")
    for name, ss in SESSION_PRESETS.items():
        lines.append(f"{name:<30} {ss.session_rate:<11g} {ss.description}")
    return "\n".join(lines)


def client_kwargs(args: argparse.Namespace, model: str) -> Dict[str, Any]:
    """The :func:`~pdkv.lab.serve.client.run_trace` keyword arguments that ``args`` select.

    Parameters
    ----------
    args : argparse.Namespace
        Parsed by a parser that :func:`add_arguments` set up.
    model : str
        Model name (resolved with :func:`~pdkv.lab.serve.client.fetch_model` if not given).
    """
    return dict(
        model=model,
        concurrency=args.concurrency,
        endpoint=args.endpoint,
        prompt_kind=args.prompt_format,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        continuous_usage=args.continuous_usage,
        request_timeout_s=args.request_timeout,
        vocab_size=args.vocab_size,
    )


def slo_from_args(args: argparse.Namespace) -> SLO:
    """The SLO that ``--ttft-slo``, ``--itl-slo`` and ``--itl-percentile`` describe.

    Raises
    ------
    ValueError
        Non-positive times or a percentile outside [0, 100].
    """
    return SLO(args.ttft_slo, args.itl_slo, args.itl_percentile)


def build_meta(
    args: argparse.Namespace,
    *,
    model: str,
    trace_info: Mapping[str, Any],
    started_at: str,
    argv: Optional[Sequence[str]] = None,
) -> Dict[str, Any]:
    """Provenance stored in the results: command line, trace, client options, machine.

    Parameters
    ----------
    args : argparse.Namespace
        Parsed arguments.
    model : str
        Model that was measured.
    trace_info : mapping
        From :func:`build_traces`.
    started_at : str
        ISO-8601 start time.
    argv : sequence of str, optional
        Arguments after ``pdkv bench serve`` (``sys.argv[1:]`` by default).
    """
    words = argv if argv is not None else sys.argv[1:]
    return {
        "command": "pdkv bench serve " + " ".join(shlex.quote(a) for a in words),
        "url": args.url,
        "model": model,
        "started_at": started_at,
        "trace": dict(trace_info),
        "client": {
            "endpoint": args.endpoint,
            "prompt_format": args.prompt_format or ("tokens" if args.endpoint == "completions" else "text"),
            "concurrency": args.concurrency,
            "temperature": args.temperature,
            "ignore_eos": args.ignore_eos,
            "continuous_usage": args.continuous_usage,
            "warmup": args.warmup,
        },
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
    }


def emit_results(
    results: BenchResults, *, out: Optional[str], traces: Sequence[Tuple[float, Trace]] = (), plots: bool = True
) -> Dict[str, Path]:
    """Print the table, the checks and the recommendation; write the report when ``out`` is set.

    Parameters
    ----------
    results : BenchResults
        Everything measured (its SLO is used).
    out : str or None
        Report directory (:func:`~pdkv.lab.serve.report.write_report`), or ``None``
        to print only.
    traces : sequence of (float, Trace)
        Saved as ``traces/rate-<r>.jsonl`` under ``out`` so the run can be replayed.
    plots : bool
        Draw the PNGs.

    Returns
    -------
    dict of str to pathlib.Path
        What was written (empty without ``out``).
    """
    serve_prefix.fill_outputs_equal(results)
    print(markdown_table(results))
    prefix_md = serve_prefix.markdown(results)
    if prefix_md:
        print(prefix_md)
    for note in sanity_notes(results):
        print(f"warning: {note}")
    print(recommend(results).text)
    if not out:
        return {}
    paths = write_report(results, out, plots=plots)
    if prefix_md:
        with open(paths["markdown"], "a", encoding="utf-8") as f:
            f.write("\n" + prefix_md)
        if plots and "itl_cdf" in paths:  # matplotlib is there
            png = serve_prefix.plot(results, Path(out) / "prefix_reuse.png")
            if png is not None:
                paths["prefix_reuse"] = Path(png)
                with open(paths["markdown"], "a", encoding="utf-8") as f:
                    f.write("\n![Prefix hit rate against a perfect cache, and TTFT](prefix_reuse.png)\n")
    if traces:
        tdir = Path(out) / "traces"
        tdir.mkdir(exist_ok=True)
        for rate, trace in traces:
            if isinstance(trace, SessionTrace):
                trace.save(tdir / f"rate-{rate:g}.json")
            else:
                save_trace(trace, tdir / f"rate-{rate:g}.jsonl")
        paths["traces"] = tdir
    print("wrote " + ", ".join(str(p) for p in paths.values()), file=sys.stderr)
    return paths


async def _run(args: argparse.Namespace, traces: List[Tuple[float, Trace]]) -> Tuple[List[RunResult], str]:
    if args.wait_ready > 0:
        await wait_until_ready(args.url, timeout_s=args.wait_ready)
    import aiohttp

    async with aiohttp.ClientSession() as session:
        model = args.model or await fetch_model(session, args.url)
    client = client_kwargs(args, model)
    if args.warmup > 0:
        await warmup(args.url, requests=args.warmup, **client)
    metrics_urls = [u.strip() for u in (args.worker_metrics or "").split(",") if u.strip()]
    runs = await run_sweep(
        args.url, traces, mode=args.mode_name, cooldown_s=args.cooldown, progress=args.progress,
        metrics_urls=metrics_urls, block_tokens=args.block_tokens, **client
    )
    return runs, model


def run_from_args(args: argparse.Namespace, argv: Optional[Sequence[str]] = None) -> int:
    """Run the ``--url`` mode from parsed arguments (see :func:`add_arguments`).

    Parameters
    ----------
    args : argparse.Namespace
        Parsed arguments.
    argv : sequence of str, optional
        The raw arguments, recorded as the command line in the results.

    Returns
    -------
    int
        0 on success; 1 when the server is unreachable or every request failed;
        2 on bad arguments.
    """
    if args.list_presets:
        print(_list_presets())
        return 0
    if not args.url:
        print("error: --url is required", file=sys.stderr)
        return 2
    try:
        normalize_base_url(args.url)
        for u in (args.worker_metrics or "").split(","):
            if u.strip():
                normalize_base_url(u)
        slo = slo_from_args(args)
        traces, trace_info = build_traces(args)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    try:
        runs, model = asyncio.run(_run(args, traces))
    except ServerUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    meta = build_meta(args, model=model, trace_info=trace_info, started_at=started, argv=argv)
    results = BenchResults(runs, slo, meta)
    emit_results(results, out=args.out, traces=traces, plots=args.plots)
    total = sum(len(r.records) for r in runs)
    failed = sum(1 for r in runs for rec in r.records if not rec.ok)
    return 1 if total and failed == total else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point: parse ``argv`` (default ``sys.argv[1:]``) and run.

    Returns
    -------
    int
        Process exit status (see :func:`run_from_args`).
    """
    parser = argparse.ArgumentParser(
        prog="pdkv bench serve",
        description="Replay a request trace against an OpenAI-compatible server: TTFT, ITL, goodput per rate.",
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run_from_args(args, argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
