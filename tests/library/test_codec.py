"""pdkv.codec: bit-exact lossless round trips, FP8 against a numpy reference, hostile frames."""

from __future__ import annotations

import struct

import numpy as np
import pytest

import pdkv
from pdkv import codec
from pdkv.codec import Codec

HEADER = 48
LOSSLESS = [k for k in ("raw", "zstd", "lz4") if codec.available(k)]
CHECKSUM = codec.checksum_available()


def kv_like(n: int, dtype=np.float16, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(n) * 1.5).astype(dtype)


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits, round to nearest even (NaN kept quiet)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), ((u >> 16) | 0x40).astype(np.uint16), r)


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


# ---- the FP8 reference: written from the e4m3 definition, independently of the C++ ----

def e4m3_values() -> np.ndarray:
    """Values of the non-negative finite e4m3fn codes 0..126 (127 is NaN)."""
    out = []
    for c in range(127):
        e, m = c >> 3, c & 7
        out.append(m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(out, dtype=np.float64)


E4M3 = e4m3_values()


def ref_e4m3(y: np.ndarray) -> np.ndarray:
    """Nearest e4m3 code, ties to the even code, saturating at 448; NaN -> 0x7F|sign."""
    a = np.abs(y.astype(np.float64))
    a = np.where(np.isinf(a), 448.0, np.minimum(a, 448.0))
    hi = np.clip(np.searchsorted(E4M3, np.nan_to_num(a), side="left"), 0, 126)
    lo = np.clip(hi - 1, 0, 126)
    d_lo, d_hi = np.abs(a - E4M3[lo]), np.abs(E4M3[hi] - a)
    code = np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(lo % 2 == 0, lo, hi)))
    code = code.astype(np.uint8) | np.where(np.signbit(y), 0x80, 0).astype(np.uint8)
    return np.where(np.isnan(y), (0x7F | np.where(np.signbit(y), 0x80, 0)).astype(np.uint8), code)


def ref_fp8(x32: np.ndarray, heads: int, head_dim: int, rows_per_group: int):
    """Scales (per row group x head) and codes of a float32 chunk [rows, heads, head_dim]."""
    x = x32.reshape(-1, heads, head_dim)
    rows = x.shape[0]
    scales, codes = [], np.zeros(x.shape, np.uint8)
    for r0 in range(0, rows, rows_per_group):
        for h in range(heads):
            g = x[r0 : r0 + rows_per_group, h, :]
            fin = np.abs(g[np.isfinite(g)])
            amax = np.float32(fin.max()) if fin.size else np.float32(0)
            with np.errstate(divide="ignore", over="ignore"):
                scale, inv = np.float32(amax / np.float32(448)), np.float32(np.float32(448) / amax)
            if not (scale > 0) or not np.isfinite(inv):
                scale = inv = np.float32(1)
            scales.append(scale)
            with np.errstate(over="ignore", invalid="ignore"):
                codes[r0 : r0 + rows_per_group, h, :] = ref_e4m3((g * inv).astype(np.float32))
    return np.array(scales, np.float32), codes.reshape(-1)


def split_fp8_frame(frame: bytes, n_scales: int):
    payload = frame[HEADER:]
    return np.frombuffer(payload[: 4 * n_scales], np.float32), np.frombuffer(payload[4 * n_scales :], np.uint8)


# ---- lossless ----

