"""The child's side of a peer-library benchmark (``python -m pdkv.lab.transfer.peers``):
what the NIXL and Mooncake roles (:mod:`~pdkv.lab.transfer.peer_nixl`,
:mod:`~pdkv.lab.transfer.peer_mooncake`) share. Those roles are the only code that
imports a peer library, and only in the child."""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
import time
from typing import Any, Callable

import numpy as np

from pdkv.lab.transfer.cpu import CpuMeter
from pdkv.lab.transfer.peer_common import Channel, Workload

__all__ = [
    "cpu_meter",
    "cpu_s",
    "die_with_parent",
    "expect",
    "latency_loop",
    "timed_loop",
    "touched_zeros",
    "verify",
    "workload_of",
]


def cpu_s() -> float:
    """CPU seconds (user + system) this process has used so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def cpu_meter(target: dict[str, Any]) -> CpuMeter:
    """The initiator child (this process) and the target child (pid from the caller's
    ``run`` message), read together around the timed loop."""
    return CpuMeter({"initiator": os.getpid(), "target": target.get("pid")})


def touched_zeros(nbytes: int) -> np.ndarray:
    """``[nbytes]`` uint8 zeros, every page already written."""
    # np.zeros maps lazily-zeroed pages; writing them now keeps page faults out of the
    # timed transfers.
    a = np.empty(nbytes, dtype=np.uint8)
    a.fill(0)
    return a


def verify(w: Workload, pool: np.ndarray) -> tuple[bool, int]:
    """Whether every destination block of ``pool`` holds its source block."""
    src = w.source_pool().reshape(w.num_blocks, w.block_bytes)
    dst = pool.reshape(w.num_blocks, w.block_bytes)
    perm = w.permutation()
    bad = 0
    step = max(1, (64 << 20) // w.block_bytes)  # compare ~64 MiB at a time
    for s in range(0, w.num_blocks, step):
        eq = (dst[perm[s : s + step]] == src[s : s + step]).all(axis=1)
        bad += int((~eq).sum())
    return bad == 0, bad


def workload_of(msg: dict[str, Any]) -> Workload:
    """The :class:`Workload` a message from the caller carries."""
    return Workload(**msg["workload"])


def timed_loop(post_and_wait: Callable[[], None], n: int) -> float:
    """Seconds that ``n`` calls of ``post_and_wait`` take."""
    t0 = time.perf_counter()
    for _ in range(n):
        post_and_wait()
    return time.perf_counter() - t0


def latency_loop(post_and_wait: Callable[[int], None], blocks: np.ndarray) -> list[float]:
    """Microseconds of each ``post_and_wait(block)``, one per entry of ``blocks``."""
    lat = []
    for b in blocks:
        t0 = time.perf_counter()
        post_and_wait(int(b))
        lat.append((time.perf_counter() - t0) * 1e6)
    return lat


def expect(chan: Channel, cmd: str) -> dict[str, Any]:
    """The caller's next message, which must be ``cmd``; exits quietly on ``exit`` or EOF."""
    msg = chan.recv(None)
    if msg is None:
        raise SystemExit(0)  # the caller went away: leave quietly
    if msg.get("cmd") != cmd:
        if msg.get("cmd") == "exit":
            raise SystemExit(0)
        raise RuntimeError(f"expected {cmd!r} from the caller, got {msg.get('cmd')!r}")
    return msg


def die_with_parent(parent_pid: int) -> None:
    """Has this child killed when ``parent_pid`` dies; exits now if it already has."""
    # Linux: SIGKILL this child when the process that spawned it dies, so a killed bench
    # never leaves a target holding its pool and port.
    with contextlib.suppress(Exception):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)
