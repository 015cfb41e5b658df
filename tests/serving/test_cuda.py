"""The engine on a CUDA device (skipped without one): greedy output equals
``generate`` on the same device, in every scheduling mode, and the pool registers
with pdkv as CUDA memory."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import pdkv  # noqa: E402
from pdkv.serving.attention import register_paged_attention  # noqa: E402
from pdkv.serving.engine import Engine, EngineConfig  # noqa: E402
from pdkv.serving.sampling import SamplingParams  # noqa: E402
from tinylm import MAX_NEW, assert_greedy_matches, make_config, make_prompts, reference_generate, shuffled  # noqa: E402

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama_gqa", "mistral_sw"])
def test_cuda_engine_equals_generate(arch: str, dtype: str) -> None:
    import transformers

    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(
        make_config(arch), dtype=getattr(torch, dtype), attn_implementation="sdpa").to("cuda").eval()
    prompts = make_prompts()
    refs, ref_logits = reference_generate(model, prompts, MAX_NEW, device="cuda")
    model.set_attn_implementation(register_paged_attention())
    for mode in ("colocated", "chunked"):
        eng = Engine(model, EngineConfig(num_blocks=96, block_tokens=4, mode=mode, max_batch_tokens=16,
                                         max_num_seqs=8), block_order=shuffled(96))
        assert eng.pool.device.type == "cuda"
        outs = eng.generate(prompts, SamplingParams(max_tokens=MAX_NEW))
        # GPU attention kernels differ between masked chunks, packed batches and the
        # reference's calls: accept divergences only on reference logit near-ties.
        for out, ref, lg in zip(outs, refs, ref_logits):
            assert_greedy_matches(out, ref, lg, tie_tolerant=True)
    sampled = eng.generate(prompts, SamplingParams(max_tokens=4, temperature=1.0, seed=3))
    assert all(len(s) >= 1 for s in sampled)
    with pdkv.Agent("cuda-pool", secret="s") as agent:
        region = eng.pool.register(agent)
        assert region.kind == "cuda"

