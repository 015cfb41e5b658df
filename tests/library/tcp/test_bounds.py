"""What an AUTHENTICATED but hostile peer can make a target hold (issue 26; docs/security.md, "Hostile authenticated peers").

Each target runs in its own process (tests/library/tcp/bounds_target.py) and its memory is read from
/proc/<pid>/status (VmHWM: peak, VmRSS: now). The attacker speaks the tcp wire protocol
from raw sockets with the right secret (test_bad_input.authenticate), or is a pdkv agent.

* compression bombs: a small kWriteZ whose codec frame decodes far past what it carries,
  over repeated extents; a WriteZ header that announces 64 MiB and trickles; a compressed
  read request for 256 MiB of small strided pieces;
* connection caps: per authenticated peer and in total (TcpOptions.max_inbound_per_peer,
  max_inbound_conns);
* the notification queue (AgentConfig.max_queued_notifs / max_queued_notif_bytes): a flood
  is refused before it is accepted and the sender sees ResourceExhausted;
* first contact with a frozen peer obeys the transfer's timeout.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys
import time

import numpy as np
import pytest

import pdkv
from pdkv import codec
from pdkv.errors import ResourceExhausted, TransferTimeout
from conftest import SECRET, JsonLineProc, freeze, wait_until
from test_bad_input import EXT, T_ERROR, T_HELLO_ACK, T_NOTIFY, T_READ_REQ, authenticate, frame, recv_frame

HERE = os.path.dirname(os.path.abspath(__file__))
T_READ_RESP, T_WRITEZ, T_READ_RESP_Z = 7, 11, 12
STRIDED = struct.Struct("<QQQQQ")  # region offset len count stride (flag 8)
FLAG_STRIDED, FLAG_ZREPLY = 8, 16
BF16 = 2  # DType::kBF16
MiB = 1 << 20

# Under scripts/sanitize.sh the allocator (shadow memory, quarantine of freed blocks)
# decides RSS, not pdkv: the memory bounds are checked in plain runs only; everything
# else (refusals, errors, acks) is checked in both.
SANITIZED = bool(os.environ.get("PDKV_SANITIZER"))
needs_zstd = pytest.mark.skipif(not codec.available("zstd"), reason="this build has no zstd")


# ---------------------------------------------------------------- helpers
def status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} for {pid}")


def mib(pid: int, field: str) -> float:
    return status_kib(pid, field) / 1024


def check_mem(ok: bool, what: str) -> None:
    """A memory bound, asserted outside sanitizer runs."""
    if not SANITIZED:
        assert ok, what


class Target(JsonLineProc):
    def __init__(self, config: dict) -> None:
        super().__init__([sys.executable, os.path.join(HERE, "bounds_target.py"), "--config", json.dumps(config)],
                         config.get("name", "target"))
        self.regions = self.hello["regions"]
        host, port = self.address.rsplit(":", 1)
        self.hp = (host, int(port))
        self.socks: list[socket.socket] = []

    def connect(self, authed: bool = True, name: str = "raw-client") -> socket.socket:
        s = socket.create_connection(self.hp, timeout=5)
        self.socks.append(s)
        if authed:
            h, _ = authenticate(s, name=name)
            assert h[1] == T_HELLO_ACK
        return s


@pytest.fixture
def target():
    procs: list[Target] = []

    def start(**config) -> Target:
        config.setdefault("agent", {}).setdefault("secret", SECRET)
        config["agent"].setdefault("transports", ["tcp"])
        t = Target(config)
        procs.append(t)
        return t

    yield start
    for p in procs:
        for s in p.socks:
            s.close()
        p.stop()


def zstd_zeros(n: int) -> bytes:
    """A zstd frame of `n` zero bytes, hand-made from RLE blocks (4 bytes per 128 KiB):
    32 KB of it decode to 1 GiB."""
    out = bytearray(struct.pack("<IB", 0xFD2FB528, 0xE0) + struct.pack("<Q", n))  # single segment, 8-byte size
    block = 128 << 10
    left = n
    while left:
        k = min(block, left)
        left -= k
        out += (int(left == 0) | (1 << 1) | (k << 3)).to_bytes(3, "little") + b"\0"  # RLE block of k zeros
    return bytes(out)


def codec_frame(raw_len: int, payload: bytes, *, kind: int = 1, dtype: int = BF16) -> bytes:
    """A pdkv codec frame header (docs/compression.md, 48 bytes) + payload."""
    return b"PKVC" + struct.pack("<BBBBQQIIIIQ", 1, kind, dtype, 0, raw_len, len(payload), 0, 0, 0, 0, 0) + payload


def writez(region: int, extents: list[tuple[int, int]], payload: bytes, *, xfer: int = 7) -> bytes:
    body = b"".join(EXT.pack(region, off, ln) for off, ln in extents)
    return frame(T_WRITEZ, xfer=xfer, count=len(extents), payload=len(payload)) + body + payload


def error_code(s: socket.socket, timeout: float = 5.0) -> tuple[int, str] | None:
    """The next frame if it is an Error (its status and message), else None."""
    got = recv_frame(s, timeout)
    if got is None:
        return None
    h, aux = got
    return (h[8], aux.decode(errors="replace")) if h[1] == T_ERROR else None


RESOURCE_EXHAUSTED, PROTOCOL_ERROR = 13, 6


# ---------------------------------------------------------------- compression bombs
@needs_zstd
def test_writez_bomb_over_repeated_extents_is_refused(target):
    """32 KB of codec frame that decodes to 1 GiB, spread over 65,536 extents that all name
    the same 16 KiB: refused before decoding (a compressed frame decodes to at most 64 MiB),
    the target's peak RSS stays put. Before: 42 MiB -> 2.1 GiB peak, 1 GiB held."""
    t = target(regions=[16 << 10])
    base = mib(t.pid, "VmRSS")
    s = t.connect()
    n = 1 << 16
    bomb = codec_frame(n * (16 << 10), zstd_zeros(n * (16 << 10)))
    assert len(bomb) < 40_000
    s.sendall(writez(t.regions[0], [(0, 16 << 10)] * n, bomb))
    err = error_code(s)
    assert err is not None and err[0] == PROTOCOL_ERROR and "more than a compressed frame may decode to" in err[1], err
    time.sleep(0.5)
    check_mem(mib(t.pid, "VmHWM") - base < 120, f"peak {mib(t.pid, 'VmHWM'):.0f} MiB from {base:.0f} MiB")


