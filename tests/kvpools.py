"""Test helpers: KV pools of several layouts and dtypes, filled deterministically,
and their logical (layer, part, token, head, dim) view for bit-exact comparison.

Used in-process and by ``peer_proc.py`` (the other side of two-process tests), so
both sides can generate and check the same bytes from a seed without shipping them.
"""

from __future__ import annotations

import ctypes
import hashlib
import time
from dataclasses import asdict, dataclass

import numpy as np

import pdkv

# numpy has no bfloat16/fp8: hold their bits in same-sized integer arrays.
NP_DTYPE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "float8_e4m3fn": np.uint8}

STYLES = ("nhd", "hnd", "interleaved", "vllm")
# Engine layouts described by strides (KVLayout.from_vllm / from_token_pool / from_strided).
STRIDED_STYLES = ("vllm_cpu", "flashinfer_hnd", "cross_layer", "token_pool")
ALL_STYLES = STYLES + STRIDED_STYLES


@dataclass(frozen=True)
class PoolSpec:
    layers: int = 2
    blocks: int = 16
    block_tokens: int = 4
    heads: int = 2
    head_dim: int = 8
    dtype: str = "float16"
    style: str = "nhd"

    @property
    def order(self) -> str:
        return "HND" if self.style == "hnd" else "NHD"

    def to_dict(self) -> dict:
        return asdict(self)


