"""tcp with TcpOptions(tls=True): TLS 1.3 on every connection, the handshake inside bound
to the session (cpp/src/transport/tcp/tls.h, docs/security.md).

Bit-exact writes, reads and notifications; nothing on the wire is plaintext (no frame
magic, no KV bytes, no secret); a machine in the middle that terminates TLS towards each
end and relays the plaintext is refused (the proofs cover each session's exporter); an
agent with TLS and one without refuse each other with an error that says so; a peer that
never finishes the TLS handshake fails the transfer at its deadline."""

from __future__ import annotations

import socket
import ssl
import subprocess
import threading

import numpy as np
import pytest

import pdkv
from conftest import Relay, listen_like
from test_handshake_auth import derived

SECRET = "tls-test-secret"
TLS = pdkv.TcpOptions(tls=True)


def agent(name, tls=True, **kw):
    return pdkv.Agent(name, secret=SECRET, transports=["tcp"], options=[pdkv.TcpOptions(tls=tls, **kw)])


def test_tls_write_read_notify_bit_exact():
    with agent("t") as t, agent("i") as i:
        rng = np.random.default_rng(5)
        src = rng.integers(0, 256, 8 << 20, dtype=np.uint8)
        dst = np.zeros_like(src)
        back = np.zeros_like(src)
        dst2 = np.zeros_like(src)
        rs, rd, rb, rd2 = i.register(src), t.register(dst), i.register(back), t.register(dst2)
        peer = i.connect(t.address)
        assert i.prepare_extents("write", peer, [(rs.id, 0, rd.id, 0, src.size)]).post(notify=b"kv-ready").wait(20)
        assert np.array_equal(dst, src)
        assert [n.data for n in t.wait_notifications(timeout=5)] == [b"kv-ready"]
        assert i.prepare_extents("read", peer, [(rb.id, 0, rd.id, 0, src.size)]).post().wait(20)
        assert np.array_equal(back, src)
        # Many small extents, into a fresh region (dst was just sent by the target's
        # progress thread: zeroing it here would race with that send as ThreadSanitizer
        # sees it, the kernel being the only thing ordering the two).
        ext = [(rs.id, k * 4096, rd2.id, (k * 7919 % 2048) * 4096, 4096) for k in range(512)]
        assert i.prepare_extents("write", peer, ext).post().wait(20)
        for (_, so, _, do, n) in ext:
            assert np.array_equal(dst2[do:do + n], src[so:so + n])


def test_nothing_on_the_wire_is_plaintext():
    with agent("t") as t, agent("i") as i:
        src = np.frombuffer(b"KVKVKVKV" * 8192, np.uint8).copy()
        dst = np.zeros_like(src)
        rs, rd = i.register(src), t.register(dst)
        real = t.address
        ls, via = listen_like(real)
        host, port = real.rsplit(":", 1)
        relay = Relay(ls, (host, int(port)))
        try:
            peer = i.add_peer(t.metadata().replace(real.encode(), via.encode()))
            assert i.prepare_extents("write", peer, [(rs.id, 0, rd.id, 0, src.size)]).post(notify=b"secret-note").wait(10)
            assert np.array_equal(dst, src)
            wire = relay.wire()
            assert len(wire) > src.size
            for needle in [b"PDKF", b"KVKVKVKV", b"secret-note", b"initiator", *derived(SECRET)]:
                assert needle not in wire, needle
        finally:
            relay.close()


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    d = tmp_path_factory.mktemp("mitm")
    key, crt = d / "k.pem", d / "c.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-keyout", str(key), "-out", str(crt), "-days", "1", "-subj", "/CN=mitm"],
                   check=True, capture_output=True)
    return str(crt), str(key)


