"""GPUs through cuda-python's driver bindings: what this host's GPUs are (``pdkv doctor``)
and device memory pdkv allocates itself (``Agent.alloc(nbytes, device=N)``), for engines
that are not torch-based, benchmarks and tests.

Nothing here imports cuda-python before it is asked: ``import pdkv`` needs no CUDA,
torch or cuda-python. The data path never comes here: the C++ core loads the driver
itself (cpp/src/cuda/driver.h). Both use the same driver library: ``$PDKV_CUDA_DRIVER``
when set (loaded here first, so cuda-python's ``dlopen("libcuda.so.1")`` finds it
loaded; it must carry the soname ``libcuda.so.1``, as the emulated driver in
tests/fakecuda does), else ``libcuda.so.1``.

Errors: no cuda-python, no driver, or no such device raise
:class:`~pdkv.errors.NotSupported` (``InvalidArgument`` for a device index that is not
an int); a driver call that fails raises :class:`CudaError` (a ``PdkvError``) naming the
call and the driver's error.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from typing import Any

from . import _validate
from .errors import InvalidArgument, NotSupported, PdkvError
from .region import Region

__all__ = ["CudaError", "DeviceBuffer", "DeviceRegion", "driver", "gpus", "peer_matrix", "driver_version"]

_INSTALL_HINT = "pip install 'pdkv[gpu]' (or cuda-bindings)"


class CudaError(PdkvError):
    """A CUDA driver call failed; ``code`` is the driver's ``CUresult``."""

    def __init__(self, what: str, code: int, name: str) -> None:
        super().__init__(f"{what} failed: {name} ({code})")
        self.code = code


def _import_bindings() -> Any:
    try:
        from cuda.bindings import driver as drv  # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import cuda as drv  # type: ignore[no-redef]  # older cuda-python
        except ImportError as e:
            raise NotSupported(f"cuda-python is not installed ({e}): {_INSTALL_HINT}") from None
    return drv


def _preload_override() -> None:
    """Loads $PDKV_CUDA_DRIVER before cuda-python looks for libcuda.so.1, and checks that
    cuda-python will get that library and not another one."""
    path = os.environ.get("PDKV_CUDA_DRIVER")
    if not path:
        return
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise NotSupported(f"cannot load the CUDA driver {path} (PDKV_CUDA_DRIVER): {e}") from None
    try:
        same = ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD)._handle == lib._handle
    except OSError:
        same = False
    if not same:
        raise NotSupported(f"PDKV_CUDA_DRIVER={path} has no soname libcuda.so.1, so cuda-python would load "
                           "another driver than pdkv: link it with -Wl,-soname,libcuda.so.1 (or put it first on "
                           "LD_LIBRARY_PATH as libcuda.so.1)")


_init_lock = threading.Lock()


@functools.cache
def _initialized() -> Any:
    drv = _import_bindings()
    _preload_override()
    try:
        (err,) = drv.cuInit(0)
    except Exception as e:  # noqa: BLE001 - cuda-python raises RuntimeError/its own errors when libcuda is missing
        if type(e).__name__ == "DynamicLibNotFoundError":  # cuda.pathfinder: not on the loader's path
            raise NotSupported("no CUDA driver: libcuda.so.1 is not installed (no NVIDIA driver)") from None
        raise NotSupported(f"cuda-python could not use the CUDA driver ({type(e).__name__}: {e}); install the "
                           "cuda-bindings major version of the driver's CUDA (nvidia-smi: 'CUDA Version')") from None
    if int(err) != 0:
        raise NotSupported(f"the CUDA driver did not initialise: cuInit: {_error_name(drv, err)} ({int(err)})")
    return drv


def driver() -> Any:
    """cuda-python's driver module (``cuda.bindings.driver``), initialised (``cuInit``).

    Raises
    ------
    NotSupported
        Without cuda-python, without a CUDA driver, or when ``cuInit`` fails (no GPU).
    """
    with _init_lock:
        return _initialized()


def _error_name(drv: Any, err: Any) -> str:
    try:
        e, s = drv.cuGetErrorName(err)
        if int(e) == 0 and s:
            return s.decode() if isinstance(s, bytes) else str(s)
    except Exception:  # noqa: BLE001 - a driver without cuGetErrorName
        pass
    return getattr(err, "name", f"CUresult {int(err)}")


