"""Compressed tcp writes of device memory (fp8 on the GPU, lossless staged), every
direction, checked against pdkv's host codec byte for byte.

Run as a script in a fresh process (the CUDA driver is loaded once per process):
``COMPRESS=fp8 DTYPE=bfloat16 python tests/library/cuda/compress_device_child.py``. It uses the
driver pdkv loads (``$PDKV_CUDA_DRIVER``, else ``libcuda.so.1``), so the same checks run
on the fake driver in CI (tests/library/cuda/test_compress_device.py) and on a GPU
(bench/gpu_check.sh). Prints one JSON line: {"checks": [...], "stats": ..., ...};
any mismatch raises (non-zero exit with the traceback).

What lands must be exactly what the host codec's round trip of the same bytes gives
(fp8: ``pdkv.codec.Codec("fp8")`` per frame; lossless: the bytes), and a GPU sender
must put as many bytes on the wire as a host sender of the same data.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

import pdkv
from pdkv.lab.transfer.devmem import DeviceMemory
from pdkv.codec import Codec

MEM = DeviceMemory()
LIB = MEM.lib
FAKE = hasattr(LIB, "fakecuda_fail_launches")
MODE = os.environ.get("COMPRESS", "fp8")  # fp8 | lossless | auto
DTYPE = os.environ.get("DTYPE", "bfloat16")
ESIZE = {"bfloat16": 2, "float16": 2, "float32": 4}[DTYPE]

# Odd on purpose: 3 kv heads x 40 dims (rows of 120 elements), 5-token blocks.
GEOM = pdkv.KVGeometry(num_layers=2, num_blocks=48, block_tokens=5, kv_heads=3, head_dim=40, dtype=DTYPE)
BB = GEOM.block_bytes
ROW = GEOM.kv_heads * GEOM.head_dim * ESIZE
CHECKSUM = os.environ.get("CHECKSUM", "0") == "1"  # XXH3 of each frame's codes + scales, verified on arrival
KERNELS = not os.environ.get("FAKECUDA_NO_KERNEL")
Z = pdkv.TcpCompression(mode=MODE, policy="lossy-allowed", dtype=DTYPE, fp8_heads=GEOM.kv_heads,
                        fp8_head_dim=GEOM.head_dim, fp8_rows_per_group=GEOM.block_tokens, chunk_bytes=8192,
                        checksum=CHECKSUM)
# CONNS=2: batches spread over two connections and progress threads, so several
# encoder and decode threads use the GPU codec at once.
CONNS = int(os.environ.get("CONNS", "1"))
TCP = pdkv.TcpOptions(stage_chunk_bytes=16384, stage_buffers=2, compress=Z, conns_per_peer=CONNS,
                      progress_threads=CONNS)


def kv_values(n_elems: int, seed: int) -> np.ndarray:
    """KV-like fp32 values with every special case of the format in them."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n_elems) * np.exp(rng.uniform(-6, 4, n_elems))).astype(np.float32)
    specials = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-40, -3e-39, 65504.0, 70000.0, 448.0,
                         -500.0, 2.0 ** -10, 1e30], np.float32)
    pos = rng.choice(n_elems, size=8 * len(specials), replace=False)
    x[pos] = np.tile(specials, 8)
    x[: GEOM.block_tokens * GEOM.kv_heads * GEOM.head_dim] = 0.0  # an all-zero block
    return x


def encode_dtype(x: np.ndarray) -> np.ndarray:
    """fp32 values -> the pool's bytes in DTYPE (bf16 by truncation: any bits will do)."""
    if DTYPE == "float32":
        return x.view(np.uint8)
    if DTYPE == "float16":
        with np.errstate(over="ignore"):
            return x.astype(np.float16).view(np.uint8)
    return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)