class Pool:
    """Numpy arrays laid out per ``spec.style`` plus the matching KVLayout.

    With ``shared_by=agent`` the arrays live in memory that agent allocated
    (``Agent.alloc``: memfd pages a same-host peer maps); otherwise in plain numpy
    memory (reached by the shm transport through cross-memory attach).
    """

    def __init__(self, spec: PoolSpec, seed: int | None = None, *, shared_by: pdkv.Agent | None = None) -> None:
        self.spec = spec
        self.shared_by = shared_by
        L, B, T, H, D = spec.layers, spec.blocks, spec.block_tokens, spec.heads, spec.head_dim
        dt = NP_DTYPE[spec.dtype]

        def zeros(shape):
            if shared_by is None:
                return np.zeros(shape, dt)
            return shared_by.alloc(int(np.prod(shape)) * np.dtype(dt).itemsize).array(dt, shape)

        if spec.style in ("nhd", "hnd"):
            shape = (B, T, H, D) if spec.style == "nhd" else (B, H, T, D)
            self.arrays = [zeros(shape) for _ in range(2 * L)]
            self.k = self.arrays[0::2]
            self.v = self.arrays[1::2]
        elif spec.style == "interleaved":
            self.arrays = [zeros((L, B, 2, T, H, D))]
            self.k = [self.arrays[0][l, :, 0] for l in range(L)]
            self.v = [self.arrays[0][l, :, 1] for l in range(L)]
        elif spec.style == "vllm":
            self.arrays = [zeros((2, B, T, H, D)) for _ in range(L)]
            self.k = [a[0] for a in self.arrays]
            self.v = [a[1] for a in self.arrays]
        elif spec.style in STRIDED_STYLES:
            self._strided(zeros)
        else:
            raise ValueError(spec.style)
        if spec.style in STYLES:
            self.layout = pdkv.KVLayout.from_tensors(self.k, self.v, order=spec.order, dtype=spec.dtype)
        if seed is not None:
            self.fill(seed)

    def _strided(self, zeros) -> None:
        """Engine layouts; ``self.k``/``self.v`` are [B, T, H, D] views of each part."""
        spec = self.spec
        L, B, T, H, D = spec.layers, spec.blocks, spec.block_tokens, spec.heads, spec.head_dim
        if spec.style == "vllm_cpu":  # vLLM CPU: [B, H, T, 2*D], K then V in each row pair
            self.arrays = [zeros((B, H, T, 2 * D)) for _ in range(L)]
            self.k = [a[..., :D].transpose(0, 2, 1, 3) for a in self.arrays]
            self.v = [a[..., D:].transpose(0, 2, 1, 3) for a in self.arrays]
            self.layout = pdkv.KVLayout.from_vllm(self.arrays, dtype=spec.dtype, kv_layout="cpu")
        elif spec.style == "flashinfer_hnd":  # [B, 2, T, H, D] views of HND memory [B, 2, H, T, D]
            self.arrays = [zeros((B, 2, H, T, D)) for _ in range(L)]
            views = [a.transpose(0, 1, 3, 2, 4) for a in self.arrays]
            self.k = [v[:, 0] for v in views]
            self.v = [v[:, 1] for v in views]
            self.layout = pdkv.KVLayout.from_vllm(views, dtype=spec.dtype, kv_layout="flashinfer")
        elif spec.style == "cross_layer":  # one buffer [B, L, 2, T, H, D]
            self.arrays = [zeros((B, L, 2, T, H, D))]
            a = self.arrays[0]
            self.k = [a[:, l, 0] for l in range(L)]
            self.v = [a[:, l, 1] for l in range(L)]
            st = a.strides
            geo = pdkv.KVGeometry(L, B, T, H, D, spec.dtype)
            base = a.__array_interface__["data"][0]
            segs = [(base + l * st[1] + p * st[2], st[0], st[3], st[4]) for l in range(L) for p in range(2)]
            self.layout = pdkv.KVLayout.from_strided(geo, segs, keepalive=a)
        else:  # token_pool: SGLang-style [B*T, H, D] per layer and part, pages of T tokens
            self.arrays = [zeros((B * T, H, D)) for _ in range(2 * L)]
            self.k = [a.reshape(B, T, H, D) for a in self.arrays[0::2]]
            self.v = [a.reshape(B, T, H, D) for a in self.arrays[1::2]]
            self.layout = pdkv.KVLayout.from_token_pool(self.arrays[0::2], self.arrays[1::2], page_size=T,
                                                        dtype=spec.dtype)

    def fill(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        for a in self.arrays:
            a.view(np.uint8)[...] = rng.integers(0, 256, size=a.nbytes, dtype=np.uint8).reshape(a.view(np.uint8).shape)

    def register(self, agent: pdkv.Agent, name: str = "kv") -> None:
        if self.shared_by is None:
            for a in self.arrays:
                agent.register(a)
        elif self.shared_by is not agent:
            raise ValueError("a shared pool belongs to the agent that allocated it")
        agent.add_layout(name, self.layout)

    def logical(self, block_ids) -> np.ndarray:
        """Bytes of ``block_ids`` as ``[layers, 2, len(ids) * T, H, D * itemsize]`` uint8."""
        out = []
        for l in range(self.spec.layers):
            parts = []
            for cache in (self.k[l], self.v[l]):
                x = cache[np.asarray(block_ids, dtype=np.int64)]
                if self.spec.style == "hnd":
                    x = x.transpose(0, 2, 1, 3)
                n, T, H, D = x.shape
                parts.append(np.ascontiguousarray(x).view(np.uint8).reshape(n * T, H, -1))
            out.append(np.stack(parts))
        return np.stack(out)

    def digest(self, block_ids) -> str:
        return hashlib.sha256(self.logical(block_ids).tobytes()).hexdigest()


def expect_notifications(agent: pdkv.Agent, digest, req: dict, *, with_peer: bool = False) -> dict:
    """Waits for the notifications ``req["items"]`` name (``{"notif", "blocks", "digest"}``)
    and, as each arrives, checks *at once* that its blocks hold the expected bytes
    (``digest(blocks) == item["digest"]``; a ``None`` digest checks only arrival) ->
    ``{"results": [{"notif", "ok"[, "peer"]}], "missing": [...]}``."""
    want = {it["notif"]: it for it in req["items"]}
    results = []
    deadline = time.monotonic() + req.get("timeout", 30)
    while want and time.monotonic() < deadline:
        for n in agent.wait_notifications(timeout=max(0.0, deadline - time.monotonic())):
            it = want.pop(n.data.decode(), None)
            if it is not None:
                r = {"notif": n.data.decode(), "ok": it["digest"] is None or digest(it["blocks"]) == it["digest"]}
                if with_peer:
                    r["peer"] = n.peer
                results.append(r)
    return {"results": results, "missing": sorted(want)}


#: The region of an unbound layout's extents (offsets are absolute addresses).
UNBOUND = 2**64 - 1


def apply_unbound(extents) -> None:
    """Performs a plan on unbound layouts (offsets are absolute addresses): local -> remote."""
    for lr, lo, rr, ro, n in extents:
        assert lr == UNBOUND and rr == UNBOUND
        ctypes.memmove(ro, lo, n)
