"""The vLLM connector's token -> block mapping between a prefill and a decode vLLM
with different block sizes, without vLLM (runs in ``make test``).

Decode pulls the prompt tokens ``[start, end)`` (``start``: its own prefix-cache
hit) from prefill's blocks into its newly allocated ones; ``pull_span`` says which
positions of each side's block list hold them, and pdkv's planner re-blocks them in
one read. Checked against a brute-force token walk, and end to end over real agents
on vLLM CPU-shaped caches (``[blocks, kv_heads, block_size, 2*head_size]``).
"""

from __future__ import annotations

import itertools
import random

import pytest

import pdkv
from pdkv.integrations.vllm_layout import (
    check_pullable,
    cpu_token,
    cpu_token_layout,
    kernel_block_ids,
    kernel_blocks_per_block,
    pull_span,
    splits_remote_block,
)

SIZES = (16, 32, 64, 128)


def _blocks_holding(start: int, end: int, block_size: int) -> list[int]:
    """Brute force: positions of the blocks that hold any token of [start, end)."""
    return sorted({t // block_size for t in range(start, end)})


@pytest.mark.parametrize("local_bs, remote_bs", list(itertools.product(SIZES, SIZES)))
def test_span_covers_exactly_the_blocks_holding_the_tokens(local_bs, remote_bs):
    rng = random.Random(local_bs * 1000 + remote_bs)
    step = local_bs * remote_bs  # a start both sides' blocks begin at
    for _ in range(50):
        start = step * rng.randrange(0, 3)
        end = start + rng.randrange(1, 4 * max(local_bs, remote_bs))
        span = pull_span(start, end, local_bs, remote_bs)
        assert list(range(span.local_first, span.local_last)) == _blocks_holding(start, end, local_bs)
        assert list(range(span.remote_first, span.remote_last)) == _blocks_holding(start, end, remote_bs)
        assert span.num_tokens == end - start
        # equal sizes move whole blocks (partial last one included), else exactly the tokens
        assert span.plan_tokens == (0 if local_bs == remote_bs else end - start)


def test_cases_named_in_the_docs():
    # decode 16, prefill 32: 100 prompt tokens, nothing cached -> 7 local blocks, 4 of prefill's
    s = pull_span(0, 100, 16, 32)
    assert (s.local_first, s.local_last, s.remote_first, s.remote_last, s.plan_tokens) == (0, 7, 0, 4, 100)
    # decode 32, prefill 16, 64 tokens cached here: local blocks 2.., prefill blocks 4..
    s = pull_span(64, 100, 32, 16)
    assert (s.local_first, s.local_last, s.remote_first, s.remote_last, s.plan_tokens) == (2, 4, 4, 7, 36)
    # a prompt shorter than either block
    s = pull_span(0, 5, 32, 16)
    assert (s.local_last, s.remote_last, s.plan_tokens) == (1, 1, 5)


def test_a_prefix_hit_inside_a_prefill_block_is_not_pullable():
    assert splits_remote_block(16, 32) and not splits_remote_block(32, 32) and not splits_remote_block(0, 32)
    assert not splits_remote_block(64, 16)  # decode's bigger blocks always start at one of prefill's
    with pytest.raises(pdkv.InvalidArgument, match="inside one of prefill's 32-token blocks"):
        pull_span(16, 100, 16, 32)
    with pytest.raises(pdkv.InvalidArgument, match="inside one of decode's 32-token blocks"):
        pull_span(16, 100, 32, 16)


@pytest.mark.parametrize("args, match", [
    ((5, 5, 16, 16), "empty"), ((7, 3, 16, 16), "empty"), ((-16, 3, 16, 16), "empty"),
    ((0, 10, 0, 16), "local_block_size"), ((0, 10, 16, -1), "remote_block_size"),
    ((0, 10, 16, True), "remote_block_size"), ((0, 10, 16, 16.0), "remote_block_size"),
])
def test_bad_spans_are_named(args, match):
    with pytest.raises(pdkv.InvalidArgument, match=match):
        pull_span(*args)


def test_kernel_blocks():
    assert kernel_block_ids([3, 1], 1) == [3, 1]
    assert kernel_block_ids([3, 1], 2) == [6, 7, 2, 3]
    assert kernel_blocks_per_block(32, 16, "prefill") == 2
    with pytest.raises(pdkv.InvalidArgument, match="prefill's vLLM blocks of 32 tokens"):
        kernel_blocks_per_block(32, 24, "prefill")


def _geo(**kw):
    base = dict(num_layers=2, num_blocks=10, block_tokens=16, kv_heads=4, head_dim=8, dtype="float32")
    return pdkv.KVGeometry(**{**base, **kw})


def test_geometry_check_allows_block_size_and_names_the_rest():
    check_pullable(_geo(), _geo(block_tokens=32, num_blocks=3))
    with pytest.raises(pdkv.InvalidArgument, match=r"KV heads 2 vs 4 .*not pulled, decode recomputes"):
        check_pullable(_geo(), _geo(kv_heads=2))
    with pytest.raises(pdkv.InvalidArgument, match=r"head size 16 vs 8, dtype bfloat16 vs float32"):
        check_pullable(_geo(), _geo(head_dim=16, dtype="bfloat16"))
    with pytest.raises(pdkv.InvalidArgument, match="layers 3 vs 2"):
        check_pullable(_geo(), _geo(num_layers=3))


# ---------------------------------------------------------------- over real agents
try:
    import torch
except ImportError:  # `import pdkv` needs no torch; these tests do
    torch = None
LAYERS, HEADS, DIM, BLOCKS = 2, 2, 8, 24
needs_torch = pytest.mark.skipif(torch is None, reason="needs torch")


def _cpu_caches(block_size: int, seed: int, dtype=None) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"l{i}": torch.randint(-1000, 1000, (BLOCKS, HEADS, block_size, 2 * DIM), generator=g).to(
        dtype or torch.float16) for i in range(LAYERS)}


def _tokens(caches: dict, block_ids: list[int], block_size: int, start: int, end: int) -> list:
    """(K, V) per layer, head and token in [start, end) of a request whose block list
    ``block_ids`` begins at token 0, read where vLLM's ``vec`` kernels keep them."""
    return [cpu_token(t, block_ids[i // block_size], h, i % block_size) for t in caches.values()
            for h in range(HEADS) for i in range(start, end)]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x[0].view(torch.int16), y[0].view(torch.int16)) and
                                    torch.equal(x[1].view(torch.int16), y[1].view(torch.int16)) for x, y in zip(a, b))


@needs_torch
def test_token_layout_names_where_the_kernel_keeps_each_element():
    """K transposed ([head_size, block_size]) then V ([block_size, head_size]) per
    (block, head); the layout's layer l*H + h, part K, "head" d, token t is K[t, h, d]."""
    caches = _cpu_caches(16, 0)
    layout = cpu_token_layout(caches)
    geo = layout.geometry
    assert (geo.num_layers, geo.kv_parts, geo.kv_heads, geo.head_dim, geo.block_tokens) == \
        (LAYERS * HEADS, 2, DIM, 1, 16)
    t = caches["l1"]
    seg_k, seg_v = layout.segments[2 * (1 * HEADS + 1)], layout.segments[2 * (1 * HEADS + 1) + 1]
    e = t.element_size()
    for block, token, d in ((3, 5, 2), (0, 15, 7)):
        k, v = cpu_token(t, block, 1, token)
        for seg, want in ((seg_k, k[d]), (seg_v, v[d])):
            addr = seg["addr"] + block * seg["block_stride"] + token * seg["token_stride"] + d * seg["head_stride"]
            assert (addr - t.data_ptr()) % e == 0
            assert t.view(-1)[(addr - t.data_ptr()) // e] == want


@needs_torch
def test_token_layout_refuses_other_tensors():
    with pytest.raises(pdkv.InvalidArgument, match="CPU caches"):
        cpu_token_layout({"l0": torch.zeros(2, 4, 16, 2, 8)})
    with pytest.raises(pdkv.InvalidArgument, match="layer 1"):
        cpu_token_layout({"l0": torch.zeros(4, 2, 16, 16), "l1": torch.zeros(4, 2, 16, 16).transpose(1, 2)})


@needs_torch
@pytest.mark.parametrize("local_bs, remote_bs, start, end", [
    (16, 32, 0, 5),      # shorter than a block
    (16, 32, 0, 100),    # several blocks and a partial one
    (32, 16, 64, 100),   # decode caches the first 64 tokens itself
    (16, 32, 32, 32 * 3 + 7),
    (32, 32, 32, 70),    # equal sizes
])
def test_pull_of_a_token_range_is_bit_exact(local_bs, remote_bs, start, end):
    """What the connector does for one request between block sizes: prefill's
    request block list and decode's, the span mapped, one read through the
    per-token layouts with prefill's generations."""
    prefill, decode = _cpu_caches(remote_bs, 1), _cpu_caches(local_bs, 2)
    remote_list = random.Random(3).sample(range(BLOCKS), -(-end // remote_bs))
    local_list = random.Random(4).sample(range(BLOCKS), -(-end // local_bs))
    before = {k: t.clone() for k, t in decode.items()}
    span = pull_span(start, end, local_bs, remote_bs)
    lids, rids = local_list[span.local_first:span.local_last], remote_list[span.remote_first:span.remote_last]
    with pdkv.Agent("d", secret="s", transports=["tcp"]) as dec, pdkv.Agent("p", secret="s", transports=["tcp"]) as pre:
        for agent, caches in ((dec, decode), (pre, prefill)):
            for t in caches.values():
                agent.register(t)
            agent.add_layout("vllm-kv-tokens", cpu_token_layout(caches))
        peer = dec.add_peer(pre.metadata())
        dec.read(peer, pdkv.Blocks("vllm-kv-tokens", lids),
                 pdkv.Blocks("vllm-kv-tokens", rids, generations=pre.generations("vllm-kv-tokens", rids)),
                 plan=pdkv.PlanOptions(num_tokens=span.num_tokens)).wait(10)
    assert _same(_tokens(decode, local_list, local_bs, start, end), _tokens(prefill, remote_list, remote_bs, start, end))
    # decode's cached prefix, the tail of its last block and every other block are untouched
    assert _same(_tokens(decode, local_list, local_bs, 0, start), _tokens(before, local_list, local_bs, 0, start))
    tail_end = span.local_last * local_bs
    assert _same(_tokens(decode, local_list, local_bs, end, tail_end), _tokens(before, local_list, local_bs, end, tail_end))
    others = [b for b in range(BLOCKS) if b not in lids]
    assert all(torch.equal(decode[k][others], before[k][others]) for k in decode)


@pytest.mark.parametrize("mode,dtype,says", [("fp8", "bfloat16", "FP8 is not offered"), ("zstd", "bfloat16", "one of"),
                                             ("lossless", "fp8_e4m3", "needs a bfloat16")])
def test_connector_compress_option_is_checked(mode, dtype, says):
    from pdkv.integrations.vllm_layout import connector_compression

    with pytest.raises(pdkv.InvalidArgument, match=says):
        connector_compression(mode, dtype)
    assert connector_compression("off", "bfloat16") is None and connector_compression(None, "x") is None


@needs_torch
@pytest.mark.parametrize("local_bs, remote_bs", [(16, 16), (16, 32)])
def test_compressed_pull_through_the_connector_options_is_bit_exact(local_bs, remote_bs):
    """Decode's agent as the connector makes it with ``compress="lossless"``: the pull of
    a request (whole blocks, or the per-token layout between block sizes) comes back
    compressed over tcp (the transfer says zstd, fewer wire bytes than the KV) and
    bit-exact. The caches hold small integers in bf16: compressible, as real KV is."""
    from pdkv.integrations.vllm_layout import connector_compression

    end = 100
    prefill, decode = _cpu_caches(remote_bs, 5, torch.bfloat16), _cpu_caches(local_bs, 6, torch.bfloat16)
    remote_list = random.Random(7).sample(range(BLOCKS), -(-end // remote_bs))
    local_list = random.Random(8).sample(range(BLOCKS), -(-end // local_bs))
    span = pull_span(0, end, local_bs, remote_bs)
    z = connector_compression("lossless", "bfloat16")
    with pdkv.Agent("d", secret="s", transports=["tcp"], options=[pdkv.TcpOptions(compress=z)]) as dec, \
            pdkv.Agent("p", secret="s", transports=["tcp"]) as pre:
        for agent, caches in ((dec, decode), (pre, prefill)):
            for t in caches.values():
                agent.register(t)
            agent.add_layout("vllm-kv-tokens", cpu_token_layout(caches))
        peer = dec.add_peer(pre.metadata())
        x = dec.read(peer, pdkv.Blocks("vllm-kv-tokens", local_list[span.local_first:span.local_last]),
                     pdkv.Blocks("vllm-kv-tokens", remote_list[span.remote_first:span.remote_last]),
                     plan=pdkv.PlanOptions(num_tokens=span.num_tokens))
        assert x.wait(20)
        assert x.compression == "zstd" and 0 < x.wire_bytes < x.bytes_total, (x.compression, x.wire_bytes)
    assert _same(_tokens(decode, local_list, local_bs, 0, end), _tokens(prefill, remote_list, remote_bs, 0, end))
