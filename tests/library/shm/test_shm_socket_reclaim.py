"""Socket files of killed agents are reclaimed: an agent that starts unlinks the shm
control sockets in its directory that nobody listens on any more (their agent was
SIGKILLed before it could unlink them), and leaves everything else alone."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import pdkv

START_AGENT = ("import os, sys, time, pdkv\n"
               "a = pdkv.Agent(sys.argv[1], secret='s' * 16, transports=['shm'])\n"
               "print('up', flush=True)\n"
               "time.sleep(600)\n")


def _start(name: str, env: dict) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", START_AGENT, name], env=env, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "up"
    return p


def _kill(p: subprocess.Popen) -> None:
    p.kill()
    p.wait()
    if p.stdout is not None:
        p.stdout.close()


def _age(path: Path, seconds: float = 60.0) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t), follow_symlinks=False)


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_a_new_agent_reclaims_the_sockets_of_killed_agents_only(tmp_path, monkeypatch):
    env = dict(os.environ, PDKV_SHM_DIR=str(tmp_path))
    dead = [_start(f"dead{i}", env) for i in range(3)]
    alive = _start("alive", env)
    try:
        for p in dead:
            _kill(p)
        left = sorted(tmp_path.glob("*.sock"))
        assert len(left) == 4  # SIGKILL left three behind
        for f in left:
            _age(f)  # old enough to be judged
        # A fresh dead socket (a starting agent could be between bind and listen): kept.
        young = tmp_path / "young-0000000000000001.sock"
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(young))
        s.close()
        # Not a socket, or not named *.sock: never touched.
        plain = tmp_path / "plain-0000000000000002.sock"
        plain.write_text("not a socket")
        _age(plain)
        other = tmp_path / "other.sockx"
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(other))
        s.close()
        _age(other)

        monkeypatch.setenv("PDKV_SHM_DIR", str(tmp_path))
        with pdkv.Agent("fresh", secret="s" * 16, transports=["shm"]):
            names = sorted(f.name for f in tmp_path.iterdir())
        assert not any(n.startswith("dead") for n in names), names
        assert any(n.startswith("alive-") for n in names), names  # its agent still listens
        assert {young.name, plain.name, other.name} <= set(names)
        assert any(n.startswith("fresh-") for n in names)
    finally:
        for p in dead + [alive]:
            if p.returncode is None:
                _kill(p)
