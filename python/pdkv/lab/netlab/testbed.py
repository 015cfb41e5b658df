"""A multi-host test bed on one machine: network namespaces behind emulated links.

A *lab* is a set of hosts ``h0 .. hN-1``, each a network namespace with one
interface ``eth0`` (address ``10.211.0.<i+1>/24``), plugged into a switch: a bridge
in a namespace of its own. Every host's access link is shaped in both directions
with ``tc`` (an ``htb`` rate limit) and delayed (by ``sch_netem`` where the kernel
has it, else by a userspace delay line in the switch namespace: :mod:`pdkv.lab.netlab.delay`),
so traffic between two hosts crosses exactly one rate limit per direction and sees the
requested round-trip time. Nothing is added to the machine's own
network namespace: traffic never leaves namespaces the lab created.

Hosts look like separate machines to pdkv, not only to the network: a command run
on a host (:meth:`Lab.popen`, ``pdkv netlab exec``) sees its own boot id (pdkv's host
id, so the shm and cuda_ipc transports are not chosen between hosts) and its own
``/dev/shm`` (shared by the processes of that host only).

A state file per lab (under ``/run/pdkv-netlab``) records what was created, and
every name carries the prefix ``pdkvnl-``, so :func:`down_all` (``pdkv netlab down``)
removes leftovers even after a crash that lost the state file. Needs root (or
CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2 (``ip``, ``tc``);
:func:`check_available` says why a lab cannot start here.

Example
-------
>>> from pdkv.lab.netlab import testbed as netlab
>>> with netlab.Lab(hosts=2, link="1gbit,rtt=0.2ms") as lab:     # doctest: +SKIP
...     server = lab.popen("h1", ["python3", "-m", "http.server", "8000"])
...     lab.run("h0", ["curl", f"http://{lab.address('h1')}:8000/"])
"""

from __future__ import annotations

import atexit
import ctypes
import itertools
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence, TypeVar

from pdkv.errors import InvalidArgument, NotSupported, PdkvError

__all__ = ["Link", "Lab", "NetlabError", "NetlabUnavailable", "parse_link", "check_available", "list_labs",
           "attach", "down", "down_all", "live_namespaces", "PREFIX", "STATE_DIR"]

#: Every namespace, /dev/shm directory and state file of a lab starts with this.
PREFIX = "pdkvnl-"
STATE_DIR = Path("/run/pdkv-netlab")
SHM_DIR = Path("/dev/shm")
SUBNET = "10.211.0"  # host i is SUBNET.(i+1); private, and only inside the lab's namespaces
MAX_HOSTS = 200

_CAP_NET_ADMIN, _CAP_SYS_ADMIN = 12, 21
T = TypeVar("T")
_NAME_RE = re.compile(r"^[a-z0-9]{1,16}$")


class NetlabUnavailable(NotSupported):
    """A lab cannot be created here: not root / missing capability, no iproute2, or
    network namespaces are not permitted. The message says which."""


class NetlabError(PdkvError):
    """A command that builds or removes a lab failed; the message has its output."""


# ---------------------------------------------------------------- link specs
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*([a-z]+)$")
MIN_RATE_BPS, MAX_RATE_BPS = 8_000, 400 * 10**9
MAX_RTT_S = 10.0


@dataclass(frozen=True)
class Link:
    """One access link's shape: ``rate_bps`` bits per second in each direction (None:
    unlimited) and the round-trip time between two hosts in seconds."""

    rate_bps: int | None = None
    rtt_s: float = 0.0

    @property
    def one_way_delay_s(self) -> float:
        """Delay on each of the 4 shaped egresses a round trip crosses (host->switch->host, and back)."""
        return self.rtt_s / 4

    def __str__(self) -> str:
        rate = "unlimited" if self.rate_bps is None else _format_rate(self.rate_bps)
        return rate + (f",rtt={self.rtt_s * 1e3:g}ms" if self.rtt_s else "")