class TlsMitm:
    """Terminates the initiator's TLS with its own certificate, opens its own TLS session
    to the target, and relays the plaintext both ways (a machine in the middle)."""

    def __init__(self, target: tuple[str, int], real_addr: str, cert):
        self.ls, self.addr = listen_like(real_addr)
        self.ls.settimeout(0.2)
        self.target = target
        self.server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.server_ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        self.server_ctx.load_cert_chain(*cert)
        self.client_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        self.client_ctx.check_hostname = False
        self.client_ctx.verify_mode = ssl.CERT_NONE
        self.relayed = 0
        self.stop = False
        self.socks: list[socket.socket] = []
        self.th = threading.Thread(target=self.serve, daemon=True)
        self.th.start()

    def serve(self):
        while not self.stop:
            try:
                c, _ = self.ls.accept()
            except OSError:
                continue
            try:
                c.settimeout(10)
                a = self.server_ctx.wrap_socket(c, server_side=True)
                b = self.client_ctx.wrap_socket(socket.create_connection(self.target, timeout=10))
            except (OSError, ssl.SSLError):
                c.close()
                continue
            self.socks += [a, b]
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self.pump, args=(src, dst), daemon=True).start()

    def pump(self, src, dst):
        try:
            while (data := src.recv(65536)):
                self.relayed += len(data)
                dst.sendall(data)
        except (OSError, ssl.SSLError):
            pass

    def close(self):
        self.stop = True
        self.th.join(5)
        for s in self.socks:
            try:
                s.close()
            except OSError:
                pass
        self.ls.close()


def test_a_machine_in_the_middle_of_two_tls_sessions_is_refused(cert):
    # Three TLS handshakes in sequence, two of them in Python: under ThreadSanitizer on a
    # busy CI machine they took longer than 5 s (the hello timed out).
    with agent("t") as t, agent("i", connect_timeout_s=30.0) as i:
        dst = np.zeros(4096, np.uint8)
        rd, rs = t.register(dst), i.register(np.ones(4096, np.uint8))
        real = t.address
        host, port = real.rsplit(":", 1)
        mitm = TlsMitm((host, int(port)), real, cert)
        try:
            peer = i.add_peer(t.metadata().replace(real.encode(), mitm.addr.encode()))
            with pytest.raises(pdkv.AuthFailed, match="wrong secret"):
                i.prepare_extents("write", peer, [(rs.id, 0, rd.id, 0, 4096)]).post(timeout=60).wait(60)
            assert mitm.relayed > 0  # the plaintext handshake did go through it
            assert not dst.any()
        finally:
            mitm.close()
        # Without the machine in the middle the same pair works.
        i.remove_peer(peer)
        peer = i.add_peer(t.metadata())
        assert i.prepare_extents("write", peer, [(rs.id, 0, rd.id, 0, 4096)]).post().wait(10)
        assert dst.all()


@pytest.mark.parametrize("initiator_tls", [True, False])
def test_tls_and_plain_agents_refuse_each_other_clearly(initiator_tls):
    with agent("t", tls=not initiator_tls) as t, agent("i", tls=initiator_tls, connect_timeout_s=3.0) as i:
        with pytest.raises(pdkv.PdkvError) as e:
            i.connect(t.address, timeout=3)
        if initiator_tls:
            assert "TcpOptions.tls" in str(e.value), e.value
        else:
            assert type(e.value) in (pdkv.ProtocolError, pdkv.PeerConnectionError, pdkv.TransferTimeout), e.value


def test_a_peer_that_never_finishes_the_tls_handshake_fails_at_the_deadline():
    import time

    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(4)
    try:
        with agent("i", connect_timeout_s=1.0) as i:
            t0 = time.monotonic()
            with pytest.raises((pdkv.TransferTimeout, pdkv.PeerConnectionError)):
                i.connect("%s:%d" % ls.getsockname(), timeout=1.0)
            assert time.monotonic() - t0 < 5
    finally:
        ls.close()


def test_tls_option_is_typed():
    assert pdkv.TcpOptions().tls is False
    with pytest.raises(pdkv.InvalidArgument, match="bool"):
        pdkv.TcpOptions(tls=1)
