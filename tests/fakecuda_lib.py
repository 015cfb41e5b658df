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

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "fakecuda", "fakecuda.cc")

# Counter names in fakecuda.cc's enum Stat order.
STATS = ("async_copies", "kernel_launches", "h2d", "d2h", "bytes_copied", "failed_copies", "module_loads",
         "ipc_opens", "ipc_closes", "no_context_errors", "live_allocs", "live_ipc_mappings", "live_pinned",
         "live_streams", "live_events")

CU_ERROR_ILLEGAL_ADDRESS = 700


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
    with open(SOURCE, "rb") as f:
        src = f.read()
    digest = hashlib.sha256(src).hexdigest()[:16]
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
           SOURCE, "-o", tmp]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        os.unlink(tmp)
        raise RuntimeError(f"compiling the fake CUDA driver failed ({' '.join(cmd)}):\n{r.stderr}")
    os.replace(tmp, out)  # atomic: concurrent builders never see a half-written library
    return out


class CudaError(RuntimeError):
    def __init__(self, what: str, code: int) -> None:
        super().__init__(f"{what} failed: CUDA error {code}")
        self.code = code


class FakeCuda:
    """ctypes view of the fake driver at ``path`` (the instance pdkv uses in this process).

    Device pointers are ints; their memory is not host-accessible, so read and write it
    with :meth:`htod` and :meth:`dtoh` only.
    """

    def __init__(self, path: str) -> None:
        self.lib = lib = ctypes.CDLL(path)
        u64, vp, sz = ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_size_t
        lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(u64), sz]
        lib.cuMemFree_v2.argtypes = [u64]
        lib.cuMemcpyHtoD_v2.argtypes = [u64, vp, sz]
        lib.cuMemcpyDtoH_v2.argtypes = [vp, u64, sz]
        lib.cuCtxSetCurrent.argtypes = [vp]
        lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(vp), ctypes.c_int]
        lib.fakecuda_fail_copies.argtypes = [ctypes.c_int]
        lib.fakecuda_stats.argtypes = [ctypes.POINTER(u64), ctypes.c_int]
        self._check(lib.cuInit(0), "cuInit")
        self._ctx = ctypes.c_void_p()
        self._check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(self._ctx), 0), "cuDevicePrimaryCtxRetain")

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code != 0:
            raise CudaError(what, code)

    def _call(self, fn, what: str, *args) -> None:
        # The context is current only during the call: pdkv must not rely on a context
        # someone else left on its thread (tests count calls made without one).
        self._check(self.lib.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        try:
            self._check(fn(*args), what)
        finally:
            self.lib.cuCtxSetCurrent(None)

    def alloc(self, nbytes: int) -> int:
        """Device memory of ``nbytes`` bytes (zero-filled); returns its address."""
        p = ctypes.c_ulonglong()
        self._call(self.lib.cuMemAlloc_v2, "cuMemAlloc", ctypes.byref(p), nbytes)
        return p.value

    def free(self, ptr: int) -> None:
        self._call(self.lib.cuMemFree_v2, "cuMemFree", ptr)

    def htod(self, ptr: int, data) -> None:
        """Copies ``data`` (bytes or a C-contiguous numpy array) to device address ``ptr``."""
        buf = memoryview(data).cast("B")
        if buf.readonly:
            buf = memoryview(bytearray(buf))
        c = (ctypes.c_char * buf.nbytes).from_buffer(buf)
        self._call(self.lib.cuMemcpyHtoD_v2, "cuMemcpyHtoD", ptr, c, buf.nbytes)

    def dtoh(self, ptr: int, nbytes: int, dtype=None, shape=None):
        """``nbytes`` from device address ``ptr``: bytes, or a numpy array of ``dtype``/``shape``."""
        out = ctypes.create_string_buffer(nbytes)
        self._call(self.lib.cuMemcpyDtoH_v2, "cuMemcpyDtoH", out, ptr, nbytes)
        if dtype is None:
            return out.raw
        import numpy as np

        a = np.frombuffer(out.raw, dtype=dtype)
        return a if shape is None else a.reshape(shape)

    def fail_copies(self, n: int) -> None:
        """The next ``n`` copies fail with CUDA_ERROR_ILLEGAL_ADDRESS (700)."""
        self.lib.fakecuda_fail_copies(n)

    def stats(self) -> dict:
        """Counters by name (see STATS)."""
        arr = (ctypes.c_ulonglong * len(STATS))()
        self.lib.fakecuda_stats(arr, len(STATS))
        return dict(zip(STATS, arr))
