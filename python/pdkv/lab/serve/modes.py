"""``pdkv bench serve``: one trace replayed against every serving mode, same core budget.

Without ``--url`` this driver starts each serving mode on this machine in turn (a
proxy plus workers, :class:`pdkv.serving.launch.Deployment`), replays the same trace
at each request rate, stops the mode, and at the end writes one report comparing
them (JSON, markdown table, ITL CDF and rate-sweep plots) with a recommendation.
With ``--url`` it measures a server you started yourself (vLLM, SGLang, pdkv's proxy):
see :mod:`pdkv.lab.serve.cli`.

Same hardware budget: with ``N`` = prefill + decode workers of the disaggregated
modes (``--pd``, default 1:1), colocated and chunked run ``N`` single-core replicas
behind the proxy (``--replicas`` overrides), and every worker is pinned to its own
core where there are enough. On a 2-core machine: colocated = 2 replicas, chunked =
2 replicas with chunked prefill, disagg = 1 prefill core + 1 decode core, hybrid =
the same with short prompts prefilled by the decode worker.

Example::

    pdkv bench serve --serve-model tiny-40m --preset prefill-heavy --rates 0.25,0.5 \\
        --duration 60 --out bench/results/serve-tiny
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as _dt
import json
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

import aiohttp

from pdkv.lab.netlab.testbed import Lab, check_available, parse_link
from pdkv.lab.serve import cli as serve_cli
from pdkv.lab.serve import compress as serve_compress
from pdkv.lab.serve import link as serve_link
from pdkv.lab.serve import prefix as serve_prefix
from pdkv.lab.serve import stream as serve_stream
from pdkv.lab.serve.client import fetch_model, wait_until_ready
from pdkv.lab.serve.metrics import BenchResults, RunResult
from pdkv.serving.launch import Deployment
from pdkv.serving.tiny import save_tiny_model

#: disagg with the proxy's KV-aware routing (``--routing kv``; needs the workers' prefix cache).
KV_ROUTED = "disagg-kv"
MODES = ("colocated", "chunked", "disagg", "hybrid", "disagg-nostream", KV_ROUTED, serve_compress.PLAIN,
         *(serve_compress.mode_name(m) for m in serve_compress.COMPRESS_MODES))
DEFAULT_MODES = ("colocated", "chunked", "disagg", "hybrid")
#: Layer-wise streaming (the prefill worker's default) against one write after prefill:
#: disagg twice, the second with ``--no-stream-layers`` (see :mod:`pdkv.lab.serve.stream`).
COMPARE_STREAM = ("disagg", "disagg-nostream")

#: Generated model presets: ``save_tiny_model`` keyword arguments. "tiny-40m" is the
#: ~40M-parameter Llama the issue's expectations were measured with.
GENERATED = {
    "tiny-40m": dict(arch="llama", hidden_size=640, num_layers=10, num_heads=10, dtype="float32"),
    "tiny-4m": dict(arch="llama", hidden_size=128, num_layers=4, num_heads=4, dtype="float32"),
}


def resolve_model(spec: str, cache: Path) -> Path:
    """A model directory for ``--serve-model``: a path, ``smollm2`` (the demo model) or a
    generated preset (:data:`GENERATED`), written once under ``cache``."""
    if spec == "smollm2":
        from pdkv.serving.models import default_model_dir

        return Path(default_model_dir())
    if spec in GENERATED:
        out = cache / spec
        if not (out / "config.json").exists():
            save_tiny_model(out, seed=0, **GENERATED[spec])
        return out
    p = Path(spec)
    if not (p / "config.json").exists():
        raise SystemExit(f"error: --serve-model {spec!r} is neither a model directory (no config.json) nor one of "
                         f"smollm2, {', '.join(GENERATED)}")
    return p


def add_arguments(parser: argparse.ArgumentParser) -> None:
    serve_cli.add_arguments(parser)
    g = parser.add_argument_group("modes (when --url is not given)")
    g.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help=f"modes to compare, of {','.join(MODES)} (default: {','.join(DEFAULT_MODES)}); "
                   "disagg-nostream is disagg whose prefill worker writes the KV once after prefill; "
                   "disagg-tcp forces tcp between the workers, disagg-lossless|fp8|auto also compresses the KV")
    g.add_argument("--compare-stream", action="store_true",
                   help="short for --modes disagg,disagg-nostream: layer-wise streaming vs one write after "
                   "prefill on the same trace (and --link), with TTFT, time to 2nd token (KV ready), ITL, "
                   "throughput, their ratios and a token-for-token check of the outputs in the report")
    g.add_argument("--compare-compress", metavar="MODES",
                   help="KV compression vs plain on the same trace (and --link): disagg-tcp plus disagg-<mode> "
                   f"for each of MODES ({','.join(serve_compress.COMPRESS_MODES)}, comma-separated; the prefill "
                   "worker's --compress), with TTFT, time to 2nd token, ITL, throughput, their ratios and a "
                   "token-for-token check of the outputs in the report")
    g.add_argument("--prefix-cache", choices=("on", "off", "both"),
                   help="the workers' prefix cache (their --prefix-cache): on, off, or both (each mode twice; the "
                   f"cache-off runs are labelled <mode>{serve_prefix.NOCACHE_SUFFIX} and every cache-on run's "
                   "outputs are checked token for token against them). Default: the workers' default, flag not "
                   f"passed. {KV_ROUTED} (the proxy's --routing kv) runs with the cache on only")
    g.add_argument("--serve-model", default="smollm2",
                   help=f"model directory, smollm2 (the demo model) or a generated one: {', '.join(GENERATED)}")
    g.add_argument("--pd", default="1:1", help="prefill:decode workers of disagg and hybrid (default 1:1)")
    g.add_argument("--replicas", type=int, help="colocated/chunked replicas (default: prefill + decode of --pd)")
    g.add_argument("--max-batch-tokens", type=int, default=128, help="chunked mode's per-step token budget")
    g.add_argument("--hybrid-threshold", type=int, help="hybrid proxy: prompts up to this many tokens skip prefill")
    g.add_argument("--worker-arg", action="append", default=[],
                   help="extra option for every worker, e.g. --worker-arg=--num-blocks=4096 (repeatable)")
    g.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin workers to cores")
    g.add_argument("--keep-logs", metavar="DIR", help="keep every process's log under DIR")
    g.add_argument("--link", help="every process on its own network-namespace host behind an emulated link "
                   "RATE[,rtt=..], e.g. 1gbit,rtt=0.2ms (root; see pdkv netlab)")


def cache_settings(args: argparse.Namespace) -> list[Optional[str]]:
    """The prefix-cache settings each mode runs with: ``[None]`` (the workers' default),
    ``["on"]``, ``["off"]``, or ``["off", "on"]`` for ``both`` (the baseline first)."""
    pc = getattr(args, "prefix_cache", None)
    return [None] if pc is None else ["off", "on"] if pc == "both" else [pc]


def run_label(mode: str, cache: Optional[str]) -> str:
    """The mode's label in the results: ``disagg``, or ``disagg-nocache`` with the cache off."""
    return mode + serve_prefix.NOCACHE_SUFFIX if cache == "off" else mode


def deployment_for(mode: str, model_dir: Path, args: argparse.Namespace, log_dir: Optional[Path], lab=None,
                   cache: Optional[str] = None):
    p, d = (int(x) for x in args.pd.split(":"))
    place = {}
    if lab is not None:  # each process on its own lab host (--link)
        place["placement"] = serve_link.placement(lab, 0 if mode in ("colocated", "chunked") else p)
    worker_args = [a for w in args.worker_arg for a in w.split("=", 1)] if args.worker_arg else []
    if cache is not None:
        worker_args += ["--prefix-cache", cache]
    if getattr(args, "block_tokens", 16) != 16:
        worker_args += ["--block-tokens", str(args.block_tokens)]
    if mode in ("colocated", "chunked"):
        replicas = args.replicas or (p + d)
        extra = ["--max-batch-tokens", str(args.max_batch_tokens)] if mode == "chunked" else []
        return Deployment(mode, model_dir, num_prefill=0, num_decode=replicas, worker_args=worker_args,
                          decode_args=extra, pin=args.pin, log_dir=log_dir, **place), f"{replicas}x1"
    proxy_args = []
    if mode == "hybrid" and args.hybrid_threshold is not None:
        proxy_args = ["--hybrid-threshold", str(args.hybrid_threshold)]
    if mode == KV_ROUTED:
        proxy_args = ["--routing", "kv"]
    prefill_args = ["--no-stream-layers"] if mode == "disagg-nostream" else serve_compress.prefill_args(mode) or []
    disagg_variant = mode in ("disagg-nostream", KV_ROUTED) or serve_compress.prefill_args(mode) is not None
    return Deployment("disagg" if disagg_variant else mode, model_dir, num_prefill=p, num_decode=d,
                      worker_args=worker_args, prefill_args=prefill_args, proxy_args=proxy_args,
                      pin=args.pin, log_dir=log_dir, **place), f"{p}:{d}"


async def _measure(url: str, traces, mode: str, pd_ratio: str, args,
                   model_name: Optional[str], prefill_urls: Sequence[str] = (), worker_urls: Sequence[str] = (),
                   cache: Optional[str] = None) -> tuple[list[RunResult], str]:
    await wait_until_ready(url, timeout_s=120)
    async with aiohttp.ClientSession() as session:
        model = model_name or await fetch_model(session, url)
    client = serve_cli.client_kwargs(args, model)
    if serve_stream.comparing(args) or serve_compress.comparing(args):  # token ids: did the modes answer alike
        client["extra_body"] = {"return_token_ids": True}
    if args.warmup > 0:
        await serve_cli.warmup(url, requests=args.warmup, **client)
    if args.prefix_cache is not None:  # outputs_equal compares token ids with the cache-off run
        client["extra_body"] = {**client.get("extra_body", {}), "return_token_ids": True}
    config = {"mode": mode, "pd": pd_ratio, **({} if cache is None else {"prefix_cache": cache})}
    runs = await serve_cli.run_sweep(url, traces, mode=run_label(mode, cache), pd_ratio=pd_ratio,
                                     cooldown_s=args.cooldown, progress=args.progress, config=config,
                                     metrics_urls=worker_urls, block_tokens=args.block_tokens,
                                     kv_token_bytes=getattr(args, "kv_token_bytes", None), **client)
    if serve_compress.comparing(args) and prefill_urls:  # what the KV pushes put on the wire, by codec
        wire = await serve_compress.fetch_kv_wire(prefill_urls)
        for run in runs:
            run.config["kv_wire"] = wire
    return runs, model


def _run_each_mode(modes, model_dir: Path, traces, args, lab) -> tuple[list[RunResult], Optional[str]]:
    runs: list[RunResult] = []
    model_name = args.model
    run_client = serve_link.client_runner(lab) if lab is not None else asyncio.run
    for mode in modes:
        for cache in cache_settings(args):
            if mode == KV_ROUTED and cache == "off":
                continue  # KV-aware routing needs the cache; its baseline is another mode's cache-off run
            label = run_label(mode, cache)
            log_dir = Path(args.keep_logs) / label if args.keep_logs else None
            dep, pd_ratio = deployment_for(mode, model_dir, args, log_dir, lab, cache)
            print(f"== {label} ({pd_ratio}) on {model_dir}", file=sys.stderr, flush=True)
            with dep:
                prefill_urls = [w.url for w in dep.workers if w.role == "prefill"]
                worker_urls = [w.url for w in dep.workers]
                got, model_name = run_client(_measure(dep.url, traces, mode, pd_ratio, args, model_name,
                                                      prefill_urls, worker_urls, cache))
            runs += got
    return runs, model_name


def run_modes(args: argparse.Namespace, argv: Sequence[str]) -> int:
    if args.compare_stream:
        args.modes = ",".join(COMPARE_STREAM)
    if args.compare_compress:
        try:
            args.modes = ",".join(serve_compress.modes_for(serve_compress.parse_modes(args.compare_compress)))
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        print(f"error: unknown mode(s) {bad}; choose from {', '.join(MODES)}", file=sys.stderr)
        return 2
    problem = check_prefix_options(args, modes)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        p, d = (int(x) for x in args.pd.split(":"))
        if p < 1 or d < 1:
            raise ValueError
    except ValueError:
        print(f"error: --pd must look like 1:1, got {args.pd!r}", file=sys.stderr)
        return 2
    if args.link:
        parse_link(args.link)  # a bad spec or no permission: say so before loading a model
        check_available()
    try:
        slo = serve_cli.slo_from_args(args)
        traces, trace_info = serve_cli.build_traces(args)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cache = Path(os.environ.get("PDKV_CACHE_DIR", Path.home() / ".cache" / "pdkv")) / "models"
    model_dir = resolve_model(args.serve_model, cache)
    # Token-id prompts must stay inside the model's vocabulary.
    vocab = json.loads((model_dir / "config.json").read_text()).get("vocab_size")
    if vocab and args.vocab_size > vocab:
        args.vocab_size = int(vocab)
    args.kv_token_bytes = serve_prefix.kv_bytes_per_token(model_dir)
    started = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    with contextlib.ExitStack() as stack:
        lab = None
        if args.link:
            lab = stack.enter_context(Lab(hosts=serve_link.hosts_needed(p, d, args.replicas or p + d), link=args.link))
            print(f"== link {lab.link} (rtt emulated: {lab.info['rtt_emulated']}): proxy on lab host h0, "
                  f"each worker on its own host", file=sys.stderr, flush=True)
        runs, model_name = _run_each_mode(modes, model_dir, traces, args, lab)
        link = serve_link.describe(lab) if lab is not None else None
    args.url = "launched by pdkv bench serve"
    meta = serve_cli.build_meta(args, model=model_name or str(model_dir), trace_info=trace_info, started_at=started,
                                argv=argv)
    meta["deployment"] = {"modes": modes, "pd": args.pd, "replicas": args.replicas, "model_dir": str(model_dir),
                          "pinned": args.pin, "cpus": sorted(os.sched_getaffinity(0)), "link": link}
    results = BenchResults(runs, slo, meta)
    comparison = serve_stream.compare(results) if serve_stream.comparing(args) else None
    if comparison is not None:
        meta["stream_comparison"] = comparison  # in results.json
    zcomparison = serve_compress.compare(results) if serve_compress.comparing(args) else None
    if zcomparison is not None:
        meta["compress_comparison"] = zcomparison
    serve_cli.emit_results(results, out=args.out, traces=traces, plots=args.plots)
    if comparison is not None:
        serve_stream.emit(comparison, out=args.out)
    if zcomparison is not None:
        serve_compress.emit(zcomparison, out=args.out)
    return 0


def check_prefix_options(args: argparse.Namespace, modes: Sequence[str]) -> Optional[str]:
    """What is wrong with the prefix-reuse options for ``modes``, or None."""
    if KV_ROUTED in modes and args.prefix_cache == "off":
        return (f"{KV_ROUTED} routes by the workers' cached KV and needs --prefix-cache on (or both, which runs "
                f"it with the cache on and the other modes both ways)")
    if args.prefix_cache is not None and serve_stream.comparing(args) and getattr(args, "compare_stream", False):
        return "--prefix-cache and --compare-stream are separate runs"
    if getattr(args, "block_tokens", 16) < 1:
        return f"--block-tokens must be >= 1, got {args.block_tokens}"
    return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="pdkv bench serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.link and args.url:
        parser.error("--link starts the deployments in a lab; it cannot measure a server given by --url")
    if args.compare_stream and args.url:
        parser.error("--compare-stream starts both disagg deployments itself; it cannot measure a server given by --url")
    if args.compare_compress and args.url:
        parser.error("--compare-compress starts the disagg deployments itself; it cannot measure a server given by "
                     "--url")
    if args.prefix_cache and args.url:
        parser.error("--prefix-cache sets the flag of the workers this command starts; with --url start your workers "
                     "with the cache you want and pass their URLs with --worker-metrics")
    if args.worker_metrics and not args.url:
        parser.error("--worker-metrics is for --url runs (the launched modes read their own workers' /metrics)")
    if args.compare_compress and args.compare_stream:
        parser.error("--compare-compress and --compare-stream are separate runs (each replaces --modes)")
    if args.url or args.list_presets:
        return serve_cli.run_from_args(args, argv)
    return run_modes(args, argv)


if __name__ == "__main__":
    sys.exit(main())