def _format_rate(bps: int) -> str:
    for unit in ("tbit", "gbit", "mbit", "kbit"):
        if bps >= _RATE_UNITS[unit] and bps % _RATE_UNITS[unit] == 0:
            return f"{bps // _RATE_UNITS[unit]}{unit}"
    return f"{bps}bit"


def _parse_rate(text: str, spec: str) -> int | None:
    if text in ("unlimited", "none"):
        return None
    m = _RATE_RE.match(text)
    if not m or m.group(2) not in _RATE_UNITS:
        raise InvalidArgument(f"link {spec!r}: cannot parse rate {text!r} (use e.g. 100mbit, 1gbit, 10gbit, "
                              f"or unlimited; units {', '.join(_RATE_UNITS)})")
    bps = int(float(m.group(1)) * _RATE_UNITS[m.group(2)])
    if not MIN_RATE_BPS <= bps <= MAX_RATE_BPS:
        raise InvalidArgument(f"link {spec!r}: rate must lie in 8kbit..400gbit, got {text!r}")
    return bps


def _parse_duration(text: str, what: str, spec: str) -> float:
    m = _RATE_RE.match(text)
    if not m or m.group(2) not in _TIME_UNITS:
        raise InvalidArgument(f"link {spec!r}: cannot parse {what} {text!r} (use e.g. 200us, 0.2ms, 1s)")
    v = float(m.group(1)) * _TIME_UNITS[m.group(2)]
    if v > MAX_RTT_S:
        raise InvalidArgument(f"link {spec!r}: {what} must be at most {MAX_RTT_S:g} s, got {text!r}")
    return v


def parse_link(spec: str | Link) -> Link:
    """``"RATE[,rtt=DURATION]"`` -> :class:`Link`.

    RATE is a number with a unit (``bit kbit mbit gbit tbit``, decimal, per second)
    or ``unlimited``; DURATION has ``us``, ``ms`` or ``s``. Examples: ``1gbit``,
    ``10gbit,rtt=0.2ms``, ``unlimited,rtt=1ms``.

    Raises
    ------
    InvalidArgument
        A malformed spec, an unknown unit or key, a value out of range.
    """
    if isinstance(spec, Link):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise InvalidArgument(f"link spec must be a non-empty string like '1gbit,rtt=0.2ms', got {spec!r}")
    rate_text, *options = [p.strip().lower() for p in spec.split(",")]
    rate = _parse_rate(rate_text, spec)
    rtt = 0.0
    for opt in options:
        key, eq, value = opt.partition("=")
        if not eq or key != "rtt":
            raise InvalidArgument(f"link {spec!r}: unknown option {opt!r} (the only option is rtt=DURATION)")
        rtt = _parse_duration(value, "rtt", spec)
    return Link(rate, rtt)


# ---------------------------------------------------------------- capability checks
def _effective_caps() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    except (OSError, ValueError):
        pass
    return 0


def check_available() -> None:
    """Raises :class:`NetlabUnavailable` naming why no lab can be created here."""
    missing = [tool for tool in ("ip", "tc", "mount") if shutil.which(tool) is None]
    if missing:
        raise NetlabUnavailable(f"netlab needs {' and '.join(missing)} on PATH (iproute2, util-linux)")
    caps = _effective_caps()
    lacking = [name for bit, name in ((_CAP_NET_ADMIN, "CAP_NET_ADMIN"), (_CAP_SYS_ADMIN, "CAP_SYS_ADMIN"))
               if not caps >> bit & 1]
    if lacking:
        who = "not root" if os.geteuid() != 0 else "root without some capabilities"
        raise NetlabUnavailable(f"netlab needs {' and '.join(lacking)} to create network namespaces ({who}); "
                                "run as root, e.g. with sudo")


# ---------------------------------------------------------------- commands
_CLONE_NEWNET = 0x40000000


