"""The shm transport does not trust the metadata blob or its clients (issue 11).

Cross-memory attach (memory pdkv did not allocate) is bounded by what the target
confirms over its authenticated socket; deregistration revokes at every peer that
confirmed a region, within a bounded wait; the control socket bounds every frame
before allocating and has deadlines; peer faults fail the transfer at wait().
Every test ends with a verified legitimate transfer.
"""

from __future__ import annotations

import base64
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

import pdkv
from conftest import HERE, SECRET, JsonLineProc, PeerProc
from kvpools import Pool, PoolSpec

pytestmark = pytest.mark.skipif("shm" not in pdkv.available_transports(), reason="shm transport not available")

MAGIC = 0x534B4450
HELLO, HELLO_ACK, NOTIFY, ERROR, CHALLENGE, PROOF = 1, 2, 5, 9, 15, 16
SHM_VERSION = 6
NBYTES = 1 << 16


def shm_path(agent: pdkv.Agent) -> str:
    return dict(pdkv.decode_metadata(agent.metadata())["endpoints"])["shm"]


def header(type_: int, aux_len: int, ident: int = 0) -> bytes:
    return struct.pack("<IHHQII", MAGIC, type_, 0, ident, aux_len, 0)


def hello(to: str = "", version: int = SHM_VERSION, hs=None, name: str = "mallory") -> bytes:
    """A hello frame: no secret, a nonce and an ephemeral key (pdkv/spi/auth.h)."""
    def s(x: str) -> bytes:
        return struct.pack("<I", len(x)) + x.encode()
    hs = hs or pdkv._native.module().InitiatorHandshake("shm", SHM_VERSION, name)
    aux = struct.pack("<HQ", version, 0) + s(name) + s(to) + hs.nonce + hs.pub
    return header(HELLO, len(aux)) + aux


def recv_ctl(sock: socket.socket) -> tuple[int, bytes]:
    """(type, aux) of the next control frame."""
    h = b""
    while len(h) < 24:
        chunk = sock.recv(24 - len(h))
        if not chunk:
            raise ConnectionError("closed")
        h += chunk
    aux_len = struct.unpack_from("<I", h, 16)[0]
    aux = b""
    while len(aux) < aux_len:
        aux += sock.recv(aux_len - len(aux))
    return struct.unpack_from("<H", h, 4)[0], aux


def authenticate(sock: socket.socket, secret: str, to: str = "", name: str = "mallory") -> None:
    """The initiator's handshake up to its proof (made with `secret`); the target's
    answer to the proof (hello-ack or error) is left unread."""
    hs = pdkv._native.module().InitiatorHandshake("shm", SHM_VERSION, name)
    sock.settimeout(10)
    sock.sendall(hello(to, hs=hs, name=name))
    kind, aux = recv_ctl(sock)
    assert kind == CHALLENGE, (kind, aux)
    instance, n = struct.unpack_from("<QI", aux)
    target = aux[12:12 + n].decode()
    proof = hs.answer(target, instance, aux[12 + n:44 + n], aux[44 + n:76 + n], secret.encode())
    sock.sendall(header(PROOF, len(proof)) + proof)


def read_until_closed(sock: socket.socket, limit: float) -> bytes:
    sock.settimeout(limit)
    out = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def legit_write(a: pdkv.Agent, b: pdkv.Agent, value: int) -> None:
    """A fresh region pair, one write, bytes checked."""
    src = np.full(4096, value, np.uint8)
    dst = np.zeros(4096, np.uint8)
    rs, rd = a.register(src), b.register(dst)
    peer = a.add_peer(b.metadata())
    assert a.prepare_extents("write", peer, [(rs.id, 0, rd.id, 0, 4096)]).post().wait(10)
    assert np.array_equal(dst, src)
    rs.close()
    rd.close()


# ---------------------------------------------------------------- forged metadata


