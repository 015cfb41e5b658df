"""Every file descriptor an shm target gives a peer is sealed or read-only (issue 26,
items 6 and 7).

The fds travel with SCM_RIGHTS: a region's memfd with RegionResp (Agent.alloc pools,
and numpy/torch memory re-mapped onto a memfd at registration) and a layout's
published generation table with GenResp. A peer that holds one (here the test itself,
speaking the protocol after an authenticated hello) tries to shrink it, grow it,
write it and map it writable:

* a region's memfd stays writable (peers write KV into it: that is the transport) but
  can never be resized: a shrink would kill the target with SIGBUS;
* the generation table is the target's word: read-only fd, sealed against future
  writes, so no peer can rewrite a generation and make a stale read pass.

After every attempt the target is alive and serves: its bytes are readable, and for
the table a stale read is still refused.
"""

from __future__ import annotations

import base64
import ctypes
import errno
import fcntl
import mmap
import os
import socket
import struct
import sys

import pytest

import pdkv
from conftest import HERE, SECRET, JsonLineProc
from kvpools import Pool, PoolSpec

pytestmark = pytest.mark.skipif("shm" not in pdkv.available_transports(), reason="shm transport not available")

MAGIC = 0x534B4450
HELLO, HELLO_ACK, REGION_REQ, REGION_RESP, GEN_REQ, GEN_RESP = 1, 2, 3, 4, 13, 14
NBYTES = 4 << 20  # numpy/torch regions this large are re-mapped onto a memfd at registration
SPEC = PoolSpec(layers=2, blocks=8, block_tokens=4, heads=2, head_dim=8)  # shm_trust_target.py --layout
F_SEAL_FUTURE_WRITE = 0x10

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


class Target(JsonLineProc):
    def __init__(self, kind: str) -> None:
        super().__init__([sys.executable, os.path.join(HERE, "shm_trust_target.py"), "--secret", SECRET, "--kind", kind,
                          "--nbytes", str(NBYTES), "--layout"], "target")
        self.region = self.hello["region"]

    @property
    def metadata(self) -> bytes:
        return base64.b64decode(self.hello["metadata"])

    @property
    def shm_path(self) -> str:
        return dict(pdkv.decode_metadata(self.metadata)["endpoints"])["shm"]


class Peer:
    """A same-host peer speaking the shm control protocol by hand (after a hello with
    the secret), collecting the fds the target sends."""

    def __init__(self, path: str) -> None:
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.settimeout(10)
        self.s.connect(path)

        from test_shm_trust import authenticate

        authenticate(self.s, SECRET, "target")  # the challenge-response, proving the secret
        type_, _, status, _, _ = self.recv()
        assert (type_, status) == (HELLO_ACK, 0)

    def send(self, type_: int, ident: int, aux: bytes = b"") -> None:
        self.s.sendall(struct.pack("<IHHQII", MAGIC, type_, 0, ident, len(aux), 0) + aux)

    def recv(self):
        """(type, id, status, aux, fds) of the next frame."""
        hdr, fds, _, _ = socket.recv_fds(self.s, 24, 4)
        while len(hdr) < 24:
            chunk = self.s.recv(24 - len(hdr))
            assert chunk, "the target closed the connection"
            hdr += chunk
        _, type_, _, ident, aux_len, status = struct.unpack("<IHHQII", hdr)
        aux = b""
        while len(aux) < aux_len:
            aux += self.s.recv(aux_len - len(aux))
        return type_, ident, status, aux, fds

    def region_fd(self, region: int) -> int:
        self.send(REGION_REQ, region)
        type_, _, status, aux, fds = self.recv()
        assert (type_, status) == (REGION_RESP, 0), aux
        _, length, _, flags, _, shared_len = struct.unpack("<QQIIQQ", aux)
        assert flags & 1 and len(fds) == 1, "the region is not shared through a memfd"
        return fds[0]

    def gen_table_fd(self, layout: str) -> int:
        self.send(GEN_REQ, 1, layout.encode())
        type_, _, status, aux, fds = self.recv()
        assert (type_, status) == (GEN_RESP, 0), aux
        assert struct.unpack("<I", aux)[0] == SPEC.blocks and len(fds) == 1
        return fds[0]

    def close(self) -> None:
        self.s.close()


def _refused(fn) -> int:
    """Runs fn; returns the errno it failed with, 0 if it succeeded."""
    try:
        fn()
    except OSError as e:
        return e.errno
    return 0


def _mmap_writable(fd: int, size: int) -> None:
    p = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if p == ctypes.c_void_p(-1).value:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    _libc.munmap(p, size)


def _mprotect_writable(fd: int, size: int) -> None:
    p = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if p == ctypes.c_void_p(-1).value:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    try:
        if _libc.mprotect(p, size, mmap.PROT_READ | mmap.PROT_WRITE) != 0:
            e = ctypes.get_errno()
            raise OSError(e, os.strerror(e))
    finally:
        _libc.munmap(p, size)


def _reopen_and_write(fd: int, size: int) -> None:
    g = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
    try:
        os.pwrite(g, b"\xff" * 4, 0)
    finally:
        os.close(g)


