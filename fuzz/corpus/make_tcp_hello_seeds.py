"""Writes the seed corpus of fuzz/targets/tcp_hello_fuzz.cc into fuzz/corpus/tcp_hello/."""

import os
import struct


def s32(b):
    return struct.pack("<I", len(b)) + b


NONCE, PUB, MAC = b"\x11" * 32, b"\x22" * 32, b"\x33" * 32


def hello(version=2, slot=0, instance=0, frm=b"init", to=b"target", nonce=NONCE, pub=PUB):
    return struct.pack("<HHIQ", version, 0, slot, instance) + s32(frm) + s32(to) + nonce + pub


def challenge(instance=9, name=b"target", nonce=NONCE, pub=PUB):
    return struct.pack("<Q", instance) + s32(name) + nonce + pub


SEEDS = {
    "hello": hello(),
    "hello_any_target": hello(to=b"", instance=42, slot=3),
    "hello_v7": hello(version=7),
    "hello_bad_name": hello(frm=b"bad name"),
    "hello_short_key": hello(pub=PUB[:31]),
    "hello_truncated": hello()[:20],
    "challenge": challenge(),
    "challenge_bad_name": challenge(name=b""),
    "mac": MAC,
    "mac_long": MAC + b"x",
}

if __name__ == "__main__":
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tcp_hello")
    os.makedirs(out, exist_ok=True)
    for name, data in SEEDS.items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)
