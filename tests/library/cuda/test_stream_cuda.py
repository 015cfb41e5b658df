"""Streaming writes of device memory over cuda_ipc and over tcp (staged per batch through pinned host
buffers) on the fake CUDA driver (tests/fakecuda), whose device memory is not
host-accessible and whose copies land late: a layer acknowledged or notified before
its bytes reached the device shows up as a mismatch when the notification arrives.

The checks run in a fresh process (the CUDA driver is loaded once per process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from fake_gpu_peers import fake_peer  # noqa: F401  (fixture)
from kvpools import PoolSpec

CHILD = textwrap.dedent('''
    import json
    import numpy as np
    import pdkv
    from pdkv.lab.transfer.devmem import DeviceMemory

    MEM = DeviceMemory()
    GEOM = pdkv.KVGeometry(num_layers=6, num_blocks=32, block_tokens=4, kv_heads=2, head_dim=64, dtype="float32")
    TCP = pdkv.TcpOptions(stage_chunk_bytes=16384, stage_buffers=2)

    def side(name, seed):
        agent = pdkv.Agent(name, secret="s", transports=["tcp"], options=[TCP])
        n = GEOM.pool_bytes
        dev = MEM.alloc(n)
        MEM.htod(dev, np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8))
        agent.register_address(dev, n, kind="cuda", device=0)
        agent.add_layout("kv", pdkv.KVLayout.contiguous(GEOM, dev))
        return agent, dev

    def blocks(dev, ids, layers):
        v = MEM.dtoh(dev, GEOM.pool_bytes, np.uint8).reshape(GEOM.num_layers, 2, GEOM.num_blocks, -1)
        return v[layers][:, :, ids].copy()

    a, da = side("dev-a", 1)
    b, db = side("dev-b", 2)
    peer = a.connect(b.address)
    lids, rids = [3, 4, 5, 9, 20, 21], [0, 1, 2, 30, 10, 11]
    checks = []
    for order, inflight in (([0, 1, 2, 3, 4, 5], 1), ([4, 0, 5, 2, 1, 3], 4)):
        s = a.open_stream(peer, pdkv.Blocks("kv", lids), pdkv.Blocks("kv", rids), notify=b"done",
                          stream=pdkv.StreamOptions(progress_prefix=b"p:", max_inflight_batches=inflight))
        for layer in order:
            s.post_layers(layer)
        s.close()
        while True:
            (n,) = b.wait_notifications(30, max_count=1)
            if n.data == b"done":
                assert np.array_equal(blocks(db, rids, list(range(6))), blocks(da, lids, list(range(6))))
                break
            first, end = map(int, n.data[2:].split(b"-"))
            layers = list(range(first, end))
            assert np.array_equal(blocks(db, rids, layers), blocks(da, lids, layers)), n.data
        assert s.wait(30)
        checks.append(f"streamed {s.batches_posted} batches")
        MEM.htod(db, np.zeros(GEOM.pool_bytes, np.uint8))
    a.close()
    b.close()
    print(json.dumps({"checks": checks}))
''')


def test_device_memory_streams_over_tcp_bit_exact_per_batch(fakecuda_path):
    env = dict(os.environ, PDKV_CUDA_DRIVER=fakecuda_path, FAKECUDA_COPY_DELAY_US="100")
    r = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    checks = json.loads(r.stdout.strip().splitlines()[-1])["checks"]
    assert len(checks) == 2, checks
    # Each stream went out in 1 to 6 batches (how many depends on timing), every one
    # of them checked bit-exact the moment its progress notification arrived.
    assert all(1 <= int(c.split()[1]) <= 6 for c in checks), checks


def test_device_pools_stream_over_cuda_ipc_bit_exact(fake_peer):
    """Between two processes over the fake driver (cuda_ipc): the notification comes
    after every layer's bytes, checked by the target the moment it arrives, with copies
    that land 2 ms late."""
    spec = PoolSpec(layers=4, blocks=64, block_tokens=4, heads=2, head_dim=16, dtype="float16", style="vllm")
    slow = {"FAKECUDA_COPY_DELAY_US": "2000"}
    target = fake_peer("target", spec, 1, env=slow)
    init = fake_peer("init", spec, 2, env=slow)
    lids, rids = [5, 6, 7, 40, 2, 3], [60, 1, 2, 10, 11, 30]
    want = init.call(cmd="digest", blocks=lids)["digest"]
    target.send(cmd="expect", items=[{"notif": "s1", "blocks": rids, "digest": want}], timeout=20)
    r = init.call(cmd="xfer", op="stream", address=target.address, lblocks=lids, rblocks=rids, notify="s1",
                  order=[2, 0, 3, 1])
    assert r["ok"], r["error"]
    assert r["peer_transport"] == "cuda_ipc" and r["transport"] == "cuda_ipc"
    assert target.recv(30) == {"results": [{"notif": "s1", "ok": True}], "missing": []}