def _join_network_namespace(path: str) -> None:
    """setns(2) of the calling thread into the network namespace at ``path``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise NetlabError(f"cannot join network namespace {path}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    if check and p.returncode != 0:
        raise NetlabError(f"`{' '.join(argv)}` failed ({p.returncode}): {(p.stderr or p.stdout).strip()}")
    return p


def live_namespaces() -> list[str]:
    out = _sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _netem_available(ns: str, dev: str) -> bool:
    """Whether this kernel has sch_netem (tried on a lab interface, then removed)."""
    p = _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "9:", "netem", "delay", "1ms",
            check=False)
    if p.returncode == 0:
        _sh("tc", "-n", ns, "qdisc", "del", "dev", dev, "root", check=False)
    return p.returncode == 0


def _shape(ns: str, dev: str, link: Link, netem: bool) -> None:
    """Rate (htb) and one-way delay (netem under the htb class) on dev's egress."""
    if link.rate_bps is None and not (link.rtt_s and netem):
        return
    parent = "root"
    if link.rate_bps is not None:
        rate = f"{link.rate_bps}bit"
        # Bursts of a few ms at the rate keep veth's 64 KiB GSO packets flowing at slow
        # rates and keep the token bucket from starving at fast ones.
        burst = max(256 * 1024, link.rate_bps // 8 // 500)
        _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1")
        _sh("tc", "-n", ns, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", rate,
            "ceil", rate, "burst", str(burst), "cburst", str(burst), "quantum", "200000")
        parent = "parent 1:1"
    if link.rtt_s and netem:
        delay = f"{link.one_way_delay_s * 1e6:.0f}us"
        # netem's default 1000-packet queue would cap throughput at high rate x delay.
        _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, *parent.split(), "handle", "10:", "netem", "delay",
            delay, "limit", "100000")


# ---------------------------------------------------------------- state
def _state_path(name: str) -> Path:
    return STATE_DIR / f"{name}.json"


def list_labs() -> list[dict[str, Any]]:
    """The state of every lab with a state file (``pdkv netlab status``)."""
    labs = []
    for p in sorted(STATE_DIR.glob("*.json")) if STATE_DIR.is_dir() else []:
        try:
            labs.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            continue
    return labs


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise InvalidArgument(f"lab name must be 1-16 lowercase letters or digits, got {name!r}")
    return name


_counter = itertools.count()
#: Labs this process brought up and has not taken down: removed at exit if still there
#: (an exception escaping a test runner, sys.exit without the with block finishing).
_labs_of_this_process: dict[str, "Lab"] = {}


@atexit.register
def _down_labs_left_up() -> None:
    for lab in list(_labs_of_this_process.values()):
        lab.down()


def _unique_name() -> str:
    return f"p{os.getpid()}x{next(_counter)}{secrets.token_hex(2)}"


