"""The memory half of :class:`pdkv.Agent`: registering memory (``register``, ``alloc``,
``register_address``), KV layouts over it, and block generations. A mixin: the agent
owns the state it uses (``_n``, the native agent; ``_lock``; ``_regions``;
``_layout_keep``)."""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any, Iterable

from . import _native, _validate
from .errors import InvalidArgument, NotFound, OutOfRange
from .layout import KVLayout, _describe_memory
from .region import Region, SharedRegion

if TYPE_CHECKING:
    from ._pdkv import Blocks
    from .device import DeviceRegion

__all__: list[str] = []


class AgentMemory:
    """Registration, layouts and generations of an :class:`~pdkv.Agent` (see there)."""

    _n: Any
    _lock: threading.Lock
    _regions: dict[int, Region]
    _layout_keep: dict[str, KVLayout]

    # ------------------------------------------------------------------ memory
    def register(self, obj: Any, *, remote_access: bool = True) -> Region:
        """Registers the memory of ``obj``: a numpy array, a torch tensor (CPU or CUDA;
        its whole storage extent), any DLPack exporter (``__dlpack__`` and
        ``__dlpack_device__``: jax, cupy, ...; read natively from the capsule, so
        neither numpy nor torch is needed; CPU or CUDA, contiguous), or any contiguous
        writable buffer-protocol object. (Memory from :meth:`alloc` is registered
        already.) The region keeps ``obj`` alive until it is closed.

        Overlapping an existing registration raises :class:`~pdkv.errors.AlreadyExists`:
        register each pool once. ``remote_access=False`` keeps it local (a source for
        writes and a destination for reads, invisible to peers). Anything else (lists,
        DLPack capsules, read-only buffers peers could write into) raises
        :class:`~pdkv.errors.InvalidArgument`.
        """
        if isinstance(obj, Region):
            raise InvalidArgument(f"{obj!r} is registered already (Agent.alloc registers the memory it returns)")
        remote_access = _validate.flag(remote_access, "remote_access")
        mem = _describe_memory(obj)
        if mem.readonly and remote_access:
            raise InvalidArgument(f"cannot register a read-only {type(obj).__name__} with remote_access=True: "
                                  "peers would write into it (pass remote_access=False for a write source)")
        return self._register(mem.addr, mem.nbytes, mem.kind, mem.device, remote_access, mem.keepalive)

    def alloc(self, nbytes: int, *, device: int | None = None,
              remote_access: bool = True) -> SharedRegion | DeviceRegion:
        """Allocates ``nbytes`` of memory pdkv owns and registers it.

        ``device=None`` (default): shareable host memory (a memfd). Same-host peers
        then reach it with one memcpy (the ``shm`` transport) instead of a socket. Build
        your KV pool on it with ``region.array(...)`` or ``region.tensor(...)``; the
        memory is zero-filled.

        ``device=N``: device memory on CUDA device N, allocated through cuda-python's
        driver bindings (``cuMemAlloc`` in the device's primary context; not zeroed), as
        a :class:`~pdkv.device.DeviceRegion`: a DLPack exporter (``torch.from_dlpack``,
        ``cupy.from_dlpack``), with ``copy_from_host``/``copy_to_host``. Closing the
        region, or the agent, frees it. Needs cuda-python (``pip install 'pdkv[gpu]'``)
        and a CUDA driver; without them, or for a device this host does not have, raises
        :class:`~pdkv.errors.NotSupported`.
        """
        if device is not None:
            return self._alloc_device(nbytes, device, remote_access)
        import mmap

        nbytes = _validate.positive_int(nbytes, "nbytes")
        remote_access = _validate.flag(remote_access, "remote_access")
        # Sealable: registration seals it against shrinking and growing, so no peer it
        # is shared with can truncate it under us (SIGBUS).
        fd = os.memfd_create(f"pdkv:{self.name}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            import ctypes

            view = ctypes.c_char.from_buffer(mm)
            addr = ctypes.addressof(view)
            del view
            desc = self._n.register_memory(addr, nbytes, _native.module().MemKind.HOST, -1, remote_access, fd)
        finally:
            os.close(fd)  # the agent keeps its own dup for peers
        region = SharedRegion(self, desc, mm)
        with self._lock:
            self._regions[region.id] = region
        return region

    def _alloc_device(self, nbytes: int, device: Any, remote_access: bool) -> DeviceRegion:
        from .device import DeviceBuffer, DeviceRegion  # imports cuda-python only when called

        nbytes = _validate.positive_int(nbytes, "nbytes")
        remote_access = _validate.flag(remote_access, "remote_access")
        buf = DeviceBuffer(nbytes, device)
        try:
            desc = self._n.register_memory(buf.ptr, nbytes, _native.module().MemKind.CUDA, buf.device, remote_access)
        except BaseException:
            buf.free()
            raise
        region = DeviceRegion(self, desc, buf)
        with self._lock:
            self._regions[region.id] = region
        return region

    def register_address(self, addr: int, nbytes: int, *, kind: str = "host", device: int = -1,
                         remote_access: bool = True, keepalive: Any = None) -> Region:
        """Registers raw memory ``[addr, addr + nbytes)``; the caller keeps it alive."""
        addr = _validate.positive_int(addr, "addr")
        if _validate.count(nbytes, "nbytes", maximum=2**64 - 1) == 0:
            raise InvalidArgument("cannot register an empty range (nbytes=0)")
        if not _validate._is_int(device) or int(device) < -1:
            raise InvalidArgument(f"device must be a CUDA ordinal or -1, got {device!r}")
        remote_access = _validate.flag(remote_access, "remote_access")
        return self._register(addr, int(nbytes), kind, int(device), remote_access, keepalive)

    def _register(self, addr: int, nbytes: int, kind: str, device: int, remote: bool, obj: Any) -> Region:
        m = _native.module()
        if kind not in ("host", "cuda"):
            raise InvalidArgument(f"kind must be 'host' or 'cuda', got {kind!r}")
        mk = m.MemKind.HOST if kind == "host" else m.MemKind.CUDA
        desc = self._n.register_memory(addr, nbytes, mk, device if kind == "cuda" else -1, remote)
        region = Region(self, desc, obj)
        with self._lock:
            self._regions[region.id] = region
        return region

    def deregister(self, region: Region) -> None:
        """Same as ``region.close()``."""
        region.close()

    def _deregister(self, region: Region) -> None:
        self._n.deregister_memory(region.id)
        with self._lock:
            self._regions.pop(region.id, None)
            for name in [n for n in self._layout_keep if n not in self._n.layout_names()]:
                del self._layout_keep[name]

    @property
    def regions(self) -> list[Region]:
        with self._lock:
            return list(self._regions.values())

    # ------------------------------------------------------------------ layouts
    def add_layout(self, name: str, layout: KVLayout) -> None:
        """Makes ``layout``'s blocks transferable under ``name`` and exports it to peers.
        Every segment must lie inside one registered region."""
        self._n.add_layout(name, layout.native)
        with self._lock:
            self._layout_keep[name] = layout

    def remove_layout(self, name: str) -> None:
        self._n.remove_layout(name)
        with self._lock:
            self._layout_keep.pop(name, None)

    def layout(self, name: str) -> KVLayout:
        return KVLayout(self._n.layout(name))

    # ------------------------------------------------------------------ block generations
    def generations(self, layout: str, block_ids: Iterable[int]) -> list[int]:
        """Current generations of blocks of a local layout (docs/generations.md).

        Hand them out with the block ids to whoever will write into (or read from) the
        blocks; they pass them as the remote side's ``pdkv.Blocks(layout, ids,
        generations=...)``.
        """
        return self._n.generations(_validate.text(layout, "layout"), _validate.block_ids(block_ids, "block_ids"))

    def bump_generations(self, layout: str, block_ids: Iterable[int], *, timeout: float | None = 30.0) -> list[int]:
        """Invalidates every outstanding reference to these blocks; returns their new
        generations. Call it when freeing or reusing blocks whose ids (and generations)
        were handed to a peer.

        From the moment this is called, a transfer that names the old generation fails
        with :class:`StaleBlock` at this agent before any byte lands (or is sent). The
        call returns once no transfer accepted under the old generation still touches
        the blocks, so they may be reused at once. (An shm read is not waited for: it
        checks this agent's published generations again after its copy, and one still
        copying when this is called fails with :class:`StaleBlock`.)

        Parameters
        ----------
        layout : str
            A local layout.
        block_ids : sequence of int
            Distinct block ids.
        timeout : float or None
            Seconds (finite, > 0) to wait for transfers already accepted under the old
            generation (every such transfer has a deadline); None: no limit.

        Raises
        ------
        TransferTimeout
            Such a transfer still runs after ``timeout``; the new generations are in
            force anyway (new transfers naming the old ones fail).
        NotFound, OutOfRange, InvalidArgument
            Unknown layout, block id beyond it, duplicate ids.
        """
        tmo = _validate.timeout(timeout)
        return self._n.bump_generations(_validate.text(layout, "layout"),
                                        _validate.block_ids(block_ids, "block_ids"), -1.0 if tmo is None else tmo)
