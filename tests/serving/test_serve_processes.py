"""A hybrid deployment of real processes (``pdkv serve prefill|decode|proxy``):
greedy output equals ``generate``; a frozen (SIGSTOP) prefill worker means recompute
on decode in bounded time; a decode worker frozen or killed mid-stream has its stream
continued on the other one, token for token the uninterrupted answer; a killed
prefill worker makes the decode workers recompute; with no decode worker left the
client gets a clear error, in bounded time."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import urllib.request

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("aiohttp")

from pdkv.serving.launch import Deployment  # noqa: E402
from servers import completion_ids, concurrently, get, post, tiny  # noqa: E402, F401 (tiny: a fixture)

pytestmark = pytest.mark.slow  # starts four processes (about 15 s on two cores)


@pytest.fixture(scope="module")
def dep(tiny, tmp_path_factory):
    d = Deployment("hybrid", tiny.model_dir, num_prefill=1, num_decode=2,
                   worker_args=["--block-tokens", "4", "--num-blocks", "256", "--max-batch-tokens", "16",
                                "--max-num-seqs", "8"],
                   proxy_args=["--hybrid-threshold", "10", "--kv-timeout", "5", "--read-timeout", "10",
                               "--liveness", "0.5", "--probe-timeout", "0.5"],
                   log_dir=tmp_path_factory.mktemp("logs"))
    d.start(timeout=180)
    yield d
    pids = [p.pid for p in d.processes]
    for pid in pids:  # a test that failed may have left one stopped
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
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


def _workers_health(dep) -> list[dict]:
    return json.loads(get(dep.url + "/health")[1])["workers"]


def _wait_up(dep, n_up: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while sum(w["up"] for w in _workers_health(dep)) < n_up:
        assert time.monotonic() < deadline, _workers_health(dep)
        time.sleep(0.1)


LONG = 900  # tokens of the streams interrupted below (long enough to be interrupted)


def _long_body(tiny) -> dict:
    return {"model": tiny.name, "prompt": tiny.prompts[4], "max_tokens": LONG, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "stream_options": {"include_usage": True}}


def _interrupted_stream(dep, tiny, fault) -> tuple[list[dict], object, float]:
    """Streams the long request, applies ``fault(worker)`` to the decode worker serving
    it once streaming has begun; returns the events after the first, that worker and
    the seconds the stream took."""
    t0 = time.monotonic()
    with _open_stream(dep.url, _long_body(tiny)) as r:
        first = r.readline()
        assert first.startswith(b"data: ")  # streaming has begun
        health = _workers_health(dep)
        busy = [p for p in _by_role(dep, "decode") if any(w["url"] == p.url and w["in_flight"] for w in health)]
        assert len(busy) == 1, health
        fault(busy[0])
        rest = r.read().decode()
    events = [json.loads(first[len("data: "):])] + \
        [e.strip()[len("data: "):] for e in rest.split("\n\n") if e.strip().startswith("data: ")]
    events = [e if isinstance(e, dict) or e == "[DONE]" else json.loads(e) for e in events]
    return events, busy[0], time.monotonic() - t0


def _ids_text_usage(events: list) -> tuple[list[int], str, dict]:
    assert events[-1] == "[DONE]"
    errors = [e for e in events[:-1] if "error" in e]
    assert not errors, errors
    chunks = [e for e in events[:-1] if e.get("choices")]
    ids = [t for c in chunks for t in c["choices"][0].get("token_ids", [])]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    usage = [e["usage"] for e in events[:-1] if e.get("usage")][-1]
    return ids, text, usage


@pytest.fixture(scope="module")
def uninterrupted(tiny, dep):
    """The long request's output without faults (streamed)."""
    with _open_stream(dep.url, _long_body(tiny)) as r:
        raw = r.read().decode()
    events = [e[len("data: "):] for e in raw.split("\n\n") if e.startswith("data: ")]
    events = [e if e == "[DONE]" else json.loads(e) for e in events]
    ids, text, usage = _ids_text_usage(events)
    assert len(ids) == LONG and usage == {"prompt_tokens": len(tiny.prompts[4]), "completion_tokens": LONG,
                                          "total_tokens": len(tiny.prompts[4]) + LONG}
    return ids, text, usage


def test_frozen_prefill_worker_means_recompute_in_bounded_time(tiny, dep) -> None:
    pre = _by_role(dep, "prefill")[0]
    os.kill(pre.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        for p, ref in zip(tiny.prompts[3:], tiny.refs[3:]):
            ids, st = completion_ids(dep.url, tiny.name, p)
            assert ids == ref and st["route"] == "disagg" and st["recomputed"] is True, json.dumps(st)
        assert time.monotonic() - t0 < 20  # did not hang (the bound is ~liveness + probe timeout)
        assert [w["up"] for w in _workers_health(dep) if w["role"] == "prefill"] == [False]
    finally:
        os.kill(pre.pid, signal.SIGCONT)
    _wait_up(dep, 3)  # answers probes again: back in rotation
    ids, st = completion_ids(dep.url, tiny.name, tiny.prompts[4])
    assert ids == tiny.refs[4] and st["recomputed"] is False


def test_frozen_decode_worker_mid_stream_is_migrated(tiny, dep, uninterrupted) -> None:
    frozen = []

    def freeze(w):
        os.kill(w.pid, signal.SIGSTOP)
        frozen.append(w)

    try:
        events, busy, took = _interrupted_stream(dep, tiny, freeze)
        ids, text, usage = _ids_text_usage(events)
        assert (ids, text, usage) == uninterrupted  # the same answer, token for token, usage counted once
        assert took < 60
        assert not next(w for w in _workers_health(dep) if w["url"] == busy.url)["up"]
    finally:
        for w in frozen:
            os.kill(w.pid, signal.SIGCONT)
    _wait_up(dep, 3)


def test_killed_decode_worker_mid_stream_is_migrated(tiny, dep, uninterrupted) -> None:
    events, busy, took = _interrupted_stream(dep, tiny, lambda w: w.kill())
    assert _ids_text_usage(events) == uninterrupted
    assert took < 60
    # The next requests are served by the other decode worker.
    for p, ref in zip(tiny.prompts, tiny.refs):
        ids, st = completion_ids(dep.url, tiny.name, p)
        assert ids == ref and st["decode_worker"] != busy.url


def test_killed_prefill_worker_means_recompute(tiny, dep) -> None:
    _by_role(dep, "prefill")[0].kill()
    for p, ref in zip(tiny.prompts[3:], tiny.refs[3:]):
        ids, st = completion_ids(dep.url, tiny.name, p)
        assert ids == ref and st["route"] == "disagg" and st["recomputed"] is True


def test_no_decode_worker_left_is_a_clear_error_in_bounded_time(tiny, dep) -> None:
    events, busy, took = _interrupted_stream(dep, tiny, lambda w: w.kill())
    assert took < 30
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]
    assert err["code"] == "worker_failed" and "no decode worker is left" in err["message"], err
    t0 = time.monotonic()
    status, obj = post(dep.url + "/v1/completions", {"model": tiny.name, "prompt": tiny.prompts[0], "max_tokens": 4})
    assert status == 503 and obj["error"]["code"] == "no_worker_available", obj
    assert time.monotonic() - t0 < 30
