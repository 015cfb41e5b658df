"""Engine-allocated host memory over shm at Agent.alloc speed (issue 14).

Registering numpy/torch memory re-maps its whole pages onto a memfd at the same
addresses (the partial pages at either end keep cross-memory attach). Checked here:
every registration kind is bit-exact over shm writes and reads between two
processes, including extents across the shared window's edges; the engine's own
pointers see the same bytes before, during and after registration; deregistration
gives the pages back as private memory, so a frozen peer's old mapping no longer
aliases them; freeing the memory (after deregistration, or even before) breaks
nothing; the off switch keeps cross-memory attach.
"""

from __future__ import annotations

import base64
import ctypes
import ctypes.util
import hashlib
import os
import sys

import numpy as np
import pytest

import pdkv
from conftest import HERE, SECRET, JsonLineProc

sys.path.insert(0, HERE)
from shm_engine_peer import NBYTES, SMALL, memfd_mappings  # noqa: E402

pytestmark = pytest.mark.skipif("shm" not in pdkv.available_transports(), reason="shm transport not available")

PAGE = os.sysconf("SC_PAGE_SIZE")


def spawn(role: str, kind: str = "numpy") -> JsonLineProc:
    cmd = [sys.executable, os.path.join(HERE, "shm_engine_peer.py"), "--secret", SECRET, "--role", role, "--kind", kind]
    return JsonLineProc(cmd, f"{role}-{kind}")


