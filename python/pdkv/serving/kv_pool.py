"""The paged KV pool the serving engine computes into and pdkv ships from.

One torch tensor holds the whole pool, ``[num_layers, 2, num_blocks, block_tokens,
kv_heads, head_dim]``; :attr:`PagedKVPool.k_caches` and :attr:`PagedKVPool.v_caches`
are per-layer views ``[num_blocks, block_tokens, kv_heads, head_dim]`` ("NHD", as in
vLLM and FlashInfer). Because the pool is one allocation it is registered with a
:class:`pdkv.Agent` once (:meth:`PagedKVPool.register`); :meth:`PagedKVPool.layout`
describes the per-layer views so that any block id list maps to byte extents.

A token at position ``p`` of a request whose block table is ``block_ids`` lives in
block ``block_ids[p // block_tokens]``, row ``p % block_tokens``: its *slot* is
``block_ids[p // block_tokens] * block_tokens + p % block_tokens`` in the flattened
``[num_blocks * block_tokens, kv_heads, head_dim]`` view of each layer's K and V.

Thread safety: :class:`BlockAllocator` is not thread-safe; the engine guards it with
its own lock. Tensor contents are written only by the engine's step.

Example
-------
>>> import pdkv
>>> from pdkv.serving.kv_pool import PagedKVPool
>>> geo = pdkv.KVGeometry(num_layers=2, num_blocks=8, block_tokens=4, kv_heads=2, head_dim=16,
...                       dtype="bfloat16")
>>> pool = PagedKVPool(geo)
>>> tuple(pool.k_caches[0].shape)
(8, 4, 2, 16)
>>> table = pool.allocator.alloc(pool.blocks_for(6))   # a 6-token prompt
>>> table, pool.slots(table, 4, 6).tolist()
([0, 1], [4, 5])
>>> with pdkv.Agent("doc", secret="s") as agent:
...     region = pool.register(agent, "kv")            # one registration for the whole pool
...     agent.layout("kv").geometry == geo
True
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterable, Sequence

import torch

import pdkv
from pdkv.errors import InvalidArgument, ResourceExhausted

__all__ = ["BlockAllocator", "PagedKVPool"]


class BlockAllocator:
    """Free list of block ids ``0 .. num_blocks-1`` (no reference counts).

    Parameters
    ----------
    num_blocks : int
        Pool size in blocks.
    order : sequence of int, optional
        Initial free-list order (a permutation of ``range(num_blocks)``); ids are
        handed out from its front and freed ids go to its back. Default: ascending.
        Tests pass a shuffled order to get scattered, non-contiguous block tables.
    """

    def __init__(self, num_blocks: int, *, order: Sequence[int] | None = None) -> None:
        if num_blocks <= 0:
            raise InvalidArgument(f"num_blocks must be positive, got {num_blocks}")
        ids = list(range(num_blocks)) if order is None else [int(i) for i in order]
        if sorted(ids) != list(range(num_blocks)):
            raise InvalidArgument(f"order must be a permutation of range({num_blocks})")
        self._num_blocks = num_blocks
        self._free: deque[int] = deque(ids)
        self._used: set[int] = set()

    @property
    def num_blocks(self) -> int:
        """Total blocks."""
        return self._num_blocks

    @property
    def num_free(self) -> int:
        """Blocks not allocated."""
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        """Takes ``n`` free block ids.

        Raises
        ------
        ResourceExhausted
            Fewer than ``n`` blocks are free (nothing is allocated then).
        """
        if n < 0:
            raise InvalidArgument(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise ResourceExhausted(f"KV pool exhausted: {n} blocks requested, {len(self._free)} free "
                                    f"of {self._num_blocks}")
        out = [self._free.popleft() for _ in range(n)]
        self._used.update(out)
        return out

    def free(self, block_ids: Iterable[int]) -> None:
        """Returns blocks to the free list.

        Raises
        ------
        InvalidArgument
            A block id is not currently allocated (double free or foreign id); no
            block is freed then.
        """
        ids = list(block_ids)
        bad = [i for i in ids if i not in self._used]
        if bad or len(set(ids)) != len(ids):
            raise InvalidArgument(f"freeing blocks that are not allocated (or twice): {bad or ids}")
        self._used.difference_update(ids)
        self._free.extend(ids)


class PagedKVPool:
    """Per-layer paged K and V caches in one tensor, plus a block allocator.

    Parameters
    ----------
    geometry : pdkv.KVGeometry
        Layers, blocks, tokens per block, KV heads, head dim and dtype. Must be
        ``kv_parts=2`` and ``order="NHD"``. Build it with
        :meth:`pdkv.KVGeometry.from_hf_config` or use :meth:`from_hf_config`.
    device : str or torch.device
        Where the pool lives (``"cpu"`` or a CUDA device). Ignored with ``storage``.
    block_order : sequence of int, optional
        Initial free-list order of the allocator (see :class:`BlockAllocator`).
    storage : torch.Tensor, optional
        Memory to build the pool on instead of a new allocation: a contiguous tensor of
        :meth:`storage_shape` ``(geometry)`` in the geometry's dtype (for example a view
        of :meth:`pdkv.Agent.alloc` memory, see :meth:`shared`). It is zero-filled.

    Attributes
    ----------
    storage : torch.Tensor
        ``[num_layers, 2, num_blocks, block_tokens, kv_heads, head_dim]``, zero-filled.
    k_caches, v_caches : list of torch.Tensor
        Views ``[num_blocks, block_tokens, kv_heads, head_dim]``, one per layer.
    allocator : BlockAllocator
    region : pdkv.SharedRegion or None
        The pdkv-allocated memory under the pool when built by :meth:`shared`.
    """

    def __init__(self, geometry: pdkv.KVGeometry, *, device: str | torch.device = "cpu",
                 block_order: Sequence[int] | None = None, storage: torch.Tensor | None = None) -> None:
        if geometry.kv_parts != 2 or geometry.order != "NHD":
            raise InvalidArgument(f"PagedKVPool needs kv_parts=2 and order='NHD', got {geometry}")
        dtype = getattr(torch, geometry.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise InvalidArgument(f"torch has no dtype {geometry.dtype!r}")
        self.geometry = geometry
        self.region: pdkv.SharedRegion | None = None
        g = geometry
        shape = self.storage_shape(g)
        if storage is None:
            self.storage = torch.zeros(shape, dtype=dtype, device=device)
        else:
            if tuple(storage.shape) != shape or storage.dtype != dtype or not storage.is_contiguous():
                raise InvalidArgument(f"storage must be a contiguous {dtype} tensor of shape {shape}, got "
                                      f"{storage.dtype} {tuple(storage.shape)}"
                                      f"{'' if storage.is_contiguous() else ' (not contiguous)'}")
            storage.zero_()
            self.storage = storage
        self.k_caches: list[torch.Tensor] = [self.storage[i, 0] for i in range(g.num_layers)]
        self.v_caches: list[torch.Tensor] = [self.storage[i, 1] for i in range(g.num_layers)]
        # [num_blocks * block_tokens, kv_heads, head_dim] views for slot indexing.
        self._k_flat = [k.view(-1, g.kv_heads, g.head_dim) for k in self.k_caches]
        self._v_flat = [v.view(-1, g.kv_heads, g.head_dim) for v in self.v_caches]
        self.allocator = BlockAllocator(g.num_blocks, order=block_order)

    @staticmethod
    def storage_shape(geometry: pdkv.KVGeometry) -> tuple[int, ...]:
        """Shape of the pool's one tensor: ``(num_layers, 2, num_blocks, block_tokens,
        kv_heads, head_dim)``."""
        g = geometry
        return (g.num_layers, 2, g.num_blocks, g.block_tokens, g.kv_heads, g.head_dim)

    @classmethod
    def shared(cls, agent: pdkv.Agent, geometry: pdkv.KVGeometry, *, layout_name: str = "kv",
               block_order: Sequence[int] | None = None) -> "PagedKVPool":
        """A CPU pool in memory ``agent`` allocates (:meth:`pdkv.Agent.alloc`), registered
        and exported under ``layout_name``.

        Same-host peers then move its blocks with the ``shm`` transport (one memcpy)
        instead of a socket; other peers use tcp as with any registered memory. Do not
        call :meth:`register` on it (it is registered already). Close
        :attr:`region` (or the agent) before dropping the pool; the tensor views stay
        valid after that.

        Parameters
        ----------
        agent : pdkv.Agent
        geometry : pdkv.KVGeometry
            See the class parameters.
        layout_name : str
            Name of the layout peers address its blocks by.
        block_order : sequence of int, optional
        """
        dtype = getattr(torch, geometry.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise InvalidArgument(f"torch has no dtype {geometry.dtype!r}")
        region = agent.alloc(geometry.pool_bytes)
        try:
            pool = cls(geometry, block_order=block_order, storage=region.tensor(dtype, cls.storage_shape(geometry)))
            agent.add_layout(layout_name, pool.layout())
        except BaseException:
            region.close()
            raise
        pool.region = region
        return pool

    @classmethod
    def from_hf_config(cls, config: Any, *, num_blocks: int, block_tokens: int = 16, dtype: Any = None,
                       device: str | torch.device = "cpu",
                       block_order: Sequence[int] | None = None) -> "PagedKVPool":
        """A pool for a Hugging Face model's config (see :meth:`pdkv.KVGeometry.from_hf_config`).

        Parameters
        ----------
        config : transformers.PretrainedConfig
        num_blocks, block_tokens : int
        dtype : torch.dtype or str, optional
            Defaults to the config's dtype; must equal the model's compute dtype.
        """
        geo = pdkv.KVGeometry.from_hf_config(config, num_blocks=num_blocks, block_tokens=block_tokens,
                                             dtype=dtype)
        return cls(geo, device=device, block_order=block_order)

    # ------------------------------------------------------------------ geometry
    @property
    def num_layers(self) -> int:
        return self.geometry.num_layers

    @property
    def num_blocks(self) -> int:
        return self.geometry.num_blocks

    @property
    def block_tokens(self) -> int:
        return self.geometry.block_tokens

    @property
    def kv_heads(self) -> int:
        return self.geometry.kv_heads

    @property
    def head_dim(self) -> int:
        return self.geometry.head_dim

    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    @property
    def device(self) -> torch.device:
        return self.storage.device

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole pool can hold (``num_blocks * block_tokens``)."""
        return self.num_blocks * self.block_tokens

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens (``ceil(num_tokens / block_tokens)``)."""
        return -(-num_tokens // self.block_tokens)

    # ------------------------------------------------------------------ slots
    def flat_k(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s K cache as ``[num_blocks * block_tokens, kv_heads, head_dim]``."""
        return self._k_flat[layer]

    def flat_v(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s V cache as ``[num_blocks * block_tokens, kv_heads, head_dim]``."""
        return self._v_flat[layer]

    def slots(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Flat slot indices of token positions ``start .. end-1`` of a block table.

        Returns
        -------
        torch.Tensor
            ``[end - start]`` int64 on the pool's device.
        """
        if not 0 <= start <= end or end > len(block_ids) * self.block_tokens:
            raise InvalidArgument(f"positions [{start}, {end}) do not fit {len(block_ids)} blocks of "
                                  f"{self.block_tokens} tokens")
        pos = torch.arange(start, end, dtype=torch.int64)
        table = torch.as_tensor(list(block_ids), dtype=torch.int64)
        out = table[pos // self.block_tokens] * self.block_tokens + pos % self.block_tokens
        return out.to(self.device)

    # ------------------------------------------------------------------ pdkv
    def layout(self) -> pdkv.KVLayout:
        """The pool as a :class:`pdkv.KVLayout` (per-layer K and V views, NHD)."""
        return pdkv.KVLayout.from_tensors(self.k_caches, self.v_caches)

    def register(self, agent: pdkv.Agent, layout_name: str = "kv") -> pdkv.Region:
        """Registers the pool's memory with ``agent`` (once) and adds its layout as ``layout_name``.

        Returns
        -------
        pdkv.Region
            Close it (or the agent) before dropping the pool.

        Raises
        ------
        AlreadyExists
            The pool was built by :meth:`shared` (already registered) or registered before.
        """
        if self.region is not None:
            raise pdkv.AlreadyExists("this pool lives in pdkv-allocated memory and is registered already")
        region = agent.register(self.storage)
        agent.add_layout(layout_name, self.layout())
        return region

    def copy_blocks_to(self, other: "PagedKVPool", src_ids: Sequence[int], dst_ids: Sequence[int]) -> None:
        """Copies blocks ``src_ids`` of this pool into blocks ``dst_ids`` of ``other``
        (every layer, K and V) with torch indexing; a reference for what pdkv moves.

        The two pools must have the same geometry apart from ``num_blocks``.
        """
        if len(src_ids) != len(dst_ids):
            raise InvalidArgument(f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
        if other.storage.shape[3:] != self.storage.shape[3:] or other.num_layers != self.num_layers \
                or other.dtype != self.dtype:
            raise InvalidArgument("pools differ in geometry or dtype")
        src = torch.as_tensor(list(src_ids), dtype=torch.int64, device=self.device)
        dst = torch.as_tensor(list(dst_ids), dtype=torch.int64, device=other.device)
        other.storage[:, :, dst] = self.storage[:, :, src].to(other.device)

    def __repr__(self) -> str:
        g = self.geometry
        return (f"PagedKVPool(layers={g.num_layers}, blocks={g.num_blocks}, block_tokens={g.block_tokens}, "
                f"kv_heads={g.kv_heads}, head_dim={g.head_dim}, dtype={g.dtype}, device={self.device}, "
                f"free={self.allocator.num_free})")
