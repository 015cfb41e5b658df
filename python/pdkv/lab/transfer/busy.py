"""Busy co-runners: stand-ins for an engine that keeps every core busy.

In production pdkv shares its cores with the engine (vLLM's CPU workers bind spinning
OpenMP threads to their cores; GPU engines keep launch and scheduler threads hot).
:class:`BusyLoad` starts ``n`` processes that spin (``while 1: pass``), each pinned to
one of this process's allowed CPUs in turn, for the length of a ``with`` block, so
``pdkv bench transfer --busy N`` measures that regime in the same run as the raw round
trip and the socket ceilings.

Example
-------
>>> with BusyLoad(0) as load:     # no co-runners: a no-op
...     load.describe()
{'processes': 0, 'cpus': []}
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any, Sequence

from pdkv.errors import InvalidArgument

__all__ = ["BusyLoad"]

_SPIN = "while 1: pass"


class BusyLoad:
    """``n`` spinning processes pinned round-robin to ``cpus`` (default: the CPUs this
    process may run on), started on ``__enter__``, killed on ``__exit__``.

    Raises
    ------
    InvalidArgument
        ``n`` is negative or ``cpus`` names no CPU this process may use.
    """

    def __init__(self, n: int, cpus: Sequence[int] | None = None) -> None:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise InvalidArgument(f"the number of busy co-runners must be an integer >= 0, got {n!r}")
        allowed = sorted(os.sched_getaffinity(0))
        chosen = allowed if cpus is None else [int(c) for c in cpus]
        bad = [c for c in chosen if c not in allowed]
        if bad or not chosen:
            raise InvalidArgument(f"busy CPUs {bad or chosen} are not among this process's CPUs {allowed}")
        self.n = n
        self.cpus = [chosen[i % len(chosen)] for i in range(n)]
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "BusyLoad":
        try:
            for cpu in self.cpus:
                p = subprocess.Popen([sys.executable, "-c", _SPIN], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                self.procs.append(p)
                os.sched_setaffinity(p.pid, {cpu})
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self) -> None:
        """Kills the co-runners (idempotent)."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()
        self.procs = []

    def describe(self) -> dict[str, Any]:
        """What the JSON results carry: ``{"processes": n, "cpus": [cpu of each]}``."""
        return {"processes": self.n, "cpus": list(self.cpus)}
