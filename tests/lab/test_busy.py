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
