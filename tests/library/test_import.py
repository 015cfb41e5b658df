"""`import pdkv` needs neither torch, transformers, numpy, CUDA (nor cuda-python) nor NIXL."""

import subprocess
import sys

HEAVY = ("torch", "transformers", "numpy", "nixl", "mooncake", "aiohttp", "matplotlib", "vllm", "cuda")


def test_import_pdkv_without_optional_dependencies():
    # Make every optional dependency unimportable, then use the core API.
    code = f"""
import sys
for m in {HEAVY!r}:
    sys.modules[m] = None
import pdkv
assert pdkv.available_transports()[:1] == ['tcp'], pdkv.available_transports()
with pdkv.Agent('a', secret='s') as a, pdkv.Agent('b', secret='s') as b:
    src = bytearray(b'x' * 4096); dst = bytearray(4096)
    rs = a.register(src); rd = b.register(dst)
    peer = a.connect(b.address)
    assert a.prepare_extents('write', peer, [(rs.id, 0, rd.id, 0, 4096)]).post().wait(5)
    assert bytes(dst) == bytes(src)
g = pdkv.KVGeometry(num_layers=2, num_blocks=4, block_tokens=4, kv_heads=1, head_dim=8)
print('ok')
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_import_pdkv_loads_nothing_heavy():
    code = f"import sys, pdkv; print([m for m in {HEAVY!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
