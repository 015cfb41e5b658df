"""A same-host shm peer is who the kernel says it is (issue 26, item 2).

The initiator copies into the target's process by cross-memory attach at the pid it
learns in the handshake. A fake target (tests/shm_fake_target.py: a Unix socket that
speaks the protocol) claims another process's pid, or gives its own pid and exits so
that the pid is reused, or runs as another uid: every case is refused before a byte
is written, and a bystander process (tests/shm_canary.py) at the address the fake
names keeps its canary. The target side refuses a peer of another uid the same way.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

import pdkv
from conftest import HERE, SECRET

pytestmark = pytest.mark.skipif("shm" not in pdkv.available_transports(), reason="shm transport not available")

LEN = 1 << 16  # below ShmOptions.share_pages_min_bytes: a private region (cross-memory attach)
CANARY_ADDR = 0x5A5A_0000_0000
NOBODY = 65534


def shm_path(agent: pdkv.Agent) -> str:
    return dict(pdkv.decode_metadata(agent.metadata())["endpoints"])["shm"]


class Canary:
    """A bystander process with LEN bytes of 0xCC at CANARY_ADDR."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "shm_canary.py"), "--addr", str(CANARY_ADDR),
                                      "--len", str(LEN)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     bufsize=1)
        hello = json.loads(self.proc.stdout.readline())
        assert "pid" in hello, hello
        self.pid = hello["pid"]

    def intact(self) -> bool:
        self.proc.stdin.write("?\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["intact"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


class FakeTarget:
    """tests/shm_fake_target.py listening at `path` in place of agent `md`'s socket."""

    def __init__(self, path: str, md: bytes, *, claim_pid: int = 0, handoff: bool = False, uid: int = -1) -> None:
        d = pdkv.decode_metadata(md)
        os.unlink(path)  # the real agent's socket file: its listener stays, unreachable
        cmd = [sys.executable, os.path.join(HERE, "shm_fake_target.py"), "--path", path, "--instance",
               str(d["instance_id"]), "--name", d["name"], "--addr", str(CANARY_ADDR), "--len", str(LEN),
               "--claim-pid", str(claim_pid), "--secret", SECRET]
        if handoff:
            cmd.append("--handoff")
        if uid >= 0:
            cmd += ["--uid", str(uid)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()


def _victim_setup(b: pdkv.Agent):
    """b's metadata with its region moved to CANARY_ADDR (what a fake target answers too)."""
    buf = np.zeros(LEN, np.uint8)
    rd = b.register(buf)
    md = b.metadata()
    real = struct.pack("<QQ", rd.addr, LEN)
    assert md.count(real) == 1
    return md.replace(real, struct.pack("<QQ", CANARY_ADDR, LEN)), rd, buf


def _write(a: pdkv.Agent, peer: str, rd_id: int, timeout: float = 10.0):
    src = np.full(LEN, 0x11, np.uint8)
    rs = a.register(src)
    try:
        return a.prepare_extents("write", peer, [(rs.id, 0, rd_id, 0, LEN)]).post().wait(timeout)
    finally:
        rs.close()


def test_a_fake_target_claiming_another_processes_pid_is_refused_and_writes_nothing():
    canary = Canary()
    try:
        with pdkv.Agent("a", secret=SECRET, transports=["shm"]) as a, \
                pdkv.Agent("b", secret=SECRET, transports=["shm"]) as b:
            forged, rd, _ = _victim_setup(b)
            fake = FakeTarget(shm_path(b), forged, claim_pid=canary.pid)
            try:
                peer = a.add_peer(forged)
                with pytest.raises(pdkv.AuthFailed) as ei:
                    _write(a, peer, rd.id)
                msg = str(ei.value)
                assert f"process {canary.pid}" in msg and f"process {fake.proc.pid}" in msg, msg
            finally:
                fake.close()
            assert canary.intact(), "the initiator wrote into a bystander process"
    finally:
        canary.close()


def _take_pid(pid: int, tries: int = 200):
    """Starts a Canary whose pid is `pid` (root: through ns_last_pid), or None."""
    for _ in range(tries):
        try:
            with open("/proc/sys/kernel/ns_last_pid", "w") as f:
                f.write(str(pid - 1))
        except OSError:
            return None
        c = Canary()
        if c.pid == pid:
            return c
        c.close()
    return None


@pytest.mark.skipif(os.geteuid() != 0, reason="simulating pid reuse needs root (ns_last_pid)")
def test_a_reused_pid_is_never_written():
    """The target answers the handshake with its own (true) pid, hands its socket to a
    child and exits; a bystander then gets that pid. The initiator's pidfd says the
    process it connected to is gone: nothing is written to the reused pid."""
    with pdkv.Agent("a", secret=SECRET, transports=["shm"]) as a, \
            pdkv.Agent("b", secret=SECRET, transports=["shm"]) as b:
        forged, rd, _ = _victim_setup(b)
        fake = FakeTarget(shm_path(b), forged, handoff=True)
        canary = None
        try:
            peer = a.add_peer(forged)
            a.warm_up(peer, timeout=10)  # the handshake, with the fake's own pid
            dead = fake.proc.pid
            fake.proc.wait(timeout=10)  # it exited (its child keeps the connection), and is reaped
            canary = _take_pid(dead)
            if canary is None:
                pytest.skip(f"could not start a process with pid {dead} again")
            with pytest.raises(pdkv.PeerConnectionError, match=f"process {dead}"):
                _write(a, peer, rd.id)
            assert canary.intact(), "the initiator wrote into the process that reused the pid"
        finally:
            fake.close()
            if canary:
                canary.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a fake target as another uid")
@pytest.mark.parametrize("allowed", [False, True])
def test_a_target_of_another_uid_is_refused_unless_allowed(allowed):
    opts = pdkv.ShmOptions(allowed_peer_uids=[NOBODY] if allowed else [])
    with pdkv.Agent("b", secret=SECRET, transports=["shm"]) as b, \
            pdkv.Agent("a", secret=SECRET, transports=["shm"], options=[opts]) as a:
        forged, _, _ = _victim_setup(b)
        fake = FakeTarget(shm_path(b), forged, uid=NOBODY)  # truthful about its pid
        try:
            peer = a.add_peer(forged)
            if allowed:
                a.warm_up(peer, timeout=10)  # the handshake passes
            else:
                with pytest.raises(pdkv.AuthFailed, match=f"uid {NOBODY}.*allowed_peer_uids"):
                    a.warm_up(peer, timeout=10)
        finally:
            fake.close()


_CLIENT = r"""
import ctypes, os, socket, struct, sys
path, secret, uid = sys.argv[1], sys.argv[2], int(sys.argv[3])
# Connect with euid `uid` (what SO_PEERCRED reports) but filesystem uid 0 (the socket
# file is root's, mode 0600).
os.setresuid(0, uid, 0)
ctypes.CDLL(None).setfsuid(0)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(path)
os.setresuid(0, 0, 0)
def st(x):
    return struct.pack("<I", len(x)) + x.encode()
import pdkv
hs = pdkv._native.module().InitiatorHandshake("shm", 6, "mallory")
aux = struct.pack("<HQ", 6, 0) + st("mallory") + st("") + hs.nonce + hs.pub
try:
    s.sendall(struct.pack("<IHHQII", 0x534B4450, 1, 0, 0, len(aux), 0) + aux)
except OSError:
    pass
s.settimeout(10)
hdr = b""
try:
    while len(hdr) < 24:
        c = s.recv(24 - len(hdr))
        if not c:
            break
        hdr += c
except OSError:
    pass
print(struct.unpack("<IHHQII", hdr)[1] if len(hdr) == 24 else 0, struct.unpack("<IHHQII", hdr)[5] if len(hdr) == 24 else 0)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as another uid")
@pytest.mark.parametrize("allowed", [False, True])
def test_the_target_refuses_a_peer_of_another_uid_unless_allowed(allowed):
    opts = pdkv.ShmOptions(allowed_peer_uids=[NOBODY] if allowed else [])
    with pdkv.Agent("b", secret=SECRET, transports=["shm"], options=[opts]) as b:
        out = subprocess.run([sys.executable, "-c", _CLIENT, shm_path(b), SECRET, str(NOBODY)], capture_output=True,
                             text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        type_, status = map(int, out.stdout.split())
        if allowed:
            assert (type_, status) == (15, 0)  # the hello is read and answered: a challenge
        else:
            assert (type_, status) == (9, 5)  # Error, AuthFailed
        # The agent keeps serving its own uid.
        with pdkv.Agent("a", secret=SECRET, transports=["shm"]) as a:
            dst = np.zeros(4096, np.uint8)
            src = np.full(4096, 7, np.uint8)
            rd, rs = b.register(dst), a.register(src)
            peer = a.add_peer(b.metadata())
            assert a.prepare_extents("write", peer, [(rs.id, 0, rd.id, 0, 4096)]).post().wait(10)
            assert (dst == 7).all()


def test_the_options_say_who_may_connect():
    assert pdkv.ShmOptions().allowed_peer_uids == []
    assert pdkv.ShmOptions(allowed_peer_uids=[1, 2]).allowed_peer_uids == [1, 2]
    with pytest.raises(pdkv.InvalidArgument, match="allowed_peer_uids"):
        pdkv.ShmOptions(allowed_peer_uids=[-1])
    with pytest.raises(pdkv.InvalidArgument, match="allowed_peer_uids"):
        pdkv.ShmOptions(allowed_peer_uids=list(range(65)))
    with pytest.raises(pdkv.InvalidArgument, match="allowed_peer_uids"):
        pdkv.ShmOptions(allowed_peer_uids="0")
