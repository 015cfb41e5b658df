"""What the parts of ``pdkv bench transfer`` share: sizes, the tcp options of a run,
host views of registered memory, pool sizing, the results file.

:mod:`pdkv.lab.transfer.bench` (the command), :mod:`~pdkv.lab.transfer.compress`,
:mod:`~pdkv.lab.transfer.hetero` and :mod:`~pdkv.lab.transfer.link` import it; it
imports none of them.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os

import numpy as np

from pdkv import TcpOptions
from pdkv.errors import InvalidArgument
from pdkv.lab.transfer import models

__all__ = ["SECRET_ENV", "cell", "host_view", "human", "parse_size", "percentile", "pool_blocks", "tcp_options",
           "write_out"]

SECRET_ENV = "PDKV_BENCH_SECRET"


def parse_size(s: str) -> int:
    """'64M', '1G', '32K', '4096' -> bytes (binary units)."""
    s = s.strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    num = s[:-1] if s[-1:] in "KMG" else s
    try:
        v = float(num) * mult
    except ValueError:
        raise InvalidArgument(f"cannot parse size {s!r} (use e.g. 64M, 1G)") from None
    if v <= 0:
        raise InvalidArgument(f"size must be positive, got {s!r}")
    return int(v)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return str(n)


def cell(v: float | None, width: int, fmt: str, suffix: str = "") -> str:
    """A table cell: ``v`` formatted (``fmt``, then ``suffix``), right-aligned to ``width``; ``-`` where unknown."""
    return f"{format(v, fmt) + suffix if v is not None else '-':>{width}}"


def percentile(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    if not ys:
        return float("nan")
    k = (len(ys) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ys[lo] + (ys[hi] - ys[lo]) * (k - lo)


def tcp_options(args: argparse.Namespace) -> TcpOptions:
    return TcpOptions(conns_per_peer=args.conns, progress_threads=args.threads, rcvlowat_bytes=args.rcvlowat,
                      batch_bytes=args.batch_bytes, tls=bool(getattr(args, "tls_on", False)),
                      gather_below_bytes=getattr(args, "gather_below", TcpOptions().gather_below_bytes),
                      land_below_bytes=getattr(args, "land_below", TcpOptions().land_below_bytes),
                      congestion_control=getattr(args, "congestion_control", ""))


def host_view(addr: int, n: int) -> np.ndarray:
    """The ``n`` bytes of host memory at ``addr``, as a uint8 array (no copy)."""
    return np.frombuffer((ctypes.c_uint8 * n).from_address(addr), np.uint8)


def pool_blocks(model: str, payloads: list[int]) -> int:
    """Blocks each side's pool needs for the largest payload (whole blocks, at least 2)."""
    geo1 = models.geometry(model, 1)
    block = geo1.num_layers * geo1.kv_parts * geo1.block_bytes
    return max(2, max(max(1, p // block) for p in payloads))


def write_out(args: argparse.Namespace, results: list[dict]) -> None:
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(["pdkv", "bench", "transfer"] + args.argv), "results": results}, f,
                      indent=2)


def system_congestion_control() -> str:
    """The kernel's default TCP congestion control (``net.ipv4.tcp_congestion_control``),
    or ``"?"`` where it cannot be read."""
    try:
        with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
            return f.read().strip() or "?"
    except OSError:
        return "?"