def _call(what: str, fn: Any, *args: Any) -> Any:
    """Calls a cuda-python driver function; returns its values after the status."""
    out = fn(*args)
    err, rest = out[0], out[1:]
    if int(err) != 0:
        raise CudaError(what, int(err), _error_name(driver(), err))
    return rest[0] if len(rest) == 1 else rest


def device_count() -> int:
    """Number of CUDA devices (NotSupported without a driver)."""
    drv = driver()
    return int(_call("cuDeviceGetCount", drv.cuDeviceGetCount))


def driver_version() -> str:
    """The driver's CUDA version, e.g. ``"12.8"``."""
    v = int(_call("cuDriverGetVersion", driver().cuDriverGetVersion))
    return f"{v // 1000}.{v % 1000 // 10}"


def _ordinal(index: Any) -> int:
    """``index`` as a device ordinal; InvalidArgument for anything but an int >= 0."""
    if isinstance(index, bool) or not _validate._is_int(index) or int(index) < 0:
        raise InvalidArgument(f"device must be a CUDA ordinal (an int >= 0), got {index!r}")
    return int(index)


def _device(index: Any) -> Any:
    """The CUdevice of ordinal ``index``, checked."""
    index = _ordinal(index)
    n = device_count()
    if int(index) >= n:
        raise NotSupported(f"no CUDA device {int(index)}: this host has {n} (ordinals 0..{n - 1})")
    drv = driver()
    return _call(f"cuDeviceGet({int(index)})", drv.cuDeviceGet, int(index))


def gpus() -> list[dict]:
    """One dict per device: ``index``, ``name``, ``total_bytes``, ``compute_capability``
    (``"9.0"``), ``pci_bus_id`` (``None`` where the driver does not say)."""
    drv = driver()
    A = drv.CUdevice_attribute
    out = []
    for i in range(device_count()):
        dev = _device(i)
        name = _call("cuDeviceGetName", drv.cuDeviceGetName, 256, dev)
        name = name.split(b"\0", 1)[0].decode(errors="replace").strip() if isinstance(name, bytes) else str(name)
        major = _call("cuDeviceGetAttribute", drv.cuDeviceGetAttribute,
                      A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)
        minor = _call("cuDeviceGetAttribute", drv.cuDeviceGetAttribute,
                      A.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)
        try:
            bus = _call("cuDeviceGetPCIBusId", drv.cuDeviceGetPCIBusId, 32, dev)
            bus = bus.split(b"\0", 1)[0].decode() if isinstance(bus, bytes) else str(bus)
        except (CudaError, AttributeError):
            bus = None
        out.append({"index": i, "name": name, "total_bytes": int(_call("cuDeviceTotalMem", drv.cuDeviceTotalMem, dev)),
                    "compute_capability": f"{int(major)}.{int(minor)}", "pci_bus_id": bus})
    return out


def peer_matrix() -> list[list[dict | None]]:
    """``m[i][j]`` for devices i != j (``None`` on the diagonal): ``can_access_peer``
    (``cuDeviceCanAccessPeer``), and from ``cuDeviceGetP2PAttribute`` ``access_supported``,
    ``native_atomics`` and ``performance_rank`` (``None`` where the driver does not say).
    A P2P link with access (NVLink or PCIe P2P) lets cuda_ipc copy device to device."""
    drv = driver()
    n = device_count()
    P = getattr(drv, "CUdevice_P2PAttribute", None)
    m: list[list[dict | None]] = []
    for i in range(n):
        row: list[dict | None] = []
        for j in range(n):
            if i == j:
                row.append(None)
                continue
            di, dj = _device(i), _device(j)
            cell: dict = {"can_access_peer": bool(_call("cuDeviceCanAccessPeer", drv.cuDeviceCanAccessPeer, di, dj))}
            for key, attr in (("access_supported", "CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED"),
                              ("native_atomics", "CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED"),
                              ("performance_rank", "CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK")):
                try:
                    v = int(_call("cuDeviceGetP2PAttribute", drv.cuDeviceGetP2PAttribute, getattr(P, attr), di, dj))
                    cell[key] = v if key == "performance_rank" else bool(v)
                except (CudaError, AttributeError):
                    cell[key] = None
            row.append(cell)
        m.append(row)
    return m


