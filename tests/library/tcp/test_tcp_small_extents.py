"""Many small extents over tcp: gathered by the sender, landed by the receiver.

Below an average of 8 KiB per extent the sender copies a frame's extents into a
staging chunk and sends that (out_msg.h); below 4 KiB the receiver receives into
a landing chunk and scatters it (receiver.h, scatter.h). The frame on the wire is the usual Write
or ReadResp (docs/wire.md), so these tests check what can go wrong locally: every
byte where it belongs for sizes on both sides of both thresholds and batches that mix
them, a peer dying in the middle of a gathered frame, and hostile frames of many
small extents.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import pdkv
from conftest import SECRET, freeze
from test_bad_input import EXT, T_WRITE, expect_error_and_close, frame
from test_hostile_tcp import REGION, closed_within, target  # noqa: F401  (fixture)

POOL = 32 << 20


def scattered_offsets(sizes, pool_bytes, rng):
    """An offset for each size: placed in a random order, 64 bytes apart (nothing
    overlaps, nothing coalesces)."""
    offs, pos = [0] * len(sizes), 0
    for i in rng.permutation(len(sizes)):
        offs[i] = pos
        pos += sizes[i] + 64
    assert pos <= pool_bytes
    return offs


# The sizes below were chosen around the former default gather threshold (8 KiB):
# kept, so 4-8 KiB extents still go through the gathered path here.
TCP = pdkv.TcpOptions(gather_below_bytes=8192)


@pytest.fixture
def pair():
    with pdkv.Agent("target", secret=SECRET, transports=["tcp"], options=[TCP]) as t, \
            pdkv.Agent("init", secret=SECRET, transports=["tcp"], options=[TCP]) as a:
        dst = np.zeros(POOL, np.uint8)
        rd = t.register(dst)
        src = np.random.default_rng(7).integers(0, 256, POOL, dtype=np.uint8)
        back = np.zeros(POOL, np.uint8)
        rs, rb = a.register(src, remote_access=False), a.register(back, remote_access=False)
        peer = a.connect(t.address)
        yield a, peer, (src, rs), (dst, rd), (back, rb)


SIZES = {
    "256B": [256] * 20000,  # gathered and landed; more than one frame of kMaxGatherExtents
    "1KiB": [1024] * 3000,  # gathered and landed
    "5KiB": [5120] * 1000,  # gathered, not landed
    "straddle-gathered": [1, 255, 256, 257, 511, 512, 513, 2048, 4095, 4096, 4097] * 300,  # average ~1.5 KiB: landed
    "straddle-direct": [4095, 4096, 4097, 8191, 8192] * 300,  # average ~5.7 KiB: gathered, not landed
    "straddle-landed": [1, 100, 255, 256, 257, 511, 512, 513, 1000] * 1000,  # average ~380 B
    "small-then-large": [300] * 1100 + [20000] * 900,  # a gathered batch whose average then crosses 8 KiB
    "large-then-small": [64 << 10] * 40 + [300] * 1500,
}


@pytest.mark.parametrize("case", list(SIZES))
def test_small_extents_write_and_read_back_bit_exact(pair, case):
    a, peer, (src, rs), (dst, rd), (back, rb) = pair
    rng = np.random.default_rng(len(case))
    sizes = SIZES[case]
    pieces = list(zip(scattered_offsets(sizes, POOL, rng), scattered_offsets(sizes, POOL, rng), sizes))
    ext = [(rs.id, so, rd.id, do, n) for so, do, n in pieces]
    prep = a.prepare_extents("write", peer, ext)
    assert prep.post(timeout=30).wait(30)
    for so, do, n in pieces:
        assert np.array_equal(dst[do:do + n], src[so:so + n])
    # Read back: the target gathers its read response, the initiator lands it.
    rext = [(rb.id, so, rd.id, do, n) for so, do, n in pieces]
    assert a.prepare_extents("read", peer, rext).post(timeout=30).wait(30)
    touched = np.zeros(POOL, bool)
    for so, _, n in pieces:
        touched[so:so + n] = True
    assert np.array_equal(back[touched], src[touched])
    assert not back[~touched].any()  # nothing landed between the extents


def test_a_peer_dying_in_the_middle_of_a_gathered_frame_fails_only_that_transfer(pair):
    """A target killed while frames of 256-byte extents are in flight: the transfer fails
    with a named error, the initiator's process and its other peers carry on."""
    a, good_peer, (src, rs), (dst, rd), _ = pair
    code = textwrap.dedent(f"""
        import json, sys, numpy as np, pdkv
        with pdkv.Agent("doomed", secret={SECRET!r}, transports=["tcp"]) as t:
            mem = np.zeros(64 << 20, np.uint8)
            r = t.register(mem)
            print(json.dumps({{"address": t.address, "region": r.id}}), flush=True)
            sys.stdin.read()
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(proc.stdout.readline())
        doomed = a.connect(info["address"])
        n = (32 << 20) // 256
        ext = [(rs.id, (i * 512) % (POOL - 256), info["region"], i * 512, 256) for i in range(n)]
        prep = a.prepare_extents("write", doomed, ext)
        freeze(proc.pid)  # it stops reading: the frame stays half-sent
        x = prep.post(timeout=30)
        proc.kill()
        with pytest.raises((pdkv.PeerConnectionError, pdkv.TransferTimeout)):
            x.wait(30)
    finally:
        proc.kill()
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()
    ext = [(rs.id, i * 600, rd.id, i * 700, 256) for i in range(4000)]
    assert a.prepare_extents("write", good_peer, ext).post(timeout=30).wait(30)
    assert all(np.array_equal(dst[i * 700:i * 700 + 256], src[i * 600:i * 600 + 256]) for i in range(4000))


# ---------------------------------------------------------------- hostile frames of many small extents
def small_write(region, n, *, size=256, payload=None, bad=None):
    """A Write of n `size`-byte extents into `region`; `bad` = (index, (region, offset, len))."""
    descs = [(region, i * 2 * size, size) for i in range(n)]
    if bad is not None:
        descs[bad[0]] = bad[1]
    body = b"".join(EXT.pack(*d) for d in descs)
    total = sum(d[2] for d in descs) if payload is None else payload
    return frame(T_WRITE, count=n, payload=total) + body, total


@pytest.mark.parametrize("case,code,match", [
    ("zero-length-piece", "ProtocolError", "length 0"),
    ("piece-past-the-region", "OutOfRange", "outside region"),
    ("huge-piece", "OutOfRange", "outside region"),
    ("payload-not-the-sum", "ProtocolError", "payload"),
])
def test_hostile_frame_of_small_extents(target, case, code, match):
    """A Write of 100 256-byte pieces with one bad piece length or a count that does
    not add up: an error frame naming it, the connection closed, nothing written, and
    the target still serves."""
    victim = target["victim"].id
    bad = {
        "zero-length-piece": dict(bad=(51, (victim, 0, 0))),
        "piece-past-the-region": dict(bad=(99, (victim, REGION - 100, 256))),
        "huge-piece": dict(bad=(3, (victim, 0, 2**64 - 200)), payload=100 * 256),
        "payload-not-the-sum": dict(payload=100 * 256 + 1),
    }[case]
    msg, _ = small_write(victim, 100, **bad)
    s = target["connect"]()
    s.sendall(msg)
    expect_error_and_close(s, code, match)
    assert not target["mem"][:REGION].any()
    assert target["serves"]()


def test_initiator_dying_in_the_middle_of_a_landed_payload(target):
    """A raw initiator sends a valid Write of 256-byte pieces, half its payload, and
    closes: only the bytes that arrived are in place, nothing outside the extents is
    touched, and the target serves the next client."""
    victim = target["victim"].id
    msg, total = small_write(victim, 100)
    pattern = bytes(range(256)) * 100
    s = target["connect"]()
    s.sendall(msg + pattern[:total // 2 + 17])
    s.close()
    mem = target["mem"]
    assert target["serves"]()
    inside = np.zeros(REGION, bool)
    for i in range(100):
        inside[i * 512:i * 512 + 256] = True
    assert not mem[:REGION][~inside].any()


def test_slow_trickle_of_a_landed_payload_is_bounded(target):
    """Half a payload of small pieces, then silence: the frame deadline closes it."""
    victim = target["victim"].id
    msg, total = small_write(victim, 100)
    s = target["connect"]()
    s.sendall(msg + b"\x01" * 1000)
    assert closed_within(s, 10)
    assert target["serves"]()
