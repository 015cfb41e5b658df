"""``pdkv bench transfer``: pdkv's GB/s and latency beside the raw limits, in one run.

Two processes, an initiator and a target (on 127.0.0.1 by default, or across hosts
with ``--serve`` on one and ``--target HOST:PORT`` on the other). Each payload is a
set of KV blocks of a model preset; the destination blocks are a seeded random
permutation so no two extents coalesce. Measured in the same run:

* ``socket_plain``: a plain socket pair, default options, one connection, streaming
  the same number of bytes from contiguous memory (blocking send/recv, C++);
* ``socket_tuned``: a plain socket pair with the transport's socket options and
  number of connections (TCP_NODELAY, SO_RCVLOWAT, header and data in one sendmsg);
* ``memcpy``: one thread copying the same scattered extents between two local pools;

then pdkv's throughput, the ratios, and write latency (one 32 KiB block-half, one
whole block across all layers) next to a raw socket round trip of the same size.
Received bytes are verified by reading them back.

``--hetero SPEC`` (e.g. ``tp2:tp4``, ``bs16:bs32``, ``nhd:hnd``) measures a
heterogeneous prefill -> decode transfer beside the homogeneous one of the same
bytes instead: see pdkv.lab.transfer.hetero.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time

import numpy as np

from pdkv import Agent, Blocks, KVLayout, TcpOptions, available_transports, plan_blocks, set_thread_cpus, thread_cpus
from pdkv.errors import InvalidArgument, PdkvError
from pdkv.lab import _native
from pdkv.lab.transfer import compress, hetero, models, peers
from pdkv.lab.transfer.busy import BusyLoad, parse_churn, parse_cpus
from pdkv.lab.transfer.common import (SECRET_ENV, cell, host_view, human, parse_size, percentile, pool_blocks,
                                      system_congestion_control, tcp_options, write_out)
from pdkv.lab.transfer.cpu import ratio, voluntary_switches
from pdkv.lab.transfer.devmem import DeviceMemory
from pdkv.lab.transfer.link import transfer_behind_link
from pdkv.lab.transfer.target import Target, all_cpus, pin_initiator, spawn_target, start_target


def _pool(agent: Agent, geo, seed: int | None, memory: str = "host") -> tuple[object, KVLayout]:
    """A KV pool in pdkv-allocated shared memory (so every transport can use it), or in
    CUDA device memory (``memory="cuda"``, through the driver API)."""
    fill = np.random.default_rng(seed).integers(0, 256, geo.pool_bytes, dtype=np.uint8) if seed is not None else None
    if memory == "cuda":
        mem = _device_memory()
        ptr = mem.alloc(geo.pool_bytes)
        mem.htod(ptr, fill if fill is not None else np.zeros(geo.pool_bytes, np.uint8))
        agent.register_address(ptr, geo.pool_bytes, kind="cuda", device=mem.device)
        return ptr, KVLayout.contiguous(geo, ptr)
    buf = agent.alloc(geo.pool_bytes).array()
    if fill is not None:
        buf[:] = fill
    return buf, KVLayout.contiguous(geo, buf)


@functools.cache
def _device_memory() -> DeviceMemory:
    return DeviceMemory()


def _read(args, addr: int, n: int) -> np.ndarray:
    """n bytes at addr, from host or (``--memory cuda``) device memory."""
    if args.memory == "cuda":
        return _device_memory().dtoh(addr, n, np.uint8)
    return host_view(addr, n)


# ---------------------------------------------------------------- target process
def _listen(args: argparse.Namespace, bench):
    """The target's agent and raw-socket sink. A ``--target`` initiator on another host finds
    the sink at the agent's port + 1; with ``--listen HOST:0`` the kernel picks the agent's
    port, and when port + 1 is taken we close it and let the kernel pick again."""
    _, _, want = args.listen.rpartition(":")
    tries = 20 if want == "0" else 1
    while True:
        tries -= 1
        # The target offers every transport available here; the initiator picks one.
        agent = Agent("bench-target", secret=os.environ.get(SECRET_ENV, "pdkv-bench"), listen=args.listen,
                      options=[tcp_options(args)],
                      transports=["tcp"] if args.memory == "cuda" else
                      [t for t in available_transports() if t != "cuda_ipc"])
        host, _, port = agent.address.rpartition(":")
        try:
            return agent, bench.Sink(host.strip("[]"), 0 if args.child else int(port) + 1)
        except RuntimeError:
            agent.close()
            if tries == 0:
                raise


def serve(args: argparse.Namespace) -> None:
    """Target side: an agent exporting a pool, plus a raw-socket sink for the ceilings."""
    bench = _native.module().bench
    if args.thread_cpus:
        # the initiator checked them against its CPUs before it pinned itself and us
        set_thread_cpus(parse_cpus(args.thread_cpus, range(os.cpu_count() or 1)))
    geo = hetero.target_geometry(args) if args.hetero else models.geometry(args.model, args.blocks)
    agent, sink = _listen(args, bench)
    buf, layout = _pool(agent, geo, None, args.memory)
    agent.add_layout("kv", layout)
    sources = hetero.serve_sources(agent, args) if args.hetero else []  # noqa: F841 - kept alive while serving
    sys.stdout.write(json.dumps({"address": agent.address, "sink_port": sink.port}) + "\n")
    sys.stdout.flush()
    if not args.child:
        print(f"serving {args.model} x {args.blocks} blocks ({human(geo.pool_bytes)}) at {agent.address}; "
              f"raw sink at port {sink.port}; Ctrl-C to stop", file=sys.stderr)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    else:
        sys.stdin.read()  # until the initiator closes our stdin
    sink.stop()
    agent.close()


# ---------------------------------------------------------------- measurements
def _switches(meter) -> dict[str, int] | None:
    """Voluntary switches per ``process:thread name`` of the metered processes."""
    out: dict[str, int] = {}
    for proc, pid in meter.pids.items():
        v = voluntary_switches(pid)
        if v is None:
            return None
        out.update({f"{proc}:{k}": n for k, n in v.items()})
    return out


def _per(after: dict | None, before: dict | None, n: int) -> dict | None:
    """``{"total": per payload, "by_thread": {name: per payload}}`` (threads that blocked)."""
    if after is None or before is None:
        return None
    d = {k: (v - before.get(k, 0)) / n for k, v in after.items() if v - before.get(k, 0) > 0}
    return {"total": sum(d.values()), "by_thread": d}


def time_transfers(prep, iters: int, timeout: float = 120.0, each: list | None = None) -> float:
    """Seconds for ``iters`` transfers one after the other; ``each`` gets every one's ms."""
    t0 = t = time.perf_counter()
    for _ in range(iters):
        prep.post(timeout=timeout).wait(timeout)
        if each is not None:
            now = time.perf_counter()
            each.append((now - t) * 1e3)
            t = now
    return time.perf_counter() - t0


