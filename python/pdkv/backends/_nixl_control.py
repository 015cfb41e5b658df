"""Notification seam of the nixl transport: the poller thread that takes NIXL
notifications (user ones go to the agent's queue, control ones to the transport's
protocol), completes transfers nobody waits on and answers deferred revocations."""

from __future__ import annotations

import base64
import threading
import time
import weakref

from ..errors import NotFound, PdkvError, ProtocolError, ResourceExhausted
from ._nixl_records import _S
from ._nixl_wire import _CTL, _HS_TRANSPORT, _HS_VERSION, _ctl, _hex32, log, _parse_ctl, _pdkv_name, _USER
from .. import _native


# Hellos answered with a challenge whose proof has not come yet (one per sender).
_MAX_PENDING_HANDSHAKES = 256


class _Control:
    """NixlTransport's control-channel and poller methods (mixed into it)."""

    def _log_refused(self, sender: str, err: Exception) -> None:
        """Drops a malformed message from ``sender`` (logged at most once a second)."""
        self._refused += 1
        now = time.monotonic()
        if now - self._refused_logged_at >= 1.0:
            log.warning("nixl: dropped %d malformed message(s), latest from %r: %s", self._refused,
                        str(sender)[:64], err)
            self._refused, self._refused_logged_at = 0, now

    def _control(self, sender: str, raw: bytes) -> None:
        """One control message from NIXL agent ``sender`` (poller thread, lock held)."""
        try:
            msg = _parse_ctl(raw)
        except ProtocolError as e:
            self._log_refused(sender, e)
            return
        kind = msg["k"]
        eng = self._eng
        if eng is None:
            return
        try:
            if kind == "hello":
                # Challenge: the initiator proves first (proof); we prove ourselves only
                # after that, so a sender without the secret learns nothing from us.
                md = base64.b64decode(msg["md"])
                epoch = int(msg["epoch"])
                hs = _native.module().TargetHandshake(_HS_TRANSPORT, _HS_VERSION, sender, self._nixl_name, 0,
                                                      _hex32(msg, "nonce"), _hex32(msg, "pub"))
                if sender not in self._by_nixl and sender not in self._watchers and sender not in self._pending_hs:
                    eng.load_md(md)
                self._pending_hs[sender] = (epoch, md, hs)
                while len(self._pending_hs) > _MAX_PENDING_HANDSHAKES:  # oldest first
                    old = next(iter(self._pending_hs))
                    self._pending_hs.pop(old)
                    if old not in self._by_nixl and old not in self._watchers:
                        eng.forget(old)
                eng.notify(sender, _ctl(k="challenge", epoch=epoch, nonce=hs.nonce.hex(), pub=hs.pub.hex()))
            elif kind == "proof":
                pending = self._pending_hs.get(sender)
                if pending is None or pending[0] != int(msg["epoch"]):
                    raise ProtocolError("nixl proof without a pending hello of that epoch")
                epoch, md, hs = self._pending_hs.pop(sender)
                try:
                    _, ack = hs.check(_hex32(msg, "mac"), list(self._secrets))
                except PdkvError:
                    eng.notify(sender, _ctl(k="hello-ack", epoch=epoch, error="wrong secret", mac=""))
                    if sender not in self._by_nixl and sender not in self._watchers:
                        eng.forget(sender)
                    return
                self._watchers[sender] = (epoch, md)
                eng.notify(sender, _ctl(k="hello-ack", epoch=epoch, error="", mac=ack.hex()))
            elif kind in ("challenge", "hello-ack"):
                epoch = int(msg["epoch"])
                if self._hello_acks.get(epoch, 0) is None:  # our handshake of that epoch waits
                    self._hello_acks[epoch] = msg
                    self._cond.notify_all()
            elif kind == "bye":
                w = self._watchers.get(sender)
                if w is not None and w[0] == int(msg["epoch"]):
                    self._forget_watcher(sender)
            elif kind == "revoke":
                ids = frozenset(int(i) for i in msg["regions"])
                seq = int(msg["seq"])
                p = self._by_nixl.get(sender)
                if p is not None:
                    p.revoked |= ids
                    gone = NotFound(f"peer {p.name!r} deregistered its region {min(ids)}; re-add its metadata "
                                    "and prepare again")
                    for prep in list(self._preps):
                        if prep._peer is p and prep._remote_ids & ids:
                            prep._invalid = gone
                            self._detach(prep)
                    self._deferred_acks.append((sender, seq, p, ids))
                else:
                    eng.notify(sender, _ctl(k="revoke-ack", seq=seq))
            elif kind == "revoke-ack":
                waiting = self._acks.get(int(msg["seq"]))
                if waiting is not None:
                    waiting.discard(sender)
                    self._cond.notify_all()
        except (PdkvError, ValueError, KeyError, TypeError):
            pass  # a malformed or unanswerable control message changes nothing

    def _send_deferred_acks(self) -> None:
        eng = self._eng
        keep = []
        for sender, seq, p, ids in self._deferred_acks:
            if any(x._peer_state is p and x._remote_ids & ids for x in self._inflight.values()):
                keep.append((sender, seq, p, ids))
                continue
            try:
                eng.notify(sender, _ctl(k="revoke-ack", seq=seq))
            except PdkvError:
                pass
        self._deferred_acks = keep

    # -------------------------------------------------------------- poller
    def _kick(self) -> None:
        if self._poll_interval > self._opts.poll_min_s:
            self._wake.set()

    def _poll_once(self) -> tuple[bool, bool]:
        """One pass: notifications, control messages, unwaited transfers. Returns
        (something happened, transfers still in flight)."""
        eng = self._eng
        if eng is None:
            return False, False
        active = False
        try:
            got = eng.notifs()
        except eng.errors:
            got = {}
        if got:
            active = True
            hooks = self._hooks
            for sender, msgs in got.items():
                for m in msgs:
                    m = bytes(m)
                    if m[:1] == _USER:
                        if len(m) - 1 > self._max_notif:
                            self._log_refused(sender, ProtocolError(
                                f"notification of {len(m) - 1} bytes (limit {self._max_notif})"))
                        elif hooks is not None:
                            try:
                                hooks.deliver_notification(_pdkv_name(sender), m[1:])
                            except ResourceExhausted as e:  # the queue is full: refused (one-sided: the
                                self._log_refused(sender, e)  # sender is not told; docs/faults.md)
                    elif m[:1] == _CTL:
                        with self._lock:
                            self._control(sender, m[1:])
        with self._lock:
            if self._closed:
                return active, False
            if self._graveyard or self._zombies:
                self._collect_garbage()
            now = time.monotonic()
            for x in list(self._inflight.values()):
                if x._state is _S["PENDING"] and self._progress(x, now):
                    active = True
            if self._deferred_acks:
                self._send_deferred_acks()
            busy = (any(not x._waiting for x in self._inflight.values()) or bool(self._deferred_acks)
                    or bool(self._acks) or bool(self._hello_acks))
        return active, busy


def _poll_loop(ref: "weakref.ref[NixlTransport]", wake: threading.Event) -> None:
    """The poller thread. Holds its transport only weakly between passes, so an agent
    dropped without close() is still collected (the thread then ends)."""
    interval = 0.0
    while True:
        t = ref()
        if t is None or t._closed:
            return
        opts = t._opts
        try:
            active, busy = t._poll_once()
        except Exception:  # noqa: BLE001 - keep delivering; the next pass retries (backing off)
            active, busy = False, True
        if active:
            interval = opts.poll_min_s
        else:
            interval = min(max(interval * 2, opts.poll_min_s), opts.poll_busy_max_s if busy else opts.poll_idle_max_s)
        t._poll_interval = interval
        del t
        if wake.wait(interval):
            wake.clear()
            interval = 0.0
