"""Helpers for the serving tests: tiny random-weight HF models and their references.

Each model is built from a config (no download), with ``initializer_range=0.08`` so
greedy outputs vary, and its reference outputs come from ``model.generate(
do_sample=False)`` under ``sdpa`` attention before the model is switched to the
engine's paged attention.

Test modules import this after ``pytest.importorskip("torch")`` and
``pytest.importorskip("transformers")``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch
import transformers

from pdkv.serving.attention import register_paged_attention

torch.set_num_threads(1)

VOCAB = 256
EOS = 2
MAX_NEW = 10
#: Prompt lengths of the concurrent requests (1 and lengths past the sliding windows).
PROMPT_LENS = (1, 4, 9, 23, 37)

_COMMON: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                               num_attention_heads=4, max_position_embeddings=512, initializer_range=0.08,
                               eos_token_id=EOS, bos_token_id=1, pad_token_id=0, tie_word_embeddings=False)

ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    # GQA: 4 query heads share 2 KV heads.
    "llama_gqa": ("LlamaConfig", dict(num_key_value_heads=2)),
    # Qwen2: q/k/v biases; sliding window off (its config still carries a value).
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2)),
    # Qwen2 with mixed full/sliding layers and a window not aligned to blocks.
    "qwen2_mixed": ("Qwen2Config", dict(num_key_value_heads=1, use_sliding_window=True, sliding_window=5,
                                        layer_types=["full_attention", "sliding_attention", "sliding_attention"])),
    # Qwen3: q/k RMSNorm inside attention, explicit head_dim, GQA.
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=16)),
    # Mistral: every layer slides, window shorter than most sequences.
    "mistral_sw": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=6)),
}


def make_config(arch: str) -> Any:
    cls_name, extra = ARCHS[arch]
    return getattr(transformers, cls_name)(**_COMMON, **extra)


def make_prompts(lens=PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lens]


def reference_generate(model: Any, prompts: list[list[int]], max_new: int, *, device: str = "cpu"
                       ) -> tuple[list[list[int]], list[Any]]:
    """``model.generate(do_sample=False)`` per prompt (no padding involved).

    Returns
    -------
    tuple
        The output ids per prompt, and per prompt the ``[len(output), vocab]`` float32
        logits that ``generate`` chose each token from.
    """
    outs, logits = [], []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                             pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        outs.append(gen.sequences[0, len(p):].tolist())
        logits.append(torch.cat([lg.float() for lg in gen.logits]).cpu())
    return outs, logits


def assert_greedy_matches(out: list[int], ref: list[int], ref_logits: Any, *, tie_tolerant: bool = False) -> None:
    """Asserts ``out == ref``; with ``tie_tolerant``, a divergence is accepted only where
    the reference's logits of both tokens are within one bfloat16 rounding step.

    Chunked prefill in bfloat16 attends in chunks (with a mask) where the reference
    attends to the whole prompt at once; the attention kernel then rounds some
    outputs differently, which flips greedy picks between tokens whose bf16 logits tie
    or differ by one ulp. After such a flip the continuations legitimately differ.
    """
    if out == ref or not tie_tolerant:
        assert out == ref
        return
    t = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
    assert t < min(len(out), len(ref)), f"one output is a prefix of the other: {out} vs {ref}"
    row = ref_logits[t]
    tol = torch.finfo(torch.bfloat16).eps * max(float(row.abs().max()), 1.0)
    margin = float(row[ref[t]] - row[out[t]])
    assert margin <= tol, (f"diverged at output {t}: reference picked {ref[t]}, engine {out[t]}, "
                           f"reference logit margin {margin} > bf16 tolerance {tol}")


@dataclass
class TinyModel:
    """A paged-attention model plus what ``generate`` produced for :attr:`prompts`."""

    arch: str
    dtype: Any
    model: Any
    prompts: list[list[int]]
    refs: list[list[int]]
    ref_logits: list[Any]

    def check(self, outputs: list[list[int]], *, chunked: bool = False) -> None:
        """Asserts each output equals its reference (tie-tolerant for chunked bf16)."""
        assert len(outputs) == len(self.refs)
        for out, ref, lg in zip(outputs, self.refs, self.ref_logits):
            assert_greedy_matches(out, ref, lg, tie_tolerant=chunked and self.dtype == torch.bfloat16)


_CACHE: dict[tuple[str, str], TinyModel] = {}


def tiny_model(arch: str, dtype: str = "float32") -> TinyModel:
    """Builds (once per session) a tiny random-weight model and its references."""
    key = (arch, dtype)
    if key not in _CACHE:
        torch.manual_seed(1234)
        cfg = make_config(arch)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype),
                                                              attn_implementation="sdpa").eval()
        prompts = make_prompts()
        refs, ref_logits = reference_generate(model, prompts, MAX_NEW)
        model.set_attn_implementation(register_paged_attention())
        _CACHE[key] = TinyModel(arch, getattr(torch, dtype), model, prompts, refs, ref_logits)
    return _CACHE[key]


def shuffled(n: int, seed: int = 7) -> list[int]:
    """A shuffled block order, so block tables are scattered and non-contiguous."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return order
