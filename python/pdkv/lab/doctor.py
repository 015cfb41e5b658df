"""``pdkv doctor`` (also ``pdkv info --doctor``): what this host offers pdkv and what pdkv
will do with it, in a few lines (or ``--json`` for tools; docs/doctor.md has the schema).

GPUs come from cuda-python's driver bindings (:mod:`pdkv.device`); everything else from
the kernel (/sys, /dev/shm, rlimits) and from pdkv itself. Nothing is required: without a
driver or without cuda-python the GPU part is one "no GPU here: <reason>" line. With
``--peer HOST:PORT`` it connects to that agent (``PDKV_SECRET`` or ``--secret``) and says
which transport would carry transfers to it and why; ``--probe`` adds a short measured
read (and, with ``--probe-write``, a write of what it read back to where it read it).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

import pdkv
from pdkv import device as _device
from pdkv.errors import PdkvError

SCHEMA = 1
IPC_TIMEOUT_S = 10.0
PROBE_BYTES = 16 << 20

#: What each transport is for (the "why" of the transport lines).
PURPOSE = {
    "tcp": "any host; host memory zero-copy, device memory through pinned staging",
    "shm": "same host; host memory, one memcpy through shared pages or cross-memory attach",
    "cuda_ipc": "same node; GPU to GPU over NVLink/PCIe, one device copy",
    "nixl": "RDMA through NIXL/UCX (host and device memory)",
    "inproc": "same process (tests, colocated)",
    "loopback": "same agent (tests)",
}
#: Transports that carry device memory, and how.
DEVICE_PATH = {"tcp": "tcp (pinned staging)", "cuda_ipc": "cuda_ipc (device copy)", "nixl": "nixl (GPUDirect via UCX)"}


# ---------------------------------------------------------------- facts
def _cuda_python_version() -> str | None:
    try:
        from importlib.metadata import PackageNotFoundError, version

        for dist in ("cuda-bindings", "cuda-python"):
            try:
                return version(dist)
            except PackageNotFoundError:
                continue
    except Exception:  # noqa: BLE001 - metadata is best effort
        pass
    return None


def gpu_facts(*, ipc_check: bool = True, ipc_timeout: float = IPC_TIMEOUT_S) -> dict:
    """The ``gpu`` section: devices, peer-access matrix, driver, CUDA IPC between processes."""
    out: dict[str, Any] = {"available": False, "reason": None, "cuda_python": _cuda_python_version(),
                           "driver_library": os.environ.get("PDKV_CUDA_DRIVER") or "libcuda.so.1",
                           "driver_version": None, "devices": [], "peer_access": [],
                           "cuda_ipc": {"works": None, "detail": "not checked"}}
    try:
        out["driver_version"] = _device.driver_version()
        out["devices"] = _device.gpus()
        out["peer_access"] = _device.peer_matrix()
    except PdkvError as e:
        out["reason"] = str(e)
        return out
    if not out["devices"]:
        out["reason"] = "the CUDA driver reports no device"
        return out
    out["available"] = True
    if ipc_check:
        out["cuda_ipc"] = cuda_ipc_check(ipc_timeout)
    return out


_PATTERN = bytes(range(256)) * 16  # 4 KiB


def cuda_ipc_check(timeout: float = IPC_TIMEOUT_S) -> dict:
    """Exports 4 KiB of device 0 through ``cuIpcGetMemHandle`` and has a child process open
    and read it (bounded by ``timeout``): ``{"works": bool, "detail": str}``."""
    drv = _device.driver()
    try:
        buf = _device.DeviceBuffer(len(_PATTERN), 0)
    except PdkvError as e:
        return {"works": False, "detail": f"cannot allocate device memory: {e}"}
    try:
        buf.copy_from_host(_PATTERN)
        with buf._ctx:
            handle = _device._call("cuIpcGetMemHandle", drv.cuIpcGetMemHandle, buf.ptr)
        raw = ctypes.string_at(handle.getPtr(), 64)
        code = "import sys; from pdkv.lab.doctor import _ipc_child; sys.exit(_ipc_child(sys.argv[1]))"
        try:
            r = subprocess.run([sys.executable, "-c", code, raw.hex()], capture_output=True, text=True,
                               timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"works": False, "detail": f"the child process did not answer in {timeout:g} s"}
        last = (r.stdout.strip().splitlines() or [""])[-1]
        if r.returncode == 0 and last == "ok":
            return {"works": True, "detail": "a second process opened and read device memory this one exported"}
        why = last or (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
        return {"works": False, "detail": f"a second process could not use this one's device memory: {why} "
                                          "(containers: share the IPC namespace, e.g. docker --ipc=host)"}
    except PdkvError as e:
        return {"works": False, "detail": str(e)}
    finally:
        buf.free()


def _ipc_child(handle_hex: str) -> int:
    """The other process of :func:`cuda_ipc_check`: opens the handle, compares the bytes."""
    try:
        drv = _device.driver()
        ctx = _device._PrimaryContext(0)
        h = drv.CUipcMemHandle()
        raw = bytes.fromhex(handle_hex)
        ctypes.memmove(h.getPtr(), raw, len(raw))
        with ctx:
            ptr = _device._call("cuIpcOpenMemHandle", drv.cuIpcOpenMemHandle, h,
                                drv.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
            host = ctypes.create_string_buffer(len(_PATTERN))
            _device._call("cuMemcpyDtoH", drv.cuMemcpyDtoH, ctypes.addressof(host), ptr, len(_PATTERN))
            _device._call("cuIpcCloseMemHandle", drv.cuIpcCloseMemHandle, ptr)
        print("ok" if host.raw == _PATTERN else "the bytes read differ from those written")
        return 0
    except PdkvError as e:
        print(str(e))
        return 1


def pinned_facts() -> dict:
    """RLIMIT_MEMLOCK (``None``: unlimited)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)

    def lim(v: int) -> int | None:
        return None if v == resource.RLIM_INFINITY else int(v)

    low = soft != resource.RLIM_INFINITY and soft < (1 << 30)
    detail = ("CUDA pinned buffers (tcp staging) are not limited by it; RDMA registration (nixl/UCX) is: "
              + ("raise it (ulimit -l unlimited; docker --ulimit memlock=-1)" if low else "high enough"))
    return {"memlock_soft": lim(soft), "memlock_hard": lim(hard), "detail": detail}


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def rdma_facts(sysfs: str = "/sys/class/infiniband") -> dict:
    """RDMA devices and their ports, what UCX is told to use, whether NIXL is installed."""
    devices = []
    try:
        names = sorted(os.listdir(sysfs))
    except OSError:
        names = []
    for name in names:
        ports = []
        try:
            port_ids = sorted(os.listdir(os.path.join(sysfs, name, "ports")), key=lambda p: int(p) if p.isdigit() else 0)
        except OSError:
            port_ids = []
        for p in port_ids:
            base = os.path.join(sysfs, name, "ports", p)
            ports.append({"port": int(p) if p.isdigit() else p, "state": _read(os.path.join(base, "state")),
                          "link_layer": _read(os.path.join(base, "link_layer")), "rate": _read(os.path.join(base, "rate"))})
        devices.append({"name": name, "ports": ports})
    import importlib.util

    nixl = None
    if importlib.util.find_spec("nixl") is not None:
        try:
            from importlib.metadata import version

            nixl = version("nixl")
        except Exception:  # noqa: BLE001 - installed without metadata
            nixl = "installed"
    net, tls = os.environ.get("UCX_NET_DEVICES"), os.environ.get("UCX_TLS")
    if not devices:
        detail = "no RDMA device: UCX (nixl) would use TCP and shared memory, slower than pdkv's own tcp and shm"
    elif net:
        detail = f"UCX uses UCX_NET_DEVICES={net}"
    else:
        active = [f"{d['name']}:{p['port']}" for d in devices for p in d["ports"] if (p["state"] or "").endswith("ACTIVE")]
        detail = ("UCX_NET_DEVICES is unset: UCX picks among every device; set it to the NIC nearest each GPU, "
                  f"e.g. UCX_NET_DEVICES={active[0] if active else devices[0]['name'] + ':1'}")
    return {"devices": devices, "ucx_net_devices": net, "ucx_tls": tls, "nixl": nixl, "detail": detail}


