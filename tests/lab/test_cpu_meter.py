"""pdkv.lab.transfer.cpu: CPU seconds of whole processes over a section (what
`pdkv bench transfer` divides by the bytes moved)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from pdkv.lab.transfer.cpu import CpuMeter, CpuUsage, process_cpu_s, ratio

# A child that burns CPU seconds on request, in a thread other than its main one (so
# "every thread" is what is counted), and answers when done.
_CHILD = r"""
import sys, threading, time
def burn(s):
    t0 = time.thread_time()
    while time.thread_time() - t0 < s:
        pass
for line in sys.stdin:
    cmd, _, arg = line.partition(" ")
    if cmd == "burn":
        t = threading.Thread(target=burn, args=(float(arg),)); t.start(); t.join()
    elif cmd == "sleep":
        time.sleep(float(arg))
    print("done", flush=True)
"""


@pytest.fixture
def child():
    p = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(cmd: str) -> None:
        p.stdin.write(cmd + "\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "done"

    ask("sleep 0")  # started and importing nothing more
    yield p, ask
    p.stdin.close()
    p.wait(10)
    p.stdout.close()


def test_busy_child_is_measured(child):
    p, ask = child
    meter = CpuMeter({"child": p.pid})
    with meter.measure() as cpu:
        ask("burn 0.5")
    # At least what it burned (less one clock tick of rounding at each end); a little
    # more for reading its command and starting the thread, even on a loaded machine.
    assert 0.5 - 0.03 <= cpu.seconds <= 0.5 + 0.25, cpu
    assert cpu.by_process == {"child": cpu.seconds}
    assert cpu.per_gb(2 * 10**9) == pytest.approx(cpu.seconds / 2)


def test_sleeping_child_is_about_zero(child):
    p, ask = child
    with CpuMeter({"child": p.pid}).measure() as cpu:
        ask("sleep 0.4")
    assert 0.0 <= cpu.seconds <= 0.03, cpu


def test_this_process_counts_every_thread():
    def burn(s: float) -> None:
        t0 = time.thread_time()
        while time.thread_time() - t0 < s:
            pass

    with CpuMeter({"me": os.getpid()}).measure() as cpu:
        t = threading.Thread(target=burn, args=(0.3,))
        t.start()
        t.join()
    assert 0.3 - 0.005 <= cpu.seconds <= 0.3 + 0.2, cpu


def test_gone_processes_read_none_never_raise():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()  # reaped: no /proc entry
    assert process_cpu_s(p.pid) is None
    z = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while _state(z.pid) != "Z":  # exited, not yet reaped
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert process_cpu_s(z.pid) is None
    z.wait()
    meter = CpuMeter({"me": os.getpid(), "gone": p.pid, "remote": None})
    with meter.measure() as cpu:
        pass
    assert cpu.by_process["gone"] is None and cpu.by_process["remote"] is None
    assert cpu.by_process["me"] is not None
    assert cpu.seconds is None and cpu.per_gb(10**9) is None
    assert cpu.per_gb_by_process(10**9)["gone"] is None


def test_process_exiting_during_the_section_reads_none(child):
    p, ask = child
    with CpuMeter({"child": p.pid, "me": os.getpid()}).measure() as cpu:
        p.kill()
        p.wait()
    assert cpu.by_process["child"] is None and cpu.seconds is None


def test_usages_add_and_ratios_guard():
    a = CpuUsage({"initiator": 1.0, "target": 0.5})
    b = CpuUsage({"initiator": 0.25, "target": None})
    assert (a + a).by_process == {"initiator": 2.0, "target": 1.0}
    assert (a + b).by_process == {"initiator": 1.25, "target": None}
    assert (a + a).per_gb_by_process(3 * 10**9) == {"initiator": pytest.approx(2 / 3), "target": pytest.approx(1 / 3)}
    assert ratio(1.0, 2.0) == 0.5 and ratio(1.0, 0.0) is None and ratio(None, 1.0) is None and ratio(1.0, None) is None


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()[0].decode()


def test_voluntary_switches_count_each_block_per_thread_name():
    from pdkv.lab.transfer.cpu import voluntary_switches

    p = subprocess.Popen([sys.executable, "-c", "import sys, time\nsys.stdin.readline()\n"
                          "for _ in range(200): time.sleep(0.001)\nprint('done', flush=True)\nsys.stdin.readline()"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(0.2)
        before = voluntary_switches(p.pid)
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "done"
        after = voluntary_switches(p.pid)
        name = next(iter(before))
        assert after[name] - before[name] >= 200  # every sleep blocked once
    finally:
        p.stdin.close()
        p.wait()
        p.stdout.close()
    assert voluntary_switches(p.pid) is None and voluntary_switches(None) is None


def test_another_process_is_read_finer_than_clock_ticks(child):
    """Its CPU-time clock (nanoseconds), not /proc ticks: a 64 MiB round of a fast
    transfer takes 10-20 ms, which ticks read as 0 or 10 ms."""
    p, ask = child
    ask("burn 0.0137")
    v = process_cpu_s(p.pid)
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert v is not None and abs(v / tick - round(v / tick)) > 1e-6, v
    with CpuMeter({"child": p.pid}).measure() as cpu:
        ask("burn 0.0137")
    assert 0.0137 - 0.001 <= cpu.seconds <= 0.0137 + 0.05, cpu
