"""pdkv.set_thread_cpus: the CPUs pdkv's own threads run on (process-wide).

Each case runs in a child process (the setting is process-wide and threads keep the
affinity they started with), creates agents, moves bytes so that every kind of
thread exists (tcp progress, shm progress and copy threads), and reads each pdkv
thread's allowed CPUs from /proc."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import pdkv

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread affinity is read from /proc")

CHILD = textwrap.dedent(r"""
    import json, os, sys
    import numpy as np
    import pdkv

    def allowed(tid):
        with open(f"/proc/self/task/{tid}/status") as f:
            for line in f:
                if line.startswith("Cpus_allowed_list:"):
                    return line.split(":", 1)[1].strip()

    def pdkv_threads():
        out = {}
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            if name.startswith("pdkv-"):
                out.setdefault(name, set()).add(allowed(tid))
        return {k: sorted(v) for k, v in out.items()}

    pin, cpus = json.loads(sys.argv[1])
    if pin is not None:
        os.sched_setaffinity(0, pin)        # the engine pins its thread, as vLLM does
    if cpus is not None:
        pdkv.set_thread_cpus(cpus)
    res = {"thread_cpus": pdkv.thread_cpus()}
    a = pdkv.Agent("a", secret="s", transports=["tcp", "shm"])
    b = pdkv.Agent("b", secret="s", transports=["tcp", "shm"])
    src = np.arange(1 << 20, dtype=np.uint8)
    dst = np.zeros_like(src)
    ra, rb = a.register(src), b.register(dst)
    b.add_peer(a.metadata())
    a.add_peer(b.metadata())
    for t in ("tcp", "shm"):
        dst[:] = 0
        x = a.prepare_extents("write", "b", [(ra.id, 0, rb.id, 0, src.nbytes)],
                              options=pdkv.XferOptions(transport=t)).post()
        assert x.wait(30) and x.error is None, (t, x.error)
        assert (dst == src).all(), t
    res["threads"] = pdkv_threads()
    res["caller"] = sorted(os.sched_getaffinity(0))
    print(json.dumps(res))
""")


def _run(pin, cpus) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps([pin, cpus])], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PDKV_LOG": "error"})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _fmt(cpus) -> str:
    return ",".join(map(str, cpus)) if len(cpus) != 2 or cpus[1] != cpus[0] + 1 else f"{cpus[0]}-{cpus[1]}"


ALL = sorted(os.sched_getaffinity(0))
need_two = pytest.mark.skipif(len(ALL) < 2, reason="needs 2 CPUs")


@need_two
def test_threads_inherit_the_starting_threads_affinity_by_default():
    res = _run([ALL[-1]], None)
    assert res["thread_cpus"] == []
    assert {"pdkv-tcp", "pdkv-shm"} <= set(res["threads"]), res
    for name, sets in res["threads"].items():
        assert sets == [str(ALL[-1])], (name, sets)


@need_two
def test_threads_take_the_cpus_set_even_when_the_caller_is_pinned():
    """vLLM's case: the worker thread pinned to one core, pdkv's threads on others."""
    res = _run([ALL[-1]], ALL)
    assert res["thread_cpus"] == ALL and res["caller"] == [ALL[-1]]  # the caller keeps its own
    assert {"pdkv-tcp", "pdkv-shm"} <= set(res["threads"]), res
    want = ",".join(map(str, ALL)) if len(ALL) > 2 else _fmt(ALL)
    for name, sets in res["threads"].items():
        assert sets == [want], (name, sets)
    res = _run(ALL, [ALL[0]])
    for name, sets in res["threads"].items():
        assert sets == [str(ALL[0])], (name, sets)


def test_reset_and_bad_sets_are_refused_naming_the_problem():
    before = pdkv.thread_cpus()
    try:
        pdkv.set_thread_cpus([ALL[0], ALL[0]])
        assert pdkv.thread_cpus() == [ALL[0]]
        pdkv.set_thread_cpus(None)
        assert pdkv.thread_cpus() == []
        for bad, msg in (([-1], "out of range"), ([1 << 20], "out of range"), ([100000], "out of range"),
                         (["0"], "not a CPU number"), ([True], "not a CPU number"), ([1.0], "not a CPU number"),
                         ("0,1", "iterable"), (3, "iterable")):
            with pytest.raises(pdkv.InvalidArgument, match=msg):
                pdkv.set_thread_cpus(bad)
            assert pdkv.thread_cpus() == []
        offline = os.cpu_count() or 1
        if offline < 1000:  # a CPU number this machine does not have: the kernel refuses it
            with pytest.raises(pdkv.InvalidArgument, match=r"kernel refuses this set"):
                pdkv.set_thread_cpus([offline + 7])
        assert pdkv.thread_cpus() == []
    finally:
        pdkv.set_thread_cpus(before)