@pytest.mark.parametrize("kind", LOSSLESS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "uint8", "float64"])
@pytest.mark.parametrize("nbytes", [0, 1, 3, 7, 1001, 65537])
def test_lossless_round_trip_is_bit_exact(kind, dtype, nbytes):
    data = kv_like(nbytes // 2 + 1).tobytes()[:nbytes]
    c = Codec(kind, checksum=CHECKSUM)
    frame = c.encode(data, dtype=dtype)
    assert len(frame) <= c.max_frame_size(nbytes, dtype)
    assert len(frame) <= HEADER + nbytes  # incompressible chunks go out raw, never bigger
    assert c.decode(frame) == data
    out = bytearray(nbytes + 5)
    assert c.decode_into(frame, memoryview(out)[:nbytes]) == nbytes
    assert bytes(out[:nbytes]) == data and out[nbytes:] == b"\0" * 5
    assert codec.decode(frame) == data  # the codec is read from the header


@pytest.mark.skipif("zstd" not in LOSSLESS, reason="zstd not in this build")
def test_zstd_compresses_kv_like_bf16_and_not_random_bytes():
    kv = to_bf16_bits(kv_like(1 << 16, np.float32))
    frame = codec.encode(kv, "zstd", dtype="bfloat16")
    assert len(frame) < kv.nbytes * 0.9
    noise = np.random.default_rng(1).integers(0, 256, 1 << 16, dtype=np.uint8)
    raw = codec.encode(noise, "zstd", dtype="bfloat16")
    assert codec.peek_frame(raw)["codec"] == "raw" and len(raw) == noise.nbytes + HEADER


def test_torch_tensors_round_trip():
    torch = pytest.importorskip("torch")
    t = torch.randn(4, 8, 16).to(torch.bfloat16)
    kind = LOSSLESS[-1]
    c = Codec(kind)
    frame = c.encode(t)
    assert codec.peek_frame(frame)["dtype"] == "bfloat16"
    out = torch.empty_like(t)
    c.decode_into(frame, out)
    assert torch.equal(out.view(torch.int16), t.view(torch.int16))


# ---- FP8 ----

@pytest.mark.parametrize("src_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("heads,head_dim,rows_per_group,rows", [(1, 16, 4, 9), (3, 8, 16, 20), (2, 4, 1, 5)])
def test_fp8_matches_numpy_reference_exactly(src_dtype, heads, head_dim, rows_per_group, rows):
    rng = np.random.default_rng(heads * 100 + rows)
    x = rng.standard_normal((rows, heads, head_dim)).astype(np.float32)
    x *= np.array([1.0, 1e-3, 300.0])[:heads].reshape(1, heads, 1).astype(np.float32)  # heads differ in range
    x.reshape(-1)[::17] = 0.0
    if src_dtype == "bfloat16":
        src = to_bf16_bits(x)
        x = bf16_bits_to_f32(src)
    else:
        src = x.astype(src_dtype)
        x = src.astype(np.float32)
    c = Codec("fp8", heads=heads, head_dim=head_dim, rows_per_group=rows_per_group)
    frame = c.encode(src, dtype=src_dtype)
    want_scales, want_codes = ref_fp8(x, heads, head_dim, rows_per_group)
    scales, codes = split_fp8_frame(frame, want_scales.size)
    np.testing.assert_array_equal(scales, want_scales)
    np.testing.assert_array_equal(codes, want_codes)
    # Dequantized: value(code) * scale in float32, then the receiver's dtype.
    idx = np.repeat(np.arange(want_scales.size).reshape(-1, heads), rows_per_group, axis=0)[:rows]
    deq = (np.where(codes & 0x80, -1.0, 1.0) * E4M3[np.minimum(codes & 0x7F, 126)]).astype(np.float32)
    deq = (deq.reshape(rows, heads, head_dim) * want_scales[idx][:, :, None]).astype(np.float32).reshape(-1)
    got32 = np.frombuffer(c.decode(frame, "float32"), np.float32)
    np.testing.assert_array_equal(got32, deq)
    np.testing.assert_array_equal(np.frombuffer(c.decode(frame, "float16"), np.float16), deq.astype(np.float16))
    np.testing.assert_array_equal(np.frombuffer(c.decode(frame, "bfloat16"), np.uint16), to_bf16_bits(deq))
    # The error bound the format promises: half a step of e4m3 relative to each value
    # (2^-4), or half the group's subnormal step (scale * 2^-10) for tiny values.
    elem_scale = np.broadcast_to(want_scales[idx][:, :, None], (rows, heads, head_dim)).reshape(-1)
    x = x.reshape(-1)
    bound = np.maximum(np.abs(x) * 2.0**-4, elem_scale * 2.0**-10)
    assert np.all(np.abs(got32 - x) <= bound * 1.0001)


def test_fp8_non_finite_values():
    x = np.array([np.nan, np.inf, -np.inf, 2.0, -np.nan, 0.5, 0.0, -0.0], np.float32)
    c = Codec("fp8", head_dim=8)
    y = np.frombuffer(c.decode(c.encode(x), "float32"), np.float32)
    assert np.isnan(y[0]) and np.isnan(y[4])
    assert y[1] == pytest.approx(2.0) and y[2] == pytest.approx(-2.0)  # Inf saturates to the group max
    assert y[3] == pytest.approx(2.0) and y[5] == pytest.approx(0.5)
    assert y[6] == 0.0 and np.signbit(y[7])
    z = np.full(16, np.inf, np.float32)  # no finite value: scale 1, Inf -> 448
    assert np.all(np.frombuffer(Codec("fp8", head_dim=16).decode(Codec("fp8", head_dim=16).encode(z)), np.float32) == 448.0)


def test_fp8_rejects_partial_rows_and_non_float_input():
    c = Codec("fp8", heads=2, head_dim=4)
    with pytest.raises(pdkv.InvalidArgument, match="whole rows"):
        c.encode(np.zeros(6, np.float32))
    with pytest.raises(pdkv.InvalidArgument, match="int32"):
        c.encode(np.zeros(8, np.int32))
    with pytest.raises(pdkv.InvalidArgument, match="rows_per_group"):
        Codec("fp8", rows_per_group=0)


# ---- hostile frames ----

@pytest.fixture
def frame_and_codec():
    kind = "zstd" if "zstd" in LOSSLESS else LOSSLESS[-1]
    c = Codec(kind, checksum=CHECKSUM)
    data = kv_like(4096).tobytes()
    return c.encode(data, dtype="float16"), c, data


def test_truncated_frames_are_protocol_errors(frame_and_codec):
    frame, c, _ = frame_and_codec
    for n in list(range(0, 60)) + [len(frame) // 2, len(frame) - 1]:
        with pytest.raises(pdkv.ProtocolError):
            c.decode(frame[:n])
    with pytest.raises(pdkv.ProtocolError, match="header says"):
        c.decode(frame + b"\0")


@pytest.mark.parametrize(
    "offset,value,error,match",
    [
        (0, ord("X"), pdkv.ProtocolError, "magic"),
        (4, 2, pdkv.VersionMismatch, "version"),
        (5, 9, pdkv.ProtocolError, "unknown codec"),
        (6, 99, pdkv.ProtocolError, "unknown dtype"),
        (7, 4, pdkv.ProtocolError, "flags"),
        (15, 0x40, pdkv.ProtocolError, "raw_len"),
        (23, 0x40, pdkv.ProtocolError, "payload_len"),
        (36, 1, pdkv.ProtocolError, "reserved"),
    ],
)
def test_corrupted_header_fields_are_named(frame_and_codec, offset, value, error, match):
    frame, c, _ = frame_and_codec
    bad = bytearray(frame)
    bad[offset] = value
    with pytest.raises(error, match=match):
        c.decode(bytes(bad))


def test_decode_into_checks_the_destination(frame_and_codec):
    frame, c, data = frame_and_codec
    with pytest.raises(pdkv.OutOfRange, match="destination holds 10"):
        c.decode_into(frame, bytearray(10), "float16")
    with pytest.raises(pdkv.InvalidArgument, match="decodes only into float16"):
        c.decode(frame, "float32")


@pytest.mark.skipif(not CHECKSUM, reason="xxHash not in this build")
def test_checksum_mismatch_is_data_corrupted():
    data = kv_like(4096).tobytes()
    for kind in LOSSLESS + ["fp8"]:
        c = Codec(kind, checksum=True, head_dim=8)
        frame = bytearray(c.encode(data, dtype="float16"))
        frame[40] ^= 0x01  # the stored checksum
        with pytest.raises(pdkv.DataCorrupted, match="checksum"):
            c.decode(bytes(frame))
    raw = bytearray(Codec("raw", checksum=True).encode(data))
    raw[HEADER + 100] ^= 0x04  # one payload bit
    with pytest.raises(pdkv.DataCorrupted):
        Codec("raw").decode(bytes(raw))


def test_unknown_codec_and_availability():
    with pytest.raises(pdkv.InvalidArgument, match="unknown codec"):
        Codec("brotli")
    assert codec.available("raw") and codec.available("fp8")
    for k in ("zstd", "lz4"):
        if not codec.available(k):
            with pytest.raises(pdkv.NotSupported, match="not in this build"):
                Codec(k)


def test_header_layout_is_documented():
    frame = Codec("raw").encode(b"abc")
    magic, version, kind, dtype, flags, raw_len, payload_len = struct.unpack_from("<4sBBBBQQ", frame)
    assert (magic, version, kind, flags, raw_len, payload_len) == (b"PKVC", 1, 0, 0, 3, 3)
    assert codec.peek_frame(frame)["frame_len"] == HEADER + 3
