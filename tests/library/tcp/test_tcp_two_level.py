"""Two-level runs on tcp's wire (issue 14; docs/wire.md, flag 32).

A heterogeneous transfer between contiguous pools (a block's run repeated over every
(layer, part)) or NHD <-> HND with several heads (one head's tokens repeated per head
or per block) is a few hundred two-level runs instead of 25k-82k one-level ones. tcp
advertises ``two_level_extents`` and carries them as 56-byte two-level descriptors to a
peer whose metadata extra has feature bit 3 (value 8); a peer without it gets
one-level descriptors (or plain pieces, without bit 1), bit-exact all the same.

Checked here: pushes and pulls land exactly the requested rows in every mode (TP
splits both ways, block sizes, NHD <-> HND and combinations; partial last blocks; bf16
and fp8 rows; consecutive and scattered block ids), compressed too; the frames on the
wire (seen through a relay) carry flag 32, and never to a peer without the bit; a
raw-socket initiator's well-formed two-level write and read are served, hostile ones
(overlapping repetitions, a span past the region, count2 x stride2 past 2^64, zero
counts, too many pieces, a payload that does not match, both strided flags) get a
named error and a closed connection, and the target memory stays untouched.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest

import pdkv
from conftest import Relay, listen_like
from test_bad_input import T_ACK, T_READ_REQ, T_READ_RESP, T_WRITE, expect_error_and_close, recv_frame
from test_hostile_tcp import REGION, U64, raw_header, recv_exact, target  # noqa: F401 (fixture)

LAYERS, BLOCKS, D = 3, 24, 16
NP = {"bfloat16": np.uint16, "float8_e4m3fn": np.uint8}

MODES = {  # name: (local T, H, order, remote T, H, order, heads moved, local offset, remote offset)
    "tp2:tp4": (16, 4, "NHD", 16, 2, "NHD", 2, 2, 0),
    "tp4:tp2": (16, 2, "NHD", 16, 4, "NHD", 2, 0, 2),
    "bs16:bs32": (16, 2, "NHD", 32, 2, "NHD", 2, 0, 0),
    "bs32:bs16": (32, 2, "NHD", 16, 2, "NHD", 2, 0, 0),
    "nhd:hnd": (16, 4, "NHD", 16, 4, "HND", 4, 0, 0),
    "hnd:nhd": (16, 4, "HND", 16, 4, "NHD", 4, 0, 0),
    "tp2:tp4+nhd:hnd": (16, 4, "NHD", 16, 2, "HND", 2, 2, 0),
    "tp4:tp2+bs16:bs32+nhd:hnd": (16, 2, "NHD", 32, 4, "HND", 2, 0, 2),
}


class KV:
    """A contiguous pool ([layers, parts, blocks, <block>]) in one numpy buffer."""

    def __init__(self, agent, t, h, order, dtype, seed=None):
        self.geo = pdkv.KVGeometry(LAYERS, BLOCKS, t, h, D, dtype, order=order)
        self.t, self.h, self.order, self.np = t, h, order, NP[dtype]
        self.buf = np.zeros(self.geo.pool_bytes, np.uint8)
        if seed is not None:
            self.buf[:] = np.random.default_rng(seed).integers(0, 256, self.buf.size, dtype=np.uint8)
        agent.register(self.buf)
        agent.add_layout("kv", pdkv.KVLayout.contiguous(self.geo, self.buf))

    def blocks(self, buf=None):
        """A [layers, parts, blocks, tokens, heads, dim] view of `buf` (default: the pool)."""
        a = (self.buf if buf is None else buf).view(self.np)
        if self.order == "NHD":
            return a.reshape(LAYERS, 2, BLOCKS, self.t, self.h, D)
        return a.reshape(LAYERS, 2, BLOCKS, self.h, self.t, D).transpose(0, 1, 2, 4, 3, 5)

    def logical(self, ids):
        """[layers, parts, tokens, heads, dim] of blocks `ids`, in token order (a copy)."""
        return self.blocks()[:, :, ids].reshape(LAYERS, 2, len(ids) * self.t, self.h, D)


def check(src, sids, dst, dids, ntok, nh, sho, dho):
    """dst holds src's rows [:ntok, sho:sho + nh] at [:ntok, dho:dho + nh] of its blocks
    dids, and zeros everywhere else."""
    want = src.logical(sids)[:, :, :ntok, sho:sho + nh]
    assert want.any()
    expected = np.zeros_like(dst.buf)
    view = dst.blocks(expected)
    for i, blk in enumerate(dids):
        n = min(dst.t, ntok - i * dst.t)
        if n > 0:
            view[:, :, blk, :n, dho:dho + nh] = want[:, :, i * dst.t:i * dst.t + n]
    assert np.array_equal(dst.buf, expected)


def block_ids(ids, nl, nr):
    if ids == "consecutive":
        return list(range(2, 2 + nl)), list(range(1, 1 + nr))
    rng = np.random.default_rng(len(ids) + nl)
    return [int(x) for x in rng.permutation(BLOCKS)[:nl]], [int(x) for x in rng.permutation(BLOCKS)[:nr]]


def run_case(mode, op, dtype, lids, rids, ntok, *, seeds, tcp=None):
    """Moves rows [:ntok] of MODES[mode]'s heads between this side's blocks `lids` and
    the peer's `rids` over tcp (write: this side's pool seeded seeds[0]; read: the
    peer's seeded seeds[1]) and checks the destination bit-exact; returns (prepared,
    transfer)."""
    lt, lh, lo, rt, rh, ro, nh, lho, rho = MODES[mode]
    pull = op == "read"
    with pdkv.Agent("a", secret="s", transports=["tcp"], options=[tcp] if tcp else []) as a, \
            pdkv.Agent("b", secret="s", transports=["tcp"]) as b:
        local = KV(a, lt, lh, lo, dtype, None if pull else seeds[0])
        remote = KV(b, rt, rh, ro, dtype, seeds[1] if pull else None)
        peer = a.add_peer(b.metadata())
        plan = pdkv.PlanOptions(num_tokens=ntok, num_heads=nh, local_head_offset=lho, remote_head_offset=rho)
        prep = a.prepare(op, peer, pdkv.Blocks("kv", lids), pdkv.Blocks("kv", rids), plan=plan)
        x = prep.post()
        assert x.wait(30), x.error
        if pull:
            check(remote, rids, local, lids, ntok, nh, rho, lho)
        else:
            check(local, lids, remote, rids, ntok, nh, lho, rho)
        return prep, x


def run_bound(mode, nl, nr, nh):
    """At most one two-level run per block (x heads where both sides cut the rows): the
    one-level plan holds one per (layer, part, block) at least. Where both sides cut the
    rows, a plan this small stays per (layer, part) (each block's heads in one pass:
    kv_layout.cc kCheapPerSegmentRuns): one run per (layer, part, block) at most."""
    lo, ro = MODES[mode][2], MODES[mode][5]
    if lo != ro:
        return LAYERS * 2 * max(nl, nr)
    return max(nl, nr)


@pytest.mark.parametrize("ids", ["consecutive", "scattered"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("mode", list(MODES))
def test_two_level_transfers_are_bit_exact(mode, op, dtype, ids):
    lt, rt, nh = MODES[mode][0], MODES[mode][3], MODES[mode][6]
    ntok = 10 * 16 - 5  # a partial last block on both sides
    nl, nr = -(-ntok // lt), -(-ntok // rt)
    lids, rids = block_ids(ids, nl, nr)
    prep, x = run_case(mode, op, dtype, lids, rids, ntok, seeds=(5, 6))
    assert prep.num_extents <= run_bound(mode, nl, nr, nh), prep.num_extents
    assert x.bytes_done == prep.nbytes


@pytest.mark.parametrize("op", ["write", "read"])
def test_compressed_two_level_transfers_are_bit_exact(op):
    """kWriteZ carries two-level descriptors too, and a compressed read's response
    decodes into the repetitions: the codec walks the pieces listed from the runs."""
    from pdkv import codec

    z = pdkv.TcpCompression(mode="lossless", codec="zstd" if codec.available("zstd") else "raw", dtype="bfloat16",
                            chunk_bytes=16 * 1024)
    lt, lh, lo, rt, rh, ro, nh, lho, rho = MODES["tp2:tp4+nhd:hnd"]
    ids = list(range(3, 13))
    with pdkv.Agent("a", secret="s", transports=["tcp"], options=[pdkv.TcpOptions(compress=z)]) as a, \
            pdkv.Agent("b", secret="s", transports=["tcp"]) as b:
        pull = op == "read"
        local = KV(a, lt, lh, lo, "bfloat16", None if pull else 8)
        remote = KV(b, rt, rh, ro, "bfloat16", 9 if pull else None)
        peer = a.add_peer(b.metadata())
        x = a.prepare(op, peer, pdkv.Blocks("kv", ids), pdkv.Blocks("kv", ids),
                      plan=pdkv.PlanOptions(num_heads=nh, local_head_offset=lho, remote_head_offset=rho)).post()
        assert x.wait(20), x.error
        assert x.compression != ""
        if pull:
            check(remote, ids, local, ids, len(ids) * 16, nh, rho, lho)
        else:
            check(local, ids, remote, ids, len(ids) * 16, nh, lho, rho)


# ---------------------------------------------------------------- what the wire carries
HDR = struct.Struct("<IHHQIIQII")
F_STRIDED, F_STRIDED2 = 8, 32


class FrameRelay(Relay):
    """A TCP relay in front of an agent's tcp endpoint that records the (type, flags,
    count) of every frame the initiator sends through it."""

    def __init__(self, real_addr: str):
        host, port = real_addr.rsplit(":", 1)
        ls, self.addr = listen_like(real_addr)  # the blob's lengths hold
        self.frames: list[tuple[int, int, int]] = []
        self._parse: dict[int, tuple[bytes, int]] = {}  # per connection: header being read, bytes to pass
        super().__init__(ls, (host, int(port)))

    def observe(self, chunk: bytes, upstream: bool, conn) -> None:
        if not upstream:
            return
        head, skip = self._parse.get(id(conn), (b"", 0))
        data = chunk
        while data:  # recorded before it is passed on (and answered)
            if skip:
                n = min(skip, len(data))
                skip, data = skip - n, data[n:]
                continue
            take = HDR.size - len(head)
            head, data = head + data[:take], data[take:]
            if len(head) == HDR.size:
                _, ftype, flags, _, _, count, payload, aux, _ = HDR.unpack(head)
                desc = 56 if flags & F_STRIDED2 else 40 if flags & F_STRIDED else 24
                if ftype in (T_WRITE, T_READ_REQ):
                    self.frames.append((ftype, flags, count))
                head, skip = b"", count * desc + aux + payload
        self._parse[id(conn)] = (head, skip)


def with_features(blob: bytes, clear: int) -> bytes:
    """The metadata blob with feature bits `clear` off in its tcp extra (an older peer)."""
    extra = pdkv.decode_metadata(blob)["extras"]["tcp"]
    magic, features = struct.unpack_from("<II", extra)
    assert features & 8, "this pdkv publishes two-level extents"
    old = blob.replace(extra, struct.pack("<II", magic, features & ~clear) + extra[8:])
    assert old != blob
    return old


@pytest.mark.parametrize("peer_kind", ["two-level", "one-level (no bit 3)", "plain (no bits 1, 3)"])
def test_the_wire_carries_two_level_descriptors_only_to_peers_that_take_them(peer_kind):
    clear = {"two-level": 0, "one-level (no bit 3)": 8, "plain (no bits 1, 3)": 8 | 2}[peer_kind]
    lt, lh, lo, rt, rh, ro, nh, lho, rho = MODES["tp2:tp4+nhd:hnd"]
    ids = list(range(1, 21))
    ntok = 20 * 16 - 3
    with pdkv.Agent("a", secret="s", transports=["tcp"]) as a, pdkv.Agent("b", secret="s", transports=["tcp"]) as b:
        local = KV(a, lt, lh, lo, "bfloat16", 3)
        remote = KV(b, rt, rh, ro, "bfloat16")
        blob = b.metadata()
        real = b.address
        relay = FrameRelay(real)
        try:
            blob = blob.replace(real.encode(), relay.addr.encode())
            if clear:
                blob = with_features(blob, clear)
            peer = a.add_peer(blob)
            plan = pdkv.PlanOptions(num_tokens=ntok, num_heads=nh, local_head_offset=lho, remote_head_offset=rho)
            for op in ("write", "read"):
                prep = a.prepare(op, peer, pdkv.Blocks("kv", ids), pdkv.Blocks("kv", ids), plan=plan)
                x = prep.post()
                assert x.wait(20), x.error
            check(local, ids, remote, ids, ntok, nh, lho, rho)
            data = [f for f in relay.frames if f[0] in (T_WRITE, T_READ_REQ)]
            assert {f[0] for f in data} == {T_WRITE, T_READ_REQ}
            flags = {f[1] & (F_STRIDED | F_STRIDED2) for f in data}
            descriptors = sum(f[2] for f in data)
            if peer_kind == "two-level":
                assert flags == {F_STRIDED2}, relay.frames
                assert descriptors <= 2 * prep.num_extents + 2 * len(data), descriptors  # no expansion
            elif clear == 8:
                assert flags == {F_STRIDED}, relay.frames
                assert descriptors >= 2 * 2 * LAYERS * len(ids), descriptors  # one per repetition at least
            else:
                assert flags == {0}, relay.frames
        finally:
            relay.close()


# ---------------------------------------------------------------- a raw-socket initiator
S2 = struct.Struct("<QQQQQQQ")  # region, offset, len, count, stride, count2, stride2


def pieces_of(off, ln, n, st, n2, st2):
    return [off + j * st2 + i * st for j in range(n2) for i in range(n)], ln


def test_a_two_level_write_lands_its_pieces_and_a_read_returns_them(target):  # noqa: F811
    s = target["connect"]()
    rid = target["victim"].id
    runs = [(64, 4, 3, 16, 3, 5),      # repetitions interleaved in the inner gaps (NHD <-> HND)
            (1000, 3, 4, 5, 3, 32),    # repetitions one after another
            (4096, 8, 1, 0, 1, 0),     # a plain extent in the two-level form
            (5000, 16, 2, 16, 3, 40)]  # inner pieces touch
    total = sum(ln * n * n2 for _, ln, n, _, n2, _ in runs)
    payload = np.random.default_rng(5).integers(0, 256, total, dtype=np.uint8).tobytes()
    descs = b"".join(S2.pack(rid, *r) for r in runs)
    s.sendall(raw_header(T_WRITE, count=len(runs), payload=total, flags=F_STRIDED2) + descs + payload)
    h, _ = recv_frame(s)
    assert h[1] == T_ACK and h[8] == 0, h
    want = np.zeros(REGION, np.uint8)
    pos = 0
    for r in runs:
        offs, ln = pieces_of(*r)
        for o in offs:
            want[o:o + ln] = np.frombuffer(payload[pos:pos + ln], np.uint8)
            pos += ln
    assert np.array_equal(target["mem"][:REGION], want)
    s.sendall(raw_header(T_READ_REQ, count=len(runs), flags=F_STRIDED2, xfer=2) + descs)
    hdr = recv_exact(s, 40)
    assert struct.unpack_from("<H", hdr, 4)[0] == T_READ_RESP
    assert recv_exact(s, struct.unpack_from("<Q", hdr, 24)[0]) == payload
    assert target["serves"]()


HOSTILE = {  # name: ((offset, len, count, stride, count2, stride2), code, message)
    "repetitions-overlap": ((0, 4, 4, 8, 2, 16), "ProtocolError", "overlap"),
    "inner-pieces-overlap": ((0, 8, 2, 4, 2, 64), "ProtocolError", "overlap"),
    "repetitions-closer-than-a-piece": ((0, 4, 2, 64, 3, 2), "ProtocolError", "overlap"),
    "span-past-the-region": ((0, 256, 2, 512, REGION // 1024 + 1, 1024), "OutOfRange", "outside"),
    "first-piece-past-the-region": ((REGION, 16, 2, 16, 2, 64), "OutOfRange", "outside"),
    "offset-plus-span-wraps": ((U64 - 64, 8, 2, 8, 2, 32), "OutOfRange", "outside"),
    "count2-x-stride2-overflows": ((0, 1, 2, 1, 1 << 17, 1 << 50), "ProtocolError", "overflows"),
    "count-zero": ((0, 16, 0, 16, 2, 64), "ProtocolError", "count 0"),
    "count2-zero": ((0, 16, 2, 16, 0, 64), "ProtocolError", "count2 0"),
    "length-zero": ((0, 0, 2, 16, 2, 64), "ProtocolError", "length 0"),
    "pieces-exceed": ((0, 1, 1 << 10, 1, 1 << 9, 1 << 10), "ProtocolError", "pieces exceed"),
    "count-x-count2-wraps": ((0, 1, 1 << 40, 1, 1 << 40, 1), "ProtocolError", "pieces exceed"),
}


@pytest.mark.parametrize("op", [T_WRITE, T_READ_REQ], ids=["write", "read"])
@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_two_level_descriptors_are_refused(target, op, name):  # noqa: F811
    (offset, length, count, stride, count2, stride2), code, message = HOSTILE[name]
    s = target["connect"]()
    payload = 0
    if op == T_WRITE:  # a consistent frame where it can be: only the check named can refuse it
        payload = length * count * count2 if 0 < length * count * count2 < (1 << 30) else 16
    s.sendall(raw_header(op, count=1, payload=payload, flags=F_STRIDED2) +
              S2.pack(target["victim"].id, offset, length, count, stride, count2, stride2))
    expect_error_and_close(s, code, message)
    assert not target["mem"].any()
    assert target["serves"]()


def test_a_payload_that_does_not_match_the_repetitions_is_refused(target):  # noqa: F811
    s = target["connect"]()
    s.sendall(raw_header(T_WRITE, count=1, payload=100, flags=F_STRIDED2) +
              S2.pack(target["victim"].id, 0, 16, 2, 32, 2, 128) + b"\x01" * 100)
    expect_error_and_close(s, "ProtocolError", "two-level extents add up to 64")
    assert not target["mem"].any()
    assert target["serves"]()


def test_both_strided_flags_are_refused(target):  # noqa: F811
    s = target["connect"]()
    s.sendall(raw_header(T_WRITE, count=1, payload=64, flags=F_STRIDED | F_STRIDED2) +
              S2.pack(target["victim"].id, 0, 16, 2, 32, 2, 128) + b"\x01" * 64)
    expect_error_and_close(s, "ProtocolError", "both strided flags")
    assert not target["mem"].any()
    assert target["serves"]()


def test_too_many_pieces_across_two_level_descriptors_are_refused(target):  # noqa: F811
    """Each descriptor is within the limit (2^18 pieces), together they are not."""
    s = target["connect"]()
    rid = target["victim"].id
    one = S2.pack(rid, 0, 1, 1 << 9, 2, 1 << 8, 1 << 10)  # 2^17 pieces of 1 byte
    s.sendall(raw_header(T_READ_REQ, count=3, flags=F_STRIDED2) + one * 3)
    expect_error_and_close(s, "ProtocolError", "pieces exceed")
    assert not target["mem"].any()
    assert target["serves"]()


@pytest.mark.parametrize("batch_bytes", [100, 1000, 4096, 50_000])
@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("mode", ["tp2:tp4", "tp2:tp4+nhd:hnd", "hnd:nhd"])
def test_two_level_runs_cut_between_frames_are_bit_exact(mode, op, batch_bytes):
    """Frames of at most batch_bytes: a two-level run is cut at whole repetitions, a
    repetition larger than what is left of a frame at pieces, a piece larger than a
    frame inside it; the pieces land in order all the same (and many frames, on
    several connections, carry one transfer)."""
    lt, rt = MODES[mode][0], MODES[mode][3]
    ntok = 6 * 16 - 7
    nl, nr = -(-ntok // lt), -(-ntok // rt)
    lids, rids = block_ids("scattered", nl, nr)
    run_case(mode, op, "bfloat16", lids, rids, ntok, seeds=(11, 12), tcp=pdkv.TcpOptions(batch_bytes=batch_bytes))
