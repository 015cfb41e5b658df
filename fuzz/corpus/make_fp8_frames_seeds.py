"""Writes the seed corpus of fuzz/targets/fp8_frames_fuzz.cc into fuzz/corpus/fp8_frames/
(needs the built pdkv): compressed-write payloads of fp8 frames (every input dtype, with
and without the checksum, one frame or several) with destination extents that fit them,
split differently, plus a few that do not fit."""

import os
import struct

import numpy as np

from pdkv.codec import Codec


def seed(extent_elems: list[int], payload: bytes) -> bytes:
    return bytes([len(extent_elems) - 1]) + b"".join(struct.pack("<H", e) for e in extent_elems) + payload


if __name__ == "__main__":
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fp8_frames")
    os.makedirs(out, exist_ok=True)
    heads, dim, rpg = 2, 8, 3
    row = heads * dim
    x = (np.random.default_rng(0).standard_normal(7 * row) * 3).astype(np.float32)
    seeds = {}
    for dtype, arr in (("float32", x), ("float16", x.astype(np.float16)),
                       ("bfloat16", (x.view(np.uint32) >> 16).astype(np.uint16))):
        for checksum in (False, True):
            c = Codec("fp8", checksum=checksum, heads=heads, head_dim=dim, rows_per_group=rpg)
            one = c.encode(arr.tobytes(), dtype)
            two = c.encode(arr[: 3 * row].tobytes(), dtype) + c.encode(arr[3 * row:].tobytes(), dtype)
            tag = f"{dtype}{'_sum' if checksum else ''}"
            seeds[f"{tag}_one"] = seed([7 * row], one)
            seeds[f"{tag}_split"] = seed([2 * row, 5 * row], one)
            seeds[f"{tag}_two_frames"] = seed([3 * row, 1 * row, 3 * row], two)
            seeds[f"{tag}_row_across"] = seed([row + 3, 6 * row - 3], one)  # a row crosses extents: host route
            seeds[f"{tag}_short"] = seed([6 * row], one)  # extents smaller than the frames
    for name, data in seeds.items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