def latency_us(prep, iters: int) -> list[float]:
    out = []
    for i in range(iters + 20):
        t0 = time.perf_counter()
        prep.post().wait(10)
        if i >= 20:
            out.append((time.perf_counter() - t0) * 1e6)
    return out


def prepare_cost(model: str, num_blocks: int) -> dict:
    """Seconds to validate and lay out a write of ``num_blocks`` scattered blocks.

    ``prepare()`` never touches the memory, so two synthetic, never-mapped address
    ranges of the pool's size are registered (no allocation, whatever the size) and the
    agent prepares against itself: no network either.
    """
    geo = models.geometry(model, num_blocks)
    bases = [1 << 44, (1 << 44) + (1 << 43)]  # far apart, inside the user address space
    if geo.pool_bytes > 1 << 43:
        raise InvalidArgument(f"{num_blocks} blocks of {model} exceed the synthetic address range")
    with Agent("bench-prepare", secret="x", transports=["tcp"]) as a:
        for i, base in enumerate(bases):
            a.register_address(base, geo.pool_bytes, remote_access=True)
            a.add_layout(f"kv{i}", KVLayout.contiguous(geo, base))
        me = a.add_peer(a.metadata())
        rng = np.random.default_rng(0)
        lids = rng.permutation(num_blocks).astype(np.uint32)
        rids = rng.permutation(num_blocks).astype(np.uint32)
        t0 = time.perf_counter()
        prep = a.prepare("write", me, Blocks("kv0", lids), Blocks("kv1", rids))
        dt = time.perf_counter() - t0
        extents = prep.num_extents
    return {"blocks": num_blocks, "extents": extents, "seconds": dt, "ns_per_extent": dt / extents * 1e9,
            "payload_bytes": geo.pool_bytes}


