"""KVLayout extent math against a plain-Python reference (property-based)."""

from __future__ import annotations


import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pdkv
from kvpools import STYLES, UNBOUND, Pool, PoolSpec
from kvpools import apply_unbound as apply

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def ref_fast_path(local: Pool, lids, remote: Pool, rids):
    """Reference extents for equal geometry: one block-half per (layer, part, block),
    in (layer, part, block) order, merged when both sides continue."""
    out = []
    ls, rs = local.layout.segments, remote.layout.segments
    half = local.layout.block_bytes
    for s in range(len(ls)):
        for a, b in zip(lids, rids):
            lo = ls[s]["addr"] + a * ls[s]["block_stride"]
            ro = rs[s]["addr"] + b * rs[s]["block_stride"]
            if out and out[-1][1] + out[-1][4] == lo and out[-1][3] + out[-1][4] == ro:
                last = out[-1]
                out[-1] = (last[0], last[1], last[2], last[3], last[4] + half)
            else:
                out.append((UNBOUND, lo, UNBOUND, ro, half))
    return out


def unique_ids(draw, n, blocks):
    return draw(st.lists(st.integers(0, blocks - 1), min_size=n, max_size=n, unique=True))


@st.composite
def same_geometry_case(draw):
    blocks = draw(st.integers(1, 12))
    base = dict(layers=draw(st.integers(1, 3)), blocks=blocks, block_tokens=draw(st.sampled_from([1, 2, 4])),
                heads=draw(st.integers(1, 3)), head_dim=draw(st.sampled_from([1, 4, 8])),
                dtype=draw(st.sampled_from(["float16", "float32", "bfloat16", "float8_e4m3fn"])))
    lstyle = draw(st.sampled_from(STYLES))
    rstyle = draw(st.sampled_from(["hnd"] if lstyle == "hnd" else ["nhd", "interleaved", "vllm"]))
    n = draw(st.integers(1, blocks))
    lids = unique_ids(draw, n, blocks)
    # Often consecutive runs, so coalescing is exercised.
    if draw(st.booleans()):
        start = draw(st.integers(0, blocks - n))
        rids = list(range(start, start + n))
        lids = sorted(lids) if draw(st.booleans()) else lids
    else:
        rids = unique_ids(draw, n, blocks)
    return PoolSpec(style=lstyle, **base), PoolSpec(style=rstyle, **base), lids, rids


@SETTINGS
@given(same_geometry_case(), st.integers(0, 2**31))
def test_same_geometry_matches_reference(case, seed):
    lspec, rspec, lids, rids = case
    local, remote = Pool(lspec, seed), Pool(rspec)
    ext = pdkv.plan_blocks(local.layout, lids, remote.layout, rids)
    assert ext == ref_fast_path(local, lids, remote, rids)
    apply(ext)
    assert np.array_equal(remote.logical(rids), local.logical(lids))
    # Untouched blocks stay zero.
    others = [b for b in range(rspec.blocks) if b not in set(rids)]
    if others:
        assert not remote.logical(others).any()


def test_consecutive_ids_coalesce_per_layer_and_part():
    spec = PoolSpec(layers=3, blocks=32, block_tokens=4, heads=2, head_dim=8, style="nhd")
    a, b = Pool(spec), Pool(spec)
    ext = pdkv.plan_blocks(a.layout, range(4, 12), b.layout, range(20, 28))
    assert len(ext) == 3 * 2  # one extent per (layer, part)
    assert all(e[4] == 8 * a.layout.block_bytes for e in ext)
    # A single permutation break splits each run in two.
    ext = pdkv.plan_blocks(a.layout, [4, 5, 6, 7], b.layout, [20, 21, 9, 10])
    assert len(ext) == 3 * 2 * 2


def test_interleaved_does_not_coalesce_across_blocks():
    spec = PoolSpec(layers=1, blocks=8, style="interleaved")
    a, b = Pool(spec), Pool(spec)
    assert len(pdkv.plan_blocks(a.layout, [0, 1, 2], b.layout, [0, 1, 2])) == 2 * 3


