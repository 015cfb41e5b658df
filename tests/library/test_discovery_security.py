"""Securing etcd (pdkv.discovery): signed records and etcd's own authentication and TLS.

Every record kind pdkv writes (agents, workers, proxies) x every forgery an etcd writer
without the cluster secret can make (unsigned, another secret, copied from another key,
a changed field, another lease, dated in the future, an older value replayed) is
ignored by readers with the secret, logged once per key and counted; a record signed
with a second accepted secret (rotation) is accepted. etcd user/password (token,
re-authentication when it expires) and TLS (CA, client certificates) against a real
etcd on 127.0.0.1. Each test runs its own etcd; skipped without the binary."""

from __future__ import annotations

import json
import logging
import shutil
import socket
import subprocess
import threading
import time

import pytest

import pdkv
from conftest import SECRET, wait_until
from pdkv.credential import Credential
from pdkv.discovery import (RECORD_VERSION, EtcdClient, EtcdOptions, EtcdRefused, Registry, canonical_json,
                            parse_registry_url)
from pdkv.discovery_etcd import EtcdServer, EtcdTLS, enable_auth, etcd_binary

TTL = 2
OTHER = "another-secret"
KINDS = ("agents", "workers", "proxies")

#: A representative record of each kind (what Agent, WorkerRegistration and PoolWatch publish).
RECORDS = {
    "agents": {"name": "genuine", "instance_id": "abc", "address": "127.0.0.1:4000", "metadata": "AAAA"},
    "workers": {"url": "http://127.0.0.1:4001", "role": "decode", "model": "m", "capacity_tokens": 64,
                "load": {"in_flight": 0}, "state": "serving", "pid": 1},
    "proxies": {"url": "http://127.0.0.1:4002", "mode": "disagg", "pid": 2},
}
#: The field a forger changes (where the reader would send traffic).
FIELD = {"agents": "address", "workers": "url", "proxies": "url"}
EVIL = {"agents": "127.0.0.1:6666", "workers": "http://127.0.0.1:6666", "proxies": "http://127.0.0.1:6666"}

needs_etcd = pytest.mark.skipif(etcd_binary() is None,
                                reason="no etcd binary (apt-get install etcd-server, or set PDKV_ETCD)")


def registry(etcd, secret=SECRET, accepted=(), **kw) -> Registry:
    cred = None if secret is None else Credential(secret, accepted)
    return Registry(etcd.url, ttl=TTL, credential=cred, etcd=None, **kw)


def envelope(secret: str, key: str, record: dict, lease: int, ts_ms: int) -> bytes:
    """A signed envelope made by hand (what a member with ``secret`` would write)."""
    body = canonical_json(record)
    mac = Credential(secret).sign("etcd", "pdkv etcd record", RECORD_VERSION, key, body, str(lease), str(ts_ms))
    return json.dumps({"v": RECORD_VERSION, "record": record, "lease": str(lease), "ts": ts_ms,
                       "mac": mac}).encode()


def now_ms() -> int:
    return int(time.time() * 1000)


class Forger:
    """An etcd writer without the cluster secret: its own lease, raw puts."""

    def __init__(self, etcd) -> None:
        self.client = EtcdClient("127.0.0.1", etcd.port)
        self.lease = self.client.grant(30)

    def raw(self, key: str) -> tuple[bytes, int]:
        kv = self.client.get_kv(key)
        assert kv is not None
        return kv.value, kv.lease


