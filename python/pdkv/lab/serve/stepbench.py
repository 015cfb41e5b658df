"""Per-step cost of the engine's decode against plain Hugging Face decode.

Builds a random-weight Llama-style model (about 40M parameters by default, GQA), then
for each batch size times decode steps at the same context length:

* ``hf``: ``model(input_ids=[B, 1], cache=DynamicCache, ...)`` with
  ``sdpa`` attention: plain transformers decoding with its contiguous KV cache;
* ``engine``: :meth:`Engine.step` over ``B`` decoding requests (paged pool,
  scattered blocks), which also includes scheduling and sampling.

Run ``python -m pdkv.lab.serve.stepbench --help``. Prints one line per batch size and a
JSON summary; timings are medians over the timed steps.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import statistics
import time
from typing import Any

import torch

from pdkv.serving.attention import register_paged_attention
from pdkv.serving.engine import Engine, EngineConfig
from pdkv.serving.models import parse_dtype, pin_threads
from pdkv.serving.sampling import SamplingParams

__all__ = ["bench_config", "run"]


def bench_config(hidden: int = 512, layers: int = 8, heads: int = 8, kv_heads: int = 4, vocab: int = 16000,
                 intermediate: int = 1536) -> Any:
    """A Llama config of roughly 40M parameters (default arguments)."""
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       max_position_embeddings=4096, initializer_range=0.08, tie_word_embeddings=False)


class _HFDecoder:
    """Plain transformers decoding of ``[B, N]`` prompts with a ``DynamicCache``."""

    def __init__(self, model: Any, prompts: torch.Tensor) -> None:
        from transformers import DynamicCache

        self.model = model
        self.b, self.n = prompts.shape
        self.cache = DynamicCache(config=model.config)
        self.i = 0
        with torch.inference_mode():
            out = model(input_ids=prompts, cache=self.cache, use_cache=True)
        self.tok = out.logits[:, -1].argmax(-1, keepdim=True)

    def step(self) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            pos = torch.full((self.b, 1), self.n + self.i, dtype=torch.int64)
            out = self.model(input_ids=self.tok, cache=self.cache, position_ids=pos, use_cache=True,
                             logits_to_keep=1)
            self.tok = out.logits[:, -1].argmax(-1, keepdim=True)
        self.i += 1
        return time.perf_counter() - t0


class _EngineDecoder:
    """The same prompts as decoding requests of an :class:`Engine` (scattered blocks)."""

    def __init__(self, model: Any, prompts: torch.Tensor, steps: int, block_tokens: int) -> None:
        b, n = prompts.shape
        blocks = b * (-(-(n + steps + 1) // block_tokens)) + 8
        order = list(range(blocks))
        random.Random(0).shuffle(order)
        self.b = b
        self.engine = Engine(model, EngineConfig(num_blocks=blocks, block_tokens=block_tokens, max_num_seqs=b,
                                                 max_batch_tokens=b * n, num_threads=None), block_order=order)
        params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
        for i in range(b):
            self.engine.add_request(f"r{i}", prompts[i].tolist(), params)
        self.engine.step()  # prefill (colocated: every prompt in one step)

    def step(self) -> float:
        stats = self.engine.step()
        assert stats is not None and stats.num_decode_tokens == self.b
        return stats.elapsed_s


def run(batches: list[int], context: int, steps: int, dtype: str, threads: int, block_tokens: int,
        warmup: int = 4) -> list[dict]:
    """Times both decoders per batch size, alternating their steps so that load from
    other processes hits both alike; returns one dict per batch size."""
    from transformers import AutoModelForCausalLM

    pin_threads(threads)
    torch.manual_seed(0)
    cfg = bench_config()
    dt = parse_dtype(dtype)
    hf_model = AutoModelForCausalLM.from_config(cfg, dtype=dt, attn_implementation="sdpa").eval()
    paged = AutoModelForCausalLM.from_config(copy.deepcopy(cfg), dtype=dt, attn_implementation=register_paged_attention()).eval()
    paged.load_state_dict(hf_model.state_dict(), assign=True)  # same weight tensors
    n_params = sum(p.numel() for p in hf_model.parameters())
    rows = []
    for b in batches:
        prompts = torch.randint(3, cfg.vocab_size, (b, context))
        hf_dec = _HFDecoder(hf_model, prompts)
        eng_dec = _EngineDecoder(paged, prompts, steps + warmup, block_tokens)
        hf, eng = [], []
        for _ in range(steps + warmup):
            hf.append(hf_dec.step())
            eng.append(eng_dec.step())
        hf_ms, eng_ms = 1e3 * statistics.median(hf[warmup:]), 1e3 * statistics.median(eng[warmup:])
        rows.append(dict(batch=b, context=context, params_m=round(n_params / 1e6, 1), dtype=dtype, threads=threads,
                         hf_step_ms=round(hf_ms, 3), engine_step_ms=round(eng_ms, 3), ratio=round(eng_ms / hf_ms, 3)))
        print(f"batch {b:3d}  context {context}  hf {hf_ms:8.2f} ms/step  engine {eng_ms:8.2f} ms/step  "
              f"ratio {eng_ms / hf_ms:.2f}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pdkv.lab.serve.stepbench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--context", type=int, default=256, help="prompt tokens before the timed decode steps")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per batch size")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--block-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    rows = run(args.batch, args.context, args.steps, args.dtype, args.threads, args.block_tokens)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
