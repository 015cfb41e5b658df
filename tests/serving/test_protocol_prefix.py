"""The cross-worker reuse fields of the worker protocol (:mod:`pdkv.serving.protocol`):
``Reservation.cached_blocks``, :class:`KVLease` (``PrefillRequest.src``), the
``/pd/kv_lease`` and ``/pd/kv_release`` bodies and the reuse figures of
:class:`KVResult`. Round trips, every cap (accepted at the cap, refused past it with
the field and the cap named), and fuzzing: nothing but InvalidArgument comes out of a
decoder, whatever the body holds."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdkv.errors import InvalidArgument
from pdkv.serving.kv_pull import PullConfig, PullCostModel, PullPolicy, push_span
from pdkv.serving.prefix_hash import block_hashes, cache_salt
from pdkv.serving.protocol import (GenParams, KVLease, KVReady, KVResult, LeaseRelease, LeaseRequest,
                                   PrefillRequest, ProtocolLimits, Reservation)

HASHES = block_hashes(list(range(40)), 4, cache_salt("m", block_tokens=4, dtype="float32"))
PARAMS = GenParams(max_tokens=4, seed=1)


def lease_json(**kw):
    return {"lease_id": "l1", "agent": "127.0.0.1:9", "name": "w", "block_tokens": 4, "start": 2,
            "blocks": [7, 8, 9], "generations": [1, 1, 3], **kw}


def res_json(**kw):
    return {"blocks": [1, 2, 3], "agent": "127.0.0.1:1", "name": "d", "block_tokens": 4, "generations": [1, 2, 3],
            **kw}


class TestRoundTrips:
    def test_reservation_cached_blocks(self) -> None:
        r = Reservation.from_json(res_json(cached_blocks=2))
        assert r.cached_blocks == 2 and Reservation.from_json(r.to_json()) == r
        assert Reservation.from_json(res_json()).cached_blocks == 0  # absent: nothing cached (older decoders)
        assert "cached_blocks" not in Reservation.from_json(res_json()).to_json()

    def test_lease_and_prefill_src(self) -> None:
        lease = KVLease.from_json(lease_json())
        assert (lease.start, lease.end, lease.blocks, lease.generations) == (2, 5, (7, 8, 9), (1, 1, 3))
        req = PrefillRequest("r", (1, 2, 3, 4, 5), PARAMS, Reservation.from_json(res_json()), 10.0, lease)
        back = PrefillRequest.from_json(req.to_json())
        assert back == req and back.src == lease
        assert PrefillRequest.from_json({**req.to_json(), "src": None}).src is None

    def test_lease_bodies(self) -> None:
        body = LeaseRequest("abc", tuple(HASHES[:3]), 2.5, 1)
        assert LeaseRequest.from_json(body.to_json()) == body
        assert LeaseRequest.from_json({"lease_id": "x", "hashes": []}) == LeaseRequest("x", (), 10.0, 0)
        assert LeaseRelease.from_json({"lease_id": "x"}) == LeaseRelease("x")

    def test_kv_result_reuse_fields(self) -> None:
        r = KVResult(True, True, 100, 0.1, "shm", cached_tokens=8, pulled_tokens=4, pulled_bytes=64,
                     computed_tokens=3, skipped_blocks=2)
        assert KVResult.from_json(r.to_json()) == r
        old = {"ok": True, "posted": True, "bytes": 5}  # a worker without the fields: zeros
        assert KVResult.from_json(old).skipped_blocks == 0 and KVResult.from_json(old).pulled_tokens == 0


class TestValidation:
    @pytest.mark.parametrize("cached,match", [(4, r"cached_blocks is 4, not in \[0, 3\]"),
                                              (-1, "cached_blocks must be an integer >= 0"),
                                              (True, "cached_blocks must be an integer"),
                                              ("2", "cached_blocks must be an integer")])
    def test_cached_blocks(self, cached, match) -> None:
        with pytest.raises(InvalidArgument, match=match):
            Reservation.from_json(res_json(cached_blocks=cached))

    def test_cached_blocks_cap(self) -> None:
        with pytest.raises(InvalidArgument, match="cached_blocks is 9, above this worker's cap of 8"):
            Reservation.from_json(res_json(blocks=[1] * 8, generations=[], cached_blocks=9),
                                  limits=ProtocolLimits(max_blocks=8))

    @pytest.mark.parametrize("body,match", [
        (lease_json(generations=[1]), "1 generations for 3 blocks"),
        (lease_json(lease_id=""), "lease_id must be a non-empty printable"),
        (lease_json(lease_id="a\nb"), "lease_id must be a non-empty printable"),
        (lease_json(lease_id="x" * 101), "lease_id has 101 characters, above this worker's cap of 100"),
        (lease_json(start=-1), "start must be an integer >= 0"),
        (lease_json(block_tokens=0), "block_tokens must be >= 1"),
        (lease_json(blocks=[1] * 9, generations=[1] * 9), "blocks has 9 entries, above this worker's cap of 8"),
        (lease_json(agent="a" * 300), "agent has 300 characters"),
        ({k: v for k, v in lease_json().items() if k != "generations"}, "missing field 'generations'"),
    ])
    def test_lease(self, body, match) -> None:
        with pytest.raises(InvalidArgument, match=match):
            KVLease.from_json(body, limits=ProtocolLimits(max_blocks=8))

    @pytest.mark.parametrize("body,match", [
        ({"lease_id": "x", "hashes": HASHES[:9]}, "the number of hashes is 9, above this worker's cap of 8"),
        ({"lease_id": "x", "hashes": ["zz"]}, "hashes must be block hashes"),
        ({"lease_id": "x", "hashes": [HASHES[0].upper()]}, "hashes must be block hashes"),
        ({"lease_id": "x", "hashes": [1]}, "hashes must be block hashes"),
        ({"lease_id": "x", "hashes": "ab"}, "field 'hashes' must be list"),
        ({"lease_id": "x", "hashes": [], "ttl_s": 31}, "ttl_s is 31 s, above this worker's cap of 30 s"),
        ({"lease_id": "x", "hashes": [], "ttl_s": 0}, "ttl_s must be a finite number > 0"),
        ({"lease_id": "x", "hashes": [], "ttl_s": math.inf}, "ttl_s must be a finite number"),
        ({"lease_id": "x", "hashes": [], "ttl_s": True}, "ttl_s must be a finite number"),
        ({"lease_id": "x", "hashes": [], "start": 1.5}, "start must be an integer"),
        ({"hashes": []}, "missing field 'lease_id'"),
    ])
    def test_lease_request(self, body, match) -> None:
        with pytest.raises(InvalidArgument, match=match):
            LeaseRequest.from_json(body, limits=ProtocolLimits(max_lease_hashes=8, max_lease_ttl_s=30))

    def test_lease_request_at_caps(self) -> None:
        lim = ProtocolLimits(max_lease_hashes=8, max_lease_ttl_s=30)
        assert len(LeaseRequest.from_json({"lease_id": "x", "hashes": HASHES[:8], "ttl_s": 30}, limits=lim).hashes) == 8

    @pytest.mark.parametrize("field", ["cached_tokens", "pulled_tokens", "pulled_bytes", "computed_tokens",
                                       "skipped_blocks"])
    @pytest.mark.parametrize("value", [-1, 1.5, "3", True, 1 << 64])
    def test_kv_result_counts(self, field, value) -> None:
        with pytest.raises(InvalidArgument, match=field):
            KVResult.from_json({"ok": True, field: value})


_scalars = st.none() | st.booleans() | st.integers(min_value=-(1 << 80), max_value=1 << 80) | \
    st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20) | st.sampled_from(HASHES[:2])
_keys = st.sampled_from(["lease_id", "agent", "name", "block_tokens", "start", "blocks", "generations", "hashes",
                         "ttl_s", "cached_blocks", "src", "dst", "pulled_tokens", "skipped_blocks", "ok"])
_json = st.recursive(_scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(_keys | st.text(max_size=4),
                                                                                          kids, max_size=6),
                     max_leaves=30)
_BASES = [lease_json(), res_json(cached_blocks=1), {"lease_id": "x", "hashes": HASHES[:2], "ttl_s": 1.0},
          {"lease_id": "x"}, {"ok": True, "cached_tokens": 1},
          {**PrefillRequest("r", (1, 2), PARAMS, Reservation.from_json(res_json()), 5.0,
                            KVLease.from_json(lease_json())).to_json()}]


def _mutated():
    return st.tuples(st.sampled_from(_BASES), st.sampled_from(sorted({k for b in _BASES for k in b})), _json) \
        .map(lambda t: {**t[0], t[1]: t[2]})


DECODERS = [KVLease.from_json, LeaseRequest.from_json, LeaseRelease.from_json, Reservation.from_json,
            PrefillRequest.from_json, KVResult.from_json]


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(obj=_json | _mutated())
def test_decoders_raise_only_invalid_argument(obj) -> None:
    for dec in DECODERS:
        try:
            dec(obj)
        except InvalidArgument:
            pass


# ---------------------------------------------------------------------------- pure helpers

def test_push_span_skips_exactly_what_decode_holds() -> None:
    def req(cached: int, dbt: int, n: int) -> PrefillRequest:
        nb = -(-n // dbt)
        return PrefillRequest("r", tuple(range(n)), PARAMS,
                              Reservation(tuple(range(nb)), "a", "d", dbt, tuple([1] * nb), cached), 5.0)

    assert push_span(req(0, 4, 10), 4) == (0, 0, 10)
    assert push_span(req(2, 4, 10), 4) == (2, 2, 2)
    assert push_span(req(1, 8, 10), 4) == (2, 1, 2)    # decode blocks of 8 = two local blocks of 4
    assert push_span(req(1, 4, 10), 8) == (0, 0, 10)   # 4 tokens end inside a local block of 8: from 0
    assert push_span(req(3, 4, 20), 8) == (1, 2, 12)   # 12 tokens: from the shared boundary at 8
    assert push_span(req(2, 4, 8), 4) == (2, 2, 0)     # decode holds every block


def test_cost_model_measures_and_decides() -> None:
    cm = PullCostModel(PullConfig(default_bandwidth=1e6, latency_s=0.001))
    assert cm.bandwidth("p") == 1e6 and cm.compute_seconds(100) is None
    assert not cm.worth_pulling("p", 1000, 100)  # prefill speed unknown: compute
    cm.observe_prefill(1000, 1.0)                # 1000 tokens/s
    assert cm.compute_seconds(100) == pytest.approx(0.1)
    assert cm.worth_pulling("p", 10_000, 100)    # 0.011 s < 0.1 s
    assert not cm.worth_pulling("p", 1_000_000, 100)  # 1.001 s > 0.1 s
    cm.observe_transfer("p", 10_000_000, 1.0)    # measured: 10 MB/s
    assert cm.bandwidth("p") == 1e7 and cm.bandwidth("other") == 1e6
    assert cm.worth_pulling("p", 500_000, 100)   # 0.051 s < 0.1 s now
    cm.observe_transfer("p", 100, 1.0)           # too small to measure a link
    assert cm.bandwidth("p") == 1e7
    assert PullCostModel(PullConfig(policy="always")).worth_pulling("p", 1 << 40, 1)
    assert not PullCostModel(PullConfig(policy=PullPolicy.OFF)).worth_pulling("p", 1, 1 << 20)


@pytest.mark.parametrize("kw,match", [({"policy": "sometimes"}, "policy must be one of"),
                                      ({"default_bandwidth": 0}, "default_bandwidth"),
                                      ({"timeout_s": math.inf}, "timeout_s"),
                                      ({"latency_s": -1}, "latency_s"),
                                      ({"min_tokens": 0}, "min_tokens")])
def test_pull_config_validates(kw, match) -> None:
    with pytest.raises(InvalidArgument, match=match):
        PullConfig(**kw)


def test_kv_ready_says_when_kv_was_lossy() -> None:
    assert KVReady.decode(KVReady("r", 1, 2).encode()).lossy is False
    assert b"lossy" not in KVReady("r", 1, 2).encode()  # older decode workers read it unchanged
    assert KVReady.decode(KVReady("r", 1, 2, lossy=True).encode()) == KVReady("r", 1, 2, True, True)
    with pytest.raises(InvalidArgument, match="lossy must be bools"):
        KVReady.decode(b'{"rid": "r", "t": 1, "seed": 2, "lossy": 1}')
