"""The codecs' kernel paths (pdkv.codec.set_kernels: scalar reference, compiler-vectorised,
AVX2) give byte-identical frames and decoded bytes: every FP8 source and destination
dtype, special values (NaN, infinities, subnormals, signed zeros, values past 448 after
scaling), odd lengths and unaligned buffers, and the byte planes of the lossless codecs.
"""

from __future__ import annotations

import numpy as np
import pytest

from pdkv import codec
from pdkv.codec import Codec

PATHS = codec.kernels_available()
FAST = [p for p in PATHS if p != "scalar"]
LOSSLESS = [k for k in ("zstd", "lz4") if codec.available(k)]
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}


@pytest.fixture(autouse=True)
def restore_kernels():
    before = codec.kernels()
    yield
    codec.set_kernels(before)


def special_values(dtype: str, n: int, seed: int) -> np.ndarray:
    """n elements of `dtype` as raw bytes: normal KV-like values with every kind of
    special value sprinkled in, and some groups made only of tiny or zero values."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * rng.choice([1e-6, 1e-3, 1.0, 30.0, 5e4], n)).astype(np.float32)
    specials = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -1e-45, 6e4, -7e4, 3e38,
                         2.0 ** -14, 2.0 ** -24, 5.9e-8, 65504.0, 65520.0], np.float32)
    where = rng.choice(n, n // 8, replace=False)
    x[where] = rng.choice(specials, where.size)
    x[: min(n, 64)] = 0.0  # an all-zero group
    if n > 256:
        x[64:128] = 1e-42  # an underflowing group
    if dtype == "bfloat16":
        bits = x.view(np.uint32)
        raw = (bits >> 16).astype(np.uint16)
        raw[rng.choice(n, n // 16)] ^= rng.integers(0, 2, n // 16, dtype=np.uint16)  # odd low bits too
        return raw.view(np.uint8)
    if dtype == "float16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16).view(np.uint8)
    return x.view(np.uint8)


def unaligned(data: np.ndarray, shift: int) -> np.ndarray:
    """The same bytes starting `shift` bytes past an aligned address."""
    buf = np.zeros(data.size + 64, np.uint8)
    base = (-buf.ctypes.data) % 64 + shift
    out = buf[base: base + data.size]
    out[:] = data
    return out


def each_path(fn):
    """fn() under every kernel path, the scalar reference first."""
    results = {}
    for path in PATHS:
        codec.set_kernels(path)
        results[path] = fn()
    return results


def test_paths_are_listed_and_switchable():
    assert PATHS[:2] == ["scalar", "vector"]
    assert codec.kernels() in PATHS
    with pytest.raises(Exception, match="unknown codec kernels"):
        codec.set_kernels("sse9")


@pytest.mark.parametrize("src_dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("dst_dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("geometry", [(1, 64, 16), (8, 64, 16), (3, 7, 5), (2, 128, 1), (1, 1, 3)])
def test_fp8_paths_are_bit_identical(src_dtype, dst_dtype, geometry):
    heads, head_dim, rows_per_group = geometry
    rows = 37  # the last row group is shorter
    n = rows * heads * head_dim
    data = special_values(src_dtype, n, seed=heads * 1000 + head_dim + rows_per_group)
    for shift in (0, 1, 3):
        src = unaligned(data, shift)

        def round_trip():
            c = Codec("fp8", heads=heads, head_dim=head_dim, rows_per_group=rows_per_group)
            frame = c.encode(src, src_dtype)
            out = unaligned(np.zeros(n * ITEMSIZE[dst_dtype], np.uint8), shift)
            assert c.decode_into(frame, out, dst_dtype) == out.size
            return frame, out.tobytes()

        results = each_path(round_trip)
        ref_frame, ref_out = results["scalar"]
        for path in FAST:
            frame, out = results[path]
            assert frame == ref_frame, (path, shift, "frame")
            assert out == ref_out, (path, shift, "decoded")


@pytest.mark.parametrize("kind", LOSSLESS)
@pytest.mark.parametrize("dtype", ["uint8", "bfloat16", "float16", "float32", "int64"])
@pytest.mark.parametrize("length", [0, 1, 2, 3, 4095, 4097, 65536 + 7])
def test_byte_plane_paths_are_bit_identical(kind, dtype, length):
    rng = np.random.default_rng(length)
    data = (rng.standard_normal(length // 2 + 1) * 3).astype(np.float16).view(np.uint8)[:length].copy()
    for shift in (0, 1, 5):
        src = unaligned(data, shift)

        def round_trip():
            c = Codec(kind)
            frame = c.encode(src, dtype)
            return frame, c.decode(frame, dtype)

        results = each_path(round_trip)
        ref_frame, ref_out = results["scalar"]
        assert ref_out == data.tobytes()
        for path in FAST:
            assert results[path] == (ref_frame, ref_out), (path, shift)


def test_fp8_throughput_reports_cpu_time():
    data = special_values("bfloat16", 8 * 64 * 16 * 8, seed=1)
    t = Codec("fp8", heads=8, head_dim=64, rows_per_group=16).throughput(data, "bfloat16", repeats=2)
    assert t["raw_bytes"] == data.size
    assert t["encode_cpu_s"] > 0 and t["decode_cpu_s"] > 0
