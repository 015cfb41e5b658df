"""One fault contract for every transport (docs/faults.md), checked the same way for each.

A peer-side fault never raises from ``write()`` (nor ``prepare()``/``post()``): the
returned transfer fails, and ``wait()`` raises exactly

* ``PeerConnectionError`` when the peer died, or was never reachable at its address;
* ``TransferTimeout`` when the peer is frozen (SIGSTOP), at the transfer's timeout;
* ``StalePeer`` when the peer restarted (same name and address, a new instance).

After the fault the same agent completes a verified transfer with a healthy peer.
Every flavor of tests/conftest.py runs every fault: tcp, shm (Agent.alloc pools),
shm-cma (numpy pools, cross-memory attach) and nixl when installed. Every write carries
a notification, as an engine's would: with shared-memory pools the bytes of a write can
land without the peer's help, but its notification cannot.

cuda_ipc needs device memory: its agents run over the fake CUDA driver, each in a
child process (tests/fake_gpu_peers.py), and the initiator reports which call raised,
the transfer's state and error class, and the time taken. Dead and frozen exporters,
for write, read (both with a notification) and a notification alone, and both before
the importer first dialed the exporter's control socket and after.
"""

from __future__ import annotations

import glob
import os
import random
import shutil
import socket
import tempfile
import time

import pytest

import pdkv
from conftest import SECRET, make_pool
from fake_gpu_peers import fake_peer  # noqa: F401  (fixture)
from kvpools import PoolSpec

SPEC = PoolSpec(layers=2, blocks=16, block_tokens=4, heads=2, head_dim=16, dtype="float16")
FAULTS = ["dead", "frozen", "restarted", "unreachable"]


