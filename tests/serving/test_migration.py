"""Request migration: a stream continued elsewhere after ``n`` tokens (prompt plus the
tokens sent, ``max_tokens`` reduced by ``n``, ``index_offset`` raised by ``n``, the same
seed) is, token for token, the uninterrupted request -- sampled ones included. The
process-level tests (killed and frozen decode workers) are in test_serve_processes.py."""

from __future__ import annotations

import dataclasses
import json
import urllib.request

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("aiohttp")

from pdkv.errors import InvalidArgument  # noqa: E402
from pdkv.serving.engine import Engine, EngineConfig  # noqa: E402
from pdkv.serving.protocol import GenParams  # noqa: E402
from pdkv.serving.sampling import SamplingParams  # noqa: E402
from servers import Stack, get, tiny  # noqa: E402, F401 (tiny: a fixture)
from tinylm import tiny_model  # noqa: E402


def test_index_offset_travels_and_is_checked() -> None:
    p = GenParams(max_tokens=5, temperature=0.7, seed=9, index_offset=3)
    assert GenParams.from_json(p.to_json()) == p
    assert GenParams.from_json({**p.to_json(), "index_offset": 0}).index_offset == 0
    old = p.to_json()
    del old["index_offset"]  # an older proxy's request
    assert GenParams.from_json(old).index_offset == 0
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(InvalidArgument, match="index_offset"):
            GenParams.from_json({**p.to_json(), "index_offset": bad})
    with pytest.raises(InvalidArgument, match="index_offset"):
        SamplingParams(index_offset=-1)
    assert SamplingParams.of(p).index_offset == 3


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (1.0, 1.0), (0.8, 0.9)])
def test_continuation_equals_uninterrupted_run(temperature, top_p) -> None:
    tm = tiny_model("llama_gqa")
    eng = Engine(tm.model, EngineConfig(num_blocks=64, block_tokens=4, mode="chunked", max_batch_tokens=16,
                                        max_num_seqs=8))
    n = 12
    params = SamplingParams(max_tokens=n, temperature=temperature, top_p=top_p, seed=1234, ignore_eos=True)
    prompt = list(tm.prompts[1])
    [full] = eng.generate([prompt], params)
    assert len(full) == n
    for k in (1, 5, n - 1):
        cont = dataclasses.replace(params, max_tokens=n - k, index_offset=k)
        [rest] = eng.generate([prompt + full[:k]], cont)
        assert full[:k] + rest == full, k
    if temperature > 0:  # without the offset the draws differ (the test can tell)
        other = [eng.generate([prompt + full[:k]], dataclasses.replace(params, max_tokens=n - k))[0]
                 for k in (1, 5)]
        assert any(full[k:] != o for k, o in zip((1, 5), other))


def _stream(url: str, body: dict) -> tuple[list[int], str]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        raw = r.read().decode()
    events = [e[len("data: "):] for e in raw.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]"
    objs = [json.loads(e) for e in events[:-1]]
    assert not [o for o in objs if "error" in o], objs
    chunks = [o for o in objs if o.get("choices")]
    return ([t for c in chunks for t in c["choices"][0].get("token_ids", [])],
            "".join(c["choices"][0]["text"] for c in chunks))


def test_sampled_stream_migrated_in_process_equals_uninterrupted(tiny) -> None:
    """Two engine workers behind a colocated proxy; the one serving a sampled stream
    is stopped mid-stream: the client receives the uninterrupted answer."""
    s = Stack()
    try:
        a, b = s.worker(tiny, "colocated"), s.worker(tiny, "colocated")
        url = s.proxy("colocated", decode=[a, b], liveness_s=0.5, probe_timeout_s=0.5)
        body = {"model": tiny.name, "prompt": tiny.prompts[3], "max_tokens": 300, "temperature": 0.9, "seed": 5,
                "ignore_eos": True, "return_token_ids": True}
        ref = _stream(url, body)
        assert len(ref[0]) == 300
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            first = r.readline()
            assert first.startswith(b"data: ")
            workers = json.loads(get(url + "/health")[1])["workers"]
            [busy] = [w["url"] for w in workers if w["in_flight"]]
            s.stop(busy)
            raw = first.decode() + r.read().decode()
        events = [e.strip()[len("data: "):] for e in raw.split("\n\n") if e.strip().startswith("data: ")]
        assert events[-1] == "[DONE]"
        objs = [json.loads(e) for e in events[:-1]]
        assert not [o for o in objs if "error" in o], objs[-1]
        chunks = [o for o in objs if o.get("choices")]
        got = ([t for c in chunks for t in c["choices"][0].get("token_ids", [])],
               "".join(c["choices"][0]["text"] for c in chunks))
        assert got == ref
        # The stopped worker was taken out of rotation. (Not checked through /health's
        # "up": its freed port may be taken by another server on this machine, which
        # would then answer the liveness probe and bring the URL back.)
        failures = [line for line in get(url + "/metrics")[1].splitlines()
                    if line.startswith("pdkv_worker_failures_total{") and f'worker="{busy}"' in line]
        assert failures and float(failures[0].rsplit(" ", 1)[1]) >= 1, failures
    finally:
        s.close()
