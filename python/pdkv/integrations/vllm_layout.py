"""How the vLLM connector describes vLLM's KV cache tensors as pdkv layouts, and
which blocks hold a request's tokens when prefill and decode use different block
sizes.

Kept apart from :mod:`pdkv.integrations.vllm` (which imports vLLM) so that it is
tested without vLLM, on tensors of the shapes vLLM's attention backends allocate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import InvalidArgument
from ..layout import KVGeometry, KVLayout


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


# ---------------------------------------------------------------------------- vLLM CPU caches per token
#: How vLLM 0.32's CPU attention kernels pack a block, by the ISA its ``_get_attn_isa``
#: picks, and how many tokens one token of :func:`cpu_token_layout` carries.
CPU_PACKING_GRANULE = {"vec": 1, "amx": 16}


def cpu_token_layout(kv_caches: Mapping[str, Any], packing: str = "vec") -> KVLayout:
    """Where each token's K and V elements sit in vLLM CPU caches written by the
    ``packing`` kernels (:data:`CPU_PACKING_GRANULE`), for pulls between block sizes.

    ``"vec"`` (x86 without AMX, any dtype, block sizes that are multiples of 32): a
    cache ``[num_blocks, kv_heads, block_size, 2*head_size]`` holds, per (block,
    head), K transposed (``[head_size, block_size]``: a dimension's tokens are
    contiguous) followed by V (``[block_size, head_size]``). No (token, head) row is
    contiguous in K, so this layout has one element per row: layer ``l * kv_heads + h``
    is (layer l, head h), its "heads" are the ``head_size`` dimensions. pdkv's planner
    then moves a run of tokens per (layer, head, K dimension) and one per (layer, head)
    for V between two block sizes.

    ``"amx"`` (bfloat16 with AMX, ``csrc/cpu/cpu_attn_amx.hpp`` ``reshape_and_cache``):
    per (block, head), K is groups of 16 tokens, each ``[head_size/2, 16, 2]`` (pairs
    of dimensions, token-major inside a pair), then V is ``[head_size/16,
    block_size/2, 16, 2]`` (16 dimensions per group, pairs of tokens innermost). A
    token's place inside its group of 16 does not depend on the block size, so this
    layout's "tokens" are 16-token groups (:data:`CPU_PACKING_GRANULE`): its heads are
    the ``head_size/16`` 256-element rows a group holds in K (16 dimensions x 16
    tokens, contiguous) and in V (8 token pairs x 16 dimensions, contiguous; the next
    16 dimensions are ``block_size*16`` elements on). A pull of ``n`` tokens moves
    ``ceil(n/16)`` such tokens: the last group's places past ``n`` carry prefill's
    bytes into places decode writes itself before it reads them.

    Only valid for caches the kernel really packs this way: the connector checks that
    on vLLM's own cache kernel first (:func:`pdkv.integrations.vllm_worker._probe_cpu_packing`).

    Raises
    ------
    InvalidArgument
        Tensors that are not contiguous CPU caches of one shape, an unknown packing, or
        (``"amx"``) a dtype other than 2 bytes or sizes that are not multiples of 16.
    """
    tensors = list(kv_caches.values())
    if not tensors or any(len(t.shape) != 4 for t in tensors):
        raise InvalidArgument("expected vLLM CPU caches [num_blocks, kv_heads, block_size, 2*head_size]")
    if packing not in CPU_PACKING_GRANULE:
        raise InvalidArgument(f"unknown vLLM CPU packing {packing!r} (known: {', '.join(CPU_PACKING_GRANULE)})")
    shape, e = tuple(tensors[0].shape), tensors[0].element_size()
    nb, heads, bs, d2 = shape
    dim = d2 // 2
    if packing == "amx" and (e != 2 or bs % 16 or dim % 16):
        raise InvalidArgument(f"vLLM's AMX packing needs 2-byte elements and block and head sizes that are multiples "
                              f"of 16, got {e}-byte elements, {bs}-token blocks, head size {dim}")
    segments = []
    for i, t in enumerate(tensors):
        if tuple(t.shape) != shape or not t.is_contiguous():
            raise InvalidArgument(f"layer {i}: shape {tuple(t.shape)} (contiguous {t.is_contiguous()}) is not the "
                                  f"first layer's contiguous {shape}")
        block_stride, head_stride = t.stride(0) * e, t.stride(1) * e
        for h in range(heads):
            slab = t.data_ptr() + h * head_stride
            if packing == "vec":
                segments.append((slab, block_stride, e, bs * e))  # K[d, t]: tokens contiguous per dimension
                segments.append((slab + bs * dim * e, block_stride, dim * e, e))  # V[t, d]
            else:
                segments.append((slab, block_stride, 16 * dim * e, 256 * e))  # K: group g at 16*dim*g
                segments.append((slab + bs * dim * e, block_stride, 256 * e, bs * 16 * e))  # V: group at 256*g
    if packing == "vec":
        geo = KVGeometry(len(tensors) * heads, nb, bs, dim, 1, tensors[0].dtype, kv_parts=2, order="HND")
    else:
        geo = KVGeometry(len(tensors) * heads, nb, bs // 16, dim // 16, 256, tensors[0].dtype, kv_parts=2,
                         order="HND")
    return KVLayout.from_strided(geo, segments, keepalive=tensors)


def cpu_token(cache: Any, block: int, head: int, token: int, packing: str = "vec") -> tuple[Any, Any]:
    """(K, V) of one token and head, ``head_size`` elements each, in a CPU cache of
    ``packing`` (the reference the probe and the tests compare with; K and V as
    vLLM's ``reshape_and_cache`` placed them, written out index by index)."""
    nb, heads, bs, d2 = cache.shape
    dim = d2 // 2
    slab = cache.reshape(nb, heads, bs * d2)[block, head]
    if packing == "vec":
        return slab[token:bs * dim:bs], slab[bs * dim + token * dim:bs * dim + (token + 1) * dim]
    if packing != "amx":
        raise InvalidArgument(f"unknown vLLM CPU packing {packing!r}")
    group, t = divmod(token, 16)
    k = [group * 16 * dim + (d // 2) * 32 + t * 2 + d % 2 for d in range(dim)]
    v = [bs * dim + (token // 2) * 32 + token % 2 + (d // 16) * bs * 16 + (d % 16) * 2 for d in range(dim)]
    return slab[k], slab[v]


# ---------------------------------------------------------------------------- pulls between block sizes
@dataclass(frozen=True)
class PullSpan:
    """What one pull moves: the prompt tokens ``[start, end)``.

    They sit in decode's blocks ``[local_first, local_last)`` of ``local_block_size``
    tokens and in prefill's blocks ``[remote_first, remote_last)`` of
    ``remote_block_size`` tokens (positions in each side's block list of the
    request). Both ranges begin at a block boundary, as pdkv's planner maps the
    tokens ``[0, num_tokens)`` of one block list onto those of the other.
    """

    start: int
    end: int
    local_block_size: int
    remote_block_size: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def local_first(self) -> int:
        return self.start // self.local_block_size

    @property
    def local_last(self) -> int:
        return -(-self.end // self.local_block_size)

    @property
    def remote_first(self) -> int:
        return self.start // self.remote_block_size

    @property
    def remote_last(self) -> int:
        return -(-self.end // self.remote_block_size)

    @property
    def plan_tokens(self) -> int:
        """``num_tokens`` for :meth:`pdkv.Agent.read`: 0 (whole blocks, partial last
        block included) when both sides use one block size, else the exact count."""
        return 0 if self.local_block_size == self.remote_block_size else self.num_tokens


def _positive(value: Any, name: str) -> int:
    if type(value) is not int or value <= 0:
        raise InvalidArgument(f"{name} must be a positive integer, got {value!r}")
    return value


def pull_span(start: int, end: int, local_block_size: int, remote_block_size: int) -> PullSpan:
    """The blocks on each side that hold prompt tokens ``[start, end)``.

    Parameters
    ----------
    start : int
        First token to pull: decode's local prefix-cache hit, a whole number of
        decode's blocks.
    end : int
        One past the last token prefill computed.
    local_block_size, remote_block_size : int
        Tokens per block of decode's and of prefill's vLLM (``cache_config.block_size``).

    Raises
    ------
    InvalidArgument
        An empty or negative range, a non-positive block size, or a ``start`` inside
        a block of either side (see :func:`splits_remote_block`).
    """
    local_block_size = _positive(local_block_size, "local_block_size")
    remote_block_size = _positive(remote_block_size, "remote_block_size")
    if type(start) is not int or type(end) is not int or not 0 <= start < end:
        raise InvalidArgument(f"token range [{start}, {end}) is empty or negative")
    if start % local_block_size:
        raise InvalidArgument(f"the pull starts at token {start}, inside one of decode's "
                              f"{local_block_size}-token blocks")
    if splits_remote_block(start, remote_block_size):
        raise InvalidArgument(f"the pull starts at token {start}, inside one of prefill's "
                              f"{remote_block_size}-token blocks")
    return PullSpan(start, end, local_block_size, remote_block_size)


def splits_remote_block(start: int, remote_block_size: int) -> bool:
    """True when a pull from token ``start`` would begin inside one of prefill's
    blocks: decode holds that block's first tokens already (a prefix-cache hit of an
    odd number of 16-token blocks against prefill's 32-token ones, say). pdkv's
    planner moves whole block lists from token 0, so such a request is computed by
    decode instead of pulled."""
    return start % remote_block_size != 0


def kernel_block_ids(block_ids: list[int], per_block: int) -> list[int]:
    """vLLM block ids -> the layout's kernel block ids (``per_block`` kernel blocks
    of each logical block, in token order)."""
    if per_block == 1:
        return list(block_ids)
    return [b * per_block + i for b in block_ids for i in range(per_block)]


def kernel_blocks_per_block(block_size: int, kernel_block_tokens: int, side: str) -> int:
    """How many kernel blocks of ``kernel_block_tokens`` make one ``block_size``-token
    vLLM block (``side`` names the instance in the error)."""
    if kernel_block_tokens <= 0 or block_size % kernel_block_tokens:
        raise InvalidArgument(f"{side}'s vLLM blocks of {block_size} tokens do not split into its KV layout's "
                              f"{kernel_block_tokens}-token blocks")
    return block_size // kernel_block_tokens


def check_pullable(local: Any, remote: Any) -> None:
    """Raises :class:`InvalidArgument` naming what differs when decode (``local``
    :class:`pdkv.KVGeometry`) cannot pull from prefill (``remote``). Block sizes
    (and strides) may differ; layers, KV heads, head size, dtype and K/V parts must
    not: a TP or model difference is recomputed, never pulled in part."""
    fields = (("layers", "num_layers"), ("KV heads", "kv_heads"), ("head size", "head_dim"), ("dtype", "dtype"),
              ("KV parts", "kv_parts"))
    diff = [f"{label} {getattr(remote, attr)} vs {getattr(local, attr)}" for label, attr in fields
            if getattr(remote, attr) != getattr(local, attr)]
    if diff:
        raise InvalidArgument(f"prefill's KV cache differs from decode's in {', '.join(diff)} (prefill vs decode; "
                              f"prefill {remote}, decode {local}): not pulled, decode recomputes")


#: ``kv_connector_extra_config["compress"]`` values: how decode's pulls over tcp ask
#: prefill to compress the KV (prefill encodes what the reader asks; nothing to set there).
CONNECTOR_COMPRESS_MODES = ("off", "lossless", "auto")


def connector_compression(mode: Any, dtype: str) -> Any:
    """The connector agent's ``TcpCompression`` for ``compress=mode`` on a KV cache of
    ``dtype`` (``"bfloat16"``, ``"float16"``, ``"float32"``), or None for ``"off"``/None.

    Lossless only (``auto`` never chooses FP8 here): FP8 needs one scale per head per
    block, and vLLM's CPU cache interleaves K and V per head, which a scale group would
    mix. Raises InvalidArgument naming a bad mode or a dtype the codec does not take."""
    from .. import TcpCompression

    if mode is None or mode == "off":
        return None
    if mode not in CONNECTOR_COMPRESS_MODES:
        raise InvalidArgument(f"pdkv connector: compress must be one of {', '.join(CONNECTOR_COMPRESS_MODES)}, "
                              f"got {mode!r}" + (" (FP8 is not offered for vLLM caches: K and V share a "
                                                 "head's block, a scale group would mix them)" if mode == "fp8" else ""))
    if dtype not in ("bfloat16", "float16", "float32"):
        raise InvalidArgument(f"pdkv connector: compress={mode!r} needs a bfloat16, float16 or float32 KV cache, "
                              f"this one is {dtype}")
    return TcpCompression(mode=mode, dtype=dtype, policy="lossless")