class Lab:
    """N hosts (network namespaces) on a switch, each behind a shaped access link.

    Parameters
    ----------
    hosts : int
        Number of hosts, 1..200, named ``h0 .. h{hosts-1}``.
    link : str or Link
        Each access link's shape, ``"RATE[,rtt=DURATION]"`` (:func:`parse_link`).
        ``rtt`` is the round trip between two hosts: ``sch_netem`` delays each shaped
        egress where the kernel has it; else a delay line (a process of this lab in its
        switch namespace, forwarding frames in native threads) holds every frame for
        rtt/4 on each host link, both ways. :attr:`info` says which (``delay``).
    name : str, optional
        Lab name (lowercase letters and digits); default: unique per process and call,
        so parallel tests never collide.

    The lab is created by :meth:`up` (or ``with``) and removed by :meth:`down`, which
    also ends every process still running in its namespaces. Not thread-safe.
    """

    def __init__(self, hosts: int = 2, link: str | Link = "unlimited", name: str | None = None) -> None:
        if not isinstance(hosts, int) or isinstance(hosts, bool) or not 1 <= hosts <= MAX_HOSTS:
            raise InvalidArgument(f"hosts must be an integer in 1..{MAX_HOSTS}, got {hosts!r}")
        self.link = parse_link(link)
        self.name = _check_name(name) if name is not None else _unique_name()
        self.hosts = [f"h{i}" for i in range(hosts)]
        self.info: dict[str, Any] = {}
        self._delay_line: subprocess.Popen | None = None  # rtt without sch_netem

    # -- names
    @property
    def switch_namespace(self) -> str:
        return f"{PREFIX}{self.name}-sw"

    def _host(self, host: str | int) -> str:
        h = f"h{host}" if isinstance(host, int) or (isinstance(host, str) and host.isdigit()) else host
        if h not in self.hosts:
            raise InvalidArgument(f"lab {self.name!r} has hosts {', '.join(self.hosts)}; got {host!r}")
        return h

    def namespace(self, host: str | int) -> str:
        """The network namespace of ``host`` (``"h1"``, ``"1"`` or ``1``)."""
        return f"{PREFIX}{self.name}-{self._host(host)}"

    def address(self, host: str | int) -> str:
        """``host``'s IPv4 address on the lab network."""
        return f"{SUBNET}.{self.hosts.index(self._host(host)) + 1}"

    def _boot_id_path(self, host: str) -> Path:
        return STATE_DIR / self.name / f"{host}.boot_id"

    def _shm_dir(self, host: str) -> Path:
        return SHM_DIR / f"{PREFIX}{self.name}-{host}"

    # -- running commands
    def prefix(self, host: str | int) -> list[str]:
        """The argv prefix that runs a command on ``host``: in its network namespace,
        with its own boot id and /dev/shm (a fresh mount namespace per command)."""
        h = self._host(host)
        script = ('mount --bind "$1" /proc/sys/kernel/random/boot_id && mount --bind "$2" /dev/shm '
                  '|| { echo "pdkv netlab: cannot give the command its host identity" >&2; exit 126; }; '
                  'shift 2; exec "$@"')
        return ["ip", "netns", "exec", self.namespace(h), "sh", "-c", script, "pdkv-netlab",
                str(self._boot_id_path(h)), str(self._shm_dir(h))]

    def popen(self, host: str | int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """``subprocess.Popen(argv)`` on ``host``; the Popen's pid is the command's own."""
        self._require_up()
        return subprocess.Popen([*self.prefix(host), *argv], **kwargs)

    def run(self, host: str | int, argv: Sequence[str], *, check: bool = True, timeout: float | None = 60,
            **kwargs: Any) -> subprocess.CompletedProcess:
        """``subprocess.run(argv)`` on ``host`` (default: check, capture text output, 60 s)."""
        self._require_up()
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        return subprocess.run([*self.prefix(host), *argv], check=check, timeout=timeout, **kwargs)

    def call_in(self, host: str | int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on a new thread of this process that joined ``host``'s
        network namespace (only its network: sockets it opens are on the lab network);
        returns its result or raises its exception. For clients (an HTTP benchmark, a
        test) that must reach lab addresses without a process of their own."""
        self._require_up()
        ns_path = f"/run/netns/{self.namespace(host)}"
        outcome: dict[str, Any] = {}

        def body() -> None:
            try:
                _join_network_namespace(ns_path)
                outcome["result"] = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                outcome["error"] = e

        t = threading.Thread(target=body, name=f"netlab-{self.name}-{host}", daemon=True)
        t.start()
        t.join()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["result"]

    def _require_up(self) -> None:
        if not self.info:
            raise InvalidArgument(f"lab {self.name!r} is not up (call up() or use it in a with block)")

    # -- lifecycle
    def up(self) -> "Lab":
        """Creates the namespaces, the switch and the shaped links; writes the state file.
        On any failure removes what it created and raises."""
        check_available()
        if self.info:
            raise InvalidArgument(f"lab {self.name!r} is already up")
        taken = any(ns.startswith(f"{PREFIX}{self.name}-") for ns in live_namespaces())
        if taken or _state_path(self.name).exists():
            raise InvalidArgument(f"a lab named {self.name!r} already exists (pdkv netlab down {self.name})")
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        (STATE_DIR / self.name).mkdir(exist_ok=True)
        self._write_state(status="creating", rtt_emulated=None)  # so down() finds a half-built lab
        try:
            netem = self._build()
        except BaseException:
            down(self.name)
            self.info = {}
            self._reap_delay_line()
            raise
        delay = None if not self.link.rtt_s else "netem" if netem else "delay line"
        self._write_state(status="up", rtt_emulated=True, delay=delay)
        _labs_of_this_process[self.name] = self
        return self

    def _build(self) -> bool:
        sw = self.switch_namespace
        try:
            _sh("ip", "netns", "add", sw)
        except NetlabError as e:  # e.g. a container without the right to mount /run/netns
            raise NetlabUnavailable(f"network namespaces are not permitted here: {e}") from None
        _sh("ip", "-n", sw, "link", "set", "lo", "up")
        _sh("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", sw, "link", "set", "br0", "up")
        netem = None
        for h in self.hosts:
            ns = self.namespace(h)
            _sh("ip", "netns", "add", ns)
            _sh("ip", "-n", sw, "link", "add", h, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _sh("ip", "-n", ns, "addr", "add", f"{self.address(h)}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            if netem is None:
                netem = bool(self.link.rtt_s) and _netem_available(ns, "eth0")
            if netem or not self.link.rtt_s:
                _sh("ip", "-n", sw, "link", "set", h, "master", "br0")
            _sh("ip", "-n", sw, "link", "set", h, "up")  # with a delay line: out of the bridge
            _shape(ns, "eth0", self.link, netem)  # host -> switch
            _shape(sw, h, self.link, netem)  # switch -> host
            self._boot_id_path(h).write_text(f"{uuid.uuid4()}\n")
            self._shm_dir(h).mkdir(mode=0o1777, exist_ok=True)
            os.chmod(self._shm_dir(h), 0o1777)
        if self.link.rtt_s and not netem:
            self._start_delay_line()
        return bool(netem)

    def _start_delay_line(self) -> None:
        """Starts the lab's delay line in the switch namespace and plugs its TAP devices
        into the bridge in place of the hosts' veth ends."""
        sw = self.switch_namespace
        # Room for a few round trips of the link's bytes in flight (netem's `limit`).
        rate = self.link.rate_bps or 100 * 10**9
        limit = int(min(256 << 20, max(8 << 20, 4 * rate / 8 * self.link.one_way_delay_s)))
        p = subprocess.Popen(["ip", "netns", "exec", sw, sys.executable, "-m", "pdkv.lab.netlab.delay",
                              "--links", ",".join(self.hosts),
                              "--one-way-delay-us", f"{self.link.one_way_delay_s * 1e6:.3f}",
                              "--queue-limit-bytes", str(limit)],
                             stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, start_new_session=True)
        assert p.stdout is not None
        ready: list[str] = []
        reader = threading.Thread(target=lambda: ready.append(p.stdout.readline()), daemon=True)
        reader.start()
        reader.join(30)
        p.stdout.close()
        line = ready[0] if ready else ""
        try:
            msg = json.loads(line) if line else {"error": "it did not start within 30 s" if p.poll() is None
                                                 else f"it exited with status {p.poll()}"}
        except json.JSONDecodeError:
            msg = {"error": f"unexpected output {line!r}"}
        self._delay_line = p
        if "taps" not in msg:
            p.kill()
            raise NetlabError(f"the lab's delay line (rtt without sch_netem) failed: {msg.get('error')}")
        for tap in msg["taps"]:
            _sh("ip", "-n", sw, "link", "set", tap, "master", "br0", "up")

    def _write_state(self, **extra: Any) -> None:
        self.info = {"name": self.name, "link": str(self.link), "rate_bps": self.link.rate_bps,
                     "rtt_s": self.link.rtt_s, "pid": os.getpid(), "created": time.time(),
                     "switch": self.switch_namespace,
                     "hosts": {h: {"namespace": self.namespace(h), "address": self.address(h)} for h in self.hosts},
                     **extra}
        tmp = _state_path(self.name).with_suffix(".tmp")
        tmp.write_text(json.dumps(self.info, indent=1))
        tmp.replace(_state_path(self.name))

    def persist(self) -> "Lab":
        """Keeps the lab up after this process exits (``pdkv netlab up``); remove it with
        :meth:`down` or ``pdkv netlab down``."""
        _labs_of_this_process.pop(self.name, None)
        return self

    def down(self) -> None:
        """Ends the processes in the lab, removes its namespaces, files and state (idempotent)."""
        if self.info:
            down(self.name)
            self.info = {}
            _labs_of_this_process.pop(self.name, None)
        self._reap_delay_line()

    def _reap_delay_line(self) -> None:
        if self._delay_line is not None:
            try:
                self._delay_line.wait(5)  # down() ended it with the lab's other processes
            except subprocess.TimeoutExpired:
                self._delay_line.kill()
                self._delay_line.wait()
            self._delay_line = None

    def __enter__(self) -> "Lab":
        return self if self.info else self.up()

    def __exit__(self, *exc: Any) -> None:
        self.down()

    def __repr__(self) -> str:
        return f"Lab({self.name!r}, hosts={len(self.hosts)}, link={str(self.link)!r}, up={bool(self.info)})"


def attach(name: str | None = None) -> Lab:
    """A :class:`Lab` for one that is already up (by name; or the only one there is)."""
    labs = {lab["name"]: lab for lab in list_labs() if lab.get("status") == "up"}
    if name is None:
        if len(labs) != 1:
            raise InvalidArgument(f"{len(labs)} labs are up ({', '.join(labs) or 'none'}); name one")
        name = next(iter(labs))
    if name not in labs:
        raise InvalidArgument(f"no lab named {name!r} is up ({', '.join(labs) or 'none are'})")
    st = labs[name]
    lab = Lab(hosts=len(st["hosts"]), link=st["link"], name=name)
    lab.info = st
    return lab


# ---------------------------------------------------------------- teardown
def _kill_processes(namespaces: Sequence[str]) -> None:
    """SIGTERM, then SIGKILL after 3 s, to every process in these namespaces."""
    def pids() -> list[int]:
        out: list[int] = []
        for ns in namespaces:
            out += [int(p) for p in _sh("ip", "netns", "pids", ns, check=False).stdout.split() if p.isdigit()]
        return [p for p in out if p != os.getpid()]

    for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 2.0)):
        live = pids()
        if not live:
            return
        for pid in live:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while pids() and time.monotonic() < deadline:
            time.sleep(0.05)


