"""`pdkv bench transfer --busy N`: spinning co-runners pinned like an engine's threads."""

from __future__ import annotations

import os
import time

import pytest

import pdkv
from pdkv.lab.transfer.busy import BusyLoad
from pdkv.lab.transfer.cpu import process_cpu_s


def _spends_cpu(pid: int, seconds: float = 0.05, within: float = 20.0) -> bool:
    """pid's CPU time grows by ``seconds`` within ``within`` s of wall time (a loaded
    machine gives a spinner only a share of its core)."""
    before = process_cpu_s(pid) or 0.0
    end = time.monotonic() + within
    while time.monotonic() < end:
        time.sleep(0.1)
        if (process_cpu_s(pid) or 0.0) - before >= seconds:
            return True
    return False


def test_co_runners_spin_on_their_cpus_and_are_gone_after():
    allowed = sorted(os.sched_getaffinity(0))
    with BusyLoad(2) as load:
        pids = [p.pid for p in load.procs]
        assert load.cpus == [allowed[0], allowed[1 % len(allowed)]]
        assert [os.sched_getaffinity(pid) for pid in pids] == [{c} for c in load.cpus]
        assert all(_spends_cpu(pid) for pid in pids)  # they really spin
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


def _stat(pid: int | str) -> list[str] | None:
    """/proc/PID/stat's fields after the command name (state first), None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] != "Z"


def _group_members(pgid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            fields = _stat(d)
            if fields is not None and int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(d))
    return out


def test_spinning_threads_are_bound_one_per_cpu_in_one_process_and_gone_after():
    allowed = sorted(os.sched_getaffinity(0))
    with BusyLoad(0, threads=3) as load:
        pid = load.thread_proc.pid
        assert load.thread_cpus == [allowed[i % len(allowed)] for i in range(3)]
        assert len(load.thread_ids) == 3
        # every thread is a thread of the one co-runner process, bound to its CPU
        assert all(os.path.exists(f"/proc/{pid}/task/{t}") for t in load.thread_ids)
        assert [os.sched_getaffinity(t) for t in load.thread_ids] == [{c} for c in load.thread_cpus]
        assert _spends_cpu(pid, 0.05 * len(load.thread_ids))  # they really run
        assert load.describe() == {"processes": 0, "cpus": [], "threads": 3, "thread_cpus": load.thread_cpus}
    assert not _alive(pid) and load.thread_proc is None


def test_churn_starts_processes_during_the_run_and_kills_them_all_after():
    with BusyLoad(0, churn="fork:4,alloc:8") as load:
        drivers = [d.pid for d in load.drivers]
        assert len(drivers) == 2
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            churn = load.describe()["churn"]
            if all(c["starts"] > 0 for c in churn):
                break
            time.sleep(0.1)
        assert [(c["kind"], c["arg"]) for c in churn] == [("fork", "4"), ("alloc", "8")]
        assert churn[0]["starts"] >= 4 and churn[0]["starts"] % 4 == 0 and churn[1]["starts"] >= 1
    # the drivers and everything they started (same process group) are gone
    assert not any(_alive(p) for p in drivers)
    deadline = time.monotonic() + 15  # a killed child may take a moment to finish exiting under load
    while any(_group_members(p) for p in drivers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(_group_members(p) == [] for p in drivers)
    assert load.describe()["churn"][0]["starts"] >= churn[0]["starts"]  # the last count is kept


def test_churn_specs_parse_and_bad_ones_are_refused():
    from pdkv.lab.transfer.busy import parse_churn

    assert parse_churn("import:json, fork:8,alloc:64") == [("import", "json"), ("fork", "8"), ("alloc", "64")]
    assert parse_churn("fork,alloc") == [("fork", "16"), ("alloc", "512")]
    assert parse_churn("import")[0][1] in ("torch", "numpy", "asyncio")
    for bad, msg in (("spawn", "unknown churn kind"), ("fork:0", "1..256"), ("fork:x", "1..256"),
                     ("alloc:-5", "1..65536"), ("import:os;rm", "not a module name")):
        with pytest.raises(pdkv.InvalidArgument, match=msg):
            parse_churn(bad)
    with pytest.raises(pdkv.InvalidArgument, match="threads"):
        BusyLoad(0, threads=-1)


@pytest.mark.parametrize("argv, msg", [(["--busy-threads", "-1"], "--busy-threads must be >= 0"),
                                       (["--busy-churn", "spawn"], "--busy-churn: unknown churn kind")])
def test_cli_refuses_bad_thread_counts_and_churn(capsys, argv, msg):
    from pdkv.lab.transfer.bench import main

    with pytest.raises(SystemExit):
        main(argv + ["--payload", "1M"])
    assert msg in capsys.readouterr().err