def shm_facts(path: str = "/dev/shm") -> dict:
    """/dev/shm size and free space, memfd_create and its seals."""
    out: dict[str, Any] = {"path": path, "total_bytes": None, "free_bytes": None, "memfd": False, "seals": False}
    try:
        st = os.statvfs(path)
        out["total_bytes"], out["free_bytes"] = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    except OSError:
        pass
    try:
        import fcntl

        fd = os.memfd_create("pdkv-doctor", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        out["memfd"] = True
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
            out["seals"] = True
        except (OSError, AttributeError):
            pass
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        pass
    if not out["memfd"]:
        out["detail"] = "no memfd_create: Agent.alloc and the shm transport's shared pages are unavailable"
    elif not out["seals"]:
        out["detail"] = "memfd without seals: pdkv cannot protect shared pools from being resized by a peer"
    else:
        out["detail"] = "Agent.alloc pools are memfds (not /dev/shm files); shm sockets live in /tmp"
    return out


def tcp_facts(proc: str = "/proc/sys/net/ipv4") -> dict:
    """The kernel's TCP congestion control: the default, and those a process may pick."""
    def words(name: str) -> list[str]:
        return (_read(os.path.join(proc, name)) or "").split()

    default = (words("tcp_congestion_control") or [None])[0]
    out = {"congestion_control": default, "allowed": words("tcp_allowed_congestion_control"),
           "available": words("tcp_available_congestion_control")}
    if default == "bbr":
        alt = next((c for c in ("cubic", "reno") if c in out["allowed"]), None)
        out["detail"] = ("bbr paces at the bandwidth it estimates: loopback transfers measured ~30% slower than with "
                         "cubic or reno (docs/benchmarks.md, Congestion control); "
                         + (f"TcpOptions(congestion_control={alt!r}) sets it per agent" if alt else
                            "none of cubic or reno is allowed to this process"))
    else:
        out["detail"] = "TcpOptions(congestion_control=...) sets another per agent"
    return out


def transport_facts(gpu: dict) -> dict:
    """Available transports, the default order an agent uses, and a note on each."""
    available = pdkv.available_transports()
    from pdkv import _native

    order = list(_native.module().default_transports())
    notes = {}
    for name in sorted(set(available) | {"tcp", "shm", "cuda_ipc"}):
        if name not in available:
            if name == "cuda_ipc":
                notes[name] = "not available: " + (gpu.get("reason") or "the CUDA driver is not usable here")
            else:
                notes[name] = "not available here"
            continue
        note = PURPOSE.get(name, "")
        if name not in order:
            note += ("; " if note else "") + "not enabled by default (Agent(transports=[...]) enables it)"
        notes[name] = note
    return {"available": available, "default_order": order, "notes": notes}


def peer_facts(address: str, *, secret: str | None, probe: bool, probe_write: bool = False,
               timeout: float = 10.0) -> dict:
    """Which transport would carry transfers to the agent at ``address``, and why (and a
    measured read, with ``probe``)."""
    out: dict[str, Any] = {"address": address}
    try:
        with pdkv.Agent(f"pdkv-doctor-{os.getpid()}", secret=secret) as a:
            name = a.connect(address, timeout=timeout)
            info = a.peer_info(name)
            mine = pdkv.decode_metadata(a.metadata())
            same_host = info.get("host_id") == mine.get("host_id")
            transport = a.peer_transport(name)
            theirs = [e[0] for e in info.get("endpoints", [])]
            out.update(name=info.get("name"), same_host=same_host, endpoints=theirs, transport=transport,
                       why=(f"the first of this agent's transports ({', '.join(a.transports)}) that can reach the "
                            f"peer (it offers {', '.join(theirs) or 'none'}; "
                            f"{'same host' if same_host else 'another host'})"))
            carriers = [t for t in a.transports if t in theirs and t in DEVICE_PATH and
                        (same_host or t != "cuda_ipc")]
            if transport in DEVICE_PATH:
                out["device_memory"] = DEVICE_PATH[transport]
            elif carriers:
                out["device_memory"] = (f"{transport} cannot carry device memory: connect with "
                                        f"transport='{carriers[0]}' ({DEVICE_PATH[carriers[0]]})")
            else:
                out["device_memory"] = "no transport both sides offer carries device memory"
            out["regions"] = len(info.get("regions", []))
            out["probe"] = _probe(a, name, info, probe_write, timeout) if probe else None
    except PdkvError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def _probe(a: Any, peer: str, info: dict, write: bool, timeout: float) -> dict:
    regions = [r for r in info.get("regions", []) if r.get("remote_access")]
    if not regions:
        return {"error": "the peer exports no region to read"}
    r = max(regions, key=lambda x: x["len"])
    n = min(PROBE_BYTES, int(r["len"]))
    local = a.alloc(n)
    out: dict[str, Any] = {"bytes": n, "remote_region": r["id"], "remote_kind": r["kind"]}
    try:
        ops = ["read", "write"] if write else ["read"]
        for op in ops:
            x = a.prepare_extents(op, peer, [(local.id, 0, r["id"], 0, n)])
            x.post().wait(timeout)  # warm-up: connections, registration, staging buffers
            t0 = time.perf_counter()
            x.post().wait(timeout)
            dt = time.perf_counter() - t0
            out[op] = {"seconds": dt, "gb_per_s": n / dt / 1e9}
    except PdkvError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        local.close()
    return out


def gather(*, peer: str | None = None, secret: str | None = None, probe: bool = False, probe_write: bool = False,
           ipc_check: bool = True) -> dict:
    """Every section of ``pdkv doctor --json`` (docs/doctor.md)."""
    gpu = gpu_facts(ipc_check=ipc_check)
    return {"schema": SCHEMA, "pdkv_version": pdkv.__version__, "gpu": gpu, "pinned_memory": pinned_facts(),
            "rdma": rdma_facts(), "shm": shm_facts(), "tcp": tcp_facts(), "transports": transport_facts(gpu),
            "peer": peer_facts(peer, secret=secret, probe=probe, probe_write=probe_write) if peer else None}


# ---------------------------------------------------------------- text
def _size(n: int | None) -> str:
    if n is None:
        return "unlimited"
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << k:
            return f"{n / (1 << k):.1f} {unit}"
    return f"{n} B"


def render(r: dict) -> str:
    """The plain-text report: a few lines."""
    g, lines = r["gpu"], [f"pdkv {r['pdkv_version']} doctor"]
    cp = f"cuda-python {g['cuda_python']}" if g["cuda_python"] else "cuda-python not installed"
    if not g["available"]:
        lines.append(f"gpu: no GPU here: {g['reason']} ({cp})")
    else:
        lines.append(f"gpu: {len(g['devices'])} device(s), CUDA driver {g['driver_version']} "
                     f"({g['driver_library']}), {cp}")
        for d in g["devices"]:
            lines.append(f"  {d['index']}: {d['name']}, {_size(d['total_bytes'])}, "
                         f"compute {d['compute_capability']}, pci {d['pci_bus_id']}")
        pairs = [(i, j, c) for i, row in enumerate(g["peer_access"]) for j, c in enumerate(row) if c and i < j]
        if pairs:
            cells = [f"{i}<->{j} {'yes' if c['can_access_peer'] else 'no'}"
                     + (f" (rank {c['performance_rank']})" if c["can_access_peer"] and
                        c.get("performance_rank") is not None else "") for i, j, c in pairs]
            lines.append("  peer access: " + ", ".join(cells))
        ipc = g["cuda_ipc"]
        lines.append(f"  cuda ipc between processes: {'works' if ipc['works'] else 'no' if ipc['works'] is False else 'not checked'}"
                     + ("" if ipc["works"] else f" ({ipc['detail']})"))
    p = r["pinned_memory"]
    lines.append(f"pinned memory: RLIMIT_MEMLOCK {_size(p['memlock_soft'])} (hard {_size(p['memlock_hard'])}); "
                 f"{p['detail']}")
    rd = r["rdma"]
    devs = ", ".join(d["name"] for d in rd["devices"]) or "none"
    lines.append(f"rdma: devices {devs}; UCX_NET_DEVICES={rd['ucx_net_devices'] or 'unset'}, "
                 f"UCX_TLS={rd['ucx_tls'] or 'unset'}; nixl {rd['nixl'] or 'not installed'}; {rd['detail']}")
    s = r["shm"]
    lines.append(f"shm: {s['path']} {_size(s['free_bytes'])} free of {_size(s['total_bytes'])}; memfd "
                 f"{'with seals' if s['seals'] else 'without seals' if s['memfd'] else 'unavailable'}; {s['detail']}")
    tc = r["tcp"]
    lines.append(f"tcp: congestion control {tc['congestion_control'] or 'unknown'} (allowed: "
                 f"{' '.join(tc['allowed']) or 'unknown'}); {tc['detail']}")
    t = r["transports"]
    lines.append(f"transports: agents use {', '.join(t['default_order'])}, in this order")
    for name in t["default_order"]:
        lines.append(f"  {name}: {t['notes'][name]}")
    if "cuda_ipc" not in t["available"]:
        lines.append(f"  cuda_ipc: {t['notes']['cuda_ipc']}")
    extra = [n for n in t["available"] if n not in t["default_order"]]
    if extra:
        lines.append(f"  also available, enabled with Agent(transports=[...]): {', '.join(extra)}")
    peer = r.get("peer")
    if peer:
        if "error" in peer:
            lines.append(f"peer {peer['address']}: {peer['error']}")
        else:
            lines.append(f"peer {peer['address']} ({peer['name']!r}): {peer['transport']}, {peer['why']}; "
                         f"device memory: {peer['device_memory']}")
            pr = peer.get("probe")
            if pr:
                if "error" in pr and not any(k in pr for k in ("read", "write")):
                    lines.append(f"  probe: {pr['error']}")
                for op in ("read", "write"):
                    if op in pr:
                        lines.append(f"  probe: {op} {_size(pr['bytes'])} of {pr['remote_kind']} memory in "
                                     f"{pr[op]['seconds'] * 1e3:.2f} ms ({pr[op]['gb_per_s']:.2f} GB/s)")
                if "error" in pr and any(k in pr for k in ("read", "write")):
                    lines.append(f"  probe: {pr['error']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdkv doctor", description=(
        "What this host offers pdkv (GPUs, peer access, CUDA IPC, pinned memory, RDMA, shm) and what pdkv will "
        "do with it (transports, and for --peer which one carries transfers to that agent and why)."))
    ap.add_argument("--json", action="store_true", help="print the report as JSON (schema: docs/doctor.md)")
    ap.add_argument("--peer", metavar="HOST:PORT", help="an agent's address: which transport would carry transfers")
    ap.add_argument("--secret", help="the cluster secret for --peer (default: $PDKV_SECRET)")
    ap.add_argument("--probe", action="store_true", help="with --peer: a short measured read of the peer's largest "
                    f"exported region (at most {PROBE_BYTES >> 20} MiB)")
    ap.add_argument("--probe-write", action="store_true", help="with --probe: also write the bytes read back to "
                    "where they were read from (overwrites that range if the peer changes it meanwhile)")
    ap.add_argument("--no-ipc-check", action="store_true", help="skip the two-process CUDA IPC check")
    args = ap.parse_args(argv)
    if (args.probe or args.probe_write) and not args.peer:
        ap.error("--probe needs --peer")
    if args.peer and not (args.secret or os.environ.get("PDKV_SECRET")):
        ap.error("--peer needs the cluster secret: --secret or PDKV_SECRET")
    report = gather(peer=args.peer, secret=args.secret, probe=args.probe or args.probe_write,
                    probe_write=args.probe_write, ipc_check=not args.no_ipc_check)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


__all__ = ["gather", "render", "main", "gpu_facts", "cuda_ipc_check", "pinned_facts", "rdma_facts", "shm_facts",
           "transport_facts", "peer_facts"]
