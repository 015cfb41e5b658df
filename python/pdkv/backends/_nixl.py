"""The one place that touches NIXL's bindings, plus the UCX defaults pdkv applies.

Everything here that does not create a NIXL object is pure Python and imports no NIXL:
:func:`ucx_setup` (which UCX settings pdkv supplies, given the environment),
:func:`ucx_error_mode`, :func:`import_bindings`. :class:`NixlEngine` wraps one NIXL
agent with a UCX backend and converts every NIXL failure into a :class:`pdkv.PdkvError`.

Why the bindings and not ``nixl._api.nixl_agent``: the Python wrapper hard-codes the
progress-thread delay to 0 (a core spinning while idle), logs INFO lines to *stdout*
(which corrupts any program that speaks a protocol on stdout), hands out raw handles
with ``__del__`` finalizers and a leak list, and ``import nixl`` imports torch. The
bindings (``nixl_cuXX._bindings``) are what ``nixl_agent`` itself calls; using them
directly lets pdkv own every handle's lifetime explicitly.
"""

from __future__ import annotations

import importlib
import importlib.util
import ipaddress
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ..errors import (
    Cancelled,
    InternalError,
    InvalidArgument,
    NotFound,
    NotSupported,
    PdkvError,
    PeerConnectionError,
)

PIP = "pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1"

# NIXL UCX progress thread: poll() timeout in microseconds (rounded up to whole ms by
# NIXL). 0, nixl_agent's hard-coded value, turns the thread into a busy loop.
PTHR_DELAY_US = 10_000

# UCX transports that cannot detect a dead peer: with only these, the UCX backend must
# be created with error handling mode "none" (NIXL's default "peer" fails).
_SAME_HOST_TLS = frozenset({"shm", "posix", "sysv", "cma", "knem", "xpmem", "self", "sm"})

# Backend wheels NIXL's meta package chooses from, in its own fallback order.
_WHEELS = ("nixl_cu13", "nixl_cu12", "nixl_rocm")


def rdma_device_present() -> bool:
    """True when the host has an RDMA device (InfiniBand, RoCE, EFA)."""
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


