"""The nixl transport's records: regions registered with NIXL and their index, peers as
the transport knows them, groups of pooled NIXL requests, prepared and posted transfers."""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol, Sequence

import numpy as np

from ..errors import NotFound, PdkvError
from ..xfer_state import XferState


class _Owner(Protocol):
    """What a transfer record needs of the transport that made it (NixlTransport, which
    imports this module: the records name this contract, not the transport)."""

    _lock: threading.Lock
    _opts: Any  # NixlOptions
    _graveyard: list  # pooled request groups to release on the progress thread

    def _check(self, x: "NixlTransfer") -> XferState: ...


class _Region:
    __slots__ = ("id", "addr", "end", "kind", "device", "exported", "dlist")

    def __init__(self, region: dict, dlist: Any) -> None:
        self.id = int(region["id"])
        self.addr = int(region["addr"])
        self.end = self.addr + int(region["len"])
        self.kind = region["kind"]
        self.device = max(0, int(region["device"]))
        self.exported = bool(region["remote_access"])
        self.dlist = dlist


_KINDS = ("host", "cuda")


class _RegionIndex:
    """Sorted (addr, end, id, kind, device) table; maps extents to their regions."""

    def __init__(self, rows: Sequence[tuple[int, int, int, str, int]]) -> None:
        rows = sorted(rows)
        self.starts = np.array([r[0] for r in rows], dtype=np.uint64)
        self.ends = np.array([r[1] for r in rows], dtype=np.uint64)
        self.ids = np.array([r[2] for r in rows], dtype=np.int64)
        self.kinds = np.array([_KINDS.index(r[3]) for r in rows], dtype=np.int64)  # codes into _KINDS
        self.devices = np.array([r[4] for r in rows], dtype=np.uint64)

    def lookup(self, addrs: np.ndarray, lens: np.ndarray, side: str) -> np.ndarray:
        """Row index of the region holding each ``[addr, addr + len)``; raises NotFound."""
        if not len(self.starts):
            raise NotFound(f"no {side} region is registered with the nixl transport")
        i = np.searchsorted(self.starts, addrs, side="right").astype(np.int64) - 1
        bad = (i < 0) | (addrs + lens > self.ends[np.maximum(i, 0)])
        if bad.any():
            k = int(np.argmax(bad))
            raise NotFound(f"{side} bytes [0x{int(addrs[k]):x}, +{int(lens[k])}) are not in a region "
                           "registered with the nixl transport (region not registered)")
        return i


class _Peer:
    """One peer as this transport knows it (replaced, never mutated, on re-add)."""

    def __init__(self, name: str, md: dict, nixl_name: str, extra: bytes, secret: bytes) -> None:
        self.name = name
        self.instance = int(md["instance_id"])
        self.nixl_name = nixl_name
        self.update(md, extra, secret)
        self.error: PdkvError | None = None  # set: transfers to this peer raise it
        self.is_self = False
        self.loaded = False  # its NIXL metadata is loaded
        self.epoch = 0  # of the handshake that made the peer hold our metadata
        self.hello_ok = False
        self.revoked: set[int] = set()
        self.dropped = False
        self.core: Any = None  # the core's Peer this state was made or updated for

    def update(self, md: dict, extra: bytes, secret: bytes) -> None:
        self.extra = extra
        self.secret = secret
        # Where to ask whether it restarted when its NIXL endpoint fails (see _probe_restart).
        self.tcp_address = next((a for t, a in md.get("endpoints", []) if t == "tcp"), None)
        self.rows = [(int(r["addr"]), int(r["addr"]) + int(r["len"]), int(r["id"]), r.get("kind", "host"),
                      max(0, int(r.get("device", -1)))) for r in md.get("regions", [])]
        self.index = _RegionIndex(self.rows)
        self.region_ids = {row[2] for row in self.rows}

    def reuses_freed_range(self, md: dict) -> bool:
        """Whether ``md`` (same instance) has a region overlapping one this peer dropped:
        NIXL would keep the dropped region's key for it (reloading only adds entries)."""
        new = [(int(r["addr"]), int(r["addr"]) + int(r["len"]), int(r["id"])) for r in md.get("regions", [])]
        ids = {n[2] for n in new}
        gone = [row for row in self.rows if row[2] not in ids]
        return any(a < ge and ga < e for a, e, _ in new for ga, ge, *_ in gone)


class _Group:
    """The extents of a prepared transfer that share a (local, remote) memory kind: one
    pair of NIXL descriptor lists and a pool of NIXL requests built from them."""

    __slots__ = ("lkind", "rkind", "ldesc", "rdesc", "nbytes", "ldl", "rdl", "idle", "busy")

    def __init__(self, lkind: str, rkind: str, ldesc: np.ndarray, rdesc: np.ndarray) -> None:
        self.lkind, self.rkind = lkind, rkind
        self.ldesc, self.rdesc = ldesc, rdesc
        self.nbytes = int(ldesc[:, 1].sum())
        self.ldl: int | None = None
        self.rdl: int | None = None
        self.idle: list[int] = []  # completed requests, ready to repost (never given a notification)
        self.busy = 0


