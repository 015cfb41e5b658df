"""Paged attention for Hugging Face models, plugged in through ``AttentionInterface``.

The engine packs every scheduled request's new tokens into one sequence (batch 1,
``T`` tokens) and passes a :class:`PagedBatch` to the model's forward as the keyword
``pdkv_batch``; transformers hands that keyword, unchanged, to the attention function
of every layer. For each layer :func:`paged_attention_forward`

1. writes this step's rotated K and V (``[1, kv_heads, T, head_dim]``) into the pool
   slots of their positions, so the pool holds exactly what prefill computed (and
   what pdkv ships), then tells the engine (``on_layer_written``: a prefill worker
   streams that layer to the decode worker while the next layers compute), and
2. attends each request's queries to its own context read back from the pool: causal,
   aligned to the end of the context (chunked prefill), restricted to the layer's
   ``sliding_window`` keyword when the layer has one.

It returns ``[1, T, num_heads, head_dim]`` as transformers expects.

Models must be run with ``use_cache=False`` (the pool is the cache) and explicit
``position_ids``. The attention mask transformers would build is skipped because no
mask function is registered under :data:`PAGED_ATTENTION`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from pdkv.errors import InvalidArgument

from .kv_pool import PagedKVPool

__all__ = ["PAGED_ATTENTION", "BATCH_KWARG", "PagedBatch", "SeqSpan", "paged_attention_forward",
           "register_paged_attention"]

#: Name under which the attention function is registered with transformers.
PAGED_ATTENTION = "pdkv_paged"
#: Keyword argument of the model's forward that carries the :class:`PagedBatch`.
BATCH_KWARG = "pdkv_batch"


@dataclass(frozen=True)
class SeqSpan:
    """One request's part of a packed step.

    Attributes
    ----------
    q_start : int
        Offset of its first new token in the packed ``T`` tokens.
    num_new : int
        Tokens it computes this step (a whole prompt, a prefill chunk, or 1 to decode).
    context_len : int
        Tokens of KV it has after this step (earlier tokens plus ``num_new``).
    block_ids : tuple of int
        Its block table (covers at least ``context_len`` tokens).
    """

    q_start: int
    num_new: int
    context_len: int
    block_ids: tuple[int, ...]

    @property
    def fresh(self) -> bool:
        """True when the request has no KV from earlier steps (a whole prompt)."""
        return self.context_len == self.num_new


@dataclass
class _Plan:
    """How one span attends under one sliding window (computed once per step)."""

    kv_slots: torch.Tensor | None   # [L] slots to read, None: use this step's K/V directly
    mask: torch.Tensor | None       # [num_new, L] bool, True = attend; None: see causal
    causal: bool                    # top-left causal with L == num_new


@dataclass
class PagedBatch:
    """Per-step metadata that the attention function of every layer reads.

    Attributes
    ----------
    pool : PagedKVPool
        Where K/V are written and read.
    spans : list of SeqSpan
        The packed requests, in packing order (``q_start`` ascending, no gaps).
    write_slots : torch.Tensor
        ``[T]`` int64 flat pool slots of the ``T`` packed tokens.
    on_layer_written : callable, optional
        Called with the layer index right after that layer's K/V of this step are in
        the pool (before its attention runs), so the engine can ship them while later
        layers compute (layer-wise streaming, docs/streaming.md).
    """

    pool: PagedKVPool
    spans: list[SeqSpan]
    write_slots: torch.Tensor
    on_layer_written: Callable[[int], None] | None = None
    _plans: dict[int | None, list[_Plan]] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, pool: PagedKVPool, spans: list[SeqSpan]) -> "PagedBatch":
        """Computes the write slots of ``spans`` (validated against the pool)."""
        parts: list[torch.Tensor] = []
        offset = 0
        for s in spans:
            if s.q_start != offset or s.num_new <= 0 or s.context_len < s.num_new:
                raise InvalidArgument(f"malformed span {s} at packed offset {offset}")
            parts.append(pool.slots(s.block_ids, s.context_len - s.num_new, s.context_len))
            offset += s.num_new
        if not parts:
            raise InvalidArgument("a step needs at least one span")
        return cls(pool, spans, torch.cat(parts))

    @property
    def num_tokens(self) -> int:
        """Packed tokens ``T``."""
        return int(self.write_slots.shape[0])

    def plans(self, window: int | None) -> list[_Plan]:
        """Per-span read slots and masks for a layer with sliding window ``window``."""
        plans = self._plans.get(window)
        if plans is None:
            plans = [self._plan(s, window) for s in self.spans]
            self._plans[window] = plans
        return plans

    def _plan(self, s: SeqSpan, window: int | None) -> _Plan:
        n, ctx = s.num_new, s.context_len
        first_q = ctx - n  # absolute position of the first query
        if s.fresh:
            if window is None or n <= window:
                return _Plan(None, None, causal=True)
            lo = 0
        else:
            # Oldest key any of the queries may see (window: key > query - window).
            lo = 0 if window is None else max(0, first_q - window + 1)
        kv_slots = None if s.fresh else self.pool.slots(s.block_ids, lo, ctx)
        if n == 1:
            return _Plan(kv_slots, None, causal=False)  # every key in [lo, ctx) is visible
        device = self.pool.device
        q_pos = torch.arange(first_q, ctx, device=device)[:, None]
        k_pos = torch.arange(lo, ctx, device=device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
        return _Plan(kv_slots, mask, causal=False)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    pdkv_batch: PagedBatch | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over the paged pool (the transformers ``AttentionInterface`` contract).

    Parameters
    ----------
    module : torch.nn.Module
        The attention layer (``module.layer_idx`` picks the pool layer).
    query : torch.Tensor
        ``[1, num_heads, T, head_dim]``, rotated.
    key, value : torch.Tensor
        ``[1, kv_heads, T, head_dim]``, this step's (rotated) keys and values.
    attention_mask : None
        Must be None: masks come from :class:`PagedBatch`.
    scaling : float, optional
        Softmax scale (default ``head_dim ** -0.5``).
    sliding_window : int, optional
        This layer's window: a query at position ``p`` sees keys ``> p - sliding_window``.
    pdkv_batch : PagedBatch
        The step's metadata (the ``pdkv_batch`` keyword of the model's forward).

    Returns
    -------
    tuple
        ``([1, T, num_heads, head_dim], None)``.
    """
    if pdkv_batch is None:
        raise InvalidArgument(
            f"attn_implementation={PAGED_ATTENTION!r} needs the engine's {BATCH_KWARG}= metadata; run this model "
            f"through pdkv.serving.Engine, or switch it with model.set_attn_implementation('sdpa') to use it "
            f"elsewhere")
    if attention_mask is not None:
        raise InvalidArgument(f"{PAGED_ATTENTION} builds its own masks; got an attention_mask from the model")
    if query.shape[0] != 1:
        raise InvalidArgument(f"paged attention packs requests into batch 1, got batch {query.shape[0]}")
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
        raise InvalidArgument(f"{PAGED_ATTENTION} does not support logit soft-capping or attention sinks")
    pool = pdkv_batch.pool
    if key.dtype != pool.dtype:
        raise InvalidArgument(f"model computes in {key.dtype} but the KV pool holds {pool.dtype}")
    layer = module.layer_idx
    k_flat, v_flat = pool.flat_k(layer), pool.flat_v(layer)
    # [1, Hkv, T, D] -> [T, Hkv, D], written into the pool slots of the packed tokens.
    k_flat.index_copy_(0, pdkv_batch.write_slots, key[0].transpose(0, 1))
    v_flat.index_copy_(0, pdkv_batch.write_slots, value[0].transpose(0, 1))
    if pdkv_batch.on_layer_written is not None:
        pdkv_batch.on_layer_written(layer)

    outs: list[torch.Tensor] = []
    for span, plan in zip(pdkv_batch.spans, pdkv_batch.plans(sliding_window)):
        lo, hi = span.q_start, span.q_start + span.num_new
        q = query[:, :, lo:hi]
        if plan.kv_slots is None:
            k, v = key[:, :, lo:hi], value[:, :, lo:hi]
        else:
            # [L, Hkv, D] -> [1, Hkv, L, D]; index_select copies whole rows (much
            # faster on CPU than advanced indexing, which goes element by element).
            k = torch.index_select(k_flat, 0, plan.kv_slots).transpose(0, 1).unsqueeze(0)
            v = torch.index_select(v_flat, 0, plan.kv_slots).transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.mask, is_causal=plan.causal,
                                           scale=scaling, enable_gqa=True)
        outs.append(o)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2), None


def register_paged_attention() -> str:
    """Registers :func:`paged_attention_forward` with transformers (idempotent).

    Returns
    -------
    str
        The name to pass as ``attn_implementation`` (:data:`PAGED_ATTENTION`).
    """
    from transformers import AttentionInterface

    AttentionInterface.register(PAGED_ATTENTION, paged_attention_forward)
    return PAGED_ATTENTION
