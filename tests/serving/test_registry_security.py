"""The forged-registration attack (issue 26, item 3) fails: an etcd writer without the
cluster secret registers a "worker" (a fake HTTP server on 127.0.0.1) under
/pdkv/workers/; a proxy with the secret never routes to it, never probes it, and no
agent connects to it; users' requests are answered by the genuine workers with outputs
equal to ``generate``; the proxy counts the refused records in its metrics. A proxy
without the secret (the control) does reach the fake: the test would see the attack."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("aiohttp")

from pdkv.credential import Credential  # noqa: E402
from pdkv.discovery import EtcdClient, Registry, canonical_json  # noqa: E402
from servers import SECRET, Stack, completion_ids, get, tiny  # noqa: E402, F401 (tiny: a fixture)

TTL = 2


class FakeWorker:
    """A TCP listener on 127.0.0.1 that counts every connection (HTTP or agent) made to it."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


def rotation(proxy: str) -> set[str]:
    return {w["url"] for w in json.loads(get(proxy + "/health")[1])["workers"]}


def rejected(proxy: str) -> dict[tuple[str, str], float]:
    out = {}
    for line in get(proxy + "/metrics")[1].splitlines():
        if line.startswith("pdkv_discovery_rejected_records_total{"):
            labels, value = line.rsplit(" ", 1)
            d = dict(p.split("=", 1) for p in labels[labels.index("{") + 1:-1].split(","))
            out[(d["kind"].strip('"'), d["reason"].strip('"'))] = float(value)
    return out


def forge(client: EtcdClient, lease: int, fake: FakeWorker, dec_id: str, prefix: str, tag: str) -> None:
    """Every forgery a writer without the secret can make, each pointing at the fake
    (as a decode worker and as a prefill worker)."""
    genuine_value = client.get_kv(f"{prefix}/workers/{dec_id}")
    assert genuine_value is not None
    genuine = json.loads(genuine_value.value)
    for role in ("prefill", "decode"):
        rec = dict(genuine["record"], url=fake.url, role=role)
        key = f"{prefix}/workers/evil-{tag}-{role}"
        client.put(key + "-unsigned", canonical_json(rec), lease=lease)
        other = Registry("etcd://127.0.0.1:1", credential=Credential("not-the-secret"), etcd=None)
        client.put(key + "-other-secret", other.seal(key + "-other-secret", canonical_json(rec), lease), lease=lease)
        tampered = dict(genuine, record=rec)  # the genuine MAC, the fake's URL
        client.put(key + "-tampered", json.dumps(tampered).encode(), lease=genuine_value.lease)
    client.put(f"{prefix}/workers/evil-{tag}-copied", genuine_value.value, lease=genuine_value.lease)


def test_forged_worker_registration_gets_no_request(tiny, etcd, monkeypatch):
    fake = FakeWorker()
    forger = EtcdClient("127.0.0.1", etcd.port)
    lease = forger.grant(60)
    s = Stack()
    try:
        reg = dict(registry=etcd.url, registry_ttl=TTL)
        pre = s.worker(tiny, "prefill", **reg)
        dec = s.worker(tiny, "decode", **reg)
        dec_id = s.workers[dec].registration.id
        forge(forger, lease, fake, dec_id, "/pdkv", "early")  # seen by the proxy's first listing
        monkeypatch.setenv("PDKV_SECRET", SECRET)  # the proxy has the cluster secret
        proxy = s.proxy("disagg", decode=[], registry=etcd.url)
        forge(forger, lease, fake, dec_id, "/pdkv", "late")  # seen by its watch
        deadline = time.monotonic() + 10
        while sum(rejected(proxy).values()) < 14 and time.monotonic() < deadline:
            time.sleep(0.1)
        counts = rejected(proxy)
        assert counts.get(("workers", "unsigned"), 0) >= 4, counts
        assert counts.get(("workers", "bad_mac"), 0) >= 10, counts  # other secret, tampered, copied
        assert rotation(proxy) == {pre, dec}
        for prompt, ref in zip(tiny.prompts, tiny.refs):
            ids, _ = completion_ids(proxy, tiny.name, prompt)
            assert ids == ref
        time.sleep(1.0)  # liveness probes and info fetches would have come by now
        assert fake.connections == 0, "the proxy or an agent connected to the forged worker"
        # The proxy's own registration is signed, the genuine workers' too.
        assert set(Registry(etcd.url, credential=Credential(SECRET), etcd=None).list("workers")[0]) == \
            {s.workers[pre].registration.id, dec_id}

        # Control: the forgeries are there for a reader that checks nothing (a proxy cannot
        # run without the cluster secret any more: it signs every worker call), naming the fake.
        unchecked = Registry(etcd.url, credential=None, etcd=None).list("workers")[0]
        assert sum(fake.url in str(r) for r in unchecked.values()) >= 4, unchecked
    finally:
        s.close()
        fake.close()
        forger.revoke(lease)