def run_case(args, target: Target, agent: Agent, peer: str, payload: int, src, scratch_layout_name: str) -> dict:
    """pdkv's writes of ``payload`` bytes beside the ceilings, in alternating rounds.

    Each of ``args.rounds`` rounds measures pdkv, then the plain pair, the tuned pair
    and memcpy, each moving the same bytes (``args.min_bytes`` split over the rounds),
    so load that drifts over the run reaches all of them alike. Reported: each figure's
    median over the rounds, the ratios as the median of each round's ratio (pdkv over
    the ceiling measured beside it), their spread (min, max), and every round.
    ``--rounds 1`` is the former single-shot measurement (one sample each).
    """
    bench = _native.module().bench
    geo = models.geometry(args.model, 1)
    block = geo.num_layers * geo.kv_parts * geo.block_bytes
    nblocks = max(1, payload // block)
    payload = nblocks * block
    rounds = max(1, args.rounds)
    iters = args.iters or max(3 if rounds == 1 else 1, math.ceil(args.min_bytes / rounds / payload))
    rng = np.random.default_rng(args.seed)
    lids = rng.permutation(args.local_blocks)[:nblocks].astype(np.uint32)
    rids = rng.permutation(args.remote_blocks)[:nblocks].astype(np.uint32)
    prep = agent.prepare("write", peer, Blocks("kv", lids), Blocks("kv", rids))
    meter = target.cpu_meter()  # each section's CPU: initiator and target process, every thread
    time_transfers(prep, 1)  # warm-up: connections, page faults on the target
    total = payload * iters
    ext = None
    if args.memory == "host":
        # memcpy of the same scattered extents between two local pools.
        ext = [(ro, lo, n) for _, lo, _, ro, n in plan_blocks(
            agent.layout("kv").unbound(), lids, agent.layout(scratch_layout_name).unbound(),
            rng.permutation(args.local_blocks)[:nblocks].astype(np.uint32))]
        bench.memcpy_extents(ext, 1)
    per_round = []
    for _ in range(rounds):
        gb, cpu_gb, by_proc, each = {}, {}, {}, []
        w0 = _switches(meter)
        with meter.measure() as u:
            s = time_transfers(prep, iters, each=each)
        wakes = {"pdkv": _per(_switches(meter), w0, iters)}
        w0 = _switches(meter)
        gb["pdkv"], cpu_gb["pdkv"], by_proc["pdkv"] = total / s / 1e9, u.per_gb(total), u.per_gb_by_process(total)
        with meter.measure() as u:
            s = bench.stream(target.sink_host, target.sink_port, 1, total, payload, False,
                             congestion=args.congestion_control)
        gb["socket_plain"], cpu_gb["socket_plain"] = total / s / 1e9, u.per_gb(total)
        wakes["socket_plain"] = _per(_switches(meter), w0, iters)
        by_proc["socket_plain"] = u.per_gb_by_process(total)
        with meter.measure() as u:
            s = bench.stream(target.sink_host, target.sink_port, args.conns, total, payload, True,
                             args.rcvlowat or 0, congestion=args.congestion_control)
        gb["socket_tuned"], cpu_gb["socket_tuned"] = total / s / 1e9, u.per_gb(total)
        by_proc["socket_tuned"] = u.per_gb_by_process(total)
        if ext is not None:
            with meter.measure() as u:
                s = bench.memcpy_extents(ext, iters)
            gb["memcpy"], cpu_gb["memcpy"], by_proc["memcpy"] = total / s / 1e9, u.per_gb(total), u.per_gb_by_process(total)
        per_round.append({
            "gbps": gb, "cpu_s_per_gb": cpu_gb, "cpu_s_per_gb_by_process": by_proc,
            "pdkv_transfer_ms": [round(v, 3) for v in each],  # each transfer of the round: a stall shows
            # voluntary context switches (blocks that needed a wake-up) per payload moved,
            # initiator + target, every thread: the hand-offs a busy core makes wait
            "wakeups_per_payload": wakes,
            "ratios": {k: gb["pdkv"] / v for k, v in gb.items() if k != "pdkv"},
            "ratios_cpu": {k: ratio(cpu_gb["pdkv"], v) for k, v in cpu_gb.items() if k != "pdkv"},
        })
    # Verify: read the destination blocks back into scratch blocks and compare.
    verified = None
    if not args.no_verify:
        back = agent.prepare("read", peer, Blocks(scratch_layout_name, np.arange(nblocks, dtype=np.uint32)),
                             Blocks("kv", rids))
        back.post().wait(120)
        pairs = plan_blocks(agent.layout("kv").unbound(), lids, agent.layout(scratch_layout_name).unbound(),
                            np.arange(nblocks, dtype=np.uint32))
        verified = all(np.array_equal(_read(args, lo, n), _read(args, ro, n)) for _, lo, _, ro, n in pairs)
    names = [k for k in per_round[0]["gbps"] if k != "pdkv"]
    med = lambda key, k: _median([r[key][k] for r in per_round])  # noqa: E731
    cpu_per_gb = med("cpu_s_per_gb", "pdkv")
    ceil_per_gb = {k: med("cpu_s_per_gb", k) for k in names}
    return {
        "transport": agent.peer_transport(peer),
        "memory": args.memory,
        "model": args.model,
        "payload_bytes": payload,
        "block_bytes": geo.block_bytes,
        "blocks": nblocks,
        "extents": prep.num_extents,
        "iters": iters,
        "rounds": rounds,
        "gbps": med("gbps", "pdkv"),
        "ceilings": {k: med("gbps", k) for k in names},
        # The median of each round's pdkv / ceiling (both measured in that round).
        "ratios": {k: med("ratios", k) for k in names},
        # CPU seconds per GB moved, initiator + target process (None: a target on another host).
        "cpu_s_per_gb": cpu_per_gb,
        "ceilings_cpu_s_per_gb": ceil_per_gb,
        "ratios_cpu": {k: med("ratios_cpu", k) for k in names},
        "spread": {"ratios": {k: _span([r["ratios"][k] for r in per_round]) for k in names},
                   "ratios_cpu": {k: _span([r["ratios_cpu"][k] for r in per_round]) for k in names}},
        "per_round": per_round,
        # Each figure's split by process in its median round (so it adds up to the median).
        "cpu_s_per_gb_by_process": {k: _median_split(per_round, k) for k in ["pdkv", *names]},
        "verified": verified,
        "conns": args.conns,
        "threads": args.threads,
    }


def _median(xs: list) -> float | None:
    """The median of the known values (``None`` when none is known)."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    m = len(xs) // 2
    return xs[m] if len(xs) % 2 else (xs[m - 1] + xs[m]) / 2


def _median_split(per_round: list[dict], key: str) -> dict:
    """``key``'s CPU/GB by process in the round of its median total (the mean of the two
    middle rounds when their number is even), so the parts add up to that median."""
    known = sorted((r for r in per_round if r["cpu_s_per_gb"][key] is not None), key=lambda r: r["cpu_s_per_gb"][key])
    if not known:
        return per_round[0]["cpu_s_per_gb_by_process"][key]
    m = len(known) // 2
    mids = [known[m]] if len(known) % 2 else [known[m - 1], known[m]]
    splits = [r["cpu_s_per_gb_by_process"][key] for r in mids]
    return {p: None if any(s[p] is None for s in splits) else sum(s[p] for s in splits) / len(splits)
            for p in splits[0]}


def _span(xs: list) -> list | None:
    """``[min, max]`` of the known values (``None`` when none is known)."""
    xs = [x for x in xs if x is not None]
    return [min(xs), max(xs)] if xs else None


def run_latency(args, target: Target, agent: Agent, peer: str) -> dict:
    bench = _native.module().bench
    geo = models.geometry(args.model, 1)
    src = agent.layout("kv")
    # One block-half (e.g. 32 KiB): a single extent.
    seg = src.segments[0]
    rseg = agent.peer_info(peer)["layouts"]["kv"].segments[0]
    one = agent.prepare_extents("write", peer, [(seg["region_id"], seg["region_offset"], rseg["region_id"],
                                                 rseg["region_offset"], geo.block_bytes)])
    lat_half = latency_us(one, args.lat_iters)
    whole = agent.prepare("write", peer, Blocks("kv", [0]), Blocks("kv", [1]))
    lat_block = latency_us(whole, max(20, args.lat_iters // 4))
    cc = args.congestion_control
    raw = [x / 1000 for x in bench.pingpong(target.sink_host, target.sink_port, geo.block_bytes, args.lat_iters,
                                            congestion=cc)]
    raw_block = [x / 1000 for x in bench.pingpong(target.sink_host, target.sink_port,
                                                  geo.num_layers * geo.kv_parts * geo.block_bytes,
                                                  max(20, args.lat_iters // 4), congestion=cc)]
    return {
        "block_half_bytes": geo.block_bytes,
        "lat_p50_us": percentile(lat_half, 50),
        "lat_p99_us": percentile(lat_half, 99),
        "raw_rtt_p50_us": percentile(raw, 50),
        "raw_rtt_p99_us": percentile(raw, 99),
        "whole_block_bytes": geo.num_layers * geo.kv_parts * geo.block_bytes,
        "block_lat_p50_us": percentile(lat_block, 50),
        "block_lat_p99_us": percentile(lat_block, 99),
        "raw_block_rtt_p50_us": percentile(raw_block, 50),
    }


def run(args: argparse.Namespace) -> list[dict]:
    if args.memory == "cuda" and args.compare:
        raise InvalidArgument("--compare runs NIXL/Mooncake on host memory; measure them without --memory cuda")
    if args.memory == "cuda":
        _device_memory()  # no driver or device: say so before starting the target
    payloads = [parse_size(p) for p in args.payload.split(",")]
    if args.hetero:
        return run_hetero(args, payloads)
    if args.compress:  # compressed writes beside plain ones (compress.py)
        return compress.run(args, payloads)
    if args.tls:  # the same cases plain, then with TcpOptions(tls=True): the cost of encryption
        if args.transport != "tcp" or args.target:
            raise InvalidArgument("--tls measures the tcp transport between two local processes (--transport tcp)")
        args.tls_on = False
        plain = _run_cases(args, payloads, quiet=True)
        args.tls_on = True
        results = _run_cases(args, payloads, quiet=True)
        for r, p in zip(results, plain):
            r["tls"] = True
            r["plain"] = {k: p[k] for k in ("gbps", "lat_p50_us", "lat_p99_us", "ceilings", "cpu_s_per_gb") if k in p}
            r["ratio_tls_over_plain"] = r["gbps"] / p["gbps"] if p["gbps"] else None
            r["ratio_cpu_tls_over_plain"] = ratio(r["cpu_s_per_gb"], p["cpu_s_per_gb"])
            r["lat_ratio_tls_over_plain"] = r["lat_p50_us"] / p["lat_p50_us"] if p["lat_p50_us"] else None
            if args.json:
                print(json.dumps(r), flush=True)
        if not args.json:
            print_table(args, plain)
            print_table(args, results)
            print_tls(results)
        write_out(args, results)
        return results
    return _run_cases(args, payloads)


def _run_cases(args: argparse.Namespace, payloads: list[int], quiet: bool = False) -> list[dict]:
    """Every payload through tcp_options(args) against a fresh target process."""
    args.remote_blocks = args.local_blocks = pool_blocks(args.model, payloads)
    target = start_target(args, args.remote_blocks)
    results = []
    try:
        secret = os.environ.get(SECRET_ENV, "pdkv-bench")
        transports = [args.transport] + (["tcp"] if args.transport != "tcp" else [])
        with Agent("bench-initiator", secret=secret, listen=f"{args.host}:0", options=[tcp_options(args)],
                   transports=transports) as agent:
            geo = models.geometry(args.model, args.local_blocks)
            src, src_layout = _pool(agent, geo, args.seed, args.memory)
            scratch, scratch_layout = _pool(agent, geo, None, args.memory)
            agent.add_layout("kv", src_layout)
            agent.add_layout("scratch", scratch_layout)
            peer = agent.connect(target.address, transport=args.transport)
            info = agent.peer_info(peer)["layouts"]["kv"].geometry
            if info.num_blocks < args.remote_blocks:
                raise InvalidArgument(f"the target pool has {info.num_blocks} blocks; this run needs "
                                      f"{args.remote_blocks} (start it with --blocks {args.remote_blocks})")
            lat = run_latency(args, target, agent, peer)
            for p in payloads:
                r = run_case(args, target, agent, peer, p, src, "scratch")
                r.update(lat)
                r["lat_ratio_vs_raw_rtt"] = r["lat_p50_us"] / r["raw_rtt_p50_us"]
                r["peers"] = run_peers(args, r) if args.compare else {}
                for name, p in r["peers"].items():
                    if "cpu_s_per_gb" in p:
                        r["ratios_cpu"][name] = p["ratio_cpu_pdkv_over_peer"]
                r["tls"] = bool(getattr(args, "tls_on", False))
                r["congestion_control"] = args.congestion_control or system_congestion_control()
                load = getattr(args, "busy_load", None)
                r["busy"] = load.describe() if load is not None else {"processes": 0, "cpus": []}
                r["pdkv_thread_cpus"] = thread_cpus()  # [] : they inherit their starter's (the pin's)
                r["process_cpus"] = {"initiator": sorted(os.sched_getaffinity(0)),
                                     "target": sorted(os.sched_getaffinity(target.proc.pid)) if target.proc else None}
                results.append(r)
                if args.json and not quiet:
                    print(json.dumps(r), flush=True)
    finally:
        target.close()
    if args.prepare_blocks:
        pc = prepare_cost(args.model, args.prepare_blocks)
        for r in results:
            r["prepare"] = pc
    if not quiet:
        if not args.json:
            print_table(args, results)
        write_out(args, results)
    return results


def print_tls(results: list[dict]) -> None:
    """The cost of TcpOptions(tls=True): each payload's TLS run over its plain run (one invocation)."""
    print("TLS 1.3 (TcpOptions.tls) against the plain run of the same invocation:")
    for r in results:
        print(f"{human(r['payload_bytes']):>9} {r['gbps']:7.2f} GB/s vs plain {r['plain']['gbps']:7.2f} GB/s "
              f"({r['ratio_tls_over_plain']:.2f}x); write p50 {r['lat_p50_us']:.1f} us vs {r['plain']['lat_p50_us']:.1f} us "
              f"({r['lat_ratio_tls_over_plain']:.2f}x); CPU {cell(r['cpu_s_per_gb'], 0, '.2f')} s/GB vs "
              f"{cell(r['plain'].get('cpu_s_per_gb'), 0, '.2f')} s/GB "
              f"({cell(r['ratio_cpu_tls_over_plain'], 0, '.2f', 'x')})")


