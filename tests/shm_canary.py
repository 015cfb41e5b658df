"""A bystander process for tests/library/shm/test_shm_identity.py: maps ``--len`` bytes filled
with 0xCC at the fixed address ``--addr`` (MAP_FIXED_NOREPLACE), prints
``{"pid", "addr"}`` and then, for every line on stdin, ``{"intact": bool}`` (whether
every byte is still 0xCC). A fake shm target names this process and this address to
make an initiator write into it."""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import sys

MAP_FIXED_NOREPLACE = 0x100000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--addr", type=int, required=True)
    ap.add_argument("--len", type=int, required=True)
    args = ap.parse_args()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    p = libc.mmap(args.addr, args.len, mmap.PROT_READ | mmap.PROT_WRITE,
                  mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0)
    if p != args.addr:
        print(json.dumps({"error": f"mmap at {args.addr:#x} failed: {os.strerror(ctypes.get_errno())}"}), flush=True)
        sys.exit(1)
    ctypes.memset(p, 0xCC, args.len)
    view = (ctypes.c_ubyte * args.len).from_address(p)
    print(json.dumps({"pid": os.getpid(), "addr": p}), flush=True)
    for _ in sys.stdin:
        print(json.dumps({"intact": bytes(view) == b"\xcc" * args.len}), flush=True)


if __name__ == "__main__":
    main()
