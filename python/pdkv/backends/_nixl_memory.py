"""Memory seam of the nixl transport: registering regions with NIXL, publishing the
exported ones in metadata, and revoking peers' access before a region goes."""

from __future__ import annotations

import time

from ..errors import NotFound, PdkvError
from ._nixl_records import _Region, _RegionIndex, _S
from ._nixl_wire import _ctl, _encode_extra


class _Memory:
    """NixlTransport's memory methods (mixed into it; state lives there)."""

    # -------------------------------------------------------------- memory
    def region_added(self, region: dict) -> None:
        eng = self._engine()
        kind = region["kind"]
        dlist = eng.reg_dlist(kind, [(int(region["addr"]), int(region["len"]), max(0, int(region["device"])))])
        eng.register(dlist)
        with self._lock:
            self._regions[int(region["id"])] = _Region(region, dlist)
            self._reindex()

    def region_removed(self, region: dict) -> None:
        rid = int(region["id"])
        with self._lock:
            r = self._regions.get(rid)
            if r is None or self._closed:
                return
            if r.exported and self._watchers:
                self._revoke(rid)
            # In-flight transfers that use the region (as source/destination here, or as
            # the "remote" side of transfers to ourselves) finish first.
            self._kick()
            while True:
                busy = [x for x in self._inflight.values()
                        if rid in x._local_ids or (x._peer_state.is_self and rid in x._remote_ids)]
                if not busy:
                    break
                now = time.monotonic()
                for x in busy:
                    self._progress(x, now)
                if any(x._state is _S["PENDING"] for x in busy):
                    self._wait_cond(self._opts.poll_busy_max_s)
            gone = NotFound(f"region {rid} is not registered any more (deregistered); prepare the transfer again")
            for prep in list(self._preps):
                if rid in prep._local_ids or (prep._peer.is_self and rid in prep._remote_ids):
                    prep._invalid = gone
                    self._detach(prep)
            del self._regions[rid]
            self._reindex()
            eng = self._eng
        if eng is not None:
            eng.deregister(r.dlist)

    def _reindex(self) -> None:
        self._index = _RegionIndex([(r.addr, r.end, r.id, r.kind, r.device) for r in self._regions.values()])
        self._md_cache = None

    def metadata_extra(self) -> bytes:
        with self._lock:
            if self._md_cache is None:
                eng = self._engine()
                mds = []
                for kind in ("host", "cuda"):
                    rows = [(r.addr, r.end - r.addr, r.device) for r in self._regions.values()
                            if r.exported and r.kind == kind]
                    if rows:
                        mds.append(eng.partial_md(eng.reg_dlist(kind, rows)))
                self._md_cache = _encode_extra(self._nixl_name, mds or [self._conn_md])
            return self._md_cache

    # -------------------------------------------------------------- revocation protocol
    def _revoke(self, rid: int) -> None:
        """Tells every peer holding our metadata that region ``rid`` goes away and waits
        until each confirms it no longer uses it (lock held; the wait releases it)."""
        eng = self._engine()
        seq = next(self._ids)
        waiting: set[str] = set()
        for n in list(self._watchers):
            try:
                eng.notify(n, _ctl(k="revoke", regions=[rid], seq=seq))
                waiting.add(n)
            except PdkvError:
                self._forget_watcher(n)
        if not waiting:
            return
        self._acks[seq] = waiting
        self._kick()
        deadline = time.monotonic() + self._opts.revoke_timeout_s
        while self._acks[seq] and time.monotonic() < deadline and not self._closed:
            self._wait_cond(min(self._opts.poll_busy_max_s * 10, max(0.0, deadline - time.monotonic())))
        for n in self._acks.pop(seq):
            self._forget_watcher(n)  # silent past the deadline: it is not told again

    def _forget_watcher(self, n: str) -> None:
        self._watchers.pop(n, None)
        p = self._by_nixl.get(n)
        if (p is None or not p.loaded) and self._eng is not None:
            self._eng.forget(n)
