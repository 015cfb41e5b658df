"""Device memory through the CUDA driver API (ctypes), for benchmarks and checks that
must not depend on torch: allocate, fill, read back.

It opens the same library pdkv loads (``$PDKV_CUDA_DRIVER``, else ``libcuda.so.1``), so
in a process using a fake driver both see one set of allocations. Device pointers are
ints; their memory is not host-accessible: use :meth:`htod` and :meth:`dtoh`.
"""

from __future__ import annotations

import ctypes
import os

from pdkv.errors import NotSupported


class CudaError(RuntimeError):
    def __init__(self, what: str, code: int) -> None:
        super().__init__(f"{what} failed: CUDA error {code}")
        self.code = code


def driver_path() -> str:
    return os.environ.get("PDKV_CUDA_DRIVER") or "libcuda.so.1"


class DeviceMemory:
    """Allocations on CUDA device ``device`` of the driver at ``path``."""

    def __init__(self, path: str | None = None, device: int = 0) -> None:
        path = path or driver_path()
        try:
            self.lib = lib = ctypes.CDLL(path)
        except OSError as e:
            raise NotSupported(f"device memory needs the CUDA driver ({path}): {e}") from None
        u64, vp, sz = ctypes.c_ulonglong, ctypes.c_void_p, ctypes.c_size_t
        lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(u64), sz]
        lib.cuMemFree_v2.argtypes = [u64]
        lib.cuMemcpyHtoD_v2.argtypes = [u64, vp, sz]
        lib.cuMemcpyDtoH_v2.argtypes = [vp, u64, sz]
        lib.cuCtxSetCurrent.argtypes = [vp]
        lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(vp), ctypes.c_int]
        lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        self._check(lib.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        self._check(lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
        self._ctx = ctypes.c_void_p()
        self._check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(self._ctx), dev.value), "cuDevicePrimaryCtxRetain")
        self.device = device

    @staticmethod
    def _check(code: int, what: str) -> None:
        if code != 0:
            raise CudaError(what, code)

    def _call(self, fn, what: str, *args) -> None:
        # The context is current only during the call: pdkv must not rely on a context
        # someone else left on its thread.
        self._check(self.lib.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        try:
            self._check(fn(*args), what)
        finally:
            self.lib.cuCtxSetCurrent(None)

    def alloc(self, nbytes: int) -> int:
        """Device memory of ``nbytes`` bytes; returns its address."""
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
