"""Writes the seed corpus of fuzz/targets/tcp_frame_fuzz.cc into fuzz/corpus/tcp_frame/.

Each seed: one state byte (fuzz target: 0 inbound before hello, 1 inbound open,
2 outbound handshake, 3 outbound open, 4 outbound awaiting metadata), then frames.
"""

import os
import struct

HDR = struct.Struct("<IHHQIIQII")
EXT = struct.Struct("<QQQ")
SEXT = struct.Struct("<QQQQQ")  # strided extent (flag 8): region, offset, len, count, stride
S2 = struct.Struct("<QQQQQQQ")  # two-level extent (flag 32): ... count2, stride2
MAGIC = 0x464B4450


def frame(t, *, count=0, payload=0, aux=b"", flags=0, status=0, xfer=1, batch=0, aux_len=None):
    n = len(aux) if aux_len is None else aux_len
    return HDR.pack(MAGIC, t, flags, xfer, batch, count, payload, n, status) + aux


def s32(b):
    return struct.pack("<I", len(b)) + b


# The handshake (wire v2): hello {nonce, key}; challenge; proof and hello-ack are one MAC each.
HELLO = struct.pack("<HHIQ", 2, 0, 0, 0) + s32(b"init") + s32(b"target") + b"\x11" * 32 + b"\x22" * 32
CHALLENGE = struct.pack("<Q", 7) + s32(b"target") + b"\x33" * 32 + b"\x44" * 32
MAC = b"\x55" * 32
ACK = MAC
# Block generations (flag 4): u32 length, then the claim (name, count, (block, gen) pairs).
CLAIM = s32(b"kv") + struct.pack("<I", 2) + struct.pack("<IIII", 3, 1, 4, 2)
GENS = s32(CLAIM)


def codec_frame(data, *, codec=0, dtype=6, raw_len=None, payload_len=None):
    """A pdkv codec frame (docs/compression.md): 48-byte header, then the payload (raw here)."""
    raw = len(data) if raw_len is None else raw_len
    pay = len(data) if payload_len is None else payload_len
    return b"PKVC" + struct.pack("<BBBBQQIIIIQ", 1, codec, dtype, 0, raw, pay, 0, 0, 0, 0, 0) + data


Z1 = codec_frame(b"abcd") + codec_frame(b"efghijkl")


def zstd_zeros(n):
    """A zstd frame of n zero bytes made of RLE blocks (4 bytes per 128 KiB): a compression bomb."""
    out = bytearray(struct.pack("<IB", 0xFD2FB528, 0xE0) + struct.pack("<Q", n))
    left = n
    while left:
        k = min(128 << 10, left)
        left -= k
        out += (int(left == 0) | 2 | (k << 3)).to_bytes(3, "little") + b"\0"
    return bytes(out)


