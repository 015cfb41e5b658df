"""Benchmark switches live in one registry (cpp/src/util/bench_switches.h): no other
production source reads, or even names, a PDKV_BENCH_* variable, and `pdkv info`
lists every switch with the value in force."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REGISTRY = ROOT / "cpp" / "src" / "util" / "bench_switches.h"
# Production sources: the native library, its bindings and the Python library and
# serving layers. The lab (pdkv.lab, bench/) sets switches for the
# processes it measures; that is what they are for.
PRODUCTION = [ROOT / "cpp" / "src", ROOT / "cpp" / "include", ROOT / "cpp" / "bindings", ROOT / "python" / "pdkv"]
LAB = [ROOT / "python" / "pdkv" / "lab"]
SUFFIXES = {".h", ".cc", ".cu", ".cuh", ".py"}


def _production_files():
    for top in PRODUCTION:
        for p in top.rglob("*"):
            if p.suffix in SUFFIXES and p != REGISTRY and not any(p.is_relative_to(lab) for lab in LAB):
                yield p


def test_no_production_source_names_a_bench_switch_outside_the_registry():
    offenders = []
    for p in _production_files():
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            if "PDKV_BENCH_" in line:
                offenders.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, ("PDKV_BENCH_* outside cpp/src/util/bench_switches.h (declare the switch there and "
                           "use util::bench_switch_is(BenchSwitch::k...)):\n" + "\n".join(offenders))


def test_the_registry_declares_each_switch_once_and_reads_the_environment_in_one_place():
    text = REGISTRY.read_text()
    names = re.findall(r'\{"(PDKV_BENCH_\w+)"', text)
    assert len(names) == len(set(names)) >= 10
    assert text.count("getenv(") == 1  # all read together, once


def test_pdkv_info_lists_every_switch_and_its_value():
    env = dict(os.environ, PDKV_BENCH_WAIT_YIELD="1")
    out = subprocess.run([sys.executable, "-m", "pdkv.cli", "info"], capture_output=True, text=True, env=env,
                         timeout=120, check=True).stdout
    names = re.findall(r'\{"(PDKV_BENCH_\w+)"', REGISTRY.read_text())
    for name in names:
        assert name in out
    assert re.search(r"PDKV_BENCH_WAIT_YIELD=1: 1 \(", out)
    assert re.search(r"PDKV_BENCH_FRESH_PLAN=1: unset \(", out)
