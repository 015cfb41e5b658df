"""``await transfer`` / ``Transfer.wait_async``: one eventfd per event loop, no thread
per waiter, cancellation of the waiter leaves the transfer alone."""

from __future__ import annotations

import asyncio
import threading

import pytest

import pdkv
from conftest import SECRET
from kvpools import PoolSpec

SPEC = PoolSpec(layers=1, blocks=8, block_tokens=4, heads=1, head_dim=8)


def _waits_left() -> int:
    """Waits the running loop still tracks (white box: pdkv.transfer._LoopCompletions)."""
    from pdkv.transfer import _LoopCompletions

    return len(_LoopCompletions.of(asyncio.get_running_loop())._waiting)


@pytest.fixture
def frozen_target(spawn_peer):
    """(agent, peer name, peer process): the peer is connected, then SIGSTOPped, so
    transfers to it stay pending until ``proc.resume()``."""
    proc = spawn_peer("frozen", SPEC, seed=1)
    with pdkv.Agent("waiter", secret=SECRET, transports=["tcp"]) as a:
        from kvpools import Pool

        pool = Pool(SPEC, 2)
        pool.register(a)
        peer = a.connect(proc.address)
        a.warm_up(peer)
        proc.pause()  # returns once every thread of the peer is stopped
        try:
            yield a, peer, proc
        finally:
            proc.resume()


def test_500_concurrent_awaits_use_no_thread_and_all_complete(frozen_target):
    a, peer, proc = frozen_target
    xfers = [a.write(peer, pdkv.Blocks("kv", [i % SPEC.blocks]), timeout=60) for i in range(500)]

    async def main():
        baseline = threading.active_count()
        tasks = [asyncio.ensure_future(x.wait_async()) for x in xfers[:250]]

        async def bare_await(x):
            return await x  # Transfer.__await__

        tasks += [asyncio.ensure_future(bare_await(x)) for x in xfers[250:]]
        await asyncio.sleep(0.3)
        pending = sum(not t.done() for t in tasks)
        threads_while_waiting = threading.active_count()
        proc.resume()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
        return baseline, threads_while_waiting, pending, results

    baseline, during, pending, results = asyncio.run(main())
    assert pending == 500  # they really waited on the frozen peer
    assert during == baseline  # no executor thread per waiter (nor any other)
    assert results == [True] * 500
    assert all(x.state is pdkv.XferState.DONE for x in xfers)


def test_cancelling_the_awaiting_task_leaves_the_transfer_alone(frozen_target):
    a, peer, proc = frozen_target
    x = a.write(peer, pdkv.Blocks("kv", [0]), timeout=60)

    async def main():
        task = asyncio.ensure_future(x.wait_async())
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert x.state is pdkv.XferState.PENDING
        assert _waits_left() == 0  # the cancelled wait left nothing behind
        proc.resume()
        return await x.wait_async(30)  # a new waiter still sees it finish

    assert asyncio.run(main()) is True
    assert x.state is pdkv.XferState.DONE


def test_wait_async_timeout_returns_false_while_pending(frozen_target):
    a, peer, proc = frozen_target
    slow = a.write(peer, pdkv.Blocks("kv", [1]), timeout=60)

    async def main():
        assert await slow.wait_async(0.1) is False
        assert await slow.wait_async(0) is False
        assert _waits_left() == 0
        proc.resume()
        return await slow

    assert asyncio.run(main()) is True
    with pytest.raises(pdkv.InvalidArgument, match="timeout"):
        asyncio.run(slow.wait_async(-1))


def test_awaiting_a_failed_transfer_raises_its_error(frozen_target):
    a, peer, proc = frozen_target
    doomed = a.write(peer, pdkv.Blocks("kv", [2]), timeout=0.3)

    async def main():
        await doomed

    with pytest.raises(pdkv.TransferTimeout):
        asyncio.run(main())


def test_awaiting_a_finished_transfer_and_on_two_loops():
    a = pdkv.Agent("a", secret=SECRET, transports=["tcp"])
    b = pdkv.Agent("b", secret=SECRET, transports=["tcp"])
    src = bytearray(b"x" * 4096)
    dst = bytearray(4096)
    rs, rd = a.register(src), b.register(dst)
    peer = a.connect(b.address)
    x = a.prepare_extents("write", peer, [(rs.id, 0, rd.id, 0, 4096)]).post()
    assert x.wait(10)

    async def main():
        return await x, await x.wait_async(1)

    assert asyncio.run(main()) == (True, True)
    results = []

    def other_loop():
        y = a.prepare_extents("write", peer, [(rs.id, 0, rd.id, 0, 4096)]).post()
        results.append(asyncio.run(y.wait_async(10)))

    t = threading.Thread(target=other_loop)
    t.start()
    t.join(30)
    assert results == [True] and bytes(dst) == bytes(src)
    a.close()
    b.close()
