"""CPU seconds of whole processes over a timed section: what ``pdkv bench transfer``
turns into CPU seconds per GB moved.

A loopback transfer on a small machine saturates a core at each end, so GB/s alone
cannot tell extra work from shared cores; CPU time per byte can, whatever the core
count. Every process taking part is read (the initiator, the target, a peer library's
children), user + system time of all its threads, living and exited, right before and
right after the section.

Example
-------
>>> import os
>>> from pdkv.lab.transfer.cpu import CpuMeter
>>> meter = CpuMeter({"initiator": os.getpid()})
>>> with meter.measure() as cpu:
...     sum(range(10**6))
>>> cpu.seconds >= 0.0
True

Resolution: this process is read with ``getrusage`` (microseconds); another process
through its CPU-time clock (``clock_gettime`` of the clock id ``clock_getcpuclockid``
gives for a pid: nanoseconds, the scheduler's own sum over every thread, living and
exited), or where the kernel refuses that clock through ``/proc/<pid>/stat`` (fields
14-15, clock ticks: 10 ms at the usual ``SC_CLK_TCK`` of 100). Ticks were too coarse:
a 64 MiB round takes 10-20 ms on a fast machine, so the target's share of it was read
as 0 or 10 ms, and the hetero/homogeneous ratio of one run moved by +-25 %. Children
of a process are not counted in it (each process taking part is named on its own).
"""

from __future__ import annotations

import contextlib
import os
import resource
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

__all__ = ["CpuMeter", "CpuUsage", "process_cpu_s", "ratio"]

_CLK_TCK = os.sysconf("SC_CLK_TCK")
_GB = 1e9


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds process ``pid`` has used so far, every thread included.

    Returns ``None`` when the process is gone (no such pid, or exited and not yet
    reaped): its time over a section can no longer be known. Never raises for that.
    """
    if pid == os.getpid():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # Field 2 (comm) is in parentheses and may hold spaces or ')': split after the last one.
    rest = stat.rsplit(b")", 1)[1].split()
    if rest[0] in (b"Z", b"X"):  # field 3, state: exited (zombie) or dead
        return None
    try:
        return time.clock_gettime(_process_clock(pid))
    except OSError:  # gone since, or a kernel without the clock: the ticks read above
        pass
    utime, stime = int(rest[11]), int(rest[12])  # fields 14 and 15, in clock ticks
    return (utime + stime) / _CLK_TCK


def _process_clock(pid: int) -> int:
    """The clock id of process ``pid``'s CPU time (glibc's ``clock_getcpuclockid``:
    ``MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)``, which Python does not wrap)."""
    return ((~pid) << 3) | 2


def voluntary_switches(pid: int | None) -> dict[str, int] | None:
    """Voluntary context switches of the live threads of ``pid``, summed per thread name
    (``pdkv-tcp``, ``python``, ...): each is a block that needed a wake-up, a hand-off.
    ``None`` when it cannot be read."""
    if pid is None:
        return None
    out: dict[str, int] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for t in tids:
        try:
            with open(f"/proc/{pid}/task/{t}/status") as f:
                name, n = "?", 0
                for ln in f:
                    if ln.startswith("Name:"):
                        name = ln.split(None, 1)[1].strip()
                    elif ln.startswith("voluntary_ctxt_switches:"):
                        n = int(ln.split()[1])
                        break
        except OSError:
            continue  # the thread ended
        out[name] = out.get(name, 0) + n
    return out


@dataclass
class CpuUsage:
    """CPU seconds each named process used over a section (``None``: could not be read,
    the process being gone or not on this host). Filled when the section ends; usages of
    the same processes add up (``a + b``)."""

    by_process: dict[str, float | None] = field(default_factory=dict)

    @property
    def seconds(self) -> float | None:
        """All processes together; ``None`` if any of them could not be read."""
        if not self.by_process or any(v is None for v in self.by_process.values()):
            return None
        return sum(self.by_process.values())

    def per_gb(self, nbytes: int) -> float | None:
        """:attr:`seconds` per GB (1e9 bytes) of ``nbytes`` moved."""
        s = self.seconds
        return None if s is None or nbytes <= 0 else s / (nbytes / _GB)

    def per_gb_by_process(self, nbytes: int) -> dict[str, float | None]:
        """Each process's seconds per GB of ``nbytes`` moved."""
        return {k: None if v is None or nbytes <= 0 else v / (nbytes / _GB) for k, v in self.by_process.items()}

    def __add__(self, other: CpuUsage) -> CpuUsage:
        keys = list(dict.fromkeys([*self.by_process, *other.by_process]))
        out = {}
        for k in keys:
            a, b = self.by_process.get(k, 0.0), other.by_process.get(k, 0.0)
            out[k] = None if a is None or b is None else a + b
        return CpuUsage(out)


class CpuMeter:
    """Reads the CPU time of a set of named processes together.

    Parameters
    ----------
    pids : mapping of str to int or None
        A name for each process taking part (e.g. ``{"initiator": os.getpid(),
        "target": 1234}``). ``None`` names a process that cannot be read from here
        (a target on another host): its usage is ``None``, and so is the total.
    """

    def __init__(self, pids: Mapping[str, int | None]) -> None:
        self.pids = dict(pids)

    def read(self) -> dict[str, float | None]:
        """CPU seconds each process has used so far (``None``: gone or not readable)."""
        return {name: None if pid is None else process_cpu_s(pid) for name, pid in self.pids.items()}

    @contextlib.contextmanager
    def measure(self) -> Iterator[CpuUsage]:
        """Context manager: the :class:`CpuUsage` of the ``with`` block, filled at its end.

        A process that is gone at either end is ``None`` in the result, never an error.
        """
        usage = CpuUsage({name: None for name in self.pids})
        start = self.read()
        yield usage
        end = self.read()
        usage.by_process = {k: None if start[k] is None or end[k] is None else max(0.0, end[k] - start[k])
                            for k in self.pids}


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or ``None`` where either is unknown or ``b`` is not positive."""
    if a is None or b is None or b <= 0:
        return None
    return a / b
