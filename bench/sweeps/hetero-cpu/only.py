# python bench/sweeps/hetero-cpu/only.py het|hom <pdkv bench transfer --hetero args>: runs only one side's rounds
# (the other's are skipped and reported as 1 ms; their results and verification are then meaningless), for perf_split.sh.
import os, sys
which = sys.argv.pop(1)
import pdkv.lab.transfer.hetero as H
orig = H.time_round
state = {"n": 0}
def tr(preps):
    ext = sum(p.num_extents for p in preps)
    state.setdefault("first", ext)
    is_het = ext == state["first"]  # measure() warms het first
    if (which == "het") == is_het:
        return orig(preps)
    return 1e-3
H.time_round = tr
from pdkv.cli import main
sys.exit(main(["bench", "transfer", *sys.argv[1:]]))
