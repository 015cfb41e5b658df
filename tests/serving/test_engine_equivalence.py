"""Greedy output through the engine equals ``model.generate(do_sample=False)``, token
for token, for several concurrent requests of different lengths in every scheduling
mode, with scattered block tables, chunked prefill sharing steps with decodes,
requests joining mid-run, and preemption.

fp32 is compared exactly everywhere. bf16 chunked prefill is compared exactly up to
the first divergence, which must fall on a reference bf16 logit tie (see
``tinylm.assert_greedy_matches``): attending to a prompt in masked chunks rounds some
bf16 attention outputs differently from attending to it at once.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from pdkv.serving.engine import Engine, EngineConfig  # noqa: E402
from pdkv.serving.sampling import SamplingParams  # noqa: E402
from tinylm import ARCHS, MAX_NEW, shuffled, tiny_model  # noqa: E402

GREEDY = SamplingParams(max_tokens=MAX_NEW)
NUM_BLOCKS = 96


def make_engine(model, mode: str, **kw) -> Engine:
    cfg = dict(num_blocks=NUM_BLOCKS, block_tokens=4, mode=mode, max_batch_tokens=16, max_num_seqs=8)
    cfg.update(kw)
    return Engine(model, EngineConfig(**cfg), block_order=shuffled(cfg["num_blocks"]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("mode", ["colocated", "chunked"])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_concurrent_greedy_equals_generate(arch: str, mode: str, dtype: str) -> None:
    tm = tiny_model(arch, dtype)
    engine = make_engine(tm.model, mode)
    handles = [engine.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(tm.prompts)]
    stats = []
    while engine.has_work():
        stats.append(engine.step())
    tm.check([h.output_ids for h in handles], chunked=mode == "chunked")
    assert engine.num_free_blocks == NUM_BLOCKS  # everything released
    if mode == "chunked":
        # The 37-token prompt needs several 16-token chunks, and some steps mix
        # prefill chunks with decodes.
        assert any(s.num_prefill_tokens and s.num_decode_tokens for s in stats)
        assert max(s.num_prefill_tokens + s.num_decode_tokens for s in stats) <= 16
    else:
        assert not any(s.num_prefill_tokens and s.num_decode_tokens for s in stats)


@pytest.mark.parametrize("mode", ["colocated", "chunked"])
@pytest.mark.parametrize("arch", ["llama_gqa", "qwen2_mixed", "mistral_sw"])
def test_requests_join_while_others_decode(arch: str, mode: str) -> None:
    tm = tiny_model(arch)
    engine = make_engine(tm.model, mode, max_batch_tokens=8)
    order = [3, 0, 4, 1, 2]
    handles = {}
    for k, i in enumerate(order):
        handles[i] = engine.add_request(f"r{i}", tm.prompts[i], GREEDY)
        for _ in range(k + 2):  # let earlier requests decode before the next joins
            engine.step()
    engine.run_until_idle()
    assert [handles[i].output_ids for i in range(len(order))] == tm.refs


@pytest.mark.parametrize("mode", ["colocated", "chunked"])
def test_preemption_recomputes_without_changing_output(mode: str) -> None:
    tm = tiny_model("mistral_sw")
    # 24 blocks of 4 tokens: the two longest requests (up to 47 + 9 tokens of KV each
    # with the others) cannot all stay resident, so decodes preempt later requests.
    engine = make_engine(tm.model, mode, num_blocks=24)
    handles = [engine.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(tm.prompts)]
    engine.run_until_idle()
    assert [h.output_ids for h in handles] == tm.refs
    assert engine.num_preemptions > 0
    assert sum(h.num_preemptions for h in handles) == engine.num_preemptions
    assert engine.num_free_blocks == 24


def test_block_size_one_and_large_budget() -> None:
    tm = tiny_model("qwen2_mixed")
    engine = make_engine(tm.model, "chunked", block_tokens=1, num_blocks=400, max_batch_tokens=512)
    assert engine.generate(tm.prompts, GREEDY) == tm.refs
