"""Strided KV layouts (engine layouts): constructors, validation, metadata round trip,
and bit-exact plans and transfers between every pair of layout kinds."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pdkv
from kvpools import ALL_STYLES, NP_DTYPE, STRIDED_STYLES, UNBOUND, Pool, PoolSpec
from kvpools import apply_unbound as apply

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
DTYPES = ["float16", "float32", "bfloat16", "float8_e4m3fn"]


def unique_ids(draw, n, blocks):
    return draw(st.lists(st.integers(0, blocks - 1), min_size=n, max_size=n, unique=True))


@st.composite
def any_layout_case(draw):
    """Two layouts of any kinds, block sizes and head counts; a token and head range."""
    heads_l, heads_r = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    nh = draw(st.integers(1, min(heads_l, heads_r)))
    lho, rho = draw(st.integers(0, heads_l - nh)), draw(st.integers(0, heads_r - nh))
    bt_l, bt_r = draw(st.sampled_from([1, 2, 4, 8])), draw(st.sampled_from([1, 2, 4, 8]))
    common = dict(layers=draw(st.integers(1, 2)), head_dim=draw(st.sampled_from([1, 4])),
                  dtype=draw(st.sampled_from(DTYPES)))
    lspec = PoolSpec(blocks=8, block_tokens=bt_l, heads=heads_l, style=draw(st.sampled_from(ALL_STYLES)), **common)
    rspec = PoolSpec(blocks=8, block_tokens=bt_r, heads=heads_r, style=draw(st.sampled_from(ALL_STYLES)), **common)
    ntok = draw(st.integers(1, min(8 * bt_l, 8 * bt_r)))  # often a partial last block
    lids = unique_ids(draw, -(-ntok // bt_l), 8)
    rids = unique_ids(draw, -(-ntok // bt_r), 8)
    return lspec, rspec, lids, rids, ntok, nh, lho, rho


@SETTINGS
@given(any_layout_case(), st.integers(0, 2**31))
def test_every_layout_kind_moves_exactly_the_requested_rows(case, seed):
    lspec, rspec, lids, rids, ntok, nh, lho, rho = case
    local, remote = Pool(lspec, seed), Pool(rspec)
    plan = pdkv.PlanOptions(num_tokens=ntok, num_heads=nh, local_head_offset=lho, remote_head_offset=rho)
    ext = pdkv.plan_blocks(local.layout, lids, remote.layout, rids, plan=plan)
    apply(ext)
    got = remote.logical(rids)[:, :, :ntok, rho:rho + nh]
    want = local.logical(lids)[:, :, :ntok, lho:lho + nh]
    assert np.array_equal(got, want)
    rest = remote.logical(rids).copy()
    rest[:, :, :ntok, rho:rho + nh] = 0
    assert not rest.any(), "bytes outside the requested rows were written"
    for a, b in zip(ext, ext[1:]):
        assert not (a[1] + a[4] == b[1] and a[3] + a[4] == b[3]), "not coalesced"
    row = lspec.head_dim * np.dtype(NP_DTYPE[lspec.dtype]).itemsize
    assert sum(e[4] for e in ext) == 2 * lspec.layers * ntok * nh * row


@pytest.mark.parametrize("style", STRIDED_STYLES)
def test_equal_strided_layouts_move_whole_blocks(style):
    spec = PoolSpec(layers=2, blocks=8, block_tokens=4, heads=2, head_dim=8, style=style)
    a, b = Pool(spec, 1), Pool(spec)
    ext = pdkv.plan_blocks(a.layout, [1, 2, 3], b.layout, [4, 5, 6])
    apply(ext)
    assert np.array_equal(b.logical([4, 5, 6]), a.logical([1, 2, 3]))
    # Whole blocks: per (layer, part), per layer (vLLM CPU: K and V interleave inside a
    # block), or per block (cross-layer: a block holds every layer).
    expect = {"vllm_cpu": 2, "flashinfer_hnd": 2 * 2 * 3, "cross_layer": 2 * 2 * 3, "token_pool": 2 * 2}[style]
    assert len(ext) == expect


def test_segments_report_their_strides():
    spec = PoolSpec(layers=1, blocks=4, block_tokens=4, heads=2, head_dim=8, dtype="float16", style="vllm_cpu")
    p = Pool(spec)
    k, v = p.layout.segments
    assert (k["block_stride"], k["token_stride"], k["head_stride"]) == (2 * 2 * 4 * 16, 32, 4 * 32)
    assert v["addr"] - k["addr"] == 16
    lo, hi = p.layout.span
    assert hi - lo == p.arrays[0].nbytes


# ---- from_vllm / from_token_pool / from_strided validation

def test_from_vllm_reads_the_gpu_shape():
    t = [np.zeros((2, 6, 4, 3, 8), np.float16) for _ in range(2)]
    lay = pdkv.KVLayout.from_vllm(t)
    g = lay.geometry
    assert (g.num_layers, g.num_blocks, g.block_tokens, g.kv_heads, g.head_dim, g.kv_parts, g.order) == \
        (2, 6, 4, 3, 8, 2, "NHD")
    assert lay.segments[1]["addr"] - lay.segments[0]["addr"] == 6 * 4 * 3 * 8 * 2
    with pytest.raises(pdkv.InvalidArgument, match="num_kv_heads=4"):
        pdkv.KVLayout.from_vllm(t, num_kv_heads=4)


def test_from_vllm_reads_the_cpu_shape_as_interleaved_k_and_v():
    t = [np.zeros((5, 2, 16, 2 * 64), np.uint16)]
    lay = pdkv.KVLayout.from_vllm({"layer.0": t[0]}, dtype="bfloat16")
    g = lay.geometry
    assert (g.num_blocks, g.block_tokens, g.kv_heads, g.head_dim, g.order) == (5, 16, 2, 64, "HND")
    k, v = lay.segments
    assert v["addr"] - k["addr"] == 64 * 2 and k["token_stride"] == 256 and k["head_stride"] == 16 * 256


def test_from_vllm_mla_is_one_latent_part():
    lay = pdkv.KVLayout.from_vllm([np.zeros((4, 16, 576), np.uint16)] * 3, dtype="bfloat16")
    g = lay.geometry
    assert (g.num_layers, g.kv_parts, g.kv_heads, g.head_dim) == (3, 1, 1, 576)


@pytest.mark.parametrize("make, match", [
    (lambda: [np.zeros((2, 2, 4, 3, 8), np.float16)], "pass kv_layout"),
    (lambda: [np.zeros((4, 3, 8), np.float16)[:, :, ::2]], "dimension 2"),
    (lambda: [np.zeros((2, 6, 4, 3, 16), np.float16)[..., ::2]], "dimension 4"),
    (lambda: [np.zeros((6, 2, 4, 7), np.float16)], "2\\*head_size"),
    (lambda: [np.zeros((6, 4, 8), np.float16), np.zeros((5, 4, 8), np.float16)], "layer 1"),
    (lambda: [np.zeros((6, 8), np.float16)], "no vLLM KV cache shape"),
    (lambda: [], "at least one layer"),
])
def test_from_vllm_rejects_shapes_and_strides_naming_the_dimension(make, match):
    with pytest.raises(pdkv.InvalidArgument, match=match):
        pdkv.KVLayout.from_vllm(make())


def test_from_vllm_explicit_kind_must_match():
    with pytest.raises(pdkv.InvalidArgument, match="dimension 0 is 3"):
        pdkv.KVLayout.from_vllm([np.zeros((3, 6, 4, 3, 8), np.float16)], kv_layout="gpu")
    with pytest.raises(pdkv.InvalidArgument, match="kv_layout must be"):
        pdkv.KVLayout.from_vllm([np.zeros((2, 6, 4, 3, 8), np.float16)], kv_layout="tpu")


def test_from_vllm_torch_views():
    torch = pytest.importorskip("torch")
    # FlashInfer HND: [num_blocks, 2, T, H, D] as a permuted view of [num_blocks, 2, H, T, D].
    mem = torch.zeros(6, 2, 3, 4, 8, dtype=torch.bfloat16)
    lay = pdkv.KVLayout.from_vllm([mem.permute(0, 1, 3, 2, 4)])
    g = lay.geometry
    assert (g.block_tokens, g.kv_heads, g.order, g.dtype) == (4, 3, "HND", "bfloat16")
    k = lay.segments[0]
    assert (k["token_stride"], k["head_stride"]) == (16, 4 * 16)


def test_from_token_pool_pages():
    k = [np.zeros((33, 2, 8), np.float32)]  # 33 tokens: 4 pages of 8, one token left over
    v = [np.zeros((33, 2, 8), np.float32)]
    lay = pdkv.KVLayout.from_token_pool(k, v, page_size=8)
    g = lay.geometry
    assert (g.num_blocks, g.block_tokens, g.kv_heads) == (4, 8, 2)
    assert lay.segments[0]["block_stride"] == 8 * 2 * 8 * 4
    with pytest.raises(pdkv.InvalidArgument, match="fewer than one page"):
        pdkv.KVLayout.from_token_pool(k, v, page_size=64)
    with pytest.raises(pdkv.InvalidArgument, match="head_dim"):
        pdkv.KVLayout.from_token_pool([np.zeros((32, 2, 16), np.float32)[:, :, ::2]], None, page_size=8)


def test_from_strided_rejects_overlapping_rows_naming_the_dimension():
    geo = pdkv.KVGeometry(1, 4, 4, 2, 8, "float16", kv_parts=1)  # 16-byte rows
    with pytest.raises(pdkv.InvalidArgument, match="head stride 8 bytes"):
        pdkv.KVLayout.from_strided(geo, [(4096, 256, 32, 8)])
    with pytest.raises(pdkv.InvalidArgument, match="block stride 100 bytes"):
        pdkv.KVLayout.from_strided(geo, [(4096, 100, 32, 16)])
    with pytest.raises(pdkv.InvalidArgument, match="expected \\(addr, block_stride"):
        pdkv.KVLayout.from_strided(geo, [(4096, 256)])
    with pytest.raises(pdkv.InvalidArgument, match="segments"):
        pdkv.KVLayout.from_strided(geo, [(4096, 256, 32, 16)] * 2)


def test_older_constructors_are_unchanged():
    """from_tensors / contiguous / from_segments give the dense strides of their order."""
    geo = pdkv.KVGeometry(2, 4, 4, 2, 8, "float16", order="HND")
    buf = np.zeros(geo.pool_bytes, np.uint8)
    for lay in (pdkv.KVLayout.contiguous(geo, buf),
                pdkv.KVLayout.from_segments(geo, [(buf.ctypes.data + i * 1024, 256) for i in range(4)])):
        for s in lay.segments:
            assert (s["token_stride"], s["head_stride"]) == (16, 64)


# ---- metadata round trip and transfers between agents

@pytest.mark.parametrize("style", STRIDED_STYLES)
def test_peer_sees_the_same_strides(style):
    spec = PoolSpec(layers=2, blocks=4, block_tokens=4, heads=2, head_dim=8, style=style)
    with pdkv.Agent("a", secret="s", transports=["tcp"]) as a, pdkv.Agent("b", secret="s", transports=["tcp"]) as b:
        p = Pool(spec)
        p.register(a)
        peer = b.add_peer(a.metadata())
        seen = pdkv.KVLayout(b.peer_info(peer)["layouts"]["kv"])
        assert seen.geometry == p.layout.geometry
        mine = [(s["addr"], s["block_stride"], s["token_stride"], s["head_stride"]) for s in p.layout.segments]
        theirs = [(s["addr"], s["block_stride"], s["token_stride"], s["head_stride"]) for s in seen.segments]
        assert mine == theirs


CASES = [  # (local style, local T, local H, remote style, remote T, remote H, heads moved, offsets)
    ("vllm_cpu", 4, 2, "nhd", 4, 2, 0, (0, 0)),
    ("nhd", 4, 2, "vllm_cpu", 8, 2, 0, (0, 0)),
    ("cross_layer", 4, 4, "vllm_cpu", 4, 2, 2, (2, 0)),
    ("token_pool", 8, 2, "flashinfer_hnd", 4, 4, 2, (0, 2)),
    ("vllm_cpu", 4, 1, "hnd", 8, 2, 1, (0, 1)),  # a replicated GQA head into slot 1
]


@pytest.mark.parametrize("transport", ["tcp", "shm"])
@pytest.mark.parametrize("op", ["write", "read"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}{c[1]}x{c[2]}-{c[3]}{c[4]}x{c[5]}")
def test_strided_transfers_are_bit_exact(transport, op, case):
    ls, lt, lh, rs, rt, rh, nh, (lho, rho) = case
    ntok = 13  # a partial last block on both sides
    with pdkv.Agent("a", secret="s", transports=[transport]) as a, \
            pdkv.Agent("b", secret="s", transports=[transport]) as b:
        local = Pool(PoolSpec(layers=2, blocks=8, block_tokens=lt, heads=lh, head_dim=8, dtype="bfloat16",
                              style=ls), 7 if op == "write" else None)
        remote = Pool(PoolSpec(layers=2, blocks=8, block_tokens=rt, heads=rh, head_dim=8, dtype="bfloat16",
                               style=rs), 9 if op == "read" else None)
        local.register(a)
        remote.register(b)
        peer = a.add_peer(b.metadata())
        lids = [7, 2, 5, 0][: -(-ntok // lt)]
        rids = [1, 6, 3, 4][: -(-ntok // rt)]
        plan = pdkv.PlanOptions(num_tokens=ntok, num_heads=nh or lh, local_head_offset=lho, remote_head_offset=rho)
        xfer = (a.write if op == "write" else a.read)(peer, pdkv.Blocks("kv", lids), pdkv.Blocks("kv", rids), plan=plan)
        xfer.wait(10)
        src, dst = (local, remote) if op == "write" else (remote, local)
        sids, dids = (lids, rids) if op == "write" else (rids, lids)
        sho, dho = (lho, rho) if op == "write" else (rho, lho)
        n = plan.num_heads
        assert src.logical(sids)[:, :, :ntok, sho:sho + n].any()
        assert np.array_equal(dst.logical(dids)[:, :, :ntok, dho:dho + n], src.logical(sids)[:, :, :ntok, sho:sho + n])
        rest = dst.logical(dids).copy()
        rest[:, :, :ntok, dho:dho + n] = 0
        assert not rest.any()
