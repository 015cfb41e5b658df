"""Shared fixtures: peer processes, agents, and automatic skips for hardware markers."""

from __future__ import annotations

import importlib.util
import json
import os
import select
import signal
import socket
import subprocess
import threading
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# Test modules import helpers from test modules of other folders (the tcp wire helpers
# of tests/library/tcp/test_bad_input.py, ...): every test folder is importable, whatever
# was collected first (one file alone, or an xdist worker). Basenames are unique.
for _dir, _subdirs, _files in sorted(os.walk(HERE)):
    _subdirs[:] = [d for d in _subdirs if d not in ("__pycache__", "fakecuda")]
    if _dir != HERE and any(f.startswith("test_") and f.endswith(".py") for f in _files):
        sys.path.append(_dir)


@pytest.fixture(scope="session")
def fakecuda_path() -> str:
    """Path of the fake CUDA driver (tests/fakecuda), built once; see tests/fakecuda_lib.py."""
    import fakecuda_lib

    try:
        return fakecuda_lib.build(os.path.join(os.path.dirname(HERE), "build", "fakecuda"))
    except fakecuda_lib.CompilerMissing as e:  # a compile error fails the tests instead
        pytest.skip(str(e))


class _NoTorchUnderSanitizer:
    """scripts/sanitize.sh sets PDKV_SANITIZER: torch's import then fails, so tests that
    ``pytest.importorskip("torch")`` skip with this reason instead of reporting torch's
    own one-time allocations (and its uninstrumented threads) as pdkv's."""

    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"torch is not loaded under the {os.environ['PDKV_SANITIZER']} sanitizer run "
                              "(its one-time allocations are not pdkv's); the test runs in `make test`")
        return None


if os.environ.get("PDKV_SANITIZER"):
    sys.meta_path.insert(0, _NoTorchUnderSanitizer())

# NIXL/UCX in tests (this process and the peer processes it spawns): loopback only.
os.environ.setdefault("UCX_NET_DEVICES", "lo")

SECRET = "test-secret"


def _has_cuda() -> bool:
    try:
        import ctypes

        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def pytest_collection_modifyitems(config, items):
    skip_cuda = None if _has_cuda() else pytest.mark.skip(reason="needs an NVIDIA GPU and driver (libcuda.so.1)")
    skip_nixl = None if importlib.util.find_spec("nixl") else pytest.mark.skip(
        reason="needs NIXL: pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1")
    if os.environ.get("PDKV_SANITIZER") == "tsan":  # set by scripts/sanitize.sh
        skip_nixl = pytest.mark.skip(reason="NIXL/UCX is not instrumented and replaces memory hooks: "
                                            "it crashes under ThreadSanitizer (it runs in `make test`)")
    for item in items:
        # The marker, not the keyword: item.keywords also holds the enclosing directories'
        # names, so every test under tests/library/cuda/ (the fake-GPU ones too) would match.
        if skip_cuda and item.get_closest_marker("cuda"):
            item.add_marker(skip_cuda)
        if skip_nixl and "nixl" in item.keywords:
            item.add_marker(skip_nixl)


