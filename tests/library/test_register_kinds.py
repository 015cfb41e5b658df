"""Every kind of memory Agent.register accepts round-trips bit-exact over tcp; DLPack
exporters are read from their capsule by the native module (no numpy/torch needed)."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import pdkv
from conftest import SECRET

NBYTES = 1 << 16


class DlpackOnly:
    """Exports only DLPack (as jax/cupy arrays on the host do); forwards the keywords."""

    def __init__(self, arr) -> None:
        self.arr = arr

    def __dlpack__(self, **kw):
        return self.arr.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self.arr.__dlpack_device__()


class LegacyDlpack(DlpackOnly):
    """An exporter older than DLPack 1.0: ``__dlpack__`` takes no ``max_version``."""

    def __dlpack__(self, stream=None):
        return self.arr.__dlpack__()


def _pattern(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, NBYTES, dtype=np.uint8)


def _numpy(agent, data):
    arr = data.copy()
    return agent.register(arr), arr


def _buffer(agent, data):
    ba = bytearray(data.tobytes())
    return agent.register(ba), np.frombuffer(ba, np.uint8)


def _alloc(agent, data):
    region = agent.alloc(NBYTES)
    view = region.array(np.uint8)
    view[:] = data
    return region, view


def _address(agent, data):
    arr = data.copy()
    return agent.register_address(arr.ctypes.data, NBYTES, keepalive=arr), arr


def _dlpack_numpy(agent, data):
    arr = data.copy()
    return agent.register(DlpackOnly(arr)), arr


def _dlpack_legacy(agent, data):
    arr = data.copy()
    return agent.register(LegacyDlpack(arr)), arr


def _torch(agent, data):
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(data.copy())
    return agent.register(t), t.numpy()


def _dlpack_torch(agent, data):
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(data.copy())
    return agent.register(DlpackOnly(t)), t.numpy()


KINDS = {"numpy": _numpy, "buffer": _buffer, "alloc": _alloc, "address": _address, "dlpack-numpy": _dlpack_numpy,
         "dlpack-legacy": _dlpack_legacy, "torch": _torch, "dlpack-torch": _dlpack_torch}


@pytest.mark.parametrize("dst_kind", sorted(KINDS))
@pytest.mark.parametrize("src_kind", sorted(KINDS))
def test_every_registration_kind_round_trips_bit_exact_over_tcp(src_kind, dst_kind):
    with pdkv.Agent("src", secret=SECRET, transports=["tcp"]) as a, \
            pdkv.Agent("dst", secret=SECRET, transports=["tcp"]) as b:
        data = _pattern(hash((src_kind, dst_kind)) & 0xFFFF)
        rs, src_view = KINDS[src_kind](a, data)
        rd, dst_view = KINDS[dst_kind](b, np.zeros(NBYTES, np.uint8))
        assert (rs.nbytes, rd.nbytes) == (NBYTES, NBYTES)
        peer = a.connect(b.address)
        assert a.prepare_extents("write", peer, [(rs.id, 0, rd.id, 0, NBYTES)]).post().wait(10)
        assert np.array_equal(dst_view, data)
        # and back again, as a read into a zeroed source
        src_view[:] = 0
        assert a.prepare_extents("read", peer, [(rs.id, 0, rd.id, 0, NBYTES)]).post().wait(10)
        assert np.array_equal(src_view, data)


def test_dlpack_region_is_the_exported_memory_with_byte_offset():
    with pdkv.Agent("a", secret=SECRET) as a:
        base = np.arange(64, dtype=np.float32)
        view = base[16:48]  # a contiguous slice: data + byte_offset (numpy folds it into data)
        r = a.register(DlpackOnly(view))
        assert (r.addr, r.nbytes, r.kind, r.device) == (view.ctypes.data, 128, "host", -1)
        r2 = a.register(LegacyDlpack(np.zeros((4, 8), np.float16)))
        assert r2.nbytes == 64


def test_dlpack_region_keeps_the_exporter_alive():
    with pdkv.Agent("a", secret=SECRET) as a:
        arr = np.ones(1024, np.uint8)
        exporter = DlpackOnly(arr)
        alive = weakref.ref(exporter)
        r = a.register(exporter)
        del exporter, arr
        gc.collect()
        assert alive() is not None  # the region holds it
        r.close()
        gc.collect()
        assert alive() is None


@pytest.mark.parametrize("bad, match", [
    (np.zeros((8, 8), np.float32)[:, ::2], r"not contiguous \(dimension 1 has stride 2 elements"),
    (np.zeros((8, 8), np.float32).T, "not contiguous"),
    (np.zeros(0, np.float32), "empty"),
])
def test_dlpack_non_contiguous_or_empty_is_invalid_argument(bad, match):
    with pdkv.Agent("a", secret=SECRET) as a:
        with pytest.raises(pdkv.InvalidArgument, match=match):
            a.register(DlpackOnly(bad))
        assert a.regions == []


class OnDevice:
    """A DLPack exporter on a device pdkv cannot register (here: Vulkan, type 7)."""

    def __dlpack_device__(self):
        return (7, 0)

    def __dlpack__(self, **kw):
        raise AssertionError("pdkv must refuse before asking for the capsule")


class BrokenDevice:
    def __dlpack_device__(self):
        raise RuntimeError("device went away")

    def __dlpack__(self, **kw):
        raise AssertionError("not reached")


def test_dlpack_unsupported_device_and_broken_exporters_are_invalid_argument():
    with pdkv.Agent("a", secret=SECRET) as a:
        with pytest.raises(pdkv.InvalidArgument, match="OnDevice on DLPack device type 7: pdkv registers CPU and CUDA"):
            a.register(OnDevice())
        with pytest.raises(pdkv.InvalidArgument, match=r"BrokenDevice.__dlpack_device__\(\) failed: .*went away"):
            a.register(BrokenDevice())


def test_dlpack_read_only_export_needs_remote_access_false():
    if tuple(int(x) for x in np.__version__.split(".")[:2]) < (2, 1):
        pytest.skip("numpy < 2.1 exports no read-only flag over DLPack")
    with pdkv.Agent("a", secret=SECRET) as a:
        ro = np.zeros(64, np.uint8)
        ro.flags.writeable = False
        with pytest.raises(pdkv.InvalidArgument, match="read-only"):
            a.register(DlpackOnly(ro))
        assert a.register(DlpackOnly(ro), remote_access=False).nbytes == 64


# ---------------------------------------------------------------- hand-built capsules
# Exporters that build their DLPack struct with ctypes, so that every field the native
# reader looks at (device, byte_offset, strides, dtype bits, version, flags) is set
# explicitly, CUDA included, without a GPU: dlpack_memory only reads the struct.
import ctypes  # noqa: E402


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_NAMES = {False: b"dltensor", True: b"dltensor_versioned"}  # kept alive: capsules point at them


class HandBuilt:
    """A DLPack exporter of ``data`` (an address) with the given fields; no deleter."""

    def __init__(self, data, shape, *, strides=None, bits=32, lanes=1, device=(1, 0), byte_offset=0,
                 versioned=True, major=1, flags=0):
        self.shape = (ctypes.c_int64 * len(shape))(*shape)
        self.strides = None if strides is None else (ctypes.c_int64 * len(strides))(*strides)
        t = _DLTensor(data, _DLDevice(*device), len(shape), _DLDataType(2, bits, lanes), self.shape,
                      self.strides, byte_offset)
        self.versioned = versioned
        self.managed = (_DLManagedTensorVersioned(major, 0, None, None, flags, t) if versioned
                        else _DLManagedTensor(t, None, None))
        self.device = device

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, max_version=None, **kw):
        versioned = self.versioned and max_version is not None
        return _capsule_new(ctypes.addressof(self.managed), _NAMES[versioned], None)


def _memory(obj):
    from pdkv import _native

    return _native.module().dlpack_memory(obj)[:5]


def test_hand_built_capsules_cover_offset_strides_devices_and_versions():
    base = 0x10000
    assert _memory(HandBuilt(base, [4, 8], byte_offset=64)) == (base + 64, 128, "host", -1, False)
    assert _memory(HandBuilt(base, [4, 8], strides=[8, 1])) == (base, 128, "host", -1, False)
    assert _memory(HandBuilt(base, [1, 8], strides=[999, 1])) == (base, 32, "host", -1, False)  # size-1 dim
    assert _memory(HandBuilt(base, [16], bits=16, lanes=2, versioned=False)) == (base, 64, "host", -1, False)
    assert _memory(HandBuilt(base, [16], device=(2, 3))) == (base, 64, "cuda", 3, False)
    assert _memory(HandBuilt(base, [16], device=(3, 0))) == (base, 64, "host", -1, False)  # pinned host
    assert _memory(HandBuilt(base, [16], flags=1)) == (base, 64, "host", -1, True)  # read-only flag


@pytest.mark.parametrize("kw, match", [
    ({"shape": [4, 8], "strides": [1, 4]}, r"not contiguous \(dimension 1 has stride 4 elements, a compact layout has 1"),
    ({"shape": [16], "bits": 4}, "elements of 4 bits are not whole bytes"),
    ({"shape": [16], "major": 2}, r"exports DLPack 2\.x; pdkv reads 1\.x"),
    ({"shape": [3, 0]}, "empty"),
    ({"shape": [-1]}, "negative DLPack dimension"),
    ({"shape": [16], "device": (13, 0)}, "on DLPack device type 13"),
])
def test_hand_built_capsules_that_pdkv_refuses(kw, match):
    shape = kw.pop("shape")
    with pytest.raises(pdkv.InvalidArgument, match=match):
        _memory(HandBuilt(0x10000, shape, **kw))


def test_a_consumed_capsule_is_not_consumed_twice():
    cap_holder = HandBuilt(0x10000, [16])
    cap = cap_holder.__dlpack__(max_version=(1, 0))

    class Replays:
        def __dlpack_device__(self):
            return (1, 0)

        def __dlpack__(self, **kw):
            return cap

    assert _memory(Replays())[1] == 64
    with pytest.raises(pdkv.InvalidArgument, match="named 'used_dltensor_versioned'"):
        _memory(Replays())
