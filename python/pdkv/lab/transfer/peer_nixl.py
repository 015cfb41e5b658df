"""NIXL in a peer-library benchmark: the settings both sides read, and the target and
initiator roles its two children play (:mod:`pdkv.lab.transfer.peers` has the traps
these work around). NIXL is imported only inside the roles, that is only in a child."""

from __future__ import annotations

import base64
import os
import time
from typing import Any

import numpy as np

from pdkv.backends import _nixl as _nixl_setup
from pdkv.lab.transfer.peer_child import (
    cpu_meter,
    cpu_s,
    expect,
    latency_loop,
    timed_loop,
    touched_zeros,
    verify,
    workload_of,
)
from pdkv.lab.transfer.peer_common import Channel, Workload

__all__ = ["NIXL_PTHR_DELAY_US", "initiator", "pthr_delay_us", "target", "ucx_error_mode"]

# Upper bound of the NIXL UCX progress thread's poll() timeout (microseconds; the backend
# rounds it up to whole milliseconds). It only bounds how late the thread notices work
# whose event-fd wake-up UCX missed; normal wake-ups are immediate. 0 (NIXL's Python
# default) turns the poll into a busy loop.
NIXL_PTHR_DELAY_US = _nixl_setup.PTHR_DELAY_US

_DONE_TAG = b"pdkv-bench-done"
_TARGET_NAME = "pdkv-bench-target"
_INITIATOR_NAME = "pdkv-bench-initiator"


def pthr_delay_us(env: dict[str, str]) -> int:
    """The progress thread's pthrDelay (us) that ``env`` asks for (``PDKV_NIXL_PTHR_DELAY_US``)."""
    return int(env.get("PDKV_NIXL_PTHR_DELAY_US", NIXL_PTHR_DELAY_US))


def ucx_error_mode(env: dict[str, str]) -> str:
    """``"none"`` when ``UCX_TLS`` names only transports that cannot detect a dead peer
    (shared with the nixl transport: :func:`pdkv.backends._nixl.ucx_error_mode`)."""
    return _nixl_setup.ucx_error_mode(env.get("UCX_TLS", ""))


class _NixlBindShim:
    """Stands in for ``nixl._api.nixlBind`` while one agent is built, to set pthrDelay.

    ``nixl_agent.__init__`` builds its ``nixlAgentConfig`` and then hard-codes
    ``pthrDelay = 0`` (a busy-polling progress thread) before passing it to
    ``nixlBind.nixlAgent``; this shim sets the delay on the config at that call.
    """

    def __init__(self, real: Any, delay_us: int) -> None:
        self._real = real
        self._delay_us = delay_us
        self.applied = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def nixlAgent(self, name: str, cfg: Any) -> Any:  # noqa: N802 (NIXL's name)
        cfg.pthrDelay = self._delay_us
        self.applied = True
        return self._real.nixlAgent(name, cfg)


def _nixl_agent(name: str) -> tuple[Any, str]:
    """A NIXL agent with a UCX backend whose progress thread sleeps when idle.

    Returns the agent and how it progresses: ``"thread"`` (NIXL's progress thread,
    blocking in ``poll()`` between events), ``"thread-spinning"`` (pthrDelay 0: NIXL's
    own default), or ``"caller"`` (no progress thread: whoever waits must poll; used when
    ``PDKV_NIXL_PTHR_DELAY_US`` is negative or pthrDelay cannot be set).
    """
    # The backend wheel's _api directly: ``import nixl`` would import torch (see
    # pdkv.backends._nixl.import_bindings).
    api = _nixl_setup.import_api()
    nixl_agent, nixl_agent_config = api.nixl_agent, api.nixl_agent_config

    delay_us = pthr_delay_us(dict(os.environ))
    real = getattr(api, "nixlBind", None)
    agent = None
    progress = "caller"
    if delay_us >= 0 and real is not None:
        shim = _NixlBindShim(real, delay_us)
        api.nixlBind = shim
        try:
            # No backend in the config: UCX is created below, with its parameters.
            agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=True, backends=[]))
        finally:
            api.nixlBind = real
        if shim.applied:
            progress = "thread" if delay_us > 0 else "thread-spinning"
        else:  # NIXL changed underneath: never leave a spinning thread behind
            del agent
            agent = None
    if agent is None:
        agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.create_backend("UCX", {"ucx_error_handling_mode": ucx_error_mode(dict(os.environ))})
    return agent, progress


def _nixl_wait(agent: Any, handle: Any, state: str, deadline: float) -> None:
    while state == "PROC":
        if time.monotonic() > deadline:
            raise TimeoutError("NIXL transfer did not complete in time")
        state = agent.check_xfer_state(handle)
    if state != "DONE":
        raise RuntimeError(f"NIXL transfer failed (state {state})")


