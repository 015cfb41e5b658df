"""Engine-level disaggregation: prefill on engine A, move the prompt's KV blocks into
engine B's reserved blocks, decode on B; the output equals ``generate``. The blocks
move with torch indexing and through two pdkv Agents; a failed transfer falls back to
recomputing on B."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import pdkv  # noqa: E402
from pdkv.errors import NotFound  # noqa: E402
from pdkv.serving.engine import Engine, EngineConfig, FinishReason  # noqa: E402
from pdkv.serving.sampling import SamplingParams  # noqa: E402
from tinylm import MAX_NEW, shuffled, tiny_model  # noqa: E402

GREEDY = SamplingParams(max_tokens=MAX_NEW)
SECRET = "serving-test"


def engines(model, *, blocks_a: int = 64, blocks_b: int = 80, mode_b: str = "colocated"):
    a = Engine(model, EngineConfig(num_blocks=blocks_a, block_tokens=4, max_batch_tokens=64),
               block_order=shuffled(blocks_a, seed=1))
    b = Engine(model, EngineConfig(num_blocks=blocks_b, block_tokens=4, mode=mode_b, max_batch_tokens=16,
                                   max_num_seqs=8),
               block_order=shuffled(blocks_b, seed=2))
    return a, b


def prefill_all(a: Engine, prompts, params=GREEDY):
    handles = [a.add_request(f"r{i}", p, params, prefill_only=True) for i, p in enumerate(prompts)]
    a.run_until_idle()
    for h in handles:
        assert h.finished and len(h.output_ids) == 1
        assert h.finish_reason in (FinishReason.PREFILLED, FinishReason.STOP, FinishReason.LENGTH)
        assert len(h.block_ids) == a.pool.blocks_for(len(h.prompt_ids))
    return handles


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama_gqa", "qwen2_mixed", "mistral_sw"])
def test_disagg_torch_copy_equals_generate(arch: str, dtype: str) -> None:
    tm = tiny_model(arch, dtype)
    a, b = engines(tm.model)
    pre = prefill_all(a, tm.prompts)
    decoded = []
    for i, (p, h) in enumerate(zip(tm.prompts, pre)):
        dst = b.reserve(f"r{i}", len(p))
        a.pool.copy_blocks_to(b.pool, h.block_ids, dst)
        a.release(f"r{i}")
        decoded.append(b.admit_prefilled(f"r{i}", p, h.output_ids[0], GREEDY, seed=h.seed))
    assert a.num_free_blocks == a.pool.num_blocks
    b.run_until_idle()
    tm.check([d.output_ids for d in decoded])
    assert b.num_free_blocks == b.pool.num_blocks


def test_disagg_through_pdkv_agents() -> None:
    tm = tiny_model("llama_gqa")
    a, b = engines(tm.model, mode_b="chunked")
    with pdkv.Agent("prefill", secret=SECRET) as pa, pdkv.Agent("decode", secret=SECRET) as da:
        ra = a.pool.register(pa)
        rb = b.pool.register(da)
        assert ra.nbytes == a.pool.storage.numel() * a.pool.storage.element_size()
        peer = pa.connect(da.address)
        pre = prefill_all(a, tm.prompts)
        decoded = []
        for i, (p, h) in enumerate(zip(tm.prompts, pre)):
            rid = f"r{i}"
            dst = b.reserve(rid, len(p))
            pa.write(peer, pdkv.Blocks("kv", list(h.block_ids)), pdkv.Blocks("kv", dst), notify=rid.encode()).wait(10)
            a.release(rid)
            got = da.wait_notifications(10)
            assert [n.data for n in got] == [rid.encode()]
            decoded.append(b.admit_prefilled(rid, p, h.output_ids[0], GREEDY, seed=h.seed))
            if i == 1:
                b.step()  # later requests arrive while earlier ones decode
        b.run_until_idle()
        tm.check([d.output_ids for d in decoded])
        rb.close()
        ra.close()


def test_failed_transfer_recomputes_on_decode_side() -> None:
    tm = tiny_model("qwen2_mixed")
    a, b = engines(tm.model)
    pre = prefill_all(a, tm.prompts)
    decoded = []
    for i, (p, h) in enumerate(zip(tm.prompts, pre)):
        rid = f"r{i}"
        b.reserve(rid, len(p))  # the transfer into these blocks "fails": they hold nothing
        a.release(rid)
        if i % 2:
            decoded.append(b.admit_recompute(rid, p, GREEDY, first_token=h.output_ids[0], seed=h.seed))
        else:  # prefill side died before its first token: recompute everything
            decoded.append(b.admit_recompute(rid, p, GREEDY, seed=h.seed))
    assert b.num_recomputes == len(tm.prompts)
    b.run_until_idle()
    assert all(d.recomputed for d in decoded)
    tm.check([d.output_ids for d in decoded])
    assert b.num_free_blocks == b.pool.num_blocks


def test_sampled_output_is_the_same_disaggregated() -> None:
    tm = tiny_model("mistral_sw")
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0.9, top_p=0.8, seed=100 + i, ignore_eos=True)
              for i in range(len(tm.prompts))]
    single = Engine(tm.model, EngineConfig(num_blocks=64, block_tokens=4, mode="chunked", max_batch_tokens=16,
                                           max_num_seqs=8))
    expected = single.generate(tm.prompts, params)
    assert expected != tm.refs  # it really sampled
    a, b = engines(tm.model)
    handles = [a.add_request(f"r{i}", p, sp, prefill_only=True) for i, (p, sp) in enumerate(zip(tm.prompts, params))]
    a.run_until_idle()
    decoded = []
    for i, (p, h, sp) in enumerate(zip(tm.prompts, handles, params)):
        dst = b.reserve(f"r{i}", len(p))
        a.pool.copy_blocks_to(b.pool, h.block_ids, dst)
        a.release(f"r{i}")
        decoded.append(b.admit_prefilled(f"r{i}", p, h.output_ids[0], sp, seed=h.seed))
    b.run_until_idle()
    assert [d.output_ids for d in decoded] == expected


def test_reservation_lifecycle() -> None:
    tm = tiny_model("llama_gqa")
    _, b = engines(tm.model)
    free = b.num_free_blocks
    ids = b.reserve("x", 9)
    assert len(ids) == 3 and len(set(ids)) == 3
    assert b.num_free_blocks == free - 3
    with pytest.raises(pdkv.AlreadyExists):
        b.reserve("x", 4)
    with pytest.raises(pdkv.InvalidArgument, match="needs 2"):
        b.admit_prefilled("x", [5] * 8, 7)  # 8 tokens need 2 blocks, 3 were reserved
    b.release("x")
    assert b.num_free_blocks == free
    with pytest.raises(NotFound):
        b.release("x")
    with pytest.raises(NotFound):
        b.admit_prefilled("nope", [5, 6], 7)
    assert b.abort("x") is False
    # A first token that already ends the request finishes at once and frees the blocks.
    b.reserve("eos", 2)
    events = []
    h = b.admit_prefilled("eos", [5, 6], 2, on_event=events.append)  # 2 is EOS
    assert h.finished and h.finish_reason is FinishReason.STOP and h.output_ids == [2]
    assert [(e.token_id, e.finish_reason) for e in events] == [(None, FinishReason.STOP)]
    assert b.num_free_blocks == free


def test_prefill_only_blocks_are_held_until_release() -> None:
    tm = tiny_model("llama_gqa")
    a, _ = engines(tm.model)
    h = a.add_request("p", tm.prompts[4], GREEDY, prefill_only=True)
    a.run_until_idle()
    assert h.finish_reason is FinishReason.PREFILLED
    held = a.pool.blocks_for(len(tm.prompts[4]))
    assert a.num_free_blocks == a.pool.num_blocks - held
    with pytest.raises(pdkv.AlreadyExists):
        a.add_request("p", [3], GREEDY)
    a.release("p")
    assert a.num_free_blocks == a.pool.num_blocks
    # abort() also gives held blocks back.
    a.add_request("q", tm.prompts[3], GREEDY, prefill_only=True)
    a.run_until_idle()
    assert a.abort("q") is True
    assert a.num_free_blocks == a.pool.num_blocks


def test_prefilled_requests_respect_max_num_seqs_and_go_first() -> None:
    tm = tiny_model("llama_gqa")
    a, _ = engines(tm.model)
    # 20 blocks: the local 37-token prompt (10 blocks to start, colocated) cannot
    # start while the prefilled requests hold 11; they must not queue behind it.
    b = Engine(tm.model, EngineConfig(num_blocks=20, block_tokens=4, mode="colocated", max_num_seqs=2),
               block_order=shuffled(20, 3))
    pre = prefill_all(a, tm.prompts[:4])
    local = b.add_request("local", tm.prompts[4], GREEDY)
    decoded = []
    for i, (p, h) in enumerate(zip(tm.prompts[:4], pre)):
        dst = b.reserve(f"r{i}", len(p))
        a.pool.copy_blocks_to(b.pool, h.block_ids, dst)
        a.release(f"r{i}")
        decoded.append(b.admit_prefilled(f"r{i}", p, h.output_ids[0], GREEDY, seed=h.seed))
    most_running = 0
    while b.has_work():
        assert b.step() is not None, "stalled"
        most_running = max(most_running, b.num_running)
    assert most_running == 2
    tm.check([d.output_ids for d in decoded] + [local.output_ids])
    assert b.num_free_blocks == 20
