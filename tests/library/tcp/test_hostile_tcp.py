"""Hostile peers against the tcp transport, as a class per attack (limits: docs/wire.md).

Raw-socket initiators attack a target agent, and a fake target (a Python server) attacks
an initiator agent that connects to it. For every frame type (1..10 and unknown ones) and
every way of lying about sizes, offsets, direction or timing, the victim answers with a
named error, closes that connection, does not crash or balloon, and then serves a
legitimate transfer that is checked bit for bit.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import pdkv
from conftest import SECRET, listen_like
from test_bad_input import (CODES, EXT, HDR, MAGIC, T_ACK, T_ERROR, T_HELLO, T_HELLO_ACK, T_META_REQ, T_META_RESP,
                            T_CHALLENGE, T_NOTIFY, T_PROOF, challenge, T_READ_REQ, T_READ_RESP, T_WRITE, authenticate, expect_error_and_close, frame, hello,
                            recv_frame)

FRAME_TIMEOUT = 0.5  # TcpOptions.frame_timeout_s of the victims
U32, U64 = 2**32 - 1, 2**64 - 1
ALL_TYPES = list(range(1, 11)) + [0, 11, 99, 0xFFFF]
VALID_ON_OPEN_INBOUND = {T_META_REQ, T_WRITE, T_READ_REQ, T_NOTIFY, T_ERROR}
REGION = 1 << 16


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def closed_within(s: socket.socket, seconds: float) -> bool:
    """True if the peer closes `s` (after any error frame) within `seconds`."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        s.settimeout(max(0.01, end - time.monotonic()))
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            return False
        except ConnectionResetError:
            return True
        if not chunk:
            return True
    return False


# ---------------------------------------------------------------- a target under attack
@pytest.fixture
def target(request):
    """A target agent exporting two regions (one to attack, one to prove it still serves)
    and a good initiator connected to it. Indirect parameter: frame_timeout_s."""
    opts = pdkv.TcpOptions(handshake_timeout_s=1.0, frame_timeout_s=getattr(request, "param", FRAME_TIMEOUT))
    with pdkv.Agent("target", secret=SECRET, options=[opts], transports=["tcp"]) as t, \
            pdkv.Agent("good", secret=SECRET, transports=["tcp"]) as good:
        mem = np.zeros(2 * REGION, np.uint8)
        victim = t.register(mem[:REGION])
        served = t.register(mem[REGION:])
        src = np.random.default_rng(1).integers(0, 256, REGION, dtype=np.uint8)
        rs = good.register(src)
        peer = good.connect(t.address)
        host, port = t.address.rsplit(":", 1)
        socks: list[socket.socket] = []

        def serves() -> bool:
            """A good write and read back, both bit-exact."""
            mem[REGION:] = 0
            assert good.prepare_extents("write", peer, [(rs.id, 0, served.id, 0, REGION)]).post().wait(10)
            assert np.array_equal(mem[REGION:], src)
            back = np.zeros(REGION, np.uint8)
            rb = good.register(back)
            try:
                assert good.prepare_extents("read", peer, [(rb.id, 0, served.id, 0, REGION)]).post().wait(10)
            finally:
                rb.close()
            return bool(np.array_equal(back, src))

        def connect(authed=True, source="127.0.0.1"):
            s = socket.socket()
            s.bind((source, 0))
            s.settimeout(5)
            s.connect((host, int(port)))
            socks.append(s)
            if authed:
                h, _ = authenticate(s)
                assert h[1] == T_HELLO_ACK
            return s

        yield {"agent": t, "mem": mem, "victim": victim, "served": served, "serves": serves, "connect": connect,
               "addr": (host, int(port))}
        for s in socks:
            s.close()


MUTATIONS = {
    "as-is": {},
    "count-2^24": dict(count=1 << 24),
    "count-max": dict(count=U32),
    "aux-max": dict(aux_len=U32),
    "aux-16MiB": dict(aux_len=16 << 20),
    "payload-max": dict(payload=U64),
    "payload-2^40": dict(payload=1 << 40),
}


def raw_header(ftype, *, count=0, aux_len=0, payload=0, flags=0, status=0, xfer=1, batch=0):
    return HDR.pack(MAGIC, ftype, flags, xfer, batch, count, payload, aux_len, status)