def test_forged_region_length_is_refused_and_the_canary_survives():
    with pdkv.Agent("a", secret=SECRET, transports=["shm"]) as a, \
            pdkv.Agent("b", secret=SECRET, transports=["shm"]) as b:
        buf = np.zeros(2 * NBYTES, np.uint8)
        buf[NBYTES:] = 0xCC  # canary right after the exported bytes
        rd = b.register(buf[:NBYTES])
        md = b.metadata()
        real = struct.pack("<QQ", rd.addr, NBYTES)
        assert md.count(real) == 1
        forged = md.replace(real, struct.pack("<QQ", rd.addr, 2 * NBYTES))
        peer = a.add_peer(forged)
        src = np.full(2 * NBYTES, 0x11, np.uint8)
        rs = a.register(src)
        x = a.prepare_extents("write", peer, [(rs.id, 0, rd.id, 0, 2 * NBYTES)]).post(notify=b"forged")
        with pytest.raises(pdkv.OutOfRange) as ei:
            x.wait(10)
        msg = str(ei.value)
        assert f"+{NBYTES})" in msg and f"+{2 * NBYTES})" in msg, msg  # names both
        assert (buf[NBYTES:] == 0xCC).all(), "write landed outside the export"
        assert not buf[:NBYTES].any()
        assert b.wait_notifications(0.2) == []
        # With the real metadata the same peer writes (only) the exported bytes.
        peer = a.add_peer(md)
        assert a.prepare_extents("write", peer, [(rs.id, 0, rd.id, 0, NBYTES)]).post().wait(10)
        assert (buf[:NBYTES] == 0x11).all() and (buf[NBYTES:] == 0xCC).all()


# ---------------------------------------------------------------- deregistration


class Target(JsonLineProc):
    def __init__(self, kind: str) -> None:
        super().__init__([sys.executable, os.path.join(HERE, "shm_trust_target.py"), "--secret", SECRET,
                          "--kind", kind], "target")

    @property
    def metadata(self) -> bytes:
        return base64.b64decode(self.hello["metadata"])

    def data(self) -> np.ndarray:
        return np.frombuffer(base64.b64decode(self.call(cmd="bytes")["data"]), np.uint8)


@pytest.mark.parametrize("kind", ["numpy", "torch", "alloc"])
def test_deregistered_region_refuses_new_writes_in_another_process(kind):
    if kind == "torch":
        pytest.importorskip("torch")
    t = Target(kind)
    try:
        with pdkv.Agent("init", secret=SECRET, transports=["shm"]) as a:
            src = np.full(NBYTES, 7, np.uint8)
            rs = a.register(src)
            peer = a.add_peer(t.metadata)
            ext = [(rs.id, 0, t.hello["region"], 0, NBYTES)]
            assert a.prepare_extents("write", peer, ext).post(notify=b"first").wait(10)
            assert (t.data() == 7).all()
            assert t.call(cmd="notifs")["notifs"] == ["first"]
            kept = a.prepare_extents("write", peer, ext)  # prepared (and confirmed) before
            assert kept.post().wait(10)
            assert t.call(cmd="dereg")["secs"] < 5
            src[:] = 9
            for x in (a.prepare_extents("write", peer, ext).post(notify=b"late"), kept.post(notify=b"late2")):
                with pytest.raises(pdkv.NotFound, match="deregistered"):
                    x.wait(10)
            # Not one byte landed, no notification.
            assert (t.data() == 7).all()
            assert t.call(cmd="notifs", wait=0.3)["notifs"] == []
            # A new region of the same kind works.
            fresh = t.call(cmd="fresh")
            peer = a.add_peer(base64.b64decode(fresh["metadata"]))
            x = a.prepare_extents("write", peer, [(rs.id, 0, fresh["region"], 0, NBYTES)]).post(notify=b"fresh")
            assert x.wait(10)
            assert (t.data() == 9).all()
            assert t.call(cmd="notifs")["notifs"] == ["fresh"]
    finally:
        t.stop()


def test_frozen_peer_cannot_block_deregistration():
    spec = PoolSpec(blocks=8)
    with pdkv.Agent("target", secret=SECRET, transports=["shm", "tcp"]) as b:
        pool = Pool(spec, None)
        pool.register(b)
        init = PeerProc("init", spec, 3, transports=("shm", "tcp"))
        try:
            r = init.call(cmd="xfer", op="write", address=b.address, lblocks=[0, 1], rblocks=[2, 3])
            assert r["ok"] and r["transport"] == "shm", r  # init confirmed b's regions
            before = pool.logical([0, 1, 2, 3]).copy()
            init.pause()
            t0 = time.monotonic()
            for reg in b.regions:
                reg.close()
            took = time.monotonic() - t0
            assert took < 20, f"deregistration blocked for {took:.1f} s"
            init.resume()
            # The peer lost its connection; when it comes back it finds nothing to write to.
            r = init.call(cmd="xfer", op="write", address=b.address, lblocks=[0], rblocks=[0])
            assert not r["ok"] and "NotFound" in r["error"], r
            assert np.array_equal(pool.logical([0, 1, 2, 3]), before)
            # A freshly registered pool is served.
            pool2 = Pool(spec, None)
            pool2.register(b)
            r = init.call(cmd="xfer", op="write", address=b.address, lblocks=[4, 5], rblocks=[6, 7], notify="ok")
            assert r["ok"] and r["transport"] == "shm", r
            src = Pool(spec, 3)
            assert np.array_equal(pool2.logical([6, 7]), src.logical([4, 5]))
        finally:
            init.stop()