_S: dict[str, XferState] = {m.name: m for m in XferState}


class NixlTransfer:
    """This transport's record of one posted transfer (or standalone notification):
    the NIXL requests it waits on and the core's transfer it resolves when it ends."""

    def __init__(self, owner: _Owner, xid: int, peer: "_Peer", op: str, nbytes: int,
                 notify: bytes | None, native: Any, prep: "NixlPrepared | None") -> None:
        self._owner = owner
        self.id = xid
        self._peer_state = peer
        self.peer = peer.name
        self._op = op
        self.bytes_total = nbytes
        self._notify = notify
        self._native = native  # pdkv._pdkv.Transfer (its parts declared), or None
        self._deadline = 0.0  # monotonic; 0: none. Set by _watch once it is still in flight after post
        self._prep = prep
        self._local_ids: frozenset = prep._local_ids if prep is not None else frozenset()
        self._remote_ids: frozenset = prep._remote_ids if prep is not None else frozenset()
        self._reqs: list[tuple[_Group, int]] = []
        self._pending: list[int] = []
        self._manual_notify = False  # a notification to send once every request completed
        self._probing = False  # failed at the connection level; finished once the restart probe answers
        self._waiting = 0  # threads in wait(): they check it, so the poller need not hurry
        self._state = _S["PENDING"]
        self._error: PdkvError | None = None
        self._t_post = time.monotonic()
        self._event: threading.Event | None = None  # made by the first waiter that sleeps

    def drive(self, timeout: float) -> None:
        """The core transfer's driver: ``wait()`` progresses NIXL itself (checking
        continuously for ``wait_spin_s``, then sleeping between checks, woken at once
        when the poller sees completion) instead of waiting for the poller."""
        owner = self._owner
        if owner._check(self) is not _S["PENDING"]:
            return
        with owner._lock:
            self._waiting += 1
        try:
            self._wait_loop(timeout)
        finally:
            with owner._lock:
                self._waiting -= 1

    def _wait_loop(self, timeout: float) -> XferState:
        owner = self._owner
        opts = owner._opts
        pending = st = _S["PENDING"]
        now = time.monotonic()
        end = None if timeout == float("inf") else now + max(0.0, float(timeout))
        spin_end = now + opts.wait_spin_s
        pause = opts.poll_min_s
        while True:
            now = time.monotonic()
            if end is not None and now >= end:
                return st
            if now >= spin_end:
                ev = self._event
                if ev is None:
                    with owner._lock:  # _finish sets it under the same lock: no lost wake-up
                        if self._state is not pending:
                            return self._state
                        ev = self._event = self._event or threading.Event()
                ev.wait(pause if end is None else min(pause, end - now))
                pause = min(pause * 2, opts.poll_busy_max_s)
            st = owner._check(self)
            if st is not pending:
                return st


class NixlPrepared:
    """What prepare() returns to the core: a nixl transfer laid out once (descriptor
    lists and a NIXL request built), posted many times."""

    def __init__(self, owner: _Owner, peer: "_Peer", op: str, ldesc: np.ndarray, rdesc: np.ndarray,
                 kinds: np.ndarray, local_ids: frozenset, remote_ids: frozenset) -> None:
        self._owner = owner
        self._peer = peer
        self.peer = peer.name
        self._op = op
        self._ldesc, self._rdesc = ldesc, rdesc
        self._kinds = kinds  # [n] local kind code * len(_KINDS) + remote kind code
        self._local_ids, self._remote_ids = local_ids, remote_ids
        self.nbytes = int(ldesc[:, 1].sum())
        self.num_extents = len(ldesc)
        self._groups: list[_Group] | None = None
        self._invalid: PdkvError | None = None  # raised by post (the caller must prepare again)

    def __del__(self) -> None:
        groups, self._groups = self._groups, None
        if groups:
            # No locks in a finalizer: the owner releases these on its next pass.
            self._owner._graveyard.append(groups)

    def __repr__(self) -> str:
        return (f"NixlPrepared(peer={self.peer!r}, {self._op}, {self.nbytes} bytes in "
                f"{self.num_extents} extents)")


def _coalesce(ext: np.ndarray) -> np.ndarray:
    """Merges extents adjacent on both sides: ``[n, 3]`` (local, remote, nbytes) uint64."""
    if len(ext) < 2:
        return ext
    ends_l = ext[:-1, 0] + ext[:-1, 2]
    ends_r = ext[:-1, 1] + ext[:-1, 2]
    joins = (ends_l == ext[1:, 0]) & (ends_r == ext[1:, 1])
    if not joins.any():
        return ext
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    out = ext[starts].copy()
    out[:, 2] = np.add.reduceat(ext[:, 2], starts)
    return out
