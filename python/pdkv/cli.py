"""The ``pdkv`` command: ``info``, ``doctor``, ``secret``, ``bench transfer``, ``bench serve``, ``plan``, ``serve``, ``demo``, ``netlab``."""

from __future__ import annotations

import argparse
import importlib
import sys

USAGE = """pdkv <command> [options]

commands:
  demo               start a proxy, a prefill and a decode worker with a small model and chat with it
  serve ROLE         run one serving process: prefill | decode | proxy | colocated
  bench transfer     transport GB/s and latency against the raw limits (and NIXL/Mooncake)
  bench serve        TTFT / ITL / goodput of each serving mode on one trace
  plan               the prefill:decode split for a trace and SLO, from measured worker capacity
  netlab             hosts in network namespaces behind emulated links: up | exec | status | down (root)
  info               version, transports available here, optional dependencies (--doctor: as doctor)
  doctor             GPUs, peer access, CUDA IPC, pinned memory, RDMA, shm, and the transport pdkv picks (--json, --peer)
  secret             print a new random cluster secret (128 bits, hex) for PDKV_SECRET

run `pdkv <command> --help` for a command's options
"""

# command -> module:function taking argv
COMMANDS = {
    ("demo",): "pdkv.serving.demo:main",
    ("serve",): "pdkv.serving.cli:main",
    ("bench", "transfer"): "pdkv.lab.transfer.bench:main",
    ("bench", "serve"): "pdkv.lab.serve.modes:main",
    ("plan",): "pdkv.lab.plan.cli:main",
    ("netlab",): "pdkv.lab.netlab.cli:main",
    ("info",): "pdkv.cli:info",
    ("doctor",): "pdkv.lab.doctor:main",
    ("secret",): "pdkv.cli:secret",
}


def info(argv: list[str]) -> int:
    """Prints what this installation can do (``--doctor``: and what this host offers it)."""
    if "--doctor" in argv:
        from .lab.doctor import main as doctor

        return doctor([a for a in argv if a != "--doctor"])
    ap = argparse.ArgumentParser(prog="pdkv info")
    ap.add_argument("--doctor", action="store_true", help="run `pdkv doctor` (takes its options too)")
    ap.parse_args(argv)
    import pdkv

    print(f"pdkv {pdkv.__version__}")
    print(f"transports available here: {', '.join(pdkv.available_transports())}")
    for mod, what in (("numpy", "tests, benchmarks"), ("torch", "serving"), ("transformers", "serving"),
                      ("aiohttp", "serving, bench serve"), ("matplotlib", "bench serve plots"),
                      ("nixl", "nixl transport, bench --compare nixl"),
                      ("cuda.bindings", "Agent.alloc(device=N), pdkv doctor's GPU facts"),
                      ("mooncake", "bench --compare mooncake")):
        try:
            m = importlib.import_module(mod)
            ver = getattr(m, "__version__", "installed")
        except Exception as e:  # noqa: BLE001 - report any import failure
            ver = f"not available ({type(e).__name__})"
        print(f"  {mod:13s} {ver}  ({what})")
    print("benchmark switches (A/B paths for benchmarks, never settings; cpp/src/util/bench_switches.h):")
    for s in pdkv._native.module().bench_switches():
        state = f"{s['value']} ({s['meaning']})" if s["value"] else f"unset ({s['default']})"
        print(f"  {s['name']}={s['values']}: {state}")
    return 0


def secret(argv: list[str]) -> int:
    """Prints a new random cluster secret (docs/security.md)."""
    argparse.ArgumentParser(prog="pdkv secret", description="Print a new random cluster secret (128 bits, "
                            "hex): export PDKV_SECRET=$(pdkv secret)").parse_args(argv)
    from .credential import new_secret

    print(new_secret())
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    for key in sorted(COMMANDS, key=len, reverse=True):
        if tuple(argv[: len(key)]) == key:
            target = COMMANDS[key]
            mod_name, fn_name = target.split(":")
            try:
                mod = importlib.import_module(mod_name)
            except ImportError as e:
                print(f"pdkv {' '.join(key)}: missing dependency: {e}\n"
                      f"install the extras, e.g. `pip install -e .[serve,bench]`", file=sys.stderr)
                return 2
            from .errors import InvalidArgument, PdkvError

            try:
                return int(getattr(mod, fn_name)(argv[len(key):]) or 0)
            except PdkvError as e:
                print(f"pdkv {' '.join(key)}: {type(e).__name__}: {e}", file=sys.stderr)
                return 2 if isinstance(e, InvalidArgument) else 1
            except KeyboardInterrupt:
                return 130
    print(f"pdkv: unknown command {' '.join(argv[:2])!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