def forge(attack: str, kind: str, forger: Forger, genuine_key: str, forged_key: str) -> tuple[str, bytes, int]:
    """(key, value, lease) the forger writes for ``attack``; the value points at EVIL."""
    rec = dict(RECORDS[kind], **{FIELD[kind]: EVIL[kind]})
    if attack == "unsigned":
        return forged_key, canonical_json(rec), forger.lease
    if attack == "wrong_secret":
        return forged_key, envelope(OTHER, forged_key, rec, forger.lease, now_ms()), forger.lease
    if attack == "copied":  # a genuine record (signed for its own key) under another key, same lease
        value, lease = forger.raw(genuine_key)
        return forged_key, value, lease
    if attack == "tampered":  # the genuine record with its address changed, in place
        value, lease = forger.raw(genuine_key)
        doc = json.loads(value)
        doc["record"][FIELD[kind]] = EVIL[kind]
        return genuine_key, json.dumps(doc).encode(), lease
    if attack == "lease_swapped":  # a genuine record moved onto the forger's lease (outlives the publisher)
        value, _ = forger.raw(genuine_key)
        return genuine_key, value, forger.lease
    if attack == "lease_field_edited":  # ... and the envelope's lease edited to match
        value, _ = forger.raw(genuine_key)
        doc = json.loads(value)
        doc["lease"] = str(forger.lease)
        return genuine_key, json.dumps(doc).encode(), forger.lease
    if attack == "future":  # signed (a member's clock, or a stolen signing moment) an hour ahead
        return forged_key, envelope(SECRET, forged_key, rec, forger.lease, now_ms() + 3600_000), forger.lease
    raise AssertionError(attack)


#: attack -> the reason the reader counts.
ATTACKS = {"unsigned": "unsigned", "wrong_secret": "bad_mac", "copied": "bad_mac", "tampered": "bad_mac",
           "lease_swapped": "lease", "lease_field_edited": "bad_mac", "future": "future"}


@needs_etcd
class TestForgedRecords:
    """Each kind x each forgery: ignored by list, lookup and watch; logged once; counted."""

    @pytest.mark.parametrize("attack", sorted(ATTACKS))
    @pytest.mark.parametrize("kind", KINDS)
    def test_forged_record_is_ignored_and_counted(self, etcd, kind, attack, caplog):
        writer, reader = registry(etcd), registry(etcd)
        pub = writer.publish(kind, "genuine", lambda: RECORDS[kind])
        try:
            seen: dict[str, dict | None] = {}
            watch = reader.watch(kind, lambda name, rec: seen.__setitem__(name, rec), idle_s=5)
            assert watch.synced.wait(10) and seen == {"genuine": RECORDS[kind]}
            forger = Forger(etcd)
            genuine_key, forged_key = reader.key(kind, "genuine"), reader.key(kind, "forged")
            key, value, lease = forge(attack, kind, forger, genuine_key, forged_key)
            caplog.set_level(logging.WARNING, logger="pdkv.discovery")
            forger.client.put(key, value, lease=lease)
            reason = ATTACKS[attack]
            # The watch saw the put and refused it: the forged record never reaches on_change;
            # one that overwrote the genuine key takes it away (as a deletion would).
            assert wait_until(lambda: reader.rejected_total() >= 1, timeout=10)
            name = key.rsplit("/", 1)[1]
            if key == genuine_key:
                assert wait_until(lambda: seen.get("genuine", 0) is None, timeout=10), seen
            else:
                time.sleep(0.3)
                assert "forged" not in seen
            assert all(rec is None or rec[FIELD[kind]] != EVIL[kind] for rec in seen.values())
            items, _ = reader.list(kind)
            assert name not in items
            with pytest.raises(pdkv.NotFound, match="refused"):
                reader.lookup(kind, name)
            counted = dict(reader.rejected_records())
            assert counted.get((kind, reason), 0) >= 3, counted  # watch, list, lookup
            assert set(k for k, _ in counted) == {kind}
            warnings = [r for r in caplog.records if key in r.getMessage()]
            assert len(warnings) == 1, [r.getMessage() for r in warnings]  # once per key
            assert reason in warnings[0].getMessage()
            watch.close()
        finally:
            pub.close()

    @pytest.mark.parametrize("kind", KINDS)
    def test_older_value_replayed_on_the_same_lease_is_refused(self, etcd, kind):
        writer, reader = registry(etcd), registry(etcd)
        state = {"v": dict(RECORDS[kind], pid=1)}
        pub = writer.publish(kind, "genuine", lambda: state["v"])
        try:
            key = reader.key(kind, "genuine")
            old = Forger(etcd).raw(key)
            assert reader.lookup(kind, "genuine")["pid"] == 1
            time.sleep(0.01)
            state["v"] = dict(RECORDS[kind], pid=2)  # e.g. a worker turning 'draining'
            pub.refresh()
            assert reader.lookup(kind, "genuine")["pid"] == 2
            Forger(etcd).client.put(key, old[0], lease=old[1])  # the older value, back on the live lease
            with pytest.raises(pdkv.NotFound, match="refused"):
                reader.lookup(kind, "genuine")
            assert dict(reader.rejected_records()) == {(kind, "replayed"): 1}
        finally:
            pub.close()

    @pytest.mark.parametrize("kind", KINDS)
    def test_record_signed_with_a_second_accepted_secret_is_accepted(self, etcd, kind):
        """Rotation: the writer still signs with the old secret; readers that already
        accept the new one (first) and the old one take it; one that dropped it does not."""
        writer = registry(etcd, secret="old-secret")
        rotating = registry(etcd, secret="new-secret", accepted=["old-secret"])
        rotated = registry(etcd, secret="new-secret")
        pub = writer.publish(kind, "genuine", lambda: RECORDS[kind])
        try:
            assert rotating.lookup(kind, "genuine") == RECORDS[kind]
            assert rotating.list(kind)[0] == {"genuine": RECORDS[kind]}
            assert rotating.rejected_total() == 0
            with pytest.raises(pdkv.NotFound, match="refused"):
                rotated.lookup(kind, "genuine")
            assert dict(rotated.rejected_records()) == {(kind, "bad_mac"): 1}
            # The writer moves to the new secret (keeping the old one accepted): both readers take it.
            pub.close()
            writer = registry(etcd, secret="new-secret", accepted=["old-secret"])
            pub = writer.publish(kind, "genuine", lambda: RECORDS[kind])
            assert rotating.lookup(kind, "genuine") == rotated.lookup(kind, "genuine") == RECORDS[kind]
        finally:
            pub.close()

    def test_the_envelope_on_the_wire_carries_no_secret(self, etcd):
        writer = registry(etcd)
        pub = writer.publish("workers", "w", lambda: RECORDS["workers"])
        try:
            value, lease = Forger(etcd).raw(writer.key("workers", "w"))
            doc = json.loads(value)
            assert set(doc) == {"v", "record", "lease", "ts", "mac"} and doc["v"] == 1
            assert doc["record"] == RECORDS["workers"] and doc["lease"] == str(lease) != "0"
            assert abs(doc["ts"] / 1000 - time.time()) < 30
            assert SECRET.encode() not in value and b"test-secret" not in value
        finally:
            pub.close()


