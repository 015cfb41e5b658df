"""An shm peer that reuses a lease id it still holds: refused, never a hung target.

The target used to refuse it while holding the connection's lock, and refusing kills
the connection, which takes that lock again: the progress thread deadlocked and the
agent stopped serving every shm peer. Now: an error frame naming the reuse, the
connection closed (releasing the lease), the target still serves.
"""

from __future__ import annotations

import os
import struct
import sys

import pytest

import pdkv
from conftest import SECRET
from kvpools import Pool

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/library: test_generations
from test_generations import LEASE_REQ, LEASE_RESP, SPEC, _claim, _shm_frame, _shm_raw, _shm_recv  # noqa: E402, F401
from test_generations import _close_raw_sockets  # noqa: E402, F401  (fixture)

SHM_ERROR = 9


def test_reusing_a_held_lease_id_is_refused_and_the_target_keeps_serving():
    if "shm" not in pdkv.available_transports():
        pytest.skip("no shm transport")
    with pdkv.Agent("target", secret=SECRET, transports=["shm"]) as b:
        Pool(SPEC, 2).register(b)
        gens = b.generations("kv", [2])
        req = _shm_frame(LEASE_REQ, 7, struct.pack("<I", 60000) + _claim("kv", [2], gens)[4:])
        s = _shm_raw(b)
        s.sendall(req)
        hdr, _ = _shm_recv(s)
        assert hdr[1] == LEASE_RESP and hdr[3] == 7 and hdr[5] == 0
        s.sendall(req)  # the same id again, while held
        hdr, aux = _shm_recv(s)
        assert hdr[1] == SHM_ERROR and b"reused lease id 7" in aux
        assert _shm_recv(s) is None  # then the connection is closed ...
        assert b.bump_generations("kv", [2], timeout=10) == [gens[0] + 1]  # ... and the lease with it
        # The progress thread is alive: a new peer is answered.
        s2 = _shm_raw(b)
        s2.sendall(_shm_frame(LEASE_REQ, 1, struct.pack("<I", 60000) + _claim("kv", [3], b.generations("kv", [3]))[4:]))
        hdr, _ = _shm_recv(s2)
        assert hdr[1] == LEASE_RESP and hdr[5] == 0
