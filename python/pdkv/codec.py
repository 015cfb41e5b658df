"""KV chunk codecs: lossless (byte planes + zstd or LZ4) and lossy FP8 (e4m3).

The codecs run in the C++ core (``cpp/src/codec``); this module is their Python
surface for tests, tooling and benchmarks. One call encodes one chunk into one
self-describing frame; decoding checks the frame as untrusted input (a malformed frame
raises :class:`pdkv.ProtocolError`, a checksum mismatch :class:`pdkv.DataCorrupted`).

>>> import numpy as np
>>> from pdkv.codec import Codec
>>> kv = (np.arange(4096, dtype=np.float16) % 7).astype(np.float16)
>>> c = Codec("lz4" if available("lz4") else "raw")
>>> frame = c.encode(kv)
>>> bytes(c.decode(frame)) == kv.tobytes()
True

Codecs: ``raw`` (no compression; useful with ``checksum=True``), ``zstd`` and ``lz4``
(bit-exact), ``fp8`` (lossy: one fp32 scale per ``rows_per_group`` rows of one head,
dequantized into ``bfloat16``, ``float16`` or ``float32``). docs/compression.md has
the frame format, the exact FP8 rounding and the measured ratios on real KV.
"""

from __future__ import annotations

from typing import Any

from . import _native
from .errors import InvalidArgument

__all__ = ["Codec", "available", "checksum_available", "peek_frame", "encode", "decode", "dtype_of",
           "kernels", "kernels_available", "set_kernels"]

CODECS = ("raw", "zstd", "lz4", "fp8")


def available(kind: str) -> bool:
    """Whether this build has codec ``kind`` (zstd/lz4 need their library at build time)."""
    return bool(_native.module().codec_available(kind))


def checksum_available() -> bool:
    """Whether this build can checksum frames (XXH3-64 from libxxhash)."""
    return bool(_native.module().codec_checksum_available())


def kernels() -> str:
    """Which implementation runs the codecs' element loops now: ``"avx2"``, ``"vector"``
    (compiler-vectorised for the build's baseline ISA) or ``"scalar"`` (the reference).
    All give bit-identical frames and decoded bytes; the default is the fastest this
    CPU runs."""
    return str(_native.module().codec_kernels())


def kernels_available() -> list[str]:
    """The kernel paths this process can run (``"scalar"`` and ``"vector"`` always)."""
    return list(_native.module().codec_kernels_available())


def set_kernels(name: str) -> None:
    """Switches the kernel path process-wide (for tests and benchmarks that compare them).

    Raises
    ------
    InvalidArgument
        An unknown name.
    NotSupported
        ``"avx2"`` on a CPU (or build) without AVX2.
    """
    _native.module().set_codec_kernels(name)


def peek_frame(frame: Any) -> dict:
    """The validated header of ``frame``: codec, dtype, checksum, raw_len, payload_len,
    frame_len (and the FP8 grouping for fp8 frames)."""
    return dict(_native.module().codec_peek_frame(frame))


def dtype_of(data: Any, dtype: str | None = None) -> str:
    """The pdkv dtype name of ``data`` (numpy array or torch tensor) or ``dtype`` if given.
    numpy has no bfloat16: pass ``dtype="bfloat16"`` with its raw bytes (or a torch tensor)."""
    if dtype is not None:
        return dtype
    dt = getattr(data, "dtype", None)
    if dt is None:
        return "uint8"
    name = str(dt).replace("torch.", "")
    return {"half": "float16", "float": "float32"}.get(name, name)


def _as_buffer(data: Any) -> Any:
    """A buffer-protocol view of ``data`` (torch tensors via their CPU numpy view)."""
    torch = __import__("sys").modules.get("torch")
    if torch is not None and isinstance(data, torch.Tensor):
        if data.device.type != "cpu":
            raise InvalidArgument("pdkv.codec works on host memory; move the tensor to the CPU first")
        return data.contiguous().reshape(-1).view(torch.uint8).numpy()
    return data


class Codec:
    """One codec with reusable contexts (not thread-safe: one per thread).

    Parameters
    ----------
    kind : {"raw", "zstd", "lz4", "fp8"}
    level : int
        zstd level (1 = fast; negative = faster). Ignored by the others.
    checksum : bool
        Append an XXH3-64 of the uncompressed bytes (fp8: of codes and scales); the
        decoder verifies it and raises :class:`pdkv.DataCorrupted` on mismatch.
    heads, head_dim, rows_per_group : int
        FP8 grouping: the chunk is rows of ``heads x head_dim`` elements; one scale per
        ``rows_per_group`` rows of one head (per-block-per-head: rows_per_group = tokens
        per block; NHD blocks: heads = kv heads; HND or single-head chunks: heads = 1).
    """

    def __init__(
        self,
        kind: str = "zstd",
        *,
        level: int = 1,
        checksum: bool = False,
        heads: int = 1,
        head_dim: int = 1,
        rows_per_group: int = 128,
    ) -> None:
        if kind not in CODECS:
            raise InvalidArgument(f"unknown codec {kind!r} (expected one of {', '.join(CODECS)})")
        self._c = _native.module().Codec(kind, level, checksum, heads, head_dim, rows_per_group)
        self.kind = kind

    def encode(self, data: Any, dtype: str | None = None) -> bytes:
        """Encodes one C-contiguous host chunk (numpy array, torch CPU tensor, bytes) into a frame.

        ``dtype`` defaults to the array's dtype (``uint8`` for plain bytes)."""
        return self._c.encode(_as_buffer(data), dtype_of(data, dtype))

    def decode(self, frame: Any, dtype: str | None = None) -> bytes:
        """Decodes one frame into new bytes of ``dtype`` (default: the frame's dtype;
        fp8 frames may name bfloat16, float16 or float32)."""
        return self._c.decode(frame, dtype or "")

    def decode_into(self, frame: Any, out: Any, dtype: str | None = None) -> int:
        """Decodes one frame into the writable buffer ``out``; returns the bytes written.

        ``dtype`` defaults to ``out``'s dtype, or the frame's for a plain byte buffer."""
        if dtype is None:
            dtype = dtype_of(out) if hasattr(out, "dtype") else peek_frame(frame)["dtype"]
        return int(self._c.decode_into(frame, _as_buffer(out), dtype))

    def max_frame_size(self, nbytes: int, dtype: str) -> int:
        """Upper bound of the frame size for a chunk of ``nbytes`` bytes of ``dtype``."""
        return int(self._c.max_frame_size(nbytes, dtype))

    def throughput(self, data: Any, dtype: str | None = None, out_dtype: str | None = None,
                   repeats: int = 3) -> dict:
        """Seconds per encode and per decode of ``data`` on this thread (timed in C++):
        wall clock (``encode_s``, ``decode_s``) and this thread's CPU time
        (``encode_cpu_s``, ``decode_cpu_s``: the per-core rate on a shared machine),
        plus raw_bytes and frame_bytes."""
        return dict(self._c.throughput(_as_buffer(data), dtype_of(data, dtype), out_dtype or "", repeats))


def encode(data: Any, kind: str = "zstd", dtype: str | None = None, **options: Any) -> bytes:
    """One-shot :meth:`Codec.encode` (options as for :class:`Codec`)."""
    return Codec(kind, **options).encode(data, dtype)


def decode(frame: Any, dtype: str | None = None) -> bytes:
    """One-shot decode of any frame (the codec is read from its header)."""
    kind = peek_frame(frame)["codec"]
    return Codec(kind).decode(frame, dtype)