def nvidia_gpu_present() -> bool:
    """True when the NVIDIA driver exposes at least one GPU (no CUDA call made)."""
    try:
        return bool(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return False


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is a loopback address."""
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def ucx_error_mode(tls: str) -> str:
    """UCX error handling mode for a ``UCX_TLS`` value: ``"none"`` or ``"peer"``.

    ``"none"`` when ``tls`` names only same-host transports (shm, posix, sysv, cma,
    knem, xpmem, self): they have no peer-failure detection, and under NIXL's default
    ``"peer"`` mode ``createBackend("UCX")`` fails with ``NIXL_ERR_BACKEND``. Anything
    with a network transport (or UCX's own choice) keeps ``"peer"``, so a dead peer
    fails transfers instead of hanging them.
    """
    tls = tls.strip()
    if not tls or tls.startswith("^"):
        return "peer"
    names = {t.strip().split(":")[0] for t in tls.split(",") if t.strip()}
    return "none" if names and names <= _SAME_HOST_TLS else "peer"


@dataclass(frozen=True)
class UcxSetup:
    """What pdkv supplies to UCX for one NIXL agent (see :func:`ucx_setup`).

    Attributes
    ----------
    env : dict of str to str
        Variables to add to the process environment (only ones the caller has not set).
    backend_params : dict of str to str
        Parameters of NIXL's UCX backend (per agent; they never touch the environment).
    tls : str
        The effective UCX transport list, ``""`` when UCX chooses.
    applied : list of str
        One line per default applied, for logs and ``NixlTransport.info()``.
    """

    env: dict[str, str]
    backend_params: dict[str, str]
    tls: str
    applied: list[str] = field(default_factory=list)


def ucx_setup(environ: Mapping[str, str], *, loopback: bool, rdma: bool | None = None,
              gpu: bool | None = None) -> UcxSetup:
    """The UCX settings pdkv applies for one agent, given the environment.

    A variable the caller set always wins; only missing ones get a default.

    Parameters
    ----------
    environ : mapping
        The environment (``os.environ``).
    loopback : bool
        The agent listens on a loopback address, so every peer it can meet is on this
        host: UCX is restricted to the ``lo`` device (``UCX_NET_DEVICES``). Otherwise UCX
        may use every device, as a multi-host deployment needs.
    rdma, gpu : bool, optional
        Whether the host has an RDMA device / an NVIDIA GPU (detected when None).
    """
    rdma = rdma_device_present() if rdma is None else rdma
    gpu = nvidia_gpu_present() if gpu is None else gpu
    env: dict[str, str] = {}
    params: dict[str, str] = {}
    applied: list[str] = []
    if "UCX_MODULES" not in environ and not rdma:
        # Debian's libibverbs makes UCX load its ib module; without a device it only
        # crashes at exit (SIGSEGV in teardown, every NIXL process).
        env["UCX_MODULES"] = "^ib"
        applied.append("UCX_MODULES=^ib (no RDMA device: avoids UCX's ib module crashing at exit)")
    # Per-agent UCX settings go through the backend's engine_config ("KEY=VALUE,...";
    # NIXL applies each only when UCX_<KEY> is not set). Its device_list parameter is
    # no use here: NIXL appends ":1" to each name, which only fits RDMA ports.
    ucx: dict[str, str] = {}
    if "UCX_NET_DEVICES" not in environ and loopback:
        ucx["NET_DEVICES"] = "lo"
        applied.append("UCX devices: lo (the agent listens on loopback, so every peer is on this host)")
    if "UCX_TLS" in environ:
        tls = environ["UCX_TLS"]
    elif not rdma and not gpu:
        # Left alone, UCX moves same-host bytes with cma (process_vm_writev), which
        # exists only on one host; tcp is the path peers on other hosts get too. (A
        # list such as "tcp,cuda_copy" cannot go through engine_config, which NIXL
        # splits on commas: hence nothing on GPU hosts.)
        tls = "tcp"
        ucx["TLS"] = "tcp"
        applied.append("UCX transports: tcp (no RDMA device; same-host peers are pdkv shm's job)")
    else:
        tls = ""  # RDMA (or CUDA) host: UCX picks rc/dc/cuda_ipc/... itself
    if ucx:
        params["engine_config"] = ",".join(f"{k}={v}" for k, v in ucx.items())
    mode = ucx_error_mode(tls)
    params["ucx_error_handling_mode"] = mode
    if mode == "none":
        applied.append(f"UCX error handling mode none (UCX_TLS={tls} cannot detect dead peers)")
    return UcxSetup(env=env, backend_params=params, tls=tls, applied=applied)


def nixl_installed() -> bool:
    return importlib.util.find_spec("nixl") is not None or any(
        importlib.util.find_spec(w) is not None for w in _WHEELS)


def import_bindings() -> Any:
    """NIXL's pybind11 module (``nixl_cuXX._bindings``), without importing torch.

    ``import nixl`` picks the backend wheel by CUDA major version and, when a CPU-only
    torch is installed (as for ``pdkv.serving``), finds it by importing torch: 2 s and
    a large RSS in every process that uses NIXL. With exactly one backend wheel
    installed the choice is not in doubt, so pdkv imports that wheel directly; with
    several it lets ``nixl`` decide.
    """
    if "nixl._bindings" in sys.modules:
        return sys.modules["nixl._bindings"]
    wheels = [w for w in _WHEELS if importlib.util.find_spec(w) is not None]
    try:
        if len(wheels) == 1:
            return importlib.import_module(f"{wheels[0]}._bindings")
        importlib.import_module("nixl")
        return sys.modules["nixl._bindings"]
    except ImportError as e:
        raise NotSupported(f"NIXL is not importable ({e}); install it with: {PIP}") from e


def import_api() -> Any:
    """NIXL's Python wrapper module (``nixl_cuXX._api``), found like :func:`import_bindings`."""
    b = import_bindings()
    return importlib.import_module(b.__name__.rpartition(".")[0] + "._api")


# NIXL exception class name -> (pdkv class, what it means)
_ERRORS: dict[str, tuple[type[PdkvError] | None, str]] = {
    "nixlRemoteDisconnectError": (PeerConnectionError, "the peer disconnected"),
    "nixlNotFoundError": (NotFound, "not found"),
    "nixlInvalidParamError": (InvalidArgument, "invalid parameter"),
    "nixlMismatchError": (InvalidArgument, "descriptor mismatch"),
    "nixlNotSupportedError": (NotSupported, "not supported"),
    "nixlNotAllowedError": (NotSupported, "not allowed"),
    "nixlCancelledError": (Cancelled, "cancelled"),
    "nixlBackendError": (None, "UCX backend error"),
    "nixlRepostActiveError": (InternalError, "request reposted while active"),
    "nixlNotPostedError": (InternalError, "request not posted"),
    "nixlUnknownError": (InternalError, "unknown NIXL error"),
}


def to_pdkv(exc: BaseException, what: str, backend_error: type[PdkvError] = InternalError) -> PdkvError:
    """Converts a NIXL exception into the pdkv exception for it, naming the cause.

    ``backend_error`` is the class for ``NIXL_ERR_BACKEND`` (UCX failed): a connection
    error while moving data, an internal error elsewhere.
    """
    if isinstance(exc, PdkvError):
        return exc
    cls, meaning = _ERRORS.get(type(exc).__name__, (InternalError, type(exc).__name__))
    return (cls or backend_error)(f"{what}: {exc} ({meaning})")


def _nixl_exceptions(b: Any) -> tuple[type[BaseException], ...]:
    return tuple(getattr(b, n) for n in _ERRORS if hasattr(b, n)) + (RuntimeError,)


class NixlEngine:
    """One NIXL agent with one UCX backend. Every method raises :class:`PdkvError`.

    Thread safety: the NIXL agent is created with ``NIXL_THREAD_SYNC_STRICT`` (one lock
    around every call), so methods may be called from any thread.
    """

    def __init__(self, name: str, backend_params: Mapping[str, str], *, pthr_delay_us: int) -> None:
        b = import_bindings()
        self._b = b
        self.errors = _nixl_exceptions(b)
        cfg = b.nixlAgentConfig()
        cfg.useProgThread = pthr_delay_us >= 0
        cfg.useListenThread = False
        cfg.syncMode = b.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        cfg.pthrDelay = max(0, pthr_delay_us)
        cfg.captureTelemetry = False
        try:
            self._a = b.nixlAgent(name, cfg)
            self._be = self._a.createBackend("UCX", dict(backend_params))
        except self.errors as e:
            raise to_pdkv(e, f"creating NIXL agent {name!r} with a UCX backend ({dict(backend_params)})",
                          NotSupported) from None
        self._bes = [self._be]
        self.name = name
        # NIXL handles alive (made and not yet released): tests check nothing leaks.
        self.live_reqs = 0
        self.live_dlists = 0
        self.in_prog = b.NIXL_IN_PROG
        self.success = b.NIXL_SUCCESS
        self._seg = {"host": b.DRAM_SEG, "cuda": b.VRAM_SEG}
        self._ops = {"write": b.NIXL_WRITE, "read": b.NIXL_READ}

    # -- memory -------------------------------------------------------------------
    def reg_dlist(self, kind: str, descs: Sequence[tuple[int, int, int]]) -> Any:
        """A registration list of ``(addr, nbytes, device)`` of one memory kind."""
        return self._b.nixlRegDList(self._seg[kind], [(a, n, d, "") for a, n, d in descs])

    def register(self, dlist: Any) -> None:
        try:
            self._a.registerMem(dlist, self._bes)
        except self.errors as e:
            raise to_pdkv(e, "NIXL could not register the memory", NotSupported) from None

    def deregister(self, dlist: Any) -> None:
        try:
            self._a.deregisterMem(dlist, self._bes)
        except self.errors as e:
            raise to_pdkv(e, "NIXL could not deregister the memory") from None

    # -- metadata -------------------------------------------------------------------
    def partial_md(self, dlist: Any) -> bytes:
        """Connection info plus the keys of the regions in ``dlist`` (nothing else)."""
        try:
            return bytes(self._a.getLocalPartialMD(dlist, True, self._bes))
        except self.errors as e:
            raise to_pdkv(e, "NIXL could not export its metadata") from None

    def load_md(self, md: bytes) -> str:
        """Loads a peer's metadata (connecting to it); returns its NIXL agent name."""
        try:
            name = self._a.loadRemoteMD(md)
        except self.errors as e:
            raise to_pdkv(e, "NIXL could not connect to the peer (loadRemoteMD)", PeerConnectionError) from None
        return name.decode() if isinstance(name, bytes) else str(name)

    def forget(self, nixl_name: str) -> None:
        """Drops a peer's metadata and disconnects from it (idempotent)."""
        try:
            self._a.invalidateRemoteMD(nixl_name)
        except self.errors:
            pass

    # -- transfers ------------------------------------------------------------------
    def xfer_dlist(self, agent: str | None, kind: str, descs: Any) -> int:
        """Prepared descriptor list; ``agent`` None for the local side. ``descs``:
        ``[n, 3]`` uint64 (addr, nbytes, device)."""
        b = self._b
        try:
            h = self._a.prepXferDlist(b.NIXL_INIT_AGENT if agent is None else agent,
                                      b.nixlXferDList(self._seg[kind], descs), self._bes)
        except self.errors as e:
            raise to_pdkv(e, "NIXL could not prepare the descriptors", PeerConnectionError) from None
        self.live_dlists += 1
        return h

    def release_dlist(self, h: int) -> None:
        try:
            self._a.releasedDlistH(h)
        except self.errors:
            pass
        self.live_dlists -= 1

    def make_req(self, op: str, local: int, remote: int, idx: Any) -> int:
        try:
            h = self._a.makeXferReq(self._ops[op], local, idx, remote, idx, "", self._bes)
        except self.errors as e:
            raise to_pdkv(e, "NIXL could not create the transfer request", PeerConnectionError) from None
        self.live_reqs += 1
        return h

    # post/done/notifs sit on the hot path: they raise NIXL's own exceptions (one of
    # ``self.errors``); callers convert them with :func:`to_pdkv` and their context.
    def post(self, req: int, notif: bytes) -> bool:
        """Posts ``req``; True if it already completed."""
        return self._a.postXferReq(req, notif) == self.success

    def done(self, req: int) -> bool:
        """True once ``req`` completed (its notification, if any, sent)."""
        return self._a.getXferStatus(req) == self.success

    def release_req(self, req: int) -> bool:
        """Releases ``req``, aborting it if still in flight; False if NIXL refused."""
        try:
            self._a.releaseXferReq(req)
        except self.errors:
            return False
        self.live_reqs -= 1
        return True

    # -- notifications ----------------------------------------------------------------
    def notifs(self) -> dict[str, list[bytes]]:
        """Notifications received since the last call: NIXL agent name -> messages."""
        return self._a.getNotifs({}, self._bes)

    def notify(self, nixl_name: str, msg: bytes) -> None:
        try:
            self._a.genNotif(nixl_name, msg, self._bes)
        except self.errors as e:
            raise to_pdkv(e, "NIXL could not send the notification", PeerConnectionError) from None

    def close(self) -> None:
        """Destroys the agent (its progress thread, UCX workers and registrations)."""
        self._a = None
        self._bes = []
