"""How the vLLM connector describes vLLM's KV cache tensors as one pdkv layout.

Kept apart from :mod:`pdkv.integrations.vllm` (which imports vLLM) so that it is
tested without vLLM, on tensors of the shapes vLLM's attention backends allocate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import InvalidArgument
from ..layout import KVLayout


@dataclass(frozen=True)
class VllmKVLayout:
    """vLLM's per-layer caches as one exact pdkv layout.

    ``layout`` has one block per *kernel* block: an attention backend may split
    each of vLLM's logical blocks into ``phys_per_block`` kernel blocks of
    ``block_size / phys_per_block`` tokens.
    """

    layout: KVLayout
    phys_per_block: int
    kind: str  # "gpu", "flashinfer", "cpu" or "mla" (see KVLayout.from_vllm)


def _kind(t: Any) -> str:
    """The backend's shape, as KVLayout.from_vllm names it; [2, ...] wins when both
    leading dimensions are 2 (FlashAttention's order, which vLLM uses by default)."""
    shape = tuple(t.shape)
    if len(shape) == 5:
        return "gpu" if shape[0] == 2 else "flashinfer"
    return {4: "cpu", 3: "mla"}.get(len(shape), "auto")


def describe_kv_caches(kv_caches: Mapping[str, Any], *, logical_blocks: int | None = None,
                       num_kv_heads: int | None = None, head_size: int | None = None) -> VllmKVLayout:
    """The exact layout of vLLM's KV caches (one tensor per layer, in layer order).

    Parameters
    ----------
    kv_caches : mapping of layer name to tensor
        As vLLM passes them to ``register_kv_caches``: FlashAttention
        ``[2, num_blocks, block_size, H, D]``, FlashInfer ``[num_blocks, 2, block_size,
        H, D]`` (NHD, or HND through its strides), CPU ``[num_blocks, H, block_size,
        2*D]`` (K and V interleaved per head), MLA ``[num_blocks, block_size, latent]``.
    logical_blocks : int, optional
        vLLM's number of KV blocks (``KVCacheConfig.num_blocks``); the tensors may
        hold a whole multiple of it (kernel blocks).
    num_kv_heads, head_size : int, optional
        The KV cache spec's; checked against the tensors when given (they tell a CPU
        cache's ``2*head_size`` apart from anything else).

    Raises
    ------
    InvalidArgument
        Shapes or strides that are no known vLLM layout, layers that differ, or a
        kernel block count that does not split into ``logical_blocks``.
    """
    tensors = list(kv_caches.values())
    if not tensors:
        raise InvalidArgument("no KV caches to describe")
    kind = _kind(tensors[0])
    for name, t in kv_caches.items():
        if _kind(t) != kind:
            raise InvalidArgument(f"layer {name} has shape {tuple(t.shape)}, unlike the first layer's "
                                  f"{tuple(tensors[0].shape)}")
    if kind == "mla":
        num_kv_heads = None  # the latent cache has no heads; from_vllm gives it one
    layout = KVLayout.from_vllm(tensors, num_kv_heads=num_kv_heads, kv_layout=kind)
    geo = layout.geometry
    if head_size is not None and kind != "mla" and geo.head_dim != head_size:
        raise InvalidArgument(f"the KV caches ({kind} layout, shape {tuple(tensors[0].shape)}) hold heads of "
                              f"{geo.head_dim} elements, the KV cache spec says head_size={head_size}")
    phys = 1
    if logical_blocks:
        if geo.num_blocks % logical_blocks:
            raise InvalidArgument(f"{geo.num_blocks} kernel blocks do not split into {logical_blocks} logical blocks")
        phys = geo.num_blocks // logical_blocks
    return VllmKVLayout(layout, phys, kind)
