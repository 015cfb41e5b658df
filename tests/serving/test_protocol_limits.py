"""The /pd/* body decoders and the decode worker's notification handler under hostile
input: every client-supplied timeout, size and count has a server-side cap (400 naming
the field and the cap), and no payload -- arbitrary bytes, JSON of any shape, nesting
past Python's recursion limit -- gets anything but the library's InvalidArgument out of
a decoder, or stops the notification loop."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdkv.errors import InvalidArgument
from pdkv.serving.protocol import (GenerateRequest, GenParams, KVFailed, KVReady, KVResult, PrefillRequest,
                                   ProtocolLimits, Reservation, StreamError, WorkerInfo)

PARAMS = GenParams(max_tokens=4, temperature=0.0, top_p=1.0, seed=1).to_json()


def gen(**kw):
    return {"rid": "r", "prompt": [1, 2, 3], "params": dict(PARAMS), "kv_timeout_s": 30.0, **kw}


def pre(**kw):
    return {**gen(), "dst": {"blocks": [1], "agent": "127.0.0.1:1", "name": "d", "block_tokens": 4}, **kw}


class TestCaps:
    """Each cap: at the cap accepted, past it refused with the field and the cap named."""

    @pytest.mark.parametrize("value", [60.0, 60])
    def test_kv_timeout_at_cap(self, value) -> None:
        assert GenerateRequest.from_json(gen(kv_timeout_s=value)).kv_timeout_s == 60.0

    @pytest.mark.parametrize("value", [60.5, 1e9, 1e308])
    def test_kv_timeout_past_cap(self, value) -> None:
        for dec, body in ((GenerateRequest.from_json, gen(kv_timeout_s=value)),
                          (PrefillRequest.from_json, pre(kv_timeout_s=value))):
            with pytest.raises(InvalidArgument, match=r"kv_timeout_s.*cap of 60 s"):
                dec(body)

    @pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan, 0, -1, "5", True, None])
    def test_kv_timeout_not_a_finite_positive_number(self, value) -> None:
        with pytest.raises(InvalidArgument, match="kv_timeout_s"):
            GenerateRequest.from_json(gen(kv_timeout_s=value))

    def test_cap_is_configurable(self) -> None:
        lim = ProtocolLimits(max_kv_timeout_s=5)
        with pytest.raises(InvalidArgument, match="cap of 5 s"):
            GenerateRequest.from_json(gen(kv_timeout_s=6), limits=lim)
        assert GenerateRequest.from_json(gen(kv_timeout_s=5), limits=lim).kv_timeout_s == 5
        with pytest.raises(InvalidArgument):
            ProtocolLimits(max_kv_timeout_s=math.inf)

    @pytest.mark.parametrize("field,body,match", [
        ("rid", gen(rid="x" * 257), "rid has 257 characters, above this worker's cap of 256"),
        ("prompt", gen(prompt=[1] * 9), "prompt has 9 entries, above this worker's cap of 8"),
        ("max_tokens", gen(params={**PARAMS, "max_tokens": 9}), "max_tokens is 9, above this worker's cap of 8"),
        ("stop_token_ids", gen(params={**PARAMS, "stop_token_ids": [1] * 9}), "stop_token_ids has 9 entries"),
        ("index_offset", gen(params={**PARAMS, "index_offset": 9}), "index_offset is 9, above"),
        ("seed", gen(params={**PARAMS, "seed": 1 << 64}), "seed"),
        ("temperature", gen(params={**PARAMS, "temperature": math.inf}), "temperature must be a finite"),
        ("prompt ids", gen(prompt=[1 << 70]), "64-bit"),
    ])
    def test_generate_fields(self, field, body, match) -> None:
        lim = ProtocolLimits(max_prompt_tokens=8, max_new_tokens=8, max_stop_token_ids=8, max_index_offset=8)
        with pytest.raises(InvalidArgument, match=match):
            GenerateRequest.from_json(body, limits=lim)

    @pytest.mark.parametrize("dst,match", [
        ({"blocks": [1] * 9, "agent": "a", "name": "d", "block_tokens": 4}, "blocks has 9 entries"),
        ({"blocks": [1], "generations": [1] * 9, "agent": "a", "name": "d", "block_tokens": 4},
         "generations has 9 entries"),
        ({"blocks": [1], "agent": "a" * 300, "name": "d", "block_tokens": 4}, "agent has 300 characters"),
        ({"blocks": [1], "agent": "a", "name": "d" * 300, "block_tokens": 4}, "name has 300 characters"),
        ({"blocks": [1], "agent": "a", "name": "d", "block_tokens": 1 << 20}, "block_tokens is 1048576"),
        ({"blocks": [1], "agent": "a", "name": "d", "block_tokens": 0}, "block_tokens must be >= 1"),
    ])
    def test_reservation_fields(self, dst, match) -> None:
        with pytest.raises(InvalidArgument, match=match):
            PrefillRequest.from_json(pre(dst=dst), limits=ProtocolLimits(max_blocks=8))

    def test_kv_failed_fields(self) -> None:
        with pytest.raises(InvalidArgument, match="error has 5000 characters, above this worker's cap of 4096"):
            KVFailed.from_json({"rid": "r", "error": "e" * 5000})
        with pytest.raises(InvalidArgument, match="terminal must be a bool"):
            KVFailed.from_json({"rid": "r", "terminal": "no"})
        assert KVFailed.from_json({"rid": "r", "error": "e" * 4096}).error == "e" * 4096


# ---------------------------------------------------------------------------- fuzzing

_scalars = st.none() | st.booleans() | st.integers(min_value=-(1 << 80), max_value=1 << 80) | \
    st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20)
_json = st.recursive(_scalars, lambda kids: st.lists(kids, max_size=4) |
                     st.dictionaries(st.sampled_from(["rid", "prompt", "params", "kv_timeout_s", "dst", "blocks",
                                                      "agent", "name", "block_tokens", "generations", "t", "seed",
                                                      "kv", "max_tokens", "temperature", "top_p", "ignore_eos",
                                                      "stop_token_ids", "index_offset", "error", "terminal",
                                                      "first_token", "ok", "bytes", "role", "model", "vocab_size",
                                                      "max_model_len", "eos_token_ids", "aliases", "x"]) |
                                     st.text(max_size=5), kids, max_size=6), max_leaves=30)


def _mutated_valid():
    """Valid bodies with one member replaced by anything."""
    bases = [gen(), pre(), {"rid": "r", "t": 1, "seed": 2, "kv": True}, {"rid": "r", "first_token": 1}]
    return st.tuples(st.sampled_from(bases), st.sampled_from(sorted({k for b in bases for k in b})), _json) \
        .map(lambda t: {**t[0], t[1]: t[2]})


DECODERS = [GenerateRequest.from_json, PrefillRequest.from_json, KVFailed.from_json, Reservation.from_json,
            GenParams.from_json, KVResult.from_json, WorkerInfo.from_json]


def _only_library_errors(fn, arg) -> None:
    try:
        fn(arg)
    except InvalidArgument:
        pass


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(obj=_json | _mutated_valid())
def test_body_decoders_raise_only_invalid_argument(obj) -> None:
    for dec in DECODERS:
        _only_library_errors(dec, obj)
    StreamError.from_line({"error": obj})  # never raises
    _only_library_errors(KVReady.decode, json.dumps(obj).encode())


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.binary(max_size=200) | st.text(max_size=100).map(lambda t: t.encode("utf-8", "surrogatepass")))
def test_notification_decoder_raw_bytes(data) -> None:
    _only_library_errors(KVReady.decode, data)


NASTY = [b"[" * 100_000, b"{\"a\":" * 100_000, b'{"rid": "r", "t": 1, "seed": ' + b"9" * 5000 + b"}",
         b'{"rid": "r", "t": 1e999, "seed": 1}', b"\xff\xfe\x00", b"", b"null", b'"x"', b"NaN",
         b'{"rid": ["x"], "t": 1, "seed": 1}', b'{"rid": "r", "t": 1, "seed": 1, "kv": "no"}',
         json.dumps({"rid": "x" * 100_000, "t": 1, "seed": 1}).encode()]


@pytest.mark.parametrize("data", NASTY, ids=range(len(NASTY)))
def test_notification_decoder_nasty(data) -> None:
    with pytest.raises(InvalidArgument):
        KVReady.decode(data)


@pytest.mark.parametrize("data", NASTY[:3], ids=range(3))
def test_body_decoders_nasty_json(data) -> None:
    from pdkv.serving.protocol import loads

    with pytest.raises(InvalidArgument):
        loads(data, where="request body")


class _FakeNotifications:
    def __init__(self, payloads) -> None:
        self.payloads = payloads

    async def notifications(self):
        from pdkv import Notification

        for p in self.payloads:
            yield Notification("evil-peer", p)
            await asyncio.sleep(0)


def _receiver(agent):
    pytest.importorskip("torch")
    from pdkv.serving.handoff import KVReceiver
    from pdkv.serving.metrics import Registry

    reg = Registry()
    return KVReceiver(agent, None, executor=None, address="", registry=reg), reg


def test_notification_loop_survives_any_payload() -> None:
    """A nested-JSON notification used to end the decode worker's loop for good
    (RecursionError out of deliver); now every bad one is dropped and counted, and the
    valid one after them is still delivered."""
    good = KVReady("wanted", 5, 7).encode()
    agent = _FakeNotifications(NASTY + [good])
    rx, reg = _receiver(agent)

    async def main():
        fut = asyncio.get_running_loop().create_future()
        rx._waiting["wanted"] = fut
        await asyncio.wait_for(rx.run_notifications(), 30)
        return fut

    fut = asyncio.run(main())
    assert fut.done() and fut.result().first_token == 5
    assert sum(rx.dropped.values()) == len(NASTY)
    assert "pdkv_notifications_dropped_total" in reg.render()


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.binary(max_size=100) | _json.map(lambda o: json.dumps(o).encode()))
def test_deliver_never_raises(data) -> None:
    rx, _ = _receiver(None)
    assert rx.deliver(data, "p") is False