def down(name: str) -> list[str]:
    """Removes lab ``name`` (its processes, namespaces, /dev/shm directories, state);
    found by prefix, so it also cleans up after a crash. Returns the namespaces removed."""
    _check_name(name)
    namespaces = [ns for ns in live_namespaces() if ns.startswith(f"{PREFIX}{name}-")]
    return _remove(namespaces, [name])


def down_all() -> list[str]:
    """Removes every lab on this machine, with or without a state file."""
    namespaces = [ns for ns in live_namespaces() if ns.startswith(PREFIX)]
    names = {ns[len(PREFIX):].rsplit("-", 1)[0] for ns in namespaces}
    names |= {lab["name"] for lab in list_labs()}
    names |= {p.name[len(PREFIX):].rsplit("-", 1)[0] for p in SHM_DIR.glob(f"{PREFIX}*")} if SHM_DIR.is_dir() else set()
    return _remove(namespaces, sorted(n for n in names if _NAME_RE.match(n)))


def _remove(namespaces: list[str], names: list[str]) -> list[str]:
    _kill_processes(namespaces)
    # Hosts first: deleting a host namespace deletes its veth pair's switch end too.
    for ns in sorted(namespaces, key=lambda n: n.endswith("-sw")):
        _sh("ip", "netns", "del", ns, check=False)
    for name in names:
        for d in SHM_DIR.glob(f"{PREFIX}{name}-*"):
            shutil.rmtree(d, ignore_errors=True)
        shutil.rmtree(STATE_DIR / name, ignore_errors=True)
        _state_path(name).unlink(missing_ok=True)
    return namespaces
