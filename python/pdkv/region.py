"""Registered memory: :class:`Region` (``Agent.register``) and :class:`SharedRegion`
(``Agent.alloc``, memfd pages same-host peers copy into directly)."""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from .errors import InvalidArgument



class _Owner(Protocol):
    """The agent a region is registered with (what a region uses of it)."""

    def _deregister(self, region: "Region") -> None: ...

__all__ = ["Region", "SharedRegion"]


class Region:
    """Memory registered with an agent. ``close()`` (or leaving a ``with`` block)
    deregisters it, waiting for transfers that use it. Keeps the registered object
    alive while registered."""

    def __init__(self, agent: _Owner, desc: dict, obj: Any) -> None:
        self._agent = agent
        self._desc = desc
        self._obj = obj
        self._mm = obj
        self._closed = False

    id = property(lambda self: self._desc["id"], doc="Region id (unique in this agent, never reused).")
    addr = property(lambda self: self._desc["addr"], doc="Start address.")
    nbytes = property(lambda self: self._desc["len"], doc="Length in bytes.")
    kind = property(lambda self: self._desc["kind"], doc="'host' or 'cuda'.")
    device = property(lambda self: self._desc["device"], doc="CUDA ordinal, or -1 for host.")
    remote_access = property(lambda self: self._desc["remote_access"], doc="Exported to peers.")
    shared_bytes = property(lambda self: self._desc.get("shared_len", 0),
                            doc="Bytes same-host peers copy into directly (memfd-backed): all of an "
                                ":meth:`Agent.alloc` region; the whole pages of engine memory re-mapped at "
                                "registration (``ShmOptions.share_pages_min_bytes``); 0 otherwise (cross-memory "
                                "attach).")
    shared_offset = property(lambda self: self._desc.get("shared_offset", 0),
                             doc="Offset of the first shared byte from :attr:`addr`.")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Deregisters; blocks until transfers using this region finish. Idempotent."""
        if not self._closed:
            self._closed = True
            self._agent._deregister(self)
            self._obj = None
            self._mm = None

    def __enter__(self) -> "Region":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Region(id={self.id}, addr=0x{self.addr:x}, nbytes={self.nbytes}, kind={self.kind!r})"


class SharedRegion(Region):
    """Memory pdkv allocated as shareable (memfd) pages: same-host peers map it once
    and copy straight into it (the shm transport). Use it as your KV pool through
    :meth:`array` or :meth:`tensor` views; views stay valid even after ``close()``."""

    @property
    def shareable(self) -> bool:
        return True

    def array(self, dtype: Any = "uint8", shape: Sequence[int] | None = None, offset: int = 0) -> Any:
        """A numpy view of the memory (``shape=None``: 1-D over everything after ``offset``)."""
        import numpy as np

        dt = np.dtype(dtype)
        count = -1 if shape is None else int(np.prod(shape))
        a = np.frombuffer(self._mmap, dtype=dt, count=count, offset=offset)
        return a if shape is None else a.reshape(shape)

    def tensor(self, dtype: Any, shape: Sequence[int], offset: int = 0) -> Any:
        """A torch CPU tensor view of the memory (needs torch)."""
        import torch

        n = 1
        for d in shape:
            n *= int(d)
        return torch.frombuffer(self._mmap, dtype=dtype, count=n, offset=offset).view(*shape)

    @property
    def _mmap(self) -> Any:
        if self._mm is None:
            raise InvalidArgument("region is closed")
        return self._mm