@needs_zstd
def test_writez_bombs_within_the_limit_are_released(target):
    """Bombs at the limit (64 MiB of zeros from 2 KB, over 4,096 repeated 16 KiB extents)
    decode (bounded scratch) and the scratch is released: RSS is back within 40 MiB of
    where it started 1 s later. Before: the codec's plane scratch of every decode thread
    stayed at 64 MiB for good."""
    t = target(regions=[16 << 10])
    base = mib(t.pid, "VmRSS")
    n = 4096
    bomb = codec_frame(n * (16 << 10), zstd_zeros(n * (16 << 10)))
    socks = [t.connect() for _ in range(4)]
    for i in range(4):  # 4 connections x 4 frames: every decode thread decodes some
        for s in socks:
            s.sendall(writez(t.regions[0], [(0, 16 << 10)] * n, bomb, xfer=i + 1))
    for s in socks:
        for _ in range(4):
            h, _ = recv_frame(s, 30)
            assert h[1] == 8 and h[8] == 0, h  # acked: these are valid writes
    peak = mib(t.pid, "VmHWM") - base
    check_mem(peak < 700, f"peak grew {peak:.0f} MiB")  # <= 4 decode threads x (64 MiB scratch + 64 MiB planes)
    check_mem(SANITIZED or wait_until(lambda: mib(t.pid, "VmRSS") - base < 40, timeout=3.0),
              f"still {mib(t.pid, 'VmRSS') - base:.0f} MiB above the start")


def test_writez_headers_that_trickle_hold_little(target):
    """16 authenticated connections each announce a 64 MiB WriteZ payload and send one
    byte of it: the receive buffer grows with the bytes that came, not with the header.
    Before: a zero-filled 64 MiB buffer per connection (1.1 GiB)."""
    t = target(regions=[16 << 10])
    base = mib(t.pid, "VmRSS")
    socks = []
    for _ in range(16):
        s = t.connect()
        ext = EXT.pack(t.regions[0], 0, 16 << 10) * 4096
        s.sendall(frame(T_WRITEZ, count=4096, payload=64 << 20) + ext + b"P")
        socks.append(s)
    time.sleep(1.0)
    grown = mib(t.pid, "VmRSS") - base
    check_mem(grown < 120, f"16 trickling WriteZ headers hold {grown:.0f} MiB")
    for s in socks:
        s.close()


