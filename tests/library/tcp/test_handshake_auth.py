"""The handshake proves the secret and never sends it (pdkv/spi/auth.h, docs/security.md).

Classes, over every transport with a socket handshake (tcp; shm; nixl's control
messages): a captured successful exchange contains no secret nor anything derived from
it alone; the captured initiator bytes replayed on a new connection are refused; a
target's own MAC reflected back as a proof is refused and a target never proves itself
to an initiator that has not proved first; an impostor target (no secret) is refused
by the initiator before any data is sent; a wrong secret is refused; rotation (several
accepted secrets) lets old and new secrets meet.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import socket
import struct
import threading

import numpy as np
import pytest

import pdkv
from conftest import Relay, listen_like
from test_bad_input import (HDR, T_CHALLENGE, challenge, T_ERROR, T_HELLO_ACK, T_PROOF, T_WRITE, WIRE_VERSION, authenticate,
                            frame, parse_challenge, recv_frame)

SECRET = "correct horse battery staple"
TRANSPORTS = [t for t in ("tcp", "shm") if t in pdkv.available_transports()]


def derived(secret: str) -> list[bytes]:
    """What must never cross a wire: the secret and what is derived from it alone."""
    s = secret.encode()
    master = hashlib.pbkdf2_hmac("sha256", s, b"pdkv cluster credential v1", 20000)
    key = hmac.new(master, b"pdkv purpose v1\0transport", hashlib.sha256).digest()
    out = [s, s.hex().encode(), base64.b64encode(s), hashlib.sha256(s).digest(), hashlib.sha256(s).hexdigest().encode(),
           master, key, master.hex().encode(), key.hex().encode()]
    return out


def endpoint(agent: pdkv.Agent, transport: str) -> str:
    return dict(pdkv.decode_metadata(agent.metadata())["endpoints"])[transport]


def relayed(transport: str, t: pdkv.Agent, i: pdkv.Agent):
    """A recording relay in front of `t`'s `transport` endpoint and `i`'s peer for `t`
    pointing at it (an address of the same length replaces the real one in the blob)."""
    real = endpoint(t, transport)
    if transport == "tcp":
        ls, via = listen_like(real)
        host, port = real.rsplit(":", 1)
        relay = Relay(ls, (host, int(port)))
    else:
        d, base = os.path.split(real)
        via = os.path.join(d, os.urandom(len(base)).hex()[:len(base) - 5] + ".sock")
        ls = socket.socket(socket.AF_UNIX)
        ls.bind(via)
        ls.listen(16)
        relay = Relay(ls, real)
    blob = t.metadata()
    assert blob.count(real.encode()) == 1
    return relay, i.add_peer(blob.replace(real.encode(), via.encode()), transport=transport)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_captured_exchange_carries_no_secret_and_replays_fail(transport):
    with pdkv.Agent("target", secret=SECRET, transports=[transport]) as t, \
            pdkv.Agent("initiator", secret=SECRET, transports=[transport]) as i:
        dst = np.zeros(4096, np.uint8)
        src = np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8)
        rd, rs = t.register(dst), i.register(src)
        relay, peer = relayed(transport, t, i)
        try:
            assert i.prepare_extents("write", peer, [(rs.id, 0, rd.id, 0, 4096)]).post().wait(10)
            assert np.array_equal(dst, src)
            wire = relay.wire()
            assert len(wire) > (4096 if transport == "tcp" else 200)  # the handshake (tcp: and the data) went through
            for needle in derived(SECRET):
                assert needle not in wire, f"the wire carries {needle[:12]!r}..."
            up = b"".join(relay.up)
        finally:
            relay.close()
        # Replay: the initiator's captured bytes, on a fresh connection, are refused
        # (the target's nonce and key are new), and the region is as it was.
        reply = _replay(transport, t, up)
        assert b"wrong secret" in reply, reply[:200]
        assert np.array_equal(dst, src)


def _replay(transport: str, t: pdkv.Agent, up: bytes) -> bytes:
    real = endpoint(t, transport)
    if transport == "tcp":
        host, port = real.rsplit(":", 1)
        s = socket.create_connection((host, int(port)), timeout=10)
    else:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(10)
        s.connect(real)
    with s:
        # Only the handshake part: hello, then (after the new challenge) the old proof.
        s.sendall(up[:_handshake_len(transport, up)])
        out = b""
        while True:
            try:
                b = s.recv(65536)
            except (ConnectionResetError, socket.timeout):
                return out
            if not b:
                return out
            out += b


def _handshake_len(transport: str, up: bytes) -> int:
    """Bytes of hello + proof at the start of the initiator's stream."""
    if transport == "tcp":
        n = 0
        for _ in range(2):
            aux_len = HDR.unpack_from(up, n)[7]
            n += HDR.size + aux_len
        return n
    n = 0
    for _ in range(2):
        n += 24 + struct.unpack_from("<I", up, n + 16)[0]
    return n


