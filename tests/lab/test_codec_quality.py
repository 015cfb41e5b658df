"""bench/codec_quality.py on a tiny random-weight model: the lossless control agrees on
every token and leaves perplexity unchanged, FP8 figures are fractions, and a corrupted
KV (the negative control) visibly lowers agreement and raises perplexity."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from pdkv import codec  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

if not codec.available("zstd"):
    pytest.skip("this pdkv build has no zstd codec (the harness's lossless control)", allow_module_level=True)


def _load_harness():
    spec = importlib.util.spec_from_file_location("codec_quality", ROOT / "bench" / "codec_quality.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


cq = _load_harness()

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=512, initializer_range=0.08, tie_word_embeddings=False)
VOCAB = 256
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    model = cq.random_llama(VOCAB, 0, TINY)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 17, 33, 40)]
    heads, head_dim = cq.kv_geometry(model)
    return model, prompts, heads, head_dim


def test_agreement_lossless_is_total_fp8_is_a_fraction_and_corruption_lowers_it(tiny) -> None:
    model, prompts, heads, head_dim = tiny
    transforms = {"zstd": cq.CodecRoundTrip("zstd", heads, head_dim), "fp8": cq.CodecRoundTrip("fp8", heads, head_dim),
                  "corrupt": cq.NoiseCorruption(seed=1)}
    res = cq.agreement(model, prompts, MAX_TOKENS, transforms)
    assert res["zstd"]["token_agreement"] == 1.0
    assert res["zstd"]["identical_outputs"] == len(prompts)
    assert res["zstd"]["mean_first_divergence"] == MAX_TOKENS
    assert res["zstd"]["agreement_by_position"] == [1.0] * MAX_TOKENS
    for key in ("token_agreement", "identical_fraction"):
        assert 0.0 <= res["fp8"][key] <= 1.0
    assert 0 <= res["fp8"]["mean_first_divergence"] <= MAX_TOKENS
    assert len(res["fp8"]["agreement_by_position"]) == MAX_TOKENS
    # The negative control: garbage KV must cost agreement, far more than FP8 does.
    assert res["corrupt"]["token_agreement"] < 0.5
    assert res["corrupt"]["token_agreement"] < res["fp8"]["token_agreement"]
    # FP8 frames are about half of bf16 (1 byte per element + a scale per 16 tokens per head).
    ratio = transforms["fp8"].raw_bytes / transforms["fp8"].frame_bytes
    assert 1.5 < ratio <= 2.0


def test_a_lossless_transform_that_changes_output_is_an_error(tiny) -> None:
    model, prompts, _, _ = tiny
    broken = cq.NoiseCorruption(seed=2)
    broken.lossless = True  # claims bit-exactness it does not have: the harness must notice
    with pytest.raises(AssertionError, match="lossless"):
        cq.agreement(model, prompts, MAX_TOKENS, {"broken": broken})


def test_perplexity_finite_lossless_unchanged_corruption_worse(tiny) -> None:
    model, _, heads, head_dim = tiny
    rng = random.Random(3)
    text = [rng.randrange(3, VOCAB) for _ in range(130)]
    res = cq.perplexity(model, text, 64, {"zstd": cq.CodecRoundTrip("zstd", heads, head_dim),
                                          "fp8": cq.CodecRoundTrip("fp8", heads, head_dim),
                                          "corrupt": cq.NoiseCorruption(seed=4)})
    assert res["chunks"] == 2 and res["chunk_tokens"] == 64
    assert res["reference"]["scored_tokens"] == 2 * 31
    for name in ("reference", "zstd", "fp8", "corrupt"):
        assert math.isfinite(res[name]["perplexity"]) and res[name]["perplexity"] > 1.0
    assert res["zstd"]["perplexity"] == res["reference"]["perplexity"]
    assert res["zstd"]["change_vs_reference"] == 0.0
    assert math.isfinite(res["fp8"]["change_vs_reference"])
    assert res["corrupt"]["perplexity"] > res["fp8"]["perplexity"]


def test_perplexity_rejects_a_text_shorter_than_one_chunk(tiny) -> None:
    model, _, _, _ = tiny
    with pytest.raises(ValueError, match="fewer than one chunk"):
        cq.perplexity(model, [5, 6, 7], 64, {})


def test_shipped_prompts_are_fixed_varied_and_enough() -> None:
    prompts = json.loads(cq.PROMPTS_FILE.read_text())["prompts"]
    assert len(prompts) >= 100
    assert len({p["text"] for p in prompts}) == len(prompts)
    assert {p["kind"] for p in prompts} == {"question", "instruction", "code", "list", "chat"}
    first = cq.load_prompts(cq.PROMPTS_FILE, 5)
    assert len({p["kind"] for p in first}) == 5  # a small --prompts still covers every kind
    assert len(cq.load_prompts(cq.PROMPTS_FILE, len(prompts))) == len(prompts)
    with pytest.raises(ValueError, match="--prompts"):
        cq.load_prompts(cq.PROMPTS_FILE, len(prompts) + 1)
    assert len(cq.ESSAY_FILE.read_text().split()) > 2000


def test_markdown_report_names_every_path() -> None:
    agree = {"transform": "fp8", "prompts": 2, "max_tokens": 4, "identical_outputs": 1, "identical_fraction": 0.5,
             "token_agreement": 0.75, "mean_first_divergence": 3.0, "agreement_by_position": [1, 1, 0.5, 0.5]}
    result = {"model": "m", "command": "bench/codec_quality.py --prompts 2", "prompts": 2, "max_tokens": 4,
              "agreement": {"zstd": agree | {"transform": "zstd", "token_agreement": 1.0}, "fp8": agree},
              "kv_ratio": {"zstd": 1.3, "fp8": 1.9}, "note": "", "seconds": 1.0,
              "perplexity": {"chunks": 1, "chunk_tokens": 8, "text_tokens": 8, "reference": {"perplexity": 10.0},
                             "fp8": {"perplexity": 10.1, "change_vs_reference": 0.01}}}
    md = cq.markdown(result)
    assert "`bench/codec_quality.py --prompts 2`" in md
    assert "| fp8 | 1/2 (50%) | 75.0% | 3.0 of 4 | 1.9 |" in md
    assert "| fp8 | 10.1 | +1.000% |" in md


@pytest.mark.parametrize("argv", [["--prompts", "0"], ["--max-tokens", "0"], ["--model", "gpt9"]])
def test_cli_rejects_bad_arguments(argv, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        cq.main(argv)
    assert e.value.code == 2


@pytest.mark.slow
def test_cli_small_run_on_smollm2_writes_json_and_markdown(tmp_path) -> None:
    from pdkv.errors import NotFound
    from pdkv.serving import models

    try:
        models.default_model_dir()
    except NotFound as e:
        pytest.skip(f"SmolLM2 unavailable: {e}")
    out = tmp_path / "q"
    assert cq.main(["--prompts", "2", "--max-tokens", "3", "--ppl-chunk", "0", "--threads", "1",
                    "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert result["model"] == models.DEFAULT_MODEL and result["prompts"] == 2 and result["max_tokens"] == 3
    assert result["agreement"]["zstd"]["token_agreement"] == 1.0
    assert 0.0 <= result["agreement"]["fp8"]["token_agreement"] <= 1.0
    assert (result["kv_heads"], result["head_dim"], result["layers"]) == (3, 64, 30)
    assert "| zstd | 2/2 (100%) | 100.0% | 3.0 of 3 |" in out.with_suffix(".md").read_text()