class JsonLineProc:
    """A child process answering one JSON line per JSON-line request on stdin; its
    first line (the hello) is kept in ``self.hello``."""

    def __init__(self, cmd: list[str], name: str, env: dict | None = None) -> None:
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=env)
        self.name = name
        self.hello = self._read(60)
        self.address = self.hello["address"]
        self.pid = self.hello["pid"]

    def _read(self, timeout: float) -> dict:
        r, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not r:
            raise TimeoutError(f"peer process {self.name!r} did not answer")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer process {self.name!r} exited with {self.proc.wait()}")
        return json.loads(line)

    def send(self, **req) -> None:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()

    def recv(self, timeout: float = 60) -> dict:
        return self._read(timeout)

    def call(self, timeout: float = 60, **req) -> dict:
        self.send(**req)
        return self._read(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def pause(self) -> None:
        """SIGSTOP, then waits until every thread of the peer is really stopped (a signal
        is delivered asynchronously: a busy thread could still answer one more frame)."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        assert wait_until(lambda: threads_stopped(self.proc.pid), timeout=10.0), "the peer did not stop"

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> int:
        """Ends the process cleanly; returns its exit status (negative: killed by a signal)."""
        if self.proc.poll() is None:
            try:
                self.resume()
                self.send(cmd="exit")
                self.proc.wait(timeout=20)
            except (BrokenPipeError, subprocess.TimeoutExpired, OSError):
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        return self.proc.returncode


class PeerProc(JsonLineProc):
    """A pdkv agent in another process (tests/peer_proc.py), driven by JSON lines."""

    def __init__(self, name: str, spec, seed: int | None, *, secret: str = SECRET, listen: str = "127.0.0.1:0",
                 tcp: dict | None = None, prefix: list[str] | None = None, transports=("tcp",),
                 shared: bool = False) -> None:
        cmd = (prefix or []) + [sys.executable, os.path.join(HERE, "peer_proc.py"), "--name", name, "--secret", secret,
                                "--spec", json.dumps(spec.to_dict()), "--listen", listen, "--tcp", json.dumps(tcp or {}),
                                "--transports", ",".join(transports)]
        if shared:
            cmd.append("--shared")
        if seed is not None:
            cmd += ["--seed", str(seed)]
        super().__init__(cmd, name)


@pytest.fixture
def spawn_peer():
    procs: list[PeerProc] = []

    def start(name, spec, seed=None, **kw) -> PeerProc:
        p = PeerProc(name, spec, seed, **kw)
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.stop()


class Flavor:
    """One way of moving bytes that every transport test runs under.

    tcp:      the tcp transport, plain numpy pools;
    shm:      the shm transport, pools pdkv allocated (memfd, mapped by the peer);
    shm-cma:  the shm transport, plain numpy pools (cross-memory attach).
    nixl:     the nixl transport (NIXL, UCX's defaults as pdkv sets them: tcp here),
              plain numpy pools; only when NIXL is installed.
    """

    TABLE = {"tcp": (["tcp"], False), "shm": (["shm", "tcp"], True), "shm-cma": (["shm", "tcp"], False),
             "nixl": (["nixl", "tcp"], False)}

    def __init__(self, name: str) -> None:
        self.name = name
        self.transports, self.shared = self.TABLE[name]
        self.transport = self.transports[0]

    def agent(self, name: str, **kw):
        import pdkv

        kw.setdefault("secret", SECRET)
        a = pdkv.Agent(name, transports=self.transports, **kw)
        a.test_shared_pools = self.shared
        return a

    def peer_args(self) -> dict:
        return {"transports": self.transports, "shared": self.shared}

    def skip_if(self, *names: str, reason: str) -> None:
        """Skips the running test under the named flavors, saying why."""
        if self.name in names:
            pytest.skip(f"{self.name}: {reason}")

    def __repr__(self) -> str:
        return self.name


def _flavors() -> list[str]:
    import pdkv

    avail = pdkv.available_transports()
    return [f for f, (ts, _) in Flavor.TABLE.items() if ts[0] in avail]


@pytest.fixture(params=[pytest.param(f, marks=pytest.mark.nixl) if f == "nixl" else f for f in _flavors()])
def flavor(request) -> Flavor:
    return Flavor(request.param)


@pytest.fixture
def agent_pair(flavor):
    """Two agents in this process using ``flavor``'s transport: (initiator, target)."""
    a = flavor.agent("initiator")
    b = flavor.agent("target")
    yield a, b
    a.close()
    b.close()


def make_pool(spec, seed, agent):
    """A test pool for ``agent``: in shareable memory when its flavor says so."""
    from kvpools import Pool

    return Pool(spec, seed, shared_by=agent if getattr(agent, "test_shared_pools", False) else None)


def freeze(pid: int) -> None:
    """SIGSTOP `pid` and wait until every thread of it has really stopped (the signal
    is delivered asynchronously: a test that posts right after os.kill can race a peer
    that still runs for a moment and finishes the transfer)."""
    os.kill(pid, signal.SIGSTOP)
    assert wait_until(lambda: threads_stopped(pid), timeout=10.0), f"process {pid} did not stop"


def threads_stopped(pid: int) -> bool:
    """True once every thread of process ``pid`` is in the stopped state."""
    task_dir = f"/proc/{pid}/task"
    for tid in os.listdir(task_dir):
        try:
            with open(f"{task_dir}/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        if state not in ("T", "t"):
            return False
    return True


def listen_like(real_addr: str) -> tuple[socket.socket, str]:
    """A listening socket on 127.0.0.1 whose "host:port" has the length of
    `real_addr`'s, so an agent's metadata blob with one put for the other keeps its
    lengths (a fake or relaying peer posing as the real one)."""
    for _ in range(50):
        ls = socket.socket()
        ls.bind(("127.0.0.1", 0))
        addr = "127.0.0.1:%d" % ls.getsockname()[1]
        if len(addr) == len(real_addr):
            ls.listen(16)
            return ls, addr
        ls.close()
    raise AssertionError(f"no free port gives an address as long as {real_addr!r}")


class Relay:
    """Forwards every connection made to listening socket `ls` (TCP or Unix) to
    `target_addr`, recording the bytes each way (`up`: initiator -> target, `down`), and
    handing each chunk to `observe` before passing it on."""

    def __init__(self, ls: socket.socket, target_addr):
        self.family, self.target_addr = ls.family, target_addr
        self.ls = ls
        self.ls.settimeout(0.2)
        self.up: list[bytes] = []
        self.down: list[bytes] = []
        self.stop = False
        self.socks: list[socket.socket] = []
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def observe(self, chunk: bytes, upstream: bool, conn: socket.socket) -> None:
        """Called on each chunk of connection `conn` (its sending end) before it is
        forwarded (override to parse)."""

    def wire(self) -> bytes:
        return b"".join(self.up) + b"".join(self.down)

    def _accept(self):
        while not self.stop:
            try:
                c, _ = self.ls.accept()
            except OSError:
                continue
            t = socket.socket(self.family, socket.SOCK_STREAM)
            self.socks += [c, t]
            t.connect(self.target_addr)
            for src, dst, up in ((c, t, True), (t, c, False)):
                th = threading.Thread(target=self._pump, args=(src, dst, up), daemon=True)
                th.start()
                self.threads.append(th)

    def _pump(self, src, dst, upstream):
        log = self.up if upstream else self.down
        try:
            while True:
                b = src.recv(1 << 20)
                if not b:
                    break
                log.append(b)
                self.observe(b, upstream, src)
                dst.sendall(b)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self.stop = True
        self.threads[0].join(5)
        for s in self.socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for th in self.threads[1:]:
            th.join(5)
        for s in self.socks:
            s.close()
        if self.family == socket.AF_UNIX:
            os.unlink(self.ls.getsockname())
        self.ls.close()


def post_past_deadline(prep, n: int) -> tuple[list, float]:
    """``n`` posts of ``prep`` queued behind each other with a deadline 3x the fastest of
    three copies timed here, so the 4th and later cannot finish in time on a machine of
    any speed (a fixed 20 ms let 12 x 64 MiB finish on a fast one); returns the
    transfers and the timeout used. The regions must be confirmed already."""
    import time

    took = []
    for _ in range(3):
        t0 = time.perf_counter()
        assert prep.post(timeout=60).wait(60)
        took.append(time.perf_counter() - t0)
    timeout = 3 * min(took)
    return [prep.post(timeout=timeout) for _ in range(n)], timeout


def wait_until(pred, timeout: float = 10.0, interval: float = 0.01) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(interval)
    return pred()


@pytest.fixture
def etcd():
    """A fresh etcd on a free 127.0.0.1 port, stopped afterwards (tests that use it skip
    without the binary: Debian's etcd-server, which scripts/sysdeps.sh installs)."""
    from pdkv.discovery_etcd import EtcdServer, etcd_binary

    if etcd_binary() is None:
        pytest.skip("no etcd binary (apt-get install etcd-server, or set PDKV_ETCD)")
    server = EtcdServer()
    server.start()
    yield server
    server.close()
