"""P/D vLLM with vLLM's NixlConnector and with pdkv's connector, measured in one run.

::

    python -m pdkv.lab.vllm.bench --out bench/results/vllm

For each connector it starts the same deployment on this host (prefill vLLM pinned
to core 0, decode vLLM to core 1, :mod:`~pdkv.integrations.vllm_proxy` in front),
warms it up, replays one trace through the proxy with ``pdkv bench serve --url``
(same requests, same arrival times for every connector), and stops it. Both
connectors run wrapped by :mod:`~pdkv.lab.vllm.timing`, which times every
pull the same way on the decode side (from the step that hands the request to the
connector to the step that reports its KV received).

Writes ``results.json`` (summary, provenance) and per connector ``<name>/`` with
``pdkv bench serve``'s ``results.json`` and the raw per-request pulls
(``pulls.jsonl``), and prints a Markdown table. After the trace it also measures how
many cores each deployment keeps busy with no request in flight (``idle_cores``).

Connectors: ``nixl`` (NixlConnector with vLLM's defaults, UCX over loopback),
``nixl-1t`` (the same with one UCX thread, ``num_threads=1``, instead of 4: fairer on
2 cores), ``pdkv`` (pdkv picks its transport: ``shm`` on one host), ``pdkv-tcp``
(pdkv forced onto TCP, its path between hosts).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from pdkv.integrations.vllm_deploy import ProxyProcess, VllmInstance, nixl_kv_config, pdkv_kv_config
from pdkv.lab.transfer.busy import BusyLoad

__all__ = ["main"]

CONNECTORS = ("nixl", "nixl-1t", "pdkv", "pdkv-tcp")


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def _group_cpu_s(pgid: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of a process group."""
    total = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                st = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(st[2]) == pgid:
            total += int(st[11]) + int(st[12])
    return total / os.sysconf("SC_CLK_TCK")


def _idle_cores(procs: list[Any], seconds: float) -> list[float]:
    """Cores each instance keeps busy while no request is in flight."""
    a = [_group_cpu_s(p.proc.pid) for p in procs]
    t0 = time.monotonic()
    time.sleep(seconds)
    dt = time.monotonic() - t0
    return [round((_group_cpu_s(p.proc.pid) - x) / dt, 3) for p, x in zip(procs, a)]


def _cpu_list(spec: str) -> list[int]:
    """``"0"``, ``"0-1"``, ``"0,2"`` -> CPU numbers (``"all"``: this process's)."""
    if spec == "all":
        return sorted(os.sched_getaffinity(0))
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


class _Background:
    """``n`` threads that keep one long request each in flight on the decode instance
    itself (short prompt, ``output_len`` tokens; no proxy, so no pull of their own) while
    the trace runs: vLLM's own threads busy decoding while the connector pulls the
    trace's KV. ``n`` = 0: nothing."""

    def __init__(self, proxy: Any, n: int, output_len: int) -> None:
        self.proxy, self.n, self.output_len = proxy, n, output_len
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.done = 0

    def _loop(self, k: int) -> None:
        rng = random.Random(1000 + k)
        while not self.stop.is_set():
            try:
                self.proxy.complete([rng.randrange(100, 384) for _ in range(32)], self.output_len)
                self.done += 1
            except Exception:  # noqa: BLE001 - the deployment is closing; the trace reports errors
                if self.stop.wait(0.5):
                    return

    def __enter__(self) -> "_Background":
        for k in range(self.n):
            t = threading.Thread(target=self._loop, args=(k,), daemon=True)
            t.start()
            self.threads.append(t)
        if self.n:
            time.sleep(2.0)  # the first ones are decoding when the trace starts
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)


def _kv_config(name: str, role: str, timing: Path, stats: Path, kv_cpus: str = "") -> dict[str, Any]:
    if name in ("nixl", "nixl-1t"):
        extra_n: dict[str, Any] = {"timing_path": str(timing)}
        if name == "nixl-1t":
            extra_n["num_threads"] = 1  # one UCX worker thread instead of vLLM's default 4
        return nixl_kv_config(role, connector="TimedNixlConnector", module="pdkv.lab.vllm.timing",
                              **extra_n)
    extra: dict[str, Any] = {"timing_path": str(timing), "stats_path": str(stats)}
    if name == "pdkv-tcp":
        extra["transports"] = ["tcp"]
    if kv_cpus:
        extra["kv_cpus"] = "all" if kv_cpus == "all" else [int(c) for c in kv_cpus.split(",")]
    return pdkv_kv_config(role, connector="TimedPdkvConnector", module="pdkv.lab.vllm.timing", **extra)


def _rows(path: Path, skip: int = 0) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    return [json.loads(ln) for ln in lines[skip:]]


