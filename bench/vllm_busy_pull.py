"""The vLLM connector's KV pull latency while vLLM's own threads are busy (issue 30).

One command, repeatable before and after a change to the native code:

    PYTHONPATH=$PWD/python /work/main/.venv-vllm/bin/python bench/vllm_busy_pull.py \\
        --label before --out bench/results/busy/vllm-pull-before

For each of ``--runs`` runs it starts the P/D deployment of ``pdkv.lab.vllm.bench``
(prefill vLLM on core 0, decode vLLM on core 1, pdkv's connector, the proxy in front)
once per condition and replays the same trace: ``quiet`` (nothing else running) and
``busy`` (``--background`` long requests kept in flight on the decode instance itself,
so its vLLM worker steps without pause on the core pdkv's threads share while the
connector pulls the trace's KV, plus ``--spin`` spinning processes on the instances'
cores). It prints one table row per run and condition (the pull as the
connector's timing wrapper sees it: engine step that hands the request over to the
step that reports its KV received; and pdkv's own transfer time) and writes every
number to OUT/summary.json, each run's raw files under OUT/<condition>-<run>/.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", default="", help="e.g. before / after (goes into the JSON)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--conditions", default="quiet,busy", help="comma-separated: quiet, busy")
    ap.add_argument("--connector", default="pdkv-tcp", help="pdkv (shm on one host) or pdkv-tcp")
    ap.add_argument("--background", type=int, default=2, help="busy: long requests kept in flight")
    ap.add_argument("--background-output-len", type=int, default=256)
    ap.add_argument("--spin", type=int, default=0, help="busy: spinning co-runner processes on the instances' cores")
    ap.add_argument("--kv-cpus", default="", help="the connector's kv_cpus on both instances (all or N,N); default inherit")
    ap.add_argument("--num-requests", type=int, default=10)
    ap.add_argument("--rate", type=float, default=0.5, help="trace requests/s")
    ap.add_argument("--prompt-len", type=int, default=1024)
    a = ap.parse_args(argv)
    conds = [c.strip() for c in a.conditions.split(",") if c.strip()]
    for c in conds:
        if c not in ("quiet", "busy"):
            ap.error(f"unknown condition {c!r} (quiet, busy)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    import pdkv

    cmd = shlex.join([sys.executable, *sys.argv])
    rows = []
    print(f"# {cmd}\n# pdkv from {os.path.dirname(pdkv.__file__)} (tree {git}), label {a.label!r}")
    print(f"{'run':>3} {'condition':>9} {'load before':>15} {'pull p50':>8} {'p90':>7} {'max':>7} "
          f"{'pdkv p50':>8} {'p90':>7} {'ttft p50':>8} {'ok':>5} {'bg done':>7}", flush=True)
    for k in range(1, a.runs + 1):
        for c in conds:
            d = out / f"{c}-{k}"
            load = _load()
            bench = [sys.executable, "-m", "pdkv.lab.vllm.bench", "--connectors", a.connector, "--out", str(d),
                     "--num-requests", str(a.num_requests), "--rate", str(a.rate), "--prompt-len", str(a.prompt_len),
                     "--warmup", "2", "--idle-seconds", "2"] + (["--kv-cpus", a.kv_cpus] if a.kv_cpus else [])
            if c == "busy":
                bench += ["--background", str(a.background), "--background-output-len", str(a.background_output_len),
                          "--busy", str(a.spin)]
            t0 = time.time()
            p = subprocess.run(bench, capture_output=True, text=True)
            row = {"run": k, "condition": c, "load_before": load, "load_after": _load(),
                   "wall_s": round(time.time() - t0, 1), "command": shlex.join(bench)}
            if p.returncode != 0:
                row["error"] = p.stderr[-2000:]
                rows.append(row)
                print(f"{k:>3} {c:>9} {load:>15} failed (see summary.json)", flush=True)
                continue
            r = json.loads((d / "results.json").read_text())["results"][0]
            pulls = [json.loads(ln) for ln in (d / a.connector / "pulls.jsonl").read_text().splitlines() if ln]
            secs = sorted(x["seconds"] for x in pulls if not x["failed"] and x["seconds"] is not None)
            row.update({"kv_wait_s": r["kv_wait_s"], "pdkv_transfer_s": r["pdkv_transfer_s"], "ttft_s": r["ttft_s"],
                        "pulls": r["pulls"], "failed_pulls": r["failed_pulls"], "transport": r["transport"],
                        "bytes_per_request": r["bytes_per_request"], "busy": r.get("busy"),
                        "pull_s_each": secs})
            bg = (r.get("busy") or {}).get("background_done")
            rows.append(row)
            kw, nat = r["kv_wait_s"], r["pdkv_transfer_s"] or {}
            print(f"{k:>3} {c:>9} {load:>15} {_ms(kw['p50']):>8} {_ms(kw['p90']):>7} {_ms(kw['max']):>7} "
                  f"{_ms(nat.get('p50')):>8} {_ms(nat.get('p90')):>7} {_ms(r['ttft_s']['p50']):>8} "
                  f"{r['pulls'] - r['failed_pulls']:>2}/{r['pulls']:<2} {'-' if bg is None else bg:>7}", flush=True)
    print("# medians over runs (ms):")
    for c in conds:
        ok = [r for r in rows if r["condition"] == c and "error" not in r]
        if ok:
            med = lambda f: statistics.median([f(r) for r in ok if f(r) is not None] or [float("nan")])  # noqa: E731
            print(f"#   {c}: pull p50 {med(lambda r: r['kv_wait_s']['p50']) * 1e3:.1f}, "
                  f"p90 {med(lambda r: r['kv_wait_s']['p90']) * 1e3:.1f}; pdkv transfer p50 "
                  f"{med(lambda r: (r['pdkv_transfer_s'] or {}).get('p50')) * 1e3:.1f} ({len(ok)} runs)")
    (out / "summary.json").write_text(json.dumps({"command": cmd, "label": a.label, "kv_cpus": a.kv_cpus or "inherit",
                                                  "tree": git, "runs": rows},
                                                 indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
