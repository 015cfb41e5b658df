"""TcpOptions.congestion_control: every connection an agent opens or accepts uses it; a
name the kernel refuses fails the agent's start, naming what is allowed."""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest

import pdkv
from conftest import SECRET

TCP_CONGESTION = getattr(socket, "TCP_CONGESTION", 13)


def _allowed() -> list[str]:
    with open("/proc/sys/net/ipv4/tcp_allowed_congestion_control") as f:
        return f.read().split()


def _default() -> str:
    with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
        return f.read().strip()


def _congestion_by_port(port: int) -> dict[str, set[str]]:
    """This process's tcp sockets on ``port`` (local or remote end): {"dialled" or
    "accepted" or "listening": the congestion controls they use}."""
    out: dict[str, set[str]] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(fd)))
        except OSError:
            continue
        try:
            if s.family != socket.AF_INET or s.type != socket.SOCK_STREAM:
                continue
            local = s.getsockname()[1]
            try:
                remote = s.getpeername()[1]
            except OSError:
                remote = None
            kind = "listening" if remote is None and local == port else "accepted" if local == port else \
                "dialled" if remote == port else None
            if kind:
                cc = s.getsockopt(socket.IPPROTO_TCP, TCP_CONGESTION, 16).rstrip(b"\0").decode()
                out.setdefault(kind, set()).add(cc)
        finally:
            s.close()
    return out


@pytest.mark.parametrize("mode", ["write", "read"])
def test_every_connection_uses_the_chosen_congestion_control(mode):
    other = next((c for c in ("reno", "cubic", "bbr") if c in _allowed() and c != _default()), None)
    if other is None:
        pytest.skip(f"only {_default()!r} is allowed to this process")
    opts = [pdkv.TcpOptions(congestion_control=other)]
    with pdkv.Agent("t", secret=SECRET, transports=["tcp"], options=opts) as t, \
            pdkv.Agent("i", secret=SECRET, transports=["tcp"], options=opts) as i:
        src = np.random.default_rng(3).integers(0, 256, 1 << 20, dtype=np.uint8)
        dst = np.zeros_like(src)
        a, b = (i.register(src), t.register(dst)) if mode == "write" else (i.register(dst), t.register(src))
        peer = i.add_peer(t.metadata())
        assert i.prepare_extents(mode, peer, [(a.id, 0, b.id, 0, src.size)]).post(timeout=10).wait(10)
        assert (dst == src).all()
        seen = _congestion_by_port(int(t.address.rsplit(":", 1)[1]))
        assert seen == {"listening": {other}, "accepted": {other}, "dialled": {other}}, seen
    # The system's, when the option is empty.
    with pdkv.Agent("t", secret=SECRET, transports=["tcp"]) as t, \
            pdkv.Agent("i", secret=SECRET, transports=["tcp"]) as i:
        src = np.ones(4096, np.uint8)
        dst = np.zeros(4096, np.uint8)
        rs, rd = i.register(src), t.register(dst)
        peer = i.add_peer(t.metadata())
        assert i.prepare_extents("write", peer, [(rs.id, 0, rd.id, 0, 4096)]).post(timeout=10).wait(10)
        seen = _congestion_by_port(int(t.address.rsplit(":", 1)[1]))
        assert set().union(*seen.values()) == {_default()}, seen


def test_a_congestion_control_the_kernel_refuses_fails_the_start_naming_the_allowed_ones():
    missing = "pdkvnone"  # no kernel module has this name (a real one, e.g. vegas, may be loaded on demand)
    with pytest.raises(pdkv.InvalidArgument, match=f"tcp.congestion_control '{missing}' is refused by the kernel.*"
                       f"allowed for this process: {' '.join(_allowed())}"):
        pdkv.Agent("x", secret=SECRET, transports=["tcp"], options=[pdkv.TcpOptions(congestion_control=missing)])