class Side:
    """An agent with a device pool and a host pool holding the same bytes."""

    def __init__(self, name: str, seed: int) -> None:
        self.agent = pdkv.Agent(name, secret="s", transports=["tcp"], options=[TCP])
        n = GEOM.pool_bytes
        self.dev = MEM.alloc(n)
        self.host = encode_dtype(kv_values(n // ESIZE, seed)).copy()
        MEM.htod(self.dev, self.host)
        self.rdev = self.agent.register_address(self.dev, n, kind="cuda", device=0)
        self.rhost = self.agent.register(self.host)
        self.agent.add_layout("dev", pdkv.KVLayout.contiguous(GEOM, self.dev))
        self.agent.add_layout("host", pdkv.KVLayout.contiguous(GEOM, self.host))

    def pool(self, which: str) -> np.ndarray:
        return MEM.dtoh(self.dev, GEOM.pool_bytes, np.uint8) if which == "dev" else self.host.copy()

    def region(self, which: str):
        return self.rdev if which == "dev" else self.rhost

    def reset(self, seed: int) -> None:
        self.host[:] = encode_dtype(kv_values(GEOM.pool_bytes // ESIZE, seed))
        MEM.htod(self.dev, self.host)


def round_trip(data: np.ndarray, rows_per_frame: int | None = None) -> np.ndarray:
    """What the host codec lands for `data` (whole frames of rows_per_frame rows)."""
    if MODE != "fp8":  # lossless; auto, which keeps device memory plain on a fake driver
        return data.copy()
    c = Codec("fp8", heads=GEOM.kv_heads, head_dim=GEOM.head_dim, rows_per_group=GEOM.block_tokens)
    step = (rows_per_frame or len(data) // ROW) * ROW
    out = [np.frombuffer(c.decode(c.encode(data[i:i + step].tobytes(), DTYPE), DTYPE), np.uint8)
           for i in range(0, len(data), step)]
    return np.concatenate(out)


def blocks(pool: np.ndarray, ids: list[int]) -> np.ndarray:
    return pool.reshape(GEOM.num_layers * GEOM.kv_parts, GEOM.num_blocks, BB)[:, ids, :].copy()


def failure(x: pdkv.Transfer) -> str:
    try:
        x.wait(30)
    except pdkv.PdkvError as e:
        return str(e)
    raise AssertionError("the transfer should have failed")


def kernel_launches() -> int:
    """FP8 kernel launches so far (all launches but the strided copies that staging does)."""
    if not FAKE:
        return 0
    from ctypes import c_ulonglong

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # tests/
    from fakecuda_lib import STATS

    arr = (c_ulonglong * len(STATS))()
    LIB.fakecuda_stats(arr, len(STATS))
    stats = dict(zip(STATS, arr))
    return int(stats["kernel_launches"] - stats["strided_launches"])


def main() -> None:
    a, b = Side("zdev-a", 1), Side("zdev-b", 2)
    peer = a.agent.connect(b.agent.address)
    checks: list[str] = []
    wire: dict[str, int] = {}
    lids = [5, 9, 10, 11, 40, 2, 47, 17, 18, 30, 31, 32, 1, 0, 44, 45, 46, 12]
    rids = [20, 3, 4, 5, 22, 21, 0, 7, 8, 9, 33, 34, 35, 36, 37, 38, 39, 47]
    # Every block's expected bytes: its own round trip (one scale group per block per head).
    want_blocks = np.stack([np.stack([round_trip(blk) for blk in part]) for part in blocks(a.pool("host"), lids)])

    def check_codec(x: pdkv.Transfer, what: str, device_side: bool) -> None:
        """The codec the transfer says it used: the mode's; auto keeps the device side
        (a write's source, a read's destination) plain on an emulated driver."""
        if MODE != "auto":
            assert x.compression in ("fp8", "zstd"), (what, x.compression)
        elif FAKE and device_side:
            assert x.compression == "", f"auto compressed device memory on an emulated driver ({what})"

    def write(src: str, dst: str) -> None:
        x = a.agent.write(peer, pdkv.Blocks(src, lids), pdkv.Blocks(dst, rids),
                          notify=src.encode() + b"->" + dst.encode())
        got = b.agent.wait_notifications(timeout=30)
        if not got:
            x.wait(0)
        assert np.array_equal(blocks(b.pool(dst), rids), want_blocks), f"{MODE} write {src}->{dst}: bytes differ"
        assert x.wait(30), x.error
        check_codec(x, f"write {src}->{dst}", device_side=src == "dev")
        wire[f"{src}->{dst}"] = x.wire_bytes
        b.reset(2)
        checks.append(f"write {src}->{dst}")

    launches0 = kernel_launches()
    for src, dst in (("dev", "dev"), ("dev", "host"), ("host", "dev"), ("host", "host")):
        write(src, dst)
    if MODE == "fp8":
        # A GPU sender puts the host codec's frames on the wire: the same byte count.
        assert wire["dev->dev"] == wire["dev->host"] == wire["host->dev"] == wire["host->host"], wire
    launched = kernel_launches() - launches0

    # Reads (a pulls b's blocks): the target encodes its device or host blocks as the
    # reader asked (fp8 quantized on the target's GPU, lossless gathered and encoded on
    # its host), the reader decodes into its device (fp8 on its GPU) or host blocks.
    want_read = np.stack([np.stack([round_trip(blk) for blk in part]) for part in blocks(b.pool("host"), rids)])

    def read(src: str, dst: str) -> None:
        x = a.agent.read(peer, pdkv.Blocks(dst, lids), pdkv.Blocks(src, rids))
        assert x.wait(30), x.error
        assert np.array_equal(blocks(a.pool(dst), lids), want_read), f"{MODE} read {src}->{dst}: bytes differ"
        check_codec(x, f"read {src}->{dst}", device_side=dst == "dev")
        wire[f"read {src}->{dst}"] = x.wire_bytes
        a.reset(1)
        checks.append(f"read {src}->{dst}")

    for src, dst in (("dev", "dev"), ("dev", "host"), ("host", "dev"), ("host", "host")):
        read(src, dst)

    # Single extents of odd sizes: partial last scale groups, starts mid-block, an
    # element-aligned but row-odd offset, and a byte-odd offset (the kernels cannot
    # take it: encoded on the host after staging, same frames).
    odd = [(3, 7), (1, 1), (2, 12), (7, 23), (4, 41)]
    for start_row, rows in odd:
        for off_extra in (0, ESIZE, 1):
            if off_extra == 1 and MODE != "fp8":
                continue
            src_off = start_row * ROW + off_extra
            dst_off = (start_row + 3) * ROW + off_extra
            n = rows * ROW
            data = a.pool("host")[src_off:src_off + n]
            for s_kind, d_kind in (("dev", "dev"), ("dev", "host"), ("host", "dev")):
                x = a.agent.prepare_extents("write", peer, [(a.region(s_kind).id, src_off, b.region(d_kind).id,
                                                              dst_off, n)]).post()
                assert x.wait(30), x.error
                got = b.pool(d_kind)[dst_off:dst_off + n]
                # Batches are codec chunks of whole scale groups: frames of that many rows.
                chunk_rows = (8192 // (ROW * GEOM.block_tokens)) * GEOM.block_tokens
                assert np.array_equal(got, round_trip(data, chunk_rows)), (start_row, rows, off_extra, s_kind, d_kind)
                b.reset(2)
    checks.append("odd extents")

    if FAKE and MODE == "fp8" and KERNELS:
        # A kernel that faults fails that transfer with the CUDA error, nothing else.
        LIB.fakecuda_fail_launches(1)  # the sender's quantize
        err = failure(a.agent.write(peer, pdkv.Blocks("dev", lids), pdkv.Blocks("dev", rids), notify=b"never"))
        assert "CUDA error 700" in err and "pdkv_fp8_quantize" in err, err
        assert b.agent.wait_notifications(timeout=0.3) == []
        write("dev", "dev")
        LIB.fakecuda_fail_launches(1)  # the receiver's dequantize
        err = failure(a.agent.write(peer, pdkv.Blocks("host", lids), pdkv.Blocks("dev", rids), notify=b"never"))
        assert "CUDA error 700" in err and "pdkv_fp8_dequantize" in err, err
        assert b.agent.wait_notifications(timeout=0.3) == []
        write("host", "dev")
        checks.append("launch failures")
    if FAKE and MODE == "lossless":
        LIB.fakecuda_fail_copies(1)  # the sender's gather
        err = failure(a.agent.write(peer, pdkv.Blocks("dev", lids), pdkv.Blocks("dev", rids), notify=b"never"))
        assert "CUDA error 700" in err, err
        write("dev", "dev")
        LIB.fakecuda_fail_copies(1)  # the receiver's copy into device memory
        err = failure(a.agent.write(peer, pdkv.Blocks("host", lids), pdkv.Blocks("dev", rids), notify=b"never"))
        assert "CUDA error 700" in err, err
        write("host", "dev")
        checks.append("copy failures")

    for s in (a, b):
        s.agent.close()
    if FAKE:
        # Closed agents leave no staging buffer, stream or event (the GPU codec's included).
        from ctypes import c_ulonglong

        arr = (c_ulonglong * 16)()
        LIB.fakecuda_stats(arr, 16)
        live = {"pinned": int(arr[12]), "streams": int(arr[13]), "events": int(arr[14]), "no_context": int(arr[9])}
        assert live == {"pinned": 0, "streams": 0, "events": 0, "no_context": 0}, live
    print(json.dumps({"checks": checks, "wire": wire, "kernel_launches": launched, "fake": FAKE}))


if __name__ == "__main__":
    main()
