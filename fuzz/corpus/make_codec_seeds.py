"""Writes the seed corpus of fuzz/targets/codec_fuzz.cc into fuzz/corpus/codec/ (needs
the built pdkv): one valid frame per codec (with and without the checksum), an empty
chunk, and a few malformed ones."""

import os

import numpy as np

from pdkv.codec import Codec, available

if __name__ == "__main__":
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "codec")
    os.makedirs(out, exist_ok=True)
    # Compressible (a repeated pattern), so zstd/lz4 seeds are real compressed frames.
    kv = np.tile((np.random.default_rng(0).standard_normal(16) * 2).astype(np.float16), 6)
    seeds = {}
    for kind in ("raw", "zstd", "lz4", "fp8"):
        if not available(kind):
            continue
        for checksum in (False, True):
            c = Codec(kind, checksum=checksum, heads=2, head_dim=8, rows_per_group=4)
            seeds[f"{kind}{'_sum' if checksum else ''}"] = c.encode(kv)
        seeds[f"{kind}_empty"] = Codec(kind).encode(b"", dtype="bfloat16")
    seeds["zstd_truncated"] = seeds.get("zstd", seeds["raw"])[:-3]
    seeds["header_only"] = seeds["raw"][:48]
    for name, data in seeds.items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