# ---------------------------------------------------------------- the fault contract


def _peer_b(a: pdkv.Agent):
    """A second agent 'b' with a 4 KiB region, known to ``a``: (b, peer, extents of one write)."""
    b = pdkv.Agent("b", secret=SECRET, transports=["shm"])
    rd = b.register(np.zeros(4096, np.uint8))  # the region keeps its array alive
    rs = a.register(np.ones(4096, np.uint8))
    return b, a.add_peer(b.metadata()), [(rs.id, 0, rd.id, 0, 4096)]


def test_unreachable_peer_fails_at_wait_not_write():
    with pdkv.Agent("a", secret=SECRET, transports=["shm"]) as a:
        b, peer, ext = _peer_b(a)
        b.close()
        x = a.prepare_extents("write", peer, ext).post(notify=b"n")  # must not raise
        with pytest.raises(pdkv.PeerConnectionError):
            x.wait(10)
        with pdkv.Agent("c", secret=SECRET, transports=["shm"]) as c:
            legit_write(a, c, 5)


def test_restarted_peer_is_stale_at_wait():
    with pdkv.Agent("a", secret=SECRET, transports=["shm"]) as a:
        b, peer, ext = _peer_b(a)
        prep = a.prepare_extents("write", peer, ext)
        assert prep.post().wait(10)
        b.close()
        with pdkv.Agent("b", secret=SECRET, transports=["shm"]) as b2:
            for x in (prep.post(), a.prepare_extents("write", peer, ext).post()):
                with pytest.raises(pdkv.StalePeer, match="restarted"):
                    x.wait(10)
            legit_write(a, b2, 6)


