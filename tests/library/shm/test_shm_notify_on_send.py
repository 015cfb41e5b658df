"""ShmOptions(notify_on_send=True): a transfer's notification completes the transfer
once it is sent (after every byte landed) instead of when the peer acknowledges it
(docs/api.md, "Notifications"). The peer still gets it only after the bytes landed;
one the peer never acknowledges (frozen past the deadline, dead) is counted in
Agent.notifications_unacknowledged instead of failing the transfer.
"""

from __future__ import annotations

import numpy as np
import pytest

import pdkv
from conftest import SECRET, make_pool, wait_until
from kvpools import Pool, PoolSpec

pytestmark = pytest.mark.skipif("shm" not in pdkv.available_transports(), reason="shm transport not available")

SPEC = PoolSpec(layers=2, blocks=16, block_tokens=4, heads=2, head_dim=16, dtype="float16")


def test_option_is_a_bool_and_off_by_default():
    assert pdkv.ShmOptions().notify_on_send is False
    assert pdkv.ShmOptions(notify_on_send=True).notify_on_send is True
    with pytest.raises(pdkv.InvalidArgument, match="notify_on_send must be a bool"):
        pdkv.ShmOptions(notify_on_send=1)


@pytest.mark.parametrize("on_send", [False, True])
def test_read_with_notification_is_bit_exact_and_delivered_after_the_bytes(on_send):
    a = pdkv.Agent("reader", secret=SECRET, transports=["shm"], options=[pdkv.ShmOptions(notify_on_send=on_send)])
    b = pdkv.Agent("owner", secret=SECRET, transports=["shm"])
    with a, b:
        src, dst = Pool(SPEC, 1, shared_by=b), Pool(SPEC, 2)
        src.register(b)
        dst.register(a)
        peer = a.add_peer(b.metadata())
        for i in range(20):
            src.fill(10 + i)
            gens = b.generations("kv", [1, 2, 3])
            x = a.read(peer, pdkv.Blocks("kv", [4, 5, 6]), pdkv.Blocks("kv", [1, 2, 3], generations=gens),
                       notify=b"req-%d" % i, timeout=10)
            while not x.done:  # as the connector polls
                pass
            assert x.error is None and x.state is pdkv.XferState.DONE
            assert np.array_equal(dst.logical([4, 5, 6]), src.logical([1, 2, 3]))
            assert [n.data for n in b.wait_notifications(5)] == [b"req-%d" % i]
        assert wait_until(lambda: a.notifications_unacknowledged == 0, 2)
        assert a.notifications_unacknowledged == 0


def test_unacknowledged_notification_completes_the_transfer_and_is_counted(spawn_peer):
    """A frozen peer: the write lands (shared memory), its Notify sits in the peer's
    socket unread. With notify_on_send the transfer is DONE at once; at its deadline
    the connection is closed and the notification counted as unacknowledged. Without
    the option the same write fails with TransferTimeout (test_fault_contract.py)."""
    peer = spawn_peer("decode", SPEC, transports=["shm", "tcp"], shared=True)
    with pdkv.Agent("prefill", secret=SECRET, transports=["shm", "tcp"],
                    options=[pdkv.ShmOptions(notify_on_send=True)]) as a:
        local = make_pool(SPEC, 7, a)
        local.register(a)
        name = a.connect(peer.address)
        # Connect and map without a notification (an acknowledgement still in flight
        # when the peer is paused would be counted too).
        assert a.write(name, pdkv.Blocks("kv", [0, 1]), pdkv.Blocks("kv", [2, 3])).wait(20)
        assert peer.call(cmd="digest", blocks=[2, 3])["digest"] == local.digest([0, 1])
        peer.pause()
        try:
            x = a.write(name, pdkv.Blocks("kv", [4, 5, 6]), pdkv.Blocks("kv", [7, 8, 9]), notify=b"maybe-lost",
                        timeout=1.0)
            assert x.wait(10)  # completed when sent: no TransferTimeout
            assert x.state is pdkv.XferState.DONE
            assert a.notifications_unacknowledged == 0  # not yet: its deadline has not passed
            assert wait_until(lambda: a.notifications_unacknowledged == 1, 15), a.notifications_unacknowledged
        finally:
            peer.resume()
        # The bytes landed before the notification was sent.
        assert peer.call(cmd="digest", blocks=[7, 8, 9])["digest"] == local.digest([4, 5, 6])
        # The agent is unharmed: a verified write over a new connection, acknowledged.
        assert a.write(name, pdkv.Blocks("kv", [10, 11]), pdkv.Blocks("kv", [12, 13]), notify=b"again").wait(20)
        assert peer.call(cmd="digest", blocks=[12, 13])["digest"] == local.digest([10, 11])
        assert wait_until(lambda: a.notifications_unacknowledged == 1, 2)
        assert a.notifications_unacknowledged == 1