class _PrimaryContext:
    """The device's primary context made current on this thread for a ``with`` block
    (the previous one restored after), as pdkv's core does: never rely on, nor leave,
    a context on the caller's thread."""

    def __init__(self, device: int) -> None:
        drv = driver()
        self.device = device
        self._dev = _device(device)
        self.ctx = _call("cuDevicePrimaryCtxRetain", drv.cuDevicePrimaryCtxRetain, self._dev)
        self._tls = threading.local()  # per thread: the contexts to restore (blocks may nest)

    def __enter__(self) -> "_PrimaryContext":
        drv = driver()
        prev = getattr(self._tls, "prev", None)
        if prev is None:
            prev = self._tls.prev = []
        prev.append(_call("cuCtxGetCurrent", drv.cuCtxGetCurrent))
        _call("cuCtxSetCurrent", drv.cuCtxSetCurrent, self.ctx)
        return self

    def __exit__(self, *exc: Any) -> None:
        driver().cuCtxSetCurrent(self._tls.prev.pop())

    def release(self) -> None:
        drv = driver()
        fn = getattr(drv, "cuDevicePrimaryCtxRelease", None)
        if fn is not None:
            fn(self._dev)


# ---- DLPack export (the legacy DLManagedTensor; the spec lets a producer answer
# max_version=(1, x) with it). One 1-D uint8 tensor over the whole buffer.
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]
_KDL_CUDA = 2
_KDL_UINT = 1

# Exported tensors still alive, by the address of their DLManagedTensor: the struct, its
# shape array and the buffer, kept until the consumer calls the deleter, or until the
# buffer is freed. The capsule has no destructor: one written in Python would run while
# the consumer that dropped it may have an exception pending (numpy refusing a CUDA
# tensor), and calling into the C API from there loses that exception. A capsule dropped
# unconsumed so keeps its entry until free().
_exports: dict[int, tuple] = {}
_exports_lock = threading.Lock()


@_DELETER
def _dl_deleter(managed: Any) -> None:
    with _exports_lock:
        _exports.pop(ctypes.addressof(managed.contents), None)


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def _export(buffer: "DeviceBuffer") -> Any:
    shape = (ctypes.c_int64 * 1)(buffer.nbytes)
    m = _DLManagedTensor()
    m.dl_tensor.data = buffer.ptr
    m.dl_tensor.device = _DLDevice(_KDL_CUDA, buffer.device)
    m.dl_tensor.ndim = 1
    m.dl_tensor.dtype = _DLDataType(_KDL_UINT, 8, 1)
    m.dl_tensor.shape = shape
    m.dl_tensor.strides = None
    m.dl_tensor.byte_offset = 0
    m.deleter = _dl_deleter
    addr = ctypes.addressof(m)
    with _exports_lock:
        _exports[addr] = (m, shape, buffer)
    return _capsule_new(addr, b"dltensor", None)


