"""A hybrid deployment of real processes (``pdkv serve prefill|decode|proxy``):
greedy output equals ``generate``; a decode worker killed mid-stream ends that stream
with an error (no hang) and the next requests go to the other one; a killed prefill
worker makes the decode workers recompute."""

from __future__ import annotations

import json
import os
import time
import urllib.request

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("aiohttp")

from pdkv.serving.launch import Deployment  # noqa: E402
from servers import build_tiny, completion_ids, concurrently, get  # noqa: E402

pytestmark = pytest.mark.slow  # starts four processes (about 15 s on two cores)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def dep(tiny, tmp_path_factory):
    d = Deployment("hybrid", tiny.model_dir, num_prefill=1, num_decode=2,
                   worker_args=["--block-tokens", "4", "--num-blocks", "256", "--max-batch-tokens", "16",
                                "--max-num-seqs", "8"],
                   proxy_args=["--hybrid-threshold", "10", "--kv-timeout", "5", "--read-timeout", "10"],
                   log_dir=tmp_path_factory.mktemp("logs"))
    d.start(timeout=180)
    yield d
    pids = [p.pid for p in d.processes]
    d.stop()
    for pid in pids:  # no stray processes
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _by_role(dep, role):
    return [p for p in dep.workers if p.role == role]


def test_processes_equal_generate(tiny, dep) -> None:
    assert dep.proxy.info["mode"] == "hybrid"
    for _ in range(2):
        results = concurrently(lambda p: completion_ids(dep.url, tiny.name, p), tiny.prompts)
        assert [ids for ids, _ in results] == tiny.refs
    routes = [st["route"] for _, st in results]
    assert routes == ["local", "local", "local", "disagg", "disagg"]
    assert {st["kv_transport"] for _, st in results[3:]} == {"shm"}


def _open_stream(url: str, body: dict):
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=60)


def test_killed_decode_worker_ends_its_stream_with_an_error(tiny, dep) -> None:
    body = {"model": tiny.name, "prompt": tiny.prompts[4], "max_tokens": 900, "temperature": 0, "ignore_eos": True}
    t0 = time.monotonic()
    with _open_stream(dep.url, body) as r:
        assert r.readline().startswith(b"data: ")  # streaming has begun
        busy = [p for p in _by_role(dep, "decode")
                if json.loads(get(dep.url + "/health")[1]) and
                any(w["url"] == p.url and w["in_flight"] for w in json.loads(get(dep.url + "/health")[1])["workers"])]
        assert len(busy) == 1
        busy[0].kill()
        rest = r.read().decode()
    assert time.monotonic() - t0 < 30
    # readline() left the first event's blank line behind: strip before matching.
    events = [e.strip()[len("data: "):] for e in rest.split("\n\n") if e.strip().startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == "worker_failed" and busy[0].url in err["message"]
    # The next requests are served by the other decode worker.
    for p, ref in zip(tiny.prompts, tiny.refs):
        ids, st = completion_ids(dep.url, tiny.name, p)
        assert ids == ref and st["decode_worker"] != busy[0].url


def test_killed_prefill_worker_means_recompute(tiny, dep) -> None:
    _by_role(dep, "prefill")[0].kill()
    for p, ref in zip(tiny.prompts[3:], tiny.refs[3:]):
        ids, st = completion_ids(dep.url, tiny.name, p)
        assert ids == ref and st["route"] == "disagg" and st["recomputed"] is True