@needs_etcd
class TestWithoutSecret:
    """A deployment without a secret works as before; a reader with one never takes unsigned records."""

    def test_unsigned_writer_and_reader(self, etcd, monkeypatch):
        monkeypatch.delenv("PDKV_SECRET", raising=False)
        plain = Registry(etcd.url, ttl=TTL)
        assert plain.credential is None
        pub = plain.publish("workers", "w", lambda: RECORDS["workers"])
        try:
            assert json.loads(Forger(etcd).raw(plain.key("workers", "w"))[0]) == RECORDS["workers"]
            assert plain.lookup("workers", "w") == RECORDS["workers"]
            with pytest.raises(pdkv.NotFound, match="refused"):
                registry(etcd).lookup("workers", "w")
        finally:
            pub.close()

    def test_reader_without_secret_takes_signed_records_unchecked(self, etcd):
        pub = registry(etcd).publish("workers", "w", lambda: RECORDS["workers"])
        try:
            assert registry(etcd, secret=None).lookup("workers", "w") == RECORDS["workers"]
        finally:
            pub.close()

    def test_secret_from_the_environment(self, etcd, monkeypatch):
        monkeypatch.setenv("PDKV_SECRET", OTHER)
        monkeypatch.setenv("PDKV_ACCEPTED_SECRETS", SECRET)
        reg = Registry(etcd.url, ttl=TTL)
        assert reg.credential is not None and reg.credential.accepted == (OTHER.encode(), SECRET.encode())
        pub = registry(etcd).publish("workers", "w", lambda: RECORDS["workers"])
        try:
            assert reg.lookup("workers", "w") == RECORDS["workers"]
        finally:
            pub.close()

    @pytest.mark.parametrize("secret", [None, SECRET])
    def test_garbage_under_the_prefix_does_not_stop_the_watch(self, etcd, secret):
        reader = registry(etcd, secret=secret)
        seen: dict = {}
        watch = reader.watch("workers", lambda n, r: seen.__setitem__(n, r), idle_s=5)
        try:
            assert watch.synced.wait(10)
            f = Forger(etcd)
            f.client.put(reader.key("workers", "junk"), b"\xff not json", lease=f.lease)
            f.client.put(reader.key("workers", "list"), b"[1, 2]", lease=f.lease)
            pub = registry(etcd).publish("workers", "w", lambda: RECORDS["workers"])
            try:
                assert wait_until(lambda: "w" in seen, timeout=10), seen
                assert "junk" not in seen and "list" not in seen
                assert reader.list("workers")[0] == {"w": RECORDS["workers"]}
                assert dict(reader.rejected_records())[("workers", "malformed")] >= 2
            finally:
                pub.close()
        finally:
            watch.close()