@pytest.mark.parametrize("mutation", list(MUTATIONS))
@pytest.mark.parametrize("ftype", ALL_TYPES)
@pytest.mark.parametrize("authed", [True, False], ids=["after-hello", "before-hello"])
def test_every_frame_type_with_lying_sizes(target, ftype, mutation, authed):
    """Each frame type, in each state, with each size field at a huge value: a
    ProtocolError frame, a closed connection, no memory growth, still serving."""
    fields = MUTATIONS[mutation]
    valid_here = (ftype in VALID_ON_OPEN_INBOUND) if authed else (ftype == T_HELLO)
    if mutation == "as-is" and valid_here:
        pytest.skip("a well-formed frame in its place is not an attack")
    before = rss_mib()
    s = target["connect"](authed)
    base = dict(count=1, payload=16) if ftype == T_WRITE else dict(count=1) if ftype == T_READ_REQ else {}
    if ftype == T_HELLO:
        base = dict(aux_len=40)
    s.sendall(raw_header(ftype, **{**base, **fields}))
    expect_error_and_close(s, "ProtocolError", "")
    assert rss_mib() - before < 64, "the receiver allocated what the header announced"
    assert not target["mem"][:REGION].any()
    assert target["serves"]()


@pytest.mark.parametrize("op", [T_WRITE, T_READ_REQ])
@pytest.mark.parametrize("offset, length, code", [
    (U64 - 7, 16, "OutOfRange"),            # offset + len wraps around 2^64
    (8, U64 - 7, "OutOfRange"),             # len wraps
    (1 << 63, 1 << 63, "OutOfRange"),       # both halves of 2^64
    (REGION - 8, 16, "OutOfRange"),         # one past the end
    (0, 0, "ProtocolError"),                # empty extent
])
def test_offsets_that_overflow(target, op, offset, length, code):
    s = target["connect"]()
    payload = 16 if op == T_WRITE else 0
    hdr = raw_header(op, count=1, payload=payload)
    s.sendall(hdr + EXT.pack(target["victim"].id, offset, length) + b"\xee" * payload)
    expect_error_and_close(s, code, "")
    assert not target["mem"].any()
    assert target["serves"]()


def test_extents_that_sum_past_the_frame_limit(target):
    """Two legal extents whose sum wraps u64: rejected by the sum, nothing written."""
    s = target["connect"]()
    rid = target["victim"].id
    s.sendall(raw_header(T_READ_REQ, count=3) + EXT.pack(rid, 0, 16) + EXT.pack(rid, 0, U64 - 8) +
              EXT.pack(rid, 0, 16))
    got = recv_frame(s)
    assert got is not None and got[0][1] == T_ERROR and CODES[got[0][8]] in ("OutOfRange", "ProtocolError")
    assert target["serves"]()


@pytest.mark.parametrize("flags, status", [(2, 0), (0x8000, 0), (0, 5)])
def test_unknown_flags_and_status_are_rejected(target, flags, status):
    s = target["connect"]()
    s.sendall(raw_header(T_READ_REQ, count=1, flags=flags, status=status) + EXT.pack(target["victim"].id, 0, 16))
    expect_error_and_close(s, "ProtocolError", "")
    assert target["serves"]()


# ---------------------------------------------------------------- stalled senders
STALLS = {
    "mid-header": lambda rid: raw_header(T_WRITE, count=1, payload=REGION)[:17],
    "mid-control": lambda rid: raw_header(T_WRITE, count=2, payload=REGION) + EXT.pack(rid, 0, 100)[:30],
    "mid-payload": lambda rid: raw_header(T_WRITE, count=1, payload=REGION) + EXT.pack(rid, 0, REGION) + b"\x01" * 100,
    "mid-notify": lambda rid: raw_header(T_NOTIFY, aux_len=1000) + b"n" * 10,
    "mid-hello": lambda rid: b"",  # unauthenticated: the handshake deadline applies
}


@pytest.mark.parametrize("where", list(STALLS))
def test_stalled_sender_is_dropped_and_region_close_returns(target, where):
    s = target["connect"](authed=where != "mid-hello")
    s.sendall(STALLS[where](target["victim"].id) or hello()[:30])
    # The sender stays silent (like SIGSTOP): the target gives up after frame_timeout_s.
    assert closed_within(s, 10), "a stalled frame kept the connection open"
    closer = threading.Thread(target=target["victim"].close, daemon=True)
    t0 = time.monotonic()
    closer.start()
    closer.join(10)
    assert not closer.is_alive(), "Region.close() hangs behind a stalled sender"
    assert time.monotonic() - t0 < 10
    assert target["serves"]()