def run_hetero(args: argparse.Namespace, payloads: list[int]) -> list[dict]:
    """``--hetero SPEC``: pdkv.lab.transfer.hetero's run, written to ``--out`` like the others."""
    pin_initiator(args)
    results = hetero.run(args, payloads, spawn_target, Target)
    write_out(args, results)
    return results


def run_peers(args, r: dict) -> dict:
    """The same workload through NIXL and/or Mooncake (pdkv.lab.transfer.peers)."""
    out = {}
    w = peers.Workload(block_bytes=r["block_bytes"], num_blocks=r["payload_bytes"] // r["block_bytes"],
                       iters=max(2, min(r["iters"], 8)), seed=args.seed, lat_iters=min(args.lat_iters, 200))
    for name in args.compare.split(","):
        name = name.strip()
        try:
            fn = {"nixl": peers.run_nixl, "mooncake": peers.run_mooncake}[name]
        except KeyError:
            out[name] = {"error": f"unknown peer {name!r} (nixl, mooncake)"}
            continue
        try:
            res = fn(w)
            res["ratio_pdkv_over_peer"] = r["gbps"] / res["gbps"] if res.get("gbps") else None
            res["ratio_cpu_pdkv_over_peer"] = ratio(r["cpu_s_per_gb"], res.get("cpu_s_per_gb"))
            out[name] = res
        except Exception as e:  # noqa: BLE001 - reported, never fatal
            out[name] = {"error": f"{type(e).__name__}: {e}"}
    return out


