"""Paged KV-cache layouts: geometry, where each (layer, K/V) lives, block ids -> bytes.

A KV pool has ``num_layers`` layers, each with a K and a V part (``kv_parts=2``) or a
single latent part (``kv_parts=1``, MLA). Each (layer, part) holds ``num_blocks``
blocks of ``block_tokens x kv_heads`` rows of ``head_dim`` contiguous elements; the
row of (block ``b``, token slot ``t``, head ``h``) starts at
``addr + b*block_stride + t*token_stride + h*head_stride`` (bytes). Dense blocks are
``"NHD"`` ``[block_tokens, kv_heads, head_dim]`` or ``"HND"``
``[kv_heads, block_tokens, head_dim]``; general strides cover:

* per-layer K and V tensors ``[num_blocks, T, H, D]`` (vLLM, FlashInfer NHD),
* K/V interleaved per block ``[num_blocks, 2, T, H, D]`` (pass ``t[:, 0]``, ``t[:, 1]``),
* vLLM's ``[2, num_blocks, T, H, D]`` per layer (:meth:`KVLayout.from_vllm`),
* vLLM CPU's ``[num_blocks, H, T, 2*D]`` (K and V interleaved per head, :meth:`KVLayout.from_vllm`),
* token pools ``[tokens, H, D]`` paged by ``page_size`` (SGLang, :meth:`KVLayout.from_token_pool`),
* cross-layer blocks and anything else (:meth:`KVLayout.from_strided`),
* one buffer holding every layer (:meth:`KVLayout.contiguous`).

Example
-------
>>> import numpy as np, pdkv
>>> geo = pdkv.KVGeometry(num_layers=2, num_blocks=8, block_tokens=16, kv_heads=2,
...                       head_dim=64, dtype="float16")
>>> pool = np.zeros(geo.pool_bytes, dtype=np.uint8)
>>> layout = pdkv.KVLayout.contiguous(geo, pool)
>>> layout.block_bytes
4096
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Iterable, NamedTuple, Sequence

from . import _native, _validate
from . import transfer as _xfer
from .errors import InvalidArgument

__all__ = ["KVGeometry", "KVLayout", "plan_blocks", "tensor_address"]

_ORDERS = ("NHD", "HND")


def _order_enum(order: str):
    if order not in _ORDERS:
        raise InvalidArgument(f"order must be 'NHD' or 'HND', got {order!r}")
    m = _native.module()
    return m.TokenOrder.NHD if order == "NHD" else m.TokenOrder.HND


def _dtype_name(dtype: Any) -> str:
    """Normalises numpy/torch/str dtypes to pdkv's names ('bfloat16', 'float16', ...)."""
    if isinstance(dtype, str):
        name = dtype
    else:
        name = str(dtype)
        if name.startswith("torch."):
            name = name[len("torch."):]
        elif hasattr(dtype, "name"):  # numpy dtype
            name = dtype.name
    name = {"half": "float16", "float": "float32", "double": "float64", "bool": "uint8"}.get(name, name)
    _native.module().dtype_size(name)  # raises InvalidArgument for unknown names
    return _native.module().dtype_name(name)


