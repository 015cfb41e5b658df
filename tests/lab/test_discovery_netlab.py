"""A registry deployment across lab hosts (pdkv.lab.netlab.testbed): etcd on h0, a prefill worker on
h1, a decode worker on h2, a proxy on h3 and a second proxy on h0. The workers register
in etcd, both proxies find them there, greedy outputs equal ``generate`` and the KV
crosses the link over tcp. Needs root and the etcd binary (skips with the reason
elsewhere), torch, transformers, aiohttp."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("aiohttp")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))

from pdkv.lab.netlab import testbed as netlab  # noqa: E402
from pdkv.credential import Credential, new_secret  # noqa: E402
from pdkv.discovery import Registry  # noqa: E402
from pdkv.discovery_etcd import EtcdServer, etcd_binary  # noqa: E402
from pdkv.serving.launch import Deployment, ServerProcess  # noqa: E402
from servers import completion_ids, get, tiny  # noqa: E402, F401 (tiny: a fixture)

pytestmark = [pytest.mark.netns, pytest.mark.slow,
              pytest.mark.skipif(etcd_binary() is None, reason="no etcd binary (apt-get install etcd-server, or set PDKV_ETCD)")]

HOSTS = {"prefill": "h1", "decode": "h2", "proxy": "h3"}


@pytest.fixture(scope="module")
def lab():
    try:
        lab = netlab.Lab(hosts=4, link="1gbit").up()
    except netlab.NetlabUnavailable as e:
        pytest.skip(str(e))
    yield lab
    lab.down()


def healthy(lab, host: str, url: str, timeout: float = 60.0) -> bool:
    """Whether the proxy at ``url`` reports healthy (both roles in rotation) in time."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        status, _ = lab.call_in(host, get, url + "/health")
        if status == 200:
            return True
        time.sleep(0.2)
    return False


def test_registry_deployment_across_lab_hosts(tiny, lab, tmp_path):
    etcd = lab.call_in("h0", EtcdServer, lab.address("h0"))
    lab.call_in("h0", etcd.start)
    second = None
    try:
        place = lambda role, i: (lab.prefix(HOSTS[role]), lab.address(HOSTS[role]))  # noqa: E731
        env = {"PDKV_SECRET": new_secret()}  # signs the workers' and proxies' records; both proxies check them
        dep = Deployment("disagg", tiny.model_dir, num_prefill=1, num_decode=1, registry=etcd.url,
                         registry_ttl=3, pin=False, placement=place, log_dir=tmp_path, env=env,
                         worker_args=["--block-tokens", "4", "--num-blocks", "256", "--max-num-seqs", "8"])
        with dep:
            second = ServerProcess("proxy", ["--mode", "disagg", "--registry", etcd.url, "--host", lab.address("h0")],
                                   log_path=tmp_path / "proxy-2.log", env=env,
                                   name="proxy-2", prefix=lab.prefix("h0")).start()
            second.wait_ready(60)
            cred = Credential(env["PDKV_SECRET"])
            workers = lab.call_in("h0", lambda: Registry(etcd.url, credential=cred).list("workers")[0])
            assert sorted((w["role"], w["url"].split(":")[1]) for w in workers.values()) == \
                [("decode", "//" + lab.address("h2")), ("prefill", "//" + lab.address("h1"))]
            for host, url in (("h3", dep.url), ("h0", second.url)):
                assert healthy(lab, host, url), lab.call_in(host, get, url + "/health")
                results = lab.call_in(host, lambda u=url: [completion_ids(u, tiny.name, p) for p in tiny.prompts])
                assert [ids for ids, _ in results] == tiny.refs
                assert {st["kv_transport"] for _, st in results} == {"tcp"}
                rotation = json.loads(lab.call_in(host, get, url + "/health")[1])["workers"]
                assert {w["url"] for w in rotation} == {w["url"] for w in workers.values()}
    finally:
        if second is not None:
            second.stop()
        etcd.close()


def test_documented_lab_command_serves_through_both_proxies(tiny, lab):
    """``python -m pdkv.lab.netlab.discovery --check``: its own three-host lab, etcd, 2 prefill,
    2 decode and 2 proxies; one completion through each proxy."""
    import os
    import subprocess

    env = {**os.environ, "PDKV_LOG": "error"}
    p = subprocess.run([sys.executable, "-m", "pdkv.lab.netlab.discovery", "--model", str(tiny.model_dir), "--check",
                        "--worker-args", "--block-tokens 4 --num-blocks 128 --max-num-seqs 4"],
                       capture_output=True, text=True, env=env, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert lines[0].startswith("lab ") and "(2 prefill)" in lines[0] and "(2 decode)" in lines[0]
    assert lines[1].startswith("etcd: etcd://10.211.")
    assert len([x for x in lines if x.startswith("proxy http://10.211.")]) == 2, p.stdout
