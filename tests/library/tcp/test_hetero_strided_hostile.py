"""Strided descriptors (tcp frame flag 8, docs/wire.md) from a raw-socket initiator: a
well-formed strided write lands exactly its pieces and a strided read returns them in
order; a hostile one (first or last piece outside the region, count x stride past
2^64, zero or huge count, overlapping pieces, a payload that does not match) gets a
named error and a closed connection, writes nothing, and the target keeps serving."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from test_bad_input import EXT, T_ACK, T_READ_REQ, T_READ_RESP, T_WRITE, expect_error_and_close, recv_frame
from test_hostile_tcp import REGION, U64, raw_header, recv_exact, target  # noqa: F401 (fixture)

SEXT = struct.Struct("<QQQQQ")  # region, offset, len, count, stride
F_STRIDED = 8


def test_a_strided_write_lands_its_pieces_and_a_strided_read_returns_them(target):  # noqa: F811
    s = target["connect"]()
    rid = target["victim"].id
    runs = [(64, 32, 10, 96), (4096, 16, 3, 16), (9000, 7, 1, 0)]  # strided, touching pieces, one piece
    payload = bytes(np.random.default_rng(3).integers(0, 256, sum(n * ln for _, ln, n, _ in runs), dtype=np.uint8))
    descs = b"".join(SEXT.pack(rid, off, ln, n, st) for off, ln, n, st in runs)
    s.sendall(raw_header(T_WRITE, count=len(runs), payload=len(payload), flags=F_STRIDED) + descs + payload)
    h, _ = recv_frame(s)
    assert h[1] == T_ACK and h[8] == 0
    want = np.zeros(REGION, np.uint8)
    pos = 0
    for off, ln, n, st in runs:
        for i in range(n):
            want[off + i * st:off + i * st + ln] = np.frombuffer(payload[pos:pos + ln], np.uint8)
            pos += ln
    assert np.array_equal(target["mem"][:REGION], want)
    s.sendall(raw_header(T_READ_REQ, count=len(runs), flags=F_STRIDED, xfer=2) + descs)
    hdr = recv_exact(s, 40)
    assert struct.unpack_from("<H", hdr, 4)[0] == T_READ_RESP
    assert recv_exact(s, struct.unpack_from("<Q", hdr, 24)[0]) == payload
    assert target["serves"]()


HOSTILE = {  # name: (offset, len, count, stride, code, message)
    "last-piece-past-the-region": (0, 256, REGION // 256 + 1, 256, "OutOfRange", "outside"),
    "first-piece-past-the-region": (REGION, 16, 2, 16, "OutOfRange", "outside"),
    "count-x-stride-overflows": (0, 8, 1 << 17, 1 << 50, "ProtocolError", "overflows"),
    "offset-plus-span-wraps": (U64 - 64, 8, 4, 32, "OutOfRange", "outside"),
    "count-zero": (0, 16, 0, 16, "ProtocolError", "count 0"),
    "count-huge": (0, 1, 1 << 40, 1, "ProtocolError", "pieces exceed"),
    "pieces-overlap": (0, 64, 4, 32, "ProtocolError", "overlap"),
    "length-zero": (0, 0, 4, 16, "ProtocolError", "length 0"),
}


@pytest.mark.parametrize("op", [T_WRITE, T_READ_REQ], ids=["write", "read"])
@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_strided_descriptors_are_refused(target, op, name):  # noqa: F811
    offset, length, count, stride, code, message = HOSTILE[name]
    s = target["connect"]()
    payload = 16 if op == T_WRITE else 0  # never the pieces' sum: refused before the payload is read
    if op == T_WRITE and code == "OutOfRange":
        payload = length * count  # a consistent frame: only the region check can refuse it
    s.sendall(raw_header(op, count=1, payload=payload, flags=F_STRIDED) + SEXT.pack(target["victim"].id, offset, length,
                                                                                   count, stride))
    expect_error_and_close(s, code, message)
    assert not target["mem"].any()
    assert target["serves"]()


def test_a_payload_that_does_not_match_the_pieces_is_refused(target):  # noqa: F811
    s = target["connect"]()
    s.sendall(raw_header(T_WRITE, count=1, payload=100, flags=F_STRIDED) + SEXT.pack(target["victim"].id, 0, 16, 4, 32))
    expect_error_and_close(s, "ProtocolError", "strided extents add up to 64")
    assert not target["mem"].any()
    assert target["serves"]()


def test_too_many_pieces_across_descriptors_are_refused(target):  # noqa: F811
    """Each descriptor is within the limit, together they are not: refused before any
    iovec is allocated for them."""
    s = target["connect"]()
    rid = target["victim"].id
    half = SEXT.pack(rid, 0, 1, 1 << 17, 1)
    s.sendall(raw_header(T_READ_REQ, count=3, flags=F_STRIDED) + half + half + SEXT.pack(rid, 0, 1, 1, 0))
    expect_error_and_close(s, "ProtocolError", "pieces exceed")
    assert target["serves"]()


def test_plain_descriptors_without_the_flag_are_unchanged(target):  # noqa: F811
    s = target["connect"]()
    s.sendall(raw_header(T_WRITE, count=1, payload=16) + EXT.pack(target["victim"].id, 32, 16) + b"\x07" * 16)
    h, _ = recv_frame(s)
    assert h[1] == T_ACK and h[8] == 0
    assert target["mem"][32:48].tolist() == [7] * 16 and not target["mem"][:32].any()
