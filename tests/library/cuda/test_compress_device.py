"""Compressed tcp writes of device memory on the fake CUDA driver (issue 16).

fp8: the sender quantizes on the GPU (pdkv_fp8_quantize) and the receiver dequantizes
there (pdkv_fp8_dequantize); the fake driver emulates both kernels from the rules in
docs/compression.md, independently of pdkv's host codec, and what lands is compared
with the host codec's round trip of the same bytes, so the kernels' host side
(descriptor tables, frame layout, headers, checksums) and the format agree. Lossless:
staged, encoded and decoded on the host. The checks live in
tests/library/cuda/compress_device_child.py (a fresh process per run: the driver is loaded
once per process); bench/gpu_check.sh runs the same script on a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(HERE, "compress_device_child.py")

WRITES = ["write dev->dev", "write dev->host", "write host->dev", "write host->host"]
# Compressed reads of device memory: the target encodes from its GPU (fp8 quantized
# there), the reader decodes into its GPU (fp8 dequantized there).
READS = ["read dev->dev", "read dev->host", "read host->dev", "read host->host"]
ALL_DIRECTIONS = WRITES + READS + ["odd extents"]


def run_child(driver: str, **env) -> dict:
    e = dict(os.environ, PDKV_CUDA_DRIVER=driver, PDKV_LOG="error", FAKECUDA_COPY_DELAY_US="50",
             PYTHONPATH=os.pathsep.join([HERE] + [p for p in [os.environ.get("PYTHONPATH")] if p]), **env)
    r = subprocess.run([sys.executable, CHILD], env=e, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype,conns", [("bfloat16", "1"), ("float16", "1"), ("float32", "1"), ("bfloat16", "2")])
def test_fp8_of_device_memory_lands_the_host_codecs_round_trip(fakecuda_path, dtype, conns):
    out = run_child(fakecuda_path, COMPRESS="fp8", DTYPE=dtype, CHECKSUM="1" if dtype == "float16" else "0",
                    CONNS=conns)
    assert out["fake"]
    assert out["checks"] == ALL_DIRECTIONS + ["write dev->dev", "write host->dev", "launch failures"]
    # Same frames as a host sender (and target): the same bytes on the wire in every
    # direction of a write and of a read (fp8 batches are whole scale groups either way).
    assert len(set(out["wire"].values())) == 1, out["wire"]
    # The GPU did the (de)quantizing: dev->dev (2 launches per batch), dev->host, host->dev.
    assert out["kernel_launches"] > 0


def test_fp8_without_kernels_runs_on_the_host_with_the_same_frames(fakecuda_path):
    # FAKECUDA_NO_KERNEL: the fatbin has no code for this "GPU"; staged and encoded on
    # the host, decoded on the host and copied in: the same bytes land.
    out = run_child(fakecuda_path, COMPRESS="fp8", DTYPE="bfloat16", FAKECUDA_NO_KERNEL="1")
    assert out["checks"] == ALL_DIRECTIONS
    assert out["kernel_launches"] == 0
    assert len(set(out["wire"].values())) == 1, out["wire"]


def test_lossless_of_device_memory_is_bit_exact(fakecuda_path):
    out = run_child(fakecuda_path, COMPRESS="lossless", DTYPE="bfloat16")
    assert out["checks"] == ALL_DIRECTIONS + ["write dev->dev", "write host->dev", "copy failures"]
    assert out["kernel_launches"] == 0
    # A GPU end encodes and decodes the host codec's frames: the same bytes on the wire
    # in every direction of a write, and of a read (reads are cut apart from writes).
    wire = out["wire"]
    for reads in (False, True):
        assert len({v for k, v in wire.items() if k.startswith("read ") == reads}) == 1, wire


def test_auto_keeps_device_memory_plain_on_an_emulated_driver(fakecuda_path):
    # auto models the GPU codec as fast only on real hardware (docs/compression.md).
    out = run_child(fakecuda_path, COMPRESS="auto", DTYPE="bfloat16")
    assert out["checks"] == ALL_DIRECTIONS
    assert out["kernel_launches"] == 0


def test_compressed_write_into_device_memory_needs_a_cuda_driver():
    # This process has no CUDA driver: the receiver refuses a compressed write into its
    # device region as it refuses a plain one, and nothing lands.
    import ctypes

    import pdkv

    if "cuda_ipc" in pdkv.available_transports() or os.environ.get("PDKV_CUDA_DRIVER"):
        pytest.skip("a CUDA driver is loaded in this process")
    buf = bytearray(1 << 16)
    addr = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
    z = pdkv.TcpCompression(mode="fp8", fp8_heads=1, fp8_head_dim=64, fp8_rows_per_group=16)
    with pdkv.Agent("a", secret="s", transports=["tcp"], options=[pdkv.TcpOptions(compress=z)]) as a, \
            pdkv.Agent("b", secret="s", transports=["tcp"]) as b:
        src = a.register(bytearray(b"\x3f\x80" * 4096))
        r = b.register_address(addr, len(buf), kind="cuda", device=0, keepalive=buf)
        x = a.prepare_extents("write", a.connect(b.address), [(src.id, 0, r.id, 0, 8192)]).post()
        with pytest.raises(pdkv.NotSupported, match="compressed write into device memory.*CUDA driver"):
            x.wait(10)
        assert not any(buf), "nothing may land in a device region that cannot be staged"
        r.close()
