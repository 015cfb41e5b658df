"""Hostile and malformed wire input against the tcp transport (format: docs/wire.md).

Each case: a raw socket misbehaves, the agent answers with an error frame naming the
problem and closes that connection, writes nothing outside exported memory, and then
serves a good transfer from a well-behaved peer.
"""

from __future__ import annotations

import socket
import struct
import time

import numpy as np
import pytest

import pdkv
from conftest import SECRET

HDR = struct.Struct("<IHHQIIQII")  # magic type flags xfer batch count payload aux_len status
MAGIC = 0x464B4450
T_HELLO, T_HELLO_ACK, T_META_REQ, T_META_RESP, T_WRITE, T_READ_REQ, T_READ_RESP, T_ACK, T_NOTIFY, T_ERROR = range(1, 11)
T_CHALLENGE, T_PROOF = 13, 14
WIRE_VERSION = 2
EXT = struct.Struct("<QQQ")
CODES = ["OK", "InvalidArgument", "NotFound", "AlreadyExists", "OutOfRange", "AuthFailed", "ProtocolError",
         "VersionMismatch", "StalePeer", "ConnectionError", "Timeout", "Cancelled", "NotSupported",
         "ResourceExhausted", "Internal"]


def frame(ftype, *, xfer=1, batch=0, count=0, payload=0, aux=b"", flags=0, status=0, magic=MAGIC):
    return HDR.pack(magic, ftype, flags, xfer, batch, count, payload, len(aux), status)


def s32(b: bytes) -> bytes:
    return struct.pack("<I", len(b)) + b


def initiator(name="raw-client"):
    """The initiator's half of a tcp handshake (pdkv/spi/auth.h, through the bindings)."""
    return pdkv._native.module().InitiatorHandshake("tcp", WIRE_VERSION, name)


def hello(*, version=WIRE_VERSION, target="target", name="raw-client", instance=0, hs=None):
    """A hello frame (it carries no secret: a nonce and an ephemeral key)."""
    hs = hs or initiator(name)
    body = struct.pack("<HHIQ", version, 0, 0, instance) + s32(name.encode()) + s32(target.encode()) + hs.nonce + hs.pub
    return frame(T_HELLO, xfer=0, aux=body) + body


def challenge(conn: socket.socket, hello_aux: bytes, name: str, instance: int):
    """Answers a received hello body with a challenge as agent `name`: returns the
    initiator's name and the target's half of the handshake (pdkv/spi/auth.h)."""
    n = struct.unpack_from("<I", hello_aux, 16)[0]
    initiator = hello_aux[20:20 + n].decode()
    m = 20 + n + 4 + struct.unpack_from("<I", hello_aux, 20 + n)[0]
    hs = pdkv._native.module().TargetHandshake("tcp", WIRE_VERSION, initiator, name, instance,
                                               hello_aux[m:m + 32], hello_aux[m + 32:m + 64])
    ch = struct.pack("<QI", instance, len(name)) + name.encode() + hs.nonce + hs.pub
    conn.sendall(frame(T_CHALLENGE, xfer=0, aux=ch) + ch)
    return initiator, hs


def accept_handshake(conn: socket.socket, name: str, instance: int, secret=SECRET) -> str:
    """The target's side of the handshake on a raw accepted socket, as agent `name`
    (instance `instance`) knowing `secret`: reads the hello, challenges, checks the
    proof (AuthFailed if it does not match) and answers the hello-ack. Returns the
    initiator's name."""
    h, aux = recv_frame(conn)
    assert h[1] == T_HELLO, h
    initiator, hs = challenge(conn, aux, name, instance)
    h, proof = recv_frame(conn)
    assert h[1] == T_PROOF, h
    _, ack = hs.check(proof, [secret.encode() if isinstance(secret, str) else secret])
    conn.sendall(frame(T_HELLO_ACK, xfer=0, aux=ack) + ack)
    return initiator


def parse_challenge(aux: bytes):
    """(instance, name, nonce, pub) of a challenge body."""
    instance, n = struct.unpack_from("<QI", aux)
    name = aux[12:12 + n].decode()
    return instance, name, aux[12 + n:44 + n], aux[44 + n:76 + n]


def authenticate(s: socket.socket, secret=SECRET, *, target="target", name="raw-client", instance=0):
    """The initiator's side of the handshake on a raw socket: hello, the target's
    challenge, our proof made with `secret`. Returns the target's last answer: its
    hello-ack (whose MAC is checked), or its error frame (to the hello or to the proof)."""
    hs = initiator(name)
    s.sendall(hello(target=target, name=name, instance=instance, hs=hs))
    got = recv_frame(s)
    if got is None or got[0][1] != T_CHALLENGE:
        return got
    t_instance, t_name, nonce, pub = parse_challenge(got[1])
    proof = hs.answer(t_name, t_instance, nonce, pub, secret.encode() if isinstance(secret, str) else secret)
    s.sendall(frame(T_PROOF, xfer=0, aux=proof) + proof)
    got = recv_frame(s)
    if got is not None and got[0][1] == T_HELLO_ACK:
        hs.check_accept(got[1])
    return got