def test_a_reflected_mac_is_refused_and_the_target_proves_nothing_first():
    """The target's own MAC sent back as a proof fails (the role is in the MAC); a
    hello built from another connection's challenge gets no MAC out of the target."""
    with pdkv.Agent("target", secret=SECRET, transports=["tcp"]) as t:
        host, port = t.address.rsplit(":", 1)
        # A legitimate exchange gives us the target's MAC (we know the secret here).
        with socket.create_connection((host, int(port)), timeout=10) as s:
            h, target_mac = authenticate(s, SECRET)
            assert h[1] == T_HELLO_ACK
        # Reflect it: a new connection whose proof is that MAC.
        with socket.create_connection((host, int(port)), timeout=10) as s:
            from test_bad_input import hello
            s.sendall(hello())
            h, _ = recv_frame(s)
            assert h[1] == T_CHALLENGE
            s.sendall(frame(T_PROOF, xfer=0, aux=target_mac) + target_mac)
            h, aux = recv_frame(s)
            assert h[1] == T_ERROR and b"wrong secret" in aux
        # Two connections without the secret: the second's hello carries the first's
        # challenge (nonce, key); the target answers each with a challenge only.
        with socket.create_connection((host, int(port)), timeout=10) as a, \
                socket.create_connection((host, int(port)), timeout=10) as b:
            from test_bad_input import hello, s32
            a.sendall(hello(name="mirror"))
            ha, ca = recv_frame(a)
            assert ha[1] == T_CHALLENGE
            _, _, nonce_t, pub_t = parse_challenge(ca)
            body = struct.pack("<HHIQ", WIRE_VERSION, 0, 0, 0) + s32(b"mirror") + s32(b"target") + nonce_t + pub_t
            b.sendall(frame(1, xfer=0, aux=body) + body)
            hb, cb = recv_frame(b)
            assert hb[1] == T_CHALLENGE
            # Neither connection can offer anything but guesses; the target's MACs never came.
            for s in (a, b):
                s.sendall(frame(T_PROOF, xfer=0, aux=b"\0" * 32) + b"\0" * 32)
                h, aux = recv_frame(s)
                assert h[1] == T_ERROR and b"wrong secret" in aux