def test_reader_that_never_reads_back_is_dropped(target):
    """Read requests whose answers are never read: output stalls, the connection is
    closed after frame_timeout_s and the region it pinned can be closed."""
    s = target["connect"]()
    rid = target["victim"].id
    req = raw_header(T_READ_REQ, count=1) + EXT.pack(rid, 0, REGION)
    s.sendall(req * 400)  # 25 MiB of answers: more than the socket buffers hold
    time.sleep(0.3)  # let the target take in what it will (all of it, without back-pressure)
    closer = threading.Thread(target=target["victim"].close, daemon=True)
    closer.start()
    closer.join(10)
    assert not closer.is_alive(), "Region.close() hangs behind unread responses"
    assert target["serves"]()


@pytest.mark.parametrize("target", [30.0], indirect=True)  # back-pressure, not the deadline
def test_unread_read_responses_do_not_balloon(target):
    """Amplification (issue 11, item 2): many 65536-extent read requests, answers never
    read. Back-pressure stops reading the requests; memory stays bounded."""
    s = target["connect"]()
    rid = target["victim"].id
    n = 65536
    exts = b"".join(EXT.pack(rid, (i * 16) % REGION, 16) for i in range(n))
    req = raw_header(T_READ_REQ, count=n) + exts
    before = rss_mib()
    s.setblocking(False)
    view, sent_reqs = memoryview(req * 4), 0
    end = time.monotonic() + 3.0
    off = 0
    while time.monotonic() < end and sent_reqs < 300:
        try:
            off += s.send(view[off:])
        except BlockingIOError:
            time.sleep(0.01)
            continue
        if off == len(view):
            off = 0
            sent_reqs += 4
    time.sleep(0.3)
    grown = rss_mib() - before
    assert grown < 100, f"unread read responses hold {grown:.0f} MiB"
    s.close()
    assert target["serves"]()


# ---------------------------------------------------------------- wrong secrets
def test_wrong_secret_flood_backs_off_and_logs_little(target, capfd):
    """Guesses from one address: the first is answered 'wrong secret', then hellos are
    refused unread (back-off); a few log lines only; other addresses are unaffected."""
    capfd.readouterr()
    answers = []
    t0 = time.monotonic()
    for i in range(60):
        s = target["connect"](authed=False, source="127.0.0.2")
        h, aux = authenticate(s, f"guess-{i}")
        assert h[1] == T_ERROR and CODES[h[8]] == "AuthFailed"
        answers.append(aux.decode())
        s.close()
    elapsed = time.monotonic() - t0
    judged = sum("wrong secret" in a for a in answers)
    refused = sum("too many failed authentications" in a for a in answers)
    assert judged + refused == len(answers)
    assert judged <= 2 + elapsed / 0.1, (judged, elapsed)  # at most ~one guess per back-off window
    assert refused >= len(answers) - judged > 0
    # A legitimate peer from another address authenticates at once.
    s = target["connect"](authed=True, source="127.0.0.1")
    s.close()
    assert target["serves"]()
    lines = [ln for ln in capfd.readouterr().err.splitlines() if "closing" in ln or "refus" in ln]
    assert len(lines) <= 2 + elapsed + 1, lines  # rate-limited: about one line per second


