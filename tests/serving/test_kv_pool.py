"""The paged KV pool: block allocator, geometry from HF configs, slots, pdkv layout
and registration."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import pdkv  # noqa: E402
from pdkv.errors import InvalidArgument, ResourceExhausted  # noqa: E402
from pdkv.serving.kv_pool import BlockAllocator, PagedKVPool  # noqa: E402
from tinylm import make_config  # noqa: E402


def test_allocator_alloc_free_and_errors() -> None:
    a = BlockAllocator(6, order=[5, 4, 3, 2, 1, 0])
    assert a.alloc(2) == [5, 4]
    assert a.num_free == 4
    with pytest.raises(ResourceExhausted, match="2 blocks requested"):
        BlockAllocator(1).alloc(2)
    with pytest.raises(ResourceExhausted):
        a.alloc(5)
    assert a.num_free == 4  # a failed alloc takes nothing
    a.free([4])
    with pytest.raises(InvalidArgument):
        a.free([4])  # double free
    with pytest.raises(InvalidArgument):
        a.free([3])  # never allocated
    assert a.alloc(4) == [3, 2, 1, 0]
    assert a.alloc(1) == [4]  # freed ids go to the back
    with pytest.raises(InvalidArgument):
        BlockAllocator(3, order=[0, 1, 1])
    with pytest.raises(InvalidArgument):
        BlockAllocator(0)


@pytest.mark.parametrize("arch", ["llama_gqa", "qwen2_mixed", "mistral_sw"])
def test_pool_geometry_matches_kvgeometry(arch: str) -> None:
    cfg = make_config(arch)
    pool = PagedKVPool.from_hf_config(cfg, num_blocks=10, block_tokens=4, dtype=torch.bfloat16)
    geo = pdkv.KVGeometry.from_hf_config(cfg, num_blocks=10, block_tokens=4, dtype="bfloat16")
    assert pool.geometry == geo
    assert pool.layout().geometry == geo
    assert len(pool.k_caches) == cfg.num_hidden_layers
    assert pool.k_caches[0].shape == (10, 4, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads)
    assert pool.storage.numel() * pool.storage.element_size() == geo.pool_bytes


def test_slots_and_extents() -> None:
    geo = pdkv.KVGeometry(num_layers=2, num_blocks=8, block_tokens=4, kv_heads=2, head_dim=8, dtype="float32")
    pool = PagedKVPool(geo)
    table = [6, 1, 3]
    assert pool.slots(table, 0, 10).tolist() == [24, 25, 26, 27, 4, 5, 6, 7, 12, 13]
    assert pool.slots(table, 5, 6).tolist() == [5]
    with pytest.raises(InvalidArgument):
        pool.slots(table, 0, 13)
    assert pool.blocks_for(8) == 2 and pool.blocks_for(9) == 3
    # Writing through the flat view lands in k_caches[layer][block, row].
    pool.flat_k(1)[pool.slots(table, 9, 10)] = 3.0
    assert bool((pool.k_caches[1][3, 1] == 3.0).all())
    assert float(pool.storage.sum()) == 3.0 * 2 * 8
    # One extent per (layer, K/V) per run of consecutive ids.
    ext = pool.layout().block_extents([1, 2, 6])
    assert len(ext) == 2 * 2 * 2
    k1 = pool.k_caches[1]
    assert (k1[6].data_ptr(), geo.block_bytes) in ext
    assert (k1[1].data_ptr(), 2 * geo.block_bytes) in ext


def test_register_once_with_an_agent() -> None:
    geo = pdkv.KVGeometry(num_layers=2, num_blocks=8, block_tokens=4, kv_heads=2, head_dim=8, dtype="bfloat16")
    pool = PagedKVPool(geo)
    with pdkv.Agent("pool-test", secret="s") as agent:
        region = pool.register(agent, "kv")
        assert region.nbytes == geo.pool_bytes
        assert agent.layout("kv").geometry == geo
        with pytest.raises(pdkv.AlreadyExists):
            agent.register(pool.k_caches[1])  # overlaps the pool's registration
        region.close()


def test_copy_blocks_to() -> None:
    geo = pdkv.KVGeometry(num_layers=2, num_blocks=6, block_tokens=2, kv_heads=1, head_dim=4, dtype="float32")
    a, b = PagedKVPool(geo), PagedKVPool(geo.with_blocks(9))
    a.storage.copy_(torch.arange(a.storage.numel(), dtype=torch.float32).view_as(a.storage))
    a.copy_blocks_to(b, [4, 0], [8, 2])
    for layer in range(2):
        assert torch.equal(b.k_caches[layer][8], a.k_caches[layer][4])
        assert torch.equal(b.v_caches[layer][2], a.v_caches[layer][0])
    assert float(b.storage[:, :, [0, 1, 3, 4, 5, 6, 7]].abs().sum()) == 0.0
    with pytest.raises(InvalidArgument):
        a.copy_blocks_to(b, [1], [1, 2])


def test_pool_rejects_unsupported_geometry() -> None:
    with pytest.raises(InvalidArgument):
        PagedKVPool(pdkv.KVGeometry(num_layers=1, num_blocks=2, block_tokens=2, kv_heads=1, head_dim=4,
                                    dtype="float32", order="HND"))
    with pytest.raises(InvalidArgument):
        PagedKVPool(pdkv.KVGeometry(num_layers=1, num_blocks=2, block_tokens=2, kv_heads=1, head_dim=4,
                                    dtype="float32", kv_parts=1))
