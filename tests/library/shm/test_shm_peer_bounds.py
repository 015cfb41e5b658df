"""Bounds an shm peer cannot push (issue 26, items 12 and 11).

* RevokeAck is only an answer: one for a region this side never revoked at the peer
  closes the connection (ProtocolError), so a flood of them costs the target no
  memory (it grew the target's ack set by 91 MiB per 2 million before).
* The first contact with a frozen target is bounded by the transfer's deadline, not
  by the connect timeout (5 s).
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import time

import numpy as np
import pytest

import pdkv
from conftest import HERE, SECRET, JsonLineProc, freeze

pytestmark = pytest.mark.skipif("shm" not in pdkv.available_transports(), reason="shm transport not available")

MAGIC = 0x534B4450
HELLO, HELLO_ACK, REVOKE_ACK, ERROR = 1, 2, 8, 9
FLOOD = 2_000_000


class Target(JsonLineProc):
    def __init__(self) -> None:
        super().__init__([sys.executable, os.path.join(HERE, "shm_trust_target.py"), "--secret", SECRET, "--kind",
                          "alloc"], "target")

    @property
    def metadata(self) -> bytes:
        import base64

        return base64.b64decode(self.hello["metadata"])

    @property
    def shm_path(self) -> str:
        return dict(pdkv.decode_metadata(self.metadata)["endpoints"])["shm"]


def _hello(path: str) -> socket.socket:
    """An authenticated raw connection (the challenge-response with the secret)."""
    from test_shm_trust import authenticate, recv_ctl

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    authenticate(s, SECRET, "target")
    assert recv_ctl(s)[0] == HELLO_ACK
    return s


def test_unsolicited_revoke_acks_close_the_connection_and_cost_no_memory():
    target = Target()
    try:
        before = target.call(cmd="rss")
        s = _hello(target.shm_path)
        one = struct.Struct("<IHHQII")
        sent = 0
        t0 = time.monotonic()
        try:
            while sent < FLOOD and time.monotonic() - t0 < 60:
                # distinct region ids: each would be a new entry in an unbounded ack set
                s.sendall(b"".join(one.pack(MAGIC, REVOKE_ACK, 0, sent + i + 1, 0, 0) for i in range(4096)))
                sent += 4096
        except (BrokenPipeError, ConnectionResetError):
            pass
        # The target answered the first unasked ack with an Error frame and closed.
        s.settimeout(10)
        got = b""
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += chunk
        except (ConnectionResetError, socket.timeout):
            pass
        s.close()
        assert sent < FLOOD, "the target read two million unasked revoke acks without closing"
        assert len(got) >= 24
        _, type_, _, ident, _, status = struct.unpack("<IHHQII", got[:24])
        assert (type_, ident, status) == (ERROR, 1, 6), got[:200]  # ProtocolError naming the first ack
        assert b"not revoked" in got
        after = target.call(cmd="rss")
        grew_mib = (after["hwm_kib"] - before["hwm_kib"]) / 1024
        assert grew_mib < 16, f"the target's peak RSS grew by {grew_mib:.1f} MiB"
        # It keeps serving.
        with pdkv.Agent("a", secret=SECRET, transports=["shm"]) as a:
            peer = a.add_peer(target.metadata)
            src = np.full(4096, 9, np.uint8)
            rs = a.register(src)
            assert a.prepare_extents("write", peer, [(rs.id, 0, target.hello["region"], 0, 4096)]).post().wait(10)
    finally:
        target.stop()


def test_first_contact_with_a_frozen_peer_is_bounded_by_the_transfers_timeout():
    target = Target()
    try:
        with pdkv.Agent("a", secret=SECRET, transports=["shm"]) as a:
            peer = a.add_peer(target.metadata)
            src = np.full(4096, 9, np.uint8)
            rs = a.register(src)
            freeze(target.pid)
            t0 = time.monotonic()
            x = a.prepare_extents("write", peer, [(rs.id, 0, target.hello["region"], 0, 4096)]).post(timeout=0.5)
            with pytest.raises(pdkv.TransferTimeout):
                x.wait(10)
            took = time.monotonic() - t0
            assert took < 1.5, f"post(timeout=0.5) to a frozen shm peer took {took:.2f} s"
            target.resume()
            # Thawed, it serves on a new contact.
            assert a.prepare_extents("write", peer, [(rs.id, 0, target.hello["region"], 0, 4096)]).post().wait(10)
    finally:
        target.stop()