class DeviceBuffer:
    """``nbytes`` of device memory on CUDA device ``device`` (``cuMemAlloc`` in its primary
    context), freed by :meth:`free` (idempotent) or when collected.

    A DLPack exporter (a 1-D ``uint8`` tensor of ``nbytes``): ``torch.from_dlpack(buf)``,
    ``cupy.from_dlpack(buf)`` or ``Agent.register(buf)`` see the memory without a copy.
    The views do not keep it allocated: :meth:`free` frees it under them, so drop them
    (and close such registrations) first. Device memory is not
    host-accessible: use :meth:`copy_from_host` / :meth:`copy_to_host`.
    """

    def __init__(self, nbytes: int, device: int = 0) -> None:
        nbytes = _validate.positive_int(nbytes, "nbytes")
        device = _ordinal(device)  # before the driver: a bad argument is that, with or without CUDA
        self._ctx = _PrimaryContext(device)
        self.device = int(device)
        self.nbytes = nbytes
        drv = driver()
        try:
            with self._ctx:
                self.ptr = int(_call(f"cuMemAlloc({nbytes})", drv.cuMemAlloc, nbytes))
        except BaseException:
            self._ctx.release()
            raise
        self._freed = False

    def _check_range(self, offset: int, n: int) -> None:
        if offset < 0 or n < 0 or offset + n > self.nbytes:
            raise InvalidArgument(f"[{offset}, {offset + n}) is outside the buffer's {self.nbytes} bytes")
        if self._freed:
            raise InvalidArgument("the device buffer is freed")

    def copy_from_host(self, data: Any, offset: int = 0) -> None:
        """Copies ``data`` (bytes, or any C-contiguous buffer such as a numpy array) to
        ``offset`` (synchronous)."""
        view = memoryview(data).cast("B")
        self._check_range(offset, view.nbytes)
        if view.readonly:
            view = memoryview(bytearray(view))
        host = (ctypes.c_char * view.nbytes).from_buffer(view)
        drv = driver()
        with self._ctx:
            _call("cuMemcpyHtoD", drv.cuMemcpyHtoD, self.ptr + offset, ctypes.addressof(host), view.nbytes)

    def copy_to_host(self, nbytes: int | None = None, offset: int = 0) -> bytes:
        """``nbytes`` (default: to the end) from ``offset``, as bytes (synchronous)."""
        n = self.nbytes - offset if nbytes is None else int(nbytes)
        self._check_range(offset, n)
        out = ctypes.create_string_buffer(n)
        drv = driver()
        with self._ctx:
            _call("cuMemcpyDtoH", drv.cuMemcpyDtoH, ctypes.addressof(out), self.ptr + offset, n)
        return out.raw

    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                   copy: Any = None) -> Any:
        if self._freed:
            raise InvalidArgument("the device buffer is freed")
        # BufferError: what the DLPack protocol says a producer raises for what it cannot export.
        if copy:
            raise BufferError("DeviceBuffer exports its memory, never a copy (copy=True)")
        if dl_device is not None and tuple(dl_device) != (_KDL_CUDA, self.device):
            raise BufferError(f"DeviceBuffer lives on cuda:{self.device}, not DLPack device {tuple(dl_device)}")
        # Every copy pdkv made into it was synchronous: nothing for `stream` to wait on.
        return _export(self)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (_KDL_CUDA, self.device)

    def free(self) -> None:
        """Frees the device memory (``cuMemFree``, which synchronizes). Idempotent."""
        if getattr(self, "_freed", True):
            return
        self._freed = True
        with _exports_lock:  # views must be gone by now (see the class docstring)
            for k in [k for k, v in _exports.items() if v[2] is self]:
                del _exports[k]
        drv = driver()
        with self._ctx:
            _call("cuMemFree", drv.cuMemFree, self.ptr)
        self._ctx.release()

    def __del__(self) -> None:
        try:
            self.free()
        except Exception:  # noqa: BLE001 - at interpreter exit the driver may be gone
            pass

    def __repr__(self) -> str:
        state = ", freed" if getattr(self, "_freed", True) else ""
        return f"DeviceBuffer(cuda:{self.device}, ptr=0x{getattr(self, 'ptr', 0):x}, nbytes={self.nbytes}{state})"


class DeviceRegion(Region):
    """Device memory pdkv allocated and registered (:meth:`Agent.alloc` with ``device=N``).
    ``close()`` deregisters (waiting for transfers using it), then frees the memory; so
    does closing the agent. Exports DLPack (``torch.from_dlpack(region)``) while open;
    see :class:`DeviceBuffer` for the copies and the lifetime of views."""

    def __init__(self, agent: Any, desc: dict, buffer: DeviceBuffer) -> None:
        super().__init__(agent, desc, buffer)
        self._buffer = buffer

    @property
    def buffer(self) -> DeviceBuffer:
        return self._buffer

    def copy_from_host(self, data: Any, offset: int = 0) -> None:
        """See :meth:`DeviceBuffer.copy_from_host`."""
        self._buffer.copy_from_host(data, offset)

    def copy_to_host(self, nbytes: int | None = None, offset: int = 0) -> bytes:
        """See :meth:`DeviceBuffer.copy_to_host`."""
        return self._buffer.copy_to_host(nbytes, offset)

    def __dlpack__(self, **kw: Any) -> Any:
        if self.closed:
            raise InvalidArgument("region is closed")
        return self._buffer.__dlpack__(**kw)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._buffer.__dlpack_device__()

    def close(self) -> None:
        """Deregisters (waiting for transfers using it), then frees the device memory. Idempotent."""
        try:
            super().close()
        finally:
            self._buffer.free()

    def _agent_closed(self) -> None:
        """The agent is gone (its registrations with it): only the memory is left to free."""
        self._closed = True
        self._buffer.free()

    def __repr__(self) -> str:
        return f"DeviceRegion(id={self.id}, cuda:{self.device}, addr=0x{self.addr:x}, nbytes={self.nbytes})"
