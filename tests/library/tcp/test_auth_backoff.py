"""The tcp listener's authentication back-off is keyed on (source address, claimed agent
name) (cpp/src/transport/tcp/guard.h): a misconfigured peer (wrong secret) hammering
from 127.0.0.1 backs off alone, and a good peer from 127.0.0.1 still authenticates and
transfers at once. A guesser that rotates names is still held back (the address as a
whole backs off beyond a few names)."""

from __future__ import annotations

import numpy as np
import pytest

import pdkv
from conftest import SECRET
from test_bad_input import CODES, T_ERROR, authenticate


@pytest.fixture
def target():
    with pdkv.Agent("target", secret=SECRET, transports=["tcp"]) as t:
        mem = np.zeros(1 << 16, np.uint8)
        region = t.register(mem)
        yield t, mem, region


def _refusals(errors: list[str]) -> int:
    return sum("too many failed authentications" in e for e in errors)


def test_a_wrong_secret_peer_does_not_lock_out_a_good_peer_on_the_same_host(target) -> None:
    t, mem, region = target
    errors = []
    with pdkv.Agent("misconfigured", secret="not-" + SECRET, transports=["tcp"]) as bad:
        for _ in range(8):
            with pytest.raises(pdkv.AuthFailed) as e:
                bad.connect(t.address, timeout=5)
            errors.append(str(e.value))
        assert _refusals(errors) >= 1, errors  # the bad peer is in its back-off window now
        # A good peer from the same address, at once: no window to wait out.
        with pdkv.Agent("good", secret=SECRET, transports=["tcp"]) as good:
            src = np.random.default_rng(3).integers(0, 256, 4096, dtype=np.uint8)
            rs = good.register(src)
            peer = good.connect(t.address, timeout=5)
            assert good.prepare_extents("write", peer, [(rs.id, 0, region.id, 100, 4096)]).post().wait(5)
            assert np.array_equal(mem[100:4196], src)
        # The bad peer is still refused (its own window), named in the refusal.
        with pytest.raises(pdkv.AuthFailed, match="misconfigured|wrong secret"):
            bad.connect(t.address, timeout=5)


def test_rotating_names_from_one_address_still_back_off(target) -> None:
    import socket

    t, _mem, _region = target
    host, port = t.address.rsplit(":", 1)
    answers = []
    for i in range(40):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            h, aux = authenticate(s, "wrong-secret", name=f"guess-{i}")
            assert h[1] == T_ERROR and CODES[h[8]] == "AuthFailed"
            answers.append(aux.decode())
    judged = sum("wrong secret" in a for a in answers)
    assert _refusals(answers) > 0 and judged + _refusals(answers) == len(answers)
    assert judged <= 8 + 1 + 5, judged  # the tracked names' free guesses, then the address backs off
