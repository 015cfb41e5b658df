# post().wait() latency of a 4 KiB tcp write with the waiting thread alone on core 1,
# then sharing core 1 with a busy process (wait_shared_core.sh runs it).
import os, subprocess, sys, time, statistics
import numpy as np, pdkv
os.sched_setaffinity(0, {1})
tgt = pdkv.Agent("t", secret="s", transports=["tcp"], listen="127.0.0.1:0")
ini = pdkv.Agent("i", secret="s", transports=["tcp"], listen="127.0.0.1:0")
src = np.ones(4096, np.uint8); dst = np.zeros(4096, np.uint8)
rs = ini.register(src); rd = tgt.register(dst)
peer = ini.add_peer(tgt.metadata())
prep = ini.prepare_extents("write", peer, [(rs.id, 0, rd.id, 0, 4096)])
prep.post().wait(10)
def lat(n=2000):
    out = []
    for _ in range(n):
        t0 = time.perf_counter(); prep.post().wait(10); out.append((time.perf_counter() - t0) * 1e6)
    out.sort(); return out[len(out)//2], out[int(len(out)*0.99)], out[-1]
print("alone  p50/p99/max us", [round(x, 1) for x in lat()])
hog = subprocess.Popen([sys.executable, "-c", "import os; os.sched_setaffinity(0, {1})\nwhile True: pass"])
time.sleep(0.5)
print("shared p50/p99/max us", [round(x, 1) for x in lat(500)])
hog.kill()
