"""KV geometry presets of real models (per rank), for benchmarks.

Each preset is the KV cache one engine rank holds: layers, KV heads after the
tensor-parallel split, head dim, dtype and the engine's usual page size.
"""

from __future__ import annotations

from pdkv.layout import KVGeometry

# name: (layers, kv_heads per rank, head_dim, dtype, block_tokens, kv_parts, note)
PRESETS: dict[str, tuple[int, int, int, str, int, int, str]] = {
    "llama-3-8b": (32, 8, 128, "bfloat16", 16, 2, "Llama-3-8B, TP1: 32 KiB per block-half"),
    "llama-3-70b": (80, 8, 128, "bfloat16", 16, 2, "Llama-3-70B, TP1 (8 KV heads): 32 KiB block-halves"),
    "llama-3-70b-tp8": (80, 1, 128, "bfloat16", 16, 2, "Llama-3-70B on 8 GPUs: 1 KV head per rank, 4 KiB block-halves"),
    "mistral-7b": (32, 8, 128, "bfloat16", 16, 2, "Mistral-7B, TP1"),
    "qwen2.5-7b": (28, 4, 128, "bfloat16", 16, 2, "Qwen2.5-7B, TP1: 16 KiB block-halves"),
    "qwen3-32b-tp4": (64, 2, 128, "bfloat16", 16, 2, "Qwen3-32B on 4 GPUs"),
    "deepseek-v2-lite-mla": (27, 1, 576, "bfloat16", 64, 1, "MLA latent cache (512+64 dims), 64-token pages"),
    "smollm2-135m": (30, 3, 64, "bfloat16", 16, 2, "SmolLM2-135M (the demo model): 6 KiB block-halves"),
    "vllm-cpu-128": (32, 8, 128, "bfloat16", 128, 2, "Llama-3-8B with vLLM's CPU 128-token pages"),
}


# Tensor-parallel size of the presets that describe one rank of a TP group (others: TP1).
PRESET_TP: dict[str, int] = {"llama-3-70b-tp8": 8, "qwen3-32b-tp4": 4}


def preset(name: str) -> tuple[int, int, int, str, int, int, str]:
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown model preset {name!r}; choose from {', '.join(PRESETS)}") from None


def total_kv_heads(name: str) -> int:
    """The model's KV heads before the preset's TP split (e.g. 8 for llama-3-70b-tp8)."""
    return preset(name)[1] * PRESET_TP.get(name, 1)


def geometry(name: str, num_blocks: int) -> KVGeometry:
    """The preset's geometry with ``num_blocks`` blocks."""
    layers, heads, dim, dtype, bt, parts, _ = preset(name)
    return KVGeometry(layers, num_blocks, bt, heads, dim, dtype, parts)


def rank_geometry(name: str, num_blocks: int, *, kv_heads: int, block_tokens: int | None = None,
                  order: str = "NHD") -> KVGeometry:
    """The preset's geometry for one rank holding ``kv_heads`` heads (another TP split),
    optionally with another page size and element order."""
    layers, _heads, dim, dtype, bt, parts, _ = preset(name)
    return KVGeometry(layers, num_blocks, block_tokens or bt, kv_heads, dim, dtype, parts, order)


def describe() -> str:
    rows = []
    for name, (layers, heads, dim, dtype, bt, parts, note) in PRESETS.items():
        half = bt * heads * dim * 2
        rows.append(f"  {name:22s} {layers:3d} layers x {parts} parts, {heads} kv heads x {dim}, {dtype}, "
                    f"{bt} tok/block: {half // 1024} KiB block-half, {layers * parts * half / 2**20:.2f} MiB/block"
                    f"  ({note})")
    return "\n".join(rows)