def free_port() -> int:
    """A free 127.0.0.1 port below the kernel's ephemeral range, in a band of its own per
    pytest-xdist worker. A port from bind(0) is freed when its peer is killed and can be
    handed at once to an agent of the other worker's tests, which then answers at the
    dead peer's address (seen as StalePeer instead of PeerConnectionError)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    lo = 20000 + (int(worker) % 8 if worker.isdigit() else 0) * 1500
    for _ in range(500):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", random.randrange(lo, lo + 1500)))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no free port in {lo}..{lo + 1499}")


def agent_for(flavor, name: str) -> pdkv.Agent:
    kw = {}
    if flavor.name == "nixl":
        from pdkv.backends.nixl import NixlOptions

        kw["options"] = [NixlOptions(handshake_timeout_s=2.0)]
    return flavor.agent(name, default_timeout=20.0, **kw)


def verified_write(agent: pdkv.Agent, peer_proc, local, name: str, src: list[int], dst: list[int]) -> None:
    assert agent.write(name, pdkv.Blocks("kv", src), pdkv.Blocks("kv", dst), notify=b"healthy").wait(20)
    assert peer_proc.call(cmd="digest", blocks=dst)["digest"] == local.digest(src)


@pytest.mark.parametrize("fault", FAULTS)
def test_peer_fault_fails_the_transfer_and_raises_its_class_from_wait(spawn_peer, flavor, fault, monkeypatch, request):
    # Sockets in a directory of this test's own: a dead shm peer is told from a restarted
    # one by whether another agent of its name listens in its socket directory, and the
    # other xdist worker's tests start agents named "decode" too.
    sock_dir = tempfile.mkdtemp(prefix="pdkv-fc-")  # short: socket paths are limited
    request.addfinalizer(lambda: shutil.rmtree(sock_dir, ignore_errors=True))
    monkeypatch.setenv("PDKV_SHM_DIR", sock_dir)
    port = free_port()
    args = dict(listen=f"127.0.0.1:{port}", **flavor.peer_args())
    peer = spawn_peer("decode", SPEC, **args)
    with agent_for(flavor, "prefill") as a:
        local = make_pool(SPEC, 7, a)
        local.register(a)
        if fault == "unreachable":
            # The peer's metadata is all we have; nothing answers at its addresses.
            md = a.fetch_metadata(peer.address)
            peer.stop()
            name = a.add_peer(md)
        else:
            name = a.connect(peer.address)
            verified_write(a, peer, local, name, [0, 1], [2, 3])
        timeout = 20.0
        expected: type[pdkv.PdkvError]
        if fault == "dead":
            peer.kill()
            expected = pdkv.PeerConnectionError
        elif fault == "frozen":
            peer.pause()
            timeout = 1.0
            expected = pdkv.TransferTimeout
        elif fault == "restarted":
            peer.stop()
            peer = spawn_peer("decode", SPEC, **args)  # same name, same address, new instance
            expected = pdkv.StalePeer
        else:
            expected = pdkv.PeerConnectionError
        try:
            t0 = time.monotonic()
            x = a.write(name, pdkv.Blocks("kv", [4, 5, 6]), pdkv.Blocks("kv", [7, 8, 9]), notify=b"never-delivered",
                        timeout=timeout)
            with pytest.raises(expected) as info:
                x.wait(30)
            assert type(info.value) is expected, f"{type(info.value).__name__}: {info.value}"
            assert x.state is pdkv.XferState.FAILED
            assert isinstance(x.error, expected)
            assert time.monotonic() - t0 < 25.0  # did not hang (generous: no timing claims)
            if fault == "frozen":
                assert time.monotonic() - t0 >= 0.9  # not before its deadline
        finally:
            if fault == "frozen":
                peer.resume()
        # The agent is unharmed: a verified transfer with a healthy peer.
        if fault == "frozen":
            healthy, hname = peer, name
        else:
            healthy = spawn_peer("healthy", SPEC, **flavor.peer_args())
            hname = a.connect(healthy.address)
        verified_write(a, healthy, local, hname, [10, 11, 12], [13, 14, 15])
        if fault == "restarted":  # re-adding the restarted peer's metadata makes it usable again
            name = a.connect(peer.address)
            verified_write(a, peer, local, name, [1, 2], [3, 4])


def _fill_backlog(path: str, held: list) -> None:
    """Queues connections to a Unix socket nobody accepts until its backlog refuses one."""
    while len(held) < 10_000:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        held.append(s)
        if s.connect_ex(path) != 0:
            return


def test_shm_dial_to_a_frozen_peer_with_a_full_backlog_is_bounded(spawn_peer):
    """A frozen shm peer accepts nothing: once its control socket's backlog is full, a
    blocking connect() would wait forever (the first transfer to it would hang). The
    dial keeps to the connect deadline instead and fails that transfer."""
    peer = spawn_peer("decode", SPEC, transports=["shm", "tcp"], shared=False)
    with pdkv.Agent("prefill", secret=SECRET, transports=["shm", "tcp"],
                    default_timeout=20.0) as a:
        local = make_pool(SPEC, 7, a)
        local.register(a)
        name = a.add_peer(a.fetch_metadata(peer.address))  # not dialed yet over shm
        [path] = [addr for t, addr in a.peer_info(name)["endpoints"] if t == "shm"]
        peer.pause()
        held: list[socket.socket] = []
        try:
            _fill_backlog(path, held)
            t0 = time.monotonic()
            x = a.write(name, pdkv.Blocks("kv", [4, 5]), pdkv.Blocks("kv", [7, 8]), notify=b"never-delivered",
                        timeout=2.0)
            with pytest.raises(pdkv.TransferTimeout) as info:
                x.wait(40)
            assert "backlog" in str(info.value), info.value
            assert time.monotonic() - t0 < 25.0  # did not hang (generous: no timing claims)
        finally:
            for s in held:
                s.close()
            peer.resume()
        verified_write(a, peer, local, name, [10, 11], [13, 14])


def test_caller_errors_raise_at_once_even_for_a_faulty_peer(spawn_peer, flavor):
    """Only caller errors raise synchronously, whatever state the peer is in."""
    peer = spawn_peer("decode", SPEC, **flavor.peer_args())
    with agent_for(flavor, "prefill") as a:
        local = make_pool(SPEC, 3, a)
        local.register(a)
        name = a.connect(peer.address)
        peer.kill()
        with pytest.raises(pdkv.NotFound):
            a.write("nobody", pdkv.Blocks("kv", [0]))
        with pytest.raises(pdkv.OutOfRange):
            a.write(name, pdkv.Blocks("kv", [0]), pdkv.Blocks("kv", [SPEC.blocks]))  # beyond the peer's metadata
        with pytest.raises(pdkv.InvalidArgument):
            a.write(name, pdkv.Blocks("kv", [0, 1]), pdkv.Blocks("kv", [5, 5]))
        with pytest.raises(pdkv.InvalidArgument):
            a.write(name, pdkv.Blocks("kv", [0]), notify=123)
        with pytest.raises(pdkv.InvalidArgument):
            a.write(name, pdkv.Blocks("kv", [0]), timeout=-1)


def test_argument_errors_are_the_same_on_every_transport(agent_pair):
    """The validation layer is shared: a Python transport (nixl) rejects what the native ones do."""
    a, b = agent_pair
    pa, pb = make_pool(SPEC, 1, a), make_pool(SPEC, None, b)
    pa.register(a)
    pb.register(b)
    peer = a.connect(b.address)
    for bad in (dict(notify=5), dict(timeout=-1), dict(timeout=float("nan"))):
        with pytest.raises(pdkv.InvalidArgument):
            a.prepare("write", peer, pdkv.Blocks("kv", [0])).post(**bad)
    with pytest.raises(pdkv.InvalidArgument, match="remote block 3 appears twice"):
        a.write(peer, pdkv.Blocks("kv", [0, 1]), pdkv.Blocks("kv", [3, 3]))
    with pytest.raises(pdkv.InvalidArgument, match="Blocks.ids must be a sequence of integer block ids"):
        a.write(peer, pdkv.Blocks("kv", [0.0]))
    x = a.write(peer, pdkv.Blocks("kv", [0]), pdkv.Blocks("kv", [1]))
    with pytest.raises(pdkv.InvalidArgument, match="timeout"):
        x.wait(-1)
    assert x.wait(10)


# ------------------------------------------------------------------ cuda_ipc (fake GPU)

CUDA_SPEC = PoolSpec(style="vllm", layers=2, blocks=16, block_tokens=4, heads=2, head_dim=16, dtype="float16")


def verified_cuda_xfer(init, target, op: str, lblocks: list[int], rblocks: list[int], **kw) -> None:
    """A transfer from ``init`` that succeeds over cuda_ipc and moves the right bytes."""
    r = init.call(cmd="xfer", op=op, address=target.address, lblocks=lblocks, rblocks=rblocks, notify="healthy",
                  **kw)
    assert r["ok"] and r["transport"] == "cuda_ipc", r
    assert init.call(cmd="digest", blocks=lblocks) == target.call(cmd="digest", blocks=rblocks)


# (op, dialed). A notification alone travels over tcp: it never dials cuda_ipc.
CUDA_FAULT_CASES = [("write", False), ("write", True), ("read", False), ("read", True), ("notify", True)]


@pytest.mark.parametrize("op,dialed", CUDA_FAULT_CASES,
                         ids=[f"{op}-{'dialed' if d else 'first-use'}" for op, d in CUDA_FAULT_CASES])
@pytest.mark.parametrize("fault", ["dead", "frozen"])
def test_cuda_ipc_exporter_fault_fails_the_transfer_and_raises_its_class_from_wait(fake_peer, fault, op, dialed):
    """``first-use``: the fault comes before the importer ever dialed the exporter's
    control socket, so prepare() cannot map anything (its dial fails or times out);
    ``dialed``: a verified transfer came first and the mapping exists."""
    target = fake_peer("decode", CUDA_SPEC, 1)
    init = fake_peer("prefill", CUDA_SPEC, 2)
    if dialed:
        verified_cuda_xfer(init, target, "write", [0, 1], [2, 3])
    else:
        assert init.call(cmd="xfer", op="notify", address=target.address, notify="hello")["ok"]  # connected
    timeout = 20.0
    if fault == "dead":
        target.kill()
        expected = pdkv.PeerConnectionError
    else:
        target.pause()
        timeout = 1.0
        expected = pdkv.TransferTimeout
    try:
        r = init.call(cmd="xfer", op=op, address=target.address, lblocks=[4, 5, 6], rblocks=[7, 8, 9],
                      notify="never-delivered", xfer_timeout=timeout, keep="faulty")
        assert not r["ok"], r
        assert r["raised_by"] == "wait", r  # not prepare(), post() or notify()
        assert r["error"].split(":")[0] == expected.__name__, r
        assert r["state"] == "FAILED" and r["error_attr"] == expected.__name__, r
        assert r["elapsed"] < 25.0, r  # did not hang (generous: no timing claims)
        if fault == "frozen":
            assert r["elapsed"] >= 0.9, r  # not before its deadline
    finally:
        if fault == "frozen":
            target.resume()
    if fault == "frozen" and op != "notify":
        # The exporter is back: the same prepared transfer now maps and completes.
        r = init.call(cmd="xfer", address=target.address, op=op, reuse="faulty", notify="back")
        assert r["ok"] and r["transport"] == "cuda_ipc", r
        assert init.call(cmd="digest", blocks=[4, 5, 6]) == target.call(cmd="digest", blocks=[7, 8, 9])
    if fault == "dead" and op != "notify":
        # Posting the failed transfer again fails again, from wait().
        r = init.call(cmd="xfer", address=target.address, op=op, reuse="faulty", xfer_timeout=timeout)
        assert r["raised_by"] == "wait" and r["error_attr"] == "PeerConnectionError", r
    # The agent is unharmed: a verified transfer with a healthy peer.
    healthy = target if fault == "frozen" else fake_peer("healthy", CUDA_SPEC, 3)
    verified_cuda_xfer(init, healthy, "write", [10, 11, 12], [13, 14, 15])


def test_cuda_ipc_dial_to_a_frozen_exporter_with_a_full_backlog_is_bounded(fake_peer, tmp_path):
    """A frozen exporter accepts nothing: once its control socket's backlog is full, a
    blocking connect() would wait forever. The dial keeps to its deadline instead."""
    target = fake_peer("decode", CUDA_SPEC, 1, env={"PDKV_SHM_DIR": str(tmp_path)})
    init = fake_peer("prefill", CUDA_SPEC, 2)
    assert init.call(cmd="xfer", op="notify", address=target.address, notify="hello")["ok"]  # connected
    [path] = glob.glob(str(tmp_path / "decode-*.cuda.sock"))
    target.pause()
    held: list[socket.socket] = []
    try:
        while len(held) < 10_000:  # queue connections until the backlog refuses one
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            held.append(s)
            if s.connect_ex(path) != 0:
                break
        r = init.call(cmd="xfer", op="write", address=target.address, lblocks=[4, 5], rblocks=[7, 8],
                      notify="never-delivered", xfer_timeout=1.0, timeout=40)
        assert r["raised_by"] == "wait" and r["error_attr"] == "TransferTimeout", r
        assert "backlog" in r["error"], r
        assert r["elapsed"] < 25.0, r
    finally:
        for s in held:
            s.close()
        target.resume()


def test_cuda_ipc_caller_errors_raise_at_once_even_for_a_dead_exporter(fake_peer):
    target = fake_peer("decode", CUDA_SPEC, 1)
    init = fake_peer("prefill", CUDA_SPEC, 2)
    assert init.call(cmd="xfer", op="notify", address=target.address, notify="hello")["ok"]  # connected
    target.kill()
    r = init.call(cmd="xfer", op="write", address=target.address, lblocks=[0], rblocks=[CUDA_SPEC.blocks])
    assert r["raised_by"] == "prepare" and r["error"].startswith("OutOfRange"), r
    r = init.call(cmd="xfer", op="write", address=target.address, lblocks=[0, 1], rblocks=[5, 5])
    assert r["raised_by"] == "prepare" and r["error"].startswith("InvalidArgument"), r