@needs_etcd
class TestAgentNameResolution:
    """A forged agent record never makes an agent dial: connect(name) is refused before any connection."""

    @pytest.mark.parametrize("attack", ["unsigned", "wrong_secret", "tampered", "lease_swapped"])
    def test_forged_agent_record_is_not_dialled(self, etcd, attack):
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        listener.settimeout(0.2)
        accepted = []

        def accept_loop():
            while not stop.is_set():
                try:
                    conn, _ = listener.accept()
                except (socket.timeout, OSError):
                    continue
                accepted.append(conn)

        stop = threading.Event()
        t = threading.Thread(target=accept_loop)
        t.start()
        evil = f"127.0.0.1:{listener.getsockname()[1]}"
        try:
            with pdkv.Agent("victim", secret=SECRET, transports=["tcp"], registry=registry(etcd)) as victim, \
                    pdkv.Agent("dialer", secret=SECRET, transports=["tcp"], registry=etcd.url) as dialer:
                assert dialer.registry.credential is not None  # the agent's secret signs and checks
                f = Forger(etcd)
                key = dialer.registry.key("agents", "victim" if attack in ("tampered", "lease_swapped") else "ghost")
                value, lease = f.raw(dialer.registry.key("agents", "victim"))
                rec = dict(json.loads(value)["record"], name=key.rsplit("/", 1)[1], address=evil)
                if attack == "unsigned":
                    value, lease = canonical_json(rec), f.lease
                elif attack == "wrong_secret":
                    value, lease = envelope(OTHER, key, rec, f.lease, now_ms()), f.lease
                elif attack == "tampered":
                    doc = json.loads(value)
                    doc["record"]["address"] = evil
                    value = json.dumps(doc).encode()
                else:  # lease_swapped: the genuine record kept alive by the forger's lease
                    lease = f.lease
                f.client.put(key, value, lease=lease)
                with pytest.raises(pdkv.NotFound, match="refused"):
                    dialer.connect(key.rsplit("/", 1)[1])
                assert dialer.registry.rejected_total() == 1
                time.sleep(0.3)
                assert accepted == []  # no connection reached the forger's address
                assert victim.name == "victim"
        finally:
            stop.set()
            t.join()
            listener.close()
            for c in accepted:
                c.close()

    def test_signed_agents_still_resolve_and_transfer(self, etcd):
        with pdkv.Agent("a", secret=SECRET, transports=["tcp"], registry=etcd.url) as a, \
                pdkv.Agent("b", secret=SECRET, transports=["tcp"], registry=etcd.url) as b:
            assert b.connect("a") == "a"
            value, _ = Forger(etcd).raw(a.registry.key("agents", "a"))
            assert json.loads(value)["record"]["address"] == a.address


# ---------------------------------------------------------------------- etcd's own auth
PASSWORD = "pdkv-etcd-password"


@pytest.fixture
def auth_etcd():
    """An etcd with authentication on: user 'pdkv' may read and write /pdkv/ only;
    tokens live 2 s (so the tests see them expire)."""
    if etcd_binary() is None:
        pytest.skip("no etcd binary (apt-get install etcd-server, or set PDKV_ETCD)")
    server = EtcdServer(args=["--auth-token-ttl", "2", "--bcrypt-cost", "4"])
    server.start()
    enable_auth(server.client(), "pdkv", PASSWORD)
    yield server
    server.close()