def rand(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def sha(a: np.ndarray) -> str:
    return hashlib.sha256(a.tobytes()).hexdigest()


def expected_window(kind: str, nbytes: int, addr: int) -> tuple[int, int]:
    """(shared_offset, shared_bytes) the registration should report."""
    if kind == "alloc":
        return 0, nbytes
    if kind in ("small", "off"):
        return 0, 0
    lo = -(-addr // PAGE) * PAGE
    hi = (addr + nbytes) // PAGE * PAGE
    return lo - addr, hi - lo


# Extents that start before, inside and after the window, cross each of its edges,
# and cover everything once (so one read checks every byte).
def scattered_extents(nbytes: int, shared_offset: int, shared_bytes: int) -> list[tuple[int, int]]:
    cuts = {0, nbytes}
    for edge in (shared_offset, shared_offset + shared_bytes):
        for d in (-5000, -1, 1, 777):
            if 0 < edge + d < nbytes:
                cuts.add(edge + d)
    cuts.update(range(0, nbytes, 300_000))
    pts = sorted(cuts)
    return [(a, b - a) for a, b in zip(pts, pts[1:])]


@pytest.mark.parametrize("kind", ["numpy", "torch", "slice", "alloc", "small", "off"])
def test_every_kind_is_bit_exact_over_shm_both_ways(kind):
    if kind == "torch":
        pytest.importorskip("torch")
    t = spawn("target", kind)
    try:
        n = t.hello["nbytes"]
        addr = t.call(cmd="digest")["addr"]
        assert (t.hello["shared_offset"], t.hello["shared_bytes"]) == expected_window(kind, n, addr)
        if kind not in ("alloc", "small", "off"):  # the engine's pages are the memfd's now
            assert t.call(cmd="memfd_mapped")["mapped"] == t.hello["shared_bytes"]
        with pdkv.Agent("init", secret=SECRET, transports=["shm"]) as a:
            peer = a.add_peer(base64.b64decode(t.hello["metadata"]))
            src = rand(1, n)
            rs = a.register(src)
            # One extent over everything: a write, then the engine's own pointer sees it.
            x = a.prepare_extents("write", peer, [(rs.id, 0, t.hello["region"], 0, n)]).post()
            assert x.wait(30) and x.transport == "shm"
            assert t.call(cmd="digest") == {"sha": sha(src), "addr": addr}
            # The engine writes, the peer reads it back in pieces across the window's edges.
            t.call(cmd="fill", seed=2)
            dst = np.zeros(n, np.uint8)
            rd = a.register(dst)
            ext = scattered_extents(n, t.hello["shared_offset"], t.hello["shared_bytes"])
            assert a.prepare_extents("read", peer, [(rd.id, o, t.hello["region"], o, m) for o, m in ext]).post().wait(30)
            assert np.array_equal(dst, rand(2, n))
            # Scattered writes too.
            src2 = rand(3, n)
            rs2 = a.register(src2)
            assert a.prepare_extents("write", peer, [(rs2.id, o, t.hello["region"], o, m) for o, m in ext]).post().wait(30)
            assert t.call(cmd="digest")["sha"] == sha(src2)
        # Deregistered: the engine's pointer still sees the bytes, now in private pages.
        assert t.call(cmd="dereg")["secs"] < 5
        assert t.call(cmd="digest") == {"sha": sha(src2), "addr": addr}
        assert t.call(cmd="memfd_mapped")["mapped"] == 0
        t.call(cmd="fill", seed=4)
        assert t.call(cmd="digest")["sha"] == sha(rand(4, n))
    finally:
        t.stop()


def test_registration_keeps_pointers_and_bytes_in_process():
    with pdkv.Agent("engine", secret=SECRET, transports=["shm", "tcp"]) as b:
        buf = rand(5, NBYTES)
        addr, before = buf.ctypes.data, sha(buf)
        region = b.register(buf)
        off, length = expected_window("numpy", NBYTES, addr)
        assert (region.shared_offset, region.shared_bytes) == (off, length) and length >= (4 << 20) - PAGE
        assert memfd_mappings(addr, addr + NBYTES) == [(addr + off, addr + off + length)]
        assert buf.ctypes.data == addr and sha(buf) == before
        buf[::4096] = 1  # the engine keeps writing through its pointers
        expect = sha(buf)
        region.close()
        assert memfd_mappings(addr, addr + NBYTES) == []
        assert sha(buf) == expect
        # Small, unexported and below-threshold memory is never re-mapped.
        small = np.zeros(SMALL, np.uint8)
        local = rand(6, NBYTES)
        with b.register(small) as r1, b.register(local, remote_access=False) as r2:
            assert r1.shared_bytes == 0 and r2.shared_bytes == 0
            assert memfd_mappings(local.ctypes.data, local.ctypes.data + NBYTES) == []
        # Agent.alloc memory is shared whole, as before.
        with b.alloc(NBYTES) as r3:
            assert (r3.shared_offset, r3.shared_bytes) == (0, NBYTES)
    # An agent without the shm transport leaves engine memory alone.
    with pdkv.Agent("tcp-only", secret=SECRET, transports=["tcp"]) as c:
        with c.register(local) as r4:
            assert r4.shared_bytes == 0


def test_frozen_peer_loses_the_pages_at_deregistration():
    """The peer maps the engine's pages; frozen, it cannot hold up deregistration, and
    whatever it writes through its old mapping afterwards lands in no engine memory."""
    writer = spawn("init")
    try:
        with pdkv.Agent("engine", secret=SECRET, transports=["shm", "tcp"]) as b:
            buf = np.zeros(NBYTES, np.uint8)
            region = b.register(buf)
            assert region.shared_bytes > 0
            md = base64.b64encode(b.metadata()).decode()
            r = writer.call(cmd="write", metadata=md, region=region.id, nbytes=NBYTES, seed=7)
            assert r["ok"] and r["transport"] == "shm", r
            assert np.array_equal(buf, rand(7, NBYTES))
            # Positive control: the peer's mapping aliases the engine's pages now.
            assert writer.call(cmd="scribble", value=0x11)["bytes"] == region.shared_bytes
            off, n = region.shared_offset, region.shared_bytes
            assert (buf[off:off + n] == 0x11).all()
            writer.pause()
            region.close()  # waits for the frozen peer's RevokeAck, at most 10 s, then drops it
            snapshot = buf.copy()
            writer.resume()
            # The peer still holds its old mapping (a copy that was running when it froze).
            assert writer.call(cmd="scribble", value=0x22)["bytes"] == n
            assert np.array_equal(buf, snapshot)
            r = writer.call(cmd="write", metadata=md, region=region.id, nbytes=NBYTES, seed=8)
            assert not r["ok"] and "NotFound" in r["error"], r
            assert np.array_equal(buf, snapshot)
            # A fresh registration of the same memory is served again.
            region2 = b.register(buf)
            md2 = base64.b64encode(b.metadata()).decode()
            r = writer.call(cmd="write", metadata=md2, region=region2.id, nbytes=NBYTES, seed=9)
            assert r["ok"], r
            assert np.array_equal(buf, rand(9, NBYTES))
            region2.close()
    finally:
        writer.stop()


def _libc():
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


def test_freeing_the_memory_after_or_even_before_deregistration():
    libc = _libc()
    n = 8 << 20  # malloc serves this with its own mmap: free() unmaps it
    with pdkv.Agent("engine", secret=SECRET, transports=["shm"]) as b:
        # Freed after deregistration: an ordinary free of private pages.
        p = libc.malloc(n)
        ctypes.memset(p, 0x33, n)
        r = b.register_address(p, n)
        assert r.shared_bytes > 0
        r.close()
        assert np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(p))[::4096].tolist() == [0x33] * (n // 4096)
        libc.free(p)
        # Freed while registered (the caller's mistake): deregistration must not touch
        # whatever now lives at those addresses.
        p = libc.malloc(n)
        r = b.register_address(p, n)
        assert r.shared_bytes > 0
        libc.free(p)
        q = libc.malloc(n)  # usually the same addresses again
        ctypes.memset(q, 0x44, n)
        r.close()
        view = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(q))
        assert (view == 0x44).all()
        view[:] = 0x55  # still ordinary writable memory
        assert (view == 0x55).all()
        assert memfd_mappings(q, q + n) == []
        libc.free(q)


def test_file_and_shared_mappings_keep_cross_memory_attach(tmp_path):
    import mmap

    with pdkv.Agent("engine", secret=SECRET, transports=["shm"]) as b:
        anon_shared = mmap.mmap(-1, NBYTES)  # MAP_SHARED anonymous: another process may share it
        f = open(tmp_path / "pool", "w+b")
        f.truncate(NBYTES)
        filemap = mmap.mmap(f.fileno(), NBYTES)
        try:
            for m in (anon_shared, filemap):
                with b.register(m) as r:
                    assert r.shared_bytes == 0
        finally:
            filemap.close()
            f.close()
            anon_shared.close()