@needs_zstd
def test_compressed_read_of_many_pieces_is_answered_plain_before_encoding(target):
    """A compressed read request for 256 MiB of 4 KiB strided pieces: more than a codec
    chunk, so it is answered plain (a ReadResp straight from the region) without
    gathering or encoding anything. Before: the encoder's gather buffer and scratch
    left 1 GiB held."""
    t = target(regions=[256 << 20])
    base = mib(t.pid, "VmRSS")
    s = t.connect()
    pieces = 65536
    desc = STRIDED.pack(t.regions[0], 0, 4096, pieces, 4096)
    spec = struct.pack("<BBBBiIIII", 1, BF16, 0, 0, 1, 1, 64, 16, 0)
    s.sendall(frame(T_READ_REQ, count=1, flags=FLAG_STRIDED | FLAG_ZREPLY, aux=spec) + desc + spec)
    s.settimeout(10)
    hdr = b""
    while len(hdr) < 40:
        hdr += s.recv(40 - len(hdr))
    assert struct.unpack_from("<H", hdr, 4)[0] == T_READ_RESP
    time.sleep(1.0)
    grown = mib(t.pid, "VmHWM") - base
    check_mem(grown < 150, f"a 256 MiB compressed read request grew the peak by {grown:.0f} MiB")
    s.close()


# ---------------------------------------------------------------- connection caps
def test_connections_per_authenticated_peer_are_capped(target):
    """The fifth connection of one authenticated name is refused with ResourceExhausted
    naming the peer and the option: at the handshake (admit() called right after the
    proof) or, at the latest, at its first frame."""
    t = target(regions=[4096], agent={"tcp": {"max_inbound_per_peer": 4}})
    socks = [t.connect() for _ in range(4)]
    for i, s in enumerate(socks):
        s.sendall(frame(T_NOTIFY, xfer=i + 1, batch=0xFFFFFFFF, aux=b"hi") + b"hi")
    for s in socks:
        h, _ = recv_frame(s)
        assert h[1] == 8 and h[8] == 0  # acked
    fifth = socket.create_connection(t.hp, timeout=5)
    t.socks.append(fifth)
    got = authenticate(fifth)
    if got is not None and got[0][1] == T_HELLO_ACK:
        fifth.sendall(frame(T_NOTIFY, xfer=5, batch=0xFFFFFFFF, aux=b"hi") + b"hi")
        got = recv_frame(fifth)
    assert got is not None and got[0][1] == T_ERROR, got
    err = (got[0][8], got[1].decode(errors="replace"))
    assert err[0] == RESOURCE_EXHAUSTED and "max_inbound_per_peer" in err[1] and "raw-client" in err[1], err
    # Another peer name is not affected, and a slot frees when a connection closes.
    other = t.connect(name="other-client")
    other.sendall(frame(T_NOTIFY, xfer=9, batch=0xFFFFFFFF, aux=b"hi") + b"hi")
    assert recv_frame(other)[0][1] == 8
    socks[0].close()

    def admitted_again() -> bool:
        s = t.connect()
        s.sendall(frame(T_NOTIFY, xfer=10, batch=0xFFFFFFFF, aux=b"hi") + b"hi")
        got = recv_frame(s)
        s.close()
        return got is not None and got[0][1] == 8 and got[0][8] == 0

    assert wait_until(admitted_again, timeout=5.0, interval=0.2)


def test_inbound_connections_are_capped_in_total(target):
    t = target(regions=[4096], agent={"tcp": {"max_inbound_conns": 8}})
    socks = [t.connect(authed=False) for _ in range(8)]
    extra = t.connect(authed=False)
    err = error_code(extra)
    assert err is not None and err[0] == RESOURCE_EXHAUSTED and "max_inbound_conns" in err[1], err
    for s in socks:
        s.close()
    assert wait_until(lambda: _authenticates(t), timeout=5.0)


def _authenticates(t: Target) -> bool:
    try:
        t.connect().close()
        return True
    except (AssertionError, OSError, TypeError):
        return False