def recv_frame(s: socket.socket, timeout=5.0):
    s.settimeout(timeout)
    buf = b""
    while len(buf) < HDR.size:
        chunk = s.recv(HDR.size - len(buf))
        if not chunk:
            return None
        buf += chunk
    h = HDR.unpack(buf)
    aux = b""
    while len(aux) < h[7]:
        chunk = s.recv(h[7] - len(aux))
        if not chunk:
            break
        aux += chunk
    return h, aux


def expect_error_and_close(s: socket.socket, code: str, match: str, got=None):
    """The next frame (or `got`, already read) is an error of `code` matching `match`,
    and then the connection closes."""
    got = got or recv_frame(s)
    assert got is not None, "connection closed without an error frame"
    h, aux = got
    assert h[1] == T_ERROR, f"expected an error frame, got type {h[1]}"
    assert CODES[h[8]] == code, (CODES[h[8]], aux)
    assert match.lower() in aux.decode(errors="replace").lower(), aux
    # Then the agent closes the connection.
    s.settimeout(5)
    rest = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        rest += chunk
    assert rest == b""


@pytest.fixture
def target():
    """A target agent with one exported region (guarded by a non-exported one after it)
    plus a good initiator to prove it still serves."""
    with pdkv.Agent("target", secret=SECRET, options=[pdkv.TcpOptions(handshake_timeout_s=1.0)]) as t, \
            pdkv.Agent("good", secret=SECRET) as good:
        mem = np.zeros(2 * 4096, np.uint8)
        exported = t.register(mem[:4096])
        t.register(mem[4096:], remote_access=False)  # guard right after the exported bytes
        src = np.arange(4096, dtype=np.uint32).astype(np.uint8)
        rs = good.register(src)
        peer = good.connect(t.address)

        def serves() -> bool:
            mem[:4096] = 0
            ok = good.prepare_extents("write", peer, [(rs.id, 0, exported.id, 0, 4096)]).post().wait(5)
            return ok and np.array_equal(mem[:4096], src) and not mem[4096:].any()

        host, port = t.address.rsplit(":", 1)
        socks: list[socket.socket] = []
        yield {"agent": t, "mem": mem, "region": exported, "addr": (host, int(port)), "serves": serves,
               "socks": socks}
        for s in socks:
            s.close()


def connect(target, authed=True):
    s = socket.create_connection(target["addr"], timeout=5)
    target["socks"].append(s)
    if authed:
        h, aux = authenticate(s)
        assert h[1] == T_HELLO_ACK
    return s


def test_garbage(target):
    s = connect(target, authed=False)
    s.sendall(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    expect_error_and_close(s, "ProtocolError", "bad frame magic")
    assert target["serves"]()


def test_http_request_is_rejected(target):
    s = connect(target, authed=False)
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b" " * 64)
    expect_error_and_close(s, "ProtocolError", "magic")
    assert target["serves"]()


def test_wrong_secret(target):
    s = connect(target, authed=False)
    expect_error_and_close(s, "AuthFailed", "wrong secret", authenticate(s, "not-the-secret"))
    assert target["serves"]()


def test_wrong_target_name(target):
    s = connect(target, authed=False)
    s.sendall(hello(target="someone-else"))
    expect_error_and_close(s, "AuthFailed", "not 'someone-else'")
    assert target["serves"]()


def test_unknown_protocol_version(target):
    s = connect(target, authed=False)
    s.sendall(hello(version=7))
    expect_error_and_close(s, "VersionMismatch", "version 7")
    assert target["serves"]()


def test_request_before_hello(target):
    s = connect(target, authed=False)
    s.sendall(frame(T_WRITE, count=1, payload=16) + EXT.pack(target["region"].id, 0, 16) + b"x" * 16)
    expect_error_and_close(s, "ProtocolError", "must be a hello")
    assert not target["mem"].any()
    assert target["serves"]()


def test_oversized_hello(target):
    s = connect(target, authed=False)
    s.sendall(frame(T_HELLO, aux=b"\0" * (1 << 20)))
    expect_error_and_close(s, "ProtocolError", "malformed hello")
    assert target["serves"]()


@pytest.mark.parametrize(
    "desc, code, match",
    [
        ((None, 4000, 200), "OutOfRange", "outside region"),       # runs into the guard
        ((None, 2**63, 16), "OutOfRange", "outside region"),       # offset overflow
        ((None, 0, 2**64 - 8), "OutOfRange", "outside region"),    # length overflow
        ((12345, 0, 16), "NotFound", "not registered"),            # unknown region
        ((None, 0, 0), "ProtocolError", "length 0"),
    ],
)
def test_out_of_bounds_write(target, desc, code, match):
    region = target["region"].id if desc[0] is None else desc[0]
    s = connect(target)
    payload = 200 if desc[2] == 200 else 16
    s.sendall(frame(T_WRITE, count=1, payload=payload) + EXT.pack(region, desc[1], desc[2]) + b"\xff" * payload)
    expect_error_and_close(s, code, match)
    assert not target["mem"].any(), "bytes were written"
    assert target["serves"]()


