"""Helpers for the serving tests: a tiny model directory with its greedy references,
workers and proxies hosted in-process (threads with their own event loops), and small
HTTP clients.

Test modules import this after ``pytest.importorskip`` of torch, transformers and
aiohttp.
"""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import pytest
import torch

from pdkv.credential import Credential
from pdkv.serving.aio import ServerThread
from pdkv.serving.auth import sign_headers
from pdkv.serving.engine import EngineConfig
from pdkv.serving.models import load_model
from pdkv.serving.openai_api import TextCodec
from pdkv.serving.proxy import Proxy, ProxyConfig
from pdkv.serving.tiny import save_tiny_model
from pdkv.serving.worker import Worker, WorkerConfig

torch.set_num_threads(1)

SECRET = "serving-test-secret"
MAX_NEW = 10
#: Prompt lengths of the concurrent requests (a one-token prompt, block-straddling ones).
PROMPT_LENS = (1, 4, 9, 23, 37)
#: Hybrid threshold in the tests: the first three prompts are prefilled on the decode worker.
HYBRID_THRESHOLD = 10


@dataclass
class TinyServing:
    """A saved tiny model, its paged-attention instance and greedy references."""

    model_dir: Path
    name: str
    model: Any
    codec: TextCodec
    prompts: list[list[int]]
    refs: list[list[int]]


def make_prompts(vocab: int, lens: Sequence[int] = PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(7, vocab) for _ in range(n)] for n in lens]


def reference(model: Any, prompts: list[list[int]], max_new: int, pad: int = 0) -> list[list[int]]:
    """``model.generate(do_sample=False)`` per prompt."""
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                             pad_token_id=pad)
        outs.append(gen[0, len(p):].tolist())
    return outs


def build_tiny(root: Path, arch: str = "llama") -> TinyServing:
    d = save_tiny_model(root / f"tiny-{arch}", arch=arch, seed=3)
    ref_model = load_model(d, dtype="float32", attn_implementation="sdpa")
    codec = TextCodec.load(d)
    prompts = make_prompts(len(codec.tokenizer))
    refs = reference(ref_model, prompts, MAX_NEW)
    model = load_model(d, dtype="float32")
    return TinyServing(d, d.name, model, codec, prompts, refs)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> TinyServing:
    """The tiny model and its references, built once per test module (import it:
    a tests/serving/conftest.py would shadow tests/conftest.py)."""
    return build_tiny(tmp_path_factory.mktemp("models"))


class Stack:
    """In-process workers and proxies; :meth:`close` stops them all."""

    def __init__(self) -> None:
        self.threads: list[ServerThread] = []
        self.workers: dict[str, Worker] = {}

    def worker(self, tiny: TinyServing, role: str, *, mode: str = "colocated", max_batch_tokens: int = 64,
               num_blocks: int = 96, block_tokens: int = 4, **kw: Any) -> str:
        eng = EngineConfig(num_blocks=num_blocks, block_tokens=block_tokens, mode=mode,
                           max_batch_tokens=max_batch_tokens, max_num_seqs=8, num_threads=1)
        cfg = WorkerConfig(role=role, engine=eng, model_name=tiny.name, secret=SECRET, **kw)
        w = Worker(tiny.model, cfg, codec=tiny.codec if role == "colocated" else None, model_dir=str(tiny.model_dir))
        t = ServerThread(w)
        url = t.start()
        self.threads.append(t)
        self.workers[url] = w
        return url

    def proxy(self, mode: str, *, prefill: Sequence[str] = (), decode: Sequence[str], wait: bool = True,
              **kw: Any) -> str:
        kw.setdefault("secret", SECRET)
        p = Proxy(ProxyConfig(mode=mode, prefill=tuple(prefill), decode=tuple(decode), **kw))
        t = ServerThread(p)
        url = t.start()
        self.threads.append(t)
        if wait:
            assert t.call(lambda: p.wait_ready(60), timeout=90), "the proxy did not see its workers"
        return url

    def stop(self, url: str) -> None:
        """Stops one server (a worker that goes away)."""
        for t in self.threads:
            if t.url == url:
                t.stop()

    def close(self) -> None:
        for t in reversed(self.threads):
            t.stop()
        self.threads = []


def post(url: str, body: Any, timeout: float = 60.0, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """POSTs JSON; returns ``(status, decoded JSON body)`` also for HTTP errors."""
    data = _data(body)
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        with e:
            return e.code, json.loads(e.read())


def signed(method: str, url: str, body: bytes = b"", secret: str = SECRET) -> dict[str, str]:
    """The ``X-PDKV-Auth`` header of a worker call signed with ``secret`` (what a proxy sends)."""
    return sign_headers(Credential(secret), method, url, body)


def spost(url: str, body: Any, timeout: float = 60.0, secret: str = SECRET) -> tuple[int, Any]:
    """:func:`post`, signed like a proxy's call to a worker."""
    return post(url, body, timeout, headers=signed("POST", url, _data(body), secret))


def sget(url: str, timeout: float = 30.0, secret: str = SECRET) -> tuple[int, str]:
    """:func:`get`, signed like a proxy's call to a worker."""
    return get(url, timeout, headers=signed("GET", url, b"", secret))


def _data(body: Any) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


def get(url: str, timeout: float = 30.0, headers: dict[str, str] | None = None) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.read().decode()


def stream(url: str, body: dict[str, Any], timeout: float = 60.0) -> list[Any]:
    """POSTs a streaming request; returns the SSE ``data`` payloads (JSON-decoded, and
    the final ``"[DONE]"`` as is)."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    out: list[Any] = []
    with urllib.request.urlopen(req, timeout=timeout) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        for raw in r.read().decode().split("\n\n"):
            if not raw.strip():
                continue
            assert raw.startswith("data: "), raw
            payload = raw[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def completion_ids(base: str, name: str, prompt: list[int], *, max_tokens: int = MAX_NEW, streamed: bool = False,
                   **extra: Any) -> tuple[list[int], dict[str, Any]]:
    """Greedy completion of token ids; returns ``(output ids, pdkv stats)``."""
    body = {"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True,
            "pdkv_stats": True, **extra}
    if streamed:
        chunks = stream(base + "/v1/completions", body)
        assert chunks[-1] == "[DONE]"
        errors = [c for c in chunks[:-1] if "error" in c]
        assert not errors, errors
        ids = [t for c in chunks[:-1] for ch in c["choices"] for t in ch.get("token_ids", [])]
        stats = chunks[-2].get("pdkv", {})
        return ids, stats
    status, obj = post(base + "/v1/completions", body)
    assert status == 200, obj
    return obj["choices"][0]["token_ids"], obj.get("pdkv", {})


def concurrently(fn: Any, args: Sequence[Any]) -> list[Any]:
    """Runs ``fn(arg)`` for every arg at the same time; returns the results in order."""
    with ThreadPoolExecutor(len(args)) as ex:
        return list(ex.map(fn, args))
