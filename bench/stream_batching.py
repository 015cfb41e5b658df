"""Batching of a layer-wise stream with nothing computing (docs/streaming.md, "Measured
here"): 10 layers of 1 MiB between two agents in this process, posted one by one as
fast as Python can, against one write of the same blocks; per transport, the median
milliseconds (post to completion) of ``--repeats`` runs of each:

- ``write``: one ``Agent.write`` of every layer;
- ``inflight N``: a stream with ``max_inflight_batches=N`` (1, 2, 4, 10), layers posted
  one ``post_layers`` each;
- ``min_batch 4 MiB``: ``min_batch_bytes=4 MiB``, 4 in flight;
- ``all at once``: one ``post_layers(0, 10)``.

Each stream line also gives its batch transfers.

    .venv/bin/python bench/stream_batching.py [--transport tcp shm] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

import pdkv

LAYERS, BLOCKS, T, H, D = 10, 16, 16, 8, 128  # K + V of one layer: 16 x 16 x 8 x 128 x 2 B x 2 = 1 MiB


def _agent(name: str, transport: str) -> pdkv.Agent:
    a = pdkv.Agent(name, secret="stream-batching", transports=[transport])
    k = [np.ones((BLOCKS, T, H, D), np.float16) for _ in range(LAYERS)]
    v = [np.ones((BLOCKS, T, H, D), np.float16) for _ in range(LAYERS)]
    for t in k + v:
        a.register(t)
    a.add_layout("kv", pdkv.KVLayout.from_tensors(k, v))
    a._keep = (k, v)  # the pool lives as long as the agent
    return a


def _stream(src: pdkv.Agent, peer: str, ids: list[int], *, inflight: int = 4, min_batch: int = 0,
            at_once: bool = False) -> tuple[float, int]:
    t0 = time.perf_counter()
    blocks = pdkv.Blocks("kv", ids)
    s = src.open_stream(peer, blocks, blocks, timeout=30,
                        stream=pdkv.StreamOptions(max_inflight_batches=inflight, min_batch_bytes=min_batch))
    if at_once:
        s.post_layers(0, LAYERS)
    else:
        for layer in range(LAYERS):
            s.post_layers(layer)
    s.close().wait(30)
    return time.perf_counter() - t0, s.batches_posted


def run(transport: str, repeats: int) -> list[str]:
    dst, src = _agent("dst", transport), _agent("src", transport)
    try:
        peer = src.add_peer(dst.metadata())
        ids = list(range(BLOCKS))
        src.write(peer, pdkv.Blocks("kv", ids), pdkv.Blocks("kv", ids), timeout=30).wait(30)  # connect and warm up

        def write() -> tuple[float, int]:
            t0 = time.perf_counter()
            src.write(peer, pdkv.Blocks("kv", ids), pdkv.Blocks("kv", ids), timeout=30).wait(30)
            return time.perf_counter() - t0, 1

        cases = [("write", write)]
        cases += [(f"inflight {n}", lambda n=n: _stream(src, peer, ids, inflight=n)) for n in (1, 2, 4, 10)]
        cases += [("min_batch 4 MiB", lambda: _stream(src, peer, ids, min_batch=4 << 20)),
                  ("all at once", lambda: _stream(src, peer, ids, at_once=True))]
        times: dict[str, list[float]] = {name: [] for name, _ in cases}
        batches: dict[str, int] = {}
        for _ in range(repeats):  # the cases alternate, so load hits them alike
            for name, fn in cases:
                seconds, nb = fn()
                times[name].append(seconds)
                batches[name] = nb
        return [f"{transport:4s} {name:16s} {statistics.median(t) * 1e3:7.2f} ms  ({batches[name]} transfers)"
                for name, t in times.items()]
    finally:
        src.close()
        dst.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--transport", nargs="+", default=["tcp", "shm"], choices=["tcp", "shm"])
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    for transport in args.transport:
        for line in run(transport, args.repeats):
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