def test_gone_peer_beside_another_agent_of_its_name_is_not_called_restarted(monkeypatch):
    """Names are not unique on a host: when the peer's socket is gone while its process
    lives, and another process's agent of the same name listens in the directory, the
    transfer fails with a connection error naming both, not StalePeer (which would send
    the caller to fetch the other agent's metadata)."""
    # A directory of this test's own (short: socket paths are limited): the other xdist
    # worker's tests start agents named "b" too.
    sock_dir = tempfile.mkdtemp(prefix="pdkv-gb-")
    monkeypatch.setenv("PDKV_SHM_DIR", sock_dir)
    with pdkv.Agent("a", secret=SECRET, transports=["shm"]) as a:
        b, peer, ext = _peer_b(a)
        assert a.prepare_extents("write", peer, ext).post().wait(10)
        b.close()  # this process, the peer's, goes on
        other = subprocess.Popen([sys.executable, "-c", "import pdkv, sys\n"
                                  f"b = pdkv.Agent('b', secret={SECRET!r}, transports=['shm'])\n"
                                  "print('up', flush=True)\nsys.stdin.read()"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert other.stdout.readline().strip() == "up"
            x = a.prepare_extents("write", peer, ext).post()
            with pytest.raises(pdkv.PeerConnectionError, match=f"process {os.getpid()} of peer 'b' still runs.*"
                               f"process {other.pid}\\) listens") as e:
                x.wait(10)
            assert not isinstance(e.value, pdkv.StalePeer)
        finally:
            other.stdin.close()
            other.wait(30)
            other.stdout.close()
            shutil.rmtree(sock_dir, ignore_errors=True)


def _socket_inodes() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:"):
            out.add(link)
    return out


@pytest.mark.parametrize("frozen_for", [1.5, None])
def test_region_confirmation_waits_for_the_transfers_deadline(spawn_peer, frozen_for):
    """The first write naming a region asks the target to confirm it. A target that is
    alive but slow (frozen 1.5 s here; a loaded host in CI) answers within the transfer's
    deadline and the write lands, even past the connect timeout (0.5 s); one frozen past
    the deadline fails that transfer with TransferTimeout at its deadline, and its late
    answer does not cost the connection."""
    import threading

    spec = PoolSpec(layers=2, blocks=8, block_tokens=4, heads=2, head_dim=16, dtype="float16")
    peer = spawn_peer("decode", spec, transports=("shm", "tcp"), shared=True)
    opts = [pdkv.TcpOptions(connect_timeout_s=0.5), pdkv.ShmOptions(connect_timeout_s=0.5)]
    with pdkv.Agent("prefill", secret=SECRET, transports=["shm", "tcp"], options=opts) as a:
        local = Pool(spec, 3)
        local.register(a)
        name = a.connect(peer.address)
        assert a.peer_transport(name) == "shm"
        assert a.notify(name, b"dialed").wait(10)  # the shm connection is up; no region confirmed yet
        peer.pause()
        resumed = threading.Timer(frozen_for, peer.resume) if frozen_for else None
        try:
            t0 = time.monotonic()
            if resumed:
                resumed.start()
            x = a.write(name, pdkv.Blocks("kv", [1, 2]), pdkv.Blocks("kv", [3, 4]), timeout=10.0 if resumed else 1.0)
            if resumed:
                assert x.wait(20)
                assert time.monotonic() - t0 >= frozen_for - 0.1
            else:
                with pytest.raises(pdkv.TransferTimeout, match="did not confirm region"):
                    x.wait(20)
                assert 0.9 <= time.monotonic() - t0 < 8.0
        finally:
            if resumed:
                resumed.join()
            else:
                peer.resume()
        if not resumed:
            # The peer answers the timed-out request late: dropped, the connection stays
            # (no new socket: the next write does not dial again).
            sockets = _socket_inodes()
            time.sleep(0.5)
            assert a.write(name, pdkv.Blocks("kv", [7]), pdkv.Blocks("kv", [7])).wait(10)
            assert _socket_inodes() <= sockets
        assert a.write(name, pdkv.Blocks("kv", [5]), pdkv.Blocks("kv", [6])).wait(10)
        assert peer.call(cmd="digest", blocks=[6])["digest"] == local.digest([5])
        if resumed:
            assert peer.call(cmd="digest", blocks=[3, 4])["digest"] == local.digest([1, 2])


# ---------------------------------------------------------------- hostile raw clients


def test_oversized_prehello_frames_are_refused_before_allocation():
    with pdkv.Agent("a", secret=SECRET, transports=["shm"]) as a, \
            pdkv.Agent("b", secret=SECRET, transports=["shm"]) as b:
        path = shm_path(b)
        base = rss_mb()
        clients = []
        try:
            for _ in range(400):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                clients.append(s)
                s.connect(path)
                try:  # announces 2 MiB, sends 4 KiB
                    s.sendall(header(HELLO, 2 << 20) + b"\0" * 4096)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # refused after the header, before the rest arrived: as intended
            time.sleep(0.5)
            grown = rss_mb() - base
            assert grown < 200, f"RSS grew by {grown:.0f} MB"
            # Each was refused with a named error (or closed at the pending-connection cap).
            s = clients[0]
            reply = read_until_closed(s, 10)
            assert len(reply) >= 24 and struct.unpack_from("<H", reply, 4)[0] == ERROR
            assert b"limit 4096" in reply
        finally:
            for s in clients:
                s.close()
        legit_write(a, b, 3)


def test_silent_clients_are_dropped():
    with pdkv.Agent("a", secret=SECRET, transports=["shm"]) as a, \
            pdkv.Agent("b", secret=SECRET, transports=["shm"]) as b:
        path = shm_path(b)
        t0 = time.monotonic()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as mute, \
                socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stalled:
            mute.connect(path)  # never says anything
            stalled.connect(path)
            # Authenticates, then announces a 1000-byte notification and sends 10 bytes.
            authenticate(stalled, SECRET, "b")
            assert recv_ctl(stalled)[0] == HELLO_ACK
            stalled.sendall(header(NOTIFY, 1000, 1) + b"x" * 10)
            assert read_until_closed(mute, 15) == b""
            assert read_until_closed(stalled, 15) == b""
        assert time.monotonic() - t0 < 15
        assert b.wait_notifications(0.1) == []
        legit_write(a, b, 4)


def test_wrong_secret_guesses_are_slowed_and_logged_sparingly(capfd):
    with pdkv.Agent("a", secret=SECRET, transports=["shm"]) as a, \
            pdkv.Agent("b", secret=SECRET, transports=["shm"]) as b:
        path = shm_path(b)
        t0 = time.monotonic()
        for i in range(60):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(path)
                authenticate(s, f"guess-{i}", "b")
                reply = read_until_closed(s, 10)
                assert b"wrong secret" in reply
        took = time.monotonic() - t0
        # 20 failures are answered at once, then about 6 a second (5 refilled + 1 per held reply).
        assert took > 3, f"60 wrong guesses answered in {took:.2f} s: no back-off"
        lines = [ln for ln in capfd.readouterr().err.splitlines() if "wrong secret" in ln]
        if os.environ.get("PDKV_LOG", "warn") == "error":  # .ci/run and the sanitizer runs
            assert lines == []
        else:  # rate-limited: about one line a second, with the count of the others
            assert 1 <= len(lines) <= took + 2, lines
        legit_write(a, b, 8)  # a correct secret is not delayed
