"""pdkv.lab.netlab.testbed: hosts in network namespaces behind shaped links (a test bed on one machine).

Tests that build labs need root (or CAP_NET_ADMIN + CAP_SYS_ADMIN) and iproute2; they
skip with the reason elsewhere. Every lab has a unique name, so they run in parallel
with other tests and other labs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvpools import Pool, PoolSpec
from pdkv.lab.netlab import testbed as netlab
from pdkv.errors import InvalidArgument, NotSupported
from pdkv.lab.netlab.probe import measure_rate

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "python"), os.environ.get("PYTHONPATH", "")])}


def lab_up(hosts: int = 2, link: str = "unlimited", **kw) -> netlab.Lab:
    """An up lab, or a skip that says why namespaces cannot be made here."""
    try:
        return netlab.Lab(hosts=hosts, link=link, **kw).up()
    except netlab.NetlabUnavailable as e:
        pytest.skip(str(e))


@pytest.fixture
def lab3():
    lab = lab_up(3, "1gbit")
    yield lab
    lab.down()


def live_namespaces() -> set[str]:
    return set(netlab.live_namespaces())


# ---------------------------------------------------------------- link specs (no root needed)
@pytest.mark.parametrize("spec,rate,rtt", [
    ("1gbit", 10**9, 0.0),
    ("10gbit,rtt=0.2ms", 10**10, 0.0002),
    ("100Mbit, RTT=500us", 10**8, 0.0005),
    ("2.5gbit,rtt=1s", 25 * 10**8, 1.0),
    ("unlimited,rtt=1ms", None, 0.001),
])
def test_parse_link(spec, rate, rtt):
    link = netlab.parse_link(spec)
    assert link.rate_bps == rate
    assert link.rtt_s == pytest.approx(rtt)
    assert netlab.parse_link(str(link)) == link
    assert link.one_way_delay_s == pytest.approx(rtt / 4)


@pytest.mark.parametrize("spec,says", [
    ("1gbti", "cannot parse rate '1gbti'"),
    ("", "non-empty"),
    ("fast", "cannot parse rate"),
    ("1gbps", "cannot parse rate"),
    ("0gbit", "must lie in"),
    ("1000tbit", "must lie in"),
    ("-1gbit", "cannot parse rate"),
    ("1gbit,rtt=", "cannot parse rtt"),
    ("1gbit,rtt=2", "cannot parse rtt"),
    ("1gbit,rtt=20s", "at most"),
    ("1gbit,delay=1ms", "unknown option 'delay=1ms'"),
    ("1gbit,1ms", "unknown option"),
])
def test_bad_link_spec_is_a_named_error(spec, says):
    with pytest.raises(InvalidArgument, match=says.replace("(", r"\(")):
        netlab.parse_link(spec)


@pytest.mark.parametrize("kw,says", [
    ({"hosts": 0}, "hosts must be"), ({"hosts": 201}, "hosts must be"), ({"hosts": "3"}, "hosts must be"),
    ({"name": "Bad-Name"}, "lab name"), ({"name": ""}, "lab name"), ({"link": "1gbti"}, "1gbti"),
])
def test_bad_lab_arguments(kw, says):
    with pytest.raises(InvalidArgument, match=says):
        netlab.Lab(**kw)


def test_not_up_lab_refuses_commands():
    lab = netlab.Lab(hosts=2)
    with pytest.raises(InvalidArgument, match="not up"):
        lab.run("h0", ["true"])
    with pytest.raises(InvalidArgument, match="has hosts h0, h1"):
        lab.address("h7")


def test_cli_bad_link_exit_code():
    p = subprocess.run([sys.executable, "-m", "pdkv.cli", "netlab", "up", "--link", "1gbti"], capture_output=True,
                       text=True, env=ENV, timeout=60)
    assert p.returncode == 2
    assert "InvalidArgument: link '1gbti': cannot parse rate" in p.stderr


# ---------------------------------------------------------------- where labs cannot be made
def test_without_capabilities_is_netlab_unavailable():
    """Root without CAP_NET_ADMIN/CAP_SYS_ADMIN (dropped from the bounding set): a named error."""
    if os.geteuid() != 0 or not os.path.exists("/usr/bin/setpriv"):
        pytest.skip("needs root and setpriv to drop capabilities")
    code = "from pdkv.lab.netlab import testbed as netlab\ntry:\n    netlab.Lab(2).up()\nexcept netlab.NetlabUnavailable as e:\n" \
           "    print('unavailable:', e)\n"
    p = subprocess.run(["setpriv", "--bounding-set", "-net_admin,-sys_admin", "--inh-caps", "-all",
                        sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=60)
    assert "unavailable: netlab needs CAP_NET_ADMIN and CAP_SYS_ADMIN" in p.stdout, p.stderr
    assert issubclass(netlab.NetlabUnavailable, NotSupported)


def test_tests_skip_with_the_reason_where_labs_cannot_be_made():
    """The lab tests themselves, run without the capabilities, skip and say why."""
    if os.geteuid() != 0 or not os.path.exists("/usr/bin/setpriv"):
        pytest.skip("needs root and setpriv to drop capabilities")
    p = subprocess.run(["setpriv", "--bounding-set", "-net_admin,-sys_admin", "--inh-caps", "-all", sys.executable,
                        "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(REPO / "tests" / "lab" / "test_netns.py")],
                       capture_output=True, text=True, env=ENV, timeout=300, cwd=REPO)
    assert p.returncode == 0, p.stdout[-2000:]
    assert "3 skipped" in p.stdout and "netlab needs CAP_NET_ADMIN and CAP_SYS_ADMIN" in p.stdout, p.stdout[-2000:]


def test_exec_without_a_lab_names_the_problem():
    p = subprocess.run([sys.executable, "-m", "pdkv.cli", "netlab", "exec", "--lab", "nosuchlab", "h0", "--", "true"],
                       capture_output=True, text=True, env=ENV, timeout=60)
    assert p.returncode == 2
    assert "InvalidArgument: no lab named 'nosuchlab' is up" in p.stderr


def test_without_iproute2_is_netlab_unavailable(tmp_path):
    p = subprocess.run([sys.executable, "-m", "pdkv.cli", "netlab", "up"], capture_output=True, text=True,
                       env={**ENV, "PATH": str(tmp_path)}, timeout=60)
    assert p.returncode == 1
    assert "NetlabUnavailable: netlab needs ip and tc and mount on PATH" in p.stderr


# ---------------------------------------------------------------- lifecycle
pytestmark_netns = pytest.mark.netns


@pytestmark_netns
def test_up_exec_down(lab3):
    lab = lab3
    names = [lab.namespace(h) for h in lab.hosts] + [lab.switch_namespace]
    assert set(names) <= live_namespaces()
    assert [lab.address(h) for h in lab.hosts] == ["10.211.0.1", "10.211.0.2", "10.211.0.3"]
    assert lab.address(2) == lab.address("2") == "10.211.0.3"
    addr = lab.run("h2", ["ip", "-4", "-o", "addr", "show", "dev", "eth0"]).stdout
    assert "10.211.0.3/24" in addr
    # Nothing routes out of the lab: only the lab subnet, no default route.
    routes = lab.run("h0", ["ip", "-4", "route"]).stdout
    assert "default" not in routes and "10.211.0.0/24" in routes
    state = json.loads((netlab.STATE_DIR / f"{lab.name}.json").read_text())
    assert state["status"] == "up" and state["hosts"]["h1"]["address"] == "10.211.0.2"
    assert state["rate_bps"] == 10**9
    lab.down()
    assert not set(names) & live_namespaces()
    assert not (netlab.STATE_DIR / f"{lab.name}.json").exists()
    assert not list(netlab.SHM_DIR.glob(f"{netlab.PREFIX}{lab.name}-*"))
    lab.down()  # idempotent


@pytestmark_netns
def test_hosts_look_like_separate_machines(lab3):
    """Own boot id (pdkv's host id) and /dev/shm per host; shared by the processes of one host."""
    lab = lab3
    boot = {h: lab.run(h, ["cat", "/proc/sys/kernel/random/boot_id"]).stdout for h in lab.hosts}
    assert len(set(boot.values())) == 3
    assert Path("/proc/sys/kernel/random/boot_id").read_text() not in boot.values()
    assert lab.run("h0", ["cat", "/proc/sys/kernel/random/boot_id"]).stdout == boot["h0"]
    lab.run("h1", ["sh", "-c", "echo one > /dev/shm/pdkv-netlab-test"])
    assert lab.run("h1", ["cat", "/dev/shm/pdkv-netlab-test"]).stdout == "one\n"
    assert lab.run("h2", ["cat", "/dev/shm/pdkv-netlab-test"], check=False).returncode != 0
    assert not os.path.exists("/dev/shm/pdkv-netlab-test")


@pytestmark_netns
def test_hosts_reach_each_other_over_tcp(lab3):
    server = lab3.popen("h2", [sys.executable, "-c", textwrap.dedent("""
        import socket, sys
        s = socket.create_server(("10.211.0.3", 9000)); print("ready", flush=True)
        c, peer = s.accept(); c.sendall(peer[0].encode()); c.close()
        """)], stdout=subprocess.PIPE, text=True, env=ENV)
    assert server.stdout.readline() == "ready\n"
    got = lab3.run("h0", [sys.executable, "-c", "import socket; s = socket.create_connection(('10.211.0.3', 9000), "
                          "timeout=10); print(s.recv(100).decode())"], env=ENV).stdout
    assert got.strip() == "10.211.0.1"
    assert server.wait(timeout=10) == 0
    server.stdout.close()


@pytestmark_netns
def test_cleanup_after_an_exception_ends_processes():
    with pytest.raises(RuntimeError, match="boom"):
        with lab_up(2) as lab:
            sleeper = lab.popen("h1", ["sleep", "300"])
            names = [lab.namespace(h) for h in lab.hosts] + [lab.switch_namespace]
            raise RuntimeError("boom")
    assert sleeper.wait(timeout=10) is not None
    assert not set(names) & live_namespaces()


@pytestmark_netns
def test_a_failure_while_building_removes_what_was_made(monkeypatch):
    probe = lab_up(1)
    probe.down()
    made = []

    def shape_then_fail(ns, dev, link, netem):
        made.append(ns)
        if len(made) == 3:
            raise netlab.NetlabError("tc failed (simulated)")

    monkeypatch.setattr(netlab, "_shape", shape_then_fail)
    lab = netlab.Lab(hosts=3, link="1gbit")
    with pytest.raises(netlab.NetlabError, match="simulated"):
        lab.up()
    assert lab.info == {}
    assert not any(ns.startswith(f"{netlab.PREFIX}{lab.name}-") for ns in live_namespaces())
    assert not (netlab.STATE_DIR / f"{lab.name}.json").exists()


@pytestmark_netns
def test_a_lab_left_up_is_removed_when_its_process_exits():
    probe = lab_up(1)
    probe.down()
    name = f"exit{os.getpid() % 100000}"
    code = f"import sys\nfrom pdkv.lab.netlab import testbed as netlab\nnetlab.Lab(hosts=2, name={name!r}).up()\nsys.exit(3)\n"
    p = subprocess.run([sys.executable, "-c", code], env=ENV, timeout=60)
    assert p.returncode == 3
    assert not any(ns.startswith(f"{netlab.PREFIX}{name}-") for ns in live_namespaces())
    assert not (netlab.STATE_DIR / f"{name}.json").exists()


@pytestmark_netns
def test_down_finds_leftovers_of_a_crashed_lab(tmp_path):
    probe = lab_up(1)  # skips where labs cannot be made
    probe.down()
    name = f"crash{os.getpid() % 100000}"
    code = f"import os\nfrom pdkv.lab.netlab import testbed as netlab\nnetlab.Lab(hosts=2, name={name!r}).up()\nos._exit(0)\n"
    subprocess.run([sys.executable, "-c", code], check=True, env=ENV, timeout=60)
    leftovers = {ns for ns in live_namespaces() if ns.startswith(f"{netlab.PREFIX}{name}-")}
    assert len(leftovers) == 3
    (netlab.STATE_DIR / f"{name}.json").unlink()  # the state is lost too
    status = subprocess.run([sys.executable, "-m", "pdkv.cli", "netlab", "status", "--json"], capture_output=True,
                            text=True, env=ENV, timeout=60, check=True).stdout
    assert leftovers <= set(json.loads(status)["leftover_namespaces"])
    # the same name cannot be reused before it is cleaned up
    with pytest.raises(InvalidArgument, match="already exists"):
        netlab.Lab(hosts=1, name=name).up()
    p = subprocess.run([sys.executable, "-m", "pdkv.cli", "netlab", "down", name], capture_output=True, text=True,
                       env=ENV, timeout=60)
    assert p.returncode == 0, p.stderr
    assert not leftovers & live_namespaces()
    assert not list(netlab.SHM_DIR.glob(f"{netlab.PREFIX}{name}-*"))


@pytestmark_netns
def test_parallel_labs_have_distinct_names():
    with lab_up(2) as a, lab_up(2) as b:
        assert a.name != b.name
        assert a.namespace("h0") != b.namespace("h0")
        # same addresses, separate networks: each lab's h1 answers in its own lab only
        assert a.address("h1") == b.address("h1")
        assert {a.namespace("h0"), b.namespace("h0")} <= live_namespaces()


@pytestmark_netns
def test_cli_up_exec_status_down():
    name = f"cli{os.getpid() % 100000}"
    pdkv = [sys.executable, "-m", "pdkv.cli", "netlab"]
    up = subprocess.run([*pdkv, "up", "--hosts", "2", "--link", "100mbit", "--name", name], capture_output=True,
                        text=True, env=ENV, timeout=60)
    if up.returncode == 1 and "NetlabUnavailable" in up.stderr:
        pytest.skip(up.stderr.strip())
    try:
        assert up.returncode == 0, up.stderr
        assert "h1  10.211.0.2" in up.stdout
        got = subprocess.run([*pdkv, "exec", "--lab", name, "h1", "--", "ip", "-4", "-o", "addr", "show", "eth0"],
                             capture_output=True, text=True, env=ENV, timeout=60)
        assert got.returncode == 0 and "10.211.0.2/24" in got.stdout
        rc = subprocess.run([*pdkv, "exec", "--lab", name, "h0", "--", "sh", "-c", "exit 7"], env=ENV, timeout=60)
        assert rc.returncode == 7  # the command's own status
        status = subprocess.run([*pdkv, "status"], capture_output=True, text=True, env=ENV, timeout=60).stdout
        assert f"lab {name} (up), link 100mbit" in status
    finally:
        down = subprocess.run([*pdkv, "down", name], capture_output=True, text=True, env=ENV, timeout=60)
    assert down.returncode == 0 and f"{netlab.PREFIX}{name}-h0" in down.stdout
    assert not any(ns.startswith(f"{netlab.PREFIX}{name}-") for ns in live_namespaces())


# ---------------------------------------------------------------- the links carry what they are shaped to
@pytestmark_netns
@pytest.mark.parametrize("link,nbytes,low,high", [("100mbit", 8 << 20, 0.06e9, 0.11e9),
                                                  ("1gbit", 64 << 20, 0.6e9, 1.1e9)])
def test_rate_within_band(link, nbytes, low, high):
    """A shaped link's measured TCP goodput lies in a sane band around its rate (a value check of
    the emulation; the lower bound is loose because this machine's CPUs are shared)."""
    with lab_up(2, link) as lab:
        bps = measure_rate(lab, "h0", "h1", nbytes)
        assert low <= bps <= high, f"{link}: measured {bps / 1e9:.3f} Gbit/s"
        back = measure_rate(lab, "h1", "h0", nbytes)
        assert low <= back <= high, f"{link} (reverse): measured {back / 1e9:.3f} Gbit/s"


def tcp_round_trip_s(lab: netlab.Lab, src: str, dst: str, rounds: int = 21) -> float:
    """Median time of a 1-byte TCP ping-pong from src to dst (TCP_NODELAY)."""
    import socket
    import threading
    import time

    addr = lab.address(dst)
    ready = threading.Event()

    def serve() -> None:
        with socket.create_server((addr, 0)) as srv:
            serve.port = srv.getsockname()[1]  # type: ignore[attr-defined]
            ready.set()
            c, _ = srv.accept()
            with c:
                c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                for _ in range(rounds):
                    c.sendall(c.recv(1))

    def ping() -> float:
        assert ready.wait(10)
        with socket.create_connection((addr, serve.port), timeout=20) as c:  # type: ignore[attr-defined]
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            times = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                c.sendall(b"p")
                assert c.recv(1) == b"p"
                times.append(time.perf_counter() - t0)
        return sorted(times)[rounds // 2]

    server = threading.Thread(target=lambda: lab.call_in(dst, serve), daemon=True)
    server.start()
    rtt = lab.call_in(src, ping)
    server.join(10)
    return rtt


@pytestmark_netns
@pytest.mark.parametrize("link,rtt_ms", [("1gbit,rtt=2ms", 2.0), ("unlimited,rtt=5ms", 5.0)])
def test_rtt_is_emulated(link, rtt_ms):
    """The round trip between two hosts is at least the requested rtt (netem, or the delay
    line on kernels without it), and not far above it; without rtt it is loopback-fast."""
    with lab_up(2, link) as lab:
        assert lab.info["rtt_emulated"] is True and lab.info["delay"] in ("netem", "delay line")
        qdiscs = lab.run("h0", ["tc", "qdisc", "show", "dev", "eth0"]).stdout
        if lab.info["delay"] == "netem":
            assert "netem" in qdiscs
        else:
            bridge = subprocess.run(["ip", "-n", lab.switch_namespace, "-o", "link", "show", "master", "br0"],
                                    capture_output=True, text=True, check=True).stdout
            assert "d-h0" in bridge and "d-h1" in bridge and " h0@" not in bridge  # taps in, veths out
        rtt = tcp_round_trip_s(lab, "h0", "h1")
        assert rtt_ms / 1e3 <= rtt <= rtt_ms / 1e3 + 0.05, f"{link}: measured rtt {rtt * 1e3:.3f} ms"
        assert rtt_ms / 1e3 <= tcp_round_trip_s(lab, "h1", "h0") <= rtt_ms / 1e3 + 0.05
    with lab_up(2, "1gbit") as lab:
        assert lab.info["delay"] is None
        assert tcp_round_trip_s(lab, "h0", "h1") < rtt_ms / 1e3


@pytestmark_netns
def test_rate_holds_behind_the_delay():
    """A delayed link still carries its rate (the delay line queues a few round trips'
    bytes, like netem's limit): 1 Gbit/s with a 1 ms rtt."""
    with lab_up(2, "1gbit,rtt=1ms") as lab:
        bps = measure_rate(lab, "h0", "h1", 64 << 20)
        assert 0.5e9 <= bps <= 1.1e9, f"measured {bps / 1e9:.3f} Gbit/s"


@pytestmark_netns
def test_delay_line_names_a_missing_interface():
    from pdkv.lab._native import module

    with lab_up(1) as lab:
        def make():
            return module().netlab.DelayLine(["nosuchlink"], 0.001, 1 << 20)

        with pytest.raises(RuntimeError, match="no interface nosuchlink"):
            lab.call_in("h0", make)
        with pytest.raises(ValueError, match="one-way delay"):
            lab.call_in("h0", lambda: module().netlab.DelayLine(["eth0"], -1.0, 1 << 20))
        # the TAP made before the failure went with its descriptor
        assert "d-nosuchlink" not in lab.run("h0", ["ip", "-o", "link"]).stdout


# ---------------------------------------------------------------- pdkv across lab hosts
@pytestmark_netns
@pytest.mark.parametrize("op,link", [("write", "1gbit"), ("read", "1gbit"), ("write", "1gbit,rtt=1ms"),
                                     ("read", "1gbit,rtt=1ms")])
def test_pdkv_transfer_across_lab_hosts_is_bit_exact(spawn_peer, op, link):
    with lab_up(2, link) as lab:
        spec = PoolSpec(layers=4, blocks=128, block_tokens=16, heads=4, head_dim=64, dtype="float16")
        target = spawn_peer("decode", spec, seed=2, listen=f"{lab.address('h1')}:0", prefix=lab.prefix("h1"),
                            transports=("tcp", "shm"))
        initiator = spawn_peer("prefill", spec, seed=1, listen=f"{lab.address('h0')}:0", prefix=lab.prefix("h0"),
                               transports=("tcp", "shm"))
        lids, rids = list(range(3, 103)), list(range(120, 20, -1))
        res = initiator.call(cmd="xfer", op=op, address=target.address, lblocks=lids, rblocks=rids, notify="lab")
        assert res["ok"], res
        assert res["transport"] == "tcp"  # separate hosts: shm is not offered between them
        if op == "write":
            assert target.call(cmd="digest", blocks=rids)["digest"] == Pool(spec, 1).digest(lids)
        else:
            assert initiator.call(cmd="digest", blocks=lids)["digest"] == Pool(spec, 2).digest(rids)
        for p in (target, initiator):
            p.stop()


@pytestmark_netns
@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_bench_transfer_across_a_link(transport):
    import pdkv

    if transport not in pdkv.available_transports():
        pytest.skip(f"{transport} is not available here")
    probe = lab_up(1)
    probe.down()
    # UCX_NET_DEVICES=lo (right for loopback runs) must not leak into the lab
    p = subprocess.run([sys.executable, "-m", "pdkv.cli", "bench", "transfer", "--link", "1gbit", "--payload", "4M",
                        "--iters", "2", "--lat-iters", "20", "--prepare-blocks", "0", "--json",
                        "--transport", transport],
                       capture_output=True, text=True, env={**ENV, "UCX_NET_DEVICES": "lo"}, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["transport"] == transport and r["verified"] is True
    assert r["link"]["rate_bps"] == 10**9 and r["link"]["target"] == "10.211.0.2"
    # The bytes crossed the 1 Gbit/s link (loopback or shm would be far faster): a bound, not a speed test.
    assert r["gbps"] < 0.14 and r["ceilings"]["socket_plain"] < 0.14
    assert "link: 1gbit between lab hosts h0 10.211.0.1 (initiator) and h1 10.211.0.2 (target)" in p.stderr


@pytestmark_netns
@pytest.mark.parametrize("mode", ["push", "pull"])
def test_bench_transfer_hetero_across_a_link(mode):
    """--hetero behind --link: the lab's target is started with the hetero pool and flags."""
    p = subprocess.run([sys.executable, "-m", "pdkv.cli", "bench", "transfer", "--link", "1gbit", "--hetero", "tp4:tp2",
                        "--hetero-mode", mode, "--payload", "4M", "--iters", "2", "--hetero-request-tokens", "0",
                        "--json"], capture_output=True, text=True, env=ENV, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["hetero"] == "tp4:tp2" and r["mode"] == mode and r["verified"] is True
    assert r["transport"] == "tcp" and r["link"]["rate_bps"] == 10**9
    # Both crossed the 1 Gbit/s link: a bound, not a speed test.
    assert r["gbps"] < 0.14 and r["homogeneous_gbps"] < 0.14


def test_bench_transfer_link_refuses_shm():
    p = subprocess.run([sys.executable, "-m", "pdkv.cli", "bench", "transfer", "--link", "1gbit", "--transport",
                        "shm"], capture_output=True, text=True, env=ENV, timeout=120)
    assert p.returncode == 2
    assert "the shm transport does not cross one" in p.stderr or "not available here" in p.stderr
