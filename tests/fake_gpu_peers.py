"""Agents over the fake CUDA driver (tests/fakecuda), each in a child process of its own.

The CUDA driver is loaded once per process, so a fake-GPU agent cannot live in the
pytest process: ``FakePeer`` starts tests/library/cuda/fake_peer.py with ``PDKV_CUDA_DRIVER``
naming the fake driver and drives it by JSON lines. The ``fake_peer`` fixture is
imported by the test modules that use it (tests/library/cuda/test_fake_cuda_ipc.py,
tests/library/test_fault_contract.py); the fake driver itself is built by the
``fakecuda_path`` fixture (tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from conftest import JsonLineProc

HERE = os.path.dirname(os.path.abspath(__file__))
FAKE_PEER = os.path.join(HERE, "library", "cuda", "fake_peer.py")


class FakePeer(JsonLineProc):
    """A pdkv agent over fake-CUDA memory in a child process (cuda/fake_peer.py)."""

    def __init__(self, driver: str, name: str, spec, seed: int | None, *, env: dict | None = None,
                 **opts) -> None:
        cmd = [sys.executable, FAKE_PEER, "--name", name, "--spec", json.dumps(spec.to_dict())]
        if seed is not None:
            cmd += ["--seed", str(seed)]
        for k, v in opts.items():
            cmd += [f"--{k}", str(v)]
        super().__init__(cmd, name, env=dict(os.environ, PDKV_CUDA_DRIVER=driver, **(env or {})))
        self.available = self.hello["available"]

    def stats(self) -> dict:
        return self.call(cmd="stats")["stats"]


@pytest.fixture
def fake_peer(fakecuda_path):
    """``fake_peer(name, spec, seed=None, env=None, memory=..., alloc=...) -> FakePeer``;
    asserts at teardown that every peer exited cleanly (no crash in the fake driver).
    A peer the test killed (``kill()``) is exempt."""
    procs: list[FakePeer] = []

    def start(name, spec, seed=None, **kw) -> FakePeer:
        p = FakePeer(fakecuda_path, name, spec, seed, **kw)
        procs.append(p)
        return p

    yield start
    bad = []
    for p in procs:
        killed_by_test = p.proc.returncode is not None
        code = p.stop()
        if code != 0 and not killed_by_test:
            bad.append((p.name, code))
    assert not bad, f"fake-GPU peers exited badly: {bad}"
