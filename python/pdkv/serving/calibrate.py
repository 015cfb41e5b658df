"""Measures where hybrid mode should stop prefilling on the decode worker.

``python -m pdkv.serving.calibrate [--model DIR]`` answers: up to which prompt length
does prefilling a request on the decode worker itself (no KV hop) cost less than
sending it to a prefill worker?

* A local prefill of ``L`` tokens shares a step with the decode batch, so every
  decoding request waits ``stall(L) = step(decode B + prefill L) - step(decode B)``
  longer for its next token. Measured here in-process on one core, one thread
  (``B`` = ``--batch`` requests at a ``--context``-token context), as the fastest of
  ``--repeats`` steps each (other processes on the machine only ever add time).
* A disaggregated request pays the hop: the proxy's extra round trip to reserve
  blocks, the prefill worker's HTTP round trip, the KV write, the notification and
  the decode worker's admission. ``hop`` is how much later its second token arrives
  than the same request prefilled locally, measured end to end on an idle deployment
  (a prefill and a decode worker pinned to their own cores, two proxies: one sends
  every request to the prefill worker, the other none), as a median over
  ``--repeats`` requests per length.

The suggested threshold is the longest measured prompt length whose ``stall`` (and
every shorter one's) is at most the ``hop`` (the median over lengths): such short
prompts cost each running decode less than the hop would cost the request; longer ones
would stall the decode batch longer than a hop takes, so they go to a prefill worker.
The hop is measured with an idle prefill worker; a busy one adds its queueing delay to
the hop, which makes local prefill pay off for longer prompts (raise the threshold).
Timings depend on the machine and on whatever else runs on it; the output says what
was measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

__all__ = ["main", "measure_hop", "measure_stall", "suggest_threshold"]


def measure_stall(model_dir: str | Path, lengths: Sequence[int], *, batch: int = 8, context: int = 128,
                  repeats: int = 15, dtype: str = "float32", seed: int = 0) -> dict[int, dict[str, float]]:
    """Step times of a decode batch alone and with a local prefill of each length.

    Returns
    -------
    dict
        ``{L: {"decode_s", "mixed_s", "stall_s", "stall_median_s", "prefill_alone_s"}}``:
        fastest step times over the repeats (other load only adds time), ``stall_s`` their
        difference, and ``stall_median_s`` the median of the paired differences.
    """
    import torch

    from .engine import Engine, EngineConfig
    from .models import load_model, pin_threads
    from .sampling import SamplingParams

    pin_threads(1)
    model = load_model(model_dir, dtype=dtype)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(min(100, vocab - 1), vocab) for _ in range(n)]

    longest = max(lengths)
    steps = 2 * len(lengths) * repeats + 8  # background requests decode through every measured step
    eng = Engine(model, EngineConfig(num_blocks=(batch * (context + steps) + 2 * longest) // 16 + 16,
                                     block_tokens=16, mode="chunked", max_batch_tokens=batch + longest,
                                     max_num_seqs=batch + 1, num_threads=1))
    endless = SamplingParams(max_tokens=steps, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"bg{i}", prompt(context), endless)
    while eng.num_waiting:
        eng.step()
    for _ in range(3):
        eng.step()  # every background request decodes now
    out: dict[int, dict[str, float]] = {}
    with torch.inference_mode():
        for n in lengths:
            dec, mix, diff = [], [], []
            for r in range(repeats):
                # Paired: a decode-only step, then the same batch plus the prompt, so that
                # slow drifts (other load on the machine) cancel in the difference.
                t = time.perf_counter()
                eng.step()
                d = time.perf_counter() - t
                h = eng.add_request(f"p{n}-{r}", prompt(n), SamplingParams(max_tokens=1))
                t = time.perf_counter()
                st = eng.step()
                m = time.perf_counter() - t
                assert st is not None and st.num_prefill_tokens == n and h.finished
                dec.append(d)
                mix.append(m)
                diff.append(m - d)
            # Other load on the machine only ever adds time: the fastest of the repeats
            # is the closest to the step's own cost.
            out[n] = {"decode_s": min(dec), "mixed_s": min(mix), "stall_s": max(min(mix) - min(dec), 0.0),
                      "stall_median_s": statistics.median(diff)}
    for i in range(batch):
        eng.abort(f"bg{i}")
    eng.run_until_idle()
    alone = Engine(model, EngineConfig(num_blocks=longest // 16 + 4, block_tokens=16, max_batch_tokens=longest,
                                       num_threads=1))
    for n in lengths:
        times = []
        for _ in range(max(3, repeats // 3)):
            t = time.perf_counter()
            alone.generate([prompt(n)], SamplingParams(max_tokens=1))
            times.append(time.perf_counter() - t)
        out[n]["prefill_alone_s"] = min(times)
    return out


async def _timed(session: Any, url: str, model: str, prompt: list[int]) -> tuple[float, float]:
    """(TTFT, time to the second token) of one streamed greedy request."""
    body = {"model": model, "prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    from .aio import sse_events

    t0 = time.perf_counter()
    times: list[float] = []
    async with session.post(url + "/v1/completions", json=body) as r:
        async for now, obj in sse_events(r):
            for ch in obj.get("choices", []):
                times.extend([now] * len(ch.get("token_ids", [])))
    if len(times) < 2:
        raise RuntimeError("fewer than two tokens came back")
    return times[0] - t0, times[1] - t0


def measure_hop(model_dir: str | Path, lengths: Sequence[int], *, repeats: int = 15, seed: int = 1,
                log_dir: str | None = None) -> dict[int, dict[str, float]]:
    """TTFT and time to second token, prefilled locally vs on a prefill worker.

    Returns
    -------
    dict
        ``{L: {"ttft_local_s", "ttft_disagg_s", "ttst_local_s", "ttst_disagg_s", "hop_s"}}``
        (medians; ``hop_s``: median over rounds of how much later the second token came
        on the disaggregated path than on the local one, for the same prompt).
    """
    import aiohttp

    from ..credential import Credential
    from .auth import Signer
    from .launch import Deployment, ServerProcess

    dep = Deployment("disagg", model_dir, worker_args=["--num-blocks", "256"], log_dir=log_dir)
    local: ServerProcess | None = None
    try:
        dep.start(timeout=600)
        pre = ",".join(p.url for p in dep.workers if p.role == "prefill")
        dec = ",".join(p.url for p in dep.workers if p.role == "decode")
        assert dep.proxy is not None
        local = ServerProcess("proxy", ["--mode", "hybrid", "--hybrid-threshold", str(1 << 30), "--prefill", pre,
                                        "--decode", dec], log_path=dep.proxy.log_path.with_name("proxy-local.log"),
                              name="proxy-local", env={"PDKV_SECRET": dep.secret}).start()
        local.wait_ready(120)
        model = str(dep.workers[0].info["model"])
        rng = random.Random(seed)

        async def run() -> dict[int, dict[str, float]]:
            async with aiohttp.ClientSession() as s:
                info_url = dep.workers[0].url + "/pd/info"
                async with Signer(Credential(dep.secret)).get(s, info_url) as r:
                    vocab = int((await r.json())["vocab_size"])
                first = min(100, vocab - 1)
                res: dict[int, dict[str, float]] = {}
                for n in lengths:
                    rec: dict[str, list[tuple[float, float]]] = {"local": [], "disagg": []}
                    hops = []
                    for i in range(repeats + 1):
                        p = [rng.randrange(first, vocab) for _ in range(n)]
                        order = [("disagg", dep.url), ("local", local.url)]
                        if i % 2:
                            order.reverse()
                        got = {name: await _timed(s, url, model, p) for name, url in order}
                        if i:  # the first round warms up
                            for name, v in got.items():
                                rec[name].append(v)
                            hops.append(got["disagg"][1] - got["local"][1])  # paired, same prompt
                    res[n] = {"ttft_local_s": statistics.median(a for a, _ in rec["local"]),
                              "ttst_local_s": statistics.median(b for _, b in rec["local"]),
                              "ttft_disagg_s": statistics.median(a for a, _ in rec["disagg"]),
                              "ttst_disagg_s": statistics.median(b for _, b in rec["disagg"]),
                              "hop_s": statistics.median(hops)}
                return res

        return asyncio.run(run())
    finally:
        if local is not None:
            local.stop()
        dep.stop()


def suggest_threshold(stall: dict[int, dict[str, float]], hop: dict[int, dict[str, float]]) -> tuple[int, float]:
    """The suggested threshold and the hop estimate it rests on.

    The hop barely depends on the prompt length at these sizes (the KV write is a
    memcpy of a few MiB at most), so one estimate, the median of the per-length hops,
    is compared with each length's stall: the threshold is the longest length such that
    it and every shorter measured length stall the decode batch by at most that much
    (0 if even the shortest stalls it longer).
    """
    hop_s = statistics.median(h["hop_s"] for h in hop.values())
    th = 0
    for n in sorted(stall):
        if stall[n]["stall_s"] > hop_s:
            break
        th = n
    return th, hop_s


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdkv.serving.calibrate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model directory (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--lengths", default="4,8,16,32,64,128,256", help="prompt lengths to measure")
    ap.add_argument("--batch", type=int, default=8, help="decoding requests sharing the step (default 8)")
    ap.add_argument("--context", type=int, default=128, help="their context length (default 128)")
    ap.add_argument("--repeats", type=int, default=15, help="measurements per length (medians are reported)")
    ap.add_argument("--json", action="store_true", help="print the raw figures as JSON too")
    args = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    lengths = sorted({int(x) for x in args.lengths.split(",") if x.strip()})
    if args.model:
        model_dir = Path(args.model)
    else:
        from .models import default_model_dir

        model_dir = default_model_dir()
    print(f"model {model_dir}; decode batch {args.batch} at {args.context} tokens of context; "
          f"{args.repeats} repeats", flush=True)
    stall = measure_stall(model_dir, lengths, batch=args.batch, context=args.context, repeats=args.repeats)
    hop = measure_hop(model_dir, lengths, repeats=args.repeats)
    print(f"{'L':>5} {'prefill':>9} {'decode':>8} {'+prefill':>9} {'stall':>8} | {'TTFT loc':>9} {'TTFT dis':>9} "
          f"{'2nd loc':>9} {'2nd dis':>9} {'hop':>8}")
    for n in lengths:
        s, h = stall[n], hop[n]
        print(f"{n:>5} {s['prefill_alone_s'] * 1e3:>7.1f}ms {s['decode_s'] * 1e3:>6.1f}ms "
              f"{s['mixed_s'] * 1e3:>7.1f}ms {s['stall_s'] * 1e3:>6.1f}ms | {h['ttft_local_s'] * 1e3:>7.1f}ms "
              f"{h['ttft_disagg_s'] * 1e3:>7.1f}ms {h['ttst_local_s'] * 1e3:>7.1f}ms "
              f"{h['ttst_disagg_s'] * 1e3:>7.1f}ms "
              f"{h['hop_s'] * 1e3:>6.1f}ms")
    th, hop_s = suggest_threshold(stall, hop)
    print(f"hop (median over lengths): {hop_s * 1e3:.1f} ms; suggested --hybrid-threshold: {th} "
          f"(longest L whose stall, and every shorter one's, is <= the hop)")
    if args.json:
        print(json.dumps({"stall": stall, "hop": hop, "hop_s": hop_s, "threshold": th}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
