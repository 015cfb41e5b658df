"""AMX tile permission for vLLM's CPU attention (used by :mod:`pdkv.integrations.vllm_worker`).

Linux lets a process execute AMX tile instructions only after it asked for the
tile data state with ``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``; the
first tile instruction of a process that did not ask is killed with SIGILL
(Documentation/arch/x86/xstate.rst). vLLM 0.32's CPU attention picks its ``amx``
kernels for bfloat16 caches whose block size is a multiple of 32 on CPUs with
``amx_tile`` (``vllm/v1/attention/backends/cpu_attn.py``, ``_get_attn_isa``) and
runs raw tile instructions (``csrc/cpu/cpu_attn_amx.hpp``: ``_tile_loadconfig``,
``_tile_dpbf16ps``) without asking. Only oneDNN asks, when it first considers
an AMX kernel; for a small model every linear layer goes through vLLM's sgl
kernels, which call oneDNN's brgemm only for more than 4 rows
(``csrc/cpu/sgl-kernels/gemm.h``, ``can_use_brgemm``). A decode instance whose
prompt was pulled runs only 1-token steps, so nothing asked before its first
attention step: SIGILL. The connector asks at start-up instead, and stops with
:data:`FLAG_HINT` when the kernel refuses.

No torch or vLLM import here: the decision is testable on any CPU.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
from typing import Callable

__all__ = ["AmxTileError", "FLAG_HINT", "cpu_has_amx_tile", "ensure_amx_tiles", "request_tile_data",
           "tile_data_permitted"]

#: x86-64 system call number of arch_prctl, and its XSTATE permission requests.
SYS_ARCH_PRCTL = 158
ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18

#: How to keep vLLM off its AMX attention kernels.
#: (vLLM 0.32's CPU attention takes only block sizes that are multiples of 32, so the
#: dtype is the one switch: its AMX kernels are for bfloat16 only.)
FLAG_HINT = "start vLLM with --dtype float32 (its AMX attention kernels are for bfloat16 only)"


class AmxTileError(RuntimeError):
    """vLLM will run AMX tile instructions and this process may not execute them."""


def cpu_has_amx_tile(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True when the kernel reports the ``amx_tile`` CPU flag (False where it cannot tell)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return "amx_tile" in line.split(":", 1)[-1].split()
    except OSError:
        pass
    return False


def _syscall() -> Callable[..., int] | None:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.syscall
    fn.restype = ctypes.c_long
    return fn


def tile_data_permitted() -> bool | None:
    """Whether this process may use AMX tile data (``ARCH_GET_XCOMP_PERM``); None off
    Linux x86-64 or on a kernel without the request (before 5.16: no AMX there)."""
    call = _syscall()
    if call is None:
        return None
    mask = ctypes.c_uint64(0)
    if call(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(ARCH_GET_XCOMP_PERM), ctypes.byref(mask)) != 0:
        return None
    return bool(mask.value & (1 << XFEATURE_XTILEDATA))


def request_tile_data() -> str | None:
    """Asks the kernel for AMX tile data for the whole process
    (``ARCH_REQ_XCOMP_PERM``). Returns None once granted, else why not (errno name:
    ENOTSUP (EOPNOTSUPP) on a CPU without AMX, ENOSPC when an installed signal stack is too small
    for the tile state, EPERM when a seccomp filter forbids it)."""
    call = _syscall()
    if call is None:
        return f"arch_prctl is not available on {platform.system()} {platform.machine()}"
    if tile_data_permitted():
        return None
    if call(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(ARCH_REQ_XCOMP_PERM),
            ctypes.c_ulong(XFEATURE_XTILEDATA)) != 0:
        e = ctypes.get_errno()
        return f"arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) failed with {errno.errorcode.get(e, e)} ({os.strerror(e)})"
    if not tile_data_permitted():
        return "arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) succeeded but the permission is not set"
    return None


def ensure_amx_tiles(isa: str, *, dtype: str, block_size: int, has_amx: bool | None = None,
                     request: Callable[[], str | None] = request_tile_data) -> bool:
    """Makes sure vLLM's CPU attention can run in this process.

    Parameters
    ----------
    isa : str
        The kernels vLLM's CPU attention picked for this cache (``_get_attn_isa``):
        only ``"amx"`` executes tile instructions.
    dtype, block_size
        Named in the error.
    has_amx : bool, optional
        Whether the CPU has ``amx_tile`` (default: :func:`cpu_has_amx_tile`).
    request : callable
        :func:`request_tile_data` (replaceable in tests).

    Returns True when it asked the kernel (and was granted), False when nothing was
    needed (another ISA, or a CPU without AMX: vLLM does not pick ``amx`` there).

    Raises
    ------
    AmxTileError
        vLLM will use its AMX kernels and the kernel refused the tile state: naming
        the cause and :data:`FLAG_HINT`, instead of a worker killed by SIGILL on its
        first attention step.
    """
    if isa != "amx":
        return False
    if not (cpu_has_amx_tile() if has_amx is None else has_amx):
        return False
    why = request()
    if why is None:
        return True
    raise AmxTileError(f"pdkv connector: vLLM's CPU attention will run its AMX kernels ({dtype} KV cache, "
                       f"{block_size}-token blocks), and Linux kills a process that executes AMX tile "
                       f"instructions without permission (SIGILL); asking for it: {why}. Either allow it, or "
                       f"{FLAG_HINT}")
