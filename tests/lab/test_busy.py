"""`pdkv bench transfer --busy N`: spinning co-runners pinned like an engine's threads."""

from __future__ import annotations

import os
import time

import pytest

import pdkv
from pdkv.lab.transfer.busy import BusyLoad
from pdkv.lab.transfer.cpu import process_cpu_s


def test_co_runners_spin_on_their_cpus_and_are_gone_after():
    allowed = sorted(os.sched_getaffinity(0))
    with BusyLoad(2) as load:
        pids = [p.pid for p in load.procs]
        assert load.cpus == [allowed[0], allowed[1 % len(allowed)]]
        assert [os.sched_getaffinity(pid) for pid in pids] == [{c} for c in load.cpus]
        before = [process_cpu_s(pid) or 0.0 for pid in pids]
        time.sleep(0.5)
        spent = [(process_cpu_s(pid) or 0.0) - b for pid, b in zip(pids, before)]
        assert all(s > 0.05 for s in spent), spent  # they really spin (shared cores: a share of 0.5 s each)
        assert load.describe() == {"processes": 2, "cpus": load.cpus}
    assert all(not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
               for pid in pids)
    assert load.procs == []


def test_bad_counts_and_cpus_are_refused():
    with pytest.raises(pdkv.InvalidArgument, match="co-runners"):
        BusyLoad(-1)
    with pytest.raises(pdkv.InvalidArgument, match="not among"):
        BusyLoad(1, cpus=[max(os.sched_getaffinity(0)) + 1000])
    with BusyLoad(0) as load:
        assert load.procs == [] and load.describe() == {"processes": 0, "cpus": []}


def test_cli_refuses_a_negative_count(capsys):
    from pdkv.lab.transfer.bench import main

    with pytest.raises(SystemExit):
        main(["--busy", "-2", "--payload", "1M"])
    assert "--busy must be >= 0" in capsys.readouterr().err


_PINNED = """
import argparse, json, os
from pdkv.lab.transfer import bench as B
ap = argparse.ArgumentParser(); B.add_arguments(ap); ap.add_argument("--child", action="store_true")
args = ap.parse_args(["--transport", "tcp", "--prepare-blocks", "0"]); args.argv = []
target = B.start_target(args, 2)
try:
    print(json.dumps([sorted(os.sched_getaffinity(0)), sorted(os.sched_getaffinity(target.proc.pid))]))
finally:
    target.close()
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_initiator_and_spawned_target_are_pinned_to_different_cpus():
    # start_target pins this process to the first CPU before spawning the target, which
    # used to inherit that one CPU: both sides of every measurement shared a core.
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _PINNED], capture_output=True, text=True, timeout=120, check=True)
    mine, target = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    allowed = sorted(os.sched_getaffinity(0))
    assert mine == [allowed[0]]
    assert target == [allowed[1]]
