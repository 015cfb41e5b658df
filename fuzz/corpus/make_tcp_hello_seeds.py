"""Writes the seed corpus of fuzz/targets/tcp_hello_fuzz.cc into fuzz/corpus/tcp_hello/."""

import os
import struct


def s32(b):
    return struct.pack("<I", len(b)) + b


def hello(version=1, slot=0, instance=0, frm=b"init", to=b"target", secret=b"secret"):
    return struct.pack("<HHIQ", version, 0, slot, instance) + s32(frm) + s32(to) + s32(secret)


SEEDS = {
    "hello": hello(),
    "hello_any_target": hello(to=b"", instance=42, slot=3),
    "hello_v7": hello(version=7),
    "hello_bad_name": hello(frm=b"bad name"),
    "hello_long_secret": hello(secret=b"s" * 1025),
    "hello_truncated": hello()[:20],
    "hello_ack": struct.pack("<Q", 9) + s32(b"target"),
}

if __name__ == "__main__":
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tcp_hello")
    os.makedirs(out, exist_ok=True)
    for name, data in SEEDS.items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
