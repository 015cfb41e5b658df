"""The vLLM connector's pull time between different block sizes, beside equal ones, in one run.

Drives the connector's own scheduler and worker halves
(:mod:`pdkv.integrations.vllm`) the way vLLM does, without an engine: a prefill and a
decode instance, each with real pdkv agents and KV caches of vLLM's CPU layout
(``[blocks, kv_heads, block_size, 2*head_size]``), the benchmark geometry of
``docs/vllm.md`` by default (8 layers, 8 KV heads of 32, float32: 16 KiB per token).
Each request is handed out by prefill, pulled by decode (span mapping, prefill's
generations, release notification: the connector's whole path), released, and its
blocks reused by the next request. Every pull is one ``stats_path`` JSON line; the
table gives the median ``transfer_s`` per case and its ratio to the equal-size case.

    python -m pdkv.lab.vllm.hetero_bench --transport shm --requests 20

Needs vLLM importable (``.venv-vllm``), like the connector.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from vllm.v1.request import RequestStatus

from pdkv.integrations.vllm_scheduler import PdkvConnectorScheduler
from pdkv.integrations.vllm_worker import PdkvConnectorWorker

#: (prefill block size, decode block size) per case; the first is the baseline.
CASES = {"equal 128/128": (128, 128), "prefill 128 -> decode 64": (128, 64), "prefill 64 -> decode 128": (64, 128)}


def _config(role: str, block_size: int, **extra) -> SimpleNamespace:
    kvt = SimpleNamespace(kv_connector_extra_config={"secret": "bench-secret", **extra}, engine_id=f"{role}-bench",
                          is_kv_consumer=role == "decode", kv_load_failure_policy="recompute")
    return SimpleNamespace(kv_transfer_config=kvt, cache_config=SimpleNamespace(block_size=block_size))


class _Side:
    """One instance: the connector's scheduler half and worker over its own KV cache."""

    def __init__(self, role: str, block_size: int, blocks: int, args: argparse.Namespace, **extra) -> None:
        # the agent's address is its tcp endpoint: shm pulls still connect over it
        transports = ["shm", "tcp"] if args.transport == "shm" else ["tcp"]
        cfg = _config(role, block_size, transports=transports, **extra)
        self.sched, self.worker = PdkvConnectorScheduler(cfg), PdkvConnectorWorker(cfg, None)
        self.caches = {f"layer{i}": torch.rand(blocks, args.kv_heads, block_size, 2 * args.head_size)
                       for i in range(args.layers)}
        self.worker.register_kv_caches(self.caches)
        self.sched.set_agents({0: self.worker.handshake_metadata()})

    def step(self) -> tuple[set[str], set[str]]:
        self.worker.start_load_kv(self.sched.build_connector_meta())
        sent, recvd = self.worker.get_finished()
        self.sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=self.worker.worker_meta(),
                                                           finished_sending=sent, finished_recving=recvd))
        return sent or set(), recvd or set()

    def until(self, pick, what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not pick(self.step()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} within {timeout} s")
            time.sleep(0.0005)


def _run_case(name: str, prefill_bs: int, decode_bs: int, stats: Path, args: argparse.Namespace) -> None:
    n = args.tokens
    remote, local = list(range(1, 1 + -(-n // prefill_bs))), list(range(1, 1 + -(-n // decode_bs)))
    prefill = _Side("prefill", prefill_bs, len(remote) + 1, args, kv_lease_s=60)
    decode = _Side("decode", decode_bs, len(local) + 1, args, stats_path=str(stats))
    try:
        for i in range(args.requests):
            req_id = f"{name}#{i}"
            done = SimpleNamespace(request_id=req_id, kv_transfer_params={"do_remote_decode": True},
                                   status=RequestStatus.FINISHED_LENGTH_CAPPED, num_computed_tokens=n)
            _, params = prefill.sched.request_finished(done, remote)
            req = SimpleNamespace(request_id=req_id, kv_transfer_params=params, num_prompt_tokens=n + 1)
            count, _ = decode.sched.get_num_new_matched_tokens(req, 0)
            decode.sched.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (local,)), count)
            decode.until(lambda r: req_id in r[1], f"pull of {req_id}")
            if decode.worker.take_load_errors():
                raise RuntimeError(f"pull of {req_id} failed (see {stats})")
            prefill.until(lambda r: req_id in r[0], f"release of {req_id}")  # blocks reused next
    finally:
        decode.worker.close()
        prefill.worker.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transport", default="shm", choices=["shm", "tcp"])
    ap.add_argument("--requests", type=int, default=20, help="pulls per case (the first 3 are warm-up)")
    ap.add_argument("--tokens", type=int, default=1024, help="prompt tokens per request")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=32)
    ap.add_argument("--stats", type=Path, default=None,
                    help="stats_path JSON lines, replaced (default: a temporary file)")
    args = ap.parse_args(argv)
    stats = args.stats or Path(tempfile.mkdtemp(prefix="pdkv-hetero-")) / "pulls.jsonl"
    stats.unlink(missing_ok=True)  # this run's pulls only
    for name, (p, d) in CASES.items():
        _run_case(name, p, d, stats, args)
    rows = [json.loads(line) for line in stats.read_text().splitlines()]
    base = None
    print(f"transport {args.transport}, {args.tokens} tokens per request, stats in {stats}")
    print("| case | layout | MiB per pull | transfer p50 (ms) | x equal |")
    print("|---|---|---:|---:|---:|")
    for name in CASES:
        mine = [r for r in rows if r["request_id"].startswith(name + "#")][3:]
        assert mine and all(r["error"] is None for r in mine), mine
        p50 = statistics.median(r["transfer_s"] for r in mine)
        base = base or p50
        print(f"| {name} | {mine[0]['layout']} | {mine[0]['bytes'] / 2**20:.1f} | {1e3 * p50:.2f} | "
              f"{p50 / base:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
