"""Typed options: TcpOptions, ShmOptions and AgentConfig are the native classes
(cpp/bindings/py_options.cc), with keyword constructors, typed attributes and
validation that names the field (pdkv.InvalidArgument, never a TypeError)."""

from __future__ import annotations

import copy
import pickle
import socket

import pytest

import pdkv
from pdkv import _native
from conftest import SECRET

_pdkv = _native.module()


def test_options_are_the_native_classes_with_the_documented_defaults():
    assert pdkv.TcpOptions is _pdkv.TcpOptions and pdkv.ShmOptions is _pdkv.ShmOptions
    t = pdkv.TcpOptions()
    assert (t.listen_host, t.listen_port, t.conns_per_peer, t.progress_threads, t.spin_us) == ("127.0.0.1", 0, 1, 1, 0)
    assert (t.batch_bytes, t.batch_extents, t.rcvlowat_bytes) == (16 << 20, 1020, 1 << 20)
    assert (t.connect_timeout_s, t.handshake_timeout_s, t.frame_timeout_s) == (5.0, 5.0, 30.0)
    assert (t.stage_chunk_bytes, t.stage_buffers) == (4 << 20, 4)
    s = pdkv.ShmOptions()
    assert (s.copy_threads, s.inline_bytes) == (1, 256 << 10)
    c = _pdkv.AgentConfig()
    assert (c.name, c.secret, c.transports, c.default_timeout_s, c.max_notif_bytes, c.wait_spin_us) == \
        ("", b"", ["tcp"], 60.0, 1 << 20, 50)
    assert c.options == []  # no transport's options: each transport gets its defaults
    assert (t.gather_below_bytes, t.land_below_bytes) == (4096, 8192)
    assert t.congestion_control == ""  # the system's
    assert s.connect_timeout_s == 5.0
    assert (pdkv.TcpOptions.transport, pdkv.ShmOptions.transport, pdkv.NixlOptions.transport) == ("tcp", "shm", "nixl")


def test_keyword_constructor_attributes_equality_repr_copy_and_pickle():
    t = pdkv.TcpOptions(spin_us=5, conns_per_peer=3, frame_timeout_s=2)
    assert (t.spin_us, t.conns_per_peer, t.frame_timeout_s) == (5, 3, 2.0)
    assert t == pdkv.TcpOptions(conns_per_peer=3, spin_us=5, frame_timeout_s=2.0)
    assert t != pdkv.TcpOptions() and t != "TcpOptions"
    assert "spin_us=5" in repr(t) and repr(t).startswith("TcpOptions(")
    t2 = copy.copy(t)
    t2.spin_us = 7
    assert t.spin_us == 5 and t2.spin_us == 7
    assert pickle.loads(pickle.dumps(t)) == t
    assert copy.deepcopy(pdkv.ShmOptions(inline_bytes=0)).inline_bytes == 0
    # The config holds copies of native options, one per transport.
    c = _pdkv.AgentConfig(name="a", options=[t, pdkv.ShmOptions(copy_threads=2)])
    t.spin_us = 9
    assert c.options == [pdkv.TcpOptions(spin_us=5, conns_per_peer=3, frame_timeout_s=2),
                         pdkv.ShmOptions(copy_threads=2)]
    c.options = [pdkv.TcpOptions(spin_us=1)]
    assert c.options == [pdkv.TcpOptions(spin_us=1)]
    assert pickle.loads(pickle.dumps(c)).options == [pdkv.TcpOptions(spin_us=1)]


@pytest.mark.parametrize("kw, match", [
    ({"spin_us": "5"}, r"TcpOptions\.spin_us must be an integer in 0\.\.4294967295, got str '5'"),
    ({"spin_us": 1.5}, r"TcpOptions\.spin_us must be an integer.*got float 1\.5"),
    ({"spin_us": True}, r"TcpOptions\.spin_us must be an integer.*got bool True"),
    ({"spin_us": -1}, r"TcpOptions\.spin_us must be an integer in 0\.\.4294967295, got -1"),
    ({"listen_port": 70000}, r"TcpOptions\.listen_port must be an integer in 0\.\.65535, got 70000"),
    ({"batch_bytes": 2**64}, r"TcpOptions\.batch_bytes must be an integer.*got 18446744073709551616"),
    ({"frame_timeout_s": "30"}, r"TcpOptions\.frame_timeout_s must be a number of seconds, got str '30'"),
    ({"listen_host": 1}, r"TcpOptions\.listen_host must be a str, got int 1"),
    ({"spinus": 5}, r"TcpOptions has no option 'spinus' \(options: listen_host, listen_port, conns_per_peer"),
])
def test_wrong_types_and_names_are_invalid_argument_naming_the_field(kw, match):
    with pytest.raises(pdkv.InvalidArgument, match=match):
        pdkv.TcpOptions(**kw)


