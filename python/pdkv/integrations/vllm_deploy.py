"""Launch vLLM instances (and the P/D proxy) as subprocesses: used by the tests and
the benchmark, and a compact record of how to run P/D vLLM on one host.

Example (prefill on core 0, decode on core 1, pdkv between them)::

    from pdkv.integrations.vllm_deploy import VllmInstance, ProxyProcess, pdkv_kv_config

    with VllmInstance(model_dir, port=8100, cpus="0", kv_config=pdkv_kv_config("kv_producer")) as p, \\
         VllmInstance(model_dir, port=8200, cpus="1", kv_config=pdkv_kv_config("kv_consumer")) as d, \\
         ProxyProcess([p.url], [d.url], port=8000) as proxy:
        ...  # POST http://127.0.0.1:8000/v1/completions

Every class stops its process (and the process group it started) on ``close()`` /
leaving the ``with`` block, so nothing outlives the caller.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = ["VllmInstance", "ProxyProcess", "pdkv_kv_config", "nixl_kv_config", "free_port", "post_json"]


#: Holds the ``sitecustomize`` that VllmInstance(fair_spin=True) loads into vLLM's processes.
FAIR_SPIN_DIR = str(Path(__file__).resolve().parent / "vllm_fair_spin")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pdkv_kv_config(role: str, *, listen: str = "127.0.0.1:0", connector: str = "PdkvConnector",
                   module: str = "pdkv.integrations.vllm", **extra: Any) -> dict[str, Any]:
    """``--kv-transfer-config`` for :class:`~pdkv.integrations.vllm.PdkvConnector`.

    ``role``: ``"kv_producer"`` (prefill), ``"kv_consumer"`` (decode) or ``"kv_both"``.
    ``extra`` goes to ``kv_connector_extra_config`` (``transports``, ``kv_lease_s``,
    ``stats_path``...).
    """
    cfg: dict[str, Any] = {"kv_connector": connector, "kv_connector_module_path": module, "kv_role": role,
                           "kv_connector_extra_config": {"listen": listen, **extra}}
    if role in ("kv_consumer", "kv_both"):
        cfg["kv_load_failure_policy"] = "recompute"
    return cfg


def nixl_kv_config(role: str, *, connector: str = "NixlConnector", module: str | None = None,
                   **extra: Any) -> dict[str, Any]:
    """``--kv-transfer-config`` for vLLM's NixlConnector on CPU (UCX over loopback)."""
    cfg: dict[str, Any] = {"kv_connector": connector, "kv_role": role, "kv_buffer_device": "cpu",
                           "kv_connector_extra_config": {"backends": ["UCX"], **extra}}
    if module:
        cfg["kv_connector_module_path"] = module
    if role == "kv_consumer":
        cfg["kv_load_failure_policy"] = "recompute"
    return cfg