@st.composite
def mixed_case(draw):
    heads_l = draw(st.integers(1, 4))
    heads_r = draw(st.integers(1, 4))
    nh = draw(st.integers(1, min(heads_l, heads_r)))
    lho = draw(st.integers(0, heads_l - nh))
    rho = draw(st.integers(0, heads_r - nh))
    bt_l = draw(st.sampled_from([1, 2, 4, 8]))
    bt_r = draw(st.sampled_from([1, 2, 4, 8]))
    common = dict(layers=draw(st.integers(1, 2)), head_dim=draw(st.sampled_from([1, 4])),
                  dtype=draw(st.sampled_from(["float16", "float32"])))
    lspec = PoolSpec(blocks=8, block_tokens=bt_l, heads=heads_l, style=draw(st.sampled_from(STYLES)), **common)
    rspec = PoolSpec(blocks=8, block_tokens=bt_r, heads=heads_r, style=draw(st.sampled_from(STYLES)), **common)
    max_tokens = min(8 * bt_l, 8 * bt_r)
    ntok = draw(st.integers(1, max_tokens))
    lids = unique_ids(draw, -(-ntok // bt_l), 8)
    rids = unique_ids(draw, -(-ntok // bt_r), 8)
    return lspec, rspec, lids, rids, ntok, nh, lho, rho


@SETTINGS
@given(mixed_case(), st.integers(0, 2**31))
def test_mixed_geometry_moves_exactly_the_requested_tokens_and_heads(case, seed):
    lspec, rspec, lids, rids, ntok, nh, lho, rho = case
    local, remote = Pool(lspec, seed), Pool(rspec)
    plan = pdkv.PlanOptions(num_tokens=ntok, num_heads=nh, local_head_offset=lho, remote_head_offset=rho)
    ext = pdkv.plan_blocks(local.layout, lids, remote.layout, rids, plan=plan)
    apply(ext)
    got = remote.logical(rids)[:, :, :ntok, rho:rho + nh]
    want = local.logical(lids)[:, :, :ntok, lho:lho + nh]
    assert np.array_equal(got, want)
    # Nothing else was written: zero the moved part and check the rest is still zero.
    rest = remote.logical(rids).copy()
    rest[:, :, :ntok, rho:rho + nh] = 0
    assert not rest.any()
    # Fully coalesced: no two neighbours continue each other; total bytes exact.
    for a, b in zip(ext, ext[1:]):
        assert not (a[1] + a[4] == b[1] and a[3] + a[4] == b[3])
    row = lspec.head_dim * np.dtype(np.float16 if lspec.dtype == "float16" else np.float32).itemsize
    assert sum(e[4] for e in ext) == 2 * lspec.layers * ntok * nh * row


@st.composite
def unplanned_case(draw):
    common = dict(layers=1, head_dim=draw(st.sampled_from([1, 4])), dtype="float16")
    specs = [PoolSpec(blocks=8, block_tokens=draw(st.sampled_from([1, 2, 4, 8])), heads=draw(st.integers(1, 3)),
                      style=draw(st.sampled_from(STYLES)), **common) for _ in range(2)]
    lids = unique_ids(draw, draw(st.integers(1, 8)), 8)
    rids = unique_ids(draw, draw(st.integers(1, 8)), 8)
    return specs[0], specs[1], lids, rids


@SETTINGS
@given(unplanned_case(), st.integers(0, 2**31))
def test_a_plan_without_options_moves_everything_or_refuses(case, seed):
    """Issue 11 item 9: defaults never move part of the data (1 head of 2, 8 tokens of 16)."""
    lspec, rspec, lids, rids = case
    local, remote = Pool(lspec, seed), Pool(rspec)
    complete = (lspec.heads == rspec.heads
                and len(lids) * lspec.block_tokens == len(rids) * rspec.block_tokens)
    if not complete:
        with pytest.raises(pdkv.InvalidArgument, match="num_heads|num_tokens") as info:
            pdkv.plan_blocks(local.layout, lids, remote.layout, rids)
        assert "local layers=" in str(info.value) and "remote layers=" in str(info.value)
        return
    ext = pdkv.plan_blocks(local.layout, lids, remote.layout, rids)
    apply(ext)
    assert np.array_equal(remote.logical(rids), local.logical(lids))


def test_mismatch_errors_name_both_geometries():
    a = Pool(PoolSpec(heads=1))
    b = Pool(PoolSpec(heads=2, style="hnd"))
    with pytest.raises(pdkv.InvalidArgument) as info:
        pdkv.plan_blocks(a.layout, [0], b.layout, [0])
    msg = str(info.value)
    assert "kv_heads=1" in msg and "kv_heads=2" in msg and "NHD" in msg and "HND" in msg


def test_nhd_to_nhd_with_different_block_sizes_coalesces_rows():
    a = Pool(PoolSpec(layers=1, blocks=4, block_tokens=8, heads=2, head_dim=4, style="nhd"))
    b = Pool(PoolSpec(layers=1, blocks=8, block_tokens=4, heads=2, head_dim=4, style="nhd"))
    # one 8-token block -> two adjacent 4-token blocks: one extent per part
    assert len(pdkv.plan_blocks(a.layout, [2], b.layout, [5, 6])) == 2
    # ... or two scattered ones: two extents per part
    assert len(pdkv.plan_blocks(a.layout, [2], b.layout, [5, 2])) == 2 * 2


@pytest.mark.parametrize(
    "kwargs, exc",
    [
        (dict(lids=[99], rids=[0]), pdkv.OutOfRange),
        (dict(lids=[0], rids=[99]), pdkv.OutOfRange),
        (dict(lids=[0, 1], rids=[0]), pdkv.InvalidArgument),
        (dict(lids=[-1], rids=[0]), pdkv.OutOfRange),
    ],
)
def test_plan_rejects_bad_block_ids(kwargs, exc):
    a = Pool(PoolSpec())
    with pytest.raises(exc):
        pdkv.plan_blocks(a.layout, kwargs["lids"], a.layout, kwargs["rids"])


def test_plan_rejects_incompatible_layouts():
    a = Pool(PoolSpec(head_dim=8))
    b = Pool(PoolSpec(head_dim=4))
    with pytest.raises(pdkv.InvalidArgument, match="head_dim"):
        pdkv.plan_blocks(a.layout, [0], b.layout, [0])
    c = Pool(PoolSpec(dtype="float32"))
    with pytest.raises(pdkv.InvalidArgument, match="dtype"):
        pdkv.plan_blocks(a.layout, [0], c.layout, [0])
    d = Pool(PoolSpec(heads=2))
    with pytest.raises(pdkv.OutOfRange, match="heads"):
        pdkv.plan_blocks(d.layout, [0], d.layout, [0], plan=pdkv.PlanOptions(num_heads=3))


def test_geometry_from_hf_config_dict():
    cfg = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
           "torch_dtype": "bfloat16"}
    g = pdkv.KVGeometry.from_hf_config(cfg, num_blocks=100, block_tokens=16)
    assert (g.num_layers, g.kv_heads, g.head_dim, g.dtype) == (32, 8, 128, "bfloat16")
    assert g.block_bytes == 32 * 1024  # llama-3-8b: 32 KiB per block-half
    assert g.bytes_per_token == 128 * 1024
    g2 = pdkv.KVGeometry.from_hf_config(cfg, num_blocks=100, tp_size=4, dtype="float16")
    assert (g2.kv_heads, g2.dtype) == (2, "float16")
    with pytest.raises(pdkv.InvalidArgument):
        pdkv.KVGeometry.from_hf_config(cfg, num_blocks=100, tp_size=3)


def test_geometry_from_transformers_config():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                                   hidden_size=256, head_dim=48)
    g = pdkv.KVGeometry.from_hf_config(cfg, num_blocks=10, block_tokens=16, dtype="bfloat16")
    assert (g.num_layers, g.kv_heads, g.head_dim) == (4, 2, 48)


@pytest.mark.parametrize("bad", [dict(num_layers=0), dict(kv_parts=3), dict(dtype="float13"), dict(order="XYZ")])
def test_geometry_rejects_bad_values(bad):
    args = dict(num_layers=2, num_blocks=4, block_tokens=4, kv_heads=2, head_dim=8, dtype="float16")
    args.update(bad)
    with pytest.raises(pdkv.InvalidArgument):
        pdkv.KVGeometry(**args)


def test_from_tensors_rejects_non_contiguous_blocks():
    a = np.zeros((4, 8, 2, 16), np.float16)[:, :, :, ::2]  # strided head_dim
    with pytest.raises(pdkv.InvalidArgument, match="contiguous"):
        pdkv.KVLayout.from_tensors([a], [a])
    with pytest.raises(pdkv.InvalidArgument, match="shape"):
        pdkv.KVLayout.from_tensors([np.zeros((4, 8), np.float16)], [np.zeros((4, 8), np.float16)])


def test_from_tensors_torch_views():
    torch = pytest.importorskip("torch")
    pool = torch.zeros(2, 6, 2, 4, 3, 8, dtype=torch.bfloat16)  # [layers, blocks, 2, T, H, D]
    layout = pdkv.KVLayout.from_tensors([pool[l, :, 0] for l in range(2)], [pool[l, :, 1] for l in range(2)])
    g = layout.geometry
    assert (g.num_blocks, g.block_tokens, g.kv_heads, g.head_dim, g.dtype) == (6, 4, 3, 8, "bfloat16")
    seg = layout.segments[1]  # layer 0, V
    assert seg["addr"] == pool[0, 0, 1].data_ptr()
    assert seg["block_stride"] == 2 * layout.block_bytes


def test_contiguous_layout_size_check():
    g = pdkv.KVGeometry(num_layers=2, num_blocks=4, block_tokens=4, kv_heads=2, head_dim=8, dtype="float16")
    with pytest.raises(pdkv.InvalidArgument, match="pool needs"):
        pdkv.KVLayout.contiguous(g, np.zeros(g.pool_bytes - 1, np.uint8))
    lay = pdkv.KVLayout.contiguous(g, np.zeros(g.pool_bytes, np.uint8), interleaved=True)
    assert lay.span[1] - lay.span[0] == g.pool_bytes