def run_one(name: str, a: argparse.Namespace, model: Path, work: Path, out: Path) -> dict[str, Any]:
    """Starts the deployment for connector ``name``, warms it up, replays the trace."""
    d = out / name
    d.mkdir(parents=True, exist_ok=True)
    logs = work / "logs"
    timing, stats = work / f"{name}-timing.jsonl", work / f"{name}-stats.jsonl"
    common = dict(python=a.python, log_dir=logs, wait=False, kv_cache_gib=a.kv_cache_gib)
    procs: list[Any] = []
    t_start = time.time()
    try:
        procs.append(VllmInstance(model, name=f"{name}-prefill", cpus=a.prefill_cpus,
                                  kv_config=_kv_config(name, "kv_producer", timing, stats, a.kv_cpus), **common))
        procs.append(VllmInstance(model, name=f"{name}-decode", cpus=a.decode_cpus,
                                  kv_config=_kv_config(name, "kv_consumer", timing, stats, a.kv_cpus), **common))
        for p in procs:
            p.wait_ready(600)
        prefill, decode = procs
        proxy = ProxyProcess([prefill.url], [decode.url], python=a.python, log_dir=logs, name=f"{name}-proxy")
        procs.append(proxy)
        ready_s = time.time() - t_start
        rng = random.Random(12345)
        for _ in range(a.warmup):  # first pulls pay the handshake and allocator growth
            proxy.complete([rng.randrange(100, 384) for _ in range(a.prompt_len)], a.output_len)
        time.sleep(1.0)
        skip_t, skip_s = len(_rows(timing)), len(_rows(stats))
        cmd = [a.python, "-m", "pdkv.cli", "bench", "serve", "--url", proxy.url, "--model", "tiny",
               "--prompt-len", str(a.prompt_len), "--output-len", str(a.output_len), "--arrival", a.arrival,
               "--rates", str(a.rate), "--num-requests", str(a.num_requests),
               "--duration", str(a.num_requests / a.rate + 1), "--seed", str(a.seed), "--vocab-size", "384",
               "--warmup", "0", "--mode-name", name, "--out", str(d), "--no-plots", "--no-progress"]
        print(f"[{name}] {shlex.join(cmd)}", file=sys.stderr, flush=True)
        with _Background(decode, a.background, a.background_output_len) as bg, \
                BusyLoad(a.busy, cpus=_cpu_list(a.prefill_cpus) + _cpu_list(a.decode_cpus)) as load:
            busy = {"background_requests": a.background, "background_output_len": a.background_output_len,
                    "co_runners": load.describe()}
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        busy["background_done"] = bg.done  # long requests finished while the trace ran
        time.sleep(5.0)
        idle = _idle_cores([prefill, decode], a.idle_seconds)
        pulls = _rows(timing, skip_t)
        native = _rows(stats, skip_s)
    finally:
        for p in reversed(procs):
            p.close()
    with open(d / "pulls.jsonl", "w") as f:
        for r in pulls:
            f.write(json.dumps(r) + "\n")
    if native:
        with open(d / "pdkv_pulls.jsonl", "w") as f:
            for r in native:
                f.write(json.dumps(r) + "\n")
    res = json.loads((d / "results.json").read_text())
    summ = res["runs"][0]["summary"]
    ok = [r for r in pulls if not r["failed"] and r["seconds"] is not None]
    secs = [r["seconds"] for r in ok]
    nat = [r["transfer_s"] for r in native if r.get("transfer_s") is not None]
    return {
        "connector": name,
        "requests": summ["num_requests"], "ok": summ["num_ok"], "errors": summ["num_errors"],
        "ttft_s": {k: summ["ttft"][k] for k in ("mean", "p50", "p90", "p99", "max")},
        "e2e_s": {k: summ["e2e"][k] for k in ("mean", "p50", "p90")},
        "pulls": len(pulls), "failed_pulls": len(pulls) - len(ok),
        "kv_wait_s": {"mean": statistics.fmean(secs) if secs else None, "p50": _pct(secs, 50), "p90": _pct(secs, 90),
                      "max": max(secs) if secs else None},
        "pdkv_transfer_s": ({"p50": _pct(nat, 50), "p90": _pct(nat, 90)} if nat else None),
        "transport": sorted({r.get("transport") for r in native if r.get("transport")}) or None,
        "bytes_per_request": statistics.median([r["bytes"] for r in ok]) if ok else None,
        "bytes_total": sum(r["bytes"] for r in ok),
        "idle_cores": {"prefill": idle[0], "decode": idle[1]},
        "busy": busy,
        "startup_s": ready_s,
    }


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x * 1e3:.1f}"


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| connector | KV pull p50 (ms) | KV pull p90 (ms) | TTFT p50 (ms) | TTFT p90 (ms) | "
            "MiB per request | MiB moved | pulls ok/all | idle CPU (cores) |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    body = ""
    for r in rows:
        name = r["connector"] + (f" ({', '.join(r['transport'])})" if r.get("transport") else "")
        bpr = r["bytes_per_request"]
        body += (f"| {name} | {_ms(r['kv_wait_s']['p50'])} | {_ms(r['kv_wait_s']['p90'])} | "
                 f"{_ms(r['ttft_s']['p50'])} | {_ms(r['ttft_s']['p90'])} | "
                 f"{'–' if bpr is None else f'{bpr / 2**20:.0f}'} | {r['bytes_total'] / 2**20:.0f} | "
                 f"{r['pulls'] - r['failed_pulls']}/{r['pulls']} | "
                 f"{r['idle_cores']['prefill'] + r['idle_cores']['decode']:.2f} |\n")
    return head + body


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pdkv.lab.vllm.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/vllm")
    ap.add_argument("--connectors", default=",".join(CONNECTORS), help=f"comma-separated, from {CONNECTORS}")
    ap.add_argument("--model", help="model directory (default: build the tiny Llama 'bench' preset)")
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--num-requests", type=int, default=20)
    ap.add_argument("--rate", type=float, default=0.2, help="requests/s")
    ap.add_argument("--arrival", default="periodic")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--kv-cache-gib", type=int, default=2)
    ap.add_argument("--prefill-cpus", default="0")
    ap.add_argument("--decode-cpus", default="1")
    ap.add_argument("--idle-seconds", type=float, default=10.0,
                    help="after the trace, measure the instances' CPU use for this long with nothing in flight")
    ap.add_argument("--background", type=int, default=0, metavar="N",
                    help="keep N long requests in flight on decode during the trace (vLLM's threads busy "
                    "decoding; sent to decode directly, so they pull nothing)")
    ap.add_argument("--background-output-len", type=int, default=256)
    ap.add_argument("--busy", type=int, default=0, metavar="N",
                    help="N spinning co-runner processes on the instances' cores during the trace")
    ap.add_argument("--kv-cpus", default="", metavar="all|N[,N...]",
                    help="the pdkv connector's kv_cpus (its threads' CPUs) on both instances; default: inherit")
    ap.add_argument("--python", default=sys.executable, help="interpreter with vLLM and pdkv")
    ap.add_argument("--keep-logs", action="store_true", help="copy the instances' logs into --out/logs")
    a = ap.parse_args(argv)
    names = [c.strip() for c in a.connectors.split(",") if c.strip()]
    if a.kv_cpus and a.kv_cpus != "all" and not all(c.strip().isdigit() for c in a.kv_cpus.split(",")):
        ap.error(f"--kv-cpus must be 'all' or CPU numbers like 0,1, got {a.kv_cpus!r}")
    for n in names:
        if n not in CONNECTORS:
            ap.error(f"unknown connector {n!r}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="pdkv-vllm-bench-") as tmp:
        work = Path(tmp)
        model = Path(a.model) if a.model else None
        if model is None:
            from pdkv.integrations.tiny_llama import make_model

            model = make_model(work / "model", seed=0, preset="bench")
        cfg = json.loads((model / "config.json").read_text())
        rows = []
        try:
            for n in names:
                rows.append(run_one(n, a, model, work, out))
                print(table(rows[-1:]), file=sys.stderr, flush=True)
        finally:
            if a.keep_logs and (work / "logs").exists():
                shutil.copytree(work / "logs", out / "logs", dirs_exist_ok=True)
    kv_per_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg.get("head_dim", 0) * 4
    summary = {
        "schema": "pdkv.vllm_bench/1",
        "command": shlex.join([sys.executable, "-m", "pdkv.lab.vllm.bench", *(argv or sys.argv[1:])]),
        "started_at": _dt.datetime.fromtimestamp(t0).isoformat(timespec="seconds"),
        "duration_s": time.time() - t0,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "model": {k: cfg.get(k) for k in ("num_hidden_layers", "num_key_value_heads", "head_dim", "hidden_size",
                                          "vocab_size", "dtype")} | {"kv_bytes_per_token": kv_per_token},
        "busy": {"background": a.background, "background_output_len": a.background_output_len, "co_runners": a.busy},
        "trace": {"prompt_len": a.prompt_len, "output_len": a.output_len, "requests": a.num_requests,
                  "rate": a.rate, "arrival": a.arrival, "seed": a.seed, "warmup": a.warmup},
        "deployment": {"prefill_cpus": a.prefill_cpus, "decode_cpus": a.decode_cpus, "enforce_eager": True,
                       "kv_cache_gib": a.kv_cache_gib, "block_size": 128},
        "results": rows,
    }
    (out / "results.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