@pytest.mark.parametrize("kw, match", [
    ({"conns_per_peer": 0}, r"tcp\.conns_per_peer must be in 1\.\.64, got 0"),
    ({"progress_threads": 65}, r"tcp\.progress_threads must be in 1\.\.64, got 65"),
    ({"batch_extents": 1021}, r"tcp\.batch_extents must be in 1\.\.1020, got 1021"),
    ({"stage_buffers": 1}, r"tcp\.stage_buffers must be in 2\.\.1024, got 1"),
    ({"frame_timeout_s": 0}, r"tcp\.frame_timeout_s must be a number of seconds in \(0, 86400\], got 0"),
    ({"handshake_timeout_s": float("nan")}, r"tcp\.handshake_timeout_s .* got nan"),
    ({"listen_host": ""}, r"tcp\.listen_host is empty"),
])
def test_out_of_range_values_are_rejected_at_construction(kw, match):
    with pytest.raises(pdkv.InvalidArgument, match=match):
        pdkv.TcpOptions(**kw)


def test_shm_options_and_positional_arguments():
    with pytest.raises(pdkv.InvalidArgument, match=r"shm\.copy_threads must be in 1\.\.64, got 0"):
        pdkv.ShmOptions(copy_threads=0)
    with pytest.raises(pdkv.InvalidArgument, match="keyword arguments only"):
        pdkv.ShmOptions(2)
    s = pdkv.ShmOptions()
    with pytest.raises(pdkv.InvalidArgument, match=r"ShmOptions\.inline_bytes must be an integer"):
        s.inline_bytes = "big"
    s.copy_threads = 0  # attributes are checked when used (validate(), Agent())
    with pytest.raises(pdkv.InvalidArgument, match=r"shm\.copy_threads"):
        s.validate()
    with pytest.raises(pdkv.InvalidArgument, match=r"shm\.copy_threads must be in 1\.\.64, got 0"):
        pdkv.Agent("a", secret=SECRET, options=[s])


def test_agent_takes_the_typed_options_and_listen_stays_a_string_edge():
    tcp = pdkv.TcpOptions(conns_per_peer=2, listen_port=0)
    with pdkv.Agent("a", secret=SECRET, transports=["tcp"], options=[tcp], listen="127.0.0.1:0") as a:
        host, port = a.address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
    assert tcp.listen_host == "127.0.0.1" and tcp.listen_port == 0  # the caller's object is untouched
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    with pdkv.Agent("a", secret=SECRET, transports=["tcp"], listen=f"127.0.0.1:{free}") as a:
        assert a.address == f"127.0.0.1:{free}"
    with pdkv.Agent("a", secret=SECRET, transports=["tcp"], options=[pdkv.TcpOptions(listen_port=free)]) as a:
        assert a.address == f"127.0.0.1:{free}"  # without listen=, the options' address
    with pytest.raises(pdkv.InvalidArgument, match="listen"):
        pdkv.Agent("a", listen="127.0.0.1:99999")
    with pdkv.Agent("a", secret=SECRET, transports=["tcp"], listen=f"127.0.0.1:{free}",
                    options=[pdkv.ShmOptions(copy_threads=2)]) as a:
        assert a.address == f"127.0.0.1:{free}"  # listen= adds tcp options beside the others
    with pytest.raises(pdkv.InvalidArgument, match=r"options must be a list of transport options"):
        pdkv.Agent("a", options={"spin_us": 1})
    with pytest.raises(pdkv.InvalidArgument, match=r"AgentConfig\.options entries must be transport options.*dict"):
        pdkv.Agent("a", options=[{"spin_us": 1}])
    with pytest.raises(pdkv.InvalidArgument, match=r"two options for transport 'tcp'"):
        pdkv.Agent("a", options=[pdkv.TcpOptions(), pdkv.TcpOptions(spin_us=1)])
    with pytest.raises(TypeError):
        pdkv.Agent("a", tcp=pdkv.TcpOptions())  # the per-transport keywords are gone
    with pytest.raises(pdkv.InvalidArgument, match=r"AgentConfig\.name must be a str, got int"):
        pdkv.Agent(5)