@needs_etcd
class TestEtcdAuth:
    def test_without_credentials_etcd_refuses(self, auth_etcd):
        reg = Registry(auth_etcd.url, ttl=TTL, credential=None, etcd=None)
        with pytest.raises(EtcdRefused, match="user name is empty|permission denied|invalid auth token"):
            reg.publish("workers", "w", lambda: RECORDS["workers"])

    def test_wrong_password_is_refused(self, auth_etcd):
        reg = Registry(auth_etcd.url, ttl=TTL, credential=None, etcd=EtcdOptions(user="pdkv", password="nope"))
        with pytest.raises(EtcdRefused, match="authentication failed"):
            reg.lookup("workers", "w")

    def test_user_password_publish_lookup_watch_and_token_renewal(self, auth_etcd):
        opts = EtcdOptions(user="pdkv", password=PASSWORD)
        writer = Registry(auth_etcd.url, ttl=TTL, credential=Credential(SECRET), etcd=opts)
        reader = Registry(auth_etcd.url, ttl=TTL, credential=Credential(SECRET), etcd=opts)
        seen: dict = {}
        watch = reader.watch("workers", lambda n, r: seen.__setitem__(n, r), idle_s=5)
        pub = writer.publish("workers", "w", lambda: RECORDS["workers"])
        try:
            assert reader.lookup("workers", "w") == RECORDS["workers"]
            assert wait_until(lambda: seen.get("w") == RECORDS["workers"], timeout=10)
            first = reader.client.authentications
            assert first == 1
            time.sleep(3.5)  # the reader's token (TTL 2 s, unused) expires: it authenticates again
            assert reader.lookup("workers", "w") == RECORDS["workers"]
            assert reader.client.authentications > first
            assert not pub.last_error  # the writer's refreshes (every TTL/3 s) kept its token alive
            # The user may touch /pdkv/ only.
            with pytest.raises(EtcdRefused, match="permission denied"):
                reader.client.put("/elsewhere", b"x")
        finally:
            pub.close()
            watch.close()

    def test_options_from_the_environment(self, auth_etcd, monkeypatch, tmp_path):
        pw = tmp_path / "pw"
        pw.write_text(PASSWORD + "\n")
        monkeypatch.setenv("PDKV_ETCD_USER", "pdkv")
        monkeypatch.setenv("PDKV_ETCD_PASSWORD_FILE", str(pw))
        monkeypatch.delenv("PDKV_ETCD_PASSWORD", raising=False)
        reg = Registry(auth_etcd.url, ttl=TTL, credential=None)
        assert reg.client.options.user == "pdkv" and "pdkv-etcd-password" not in repr(reg.client.options)
        assert reg.list("workers") == ({}, reg.list("workers")[1])

    def test_options_are_checked(self):
        with pytest.raises(pdkv.InvalidArgument, match="user and a password"):
            EtcdOptions(user="u")
        with pytest.raises(pdkv.InvalidArgument, match="cert_file and key_file"):
            EtcdOptions(cert_file="c")
        with pytest.raises(pdkv.InvalidArgument, match="etcds://"):
            Registry("etcd://127.0.0.1:1", etcd=EtcdOptions(ca_file="/x"))
        assert parse_registry_url("etcds://h:1") == ("h", 1)
        with pytest.raises(pdkv.InvalidArgument):
            parse_registry_url("etcd://user:pw@h:1")  # never a password in the URL


# ---------------------------------------------------------------------- TLS
def _openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1 and a client certificate, by openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl binary")
    d = tmp_path_factory.mktemp("etcd-tls")
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
             "-subj", "/CN=pdkv test CA", cwd=d)
    for name in ("server", "client", "other", "nocn"):
        subj = "/O=pdkv" if name == "nocn" else f"/CN={name}"  # etcd auth + gateway: no CommonName
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", subj, cwd=d)
    for name in ("server", "client", "nocn"):
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", "ext.cnf", cwd=d)
    _openssl("x509", "-req", "-in", "other.csr", "-signkey", "other.key", "-out", "other.pem", "-days", "2",
             "-extfile", "ext.cnf", cwd=d)  # self-signed: not from the CA
    return d


@pytest.fixture
def tls_etcd(certs):
    if etcd_binary() is None:
        pytest.skip("no etcd binary (apt-get install etcd-server, or set PDKV_ETCD)")
    server = EtcdServer(tls=EtcdTLS(str(certs / "server.pem"), str(certs / "server.key"), str(certs / "ca.pem")))
    server.start()
    yield server
    server.close()


