"""``pdkv bench transfer --hetero SPEC``: a heterogeneous prefill -> decode transfer
beside the homogeneous transfer of the same bytes, in one run, verified.

SPEC is a comma-separated list of ``prefill:decode`` pairs, each changing one aspect
of the model preset's geometry (``--model``):

* ``tpA:tpB``: prefill TP size A, decode TP size B (the preset's total KV heads are
  split per rank by :class:`pdkv.tp.TPMapping`, GQA replication included);
* ``bsA:bsB``: tokens per block on each side;
* ``nhd:hnd`` / ``hnd:nhd``: element order inside a block on each side.

What is measured: **one decode rank (rank 0) receiving a request's KV from every
prefill rank that feeds it**, with the TP helper's head offsets, all transfers posted
together and timed until all have landed:

* ``--hetero-mode push`` (default): the prefill ranks ``write``. The initiator process
  holds those prefill ranks' pools, the target process decode rank 0's pool; the
  homogeneous baseline writes the same bytes from a pool with decode rank 0's own
  geometry into other blocks of the same target pool.
* ``--hetero-mode pull``: decode rank 0 ``read``s. The target process holds the
  prefill ranks' pools (filled from ``--seed``, which the initiator regenerates for
  its reference) and a pool with decode rank 0's geometry holding the same bytes for
  the homogeneous baseline; the initiator holds decode rank 0's pool.

Hetero and homogeneous alternate round by round. After the timed rounds both
destinations are compared bit for bit with a numpy reference assembled from the
source pools.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from pdkv import Agent, Blocks, KVLayout, PlanOptions
from pdkv.errors import InvalidArgument
from pdkv.layout import KVGeometry
from pdkv.tp import TPMapping, TPTransfer
from pdkv.lab.transfer import models
from pdkv.lab.transfer.common import SECRET_ENV, cell, tcp_options
from pdkv.lab.transfer.cpu import CpuMeter, CpuUsage, ratio

DECODE_RANK = 0  # the decode rank whose inbound traffic is measured
_ORDERS = ("NHD", "HND")


@dataclass(frozen=True)
class HeteroSpec:
    """Prefill (source) and decode (destination) geometry choices of one run."""

    text: str
    prefill_tp: int
    decode_tp: int
    src_block_tokens: int
    dst_block_tokens: int
    src_order: str
    dst_order: str


def parse_spec(text: str, model: str) -> HeteroSpec:
    """``"tp2:tp4,nhd:hnd"`` -> HeteroSpec (unnamed aspects keep the preset's value)."""
    _layers, _heads, _dim, _dtype, bt, _parts, _ = models.preset(model)
    tp = models.PRESET_TP.get(model, 1)
    got: dict[str, tuple] = {}
    items = [i.strip() for i in text.split(",") if i.strip()]
    if not items:
        raise InvalidArgument("--hetero needs at least one item: tpA:tpB, bsA:bsB, nhd:hnd or hnd:nhd")
    for item in items:
        kind, pair = _parse_item(item)
        if kind in got:
            raise InvalidArgument(f"--hetero names {kind} twice ({got[kind][0]!r} and {item!r})")
        got[kind] = (item, pair)
    ptp, dtp = got.get("tp", (None, (tp, tp)))[1]
    sbt, dbt = got.get("bs", (None, (bt, bt)))[1]
    so, do = got.get("order", (None, ("NHD", "NHD")))[1]
    return HeteroSpec(",".join(items), ptp, dtp, sbt, dbt, so, do)


def _parse_item(item: str) -> tuple[str, tuple]:
    a, sep, b = item.lower().partition(":")
    bad = InvalidArgument(f"--hetero item {item!r} not understood: use tpA:tpB, bsA:bsB, nhd:hnd or hnd:nhd")
    if not sep:
        raise bad
    if a.upper() in _ORDERS and b.upper() in _ORDERS:
        return "order", (a.upper(), b.upper())
    for kind in ("tp", "bs"):
        if a.startswith(kind) and b.startswith(kind):
            try:
                x, y = int(a[2:]), int(b[2:])
            except ValueError:
                raise bad from None
            if x <= 0 or y <= 0:
                raise InvalidArgument(f"--hetero item {item!r}: sizes must be positive")
            return kind, (x, y)
    raise bad


class Push(NamedTuple):
    """A write one prefill rank issues towards the measured decode rank."""

    prefill_rank: int
    transfer: TPTransfer


class Plan:
    """Geometries and the TP mapping of one spec at one model preset."""

    def __init__(self, spec: HeteroSpec, model: str) -> None:
        self.spec = spec
        self.model = model
        self.mapping = TPMapping(spec.prefill_tp, spec.decode_tp, models.total_kv_heads(model))
        # The pushes that land on DECODE_RANK, as issued by each prefill rank.
        self.pushes: list[Push] = []
        for incoming in self.mapping.transfers(side="decode", rank=DECODE_RANK, mode="push"):
            issued = self.mapping.transfers(side="prefill", rank=incoming.peer_rank, mode="push")
            self.pushes += [Push(incoming.peer_rank, t) for t in issued if t.peer_rank == DECODE_RANK]
        # The same data pulled: the reads DECODE_RANK issues (peer_rank = prefill rank).
        self.pulls: list[TPTransfer] = self.mapping.transfers(side="decode", rank=DECODE_RANK, mode="pull")

    @property
    def prefill_ranks(self) -> list[int]:
        return sorted({p.prefill_rank for p in self.pushes})

    def src_geometry(self, prefill_rank: int, num_blocks: int) -> KVGeometry:
        return models.rank_geometry(self.model, num_blocks, kv_heads=self.mapping.heads("prefill", prefill_rank).count,
                                    block_tokens=self.spec.src_block_tokens, order=self.spec.src_order)

    def dst_geometry(self, num_blocks: int) -> KVGeometry:
        return models.rank_geometry(self.model, num_blocks, kv_heads=self.mapping.heads("decode", DECODE_RANK).count,
                                    block_tokens=self.spec.dst_block_tokens, order=self.spec.dst_order)

    def dst_blocks_for(self, payload: int) -> int:
        """Decode-side blocks of a payload (>= 1)."""
        g = self.dst_geometry(1)
        return max(1, payload // (g.num_layers * g.kv_parts * g.block_bytes))

    def src_blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.spec.src_block_tokens)

    def target_src_blocks(self, target_blocks: int) -> int:
        """Pull mode: blocks of each prefill pool the target serves (enough for the
        largest request its decode-geometry pool of ``target_blocks`` was sized for)."""
        return self.src_blocks_for(target_blocks // 2 * self.spec.dst_block_tokens)


def target_geometry(args: argparse.Namespace) -> KVGeometry:
    """The target process's pool (decode rank 0), ``args.blocks`` blocks."""
    return Plan(parse_spec(args.hetero, args.model), args.model).dst_geometry(args.blocks)


def target_blocks(args: argparse.Namespace, payloads: list[int]) -> int:
    """Target pool size: room for the hetero and the homogeneous destinations of the largest payload."""
    plan = Plan(parse_spec(args.hetero, args.model), args.model)
    return 2 * max(plan.dst_blocks_for(p) for p in payloads)


def target_flags(args: argparse.Namespace) -> list[str]:
    """What a spawned target needs to know of a --hetero run."""
    return ["--hetero", args.hetero, "--hetero-mode", args.hetero_mode, "--seed", str(args.seed)]


def source_bytes(geo: KVGeometry, prefill_rank: int, seed: int) -> np.ndarray:
    """The deterministic contents of a prefill rank's pool (both processes can make them)."""
    return np.random.default_rng(seed + prefill_rank).integers(0, 256, geo.pool_bytes, dtype=np.uint8)


def serve_sources(agent: Agent, args: argparse.Namespace) -> list:
    """Target side of pull mode: the prefill ranks' pools as layouts ``src<rank>``
    (their regions are returned: keep them alive). Nothing in push mode."""
    if args.hetero_mode != "pull":
        return []
    plan = Plan(parse_spec(args.hetero, args.model), args.model)
    regions = []
    for r in plan.prefill_ranks:
        geo = plan.src_geometry(r, plan.target_src_blocks(args.blocks))
        region = agent.alloc(geo.pool_bytes)
        buf = region.array()
        buf[:] = source_bytes(geo, r, args.seed)
        agent.add_layout(f"src{r}", KVLayout.contiguous(geo, buf))
        regions.append(region)
    return regions


# ---------------------------------------------------------------- numpy views of contiguous pools
def logical(buf: np.ndarray, geo: KVGeometry, ids, tokens: int) -> np.ndarray:
    """Bytes of blocks ``ids`` of a :meth:`KVLayout.contiguous` pool as
    ``[layers, parts, tokens, heads, head_dim*itemsize]`` uint8 (a copy)."""
    L, P, B, T, H = geo.num_layers, geo.kv_parts, geo.num_blocks, geo.block_tokens, geo.kv_heads
    e = geo.head_dim * geo.itemsize
    ids = np.asarray(ids, dtype=np.int64)
    if geo.order == "NHD":
        x = buf[:geo.pool_bytes].reshape(L, P, B, T, H, e)[:, :, ids]
    else:
        x = buf[:geo.pool_bytes].reshape(L, P, B, H, T, e)[:, :, ids].transpose(0, 1, 2, 4, 3, 5)
    return x.reshape(L, P, len(ids) * T, H, e)[:, :, :tokens]


def store(buf: np.ndarray, geo: KVGeometry, ids, x: np.ndarray) -> None:
    """Inverse of :func:`logical` for whole blocks."""
    L, P, B, T, H = geo.num_layers, geo.kv_parts, geo.num_blocks, geo.block_tokens, geo.kv_heads
    e = geo.head_dim * geo.itemsize
    ids = np.asarray(ids, dtype=np.int64)
    y = x.reshape(L, P, len(ids), T, H, e)
    if geo.order == "NHD":
        view = buf[:geo.pool_bytes].reshape(L, P, B, T, H, e)
    else:
        view = buf[:geo.pool_bytes].reshape(L, P, B, H, T, e)
        y = y.transpose(0, 1, 2, 4, 3, 5)
    view[:, :, ids] = y


# ---------------------------------------------------------------- the run
@dataclass
class Pools:
    """The initiator's pools: one per feeding prefill rank, the homogeneous source, scratch."""

    src: dict[int, tuple[np.ndarray, KVGeometry]]
    hom: tuple[np.ndarray, KVGeometry]
    scratch: tuple[np.ndarray, KVGeometry]
    regions: list  # (layout name, region), released by close()

    def close(self, agent: Agent) -> None:
        for name, region in self.regions:
            agent.remove_layout(name)
            region.close()


def make_pools(agent: Agent, plan: Plan, src_blocks: int, dst_blocks: int, seed: int) -> Pools:
    regions = []

    def pool(name: str, geo: KVGeometry, fill_rank: int | None = None) -> tuple[np.ndarray, KVGeometry]:
        region = agent.alloc(geo.pool_bytes)
        regions.append((name, region))
        buf = region.array()
        if fill_rank is not None:
            buf[:] = source_bytes(geo, fill_rank, seed)
        agent.add_layout(name, KVLayout.contiguous(geo, buf))
        return buf, geo

    src = {r: pool(f"src{r}", plan.src_geometry(r, src_blocks), r) for r in plan.prefill_ranks}
    hom = pool("hom", plan.dst_geometry(dst_blocks))
    return Pools(src, hom, pool("scratch", plan.dst_geometry(dst_blocks)), regions)


def reference(plan: Plan, sources: dict[int, tuple[np.ndarray, KVGeometry]], src_ids, tokens: int) -> np.ndarray:
    """What decode rank 0's blocks must hold, head by head in the model's numbering: each
    global head from the prefill rank the mapping names as its source (``sources``:
    prefill rank -> its pool's bytes and geometry). Independent of the transfers' offsets."""
    g = plan.dst_geometry(1)
    out = np.zeros((g.num_layers, g.kv_parts, tokens, g.kv_heads, g.head_dim * g.itemsize), np.uint8)
    mine = plan.mapping.heads("decode", DECODE_RANK)
    views = {r: logical(buf, geo, src_ids, tokens) for r, (buf, geo) in sources.items()}
    for head in mine:
        src = plan.mapping.source(DECODE_RANK, head)
        out[:, :, :, head - mine.start] = views[src][:, :, :, head - plan.mapping.heads("prefill", src).start]
    return out


def time_round(preps) -> float:
    t0 = time.perf_counter()
    xfers = [p.post(timeout=120) for p in preps]
    for x in xfers:
        x.wait(120)
    return time.perf_counter() - t0


PREPARE_REPEATS = 7


def prepare_request_ms(plan: Plan, tokens: int, mode: str, transport: str = "tcp") -> dict:
    """Milliseconds to prepare one ``tokens``-token request in ``mode`` over ``transport``
    (tcp or shm: each plans differently), hetero (every push, or every pull) and
    homogeneous, against synthetic never-mapped ranges (no memory, no network; as
    ``prepare_cost`` in transfer.py); block ids scattered (a random permutation).
    ``*_ms``: the median of PREPARE_REPEATS requests prepared one after another;
    ``*_first_ms``: the first of them."""
    dst_blocks = math.ceil(tokens / plan.spec.dst_block_tokens)
    src_blocks = plan.src_blocks_for(tokens)
    base = 1 << 44
    out = {"tokens": tokens, "transport": transport}
    with Agent("bench-hetero-prepare", secret="x", transports=[transport]) as a:
        geos = {f"src{p.prefill_rank}": plan.src_geometry(p.prefill_rank, src_blocks) for p in plan.pushes}
        geos["dst"] = plan.dst_geometry(dst_blocks)
        geos["hom"] = plan.dst_geometry(dst_blocks)
        for name, geo in geos.items():
            a.register_address(base, geo.pool_bytes, remote_access=True)
            a.add_layout(name, KVLayout.contiguous(geo, base))
            base += (geo.pool_bytes + (1 << 30)) & ~((1 << 30) - 1)
        me = a.add_peer(a.metadata())
        rng = np.random.default_rng(0)
        sids, dids = rng.permutation(src_blocks).astype(np.uint32), rng.permutation(dst_blocks).astype(np.uint32)
        hom_ids = rng.permutation(dst_blocks).astype(np.uint32)

        def hetero():
            if mode == "pull":
                return [a.prepare("read", me, Blocks("dst", dids), Blocks(f"src{t.peer_rank}", sids),
                                  plan=_pull_plan(plan, t, tokens)) for t in plan.pulls]
            return [a.prepare("write", me, Blocks(f"src{p.prefill_rank}", sids), Blocks("dst", dids),
                              plan=_push_plan(plan, p, tokens)) for p in plan.pushes]

        def homogeneous():
            return [a.prepare("read" if mode == "pull" else "write", me, Blocks("hom", dids), Blocks("dst", hom_ids))]

        # Request after request, as a serving engine prepares them: the median of
        # PREPARE_REPEATS (the first, cold, one kept apart: it pays one-time page faults).
        for key, fn in (("hetero", hetero), ("homogeneous", homogeneous)):
            times, preps = [], []
            for _ in range(PREPARE_REPEATS):
                t0 = time.perf_counter()
                preps = fn()
                times.append((time.perf_counter() - t0) * 1e3)
            out[f"{key}_ms"] = statistics.median(times)
            out[f"{key}_first_ms"] = times[0]
            out[f"{key}_extents"] = sum(p.num_extents for p in preps)
    return out


def _push_plan(plan: Plan, push: Push, tokens: int) -> PlanOptions:
    return _with_tokens(plan, push.transfer.plan(), tokens)


def _pull_plan(plan: Plan, pull: TPTransfer, tokens: int) -> PlanOptions:
    return _with_tokens(plan, pull.plan(), tokens)


def _with_tokens(plan: Plan, options: PlanOptions, tokens: int) -> PlanOptions:
    """Block lists of different block sizes hold different token counts: say how many move."""
    if plan.spec.src_block_tokens != plan.spec.dst_block_tokens:
        options.num_tokens = tokens
    return options


def _plan_fields(plan: Plan, options: PlanOptions) -> dict:
    """A transfer's plan as the results record it (``num_tokens`` where the block sizes differ)."""
    out = {"num_heads": options.num_heads, "local_head_offset": options.local_head_offset,
           "remote_head_offset": options.remote_head_offset}
    if plan.spec.src_block_tokens != plan.spec.dst_block_tokens:
        out["num_tokens"] = options.num_tokens
    return out


@dataclass
class Request:
    """Block ids of one measured request: prefill-side sources, the two target destinations."""

    tokens: int
    src_ids: np.ndarray
    het_ids: np.ndarray  # target blocks the hetero pushes fill
    hom_ids: np.ndarray  # target blocks the homogeneous write fills
    hom_local: np.ndarray  # blocks of the local homogeneous source


def make_request(plan: Plan, payload: int, target_pool_blocks: int, seed: int) -> Request:
    n_dst = plan.dst_blocks_for(payload)
    tokens = n_dst * plan.spec.dst_block_tokens
    rng = np.random.default_rng(seed)
    src_ids = rng.permutation(plan.src_blocks_for(tokens)).astype(np.uint32)
    dst = rng.permutation(target_pool_blocks).astype(np.uint32)
    return Request(tokens, src_ids, dst[:n_dst], dst[n_dst:2 * n_dst], rng.permutation(n_dst).astype(np.uint32))


def run_case(args, plan: Plan, agent: Agent, peer: str, payload: int, target_pool_blocks: int,
             meter: CpuMeter) -> dict:
    """One payload, hetero beside homogeneous; ``meter`` reads the initiator and the target
    process around every timed round."""
    req = make_request(plan, payload, target_pool_blocks, args.seed)
    if args.hetero_mode == "pull":
        r = run_pull(args, plan, agent, peer, req, target_pool_blocks, meter)
        transfers = [{"prefill_rank": t.peer_rank, **_plan_fields(plan, _pull_plan(plan, t, req.tokens))}
                     for t in plan.pulls]
    else:
        r = run_push(args, plan, agent, peer, req, meter)
        transfers = [{"prefill_rank": p.prefill_rank, **_plan_fields(plan, _push_plan(plan, p, req.tokens))}
                     for p in plan.pushes]
    what = "receiving pushes from" if args.hetero_mode == "push" else "pulling from"
    return {
        "hetero": plan.spec.text,
        "mode": args.hetero_mode,
        "measured": f"decode rank {DECODE_RANK} {what} prefill ranks {plan.prefill_ranks}",
        "transport": agent.peer_transport(peer),
        "model": args.model,
        "prefill": _describe(plan.src_geometry(plan.prefill_ranks[0], len(req.src_ids)), plan.spec.prefill_tp),
        "decode": _describe(plan.dst_geometry(len(req.het_ids)), plan.spec.decode_tp),
        "transfers": transfers,
        "tokens": req.tokens,
        **r,
    }


def run_push(args, plan: Plan, agent: Agent, peer: str, req: Request, meter: CpuMeter) -> dict:
    """Push mode: local prefill pools written into the target's decode pool."""
    pools = make_pools(agent, plan, len(req.src_ids), len(req.het_ids), args.seed)
    try:
        expected = reference(plan, pools.src, req.src_ids, req.tokens)
        store(pools.hom[0], pools.hom[1], req.hom_local, expected)
        r = measure(args, meter,
                    lambda: [agent.prepare("write", peer, Blocks(f"src{p.prefill_rank}", req.src_ids),
                                           Blocks("kv", req.het_ids), plan=_push_plan(plan, p, req.tokens))
                             for p in plan.pushes],
                    lambda: [agent.prepare("write", peer, Blocks("hom", req.hom_local), Blocks("kv", req.hom_ids))])
        r["verified"] = None if args.no_verify else verify(args, agent, peer, pools, expected,
                                                              [req.het_ids, req.hom_ids])
    finally:
        pools.close(agent)
    return r


def run_pull(args, plan: Plan, agent: Agent, peer: str, req: Request, target_pool_blocks: int,
             meter: CpuMeter) -> dict:
    """Pull mode: decode rank 0's local pool reads the target's prefill pools; the
    homogeneous baseline reads the same bytes, staged untimed into the target's
    decode-geometry pool, into other local blocks."""
    n = len(req.het_ids)
    src_blocks = plan.target_src_blocks(target_pool_blocks)
    sources = {}
    for r in plan.prefill_ranks:
        geo = plan.src_geometry(r, src_blocks)
        sources[r] = (source_bytes(geo, r, args.seed), geo)
    expected = reference(plan, sources, req.src_ids, req.tokens)
    geo = plan.dst_geometry(2 * n)
    region = agent.alloc(geo.pool_bytes)
    buf = region.array()
    agent.add_layout("dst", KVLayout.contiguous(geo, buf))
    local = np.random.default_rng(args.seed + 1).permutation(2 * n).astype(np.uint32)
    het_local, hom_local = local[:n], local[n:]
    try:
        store(buf, geo, hom_local, expected)
        agent.prepare("write", peer, Blocks("dst", hom_local),
                      Blocks("kv", req.hom_ids)).post().wait(120)  # stage, untimed
        buf[:] = 0
        r = measure(args, meter,
                    lambda: [agent.prepare("read", peer, Blocks("dst", het_local),
                                           Blocks(f"src{t.peer_rank}", req.src_ids),
                                           plan=_pull_plan(plan, t, req.tokens)) for t in plan.pulls],
                    lambda: [agent.prepare("read", peer, Blocks("dst", hom_local), Blocks("kv", req.hom_ids))])
        if not args.no_verify:
            want = corrupted(expected) if args.corrupt_reference else expected
            r["verified"] = all(np.array_equal(logical(buf, geo, ids, req.tokens), want)
                                for ids in (het_local, hom_local))
        else:
            r["verified"] = None
    finally:
        agent.remove_layout("dst")
        region.close()
    return r


def measure(args, meter: CpuMeter, prepare_hetero, prepare_homogeneous) -> dict:
    """Prepares both transfers (each factory returns a list of prepared transfers), then
    times them in alternating rounds, reading ``meter``'s processes around each round."""
    t0 = time.perf_counter()
    het = prepare_hetero()
    het_prepare = time.perf_counter() - t0
    t0 = time.perf_counter()
    hom = prepare_homogeneous()
    hom_prepare = time.perf_counter() - t0
    nbytes = sum(p.nbytes for p in het)
    if nbytes != sum(p.nbytes for p in hom):
        raise AssertionError(f"hetero moves {nbytes} bytes, homogeneous {sum(p.nbytes for p in hom)}")
    iters = args.iters or max(3, math.ceil(args.min_bytes / nbytes))
    time_round(het), time_round(hom)  # warm-up: connections, page faults
    het_s = hom_s = 0.0
    het_cpu, hom_cpu = CpuUsage(), CpuUsage()
    for _ in range(iters):  # alternating, so both see the same machine
        with meter.measure() as c:
            het_s += time_round(het)
        het_cpu += c
        with meter.measure() as c:
            hom_s += time_round(hom)
        hom_cpu += c
    het_gbps, hom_gbps = nbytes * iters / het_s / 1e9, nbytes * iters / hom_s / 1e9
    moved = nbytes * iters
    het_per_gb, hom_per_gb = het_cpu.per_gb(moved), hom_cpu.per_gb(moved)
    return {
        "payload_bytes": nbytes,
        "iters": iters,
        "gbps": het_gbps,
        "homogeneous_gbps": hom_gbps,
        "ratios": {"homogeneous": het_gbps / hom_gbps},
        # CPU seconds per GB moved, initiator + target process, every thread (None: a remote target).
        "cpu_s_per_gb": het_per_gb,
        "homogeneous_cpu_s_per_gb": hom_per_gb,
        "ratios_cpu": {"homogeneous": ratio(het_per_gb, hom_per_gb)},
        "cpu_s_per_gb_by_process": {"hetero": het_cpu.per_gb_by_process(moved),
                                    "homogeneous": hom_cpu.per_gb_by_process(moved)},
        "extents": {"hetero": sum(p.num_extents for p in het), "homogeneous": sum(p.num_extents for p in hom)},
        "prepare_ms": {"hetero": het_prepare * 1e3, "homogeneous": hom_prepare * 1e3},
    }


def _describe(geo: KVGeometry, tp: int) -> dict:
    return {"tp": tp, "kv_heads_per_rank": geo.kv_heads, "block_tokens": geo.block_tokens, "order": geo.order,
            "block_half_bytes": geo.block_bytes}


def corrupted(expected: np.ndarray) -> np.ndarray:
    """A deliberately wrong reference (one byte flipped): the check must be able to fail."""
    bad = expected.copy()
    bad.reshape(-1)[bad.size // 2] ^= 0xFF
    return bad


def verify(args, agent: Agent, peer: str, pools: Pools, expected: np.ndarray, destinations) -> bool:
    """Reads each destination (target block ids) back and compares it with the reference, bit for bit."""
    if args.corrupt_reference:
        expected = corrupted(expected)
    buf, geo = pools.scratch
    ok = True
    for ids in destinations:
        scratch_ids = np.arange(len(ids), dtype=np.uint32)
        buf[:] = 0
        agent.prepare("read", peer, Blocks("scratch", scratch_ids), Blocks("kv", ids)).post().wait(120)
        ok &= bool(np.array_equal(logical(buf, geo, scratch_ids, expected.shape[2]), expected))
    return ok


def check_arguments(args: argparse.Namespace) -> None:
    """Caller errors of a --hetero run, before any process starts: InvalidArgument/KeyError."""
    Plan(parse_spec(args.hetero, args.model), args.model)
    if args.memory != "host":
        raise InvalidArgument("--hetero measures host memory pools (drop --memory cuda)")
    if args.compare:
        raise InvalidArgument("--hetero does not run --compare peers")
    if args.hetero_request_tokens < 0:
        raise InvalidArgument(f"--hetero-request-tokens must be >= 0, got {args.hetero_request_tokens}")


def run(args: argparse.Namespace, payloads: list[int], spawn_target, Target) -> list[dict]:
    """The --hetero run: spawn (or reach) the target, then one case per payload."""
    check_arguments(args)
    plan = Plan(parse_spec(args.hetero, args.model), args.model)
    blocks = target_blocks(args, payloads)
    if args.target:
        host, _, port = args.target.rpartition(":")
        target = Target(args.target, host.strip("[]"), int(port) + 1)
    else:
        target = spawn_target(args, blocks)
    results = []
    meter = target.cpu_meter()
    try:
        transports = [args.transport] + (["tcp"] if args.transport != "tcp" else [])
        with Agent("bench-hetero", secret=os.environ.get(SECRET_ENV, "pdkv-bench"), listen=f"{args.host}:0",
                   options=[tcp_options(args)], transports=transports) as agent:
            peer = agent.connect(target.address, transport=args.transport)
            info = agent.peer_info(peer)["layouts"]["kv"].geometry
            if not info == plan.dst_geometry(info.num_blocks).native() or info.num_blocks < blocks:
                raise InvalidArgument(f"the target pool is {_geometry_text(info)}; this run needs "
                                      f"{_geometry_text(plan.dst_geometry(blocks))} (start it with --hetero "
                                      f"{args.hetero} --blocks {blocks})")
            if args.hetero_mode == "pull":
                check_target_sources(plan, agent.peer_info(peer)["layouts"], info.num_blocks)
            for p in payloads:
                r = run_case(args, plan, agent, peer, p, info.num_blocks, meter)
                if args.hetero_request_tokens:
                    r["prepare_request"] = prepare_request_ms(plan, args.hetero_request_tokens, args.hetero_mode,
                                                                "shm" if args.transport == "shm" else "tcp")
                results.append(r)
                if args.json:
                    print(json.dumps(r), flush=True)
    finally:
        target.close()
    if not args.json:
        print_table(args, results)
    return results


def _geometry_text(g) -> str:
    """A KVGeometry (Python or native) in words."""
    order = g.order if isinstance(g.order, str) else str(g.order).rsplit(".", 1)[-1]
    return (f"{g.num_layers} layers x {g.kv_parts} parts, {g.num_blocks} blocks of {g.block_tokens} tokens, "
            f"{g.kv_heads} kv heads x {g.head_dim} {g.dtype}, {order}")


def check_target_sources(plan: Plan, layouts: dict, target_blocks: int) -> None:
    """Pull mode: the target must serve each prefill rank's pool as ``src<rank>``."""
    for r in plan.prefill_ranks:
        want = plan.src_geometry(r, plan.target_src_blocks(target_blocks))
        got = layouts.get(f"src{r}")
        if got is None or not got.geometry == want.native():
            raise InvalidArgument(f"the target does not serve prefill rank {r}'s pool as {_geometry_text(want)} "
                                  "(start it with the same --hetero, --hetero-mode pull and --seed)")


def print_table(args, results: list[dict]) -> None:
    if not results:
        return
    r0 = results[0]
    print(f"\npdkv bench transfer --hetero {r0['hetero']} — transport {r0['transport']}, model {args.model}; "
          f"{r0['measured']}")
    print(f"  prefill: {r0['prefill']}\n  decode:  {r0['decode']}")
    print(f"{'payload':>9} {'extents':>8} {'hetero':>7} {'homog.':>7} {'ratio':>7} {'prep ms':>8}  verified  (GB/s)"
          f"  {'hetero':>7} {'homog.':>7} {'ratio':>7}  (CPU s/GB, initiator + target)")
    for r in results:
        print(f"{r['payload_bytes'] / 2**20:7.0f}Mi {r['extents']['hetero']:>8} {r['gbps']:7.2f} "
              f"{r['homogeneous_gbps']:7.2f} {r['ratios']['homogeneous']:6.2f}x {r['prepare_ms']['hetero']:8.2f}  "
              f"{str(r['verified']):<8}{'':>8}  {cell(r.get('cpu_s_per_gb'), 7, '.3f')} "
              f"{cell(r.get('homogeneous_cpu_s_per_gb'), 7, '.3f')} "
              f"{cell(r.get('ratios_cpu', {}).get('homogeneous'), 7, '.2f', 'x')}")
        if "prepare_request" in r:
            q = r["prepare_request"]
            print(f"{'':>9} prepare of a {q['tokens']}-token request (scattered ids, median of {PREPARE_REPEATS}): "
                  f"hetero {q['hetero_ms']:.2f} ms ({q['hetero_extents']} extents), homogeneous "
                  f"{q['homogeneous_ms']:.2f} ms; the first, cold: {q['hetero_first_ms']:.2f} / "
                  f"{q['homogeneous_first_ms']:.2f} ms")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--hetero", default="",
                    help="measure a heterogeneous transfer beside the homogeneous one of the same bytes: "
                         "comma-separated prefill:decode pairs tpA:tpB, bsA:bsB, nhd:hnd, hnd:nhd "
                         "(e.g. tp2:tp4,nhd:hnd); see pdkv.lab.transfer.hetero")
    ap.add_argument("--hetero-mode", choices=("push", "pull"), default="push",
                    help="with --hetero: prefill ranks write into decode rank 0 (push, default), or decode rank 0 "
                         "reads from them (pull)")
    ap.add_argument("--hetero-request-tokens", type=int, default=4096,
                    help="with --hetero: also time preparing one request of N tokens (0: skip; default 4096)")
    ap.add_argument("--corrupt-reference", action="store_true", help=argparse.SUPPRESS)
