"""Build and drive tests/fakecuda/fakecuda.cc: the CUDA driver API emulated on host memory.

pdkv loads it instead of libcuda.so.1 when ``PDKV_CUDA_DRIVER`` names it, so the CUDA
paths (cuda_ipc transport, batched-copy kernel, per-extent fallback) run on CPU-only
machines. ``FakeCuda`` opens the *same* library with ctypes: a process that set
``PDKV_CUDA_DRIVER`` shares one allocation table with pdkv, so it can allocate
"device" memory, register it with an agent and check its bytes.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile

from pdkv.lab.transfer.devmem import DeviceMemory

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "fakecuda", "fakecuda.cc")
# pdkv's own kernel sources the fake runs as host code (the strided copy): part of the hash.
KERNEL_DIR = os.path.join(os.path.dirname(HERE), "cpp", "src", "cuda")
KERNEL_SOURCES = ("host_shim.h", "strided_abi.h", "strided_copy.cu")

# Counter names in fakecuda.cc's enum Stat order.
STATS = ("async_copies", "kernel_launches", "h2d", "d2h", "bytes_copied", "failed_copies", "module_loads",
         "ipc_opens", "ipc_closes", "no_context_errors", "live_allocs", "live_ipc_mappings", "live_pinned",
         "live_streams", "live_events", "inits", "strided_launches", "strided_runs", "batch_extents")

CU_ERROR_ILLEGAL_ADDRESS = 700


# The soname of the real driver: once a process loaded the fake (pdkv does, from
# PDKV_CUDA_DRIVER), cuda-python's dlopen("libcuda.so.1") finds the same library loaded,
# so both share one allocation table.
LINK_FLAGS = ("-Wl,-soname,libcuda.so.1", "-ldl")


class CompilerMissing(RuntimeError):
    """No C++ compiler to build the fake driver with."""


def build(dest_dir: str) -> str:
    """Compiles fakecuda.cc into ``dest_dir`` (cached by source hash); returns the .so path.

    Raises
    ------
    CompilerMissing
        When no C++ compiler (g++, or $CXX) is installed.
    RuntimeError
        When the compile fails.
    """
    h = hashlib.sha256(" ".join(LINK_FLAGS).encode())
    for path in (SOURCE, *(os.path.join(KERNEL_DIR, k) for k in KERNEL_SOURCES)):
        with open(path, "rb") as f:
            h.update(f.read())
    digest = h.hexdigest()[:16]
    out = os.path.join(dest_dir, f"libfakecuda-{digest}.so")
    if os.path.exists(out):
        return out
    cxx = shlex.split(os.environ.get("CXX", "")) or (["g++"] if shutil.which("g++") else [])
    if not cxx:
        raise CompilerMissing("building the fake CUDA driver needs a C++ compiler: install g++ (or set CXX)")
    os.makedirs(dest_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=dest_dir)
    os.close(fd)
    cmd = [*cxx, "-std=c++17", "-O2", "-shared", "-fPIC", "-pthread", "-Wall", "-Wextra", "-Wno-unused-parameter",
           f"-I{KERNEL_DIR}", SOURCE, "-o", tmp, *LINK_FLAGS]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"compiling the fake CUDA driver failed ({' '.join(cmd)}):\n{r.stderr}")
    os.replace(tmp, out)  # atomic: concurrent builders never see a half-written library
    return out


class FakeCuda(DeviceMemory):
    """ctypes view of the fake driver at ``path`` (the instance pdkv uses in this process),
    with the fake's test hooks."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        u64 = ctypes.c_ulonglong
        self.lib.fakecuda_fail_copies.argtypes = [ctypes.c_int]
        self.lib.fakecuda_stats.argtypes = [ctypes.POINTER(u64), ctypes.c_int]

    def fail_copies(self, n: int) -> None:
        """The next ``n`` copies fail with CUDA_ERROR_ILLEGAL_ADDRESS (700)."""
        self.lib.fakecuda_fail_copies(n)

    def stats(self) -> dict:
        """Counters by name (see STATS)."""
        arr = (ctypes.c_ulonglong * len(STATS))()
        self.lib.fakecuda_stats(arr, len(STATS))
        return dict(zip(STATS, arr))