@dataclass(frozen=True)
class KVGeometry:
    """Shape of a paged KV pool (no addresses).

    Parameters
    ----------
    num_layers, num_blocks, block_tokens, kv_heads, head_dim : int
        ``kv_heads`` is the number of KV heads this pool holds (after any TP split).
    dtype : str
        Element type: ``"bfloat16"``, ``"float16"``, ``"float32"``, ``"float8_e4m3fn"``, ...
    kv_parts : int
        2 for K and V, 1 for a single latent cache.
    order : str
        ``"NHD"`` or ``"HND"``: element order inside one block.
    """

    num_layers: int
    num_blocks: int
    block_tokens: int
    kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    kv_parts: int = 2
    order: str = "NHD"

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", _dtype_name(self.dtype))
        self.native()  # validates

    def native(self):
        return _native.module().KVGeometry(
            self.num_layers, self.num_blocks, self.block_tokens, self.kv_heads, self.head_dim,
            self.dtype, self.kv_parts, _order_enum(self.order),
        )

    @property
    def itemsize(self) -> int:
        return _native.module().dtype_size(self.dtype)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one (layer, part): ``block_tokens*kv_heads*head_dim*itemsize``."""
        return self.block_tokens * self.kv_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token occupies across all layers and parts."""
        return self.num_layers * self.kv_parts * self.kv_heads * self.head_dim * self.itemsize

    @property
    def pool_bytes(self) -> int:
        """Bytes of the whole pool: ``num_layers * kv_parts * num_blocks * block_bytes``."""
        return self.num_layers * self.kv_parts * self.num_blocks * self.block_bytes

    def with_blocks(self, num_blocks: int) -> "KVGeometry":
        return KVGeometry(self.num_layers, num_blocks, self.block_tokens, self.kv_heads, self.head_dim,
                          self.dtype, self.kv_parts, self.order)

    @classmethod
    def from_hf_config(
        cls,
        config: Any,
        *,
        num_blocks: int,
        block_tokens: int = 16,
        dtype: Any = None,
        tp_size: int = 1,
        order: str = "NHD",
    ) -> "KVGeometry":
        """Geometry of a Hugging Face causal LM's KV cache.

        Parameters
        ----------
        config : transformers.PretrainedConfig or dict
            Reads ``num_hidden_layers``, ``num_key_value_heads`` (falls back to
            ``num_attention_heads``), ``head_dim`` (falls back to
            ``hidden_size // num_attention_heads``) and ``torch_dtype``/``dtype``.
        num_blocks, block_tokens : int
            Pool size and page size.
        dtype : optional
            Overrides the config's dtype.
        tp_size : int
            Tensor-parallel degree: each rank holds ``kv_heads / tp_size`` heads.
        """
        get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
        text = get("text_config")
        if text is not None and get("num_hidden_layers") is None:
            return cls.from_hf_config(text, num_blocks=num_blocks, block_tokens=block_tokens, dtype=dtype,
                                      tp_size=tp_size, order=order)
        layers = get("num_hidden_layers")
        heads = get("num_attention_heads")
        if layers is None or heads is None:
            raise InvalidArgument("config lacks num_hidden_layers / num_attention_heads")
        kv_heads = get("num_key_value_heads") or heads
        head_dim = get("head_dim") or get("hidden_size") // heads
        if kv_heads % tp_size:
            raise InvalidArgument(f"{kv_heads} kv heads do not split over tp_size={tp_size}")
        if dtype is None:
            dtype = get("torch_dtype") or get("dtype") or "float32"
        return cls(int(layers), int(num_blocks), int(block_tokens), int(kv_heads) // tp_size, int(head_dim),
                   _dtype_name(dtype), 2, order)


class _Memory(NamedTuple):
    addr: int
    nbytes: int
    kind: str  # "host" or "cuda"
    device: int  # CUDA ordinal, -1 for host
    readonly: bool
    keepalive: Any  # the object whose lifetime owns the memory


def tensor_address(t: Any) -> tuple[int, int, str, int]:
    """Returns ``(address, nbytes, kind, device)`` of a tensor-like object's memory.

    Accepts numpy arrays (and any buffer-protocol object), torch tensors (CPU or CUDA,
    without importing torch), objects exporting ``__dlpack__`` (see
    :meth:`pdkv.Agent.register`). The bytes are those of the object's *extent*: for a
    strided view, from its first to one past its last element. Anything else raises
    :class:`~pdkv.errors.InvalidArgument`.
    """
    m = _describe_memory(t)
    return m.addr, m.nbytes, m.kind, m.device


