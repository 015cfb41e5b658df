"""A tiny random-weight Llama and a locally made byte-level tokenizer, for trying
pdkv's vLLM connector without downloading anything.

``python -m pdkv.integrations.tiny_llama DIR [--seed N] [--preset test|bench]`` writes
a Hugging Face model directory (``config.json``, ``model.safetensors``, tokenizer
files) that ``vllm`` can serve. The weights come from ``torch.manual_seed(seed)``;
two seeds give two models of identical shape (the tests' negative control).

Needs ``torch``, ``transformers`` and ``tokenizers`` (all present where vLLM is).

Example
-------
>>> from pdkv.integrations.tiny_llama import PRESETS
>>> PRESETS["test"]["num_hidden_layers"], PRESETS["test"]["head_dim"]
(2, 32)
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

__all__ = ["PRESETS", "VOCAB", "make_tokenizer", "make_model", "kv_bytes_per_token"]

#: Tokenizer and model vocabulary: 256 byte tokens, 3 specials, then fillers.
VOCAB = 384
_SPECIALS = ("<unk>", "<s>", "</s>")

#: Model shapes. ``test``: fast to prefill on 2 cores. ``bench``: more KV per token
#: (32 KiB in float32) so transfers are large enough to measure.
PRESETS: dict[str, dict[str, Any]] = {
    "test": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32),
    "bench": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=8, head_dim=32),
}


def kv_bytes_per_token(preset: str, itemsize: int = 4) -> int:
    """KV bytes one token occupies across all layers (K and V)."""
    p = PRESETS[preset]
    return p["num_hidden_layers"] * 2 * p["num_key_value_heads"] * p["head_dim"] * itemsize


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (byte-level BPE alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def make_tokenizer(out_dir: str | os.PathLike) -> Any:
    """Writes a byte-level tokenizer (every byte one token, no merges) to ``out_dir``.

    Ids: 0 ``<unk>``, 1 ``<s>`` (BOS), 2 ``</s>`` (EOS), 3..258 the bytes, then
    ``<x259>``... fillers up to :data:`VOCAB` so every id the model can emit decodes.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {s: i for i, s in enumerate(_SPECIALS)}
    for _b, ch in sorted(_bytes_to_unicode().items()):
        vocab[ch] = len(vocab)
    while len(vocab) < VOCAB:
        vocab[f"<x{len(vocab)}>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   model_max_length=4096)
    fast.save_pretrained(str(out_dir))
    return fast


def make_model(out_dir: str | os.PathLike, *, seed: int = 0, preset: str = "test", dtype: str = "float32",
               initializer_range: float = 0.2) -> Path:
    """Writes a random-weight ``LlamaForCausalLM`` plus tokenizer to ``out_dir``.

    ``initializer_range`` is larger than a trained model's so that greedy choices are
    clear-cut (ties between near-equal logits would make runs differ by rounding).
    Returns the directory.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=4096, initializer_range=initializer_range,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                      rms_norm_eps=1e-5, dtype=dtype, **PRESETS[preset])
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    model.save_pretrained(str(out), safe_serialization=True)
    make_tokenizer(out)
    (out / "pdkv_tiny.json").write_text(json.dumps({"seed": seed, "preset": preset, "dtype": dtype}))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pdkv.integrations.tiny_llama", description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="test")
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args(argv)
    print(make_model(a.out_dir, seed=a.seed, preset=a.preset, dtype=a.dtype))


if __name__ == "__main__":
    main()