def post_json(url: str, body: Mapping[str, Any], timeout: float = 300.0) -> dict[str, Any]:
    """POSTs JSON and returns the decoded answer (raises ``RuntimeError`` on HTTP errors)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url}: HTTP {e.code}: {e.read()[:2000]!r}") from None


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Proc:
    """A subprocess in its own process group, logged to a file, stopped on close."""

    proc: subprocess.Popen | None = None
    url: str = ""
    log_path: Path | None = None
    name: str = "process"

    def _spawn(self, cmd: Sequence[str], env: Mapping[str, str], log_path: Path) -> None:
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(list(cmd), env=dict(env), stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def log_tail(self, n: int = 60) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def wait_ready(self, timeout: float = 240.0) -> None:
        """Blocks until ``/health`` answers 200; raises with the log's tail otherwise."""
        deadline = time.monotonic() + timeout
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            if _healthy(self.url):
                return
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def close(self, timeout: float = 30.0) -> None:
        p, self.proc = self.proc, None
        if p is None:
            return
        if p.poll() is None:
            # The server alone: it shuts its engine processes down and frees their
            # shared memory; signalling the whole group at once leaks it.
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _group_alive(p.pid):
            time.sleep(0.2)
        try:  # whatever is left of the group (engine core, workers)
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class VllmInstance(_Proc):
    """One ``python -m vllm.entrypoints.openai.api_server`` process on 127.0.0.1.

    Parameters
    ----------
    model : path
        Model directory.
    port : int
        HTTP port (default: a free one).
    cpus : str
        ``VLLM_CPU_OMP_THREADS_BIND`` (e.g. ``"0"``; ``"all"`` leaves it to vLLM).
    kv_config : dict, optional
        ``--kv-transfer-config`` (see :func:`pdkv_kv_config`, :func:`nixl_kv_config`);
        None runs a plain (colocated) instance.
    kv_cache_gib : float
        ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB).
    python : str
        Interpreter with vLLM installed (default: this one).
    env : mapping
        Extra environment (``PDKV_SECRET`` defaults to ``"pdkv-vllm-test"``).
    args : sequence of str
        Extra server arguments.
    log_dir : path
        Where ``<name>.log`` goes.
    wait : bool
        Start and wait for ``/health`` in the constructor.
    fair_spin : bool
        Make vLLM's spin-waits call ``time.sleep(0)`` instead of ``os.sched_yield()``
        (``vllm_fair_spin/sitecustomize.py`` first on the instance's ``PYTHONPATH``):
        under the kernel's EEVDF scheduler a yielding spin-wait starves itself next to
        another busy task on its core, and instances sharing cores stalled each other
        for tens of seconds. Default True.
    """

    def __init__(self, model: str | os.PathLike, *, port: int | None = None, cpus: str = "all",
                 kv_config: Mapping[str, Any] | None = None, kv_cache_gib: int = 1,
                 python: str | None = None, env: Mapping[str, str] | None = None, args: Sequence[str] = (),
                 name: str = "vllm", log_dir: str | os.PathLike = ".", max_model_len: int = 4096,
                 enforce_eager: bool = True, prefix_caching: bool = True, wait: bool = True,
                 ready_timeout: float = 300.0, fair_spin: bool = True) -> None:
        self.name = name
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(self.port),
               "--max-model-len", str(max_model_len), "--dtype", "float32", "--disable-uvicorn-access-log"]
        if enforce_eager:
            cmd.append("--enforce-eager")
        if not prefix_caching:
            cmd.append("--no-enable-prefix-caching")
        if kv_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(dict(kv_config))]
        cmd += list(args)
        e = dict(os.environ)
        e.setdefault("PDKV_SECRET", "pdkv-vllm-test")
        e.update({"VLLM_CPU_KVCACHE_SPACE": str(int(kv_cache_gib)), "VLLM_LOGGING_LEVEL": e.get("VLLM_LOGGING_LEVEL", "INFO"),
                  "PYTHONUNBUFFERED": "1", "UCX_NET_DEVICES": "lo", "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                  "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port()), "VLLM_NO_USAGE_STATS": "1",
                  "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
        if cpus != "all":
            e["VLLM_CPU_OMP_THREADS_BIND"] = cpus
        if fair_spin:
            e["PYTHONPATH"] = os.pathsep.join(p for p in (FAIR_SPIN_DIR, e.get("PYTHONPATH", "")) if p)
        e.update(env or {})
        self.cmd = cmd
        self._spawn(cmd, e, Path(log_dir) / f"{name}.log")
        if wait:
            try:
                self.wait_ready(ready_timeout)
            except BaseException:
                self.close()
                raise

    def complete(self, prompt: Any, max_tokens: int, **body: Any) -> dict[str, Any]:
        """Greedy ``/v1/completions`` (returns the JSON answer)."""
        return post_json(self.url + "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                        "temperature": 0.0, "ignore_eos": True,
                                                        "return_token_ids": True, **body})


class ProxyProcess(_Proc):
    """``python -m pdkv.integrations.vllm_proxy`` as a subprocess."""

    def __init__(self, prefill: Sequence[str], decode: Sequence[str], *, port: int | None = None,
                 python: str | None = None, log_dir: str | os.PathLike = ".", name: str = "proxy",
                 wait: bool = True) -> None:
        self.name = name
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [python or sys.executable, "-m", "pdkv.integrations.vllm_proxy", "--prefill", *prefill,
               "--decode", *decode, "--port", str(self.port)]
        self._spawn(cmd, os.environ, Path(log_dir) / f"{name}.log")
        if wait:
            try:
                self.wait_ready(60.0)
            except BaseException:
                self.close()
                raise

    complete = VllmInstance.complete