def print_table(args, results: list[dict]) -> None:
    if not results:
        return
    r0 = results[0]
    print(f"\npdkv bench transfer — transport {r0['transport']}{' with TLS' if r0.get('tls') else ''}, "
          f"{args.memory} memory, model {args.model} "
          f"({human(r0['block_bytes'])} block-halves, destinations permuted), conns={args.conns}, "
          f"threads={args.threads}, congestion control {r0.get('congestion_control', '?')}, "
          f"target {'remote ' + args.target if args.target else 'local process'}")
    print(f"{'payload':>9} {'extents':>8} {'pdkv':>7} {'plain':>7} {'tuned':>7} {'memcpy':>7} "
          f"{'/plain':>7} {'/tuned':>7} {'/memcpy':>8}  verified  (GB/s; CPU: s/GB, initiator + target, "
          f"every thread)")
    for r in results:
        c, q = r["ceilings"], r["ratios"]
        print(f"{human(r['payload_bytes']):>9} {r['extents']:>8} {r['gbps']:7.2f} {c['socket_plain']:7.2f} "
              f"{c['socket_tuned']:7.2f} {cell(c.get('memcpy'), 7, '.2f')} {q['socket_plain']:7.2f}x "
              f"{q['socket_tuned']:6.2f}x {cell(q.get('memcpy'), 8, '.2f', 'x')}  {r['verified']}")
        cc, cq = r.get("ceilings_cpu_s_per_gb", {}), r.get("ratios_cpu", {})
        print(f"{'CPU/GB':>18} {cell(r.get('cpu_s_per_gb'), 7, '.3f')} "
              + " ".join(cell(cc.get(k), 7, ".3f") for k in ("socket_plain", "socket_tuned", "memcpy"))
              + f" {cell(cq.get('socket_plain'), 8, '.2f', 'x')} {cell(cq.get('socket_tuned'), 7, '.2f', 'x')} "
              f"{cell(cq.get('memcpy'), 8, '.2f', 'x')}")
        sp = r.get("spread")
        if r.get("rounds", 1) > 1 and sp:
            span = lambda v: "-" if v is None else f"{v[0]:.2f}-{v[1]:.2f}x"  # noqa: E731
            print(f"{'':>9} medians of {r['rounds']} alternating rounds; spread /plain "
                  f"{span(sp['ratios'].get('socket_plain'))} /tuned {span(sp['ratios'].get('socket_tuned'))}, "
                  f"CPU /tuned {span(sp['ratios_cpu'].get('socket_tuned'))}")
        for name, p in r.get("peers", {}).items():
            if "error" in p:
                print(f"{'':>9} {name}: {p['error']}")
            else:
                print(f"{'':>9} {name:>8} {p['gbps']:7.2f} GB/s (pdkv {r['gbps'] / p['gbps']:.2f}x), "
                      f"CPU {cell(p.get('cpu_s_per_gb'), 0, '.3f')} s/GB "
                      f"(pdkv {cell(p.get('ratio_cpu_pdkv_over_peer'), 0, '.2f', 'x')}), "
                      f"{human(p['block_bytes'])} write p50 {p['lat_p50_us']:.1f} us p99 {p['lat_p99_us']:.1f} us, "
                      f"verified {p.get('verified')}")
    print(f"latency: {human(r0['block_half_bytes'])} write p50 {r0['lat_p50_us']:.1f} us, p99 "
          f"{r0['lat_p99_us']:.1f} us; raw socket {human(r0['block_half_bytes'])} round trip p50 "
          f"{r0['raw_rtt_p50_us']:.1f} us, p99 {r0['raw_rtt_p99_us']:.1f} us "
          f"(pdkv/raw {r0['lat_ratio_vs_raw_rtt']:.2f}x)")
    print(f"         one block ({human(r0['whole_block_bytes'])}, all layers) write p50 {r0['block_lat_p50_us']:.1f} us, "
          f"p99 {r0['block_lat_p99_us']:.1f} us; raw round trip p50 {r0['raw_block_rtt_p50_us']:.1f} us")
    if "prepare" in r0:
        p = r0["prepare"]
        print(f"prepare: {p['blocks']:,} blocks -> {p['extents']:,} extents in {p['seconds'] * 1e3:.0f} ms "
              f"({p['ns_per_extent']:.0f} ns/extent; moving them would take "
              f"{p['payload_bytes'] / (r0['gbps'] * 1e9):.0f} s at the measured rate)")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--transport", default="tcp",
                    help="transport to measure: tcp, shm or nixl (default tcp; cuda_ipc: bench/gpu_bench.py)")
    ap.add_argument("--model", default="llama-3-8b", help="KV geometry preset:\n" + models.describe())
    ap.add_argument("--memory", choices=("host", "cuda"), default="host",
                    help="where both sides' KV pools live: host memory (default) or CUDA device 0 "
                         "(tcp stages it through pinned host buffers; needs a CUDA driver)")
    ap.add_argument("--payload", default="64M,256M,1G", help="comma-separated payload sizes (default 64M,256M,1G)")
    ap.add_argument("--iters", type=int, default=0, help="timed repetitions per payload (default: >= --min-bytes)")
    ap.add_argument("--min-bytes", type=lambda s: parse_size(s), default=parse_size("2G"),
                    help="bytes moved per measurement when --iters is 0, split over --rounds (default 2G)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="alternating rounds of pdkv / plain / tuned / memcpy; medians and spread reported "
                         "(default 3; 1: one sample each, the former measurement)")
    ap.add_argument("--lat-iters", type=int, default=1000, help="latency samples (default 1000)")
    ap.add_argument("--conns", type=int, default=TcpOptions().conns_per_peer, help="tcp connections per peer")
    ap.add_argument("--threads", type=int, default=TcpOptions().progress_threads, help="tcp progress threads")
    ap.add_argument("--rcvlowat", type=lambda v: parse_size(v) if v != "0" else 0,
                    default=TcpOptions().rcvlowat_bytes, help="tcp SO_RCVLOWAT cap (default 1M; 0 disables)")
    ap.add_argument("--batch-bytes", type=parse_size, default=TcpOptions().batch_bytes,
                    help="tcp payload bytes per wire batch (default 16M)")
    ap.add_argument("--gather-below", type=lambda v: parse_size(v) if v != "0" else 0,
                    default=TcpOptions().gather_below_bytes,
                    help="tcp: gather batches whose extents average fewer bytes (TcpOptions.gather_below_bytes; "
                    "default 4K; 0: never)")
    ap.add_argument("--land-below", type=lambda v: parse_size(v) if v != "0" else 0,
                    default=TcpOptions().land_below_bytes,
                    help="tcp: land payloads whose extents average fewer bytes in a buffer "
                    "(TcpOptions.land_below_bytes; default 8K; 0: never)")
    ap.add_argument("--congestion-control", default="", metavar="NAME",
                    help="tcp: TcpOptions.congestion_control of both agents and of the raw pairs' senders "
                    "(cubic, reno, bbr, ...; default: the system's, printed in the header and the JSON)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (local mode: both sides)")
    ap.add_argument("--target", default="", help="HOST:PORT of a `pdkv bench transfer --serve` on another host")
    ap.add_argument("--link", default="", help="run target and initiator on two network namespaces behind an "
                    "emulated link RATE[,rtt=..], e.g. 1gbit,rtt=0.2ms (root; see pdkv netlab)")
    ap.add_argument("--serve", action="store_true", help="run as the target (see --target)")
    ap.add_argument("--listen", default="0.0.0.0:7500", help="with --serve: pdkv address; the raw sink uses PORT+1")
    ap.add_argument("--blocks", type=int, default=512, help="with --serve: pool size in blocks")
    ap.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                    help="pin initiator and target to different CPUs (default on)")
    ap.add_argument("--compare", default="", help="also run the workload through peers: nixl,mooncake")
    ap.add_argument("--prepare-blocks", type=int, default=100_000, help="report prepare cost for N blocks (0: skip)")
    ap.add_argument("--no-verify", action="store_true", help="skip reading the bytes back")
    ap.add_argument("--tls", action="store_true",
                    help="run every payload plain, then with TcpOptions(tls=True), and report the ratio (tcp)")
    ap.add_argument("--tls-on", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--busy", type=int, default=0, metavar="N",
                    help="run N spinning processes pinned round-robin to this process's CPUs for the whole run "
                    "(an engine that keeps every core busy; JSON: busy); default 0")
    ap.add_argument("--busy-threads", type=int, default=0, metavar="N",
                    help="run N spinning threads in one co-runner process, each bound to one of this process's "
                    "CPUs in turn (vLLM's OpenMP workers; JSON: busy.threads); default 0")
    ap.add_argument("--busy-churn", default="", metavar="SPEC",
                    help="start processes all through the run (engines starting; JSON: busy.churn): comma-separated "
                    "import[:MODULE] (an interpreter importing MODULE, default torch/numpy), fork[:N] (bursts of N "
                    "/bin/true), alloc[:MiB] (allocate and touch MiB, default 512), one driver each")
    ap.add_argument("--busy-cpus", default="", metavar="LIST",
                    help="the CPUs the spinning co-runners (--busy, --busy-threads) go to, round-robin, e.g. 1 "
                    "(default: all of this process's)")
    ap.add_argument("--pin-cpus", default="", metavar="I,T",
                    help="pin the initiator to CPU I and the target to CPU T (e.g. 0,0: both on one core, "
                    "as --pin did before 2026-12-07); default: --pin's first and second CPU")
    ap.add_argument("--thread-cpus", default="", metavar="LIST",
                    help="pdkv.set_thread_cpus in initiator and target before their agents: the CPUs of pdkv's "
                    "own threads (the vLLM connector's kv_cpus), e.g. 0 or all (default: they inherit the pin)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object per payload instead of a table")
    ap.add_argument("--out", default="", help="also write all results to this JSON file")
    hetero.add_arguments(ap)
    compress.add_arguments(ap)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdkv bench transfer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(ap)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    args.argv = argv
    avail = [t for t in available_transports() if t != "cuda_ipc"]
    if args.transport not in avail:
        print(f"pdkv bench transfer: transport {args.transport!r} is not available here "
              f"(available: {', '.join(avail)})", file=sys.stderr)
        return 2
    if args.transport == "nixl":
        os.environ.setdefault("UCX_NET_DEVICES", "lo" if args.host.startswith("127.") else "all")
    if args.transport == "shm" and args.target:
        ap.error("the shm transport needs both sides on this host (drop --target)")
    if args.hetero:
        try:
            hetero.check_arguments(args)
        except (InvalidArgument, KeyError) as e:
            ap.error(str(e).strip("'\""))
    if args.busy < 0:
        ap.error(f"--busy must be >= 0, got {args.busy}")
    if args.busy_threads < 0:
        ap.error(f"--busy-threads must be >= 0, got {args.busy_threads}")
    try:
        churn = parse_churn(args.busy_churn)
    except InvalidArgument as e:
        ap.error(f"--busy-churn: {e}")
    cpus = all_cpus(args) if not args.serve else list(range(os.cpu_count() or 1))  # before any pin
    try:
        busy_cpus = parse_cpus(args.busy_cpus, cpus) if args.busy_cpus else None
        args.thread_cpus_list = parse_cpus(args.thread_cpus, cpus) if args.thread_cpus else []
        args.pin_cpus = parse_cpus(args.pin_cpus, cpus) if args.pin_cpus else []
        if args.pin_cpus and len(args.pin_cpus) != 2:
            raise InvalidArgument(f"--pin-cpus takes two CPUs (initiator,target), got {args.pin_cpus}")
    except InvalidArgument as e:
        ap.error(str(e))
    if args.thread_cpus_list and not args.serve:
        set_thread_cpus(args.thread_cpus_list)
    if args.link:
        return transfer_behind_link(args, argv)
    if args.serve:
        if args.target:
            ap.error("--serve and --target are exclusive")
        serve(args)
        return 0
    with BusyLoad(args.busy, cpus=busy_cpus, threads=args.busy_threads, churn=churn) as load:
        args.busy_load = load
        if not args.json:
            if args.busy:
                print(f"busy: {args.busy} spinning co-runner process(es) pinned to CPUs {load.cpus}", flush=True)
            if args.busy_threads:
                print(f"busy: {args.busy_threads} spinning thread(s) in one process bound to CPUs "
                      f"{load.thread_cpus}", flush=True)
            if churn:
                print("busy: churn " + ", ".join(f"{k}:{a}" for k, a in churn), flush=True)
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