def _describe_memory(t: Any) -> _Memory:
    """Pointer, length and owner of anything pdkv can register; InvalidArgument otherwise."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(t, torch.Tensor):
        if t.numel() == 0:
            raise InvalidArgument("cannot use an empty tensor")
        span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
        nbytes = span * t.element_size()
        if t.device.type == "cuda":
            return _Memory(t.data_ptr(), nbytes, "cuda", t.device.index or 0, False, t)
        if t.device.type != "cpu":
            raise InvalidArgument(f"tensors on {t.device} are not supported (cpu or cuda only)")
        return _Memory(t.data_ptr(), nbytes, "host", -1, False, t)
    if type(t).__name__ == "PyCapsule":
        raise InvalidArgument("cannot register a DLPack capsule (pdkv would have to own it): pass the tensor "
                              "or array itself, e.g. numpy.from_dlpack(obj) or torch.from_dlpack(obj)")
    cai = getattr(t, "__cuda_array_interface__", None)
    if cai is not None:
        raise InvalidArgument("objects with __cuda_array_interface__ need an explicit register_address(...)")
    ai = getattr(t, "__array_interface__", None)
    if ai is not None:
        addr, readonly = ai["data"]
        shape = ai["shape"]
        itemsize = int(ai["typestr"][2:])
        strides = ai.get("strides")
        n = 1
        for s in shape:
            n *= s
        if n == 0:
            raise InvalidArgument("cannot use an empty array")
        if strides is None:
            return _Memory(addr, n * itemsize, "host", -1, bool(readonly), t)
        if any(st < 0 for st in strides):
            raise InvalidArgument(f"array has negative strides {strides}: register its base array")
        span = 1 + sum((s - 1) * st // itemsize for s, st in zip(shape, strides))
        return _Memory(addr, span * itemsize, "host", -1, bool(readonly), t)
    if hasattr(t, "__dlpack__") and hasattr(t, "__dlpack_device__"):
        return _from_dlpack(t)
    try:
        memoryview(t).release()
    except TypeError:
        raise InvalidArgument(f"cannot register a {type(t).__name__}: expected an object with a pointer and a length "
                              "(numpy array, torch tensor, __dlpack__ exporter, buffer-protocol object, or "
                              "Agent.alloc)") from None
    addr, nbytes, readonly, contiguous = _native.module().buffer_info(t)
    if not contiguous:
        raise InvalidArgument(f"{type(t).__name__} buffer is not contiguous")
    if nbytes == 0:
        raise InvalidArgument(f"cannot use an empty {type(t).__name__}")
    return _Memory(addr, nbytes, "host", -1, bool(readonly), t)


def _from_dlpack(t: Any) -> _Memory:
    """Any DLPack exporter (CPU or CUDA), read from its capsule by the native module:
    numpy and torch are not needed. The region keeps the exporter and the consumed
    capsule alive."""
    addr, nbytes, kind, device, readonly, keepalive = _native.module().dlpack_memory(t)
    return _Memory(addr, nbytes, kind, device, readonly, keepalive)


def _strides_bytes(t: Any) -> tuple[tuple[int, ...], tuple[int, ...], int, Any, int]:
    """(shape, strides in bytes, address, dtype, itemsize) of a numpy array or torch tensor."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(t, torch.Tensor):
        es = t.element_size()
        return tuple(t.shape), tuple(s * es for s in t.stride()), t.data_ptr(), t.dtype, es
    ai = getattr(t, "__array_interface__", None)
    if ai is None:
        raise InvalidArgument(f"expected a numpy array or torch tensor, got {type(t).__name__}")
    shape = tuple(ai["shape"])
    itemsize = int(ai["typestr"][2:])
    strides = ai.get("strides")
    if strides is None:
        strides, acc = [], itemsize
        for s in reversed(shape):
            strides.append(acc)
            acc *= s
        strides = tuple(reversed(strides))
    return shape, tuple(strides), ai["data"][0], t.dtype, itemsize


def _check_row_contiguous(what: str, shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int,
                          dim_name: str) -> None:
    if any(st < 0 for st in strides):
        raise InvalidArgument(f"{what} has negative strides {strides}")
    if shape[-1] > 1 and strides[-1] != itemsize:
        raise InvalidArgument(f"{what}: {dim_name} must be contiguous (stride {strides[-1]} bytes, element "
                              f"{itemsize} bytes; strides {strides})")