@needs_etcd
class TestEtcdTLS:
    def opts(self, certs, client="client") -> EtcdOptions:
        return EtcdOptions(ca_file=str(certs / "ca.pem"), cert_file=str(certs / f"{client}.pem"),
                           key_file=str(certs / f"{client}.key"))

    def test_publish_lookup_watch_over_tls_with_a_client_certificate(self, tls_etcd, certs):
        assert tls_etcd.url.startswith("etcds://")
        reg = Registry(tls_etcd.url, ttl=TTL, credential=Credential(SECRET), etcd=self.opts(certs))
        seen: dict = {}
        watch = reg.watch("workers", lambda n, r: seen.__setitem__(n, r), idle_s=5)
        pub = reg.publish("workers", "w", lambda: RECORDS["workers"])
        try:
            assert reg.lookup("workers", "w") == RECORDS["workers"]
            assert wait_until(lambda: seen.get("w") == RECORDS["workers"], timeout=10)
        finally:
            pub.close()
            watch.close()

    def test_plain_http_to_a_tls_etcd_fails(self, tls_etcd):
        reg = Registry(tls_etcd.url.replace("etcds://", "etcd://"), ttl=TTL, credential=None, etcd=None, timeout=2)
        with pytest.raises(pdkv.PeerConnectionError):
            reg.lookup("workers", "w")

    def test_no_client_certificate_is_refused(self, tls_etcd, certs):
        reg = Registry(tls_etcd.url, ttl=TTL, credential=None, etcd=EtcdOptions(ca_file=str(certs / "ca.pem")),
                       timeout=2)
        with pytest.raises(pdkv.PeerConnectionError, match="unreachable"):
            reg.lookup("workers", "w")

    def test_a_client_certificate_from_another_ca_is_refused(self, tls_etcd, certs):
        reg = Registry(tls_etcd.url, ttl=TTL, credential=None, etcd=self.opts(certs, "other"), timeout=2)
        with pytest.raises(pdkv.PeerConnectionError, match="unreachable"):
            reg.lookup("workers", "w")

    def test_a_server_not_signed_by_the_trusted_ca_is_refused(self, tls_etcd, certs):
        opts = EtcdOptions(ca_file=str(certs / "other.pem"), cert_file=str(certs / "client.pem"),
                           key_file=str(certs / "client.key"))
        reg = Registry(tls_etcd.url, ttl=TTL, credential=None, etcd=opts, timeout=2)
        with pytest.raises(pdkv.PeerConnectionError, match="CERTIFICATE_VERIFY_FAILED|certificate verify"):
            reg.lookup("workers", "w")

    def test_tls_with_user_password(self, certs):
        """Both at once. etcd 3.4's gateway, with auth enabled, refuses client
        certificates that carry a CommonName (it would not use it): pdkv says so."""
        if etcd_binary() is None:
            pytest.skip("no etcd binary")
        tls = EtcdTLS(str(certs / "server.pem"), str(certs / "server.key"), str(certs / "ca.pem"))
        with EtcdServer(tls=tls, args=["--bcrypt-cost", "4"]) as server:
            enable_auth(server.client(self.opts(certs)), "pdkv", PASSWORD)
            good = EtcdOptions(user="pdkv", password=PASSWORD, ca_file=str(certs / "ca.pem"),
                               cert_file=str(certs / "nocn.pem"), key_file=str(certs / "nocn.key"))
            reg = Registry(server.url, ttl=TTL, credential=Credential(SECRET), etcd=good)
            pub = reg.publish("workers", "w", lambda: RECORDS["workers"])
            try:
                assert reg.lookup("workers", "w") == RECORDS["workers"]
            finally:
                pub.close()
            with_cn = EtcdOptions(user="pdkv", password=PASSWORD, ca_file=str(certs / "ca.pem"),
                                  cert_file=str(certs / "client.pem"), key_file=str(certs / "client.key"))
            with pytest.raises(EtcdRefused, match="no CommonName"):
                Registry(server.url, ttl=TTL, credential=None, etcd=with_cn).lookup("workers", "w")
