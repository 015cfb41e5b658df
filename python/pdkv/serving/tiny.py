"""Tiny random-weight model directories for tests and benchmarks (no download).

:func:`save_tiny_model` writes a complete Hugging Face model directory: a small
Llama/Qwen2/Qwen3/Mistral config with random weights (``initializer_range`` 0.08, so
greedy outputs are not flat), a byte-level tokenizer (every byte is a token, plus a
few special tokens) and a chat template. Every serving process can load it with
:func:`pdkv.serving.load_model`, and text prompts and chat work end to end; the
"answers" are random bytes.

Example
-------
>>> d = save_tiny_model(tmp_path / "tiny", arch="llama")          # doctest: +SKIP
>>> # pdkv serve colocated --model {d} --port 0
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pdkv.errors import InvalidArgument

__all__ = ["SPECIAL_TOKENS", "TINY_ARCHS", "save_tiny_model", "tiny_tokenizer"]

#: Special tokens of the byte tokenizer, ids 0..6 (``</s>`` = 2 is the EOS).
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")

#: Architectures: transformers config class and its extra settings.
TINY_ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(num_key_value_heads=2)),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2)),
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=16)),
    "mistral": ("MistralConfig", dict(num_key_value_heads=2, sliding_window=6)),
}


def tiny_tokenizer() -> Any:
    """A byte-level ``PreTrainedTokenizerFast`` with :data:`SPECIAL_TOKENS` and a chat
    template (vocabulary: 7 special tokens + 256 bytes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {s: i for i, s in enumerate(SPECIAL_TOKENS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   additional_special_tokens=list(SPECIAL_TOKENS[3:]))
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny_model(out_dir: str | os.PathLike, *, arch: str = "llama", seed: int = 0, dtype: str = "float32",
                    hidden_size: int = 64, num_layers: int = 3, num_heads: int = 4,
                    max_position_embeddings: int = 2048) -> Path:
    """Writes a tiny random-weight causal LM with a byte tokenizer to ``out_dir``.

    Parameters
    ----------
    out_dir : path-like
        Created if needed; existing files are overwritten.
    arch : {"llama", "qwen2", "qwen3", "mistral"}
    seed : int
        Torch seed of the weights.
    dtype : str
        Dtype of the saved weights.
    hidden_size, num_layers, num_heads, max_position_embeddings : int

    Returns
    -------
    pathlib.Path
        ``out_dir``.
    """
    import torch
    import transformers

    if arch not in TINY_ARCHS:
        raise InvalidArgument(f"arch must be one of {sorted(TINY_ARCHS)}, got {arch!r}")
    cls_name, extra = TINY_ARCHS[arch]
    tok = tiny_tokenizer()
    cfg = getattr(transformers, cls_name)(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, max_position_embeddings=max_position_embeddings,
        initializer_range=0.08, eos_token_id=2, bos_token_id=1, pad_token_id=0, tie_word_embeddings=False, **extra)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