# Compression bombs over repeated extents (issue 26): 1 MiB from a few bytes into 64
# copies of the same 16 KiB (decoded), and 128 MiB over 4,096 copies of 32 KiB (refused
# by the extents' 64 MiB bound before any decoding).
BOMB_1M = codec_frame(zstd_zeros(1 << 20), codec=1, dtype=2, raw_len=1 << 20)
BOMB_128M = codec_frame(zstd_zeros(128 << 20), codec=1, dtype=2, raw_len=128 << 20)
SEEDS = {
    # Compressed writes (type 11): two raw codec frames into two extents, then frames
    # that lie about their sizes (raw_len past the extents, payload_len past the frame).
    "writez_two_frames": bytes([1]) + frame(11, count=2, payload=len(Z1)) + EXT.pack(1, 0, 4) + EXT.pack(1, 64, 8) + Z1,
    "writez_raw_len_too_big": bytes([1]) + frame(11, count=1, payload=52) + EXT.pack(1, 0, 4)
    + codec_frame(b"abcd", raw_len=4096, payload_len=4),
    "writez_bomb_repeated_extents": bytes([1]) + frame(11, count=64, payload=len(BOMB_1M))
    + EXT.pack(1, 0, 16 << 10) * 64 + BOMB_1M,
    "writez_bomb_128mib": bytes([1]) + frame(11, count=4096, payload=len(BOMB_128M))
    + EXT.pack(1, 0, 32 << 10) * 4096 + BOMB_128M,
    "writez_short": bytes([1]) + frame(11, count=1, payload=60) + EXT.pack(1, 0, 4) + codec_frame(b"abcd", payload_len=16),

    "write_gens_notif": bytes([1]) + frame(5, count=1, payload=4, flags=5, aux_len=len(GENS) + 4)[:40] + EXT.pack(1, 0, 4)
    + GENS + b"note" + b"abcd",
    "read_gens": bytes([1]) + frame(6, count=1, flags=4, aux_len=len(GENS))[:40] + EXT.pack(1, 0, 8) + GENS,
    "ack_failed_with_message": bytes([3]) + frame(8, status=15, aux=b"layout 'kv' block 3: stale"),
    "hello_then_write": bytes([0]) + frame(1, aux=HELLO) + frame(14, aux=MAC) + frame(5, count=1, payload=8) + EXT.pack(1, 0, 8) + b"x" * 8,
    "hello_then_read": bytes([0]) + frame(1, aux=HELLO) + frame(14, aux=MAC) + frame(6, count=2) + EXT.pack(1, 0, 8) + EXT.pack(1, 64, 8),
    "write_notif": bytes([1]) + frame(5, count=1, payload=4, flags=1, aux=b"note") + EXT.pack(1, 0, 4) + b"abcd",
    "notify_meta": bytes([1]) + frame(9, aux=b"ready") + frame(3),
    "overflow_extent": bytes([1]) + frame(6, count=2) + EXT.pack(1, 2**64 - 8, 16) + EXT.pack(1, 0, 2**64 - 1),
    "huge_error": bytes([3]) + frame(10, count=1 << 24, aux=b"x", status=6),
    "ack_readresp": bytes([3]) + frame(8, status=0) + frame(7, payload=4) + b"data",
    "handshake_ack": bytes([2]) + frame(13, aux=CHALLENGE) + frame(2, aux=ACK),
    "proof_before_hello": bytes([0]) + frame(14, aux=MAC),
    "meta_resp": bytes([4]) + frame(4, aux=b"\x01" * 32),
    "garbage": bytes([1]) + b"GET / HTTP/1.1\r\n\r\n" + b"\0" * 40,
    # A frame of many small pieces (what a sender gathers), then one whose pieces do
    # not add up to its payload.
    "write_small_pieces": bytes([1]) + frame(5, count=300, payload=300 * 16)
    + b"".join(EXT.pack(1, i * 32, 16) for i in range(300)) + bytes(range(256)) * 18 + b"x" * 192,
    "write_small_pieces_bad_sum": bytes([1]) + frame(5, count=64, payload=64 * 16 + 1)
    + b"".join(EXT.pack(1, i * 32, 16) for i in range(64)),
    # Strided descriptors (flag 8): a write of 2 runs (16 x 32 B every 128 B, 4 x 64 B
    # touching), a pull of one run, then hostile ones: count 0, a stride shorter than the
    # pieces, count x stride past 2^64, a last piece past the region, too many pieces.
    "write_strided": bytes([1]) + frame(5, count=2, payload=16 * 32 + 256, flags=8)
    + SEXT.pack(1, 0, 32, 16, 128) + SEXT.pack(1, 4096, 64, 4, 64) + bytes(range(256)) * 3,
    "read_strided_gens": bytes([1]) + frame(6, count=1, flags=12, aux_len=len(GENS))[:40]
    + SEXT.pack(1, 64, 512, 8, 2048) + GENS,
    "strided_count_zero": bytes([1]) + frame(6, count=1, flags=8) + SEXT.pack(1, 0, 32, 0, 64),
    "strided_overlap": bytes([1]) + frame(6, count=1, flags=8) + SEXT.pack(1, 0, 64, 4, 32),
    "strided_overflow": bytes([1]) + frame(6, count=1, flags=8) + SEXT.pack(1, 0, 8, 2**63, 2**4),
    "strided_last_piece_out": bytes([1]) + frame(6, count=1, flags=8) + SEXT.pack(1, 0, 256, 8192, 256),
    "strided_too_many_pieces": bytes([1]) + frame(6, count=2, flags=8) + SEXT.pack(1, 0, 1, 1 << 17, 1)
    + SEXT.pack(1, 0, 1, (1 << 17) + 1, 1),
    # Two-level descriptors (flag 32): a write of an interleaved run (4 B x 3 at 16, x 3
    # at 5: NHD <-> HND) and one with repetitions apart (3 B x 4 at 5, x 3 at 32), a
    # compressed write and a pull with one, then hostile ones: overlapping repetitions,
    # count2 0, count2 x stride2 past 2^64, a span past the region, too many pieces,
    # both strided flags.
    "write_two_level": bytes([1]) + frame(5, count=2, payload=36 + 36, flags=32)
    + S2.pack(1, 64, 4, 3, 16, 3, 5) + S2.pack(1, 1000, 3, 4, 5, 3, 32) + bytes(range(72)),
    "writez_two_level": bytes([1]) + frame(11, count=1, payload=len(codec_frame(b"a" * 24)), flags=32)
    + S2.pack(1, 0, 4, 2, 32, 3, 8) + codec_frame(b"a" * 24),
    "read_two_level_gens": bytes([1]) + frame(6, count=1, flags=36, aux_len=len(GENS))[:40]
    + S2.pack(1, 0, 256, 4, 1024, 2, 256) + GENS,
    "two_level_overlap": bytes([1]) + frame(6, count=1, flags=32) + S2.pack(1, 0, 4, 4, 8, 2, 16),
    "two_level_count2_zero": bytes([1]) + frame(6, count=1, flags=32) + S2.pack(1, 0, 4, 2, 8, 0, 64),
    "two_level_overflow": bytes([1]) + frame(6, count=1, flags=32) + S2.pack(1, 0, 1, 2, 1, 1 << 17, 1 << 50),
    "two_level_span_out": bytes([1]) + frame(6, count=1, flags=32) + S2.pack(1, 0, 256, 2, 512, 1 << 12, 1024),
    "two_level_too_many_pieces": bytes([1]) + frame(6, count=1, flags=32) + S2.pack(1, 0, 1, 1 << 10, 1, 1 << 9, 1 << 10),
    "two_level_both_flags": bytes([1]) + frame(5, count=1, payload=16, flags=40) + S2.pack(1, 0, 4, 2, 8, 2, 64),
}

if __name__ == "__main__":
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tcp_frame")
    os.makedirs(out, exist_ok=True)
    for name, data in SEEDS.items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
