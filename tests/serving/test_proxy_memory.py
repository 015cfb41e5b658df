"""The proxy's memory per request is bounded and does not grow with the model's context
length: its body cap is fixed (4 MiB by default; it was 64 bytes per token of context,
8 MiB at 128k), and a text prompt far past the context is refused after counting about
a context's worth of it, not after tokenizing all of it (two concurrent 8 MB prompts
took the proxy to 3.6 GiB). Measured as the proxy process's peak RSS (VmHWM) over the
requests, in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("aiohttp")

from servers import SECRET, Stack  # noqa: E402

from pdkv.serving.models import load_model  # noqa: E402
from pdkv.serving.openai_api import TextCodec  # noqa: E402
from pdkv.serving.tiny import save_tiny_model  # noqa: E402

#: Peak RSS growth allowed over two concurrent maximal requests (the body cap is 4 MiB:
#: bodies, their text and a context's worth of tokens, twice, fit well within it).
BOUND_MB = 160

_PROXY = textwrap.dedent("""
    import sys
    from pdkv.serving.aio import ServerThread
    from pdkv.serving.proxy import Proxy, ProxyConfig
    p = Proxy(ProxyConfig("colocated", decode=[sys.argv[1]]))
    t = ServerThread(p)
    url = t.start()
    assert t.call(lambda: p.wait_ready(120), timeout=150)
    print(url, flush=True)
    sys.stdin.read()
    t.stop()
""")


def _status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmHWM", "VmRSS"):
                out[k] = int(v.split()[0]) // 1024  # MiB
    return out


def _post(url: str, body: bytes) -> int:
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        with e:
            e.read()
            return e.code
    except (ConnectionError, urllib.error.URLError):
        return 0  # the proxy answered 413 and closed before reading the whole body


@pytest.fixture(scope="module")
def long_context(tmp_path_factory):
    """A tiny model whose context is 128k tokens (byte tokenizer: one token per byte)."""
    d = save_tiny_model(tmp_path_factory.mktemp("models") / "tiny-128k", arch="llama", seed=3,
                        max_position_embeddings=131072)
    return d, load_model(d, dtype="float32"), TextCodec.load(d)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/status")
def test_proxy_peak_rss_is_bounded_for_maximal_prompts(long_context) -> None:
    model_dir, model, codec = long_context
    s = Stack()
    proc = None
    try:
        from servers import TinyServing

        tiny = TinyServing(model_dir, model_dir.name, model, codec, [], [])
        worker = s.worker(tiny, "colocated", num_blocks=64)
        env = {**os.environ, "PDKV_SECRET": SECRET}
        proc = subprocess.Popen([sys.executable, "-c", _PROXY, worker], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=env)
        url = proc.stdout.readline().strip()
        assert url.startswith("http://"), "the proxy did not start"
        small = json.dumps({"model": tiny.name, "prompt": "hello world", "max_tokens": 2}).encode()
        assert _post(url + "/v1/completions", small) == 200  # tokenizer and sessions warm
        base = _status(proc.pid)
        # Two concurrent prompts of text just under 8 MiB (the old cap at 128k context)
        # and just under 4 MiB (the new cap): far past the context either way.
        statuses = []
        for size in (8 << 20, 4 << 20):
            body = json.dumps({"model": tiny.name, "prompt": "ab " * ((size - 200) // 3),
                               "max_tokens": 2}).encode()
            with ThreadPoolExecutor(2) as ex:
                statuses += list(ex.map(lambda b: _post(url + "/v1/completions", b), [body, body]))
            del body
        time.sleep(0.5)
        peak = _status(proc.pid)
        grew = peak["VmHWM"] - base["VmRSS"]
        print(f"proxy RSS before {base['VmRSS']} MiB, peak after {peak['VmHWM']} MiB (+{grew} MiB); "
              f"statuses {statuses}")
        assert all(st in (400, 413, 0) for st in statuses), statuses
        assert 400 in statuses  # the 4 MiB ones are read and refused as too long
        assert grew < BOUND_MB, f"the proxy's peak RSS grew by {grew} MiB over the requests"
        # Still serving.
        assert _post(url + "/v1/completions", small) == 200
    finally:
        if proc is not None:
            proc.stdin.close()
            proc.stdout.close()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        s.close()


def test_default_body_cap_is_independent_of_context() -> None:
    from pdkv.serving.openai_api import DEFAULT_BODY_BYTES, ModelInfo, body_limit

    short = ModelInfo("m", 100, 2048, 2048, 2048)
    long_ = ModelInfo("m", 100, 1 << 20, 1 << 20, 1 << 20)
    assert body_limit(short) == body_limit(long_) == body_limit(None) == DEFAULT_BODY_BYTES == 4 << 20
    assert body_limit(long_, 123) == 123


def test_over_long_text_is_refused_before_tokenizing_whole(long_context) -> None:
    """The counting pass stops once the prompt is certainly past the limit."""
    _d, _m, codec = long_context
    calls = []
    real = codec.tokenizer

    class Spy:
        def __call__(self, text, **kw):
            calls.append(len(text))
            return real(text, **kw)

        def __getattr__(self, name):
            return getattr(real, name)

    codec.tokenizer = Spy()
    try:
        from pdkv.serving.openai_api import APIError

        with pytest.raises(APIError) as ei:
            codec.encode("ab " * 1_000_000, max_tokens=1000)
        assert ei.value.status == 400 and ei.value.code == "context_length_exceeded"
        assert sum(calls) < 100_000, calls  # not the 3 MB text
        calls.clear()
        text = "ab " * 20_000  # 60k characters, within 100k tokens: tokenized whole, same ids
        assert codec.encode(text, max_tokens=100_000) == real(text, add_special_tokens=True)["input_ids"]
    finally:
        codec.tokenizer = real
