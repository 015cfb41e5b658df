"""Busy co-runners: stand-ins for an engine that keeps every core busy.

In production pdkv shares its cores with the engine: vLLM's CPU workers bind spinning
OpenMP threads to their cores, GPU engines keep launch and scheduler threads hot, and
engine processes start (import torch, fork workers, allocate their KV cache) while
transfers run. :class:`BusyLoad` starts, for the length of a ``with`` block,

- ``n`` processes that spin (``while 1: pass``), each pinned to one of the CPUs in turn;
- ``threads`` native threads that spin inside ONE co-runner process, each bound to one
  of the CPUs in turn (OpenMP workers: one process, one thread per core; they run
  ``hashlib.sha256`` over 64 KiB, which releases the GIL, so they all run at once);
- ``churn`` drivers, each starting processes over and over (:data:`CHURN_KINDS`):
  ``import[:MODULE]`` a Python interpreter importing a heavy module, ``fork[:N]``
  bursts of N ``/bin/true`` started at once, ``alloc[:MiB]`` a process that allocates
  and touches MiB of memory and exits (an engine allocating its KV cache).

so ``pdkv bench transfer --busy N --busy-threads T --busy-churn SPEC`` measures that
regime in the same run as the raw round trip and the socket ceilings.

Example
-------
>>> with BusyLoad(0) as load:     # no co-runners: a no-op
...     load.describe()
{'processes': 0, 'cpus': []}
"""

from __future__ import annotations

import importlib.util
import os
import select
import signal
import subprocess
import sys
import tempfile
from typing import Any, Sequence

from pdkv.errors import InvalidArgument

__all__ = ["BusyLoad", "CHURN_KINDS", "parse_churn", "parse_cpus"]

_SPIN = "while 1: pass"

# One process, one spinning thread per entry of argv[1] (comma-separated CPUs), each
# bound to its CPU; prints the threads' ids once all are bound, then sleeps.
_THREADS = r"""
import hashlib, os, signal, sys, threading
cpus = [int(c) for c in sys.argv[1].split(",")]
buf = bytes(1 << 16)
tids, ready = [], threading.Semaphore(0)
def spin(cpu):
    tid = threading.get_native_id()
    os.sched_setaffinity(tid, {cpu})
    tids.append(tid)
    ready.release()
    while True:
        hashlib.sha256(buf).digest()
for c in cpus:
    threading.Thread(target=spin, args=(c,), daemon=True).start()
for _ in cpus:
    ready.acquire()
print(",".join(map(str, tids)), flush=True)
while True:
    signal.pause()
"""

# A churn driver: argv[1] kind, argv[2] its argument, argv[3] a file it rewrites with the
# number of starts so far. It leads its own process group (start_new_session), so
# whatever it started is killed with it.
_CHURN = r"""
import os, subprocess, sys
kind, arg, path = sys.argv[1], sys.argv[2], sys.argv[3]
null = subprocess.DEVNULL
starts = 0
while True:
    if kind == "import":
        subprocess.run([sys.executable, "-c", "import " + arg], stdin=null, stdout=null, stderr=null)
        starts += 1
    elif kind == "fork":
        ps = [subprocess.Popen(["/bin/true"], stdin=null, stdout=null, stderr=null) for _ in range(int(arg))]
        for p in ps:
            p.wait()
        starts += len(ps)
    else:  # alloc: allocate and touch arg MiB (bytearray zero-fills every page), then exit
        subprocess.run([sys.executable, "-c", "b = bytearray(%d << 20)" % int(arg)],
                       stdin=null, stdout=null, stderr=null)
        starts += 1
    with open(path + ".tmp", "w") as f:
        f.write(str(starts))
    os.replace(path + ".tmp", path)
"""

CHURN_KINDS = {
    "import": "a Python interpreter importing MODULE (default: torch if installed, else numpy, else asyncio)",
    "fork": "bursts of N /bin/true started at once (default 16)",
    "alloc": "a process that allocates and touches MiB of memory, then exits (default 512)",
}


def _heavy_module() -> str:
    for m in ("torch", "numpy"):
        if importlib.util.find_spec(m) is not None:
            return m
    return "asyncio"


def parse_cpus(spec: str, allowed: Sequence[int]) -> list[int]:
    """``"0,2"`` -> ``[0, 2]``, ``"all"`` -> ``allowed``; each CPU must be in ``allowed``.

    Raises
    ------
    InvalidArgument
        Not a comma-separated list of CPU numbers, or a CPU outside ``allowed``.
    """
    if spec.strip() == "all":
        return sorted(allowed)
    try:
        cpus = [int(c) for c in spec.split(",") if c.strip()]
    except ValueError:
        raise InvalidArgument(f"CPU list {spec!r}: use comma-separated CPU numbers or all") from None
    bad = [c for c in cpus if c not in allowed]
    if bad or not cpus:
        raise InvalidArgument(f"CPU list {spec!r}: {bad or 'none'} not among this process's CPUs {sorted(allowed)}")
    return cpus


