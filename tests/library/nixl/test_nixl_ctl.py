"""nixl control messages (NIXL notifications pdkv's nixl transport exchanges: hello,
challenge, proof, hello-ack, bye, revoke, revoke-ack) are decoded by one validating function with size
limits checked before parsing; a peer sending garbage changes nothing and the agent
keeps serving (docs/wire.md, "nixl control messages")."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import pdkv
from pdkv.backends.nixl import (NixlTransport, _CTL, _MAX_CTL_BYTES, _MAX_REVOKE_REGIONS, _USER, _ctl, _parse_ctl,
                                nixl_agent_name)

VALID = [
    _ctl(k="hello", epoch=3, md="AAAA", nonce="ab" * 32, pub="cd" * 32),
    _ctl(k="challenge", epoch=3, nonce="ab" * 32, pub="cd" * 32),
    _ctl(k="proof", epoch=3, mac="ef" * 32),
    _ctl(k="hello-ack", epoch=3, error="", mac="ef" * 32),
    _ctl(k="bye", epoch=3),
    _ctl(k="revoke", regions=[1, 2], seq=9),
    _ctl(k="revoke-ack", seq=9),
]

BAD = {
    "not json": b"{nope",
    "deeply nested": b"[" * 100_000 + b"]" * 100_000,
    "nested object": b'{"k":"bye","epoch":' + b'{"a":' * 50_000 + b"1" + b"}" * 50_000 + b"}",
    "not an object": b"[1, 2]",
    "unknown kind": json.dumps({"k": "rm -rf", "seq": 1}).encode(),
    "kind not a string": json.dumps({"k": 7}).encode(),
    "missing field": json.dumps({"k": "revoke-ack"}).encode(),
    "extra field": json.dumps({"k": "bye", "epoch": 1, "x": 0}).encode(),
    "bool for int": json.dumps({"k": "bye", "epoch": True}).encode(),
    "negative int": json.dumps({"k": "revoke-ack", "seq": -1}).encode(),
    "huge int": json.dumps({"k": "revoke-ack", "seq": 1 << 64}).encode(),
    "float": json.dumps({"k": "revoke-ack", "seq": 1.5}).encode(),
    "string for list": json.dumps({"k": "revoke", "regions": "1", "seq": 1}).encode(),
    "empty revoke": json.dumps({"k": "revoke", "regions": [], "seq": 1}).encode(),
    "too many regions": json.dumps({"k": "revoke", "regions": list(range(_MAX_REVOKE_REGIONS + 1)),
                                    "seq": 1}).encode(),
    "non-int region": json.dumps({"k": "revoke", "regions": [1, "2"], "seq": 1}).encode(),
    "long error": json.dumps({"k": "hello-ack", "epoch": 1, "error": "x" * 5000, "mac": ""}).encode(),
    "oversized": json.dumps({"k": "bye", "epoch": 1, "pad": "x" * _MAX_CTL_BYTES}).encode(),
}


@pytest.mark.parametrize("raw", VALID, ids=lambda r: json.loads(r[1:])["k"])
def test_every_kind_we_send_is_accepted(raw):
    assert raw[:1] == _CTL
    assert _parse_ctl(raw[1:]) == json.loads(raw[1:])


@pytest.mark.parametrize("name", sorted(BAD))
def test_malformed_messages_are_protocol_errors(name):
    with pytest.raises(pdkv.ProtocolError, match="nixl"):
        _parse_ctl(BAD[name])


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=256),
                 st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                              lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
                              max_leaves=20).map(lambda v: json.dumps(v).encode())))
def test_any_input_is_accepted_or_a_protocol_error(raw):
    try:
        msg = _parse_ctl(raw)
    except pdkv.ProtocolError:
        return
    assert isinstance(msg, dict) and msg["k"] in {"hello", "challenge", "proof", "hello-ack", "bye", "revoke",
                                                 "revoke-ack"}


@pytest.mark.nixl
def test_a_peer_sending_garbage_changes_nothing():
    """a's NIXL engine sends b every malformed control message and an oversized user
    notification; b drops them (no exception escapes its poller), then serves a's
    transfers and notifications as before."""
    from test_nixl import connected_pair

    with connected_pair() as (a, b, pa, pb, peer):
        eng = NixlTransport.of(a)._eng
        target = nixl_agent_name(b.name, b.instance_id)
        for raw in BAD.values():
            eng.notify(target, _CTL + raw)
        eng.notify(target, _USER + b"x" * ((1 << 20) + 1))  # over max_notif_bytes
        assert a.write(peer, pdkv.Blocks("kv", range(64)), notify=b"after-garbage").wait(20)
        got = b.wait_notifications(20)
        assert [m.data for m in got] == [b"after-garbage"]
        assert np.array_equal(pb.logical(range(64)), pa.logical(range(64)))