def _vllm_kind(shape: tuple[int, ...], layer: int) -> str:
    if len(shape) == 5 and shape[0] == 2 and shape[1] != 2:
        return "gpu"
    if len(shape) == 5 and shape[1] == 2 and shape[0] != 2:
        return "flashinfer"
    if len(shape) == 5:
        raise InvalidArgument(f"layer {layer}: cannot tell [2, num_blocks, ...] from [num_blocks, 2, ...] in shape "
                              f"{shape}: pass kv_layout='gpu' or 'flashinfer'")
    if len(shape) == 4:
        return "cpu"
    if len(shape) == 3:
        return "mla"
    raise InvalidArgument(f"layer {layer}: shape {shape} is no vLLM KV cache shape (5-D GPU, 4-D CPU, 3-D MLA)")


def _vllm_dims(kind: str, shape: tuple[int, ...], strides: tuple[int, ...], addr: int, itemsize: int,
               layer: int) -> tuple[tuple[int, int, int, int, int, int, int], list[int]]:
    """((num_blocks, T, H, D, block_stride, token_stride, head_stride), part addresses) of one layer."""
    expect = {"gpu": (5, "[2, num_blocks, block_size, num_kv_heads, head_size]"),
              "flashinfer": (5, "[num_blocks, 2, block_size, num_kv_heads, head_size]"),
              "cpu": (4, "[num_blocks, num_kv_heads, block_size, 2*head_size]"),
              "mla": (3, "[num_blocks, block_size, latent_size]")}[kind]
    what = f"layer {layer} ({kind} cache {expect[1]})"
    if len(shape) != expect[0]:
        raise InvalidArgument(f"{what} has shape {shape}")
    _check_row_contiguous(what, shape, strides, itemsize, f"dimension {len(shape) - 1} (head_size)")
    if kind == "gpu":
        if shape[0] != 2:
            raise InvalidArgument(f"{what}: dimension 0 is {shape[0]}, expected 2 (K and V)")
        _, nb, T, H, D = shape
        return (nb, T, H, D, strides[1], strides[2], strides[3]), [addr, addr + strides[0]]
    if kind == "flashinfer":
        if shape[1] != 2:
            raise InvalidArgument(f"{what}: dimension 1 is {shape[1]}, expected 2 (K and V)")
        nb, _, T, H, D = shape
        return (nb, T, H, D, strides[0], strides[2], strides[3]), [addr, addr + strides[1]]
    if kind == "cpu":
        nb, H, T, D2 = shape
        if D2 % 2:
            raise InvalidArgument(f"{what}: dimension 3 is {D2}, not 2*head_size")
        D = D2 // 2
        return (nb, T, H, D, strides[0], strides[2], strides[1]), [addr, addr + D * itemsize]
    nb, T, D = shape
    return (nb, T, 1, D, strides[0], strides[1], 0), [addr]


