"""Transfer seam of the nixl transport: laying out descriptor lists once, posting pooled
NIXL requests, progressing and finishing transfers (resolving the core's Transfer)."""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

import numpy as np

from .. import _native
from ..errors import Cancelled, InvalidArgument, NotFound, PdkvError, PeerConnectionError, StalePeer, TransferTimeout
from ._nixl import to_pdkv
from ._nixl_records import _coalesce, _Group, _KINDS, NixlPrepared, NixlTransfer, _Peer, _S
from ._nixl_wire import _USER


class _Transfers:
    """NixlTransport's transfer methods (mixed into it; state lives there)."""

    # -------------------------------------------------------------- transfers
    def _known_peer(self, peer: str) -> _Peer:
        """The peer's state (caller holds the lock); NotFound if the caller never added it.
        A broken peer is returned as it is: its faults surface from transfers' wait()."""
        p = self._peers.get(peer)
        if p is None:
            raise NotFound(f"peer {peer!r} is not known to the nixl transport of agent {self._agent_name!r}")
        return p

    def _failed(self, p: _Peer, op: str, nbytes: int, err: PdkvError, native: Any) -> None:
        """Fails a transfer before it started (lock held): the fault contract
        (docs/faults.md) has peer faults raise from wait(), never from post()."""
        x = NixlTransfer(self, next(self._ids), p, op, nbytes, None, native, None)
        self._finish(x, _S["FAILED"], type(err)(str(err)))

    def prepare(self, peer: Any, op: Any, extents: np.ndarray) -> NixlPrepared:
        """``extents``: the core's resolved ``[n, 7]`` rows (pdkv.transport.EXTENT_COLUMNS)."""
        rows = np.empty((len(extents), 3), dtype=np.uint64)  # (local_addr, remote_addr, nbytes)
        rows[:, 0], rows[:, 1], rows[:, 2] = extents[:, 0], extents[:, 6], extents[:, 1]
        opname = "write" if op == _native.module().OpKind.WRITE else "read"
        with self._lock:
            self._engine()
            self._ensure_peer(peer)
        return self._prepare_rows(peer.name, opname, rows)

    def _prepare_rows(self, peer: str, op: str, extents: Any) -> NixlPrepared:
        """Lays out absolute ``(local_addr, remote_addr, nbytes)`` rows to a peer this
        transport knows (checked against the regions registered with NIXL)."""
        ext = np.asarray(extents, dtype=np.uint64).reshape(-1, 3)
        if not len(ext):
            raise InvalidArgument("no extents to transfer")
        with self._lock:
            self._engine()
            p = self._known_peer(peer)
            prep = self._build(p, op, ext)
            self._preps.add(prep)
            return prep

    def _build(self, p: _Peer, op: str, ext: np.ndarray) -> NixlPrepared:
        ext = _coalesce(ext)
        laddr, raddr, lens = ext[:, 0], ext[:, 1], ext[:, 2]
        li = self._index.lookup(laddr, lens, "local")
        rindex = self._index if p.is_self else p.index
        ri = rindex.lookup(raddr, lens, f"peer {p.name!r}")
        local_ids = frozenset(int(i) for i in np.unique(self._index.ids[li]))
        remote_ids = frozenset(int(i) for i in np.unique(rindex.ids[ri]))
        if p.is_self:
            exported = {r.id for r in self._regions.values() if r.exported}
            if not remote_ids <= exported:
                raise NotFound(f"region {min(remote_ids - exported)} is not exported to peers")
        revoked = remote_ids & p.revoked
        if revoked:
            raise NotFound(f"peer {p.name!r} deregistered its region {min(revoked)}; re-add its metadata")
        ldesc = np.empty((len(ext), 3), dtype=np.uint64)  # (addr, nbytes, device) rows for NIXL
        ldesc[:, 0], ldesc[:, 1], ldesc[:, 2] = laddr, lens, self._index.devices[li]
        rdesc = np.empty((len(ext), 3), dtype=np.uint64)
        rdesc[:, 0], rdesc[:, 1], rdesc[:, 2] = raddr, lens, rindex.devices[ri]
        kinds = self._index.kinds[li] * len(_KINDS) + rindex.kinds[ri]
        prep = NixlPrepared(self, p, op, ldesc, rdesc, kinds, local_ids, remote_ids)
        if p.error is None:  # (a broken peer's transfers fail at post; nothing to build)
            self._make_groups(prep)
        return prep

    def _make_groups(self, prep: NixlPrepared) -> None:
        eng = self._engine()
        p = prep._peer
        remote = self._nixl_name if p.is_self else p.nixl_name
        codes = np.unique(prep._kinds)
        groups = []
        try:
            for code in codes.tolist():
                sel = prep._kinds == code if len(codes) > 1 else slice(None)
                lkind, rkind = _KINDS[code // len(_KINDS)], _KINDS[code % len(_KINDS)]
                g = _Group(lkind, rkind, np.ascontiguousarray(prep._ldesc[sel]),
                           np.ascontiguousarray(prep._rdesc[sel]))
                groups.append(g)
                g.ldl = eng.xfer_dlist(None, g.lkind, g.ldesc)
                g.rdl = eng.xfer_dlist(remote, g.rkind, g.rdesc)
                g.idle.append(eng.make_req(prep._op, g.ldl, g.rdl, np.arange(len(g.ldesc), dtype=np.int32)))
        except PdkvError:
            self._release_groups(groups)
            raise
        prep._groups = groups

    def post(self, prep: NixlPrepared, transfer: Any, notif: bytes) -> None:
        """Posts the prepared NIXL requests; ``transfer`` (the core's) resolves as one part
        once every request completed and the notification (if any) was sent."""
        transfer.set_parts(1)
        data = bytes(notif) or None
        with self._lock:
            if self._closed or self._eng is None:
                return self._failed(prep._peer, prep._op, prep.nbytes, PeerConnectionError(
                    f"the nixl transport of agent {self._agent_name!r} is shutting down"), transfer)
            eng = self._eng
            if prep._invalid is not None:
                return self._failed(prep._peer, prep._op, prep.nbytes, prep._invalid, transfer)
            cur = self._peers.get(prep.peer)
            if cur is not prep._peer:
                if cur is None:
                    return self._failed(prep._peer, prep._op, prep.nbytes, NotFound(
                        f"peer {prep.peer!r} was removed; add it and prepare again"), transfer)
                if cur.instance != prep._peer.instance:
                    return self._failed(prep._peer, prep._op, prep.nbytes, StalePeer(
                        f"peer {prep.peer!r} restarted since this transfer was prepared; prepare it again"), transfer)
                if cur.error is not None:
                    return self._failed(cur, prep._op, prep.nbytes, cur.error, transfer)
                gone = prep._remote_ids - cur.region_ids
                if gone:
                    return self._failed(cur, prep._op, prep.nbytes, NotFound(
                        f"peer {prep.peer!r} no longer exports region {min(gone)}"), transfer)
                self._detach(prep)
                prep._peer = cur  # same instance, re-added metadata: rebuild against it
            p = prep._peer
            if p.error is not None:
                return self._failed(p, prep._op, prep.nbytes, p.error, transfer)
            revoked = p.revoked and prep._remote_ids & p.revoked
            if revoked:
                return self._failed(p, prep._op, prep.nbytes, NotFound(
                    f"peer {p.name!r} deregistered its region {min(revoked)}; re-add its metadata and prepare again"),
                    transfer)
            x = NixlTransfer(self, next(self._ids), p, prep._op, prep.nbytes, data, transfer, prep)
            if prep._groups is None:
                try:
                    self._make_groups(prep)
                except PdkvError as e:
                    self._finish(x, _S["FAILED"], e)
                    return None
            groups = prep._groups
            x._manual_notify = data is not None
            try:
                for g in groups:
                    req = g.idle.pop() if g.idle else eng.make_req(prep._op, g.ldl, g.rdl,
                                                               np.arange(len(g.ldesc), dtype=np.int32))
                    g.busy += 1
                    x._reqs.append((g, req))
                    x._pending.append(req)
            except PdkvError as e:
                self._finish(x, _S["FAILED"], e)
                return None
            self._inflight[x.id] = x
            try:
                for g, req in x._reqs:
                    if eng.post(req, b""):
                        x._pending.remove(req)
            except eng.errors as e:
                self._fail_connection(x, to_pdkv(e, f"NIXL {prep._op} to peer {p.name!r}", PeerConnectionError))
                self._watch(x)
                return None
            if not x._pending and self._progress(x, time.monotonic()):
                return None  # (most small writes: NIXL completed them inside post)
            self._watch(x)
            if x._pending and data is not None:
                # Its notification leaves only when someone checks the finished request:
                # have the poller do so promptly in case nobody waits on it. (Without a
                # notification there is no hurry; not waking the poller keeps it off the
                # GIL while a waiter spins.)
                self._kick()
            return None

    def notify(self, peer: Any, transfer: Any, notif: bytes) -> None:
        """Sends a notification alone, after the transfers to ``peer`` posted before it
        (resolves the one part of ``transfer`` the core declared)."""
        data = bytes(notif)
        with self._lock:
            if self._closed or self._eng is None:
                return self._failed(_Peer(peer.name, {"instance_id": 0}, "", b"", b""), "notify", 0,
                                    PeerConnectionError(f"the nixl transport of agent {self._agent_name!r} is "
                                                        "shutting down"), transfer)
            try:
                p = self._ensure_peer(peer)
            except PdkvError as e:
                return self._failed(_Peer(peer.name, {"instance_id": 0}, "", b"", b""), "notify", 0, e, transfer)
            if p.error is not None:
                return self._failed(p, "notify", 0, p.error, transfer)
            x = NixlTransfer(self, next(self._ids), p, "notify", 0, data, transfer, None)
            x._manual_notify = True
            self._inflight[x.id] = x
            if not self._progress(x, time.monotonic()):
                self._watch(x)
                self._kick()
            return None

    def _watch(self, x: NixlTransfer) -> None:
        """``x`` is still in flight as post() or notify() returns (lock held): gives it
        the core transfer's deadline, and lets that transfer cancel it and have its
        waiters progress NIXL. Skipped for a transfer that ended inside post(): the
        core sees it terminal before its caller does, so nothing could cancel, wait on
        or time out it (and the hooks cost more than a small write's bookkeeping)."""
        native = x._native
        if native is None or x._state is not _S["PENDING"]:
            return
        left = native.remaining_s
        if left != float("inf"):
            x._deadline = time.monotonic() + max(left, 0.0)
        ref = weakref.ref(x)

        def cancel() -> None:
            y = ref()
            if y is not None:
                self._cancel(y)

        def drive(timeout: float) -> None:
            y = ref()
            if y is not None:
                y.drive(timeout)

        native.set_cancel_hook(cancel)
        native.set_driver(drive)

    def _check(self, x: NixlTransfer) -> "XferState":
        if x._state is _S["PENDING"]:
            with self._lock:
                if x._state is _S["PENDING"] and not self._closed:
                    self._progress(x, time.monotonic())
        return x._state

    def _progress(self, x: NixlTransfer, now: float) -> bool:
        """Advances ``x`` (lock held); True if it became terminal."""
        eng = self._eng
        if eng is None or x._probing:
            return False
        try:
            while x._pending:
                if not eng.done(x._pending[-1]):
                    break
                x._pending.pop()
        except eng.errors as e:
            self._fail_connection(x, to_pdkv(e, f"NIXL {x._op} to peer {x.peer!r} failed", PeerConnectionError))
            return False
        if not x._pending and x._manual_notify:
            if x._op == "notify" and any(y.id < x.id and y._peer_state is x._peer_state
                                         for y in self._inflight.values()):
                pass  # a standalone notification follows earlier transfers to its peer
            else:
                p = x._peer_state
                try:
                    eng.notify(self._nixl_name if p.is_self else p.nixl_name, _USER + (x._notify or b""))
                except PdkvError as e:
                    what = "the data landed but " if x.bytes_total else ""
                    self._finish(x, _S["FAILED"], PeerConnectionError(
                        f"{what}the notification to peer {x.peer!r} could not be sent: {e}"))
                    return True
                x._manual_notify = False
        if not x._pending and not x._manual_notify:
            self._finish(x, _S["DONE"], None)
            return True
        if x._deadline and now >= x._deadline:
            what = "notification" if x._op == "notify" else f"{x._op} of {x.bytes_total} bytes"
            self._finish(x, _S["FAILED"], TransferTimeout(
                f"NIXL {what} to peer {x.peer!r} timed out after {now - x._t_post:.3g} s "
                "(the peer stalled or the link is too slow)"))
            return True
        return False

    def _fail_connection(self, x: NixlTransfer, err: PdkvError) -> None:
        """``x`` failed at the connection level (lock held). A peer that restarted at the
        same address looks exactly like a dead one to UCX; the fault contract says
        StalePeer for it, so ask its tcp endpoint (off the lock, bounded) before
        finishing ``x``. It stays PENDING, untouched by the poller, until then."""
        p = x._peer_state
        if not isinstance(err, PeerConnectionError) or p.is_self or not p.tcp_address:
            self._finish(x, _S["FAILED"], err)
            return
        x._probing = True
        probe = threading.Thread(target=self._probe_restart, args=(x, err), name=f"pdkv-nixl-probe-{x.id}",
                                 daemon=True)
        self._probes.append(probe)
        probe.start()

    def _probe_restart(self, x: NixlTransfer, err: PdkvError) -> None:
        p = x._peer_state
        final = err
        hooks = self._hooks
        if hooks is not None and not self._closed:  # (shutdown joins this thread before the hooks go)
            try:
                md = _native.module().decode_metadata(
                    hooks.fetch_metadata(p.tcp_address, p.secret, self._opts.restart_probe_s))
                if md["name"] == p.name and int(md["instance_id"]) != p.instance:
                    final = StalePeer(f"peer {p.name!r} restarted (instance {p.instance:016x} is gone, "
                                      f"{int(md['instance_id']):016x} answers at {p.tcp_address}); fetch its "
                                      f"metadata again and re-add it ({err})")
            except Exception:  # noqa: BLE001 - unreachable or closed: the connection error stands
                pass
        with self._lock:
            if x._state is _S["PENDING"]:
                self._finish(x, _S["FAILED"], final)
            if threading.current_thread() in self._probes:
                self._probes.remove(threading.current_thread())

    def _cancel(self, x: NixlTransfer) -> None:
        with self._lock:
            if x._state is not _S["PENDING"] or self._closed:
                return
            if self._progress(x, time.monotonic()):
                return
            self._finish(x, _S["CANCELLED"], Cancelled(f"transfer {x.id} to peer {x.peer!r} was cancelled"))

    def _finish(self, x: NixlTransfer, state: Any, err: PdkvError | None) -> None:
        """Makes ``x`` terminal (lock held): its requests go back to their pool when it
        completed, else they are released (which aborts whatever is still in flight)."""
        x._state = state
        x._error = err
        native, x._native = x._native, None
        if native is not None:
            if state is _S["DONE"]:
                native.resolve_part(x.bytes_total)
            else:
                native.resolve_part(0, err or Cancelled(f"transfer to peer {x.peer!r} was cancelled"))
        prep = x._prep
        keep = state is _S["DONE"] and prep is not None and prep._invalid is None
        for g, req in x._reqs:
            g.busy -= 1
            if keep and prep._groups is not None and g in prep._groups and len(g.idle) < self._opts.max_idle_requests:
                g.idle.append(req)
            else:
                self._release_req(req)
            if g.busy == 0 and (prep is None or prep._groups is None or g not in prep._groups):
                self._release_groups([g])
        x._reqs = []
        x._pending = []
        x._prep = None
        self._inflight.pop(x.id, None)
        if x._event is not None:
            x._event.set()
        if self._cond_waiters:
            self._cond.notify_all()

    def _detach(self, prep: NixlPrepared) -> None:
        """Releases ``prep``'s idle requests and descriptor lists now, the busy ones when
        their transfers end; the next post rebuilds (or raises ``prep._invalid``)."""
        groups, prep._groups = prep._groups, None
        if groups:
            self._release_groups(groups)

    def _release_groups(self, groups: list[_Group]) -> None:
        eng = self._eng
        for g in groups:
            for req in g.idle:
                self._release_req(req)
            g.idle = []
            if g.busy == 0 and eng is not None:
                for h in (g.ldl, g.rdl):
                    if h is not None:
                        eng.release_dlist(h)
                g.ldl = g.rdl = None

    def _release_req(self, req: int) -> None:
        eng = self._eng
        if eng is not None and not eng.release_req(req):
            self._zombies.append(req)  # NIXL refused (still cancelling): retried by the poller

    def _collect_garbage(self) -> None:
        while self._graveyard:
            self._release_groups(self._graveyard.pop())
        zombies, self._zombies = self._zombies, []
        for req in zombies:
            self._release_req(req)