def parse_churn(spec: str) -> list[tuple[str, str]]:
    """``"import:numpy,fork:8,alloc"`` -> ``[("import", "numpy"), ("fork", "8"), ("alloc", "512")]``.

    Raises
    ------
    InvalidArgument
        An unknown kind, a module name that is not a dotted identifier, or a count that
        is not a positive integer.
    """
    out = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        kind, _, arg = item.partition(":")
        if kind not in CHURN_KINDS:
            raise InvalidArgument(f"unknown churn kind {kind!r} in {spec!r} (kinds: {', '.join(CHURN_KINDS)})")
        if kind == "import":
            arg = arg or _heavy_module()
            if not all(p.isidentifier() for p in arg.split(".")):
                raise InvalidArgument(f"churn import: {arg!r} is not a module name")
        else:
            arg = arg or ("16" if kind == "fork" else "512")
            if not arg.isdigit() or int(arg) < 1 or int(arg) > (256 if kind == "fork" else 65536):
                raise InvalidArgument(f"churn {kind}: {arg!r} must be an integer in 1..{256 if kind == 'fork' else 65536}")
        out.append((kind, arg))
    return out


class BusyLoad:
    """Co-runners started on ``__enter__`` and killed on ``__exit__``: ``n`` spinning
    processes and ``threads`` spinning threads (in one process), each pinned round-robin
    to ``cpus`` (default: the CPUs this process may run on), and one churn driver per
    entry of ``churn`` (``parse_churn`` syntax, or its result), unpinned like a starting
    engine.

    Raises
    ------
    InvalidArgument
        ``n`` or ``threads`` is negative, ``cpus`` names no CPU this process may use, or
        ``churn`` does not parse.
    """

    def __init__(self, n: int, cpus: Sequence[int] | None = None, threads: int = 0,
                 churn: str | Sequence[tuple[str, str]] = ()) -> None:
        for what, v in (("co-runners", n), ("spinning co-runner threads", threads)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise InvalidArgument(f"the number of busy {what} must be an integer >= 0, got {v!r}")
        allowed = sorted(os.sched_getaffinity(0))
        chosen = allowed if cpus is None else [int(c) for c in cpus]
        bad = [c for c in chosen if c not in allowed]
        if bad or not chosen:
            raise InvalidArgument(f"busy CPUs {bad or chosen} are not among this process's CPUs {allowed}")
        self.n = n
        self.cpus = [chosen[i % len(chosen)] for i in range(n)]
        self.thread_cpus = [chosen[i % len(chosen)] for i in range(threads)]
        self.churn = parse_churn(churn) if isinstance(churn, str) else [(str(k), str(a)) for k, a in churn]
        self.procs: list[subprocess.Popen] = []
        self.thread_proc: subprocess.Popen | None = None
        self.thread_ids: list[int] = []
        self.drivers: list[subprocess.Popen] = []
        self._dir: tempfile.TemporaryDirectory | None = None
        self._starts: list[int] = [0] * len(self.churn)

    def __enter__(self) -> "BusyLoad":
        try:
            for cpu in self.cpus:
                p = subprocess.Popen([sys.executable, "-c", _SPIN], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                self.procs.append(p)
                os.sched_setaffinity(p.pid, {cpu})
            if self.thread_cpus:
                self._start_threads()
            if self.churn:
                self._dir = tempfile.TemporaryDirectory(prefix="pdkv-churn-")
                for i, (kind, arg) in enumerate(self.churn):
                    self.drivers.append(subprocess.Popen(
                        [sys.executable, "-c", _CHURN, kind, arg, self._count_path(i)],
                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                        start_new_session=True))
        except BaseException:
            self.stop()
            raise
        return self

    def _start_threads(self) -> None:
        p = subprocess.Popen([sys.executable, "-c", _THREADS, ",".join(map(str, self.thread_cpus))],
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.thread_proc = p
        ready, _, _ = select.select([p.stdout], [], [], 30.0)
        line = p.stdout.readline().decode().strip() if ready else ""
        if not line:
            raise InvalidArgument(f"the spinning-thread co-runner did not start (exit {p.poll()})")
        self.thread_ids = [int(t) for t in line.split(",")]

    def _count_path(self, i: int) -> str:
        assert self._dir is not None
        return os.path.join(self._dir.name, f"starts-{i}")

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _read_starts(self) -> None:
        for i in range(len(self.churn)):
            try:
                with open(self._count_path(i)) as f:
                    self._starts[i] = int(f.read() or 0)
            except (OSError, ValueError, AssertionError):
                pass

    def stop(self) -> None:
        """Kills every co-runner, and whatever the churn drivers started (idempotent)."""
        if self._dir is not None:
            self._read_starts()
        for d in self.drivers:  # the whole group: the driver and the process it is starting
            try:
                os.killpg(d.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for p in self.procs + ([self.thread_proc] if self.thread_proc else []):
            if p.poll() is None:
                p.kill()
        for p in self.procs + self.drivers + ([self.thread_proc] if self.thread_proc else []):
            p.wait()
        if self.thread_proc is not None and self.thread_proc.stdout:
            self.thread_proc.stdout.close()
        self.procs, self.drivers, self.thread_proc = [], [], None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def describe(self) -> dict[str, Any]:
        """What the JSON results carry: ``{"processes": n, "cpus": [cpu of each]}``, plus
        ``threads`` / ``thread_cpus`` and ``churn`` (each driver's kind, argument and the
        processes it started so far) when those co-runners are on."""
        out: dict[str, Any] = {"processes": self.n, "cpus": list(self.cpus)}
        if self.thread_cpus:
            out["threads"] = len(self.thread_cpus)
            out["thread_cpus"] = list(self.thread_cpus)
        if self.churn:
            if self._dir is not None:
                self._read_starts()
            out["churn"] = [{"kind": k, "arg": a, "starts": s} for (k, a), s in zip(self.churn, self._starts)]
        return out
