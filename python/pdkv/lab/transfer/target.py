"""The target process of ``pdkv bench transfer``: spawned here (``--serve --child``) or
reached at ``--target HOST:PORT``; it exports the pool and runs the raw-socket sink."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass

from pdkv.errors import PdkvError
from pdkv.lab.transfer import hetero
from pdkv.lab.transfer.cpu import CpuMeter

__all__ = ["Target", "pin_initiator", "spawn_target", "start_target"]


@dataclass
class Target:
    address: str
    sink_host: str
    sink_port: int
    proc: subprocess.Popen | None = None

    def cpu_meter(self) -> CpuMeter:
        """Reads this process (the initiator) and the target process together; a target
        on another host (``--target``) reads ``None``."""
        return CpuMeter({"initiator": os.getpid(), "target": self.proc.pid if self.proc is not None else None})

    def close(self) -> None:
        if self.proc is not None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
            self.proc.stdout.close()


def all_cpus(args: argparse.Namespace) -> list[int]:
    """The CPUs this process had before :func:`pin_initiator` (recorded on first use)."""
    if not getattr(args, "all_cpus", None):
        args.all_cpus = sorted(os.sched_getaffinity(0))
    return args.all_cpus


def pin_initiator(args: argparse.Namespace) -> None:
    """``--pin``: this process on the first of its CPUs; :func:`spawn_target` puts the
    target on the second. The CPUs it had are kept (``args.all_cpus``): read after this
    pin, this process's affinity has one CPU, which put the target on the initiator's
    CPU until 2026-12-07."""
    cpus = all_cpus(args)
    if getattr(args, "pin_cpus", None):
        os.sched_setaffinity(0, {args.pin_cpus[0]})
    elif args.pin and len(cpus) >= 2:
        os.sched_setaffinity(0, {cpus[0]})


def start_target(args: argparse.Namespace, blocks: int) -> Target:
    """Pins this process to one core when asked (--pin), then reaches the --target the
    user started or spawns one with `blocks` blocks."""
    pin_initiator(args)
    if args.target:
        host, _, port = args.target.rpartition(":")
        return Target(args.target, host.strip("[]"), int(port) + 1)
    return spawn_target(args, blocks)


def spawn_target(args: argparse.Namespace, blocks: int) -> Target:
    cmd = [sys.executable, "-m", "pdkv.lab.transfer.bench", "--serve", "--child", "--model", args.model,
           "--blocks", str(blocks), "--rcvlowat", str(args.rcvlowat), "--batch-bytes", str(args.batch_bytes),
           "--gather-below", str(args.gather_below), "--land-below", str(args.land_below),
           "--congestion-control", args.congestion_control,
           "--listen", f"{args.host}:0", "--conns", str(args.conns), "--threads", str(args.threads),
           "--memory", args.memory] + (hetero.target_flags(args) if args.hetero else []) + \
        (["--tls-on"] if getattr(args, "tls_on", False) else []) + \
        (["--thread-cpus", ",".join(map(str, args.thread_cpus_list))] if getattr(args, "thread_cpus_list", None) else [])
    cpus = all_cpus(args)
    pin_to = ({args.pin_cpus[1]} if getattr(args, "pin_cpus", None)
              else {cpus[1]} if args.pin and len(cpus) >= 2 else None)

    def pre() -> None:  # runs in the child before exec
        if pin_to is not None:
            os.sched_setaffinity(0, pin_to)

    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=pre)
    line = proc.stdout.readline()
    if not line:
        raise PdkvError(f"benchmark target failed to start (exit code {proc.wait()})")
    info = json.loads(line)
    return Target(info["address"], info["address"].rsplit(":", 1)[0].strip("[]"), info["sink_port"], proc)
