"""Connection seam of the nixl transport: introducing peers to NIXL (loading their
metadata, the authenticated hello handshake), updating and forgetting them."""

from __future__ import annotations

import base64
import time
from typing import Any

from ..errors import Cancelled, NotFound, PdkvError, PeerConnectionError, ProtocolError, StalePeer
from ._nixl_records import _Peer, _S
from .. import _native
from ._nixl_wire import _HS_TRANSPORT, _HS_VERSION, _ctl, _decode_extra, _hex32, nixl_agent_name


class _Peers:
    """NixlTransport's peer methods (mixed into it; state lives there)."""

    # -------------------------------------------------------------- peers
    def connect(self, peer: Any, timeout_s: float) -> None:
        with self._lock:
            self._engine()
            self._ensure_peer(peer)

    def _ensure_peer(self, peer: Any) -> "_Peer":
        """The state of the core's ``peer`` (lock held). The core makes a new Peer on
        every add_peer: the first time this transport sees one, it (re)introduces the
        peer to NIXL, keeping connections when its metadata did not change."""
        p = self._peers.get(peer.name)
        if p is None or p.core is not peer:
            md = {"name": peer.md.name, "instance_id": peer.md.instance_id, "endpoints": peer.md.endpoints,
                  "regions": peer.md.regions}
            self._add_peer(peer.name, md, peer.md.extra(self.name) or b"", bytes(peer.secret))
            p = self._peers[peer.name]
            p.core = peer  # (held: pybind11 then hands out this same object for it)
        return p

    def _add_peer(self, name: str, peer_md: dict, blob: bytes, secret: bytes) -> None:
        """Loads the peer's NIXL metadata and introduces this agent to it (a handshake
        that lets the peer revoke access when it deregisters memory). Connection
        failures do not raise here: transfers to the peer fail with them."""
        nixl_name, mds = _decode_extra(blob)  # ProtocolError if missing or corrupted
        with self._lock:
            eng = self._engine()
            old = self._peers.get(name)
            if (old is not None and old.error is None and old.nixl_name == nixl_name
                    and old.instance == int(peer_md["instance_id"]) and (old.loaded or old.is_self)):
                if old.extra == blob:
                    old.secret = secret
                    return  # unchanged: keep connections, prepared requests and transfers
                if not old.reuses_freed_range(peer_md) and self._load_more(old, peer_md, mds, blob, secret):
                    return  # regions added or removed: NIXL learned the new ones in place
            if old is not None:  # (no goodbye: a replaced instance is usually gone)
                self._drop_peer(old, PeerConnectionError(
                    f"peer {name!r} was re-added with new metadata while this transfer was in flight"), bye=False)
            p = _Peer(name, peer_md, nixl_name, blob, secret)
            self._peers[name] = p
            expected = nixl_agent_name(str(peer_md["name"]), int(peer_md["instance_id"]))
            if nixl_name != expected:
                p.error = StalePeer(
                    f"peer {name!r} restarted or its metadata is inconsistent: it names instance "
                    f"{int(peer_md['instance_id']):016x} but its NIXL endpoint belongs to {nixl_name!r}; "
                    "fetch its metadata again and re-add it")
                return
            if nixl_name == self._nixl_name:
                p.is_self = True
                return
            try:
                for md in mds:
                    got = eng.load_md(md)
                    if got != nixl_name:
                        eng.forget(got)
                        raise ProtocolError(f"NIXL metadata of peer {name!r} names agent {got!r}, "
                                            f"expected {nixl_name!r}")
                    p.loaded = True
            except PdkvError as e:
                p.error = PeerConnectionError(f"cannot connect to peer {name!r} through NIXL: {e}")
                if p.loaded:
                    eng.forget(nixl_name)
                    p.loaded = False
                return
            self._by_nixl[nixl_name] = p
            p.epoch = next(self._ids)
            hs = _native.module().InitiatorHandshake(_HS_TRANSPORT, _HS_VERSION, self._nixl_name)
            deadline = time.monotonic() + self._opts.handshake_timeout_s
            answer = ""
            try:
                self._hello_acks[p.epoch] = None
                eng.notify(nixl_name, _ctl(k="hello", epoch=p.epoch, md=base64.b64encode(self._conn_md).decode(),
                                           nonce=hs.nonce.hex(), pub=hs.pub.hex()))
                ch = self._await_handshake(p, deadline)
                if ch is not None and ch["k"] == "challenge":
                    proof = hs.answer(nixl_name, 0, _hex32(ch, "nonce"), _hex32(ch, "pub"), secret)
                    self._hello_acks[p.epoch] = None
                    eng.notify(nixl_name, _ctl(k="proof", epoch=p.epoch, mac=proof.hex()))
                    ack = self._await_handshake(p, deadline)
                    if ack is not None and ack["k"] == "hello-ack":
                        answer = ack["error"]
                        if not answer:
                            hs.check_accept(_hex32(ack, "mac"))
                            answer = "ok"
                    elif ack is not None:
                        answer = f"answered the proof with a {ack['k']}"
                elif ch is not None:
                    answer = ch["error"] or "answered the hello without a challenge"
            except PdkvError as e:
                if p.dropped:
                    return
                p.error = PeerConnectionError(f"NIXL handshake with peer {name!r} failed: {e}")
                return
            finally:
                self._hello_acks.pop(p.epoch, None)
            if p.dropped:
                return
            if answer == "ok":
                p.hello_ok = True
            elif not answer:
                p.error = PeerConnectionError(
                    f"peer {name!r} did not answer the NIXL handshake within {self._opts.handshake_timeout_s:g} s "
                    "(unreachable over UCX, stopped, or not using the secret given to add_peer)")
            else:
                p.error = PeerConnectionError(f"peer {name!r} refused the NIXL handshake: {answer}")

    def _await_handshake(self, p: _Peer, deadline: float) -> Any:
        """The next handshake message of ``p``'s epoch (lock held), or None at the deadline."""
        self._kick()
        while self._hello_acks.get(p.epoch, 0) is None and time.monotonic() < deadline and not p.dropped:
            self._wait_cond(min(self._opts.poll_busy_max_s * 10, max(0.0, deadline - time.monotonic())))
        return self._hello_acks.get(p.epoch)

    def _load_more(self, p: _Peer, md: dict, mds: list[bytes], blob: bytes, secret: bytes) -> bool:
        """Updates a known peer in place (lock held): loads its new NIXL metadata on top of
        the old (NIXL only adds regions), and fails prepared transfers into regions it
        dropped. In-flight transfers and connections stay. False if NIXL refused."""
        if not p.is_self:
            try:
                for m in mds:
                    self._engine().load_md(m)
            except PdkvError:
                return False
        before = set(p.region_ids)
        p.update(md, blob, secret)
        gone = frozenset(before - p.region_ids)
        if gone:
            p.revoked |= gone
            err = NotFound(f"peer {p.name!r} no longer exports region {min(gone)}; prepare the transfer again")
            for prep in list(self._preps):
                if prep._peer is p and prep._remote_ids & gone:
                    prep._invalid = err
                    self._detach(prep)
        return True

    def drop_peer(self, name: str) -> None:
        with self._lock:
            p = self._peers.pop(name, None)
            if p is not None:
                self._drop_peer(p, PeerConnectionError(f"peer {name!r} was removed while the transfer was in flight"),
                                bye=True)

    def _drop_peer(self, p: _Peer, err: PdkvError | None, *, bye: bool) -> None:
        """Fails ``p``'s in-flight transfers, releases its prepared requests and forgets
        its NIXL metadata (in that order: requests point into the metadata)."""
        p.dropped = True
        self._cond.notify_all()
        if self._peers.get(p.name) is p:
            del self._peers[p.name]
        if self._by_nixl.get(p.nixl_name) is p:
            del self._by_nixl[p.nixl_name]
        for x in list(self._inflight.values()):
            if x._peer_state is p:
                self._finish(x, _S["FAILED"], err or Cancelled("the transfer's peer was dropped"))
        for prep in list(self._preps):
            if prep._peer is p:
                self._detach(prep)
        eng = self._eng
        if eng is None or not p.loaded:
            return
        if bye and p.hello_ok:
            try:
                eng.notify(p.nixl_name, _ctl(k="bye", epoch=p.epoch))
            except PdkvError:
                pass
        eng.forget(p.nixl_name)
        p.loaded = False
        w = self._watchers.get(p.nixl_name)
        if w is not None and not self._closed:  # it still holds our metadata: keep a way to reach it
            try:
                eng.load_md(w[1])
            except PdkvError:
                del self._watchers[p.nixl_name]