# ---------------------------------------------------------------- fd exhaustion
FD_CHILD = textwrap.dedent("""
    import json, os, resource, sys
    import numpy as np, pdkv
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    with pdkv.Agent("fdtarget", secret=sys.argv[1], transports=["tcp"]) as t:
        mem = np.zeros(4096, np.uint8)
        r = t.register(mem)
        fill = []
        try:
            while True:
                fill.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        print(json.dumps({"address": t.address, "region": r.id}), flush=True)
        sys.stdin.readline()  # the parent measured CPU at the fd limit
        for fd in fill:
            os.close(fd)
        print(json.dumps({"ready": True}), flush=True)
        sys.stdin.readline()  # the parent wrote
        print(json.dumps({"sum": int(mem.astype(np.uint64).sum()), "bytes": mem.tobytes().hex()}), flush=True)
""")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_fd_exhaustion_does_not_spin():
    import json

    p = subprocess.Popen([sys.executable, "-c", FD_CHILD, SECRET], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        info = json.loads(p.stdout.readline())
        host, port = info["address"].rsplit(":", 1)
        conns = [socket.create_connection((host, int(port)), timeout=5) for _ in range(20)]
        time.sleep(0.3)
        c0 = cpu_seconds(p.pid)
        time.sleep(1.0)
        used = cpu_seconds(p.pid) - c0
        assert used < 0.3, f"the agent burnt {used:.2f} s of CPU in 1 s at the fd limit"
        for c in conns:
            c.close()
        p.stdin.write("go\n")
        p.stdin.flush()
        assert json.loads(p.stdout.readline())["ready"]
        with pdkv.Agent("fdgood", secret=SECRET, transports=["tcp"]) as good:
            src = np.random.default_rng(2).integers(0, 256, 4096, dtype=np.uint8)
            rs = good.register(src)
            peer = good.connect(info["address"])
            assert good.prepare_extents("write", peer, [(rs.id, 0, info["region"], 0, 4096)]).post().wait(10)
            p.stdin.write("go\n")
            p.stdin.flush()
            assert bytes.fromhex(json.loads(p.stdout.readline())["bytes"]) == src.tobytes()
    finally:
        p.kill()
        p.wait()
        p.stdin.close()
        p.stdout.close()


# ---------------------------------------------------------------- a fake target attacking an initiator
def read_frame_raw(s: socket.socket):
    h = HDR.unpack(recv_exact(s, HDR.size))
    ctrl = recv_exact(s, h[5] * EXT.size + h[7])
    payload = recv_exact(s, h[6]) if h[1] == T_WRITE else b""
    return h, ctrl, payload


class FakeTarget:
    """A Python server posing as agent 'real' (it serves real's metadata blob with its
    own address), then misbehaving in `phase` ('hello', 'meta' or 'data') with `attack`."""

    def __init__(self, blob: bytes, real_addr: str, phase: str, attack: bytes):
        self.phase, self.attack = phase, attack
        self.ls, self.addr = listen_like(real_addr)
        self.blob = blob.replace(real_addr.encode(), self.addr.encode())
        self.instance = pdkv.decode_metadata(blob)["instance_id"]
        self.ls.settimeout(0.2)
        self.stop = False
        self.done = threading.Event()  # close(): the per-connection threads end
        self.workers: list[threading.Thread] = []
        self.th = threading.Thread(target=self.serve, daemon=True)
        self.th.start()

    def serve(self):
        socks = []
        while not self.stop:
            try:
                s, _ = self.ls.accept()
            except socket.timeout:
                continue
            socks.append(s)
            t = threading.Thread(target=self.one, args=(s,), daemon=True)
            t.start()
            self.workers.append(t)
        # Every thread ends before close() returns (a thread alive at exit keeps its
        # OpenSSL thread state, which LeakSanitizer reports).
        self.done.set()
        for t in self.workers:
            t.join(10)
        for s in socks:
            s.close()

    def one(self, s: socket.socket):
        try:
            s.settimeout(10)
            h, aux, _ = read_frame_raw(s)
            assert h[1] == T_HELLO
            if self.phase == "hello":
                s.sendall(self.attack)
                return
            # It knows the secret (a hostile peer that authenticates): the real handshake.
            _, hs = challenge(s, aux, "real", self.instance)
            if self.phase == "proof":
                s.sendall(self.attack)
                return
            h, proof, _ = read_frame_raw(s)
            assert h[1] == T_PROOF
            _, ack = hs.check(proof, [SECRET.encode()])
            s.sendall(frame(T_HELLO_ACK, xfer=0, aux=ack) + ack)
            h, _, _ = read_frame_raw(s)
            if h[1] == T_META_REQ:
                if self.phase == "meta":
                    s.sendall(self.attack)
                else:
                    s.sendall(frame(T_META_RESP, xfer=0, aux=self.blob) + self.blob)
                return
            s.sendall(self.attack)  # in answer to the first write
            self.done.wait(5)
        except (OSError, AssertionError, ConnectionError):
            pass

    def close(self):
        self.stop = True
        self.th.join(5)
        self.ls.close()


def fake(ftype, **kw):
    aux = kw.pop("aux", b"")
    if "aux_len" not in kw:
        kw["aux_len"] = len(aux)
    return raw_header(ftype, **kw) + aux


RND = np.random.default_rng(3).integers(0, 256, 4096, dtype=np.uint8).tobytes()
ATTACKS = {
    # (phase, bytes the fake target sends)
    "hello/error-count-max": ("hello", fake(T_ERROR, count=U32, aux=b"no", status=5)),
    "hello/error-count-2^24": ("hello", fake(T_ERROR, count=1 << 24, aux=b"no", status=5)),
    "hello/ack-aux-max": ("hello", fake(T_HELLO_ACK, aux_len=U32)),
    "hello/ack-count": ("hello", fake(T_HELLO_ACK, count=1000, aux=b"\0" * 16)),
    "hello/ack-bad-body": ("hello", fake(T_HELLO_ACK, aux=b"\xff" * 16)),
    "hello/ack-without-proof": ("hello", fake(T_HELLO_ACK, aux=b"\xff" * 32)),
    "hello/challenge-aux-max": ("hello", fake(T_CHALLENGE, aux_len=U32)),
    "hello/challenge-bad-body": ("hello", fake(T_CHALLENGE, aux=b"\xff" * 80)),
    "hello/proof-to-initiator": ("hello", fake(T_PROOF, aux=b"\0" * 32)),
    "proof/ack-wrong-mac": ("proof", fake(T_HELLO_ACK, aux=b"\0" * 32)),
    "proof/challenge-again": ("proof", fake(T_CHALLENGE, aux=b"\0" * 80)),
    "proof/write": ("proof", fake(T_WRITE, count=1, payload=16)),
    "hello/write": ("hello", fake(T_WRITE, count=1, payload=16)),
    "hello/garbage": ("hello", RND),
    "meta/meta-resp-aux-max": ("meta", fake(T_META_RESP, aux_len=U32)),
    "meta/meta-resp-count": ("meta", fake(T_META_RESP, count=U32, aux_len=10)),
    "meta/read-resp": ("meta", fake(T_READ_RESP, payload=1 << 30)),
    "meta/garbage": ("meta", RND),
    "data/error-count-max": ("data", fake(T_ERROR, count=U32, aux=b"die", status=6)),
    "data/error-count-2^24": ("data", fake(T_ERROR, count=1 << 24, aux=b"die", status=6)),
    "data/error-aux-max": ("data", fake(T_ERROR, aux_len=U32, status=6)),
    "data/meta-resp-huge": ("data", fake(T_META_RESP, aux_len=64 << 20)),
    "data/read-resp-unexpected": ("data", fake(T_READ_RESP, xfer=999, payload=1 << 30)),
    "data/read-resp-huge": ("data", fake(T_READ_RESP, payload=U64)),
    "data/ack-unknown": ("data", fake(T_ACK, xfer=999)),
    "data/ack-with-payload": ("data", fake(T_ACK, payload=1 << 40)),
    "data/hello-ack-again": ("data", fake(T_HELLO_ACK, aux=b"\0" * 32)),
    "data/challenge-again": ("data", fake(T_CHALLENGE, aux=b"\0" * 80)),
    "data/write-to-initiator": ("data", fake(T_WRITE, count=1, payload=16)),
    "data/notify-to-initiator": ("data", fake(T_NOTIFY, aux_len=U32)),
    "data/unknown-type": ("data", fake(77, count=U32)),
    "data/garbage": ("data", RND),
    "data/stall-mid-header": ("data", fake(T_ACK)[:20]),
}


@pytest.fixture(scope="module")
def real_target():
    with pdkv.Agent("real", secret=SECRET, transports=["tcp"]) as real:
        mem = np.zeros(4096, np.uint8)
        region = real.register(mem)
        yield real, mem, region


@pytest.mark.parametrize("name", list(ATTACKS))
def test_fake_target_cannot_crash_or_balloon_an_initiator(real_target, name):
    real, real_mem, real_region = real_target
    phase, attack = ATTACKS[name]
    ft = FakeTarget(real.metadata(), real.address, phase, attack)
    opts = pdkv.TcpOptions(frame_timeout_s=FRAME_TIMEOUT, connect_timeout_s=3.0)
    try:
        with pdkv.Agent("initiator", secret=SECRET, options=[opts], transports=["tcp"]) as ini:
            src = np.random.default_rng(4).integers(0, 256, 4096, dtype=np.uint8)
            rs = ini.register(src)
            before = rss_mib()
            with pytest.raises(pdkv.PdkvError) as err:
                peer = ini.connect(ft.addr, timeout=3)
                assert ini.prepare_extents("write", peer, [(rs.id, 0, real_region.id, 0, 4096)]).post().wait(5)
            expected = (pdkv.TransferTimeout if name.endswith("stall-mid-header")
                        else pdkv.AuthFailed if name.endswith("ack-wrong-mac") else pdkv.ProtocolError)
            assert type(err.value) is expected, repr(err.value)
            assert rss_mib() - before < 64, "the initiator allocated what the fake target announced"
            # The same initiator then talks to the real target, bit-exact.
            with contextlib.suppress(pdkv.PdkvError):
                ini.remove_peer("real")
            real_mem[:] = 0
            peer = ini.connect(real.address)
            assert ini.prepare_extents("write", peer, [(rs.id, 0, real_region.id, 0, 4096)]).post().wait(10)
            assert np.array_equal(real_mem, src)
    finally:
        ft.close()