class KVLayout:
    """A KV pool's geometry plus where each (layer, part) lives.

    Build with :meth:`from_tensors`, :meth:`contiguous` or :meth:`from_segments`;
    register the memory with an :class:`~pdkv.Agent`, then ``agent.add_layout(name,
    layout)`` to make its blocks transferable and visible to peers.
    """

    def __init__(self, native: Any, *, keepalive: Any = None) -> None:
        self._n = native
        self._keepalive = keepalive

    @property
    def native(self):
        return self._n

    @property
    def geometry(self) -> KVGeometry:
        g = self._n.geometry
        return KVGeometry(g.num_layers, g.num_blocks, g.block_tokens, g.kv_heads, g.head_dim, g.dtype,
                          g.kv_parts, "NHD" if g.order == _native.module().TokenOrder.NHD else "HND")

    @property
    def block_bytes(self) -> int:
        return self._n.geometry.block_half_bytes

    @property
    def segments(self) -> list[dict]:
        """One dict per (layer, part): ``addr``, ``block_stride``, ``token_stride``,
        ``head_stride`` (bytes), ``region_id``, ``region_offset``."""
        return self._n.segments

    @property
    def span(self) -> tuple[int, int]:
        """``(lowest address, one past the highest)`` that any block touches."""
        return self._n.min_addr, self._n.end_addr

    def __repr__(self) -> str:
        g = self.geometry
        return (f"KVLayout(layers={g.num_layers}, blocks={g.num_blocks}, block_tokens={g.block_tokens}, "
                f"kv_heads={g.kv_heads}, head_dim={g.head_dim}, dtype={g.dtype}, parts={g.kv_parts}, "
                f"order={g.order})")

    @classmethod
    def from_segments(cls, geometry: KVGeometry, segments: Sequence[tuple[int, int]]) -> "KVLayout":
        """General form: ``segments[layer * kv_parts + part] = (address of block 0, block stride)``."""
        return cls(_native.module().KVLayout.make(geometry.native(), [(int(a), int(s)) for a, s in segments]))

    @classmethod
    def from_strided(cls, geometry: KVGeometry, segments: Sequence[tuple[int, int, int, int]], *,
                     keepalive: Any = None) -> "KVLayout":
        """General strided form, one entry per (layer, part), index ``layer * kv_parts + part``.

        Parameters
        ----------
        geometry : KVGeometry
            Its ``order`` only names the layout (the strides say where rows are).
        segments : sequence of ``(addr, block_stride, token_stride, head_stride)``
            Byte address of the row (block 0, token 0, head 0) and byte strides; each
            row's ``head_dim`` elements are contiguous. Rows of one segment must not
            overlap (:class:`~pdkv.errors.InvalidArgument` names the dimension whose
            stride is too small); rows of different segments may interleave.
        keepalive : optional
            Objects whose lifetime owns the memory (kept with the layout).

        Example
        -------
        Cross-layer blocks ``[num_blocks, layers, 2, T, H, D]`` in one buffer at ``base``:
        ``block = layers*2*T*H*D*e``; segment (l, p) is
        ``(base + (2*l + p)*T*H*D*e, block, H*D*e, D*e)``.
        """
        segs = []
        for i, seg in enumerate(segments):
            if len(seg) != 4:
                raise InvalidArgument(f"segment {i}: expected (addr, block_stride, token_stride, head_stride), "
                                      f"got {seg!r}")
            segs.append(tuple(_validate.count(v, f"segment {i} {n}", maximum=2**64 - 1)
                              for v, n in zip(seg, ("addr", "block_stride", "token_stride", "head_stride"))))
        return cls(_native.module().KVLayout.make_strided(geometry.native(), segs), keepalive=keepalive)

    @classmethod
    def from_vllm(cls, kv_caches: Any, *, num_kv_heads: int | None = None, kv_layout: str = "auto",
                  dtype: Any = None) -> "KVLayout":
        """Layout of vLLM's per-layer KV cache tensors, read from their shapes and strides.

        Parameters
        ----------
        kv_caches : sequence or dict of tensors, one per layer (dict: values in order)
            Recognised shapes (``kv_layout``):

            * ``"gpu"``: ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (FlashAttention);
            * ``"flashinfer"``: ``[num_blocks, 2, block_size, num_kv_heads, head_size]``
              (also a view permuted to HND in memory: the strides say so);
            * ``"cpu"``: ``[num_blocks, num_kv_heads, block_size, 2*head_size]`` (K at
              element 0 of the last dimension, V at ``head_size``). This is the shape,
              not how vLLM 0.32's CPU attention kernels pack a block (``vec``: per
              (block, head) K transposed, then V; AMX: another packing): exact for
              whole-block moves between equal geometries, not for token- or
              head-granular plans of caches vLLM wrote (see
              ``pdkv.integrations.vllm_layout.cpu_token_layout``);
            * ``"mla"``: ``[num_blocks, block_size, latent_size]`` (one latent part).

            ``"auto"`` picks from the number of dimensions and where the 2 is.
        num_kv_heads : int, optional
            Checked against the tensors when given.
        dtype : optional
            Overrides the element type read from the tensors.

        Every layer must have the same shape and strides relative to its base; the
        head dimension must be contiguous. A wrong shape or stride raises
        :class:`~pdkv.errors.InvalidArgument` naming the layer and dimension.
        """
        tensors = list(kv_caches.values()) if isinstance(kv_caches, dict) else list(kv_caches)
        if not tensors:
            raise InvalidArgument("need at least one layer")
        if kv_layout not in ("auto", "gpu", "flashinfer", "cpu", "mla"):
            raise InvalidArgument(f"kv_layout must be 'auto', 'gpu', 'flashinfer', 'cpu' or 'mla', got {kv_layout!r}")
        geo = None
        segs: list[tuple[int, int, int, int]] = []
        for layer, t in enumerate(tensors):
            shape, strides, addr, raw_dtype, itemsize = _strides_bytes(t)
            kind = kv_layout if kv_layout != "auto" else _vllm_kind(shape, layer)
            dims, parts = _vllm_dims(kind, shape, strides, addr, itemsize, layer)
            nb, T, H, D, bs, ts, hs = dims
            if num_kv_heads is not None and H != num_kv_heads:
                raise InvalidArgument(f"layer {layer}: {kind} cache of shape {shape} holds {H} kv heads, "
                                      f"num_kv_heads={num_kv_heads}")
            dt = _dtype_name(raw_dtype if dtype is None else dtype)
            if _native.module().dtype_size(dt) != itemsize:
                raise InvalidArgument(f"dtype {dt} does not match the tensors' element size {itemsize}")
            order = "NHD" if hs <= ts or T == 1 else "HND"
            g = KVGeometry(len(tensors), nb, T, H, D, dt, len(parts), order)
            if geo is None:
                geo = g
            elif g.with_blocks(1) != geo.with_blocks(1) or g.num_blocks != geo.num_blocks:
                raise InvalidArgument(f"layer {layer} has geometry {g}, layer 0 has {geo}")
            segs += [(a, bs, ts, hs) for a in parts]
        assert geo is not None
        return cls.from_strided(geo, segs, keepalive=tensors)

    @classmethod
    def from_token_pool(cls, k_buffers: Sequence[Any], v_buffers: Sequence[Any] | None = None, *,
                        page_size: int, dtype: Any = None) -> "KVLayout":
        """Layout of per-layer token pools ``[num_tokens, kv_heads, head_dim]`` (SGLang's
        ``MHATokenToKVPool``) seen as pages of ``page_size`` tokens: block ``b`` is tokens
        ``[b*page_size, (b+1)*page_size)``; ``v_buffers=None`` is one latent part (MLA
        pools ``[num_tokens, 1, latent_dim]``). A trailing partial page is left out.
        """
        page_size = _validate.count(page_size, "page_size")
        if page_size == 0:
            raise InvalidArgument("page_size must be at least 1")
        k_buffers = list(k_buffers)
        parts = [k_buffers] if v_buffers is None else [k_buffers, list(v_buffers)]
        if not k_buffers:
            raise InvalidArgument("need at least one layer")
        if len(parts) == 2 and len(parts[1]) != len(k_buffers):
            raise InvalidArgument(f"{len(k_buffers)} K buffers but {len(parts[1])} V buffers")
        geo = None
        segs: list[tuple[int, int, int, int]] = []
        for layer in range(len(k_buffers)):
            for p, lst in enumerate(parts):
                shape, strides, addr, raw_dtype, itemsize = _strides_bytes(lst[layer])
                what = f"layer {layer} {'KV'[p] if len(parts) == 2 else 'latent'} buffer"
                if len(shape) != 3:
                    raise InvalidArgument(f"{what} has shape {shape}; expected [num_tokens, kv_heads, head_dim]")
                _check_row_contiguous(what, shape, strides, itemsize, "head_dim (dimension 2)")
                n, H, D = shape
                if n < page_size:
                    raise InvalidArgument(f"{what} holds {n} tokens, fewer than one page of {page_size}")
                dt = _dtype_name(raw_dtype if dtype is None else dtype)
                if _native.module().dtype_size(dt) != itemsize:
                    raise InvalidArgument(f"dtype {dt} does not match the tensors' element size {itemsize}")
                ts, hs = strides[0], strides[1]
                g = KVGeometry(len(k_buffers), n // page_size, page_size, H, D, dt, len(parts),
                               "NHD" if hs <= ts else "HND")
                if geo is None:
                    geo = g
                elif g != geo:
                    raise InvalidArgument(f"{what} has geometry {g}, layer 0 has {geo}")
                segs.append((addr, page_size * ts, ts, hs))
        assert geo is not None
        return cls.from_strided(geo, segs, keepalive=parts)

    @classmethod
    def contiguous(cls, geometry: KVGeometry, base: Any, *, interleaved: bool = False) -> "KVLayout":
        """One buffer holding the whole pool.

        Parameters
        ----------
        base : int or array/tensor
            Address of the buffer, or an object whose memory is used (kept alive).
            It must hold at least ``geometry.pool_bytes`` bytes.
        interleaved : bool
            ``False``: ``[layers, parts, num_blocks, <block>]``;
            ``True``: ``[layers, num_blocks, parts, <block>]`` (K/V interleaved per block).
        """
        keep = None
        if isinstance(base, int):
            addr = base
        else:
            addr, nbytes, _kind, _dev = tensor_address(base)
            if nbytes < geometry.pool_bytes:
                raise InvalidArgument(f"buffer holds {nbytes} bytes, the pool needs {geometry.pool_bytes}")
            keep = base
        return cls(_native.module().KVLayout.contiguous(geometry.native(), addr, interleaved), keepalive=keep)

    @classmethod
    def from_tensors(
        cls,
        k_caches: Sequence[Any],
        v_caches: Sequence[Any] | None = None,
        *,
        order: str = "NHD",
        dtype: Any = None,
    ) -> "KVLayout":
        """Layout of per-layer K and V cache tensors (numpy arrays or torch tensors).

        Parameters
        ----------
        k_caches, v_caches : sequence of arrays, one per layer
            Each ``[num_blocks, block_tokens, kv_heads, head_dim]`` for ``order="NHD"``
            or ``[num_blocks, kv_heads, block_tokens, head_dim]`` for ``"HND"``; the
            last three dimensions must be contiguous, the block dimension may be strided
            (views such as ``t[:, 0]`` of a ``[num_blocks, 2, T, H, D]`` tensor work).
            ``v_caches=None`` describes a single latent cache (``kv_parts=1``).
        dtype : optional
            Overrides the element type read from the tensors (e.g. when bf16 data is
            held in a uint16 numpy array).

        ``order`` must say how the tensors are stored: a contiguous block looks the
        same either way, so only a transposed view (strides that contradict
        ``order``) can be detected here (InvalidArgument). A wrong ``order`` on a
        contiguous tensor yields a geometry whose heads and block size are swapped;
        transfers with a correctly described peer then fail with InvalidArgument
        naming both geometries instead of moving part of the data (only when
        ``kv_heads == block_tokens`` can nothing tell the two orders apart).
        """
        if order not in _ORDERS:
            raise InvalidArgument(f"order must be 'NHD' or 'HND', got {order!r}")
        k_caches = list(k_caches)
        v_caches = None if v_caches is None else list(v_caches)
        if not k_caches:
            raise InvalidArgument("need at least one layer")
        if v_caches is not None and len(v_caches) != len(k_caches):
            raise InvalidArgument(f"{len(k_caches)} K caches but {len(v_caches)} V caches")
        parts = [k_caches] if v_caches is None else [k_caches, v_caches]
        geo = None
        segs: list[tuple[int, int]] = []
        for layer in range(len(k_caches)):
            for p, lst in enumerate(parts):
                shape, strides, addr, raw_dtype, itemsize = _strides_bytes(lst[layer])
                if len(shape) != 4:
                    raise InvalidArgument(
                        f"layer {layer} {'KV'[p] if len(parts) == 2 else ''} cache has shape {shape}; "
                        f"expected [num_blocks, {'block_tokens, kv_heads' if order == 'NHD' else 'kv_heads, block_tokens'}, head_dim]")
                dt = _dtype_name(raw_dtype if dtype is None else dtype)
                if dtype is not None:
                    if _native.module().dtype_size(dt) != itemsize:
                        raise InvalidArgument(f"dtype {dt} does not match the tensors' element size {itemsize}")
                nb, a, b, d = shape
                if strides[3] == itemsize and strides[1] == d * itemsize and strides[2] == a * d * itemsize and a > 1 \
                        and b > 1:
                    # A permuted view: memory holds [nb, b, a, d], i.e. the other order.
                    other = "HND" if order == "NHD" else "NHD"
                    raise InvalidArgument(
                        f"layer {layer}: strides {strides} say this {shape} tensor is a transposed view whose memory "
                        f"is in {other} order, contradicting order={order!r}: pass the tensor as stored, with "
                        f"order={other!r}")
                if strides[3] != itemsize or strides[2] != d * itemsize or strides[1] != b * d * itemsize:
                    raise InvalidArgument(f"layer {layer}: the block's inner dimensions must be contiguous "
                                          f"(strides {strides})")
                t, h = (a, b) if order == "NHD" else (b, a)
                g = KVGeometry(len(k_caches), nb, t, h, d, dt, len(parts), order)
                if geo is None:
                    geo = g
                elif g != geo:
                    raise InvalidArgument(f"layer {layer} has geometry {g}, layer 0 has {geo}")
                segs.append((addr, strides[0] if nb > 1 else g.block_bytes))
        assert geo is not None
        return cls(_native.module().KVLayout.make(geo.native(), segs), keepalive=(k_caches, v_caches))

    def block_extents(self, block_ids: Iterable[int]) -> list[tuple[int, int]]:
        """Absolute ``(address, nbytes)`` ranges holding ``block_ids``, in (layer, part,
        block) order, consecutive ids coalesced."""
        ids = list(block_ids)
        u = self.unbound().native
        return [(lo, n) for (_lr, lo, _rr, _ro, n) in _native.module().plan_blocks(u, ids, u, ids)]

    def unbound(self) -> "KVLayout":
        """A copy not tied to any agent's regions: :func:`plan_blocks` on it yields
        absolute addresses."""
        return KVLayout(_native.module().KVLayout.make_strided(
            self._n.geometry, [(s["addr"], s["block_stride"], s["token_stride"], s["head_stride"])
                               for s in self.segments]), keepalive=self._keepalive)