# Every attack, on an fd of `size` bytes. "harmless" ones succeed on a region's memfd
# by design (peers write KV into it) and change no size.
ATTACKS = {
    "shrink": lambda fd, size: os.ftruncate(fd, 0),
    "shrink-by-one-page": lambda fd, size: os.ftruncate(fd, size - 4096),
    "grow": lambda fd, size: os.ftruncate(fd, size + 4096),
    "grow-by-write": lambda fd, size: os.pwrite(fd, b"x", size + 4096),
    "grow-by-fallocate": lambda fd, size: os.posix_fallocate(fd, size, 4096),
    "unseal": lambda fd, size: fcntl.fcntl(fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE),
    "write": lambda fd, size: os.write(fd, b"\xff" * 4),
    "pwrite": lambda fd, size: os.pwrite(fd, b"\xff" * 4, 0),
    "mmap-writable": _mmap_writable,
    "mprotect-writable": _mprotect_writable,
    "reopen-writable": _reopen_and_write,
}
REGION_OK = {"write", "pwrite", "mmap-writable", "mprotect-writable", "reopen-writable"}  # the transport's job

FD_KINDS = ["region-numpy", "region-torch", "region-alloc", "generation-table"]


@pytest.fixture(scope="class", params=FD_KINDS)
def sent(request):
    """(kind, target, the fd the target sent, its size)."""
    kind = request.param
    if kind == "region-torch":
        pytest.importorskip("torch")
    target = Target(kind.split("-")[1] if kind.startswith("region-") else "alloc")
    peer = Peer(target.shm_path)
    try:
        fd = peer.region_fd(target.region) if kind.startswith("region-") else peer.gen_table_fd("kv")
        size = os.fstat(fd).st_size
        yield kind, target, fd, size
        os.close(fd)
    finally:
        peer.close()
        target.stop()


@pytest.mark.parametrize("attack", list(ATTACKS))
class TestEveryFdSentToAPeer:
    def test_attack_is_refused_or_harmless_and_the_target_serves(self, sent, attack):
        kind, target, fd, size = sent
        size_before = os.fstat(fd).st_size
        gens_before = target.call(cmd="gens", blocks=list(range(SPEC.blocks)))["gens"]
        err = _refused(lambda: ATTACKS[attack](fd, size))
        if kind.startswith("region-") and attack in REGION_OK:
            assert err == 0, f"{attack} on a region memfd failed: {os.strerror(err)}"
        else:
            assert err in (errno.EPERM, errno.EBADF, errno.EACCES, errno.EINVAL), \
                f"{attack} on the {kind} fd was not refused ({os.strerror(err) if err else 'it succeeded'})"
        assert os.fstat(fd).st_size == size_before == size
        # The target is alive and serves: its region is readable, its generations unchanged.
        assert len(target.call(cmd="bytes")["data"]) > 0
        assert target.call(cmd="gens", blocks=list(range(SPEC.blocks)))["gens"] == gens_before


def test_a_stale_read_is_still_refused_after_the_attacks():
    """The generation table attack of issue 26: a peer holding the table's fd cannot
    put back a bumped block's old generation, so the stale read fails."""
    target = Target("alloc")
    peer = Peer(target.shm_path)
    fd = peer.gen_table_fd("kv")
    try:
        with pdkv.Agent("reader", secret=SECRET, transports=["shm"]) as a:
            dst = Pool(SPEC, 2)
            dst.register(a)
            p = a.add_peer(target.metadata)
            old = target.call(cmd="gens", blocks=[3])["gens"]
            assert a.read(p, pdkv.Blocks("kv", [3]), pdkv.Blocks("kv", [3], generations=old)).wait(10)  # maps the table
            new = target.call(cmd="bump", blocks=[3])["gens"]
            assert new != old
            forged = struct.pack("<I", old[0])
            for attack in (lambda: os.pwrite(fd, forged, 4 * 3),
                           lambda: _mmap_writable(fd, 4 * SPEC.blocks),
                           lambda: _reopen_and_write(fd, 4 * SPEC.blocks)):
                assert _refused(attack) != 0
            with pytest.raises(pdkv.StaleBlock, match="block 3"):
                a.read(p, pdkv.Blocks("kv", [3]), pdkv.Blocks("kv", [3], generations=old)).wait(10)
            assert a.read(p, pdkv.Blocks("kv", [3]), pdkv.Blocks("kv", [3], generations=new)).wait(10)
    finally:
        os.close(fd)
        peer.close()
        target.stop()


def test_a_memfd_that_cannot_be_sealed_is_refused_at_registration():
    with pdkv.Agent("a", secret=SECRET, transports=["shm"]) as a:
        fd = os.memfd_create("unsealable", os.MFD_CLOEXEC)  # no MFD_ALLOW_SEALING
        try:
            os.ftruncate(fd, 4096)
            mm = mmap.mmap(fd, 4096, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
            with pytest.raises(pdkv.InvalidArgument, match="MFD_ALLOW_SEALING"):
                a._n.register_memory(addr, 4096, pdkv._native.module().MemKind.HOST, -1, True, fd)
        finally:
            os.close(fd)
