"""The vLLM connector's layout description (pdkv.integrations.vllm_layout), on torch
tensors of the shapes vLLM's attention backends allocate; no vLLM needed."""

from __future__ import annotations

import numpy as np
import pytest

import pdkv
from pdkv.integrations.vllm_layout import describe_kv_caches

torch = pytest.importorskip("torch")

LAYERS, BLOCKS, T, H, D = 3, 6, 16, 2, 8


def cpu_caches(blocks=BLOCKS, block_size=T, seed=None):
    """vLLM CPU: [num_blocks, H, block_size, 2*D] per layer."""
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    return {f"layers.{i}.attn": (torch.randint(-1000, 1000, (blocks, H, block_size, 2 * D), generator=g)
                                 .to(torch.bfloat16) if seed is not None
                                 else torch.zeros(blocks, H, block_size, 2 * D, dtype=torch.bfloat16))
            for i in range(LAYERS)}


def gpu_caches(blocks=BLOCKS, block_size=T):
    """FlashAttention: [2, num_blocks, block_size, H, D] per layer."""
    return {f"layers.{i}.attn": torch.zeros(2, blocks, block_size, H, D, dtype=torch.bfloat16) for i in range(LAYERS)}


def logical(caches, kind, ids):
    """[layers, 2, tokens, H, D] of blocks ``ids`` (what attention reads)."""
    out = []
    for t in caches.values():
        if kind == "cpu":
            k, v = t[..., :D].permute(0, 2, 1, 3), t[..., D:].permute(0, 2, 1, 3)
        else:
            k, v = t[0], t[1]
        out.append(torch.stack([k[ids].reshape(-1, H, D), v[ids].reshape(-1, H, D)]))
    return torch.stack(out)


def test_cpu_cache_is_k_and_v_interleaved_per_head():
    d = describe_kv_caches(cpu_caches(), logical_blocks=BLOCKS, num_kv_heads=H, head_size=D)
    g = d.layout.geometry
    assert (d.kind, d.phys_per_block) == ("cpu", 1)
    assert (g.num_layers, g.num_blocks, g.block_tokens, g.kv_heads, g.head_dim, g.kv_parts, g.dtype) == \
        (LAYERS, BLOCKS, T, H, D, 2, "bfloat16")
    k, v = d.layout.segments[:2]
    assert v["addr"] - k["addr"] == D * 2
    assert (k["token_stride"], k["head_stride"], k["block_stride"]) == (2 * D * 2, T * 2 * D * 2, H * T * 2 * D * 2)


def test_kernel_blocks_split_logical_blocks():
    d = describe_kv_caches(gpu_caches(blocks=2 * BLOCKS, block_size=T // 2), logical_blocks=BLOCKS)
    assert d.phys_per_block == 2 and d.layout.geometry.block_tokens == T // 2
    with pytest.raises(pdkv.InvalidArgument, match="do not split"):
        describe_kv_caches(gpu_caches(blocks=7), logical_blocks=BLOCKS)


def test_spec_mismatch_is_named():
    with pytest.raises(pdkv.InvalidArgument, match="head_size=16"):
        describe_kv_caches(cpu_caches(), head_size=16)
    with pytest.raises(pdkv.InvalidArgument, match="num_kv_heads=4"):
        describe_kv_caches(cpu_caches(), num_kv_heads=4)
    mixed = {"a": torch.zeros(2, 4, T, H, D), "b": torch.zeros(4, H, T, 2 * D)}
    with pytest.raises(pdkv.InvalidArgument, match="layer b"):
        describe_kv_caches(mixed)


def test_mla_cache_is_one_latent_part():
    d = describe_kv_caches({"l0": torch.zeros(4, T, 576, dtype=torch.bfloat16)}, num_kv_heads=1, head_size=576)
    assert (d.kind, d.layout.geometry.kv_parts, d.layout.geometry.head_dim) == ("mla", 1, 576)


def test_equal_cpu_layouts_move_whole_blocks():
    a = describe_kv_caches(cpu_caches()).layout
    ext = pdkv.plan_blocks(a, [1, 2, 3], a, [3, 4, 5])
    assert len(ext) == LAYERS  # one run of 3 whole blocks (K and V together) per layer


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("remote_kind, remote_block", [("cpu", T), ("gpu", T), ("cpu", T // 2), ("gpu", 2 * T)])
def test_cpu_cache_pulls_from_any_vllm_layout_bit_exact(transport, remote_kind, remote_block):
    """Decode (CPU layout) pulls 40 tokens from a prefill cache of another layout or
    block size: bytes equal to what attention reads on the prefill side."""
    ntok = 40
    remote = cpu_caches(blocks=12, block_size=remote_block, seed=5) if remote_kind == "cpu" else \
        {k: torch.randint(-1000, 1000, (2, 12, remote_block, H, D)).to(torch.bfloat16)
         for k in gpu_caches(blocks=12, block_size=remote_block)}
    local = cpu_caches()
    with pdkv.Agent("d", secret="s", transports=[transport]) as dec, \
            pdkv.Agent("p", secret="s", transports=[transport]) as pre:
        for side, caches in ((dec, local), (pre, remote)):
            for t in caches.values():
                side.register(t)
            side.add_layout("kv", describe_kv_caches(caches).layout)
        peer = dec.add_peer(pre.metadata())
        lids = [4, 0, 2]
        rids = [9, 3, 7, 1, 10, 11][: -(-ntok // remote_block)]
        dec.read(peer, pdkv.Blocks("kv", lids), pdkv.Blocks("kv", rids),
                 plan=pdkv.PlanOptions(num_tokens=ntok)).wait(10)
        got = logical(local, "cpu", lids)[:, :, :ntok]
        want = logical(remote, remote_kind, rids)[:, :, :ntok]
        assert want.abs().sum() > 0
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        tail = logical(local, "cpu", lids)[:, :, ntok:]
        assert not tail.view(torch.int16).any()