def test_native_agent_takes_one_config():
    cfg = _pdkv.AgentConfig(name="cfg", secret=b"\xff\x00s", transports=["tcp"],
                            options=[pdkv.TcpOptions(progress_threads=2)], default_timeout_s=0)
    a = _pdkv.Agent(cfg)
    assert a.name == "cfg" and a.secret == b"\xff\x00s" and a.transports == ["tcp"]
    with pytest.raises(pdkv.InvalidArgument, match=r"AgentConfig\.secret must be bytes or str"):
        _pdkv.AgentConfig(secret=5)
    with pytest.raises(pdkv.InvalidArgument, match=r"max_notif_bytes must be >= 1, got 0"):
        _pdkv.AgentConfig(max_notif_bytes=0)
    with pytest.raises(pdkv.InvalidArgument, match=r"AgentConfig\.transports must be a list of str"):
        _pdkv.AgentConfig(transports="tcp")


def test_import_pdkv_loads_the_native_module_only_when_options_are_used():
    # scripts/sanitize.sh imports pdkv without the sanitizer runtime preloaded.
    import subprocess
    import sys

    code = ("import sys, pdkv; assert 'pdkv._pdkv' not in sys.modules; "
            "from pdkv import TcpOptions; assert TcpOptions(spin_us=1).spin_us == 1; "
            "assert 'pdkv._pdkv' in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_every_transports_options_are_validated_enabled_or_not():
    # shm is not enabled, its options are still checked (a bad value is a mistake either way)
    with pytest.raises(pdkv.InvalidArgument, match=r"shm\.connect_timeout_s"):
        pdkv.Agent("a", secret=SECRET, transports=["tcp"], options=[pdkv.ShmOptions(connect_timeout_s=0.0)])
    with pytest.raises(pdkv.InvalidArgument, match=r"tcp\.gather_below_bytes must be in 0\.\.1073741824"):
        pdkv.TcpOptions(gather_below_bytes=(1 << 30) + 1)
    with pytest.raises(pdkv.InvalidArgument, match=r"tcp\.land_below_bytes"):
        pdkv.Agent("a", secret=SECRET, transports=["tcp"],
                   options=[pdkv.TcpOptions(land_below_bytes=(1 << 30) + 1)])
    for bad in ("BBR", "cubic;reboot", "x" * 16, "a b"):
        with pytest.raises(pdkv.InvalidArgument, match=r"tcp\.congestion_control must be a kernel congestion"):
            pdkv.TcpOptions(congestion_control=bad)


def test_a_python_transport_receives_its_own_options_class():
    from pdkv.backends.example import LoopbackOptions, LoopbackTransport

    with pdkv.Agent("a", secret=SECRET, transports=["loopback"], options=[LoopbackOptions(max_extents=7)]) as a:
        assert a.transports[0] == "loopback"
    with pytest.raises(pdkv.InvalidArgument, match=r"loopback\.max_extents"):
        pdkv.Agent("a", secret=SECRET, transports=["loopback"], options=[LoopbackOptions(max_extents=0)])
    # validated even when loopback is not enabled
    with pytest.raises(pdkv.InvalidArgument, match=r"loopback\.max_extents"):
        pdkv.Agent("a", secret=SECRET, transports=["tcp"], options=[LoopbackOptions(max_extents=0)])
    assert LoopbackTransport(LoopbackOptions(max_extents=3))._opts.max_extents == 3

    class Stray:
        transport = "no-such-transport"

    with pytest.raises(pdkv.InvalidArgument, match=r"options for transport 'no-such-transport'.*not registered"):
        pdkv.Agent("a", secret=SECRET, transports=["tcp"], options=[Stray()])

    class NotLoopback:
        transport = "loopback"

    with pytest.raises(pdkv.InvalidArgument, match=r"takes LoopbackOptions options, got NotLoopback"):
        pdkv.Agent("a", secret=SECRET, transports=["loopback"], options=[NotLoopback()])


def test_registering_a_transport_with_an_options_class_that_names_another_is_refused():
    from pdkv.transport import register_transport

    class Wrong:
        transport = "elsewhere"

    with pytest.raises(pdkv.InvalidArgument, match=r"transport = 'opts-test-t'"):
        register_transport("opts-test-t", lambda config, options: None, options=Wrong)


def test_bench_switches_are_one_table_listed_with_their_values():
    switches = _pdkv.bench_switches()
    names = [s["name"] for s in switches]
    assert len(names) == len(set(names)) == 10 and all(n.startswith("PDKV_BENCH_") for n in names)
    assert "PDKV_BENCH_TCP_GATHER_BELOW" not in names  # a TcpOptions field now
    assert all(s["meaning"] and s["default"] and s["values"] for s in switches)
