"""The memory an authenticated hostile peer makes a target hold (issue 26,
docs/security.md, "Hostile authenticated peers"): for each attack of tests/library/tcp/test_bounds.py, a target agent in a
child process (tests/library/tcp/bounds_target.py) and its RSS before, its peak (VmHWM) and its RSS
3 s later. Run from the repository root: ``.venv/bin/python bench/bounds_rss.py``.
"""
import os
import struct
import sys
import time

TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")
sys.path[:0] = [TESTS, os.path.join(TESTS, "library", "tcp")]
import test_bounds as tb
from conftest import SECRET
import pdkv

def run(name, config, attack):
    config.setdefault("agent", {}).setdefault("secret", SECRET)
    config["agent"].setdefault("transports", ["tcp"])
    t = tb.Target(config)
    try:
        base = tb.mib(t.pid, "VmRSS")
        attack(t)
        peak = tb.mib(t.pid, "VmHWM")
        time.sleep(3)
        print(f"{name}: RSS {base:.0f} MiB -> peak {peak:.0f} MiB, {tb.mib(t.pid, 'VmRSS'):.0f} MiB 3 s later", flush=True)
    finally:
        for s in t.socks: s.close()
        t.stop()

def bomb(t):
    s = t.connect(); n = 1 << 16
    s.sendall(tb.writez(t.regions[0], [(0, 16 << 10)] * n, tb.codec_frame(n * (16 << 10), tb.zstd_zeros(n * (16 << 10)))))
    print("  answer type", tb.recv_frame(s, 60)[0][1])

def trickle(t):
    for _ in range(16):
        s = t.connect()
        s.sendall(tb.frame(tb.T_WRITEZ, count=4096, payload=64 << 20) + tb.EXT.pack(t.regions[0], 0, 16 << 10) * 4096 + b"P")
    time.sleep(1)

def zread(t):
    s = t.connect()
    desc = tb.STRIDED.pack(t.regions[0], 0, 4096, 65536, 4096)
    spec = struct.pack("<BBBBiIIII", 1, tb.BF16, 0, 0, 1, 1, 64, 16, 0)
    s.sendall(tb.frame(tb.T_READ_REQ, count=1, flags=tb.FLAG_STRIDED | tb.FLAG_ZREPLY, aux=spec) + desc + spec)
    hdr = b""
    while len(hdr) < 40: hdr += s.recv(40 - len(hdr))
    print("  answer type", struct.unpack_from("<H", hdr, 4)[0]); time.sleep(1)

def notif(t):
    data = b"n" * (1 << 20)
    with pdkv.Agent("flooder", secret=SECRET, transports=["tcp"]) as a:
        peer = a.connect(t.address); ok = 0; err = None
        for _ in range(1024):
            try: a.notify(peer, data).wait(10); ok += 1
            except pdkv.PdkvError as e: err = e; break
        print(f"  accepted {ok}, refused: {type(err).__name__ if err else None}")

run("WriteZ bomb 32 KB -> 1 GiB over 65536 repeated 16 KiB extents", {"regions": [16 << 10]}, bomb)
run("16 WriteZ headers announcing 64 MiB, 1 byte each", {"regions": [16 << 10]}, trickle)
run("compressed read of 256 MiB in 4 KiB strided pieces", {"regions": [256 << 20]}, zread)
run("1024 x 1 MiB notifications, never taken", {"regions": [4096]}, notif)