def _nixl_descs(base: int, w: Workload, blocks: np.ndarray) -> np.ndarray:
    """``[len(blocks), 3]`` uint64 rows (address, length, device 0) for NIXL."""
    d = np.zeros((len(blocks), 3), dtype=np.uint64)
    d[:, 0] = base + blocks.astype(np.uint64) * np.uint64(w.block_bytes)
    d[:, 1] = w.block_bytes
    return d


def target(chan: Channel) -> None:
    """The NIXL target: registers a zeroed pool, sends its metadata, verifies it when told."""
    msg = expect(chan, "setup")
    w = workload_of(msg)
    agent, progress = _nixl_agent(_TARGET_NAME)
    pool = touched_zeros(w.payload_bytes)
    reg = agent.register_memory([(pool.ctypes.data, pool.nbytes, 0, "")], "DRAM")
    chan.send(
        {
            "metadata": base64.b64encode(agent.get_agent_metadata()).decode(),
            "base": pool.ctypes.data,
        }
    )
    if progress == "caller":
        # Nobody else moves UCX forward in this process, and its TCP transport needs
        # the receiver to progress: poll notifications (which progresses) until told.
        while not chan.readable(0.0):
            agent.update_notifs()
    msg = expect(chan, "verify")
    deadline = time.monotonic() + 120.0
    while not agent.check_remote_xfer_done(_INITIATOR_NAME, _DONE_TAG):
        if time.monotonic() > deadline:
            raise TimeoutError("no completion notification from the initiator")
        time.sleep(0.001)
    ok, bad = verify(w, pool)
    chan.send({"verified": ok, "mismatched_blocks": bad, "cpu_s": cpu_s()})
    expect(chan, "exit")
    agent.deregister_memory(reg)


def initiator(chan: Channel) -> None:
    """The NIXL initiator: writes the workload into the target's pool, sends the timings."""
    msg = expect(chan, "run")
    w = workload_of(msg)
    tinfo = msg["target"]
    agent, progress = _nixl_agent(_INITIATOR_NAME)
    src = w.source_pool()
    reg = agent.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
    remote = agent.add_remote_agent(base64.b64decode(tinfo["metadata"]))
    deadline = time.monotonic() + w.default_timeout_s()

    all_blocks = np.arange(w.num_blocks, dtype=np.int64)
    local_side = agent.prep_xfer_dlist(
        "NIXL_INIT_AGENT", _nixl_descs(src.ctypes.data, w, all_blocks), "DRAM"
    )
    remote_side = agent.prep_xfer_dlist(
        remote, _nixl_descs(int(tinfo["base"]), w, all_blocks), "DRAM"
    )
    perm = w.permutation()
    batch = agent.make_prepped_xfer(
        "WRITE", local_side, all_blocks.astype(np.int32), remote_side, perm.astype(np.int32)
    )

    def post_batch() -> None:
        _nixl_wait(agent, batch, agent.transfer(batch), deadline)

    post_batch()  # warm-up: connection set-up and first touch stay out of the timing
    with cpu_meter(tinfo).measure() as timed_cpu:
        elapsed = timed_loop(post_batch, w.iters)

    singles: dict[int, Any] = {}

    def single(b: int) -> Any:
        if b not in singles:
            singles[b] = agent.make_prepped_xfer(
                "WRITE", local_side, [b], remote_side, [int(perm[b])]
            )
        return singles[b]

    lat_blocks = w.latency_blocks()
    for b in set(lat_blocks.tolist()):
        single(b)  # prepare outside the timed section, as for the batch
    lat = latency_loop(
        lambda b: _nixl_wait(agent, single(b), agent.transfer(single(b)), deadline), lat_blocks
    )
    # The target learns that every byte has landed from a notification that NIXL
    # delivers only after this last write's data (all earlier writes are complete).
    last = single(int(lat_blocks[-1]) if lat_blocks.size else 0)
    _nixl_wait(agent, last, agent.transfer(last, _DONE_TAG), deadline)

    chan.send(
        {
            "gbps": w.payload_bytes * w.iters / elapsed / 1e9,
            "lat_us": lat,
            "cpu_s": cpu_s(),
            "cpu_timed_s": timed_cpu.by_process,
            "progress": progress,
        }
    )
    expect(chan, "exit")
    for h in [batch, *singles.values()]:
        h.release()
    local_side.release()
    remote_side.release()
    agent.remove_remote_agent(remote)
    agent.deregister_memory(reg)
