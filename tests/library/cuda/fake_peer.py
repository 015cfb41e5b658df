"""A pdkv agent whose KV pool lives in fake-CUDA "device" memory, driven by JSON lines.

Run with ``PDKV_CUDA_DRIVER`` naming the fake driver (tests/fakecuda_lib.py builds it):
the CUDA driver is loaded once per process, so every fake-GPU agent lives in a process
of its own. Start: ``python fake_peer.py --name N --spec JSON --seed K [--memory
device|host] [--alloc one|per-array]``; it prints ``{"address", "pid", "available"}``
and then answers one JSON line per command:

* ``{"cmd": "digest", "blocks": [...]}`` -> ``{"digest"}`` of the blocks' logical bytes
  (read back from device memory).
* ``{"cmd": "expect", "items": [{"notif", "blocks", "digest"}], "timeout": s}``: as each
  notification arrives, checks *at once* that its blocks hold the expected bytes
  (``digest: null``: only that it arrived) ->
  ``{"results": [{"notif", "ok"}], "missing": [...]}``.
* ``{"cmd": "xfer", "op", "address", "lblocks", "rblocks", "notify", "xfer_timeout",
  "fail_after_prepare", "repeat"}``: acts as initiator (connecting to ``address`` on
  first use only) -> ``{"ok", "error", "transport", "peer_transport", "raised_by",
  "state", "error_attr", "elapsed"}``; ``op`` is ``write``, ``read``, ``notify`` (a
  notification alone) or ``stream`` (a streaming write, layers posted in ``order``); ``raised_by``: the call that raised (``prepare``, ``post``,
  ``notify``, ``wait``), and when it was ``wait`` the transfer's ``state`` and the class
  of its ``error``; ``elapsed``: seconds from the first call after connecting;
  ``xfer_timeout``: the transfer's (default 30); ``fail_after_prepare=n``: the next n copies
  after prepare fail; ``"keep": name`` stores the prepared transfer, ``"reuse": name``
  posts a stored one instead of preparing.
* ``{"cmd": "burst", "address", "items": [{"lblocks", "rblocks", "notify"}]}``: posts
  the writes back to back, then waits for all -> ``{"ok", "error"}``.
* ``{"cmd": "post_async", "address", "items": [...]}``: posts like ``burst`` and answers
  at once ``{"posted"}``; ``{"cmd": "wait_async"}`` then waits -> ``{"ok", "error"}``.
* ``{"cmd": "remove_peer", "address"}``: forgets the peer connected at ``address`` -> ``{"ok"}``.
* ``{"cmd": "deregister"}``: closes the device pool's regions -> ``{"elapsed"}`` seconds.
* ``{"cmd": "fail_copies", "n"}``, ``{"cmd": "stats"}`` -> fake driver counters.
* ``{"cmd": "close"}``: closes the agent -> ``{"stats"}`` afterwards (leak checks).
* ``{"cmd": "same_process_pair"}``: two agents in this process over device memory ->
  ``{"peer_transport", "ok", "error"}``.
* ``{"cmd": "rows", "blocks", "ntok", "h0", "nh"}`` -> ``{"digest", "nonzero", "rest_zero"}``: the
  digest of those token rows and heads of the blocks' logical bytes, and whether every
  other byte of the blocks is zero (a heterogeneous transfer's target).
* ``{"cmd": "metadata"}`` -> ``{"blob"}`` (hex); ``{"cmd": "add_peer", "address", "blob"}``
  -> ``{"ok", "error"}``: transfers to ``address`` then use that (possibly altered) metadata.
* ``xfer`` takes ``"plan"``: the fields of prepare()'s PlanOptions (num_tokens, num_heads,
  local_head_offset, remote_head_offset); its answer has ``num_extents``.
* ``{"cmd": "exit"}``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # tests/

import numpy as np  # noqa: E402

import pdkv  # noqa: E402
from fakecuda_lib import FakeCuda  # noqa: E402
from kvpools import Pool, PoolSpec, expect_notifications  # noqa: E402

ALIGN = 256  # cudaMalloc alignment; the caching allocator hands out sub-ranges like this


class DevicePool:
    """A kvpools.Pool mirrored in device memory: ``host`` holds the reference bytes and
    the layout's geometry; the agent sees only the device copy."""

    def __init__(self, cuda: FakeCuda, spec: PoolSpec, seed: int | None, alloc: str) -> None:
        self.cuda = cuda
        self.host = Pool(spec, seed)
        sizes = [a.nbytes for a in self.host.arrays]
        if alloc in ("one", "odd"):  # one allocation, sub-ranges per array (torch's caching allocator)
            # "odd": every array starts 13 bytes past an aligned address (unaligned pieces).
            skew = 13 if alloc == "odd" else 0
            offs, total = [], 0
            for n in sizes:
                offs.append(total + skew)
                total += -(-(n + skew) // ALIGN) * ALIGN
            base = cuda.alloc(total)
            self.ptrs = [base + o for o in offs]
        else:
            self.ptrs = [cuda.alloc(n) for n in sizes]
        self.upload()

    def upload(self) -> None:
        for p, a in zip(self.ptrs, self.host.arrays):
            self.cuda.htod(p, np.ascontiguousarray(a))

    def download(self) -> None:
        for p, a in zip(self.ptrs, self.host.arrays):
            a.view(np.uint8).reshape(-1)[:] = self.cuda.dtoh(p, a.nbytes, np.uint8)

    def layout(self) -> pdkv.KVLayout:
        segs = []
        for s in self.host.layout.segments:
            for p, a in zip(self.ptrs, self.host.arrays):
                lo = a.ctypes.data
                if lo <= s["addr"] < lo + a.nbytes:
                    segs.append((p + s["addr"] - lo, s["block_stride"]))
                    break
            else:
                raise AssertionError("segment outside the pool")
        return pdkv.KVLayout.from_segments(self.host.layout.geometry, segs)

    def register(self, agent: pdkv.Agent) -> None:
        self.regions = [agent.register_address(p, a.nbytes, kind="cuda", device=0)
                        for p, a in zip(self.ptrs, self.host.arrays)]
        agent.add_layout("kv", self.layout())

    def digest(self, blocks) -> str:
        self.download()
        return self.host.digest(blocks)


class HostPool:
    """Pageable host memory (plain numpy), for host <-> device transfers."""

    def __init__(self, spec: PoolSpec, seed: int | None) -> None:
        self.host = Pool(spec, seed)

    def register(self, agent: pdkv.Agent) -> None:
        self.host.register(agent)

    def digest(self, blocks) -> str:
        return self.host.digest(blocks)


def same_process_pair(cuda: FakeCuda, spec: PoolSpec, transports: list[str]) -> dict:
    a = pdkv.Agent("sp-a", secret="s", transports=transports)
    b = pdkv.Agent("sp-b", secret="s", transports=transports)
    try:
        pa, pb = DevicePool(cuda, spec, 1, "per-array"), DevicePool(cuda, spec, 2, "per-array")
        pa.register(a)
        pb.register(b)
        peer = a.connect(b.address)
        out = {"peer_transport": a.peer_transport(peer)}
        try:
            a.write(peer, pdkv.Blocks("kv", [0, 2]), pdkv.Blocks("kv", [1, 3])).wait(30)
            out.update(ok=pb.digest([1, 3]) == pa.digest([0, 2]), error=None)
        except pdkv.PdkvError as e:
            out.update(ok=False, error=f"{type(e).__name__}: {e}")
        return out
    finally:
        a.close()
        b.close()


KEPT: dict = {}  # name -> prepared transfer ("keep" / "reuse")


def xfer(agent: pdkv.Agent, cuda: FakeCuda, peers: dict, req: dict) -> dict:
    res: dict = {"ok": False, "error": None, "transport": None, "peer_transport": None, "raised_by": None,
                 "state": None, "error_attr": None, "elapsed": None}
    stage, x, t0 = "connect", None, None
    try:
        if req["address"] not in peers:
            peers[req["address"]] = agent.connect(req["address"])
        peer = peers[req["address"]]
        res["peer_transport"] = agent.peer_transport(peer)
        t0 = time.monotonic()
        if req["op"] == "notify":
            stage = "notify"
            x = agent.notify(peer, req["notify"], timeout=req.get("xfer_timeout", 30))
            stage = "wait"
            res["ok"] = x.wait(30)
            return res
        if req["op"] == "stream":  # a layer-wise streaming write, layers posted in req["order"]
            stage = "post"
            s = agent.open_stream(peer, pdkv.Blocks("kv", req["lblocks"]), pdkv.Blocks("kv", req["rblocks"]),
                                  notify=req.get("notify"), timeout=req.get("xfer_timeout", 30))
            for layer in req.get("order") or range(s.num_layers):
                s.post_layers(layer)
            x = s.close()
            res["transport"] = x.transport
            stage = "wait"
            res["ok"] = x.wait(30)
            return res
        stage = "prepare"
        if req.get("reuse"):
            prep = KEPT[req["reuse"]]
        else:  # "plan": heterogeneous options (num_tokens, num_heads, head offsets)
            prep = agent.prepare(req["op"], peer, pdkv.Blocks("kv", req["lblocks"]), pdkv.Blocks("kv", req["rblocks"]),
                                 plan=pdkv.PlanOptions(**req.get("plan", {})))
        res["num_extents"] = prep.num_extents
        if req.get("keep"):
            KEPT[req["keep"]] = prep
        if req.get("fail_after_prepare"):
            cuda.fail_copies(req["fail_after_prepare"])
        for _ in range(req.get("repeat", 1)):
            stage = "post"
            x = prep.post(notify=req.get("notify"), timeout=req.get("xfer_timeout", 30))
            res["transport"] = x.transport
            stage = "wait"
            x.wait(30)
        res["ok"] = True
    except pdkv.PdkvError as e:
        res["error"] = f"{type(e).__name__}: {e}"
        res["raised_by"] = stage
        if stage == "wait":
            res["state"] = x.state.name
            res["error_attr"] = type(x.error).__name__
    finally:
        cuda.fail_copies(0)
        if t0 is not None:
            res["elapsed"] = time.monotonic() - t0
    return res


def burst(agent: pdkv.Agent, peers: dict, req: dict) -> dict:
    """Posts every item's write back to back, then waits for all of them."""
    try:
        if req["address"] not in peers:
            peers[req["address"]] = agent.connect(req["address"])
        peer = peers[req["address"]]
        preps = [agent.prepare("write", peer, pdkv.Blocks("kv", it["lblocks"]),
                               pdkv.Blocks("kv", it["rblocks"])) for it in req["items"]]
        xs = [p.post(notify=it["notify"], timeout=30) for p, it in zip(preps, req["items"])]
        for x in xs:
            x.wait(30)
        return {"ok": True, "error": None}
    except pdkv.PdkvError as e:
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--secret", default="s")
    ap.add_argument("--spec", required=True)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--transports", default="cuda_ipc,tcp")
    ap.add_argument("--memory", choices=("device", "host"), default="device")
    ap.add_argument("--alloc", choices=("one", "odd", "per-array"), default="per-array")
    ap.add_argument("--stage-chunk", type=int, default=0, help="tcp stage_chunk_bytes (0: the default)")
    args = ap.parse_args()
    cuda = FakeCuda(os.environ["PDKV_CUDA_DRIVER"])
    spec = PoolSpec(**json.loads(args.spec))
    transports = args.transports.split(",")
    tcp = pdkv.TcpOptions(stage_chunk_bytes=args.stage_chunk, stage_buffers=2) if args.stage_chunk else None
    agent = pdkv.Agent(args.name, secret=args.secret, transports=transports, options=[tcp] if tcp else [])
    pool = DevicePool(cuda, spec, args.seed, args.alloc) if args.memory == "device" else HostPool(spec, args.seed)
    pool.register(agent)

    def out(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    out({"address": agent.address, "pid": os.getpid(), "available": pdkv.available_transports()})
    peers: dict[str, str] = {}  # address -> peer name (connected once, like a serving engine)
    for line in sys.stdin:
        req = json.loads(line)
        cmd = req["cmd"]
        if cmd == "exit":
            break
        if cmd == "digest":
            out({"digest": pool.digest(req["blocks"])})
        elif cmd == "rows":  # digest of tokens [0, ntok) x heads [h0, h0 + nh) of blocks; the rest all zero?
            if isinstance(pool, DevicePool):
                pool.download()
            x = pool.host.logical(req["blocks"])
            sel = x[:, :, :req["ntok"], req["h0"]:req["h0"] + req["nh"]]
            rest = x.copy()
            rest[:, :, :req["ntok"], req["h0"]:req["h0"] + req["nh"]] = 0
            out({"digest": hashlib.sha256(np.ascontiguousarray(sel).tobytes()).hexdigest(),
                 "nonzero": bool(sel.any()), "rest_zero": not rest.any()})
        elif cmd == "metadata":
            out({"blob": agent.metadata().hex()})
        elif cmd == "add_peer":  # a peer from (possibly altered) metadata, used for transfers to `address`
            try:
                peers[req["address"]] = agent.add_peer(bytes.fromhex(req["blob"]))
                out({"ok": True, "error": None})
            except pdkv.PdkvError as e:
                out({"ok": False, "error": f"{type(e).__name__}: {e}"})
        elif cmd == "expect":
            out(expect_notifications(agent, pool.digest, req))
        elif cmd == "xfer":
            out(xfer(agent, cuda, peers, req))
        elif cmd == "burst":
            out(burst(agent, peers, req))
        elif cmd == "post_async":
            if req["address"] not in peers:
                peers[req["address"]] = agent.connect(req["address"])
            peer = peers[req["address"]]
            inflight = [agent.prepare("write", peer, pdkv.Blocks("kv", it["lblocks"]),
                                      pdkv.Blocks("kv", it["rblocks"])).post(timeout=60)
                        for it in req["items"]]
            out({"posted": len(inflight)})
        elif cmd == "wait_async":
            try:
                for x in inflight:
                    x.wait(60)
                out({"ok": True, "error": None})
            except pdkv.PdkvError as e:
                out({"ok": False, "error": f"{type(e).__name__}: {e}"})
        elif cmd == "remove_peer":
            agent.remove_peer(peers.pop(req["address"]))
            out({"ok": True})
        elif cmd == "deregister":
            t0 = time.monotonic()
            for r in pool.regions:
                r.close()
            out({"elapsed": time.monotonic() - t0})
        elif cmd == "fail_copies":
            cuda.fail_copies(req["n"])
            out({})
        elif cmd == "stats":
            out({"stats": cuda.stats()})
        elif cmd == "close":
            agent.close()
            out({"stats": cuda.stats()})
        elif cmd == "same_process_pair":
            out(same_process_pair(cuda, spec, transports))
        else:
            out({"error": f"unknown command {cmd}"})
    agent.close()


if __name__ == "__main__":
    main()
