"""Two peers in separate network namespaces joined by a veth pair (a private link
with its own addresses; no traffic leaves this machine)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from kvpools import Pool, PoolSpec

pytestmark = pytest.mark.netns


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, text=True)


@pytest.fixture
def netns_pair():
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2 (`ip`) to create network namespaces")
    tag = f"{os.getpid() % 100000}"
    a, b = f"pdkv-a{tag}", f"pdkv-b{tag}"
    va, vb = f"pva{tag}", f"pvb{tag}"
    try:
        sh("ip", "netns", "add", a)
    except subprocess.CalledProcessError as e:
        pytest.skip(f"cannot create network namespaces here ({e.stderr.strip() or 'permission denied'}); "
                    "run as root or with CAP_NET_ADMIN")
    try:
        sh("ip", "netns", "add", b)
        sh("ip", "link", "add", va, "type", "veth", "peer", "name", vb)
        sh("ip", "link", "set", va, "netns", a)
        sh("ip", "link", "set", vb, "netns", b)
        sh("ip", "-n", a, "addr", "add", "10.213.7.1/30", "dev", va)
        sh("ip", "-n", b, "addr", "add", "10.213.7.2/30", "dev", vb)
        for ns, dev in ((a, va), (b, vb)):
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield (a, "10.213.7.1"), (b, "10.213.7.2")
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.parametrize("op", ["write", "read"])
def test_transfer_across_namespaces(spawn_peer, netns_pair, op):
    (ns_a, ip_a), (ns_b, ip_b) = netns_pair
    spec = PoolSpec(layers=2, blocks=64, block_tokens=16, heads=4, head_dim=64, dtype="float16")
    target = spawn_peer("decode", spec, seed=2, listen=f"{ip_b}:0", prefix=["ip", "netns", "exec", ns_b])
    assert target.address.startswith(ip_b)
    initiator = spawn_peer("prefill", spec, seed=1, listen=f"{ip_a}:0", prefix=["ip", "netns", "exec", ns_a])
    lids, rids = [3, 9, 4, 5, 6, 60], [1, 2, 3, 40, 41, 42]
    res = initiator.call(cmd="xfer", op=op, address=target.address, lblocks=lids, rblocks=rids,
                         notify="across")
    assert res["ok"], res
    if op == "write":
        assert target.call(cmd="digest", blocks=rids)["digest"] == Pool(spec, 1).digest(lids)
    else:
        assert initiator.call(cmd="digest", blocks=lids)["digest"] == Pool(spec, 2).digest(rids)


def test_wildcard_listener_is_reachable_across_namespaces(spawn_peer, netns_pair):
    """A target bound to 0.0.0.0 advertises a real address; connect() uses the one it dialed."""
    (ns_a, ip_a), (ns_b, ip_b) = netns_pair
    spec = PoolSpec(layers=1, blocks=8, block_tokens=4, heads=2, head_dim=8, dtype="float16")
    target = spawn_peer("decode", spec, seed=2, listen="0.0.0.0:0", prefix=["ip", "netns", "exec", ns_b])
    assert not target.address.startswith("0.0.0.0")
    port = target.address.rsplit(":", 1)[1]
    initiator = spawn_peer("prefill", spec, seed=1, listen=f"{ip_a}:0", prefix=["ip", "netns", "exec", ns_a])
    res = initiator.call(cmd="xfer", op="write", address=f"{ip_b}:{port}", lblocks=[1, 2], rblocks=[3, 4])
    assert res["ok"], res
    assert target.call(cmd="digest", blocks=[3, 4])["digest"] == Pool(spec, 1).digest([1, 2])