def test_connection_caps_are_typed_options():
    o = pdkv.TcpOptions(max_inbound_conns=10, max_inbound_per_peer=2)
    assert (o.max_inbound_conns, o.max_inbound_per_peer) == (10, 2)
    assert (pdkv.TcpOptions().max_inbound_conns, pdkv.TcpOptions().max_inbound_per_peer) == (1024, 128)
    with pytest.raises(pdkv.InvalidArgument, match="max_inbound_per_peer"):
        pdkv.Agent("x", options=[pdkv.TcpOptions(max_inbound_per_peer=0)], transports=["tcp"])


# ---------------------------------------------------------------- notifications
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_notification_flood_is_refused_before_it_is_accepted(target, transport):
    """1,024 x 1 MiB notifications to a target that never takes them: the queue refuses
    once 64 MiB are queued (the default), the sender sees ResourceExhausted, and the
    target's RSS stays bounded. Before: RSS 28 MiB -> 1 GiB, nothing refused."""
    if transport == "shm" and "shm" not in pdkv.available_transports():
        pytest.skip("no shm")
    t = target(regions=[4096], agent={"transports": list(dict.fromkeys([transport, "tcp"]))})  # (tcp: the metadata fetch)
    base = mib(t.pid, "VmRSS")
    data = b"n" * (1 << 20)
    with pdkv.Agent("flooder", secret=SECRET, transports=list(dict.fromkeys([transport, "tcp"]))) as a:
        peer = a.connect(t.address)
        assert a.peer_transport(peer) == transport
        accepted, refused = 0, None
        for _ in range(1024):
            try:
                a.notify(peer, data).wait(10)
                accepted += 1
            except ResourceExhausted as e:
                refused = e
                break
            except pdkv.PdkvError as e:  # a transport that closes after refusing: the cause is named
                refused = e
                break
        assert refused is not None, f"{accepted} notifications of 1 MiB accepted, none refused"
        assert "notification queue is full" in str(refused) and "max_queued_notif_bytes" in str(refused)
        assert 60 <= accepted <= 64, accepted
        grown = mib(t.pid, "VmRSS") - base
        check_mem(grown < 200, f"queued notifications hold {grown:.0f} MiB")
        # Nothing accepted was dropped: the target takes exactly what was acknowledged.
        assert t.call(cmd="take")["taken"] == accepted


def test_notification_queue_limits_count_and_are_typed(target):
    t = target(regions=[4096], agent={"max_queued_notifs": 3})
    with pdkv.Agent("sender", secret=SECRET, transports=["tcp"]) as a:
        peer = a.connect(t.address)
        for i in range(3):
            a.notify(peer, b"x%d" % i).wait(10)
        with pytest.raises(ResourceExhausted, match="max_queued_notifs 3"):
            a.notify(peer, b"one too many").wait(10)
        assert t.call(cmd="take")["taken"] == 3
        a.notify(peer, b"room again").wait(10)  # taking makes room; the connection stayed
    with pytest.raises(pdkv.InvalidArgument, match="max_queued_notifs"):
        pdkv.Agent("y", max_queued_notifs=0, transports=["tcp"])


# ---------------------------------------------------------------- first contact, frozen peer
def test_first_contact_with_a_frozen_peer_obeys_the_transfer_timeout(target):
    """A peer frozen (SIGSTOP) before the first transfer to it: its kernel still accepts the
    TCP connection, the hello is never answered. post(timeout=0.5) must fail at ~0.5 s,
    not at connect_timeout_s (5 s)."""
    t = target(regions=[4096])
    with pdkv.Agent("init", secret=SECRET, transports=["tcp"]) as a:
        peer = a.add_peer(a.fetch_metadata(t.address))  # no data connection yet
        src = np.ones(4096, np.uint8)
        r = a.register(src)
        prep = a.prepare_extents("write", peer, [(r.id, 0, t.regions[0], 0, 4096)])
        freeze(t.pid)
        try:
            t0 = time.monotonic()
            x = prep.post(timeout=0.5)
            posted = time.monotonic() - t0
            with pytest.raises(TransferTimeout):
                x.wait(10)
            took = time.monotonic() - t0
        finally:
            os.kill(t.pid, signal.SIGCONT)
        assert posted < 1.5 and took < 2.0, (posted, took)