def test_write_to_local_only_region_is_rejected(target):
    guard_id = [r.id for r in target["agent"].regions if not r.remote_access][0]
    s = connect(target)
    s.sendall(frame(T_WRITE, count=1, payload=16) + EXT.pack(guard_id, 0, 16) + b"\xff" * 16)
    expect_error_and_close(s, "NotFound", "not exported")
    assert not target["mem"].any()
    assert target["serves"]()


@pytest.mark.parametrize(
    "hdr, match",
    [
        (dict(count=1 << 30, payload=16), "extents"),
        (dict(count=0, payload=16), "extents"),
        (dict(count=1, payload=1 << 40), "payload"),
        (dict(count=1, payload=0), "payload"),
        (dict(count=1, payload=16, aux=b"\0" * 8, flags=0), "notification"),
    ],
)
def test_huge_or_inconsistent_lengths(target, hdr, match):
    s = connect(target)
    aux = hdr.pop("aux", b"")
    s.sendall(frame(T_WRITE, aux=aux, **hdr))
    expect_error_and_close(s, "ProtocolError", match)
    assert target["serves"]()


def test_oversized_notification(target):
    s = connect(target)
    s.sendall(frame(T_NOTIFY, aux=b"\0" * (2 << 20)))
    expect_error_and_close(s, "ProtocolError", "notification")
    assert target["serves"]()


def test_wrong_direction_frames(target):
    for t in (T_ACK, T_READ_RESP, T_HELLO_ACK, T_META_RESP, 99):
        s = connect(target)
        s.sendall(frame(t))
        expect_error_and_close(s, "ProtocolError", "")
    assert target["serves"]()


def test_read_out_of_bounds(target):
    s = connect(target)
    s.sendall(frame(T_READ_REQ, count=1) + EXT.pack(target["region"].id, 4090, 100))
    expect_error_and_close(s, "OutOfRange", "outside region")
    assert target["serves"]()


def test_read_request_from_raw_client_works(target):
    """A well-formed raw read gets exactly the requested bytes back."""
    target["mem"][:4096] = np.arange(4096) % 251
    s = connect(target)
    s.sendall(frame(T_READ_REQ, xfer=7, batch=3, count=2) + EXT.pack(target["region"].id, 10, 5) +
              EXT.pack(target["region"].id, 100, 3))
    h, aux = recv_frame(s)
    assert (h[1], h[3], h[4], h[6]) == (T_READ_RESP, 7, 3, 8)
    data = b""
    while len(data) < 8:
        data += s.recv(8 - len(data))
    assert data == bytes(target["mem"][10:15]) + bytes(target["mem"][100:103])


@pytest.mark.parametrize("cut", [10, HDR.size, HDR.size + 12, HDR.size + EXT.size + 7])
def test_truncated_frames(target, cut):
    s = connect(target)
    full = frame(T_WRITE, count=1, payload=16) + EXT.pack(target["region"].id, 0, 16) + b"\x07" * 16
    s.sendall(full[:cut])
    s.close()
    time.sleep(0.1)
    assert target["serves"]()


def test_truncated_payload_writes_only_inside_the_declared_extent(target):
    s = connect(target)
    s.sendall(frame(T_WRITE, count=1, payload=1000) + EXT.pack(target["region"].id, 100, 1000) + b"\x07" * 500)
    s.close()
    time.sleep(0.1)
    mem = target["mem"]
    assert not mem[:100].any() and not mem[1100:].any()
    assert target["serves"]()


def test_silent_client_is_dropped_after_handshake_timeout(target):
    s = connect(target, authed=False)
    t0 = time.monotonic()
    s.settimeout(10)
    got = recv_frame(s, timeout=10)
    assert got is not None and got[0][1] == T_ERROR and CODES[got[0][8]] == "Timeout"
    assert 0.8 <= time.monotonic() - t0 <= 5
    assert target["serves"]()


def test_metadata_request_requires_hello(target):
    s = connect(target, authed=False)
    s.sendall(frame(T_META_REQ))
    expect_error_and_close(s, "ProtocolError", "must be a hello")
    s = connect(target)
    s.sendall(frame(T_META_REQ))
    h, aux = recv_frame(s)
    assert h[1] == T_META_RESP and pdkv.decode_metadata(aux)["name"] == "target"


def test_many_bad_clients_at_once(target):
    socks = []
    for i in range(50):
        s = connect(target, authed=False)
        s.sendall(b"\x00" * 40 if i % 2 else hello(version=1))
        socks.append(s)
    for s in socks:
        got = recv_frame(s)
        assert got is not None and got[0][1] == T_ERROR
    assert target["serves"]()
