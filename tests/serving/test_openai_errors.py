"""Every error the proxy and a colocated worker answer is OpenAI's JSON error object
with the right status, whatever the client sends (unknown paths, wrong methods,
oversized, malformed or deeply nested bodies, lone surrogates); no client input yields
a 500; tokenization and large JSON run off the event loop."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("aiohttp")

from servers import Stack, post, tiny  # noqa: E402, F401 (tiny: a fixture)

MiB = 1 << 20


@pytest.fixture(scope="module")
def stack(tiny):
    s = Stack()
    try:
        s.col = s.worker(tiny, "colocated", mode="colocated")
        s.proxy_url = s.proxy("colocated", decode=[s.col])
        s.small = s.proxy("colocated", decode=[s.col], max_body_bytes=4096)
        s.big = s.proxy("colocated", decode=[s.col], max_body_bytes=64 * MiB)
        yield s
    finally:
        s.close()


@pytest.fixture(params=["proxy", "worker"])
def base(request, stack) -> str:
    return stack.proxy_url if request.param == "proxy" else stack.col


def _request(url: str, data: bytes | None = None, method: str | None = None,
             content_type: str = "application/json") -> tuple[int, dict, object]:
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        with e:
            raw = e.read()
            try:
                obj = json.loads(raw)
            except ValueError:
                obj = raw
            return e.code, dict(e.headers), obj


def _assert_openai_error(status: int, obj: object, want: int, type_: str = "invalid_request_error") -> dict:
    assert status == want, obj
    assert isinstance(obj, dict) and set(obj) == {"error"}, obj
    err = obj["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == type_
    return err


def test_unknown_path_is_an_openai_404(base) -> None:
    status, _h, obj = _request(base + "/v1/no/such/path")
    err = _assert_openai_error(status, obj, 404)
    assert err["code"] == "not_found"


def test_wrong_method_is_an_openai_405(base) -> None:
    status, headers, obj = _request(base + "/v1/completions")  # GET
    _assert_openai_error(status, obj, 405)
    assert "POST" in headers.get("Allow", "")
    status, _h, obj = _request(base + "/v1/models", data=b"{}", method="POST")
    _assert_openai_error(status, obj, 405)


def test_body_over_the_default_limit_is_an_openai_413(tiny, base) -> None:
    # The default limit is 4 MiB, whatever the model's context (docs/serving.md).
    body = json.dumps({"model": tiny.name, "prompt": "a" * (5 * MiB)}).encode()
    status, _h, obj = _request(base + "/v1/completions", body)
    err = _assert_openai_error(status, obj, 413)
    assert str(4 * MiB) in err["message"]


def test_max_body_bytes_is_configurable(tiny, stack) -> None:
    body = json.dumps({"model": tiny.name, "prompt": "a" * 5000}).encode()
    status, _h, obj = _request(stack.small + "/v1/completions", body)
    _assert_openai_error(status, obj, 413)
    ok = json.dumps({"model": tiny.name, "prompt": "hello", "max_tokens": 2}).encode()
    assert _request(stack.small + "/v1/completions", ok)[0] == 200


def test_cli_has_max_body_bytes() -> None:
    from pdkv.serving.cli import build_parser

    assert build_parser().parse_args(["proxy", "--max-body-bytes", "12345"]).max_body_bytes == 12345
    assert build_parser().parse_args(["proxy"]).max_body_bytes is None


@pytest.mark.parametrize("where", ["prompt", "messages", "stop"])
def test_lone_surrogate_is_a_400(tiny, base, where: str) -> None:
    if where == "prompt":
        path, raw = "/v1/completions", '{"model": %s, "prompt": "ab\\ud800cd"}'
    elif where == "messages":
        path, raw = "/v1/chat/completions", '{"model": %s, "messages": [{"role": "user", "content": "\\udfff"}]}'
    else:
        path, raw = "/v1/completions", '{"model": %s, "prompt": "hi", "stop": ["\\ud800"]}'
    status, _h, obj = _request(base + path, (raw % json.dumps(tiny.name)).encode())
    err = _assert_openai_error(status, obj, 400)
    assert err["param"] == where


def test_deeply_nested_json_is_a_400(tiny, base) -> None:
    depth = 100_000
    body = b'{"model": "' + tiny.name.encode() + b'", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
    status, _h, obj = _request(base + "/v1/completions", body)
    _assert_openai_error(status, obj, 400)


@pytest.mark.parametrize("body", [b"{not json", b"\xff\xfe\x00{", b"[1, 2]", b"", b'"text"', b"null"],
                         ids=["syntax", "not-utf8", "array", "empty", "string", "null"])
def test_invalid_json_or_content_is_a_400(base, body: bytes) -> None:
    status, _h, obj = _request(base + "/v1/completions", body)
    _assert_openai_error(status, obj, 400)
    status, _h, obj = _request(base + "/v1/chat/completions", body, content_type="text/plain")
    _assert_openai_error(status, obj, 400)


def test_no_client_input_is_a_500(tiny, base) -> None:
    bodies = [
        {"model": tiny.name, "prompt": "x", "max_tokens": 10 ** 30},
        {"model": tiny.name, "prompt": [10 ** 30]},
        {"model": tiny.name, "prompt": "x", "seed": 10 ** 30},
        {"model": tiny.name, "prompt": "x", "stop_token_ids": [10 ** 30]},
        {"model": tiny.name, "prompt": "x", "temperature": 1e308},
        {"model": tiny.name, "messages": [{"role": "user", "content": {"a": 1}}]},
        {"model": [tiny.name], "prompt": "x"},
        {"model": tiny.name, "prompt": "x", "stream_options": []},
    ]
    for b in bodies:
        path = "/v1/chat/completions" if "messages" in b else "/v1/completions"
        status, obj = post(base + path, b)
        assert status == 200 or 400 <= status < 500, (b, obj)
        if status != 200:
            _assert_openai_error(status, obj, status)


def test_a_large_prompt_does_not_stall_small_requests(tiny, stack) -> None:
    """A multi-MB text prompt is decoded off the event loop and, far past the context,
    refused after counting about a context's worth of it (it used to be tokenized whole,
    for seconds); small requests sent meanwhile are served."""
    url = stack.big + "/v1/completions"
    big = json.dumps({"model": tiny.name, "prompt": "hello world " * (400_000), "max_tokens": 1}).encode()
    small = json.dumps({"model": tiny.name, "prompt": "hi", "max_tokens": 2, "temperature": 0}).encode()
    done: list[str] = []
    took: dict[str, float] = {}
    lock = threading.Lock()

    def send(name: str, data: bytes) -> None:
        t0 = time.monotonic()
        status, _h, obj = _request(url, data)
        assert status in (200, 400), obj  # the big one is longer than the context: a 400
        if name == "big":
            assert status == 400 and obj["error"]["code"] == "context_length_exceeded", obj
        with lock:
            done.append(name)
            took[name] = time.monotonic() - t0

    t_big = threading.Thread(target=send, args=("big", big))
    t_big.start()
    time.sleep(0.5)  # the big body is uploaded and its tokenization under way
    smalls = [threading.Thread(target=send, args=(f"small{i}", small)) for i in range(3)]
    for t in smalls:
        t.start()
    for t in smalls + [t_big]:
        t.join(120)
    assert sorted(done) == ["big", "small0", "small1", "small2"]
    assert max(took.values()) < 30, took