def plan_blocks(local: KVLayout, local_ids: Iterable[int], remote: KVLayout, remote_ids: Iterable[int], *,
                plan: Any = None) -> list[tuple[int, int, int, int, int]]:
    """Byte extents that move ``local_ids`` of ``local`` to/from ``remote_ids`` of ``remote``.

    Returns ``(local_region, local_offset, remote_region, remote_offset, nbytes)`` tuples;
    for layouts not yet added to an agent the region is ``2**64-1`` and the offset is
    the absolute address. With equal geometry and strides each block maps to one block
    and consecutive ids coalesce; otherwise (different block sizes, NHD vs HND, engine
    layouts, head subsets for tensor-parallel splits) the bytes are cut into the longest
    runs contiguous on both sides. This is the direct plan; ``Agent.prepare`` may
    instead stage a fragmented host-memory transfer through a local buffer (same bytes,
    few large extents on the wire; docs/api.md#kv-layouts).

    ``plan`` is a :class:`~pdkv.PlanOptions` (None: everything). Its ``num_tokens`` /
    ``num_heads`` = 0 mean "all", accepted only when both block lists hold the same
    number of tokens and both layouts the same number of kv heads; otherwise
    :class:`~pdkv.errors.InvalidArgument` names both geometries (a plan never moves part
    of the data unless asked to).
    """
    for name, layout in (("local", local), ("remote", remote)):
        if not isinstance(layout, KVLayout):
            raise InvalidArgument(f"{name} must be a KVLayout, got {type(layout).__name__}")
    return _native.module().plan_blocks(local.native, _validate.block_ids(local_ids, "local_ids"), remote.native,
                                        _validate.block_ids(remote_ids, "remote_ids"), _xfer.plan_options(plan))