def test_an_impostor_target_is_refused_before_any_data():
    """A server that answers the hello but does not know the secret: the initiator's
    proof goes out (one MAC, nothing more), the impostor's hello-ack MAC fails, and no
    data frame is ever sent to it."""
    with pdkv.Agent("real", secret=SECRET, transports=["tcp"]) as real, \
            pdkv.Agent("initiator", secret=SECRET, transports=["tcp"]) as ini:
        got: list[int] = []
        ls, addr = listen_like(real.address)

        def impostor():
            c, _ = ls.accept()
            with c:
                c.settimeout(10)
                h, aux = recv_frame(c)
                got.append(h[1])
                _, hs = challenge(c, aux, "real", pdkv.decode_metadata(real.metadata())["instance_id"])
                h, proof = recv_frame(c)
                got.append(h[1])
                with pytest.raises(pdkv.AuthFailed):
                    hs.check(proof, [b"a guess"])
                c.sendall(frame(T_HELLO_ACK, xfer=0, aux=b"\x11" * 32) + b"\x11" * 32)
                while (f := recv_frame(c, timeout=3)) is not None:
                    got.append(f[0][1])

        th = threading.Thread(target=impostor, daemon=True)
        th.start()
        dst = real.register(np.zeros(4096, np.uint8))
        blob = real.metadata()
        peer = ini.add_peer(blob.replace(real.address.encode(), addr.encode()), transport="tcp")
        src = ini.register(np.ones(4096, np.uint8))
        with pytest.raises(pdkv.AuthFailed, match="could not prove it knows the secret"):
            ini.prepare_extents("write", peer, [(src.id, 0, dst.id, 0, 4096)]).post().wait(5)
        th.join(10)
        ls.close()
        assert got[:2] == [1, T_PROOF] and T_WRITE not in got, got


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_rotation_old_and_new_secrets_meet(transport):
    """Target: new secret, old one still accepted. An initiator with the old one and one
    with the new one both connect (each checks the target's proof under its own
    secret); a third secret is refused."""
    with pdkv.Agent("target", secret="new", accepted_secrets=["old"], transports=[transport]) as t:
        dst = np.zeros(4096, np.uint8)
        rd = t.register(dst)
        for i, secret in enumerate(["old", "new"]):
            with pdkv.Agent(f"ini-{secret}", secret=secret, transports=[transport]) as ini:
                src = np.full(4096, i + 1, np.uint8)
                rs = ini.register(src)
                peer = ini.add_peer(t.metadata())
                assert ini.prepare_extents("write", peer, [(rs.id, 0, rd.id, 0, 4096)]).post().wait(10)
                assert (dst == i + 1).all()
        with pdkv.Agent("ini-other", secret="other", transports=[transport]) as ini:
            rs = ini.register(np.full(4096, 9, np.uint8))
            peer = ini.add_peer(t.metadata())
            with pytest.raises((pdkv.AuthFailed, pdkv.PeerConnectionError), match="wrong secret"):
                ini.prepare_extents("write", peer, [(rs.id, 0, rd.id, 0, 4096)]).post().wait(10)
        assert (dst == 2).all()


def test_accepted_secrets_are_validated():
    with pytest.raises(pdkv.InvalidArgument, match="at most 7"):
        pdkv.Agent("x", secret="s", accepted_secrets=[f"s{i}" for i in range(8)])
    with pytest.raises(pdkv.InvalidArgument, match="accepted_secrets"):
        pdkv.Agent("x", secret="s", accepted_secrets=[""])
    with pytest.raises(pdkv.InvalidArgument, match="not one secret"):
        pdkv.Agent("x", secret="s", accepted_secrets="old")


def test_accepted_secrets_from_the_environment(monkeypatch):
    monkeypatch.setenv("PDKV_ACCEPTED_SECRETS", "old1, old2")
    with pdkv.Agent("t", secret="new", transports=["tcp"]) as t:
        with pdkv.Agent("i", secret="old2", transports=["tcp"]) as i:
            assert i.connect(t.address, secret="old2") == "t"


def test_the_handshake_halves_agree_and_refuse_tampering():
    """The bindings' halves (what nixl and the raw tests use): a good exchange checks
    both ways; every field of the transcript matters."""
    m = pdkv._native.module()
    ini = m.InitiatorHandshake("tcp", 2, "a")
    tgt = m.TargetHandshake("tcp", 2, "a", "b", 7, ini.nonce, ini.pub)
    proof = ini.answer("b", 7, tgt.nonce, tgt.pub, b"s")
    idx, ack = tgt.check(proof, [b"x", b"s"])
    assert idx == 1
    ini.check_accept(ack)
    with pytest.raises(pdkv.AuthFailed):
        ini.check_accept(proof)  # the initiator's own MAC is not the target's
    for kw in ({"target": "c"}, {"instance": 8}):
        i2 = m.InitiatorHandshake("tcp", 2, "a")
        t2 = m.TargetHandshake("tcp", 2, "a", "b", 7, i2.nonce, i2.pub)
        p2 = i2.answer(kw.get("target", "b"), kw.get("instance", 7), t2.nonce, t2.pub, b"s")
        with pytest.raises(pdkv.AuthFailed):
            t2.check(p2, [b"s"])
    i3 = m.InitiatorHandshake("shm", 2, "a")  # another transport's proof
    t3 = m.TargetHandshake("tcp", 2, "a", "b", 7, i3.nonce, i3.pub)
    with pytest.raises(pdkv.AuthFailed):
        t3.check(i3.answer("b", 7, t3.nonce, t3.pub, b"s"), [b"s"])
    with pytest.raises(pdkv.AuthFailed):  # a low-order point gives no shared secret
        m.TargetHandshake("tcp", 2, "a", "b", 7, ini.nonce, b"\0" * 32)
