"""Two peers on separate lab hosts (pdkv.lab.netlab.testbed: network namespaces on a private
switch; no traffic leaves this machine)."""

from __future__ import annotations

import pytest

from kvpools import Pool, PoolSpec
from pdkv.lab.netlab import testbed as netlab

pytestmark = pytest.mark.netns


@pytest.fixture
def netns_pair():
    """((prefix, address) of h0, (prefix, address) of h1) on an unshaped two-host lab."""
    try:
        lab = netlab.Lab(hosts=2).up()
    except netlab.NetlabUnavailable as e:
        pytest.skip(str(e))
    try:
        yield (lab.prefix("h0"), lab.address("h0")), (lab.prefix("h1"), lab.address("h1"))
    finally:
        lab.down()


@pytest.mark.parametrize("op", ["write", "read"])
def test_transfer_across_namespaces(spawn_peer, netns_pair, op):
    (on_a, ip_a), (on_b, ip_b) = netns_pair
    spec = PoolSpec(layers=2, blocks=64, block_tokens=16, heads=4, head_dim=64, dtype="float16")
    target = spawn_peer("decode", spec, seed=2, listen=f"{ip_b}:0", prefix=on_b)
    assert target.address.startswith(ip_b)
    initiator = spawn_peer("prefill", spec, seed=1, listen=f"{ip_a}:0", prefix=on_a)
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
    (on_a, ip_a), (on_b, ip_b) = netns_pair
    spec = PoolSpec(layers=1, blocks=8, block_tokens=4, heads=2, head_dim=8, dtype="float16")
    target = spawn_peer("decode", spec, seed=2, listen="0.0.0.0:0", prefix=on_b)
    assert not target.address.startswith("0.0.0.0")
    port = target.address.rsplit(":", 1)[1]
    initiator = spawn_peer("prefill", spec, seed=1, listen=f"{ip_a}:0", prefix=on_a)
    res = initiator.call(cmd="xfer", op="write", address=f"{ip_b}:{port}", lblocks=[1, 2], rblocks=[3, 4])
    assert res["ok"], res
    assert target.call(cmd="digest", blocks=[3, 4])["digest"] == Pool(spec, 1).digest([1, 2])
