"""Serving across lab hosts (pdkv.lab.netlab.testbed): proxy, prefill and decode worker each on its own
network-namespace host behind a 1 Gbit/s link. Greedy output equals ``generate`` and the
KV crosses the link over tcp (hosts have distinct host ids, so shm is never chosen).
Needs root (skips with the reason elsewhere), torch, transformers, aiohttp."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("aiohttp")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))

from pdkv.lab.netlab import testbed as netlab  # noqa: E402
from pdkv.lab.serve import link as serve_link  # noqa: E402
from pdkv.serving.launch import Deployment  # noqa: E402
from servers import completion_ids, tiny  # noqa: E402, F401 (tiny: a fixture)

pytestmark = [pytest.mark.netns, pytest.mark.slow]  # three processes, about 15 s on two cores

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lab():
    try:
        lab = netlab.Lab(hosts=3, link="1gbit").up()
    except netlab.NetlabUnavailable as e:
        pytest.skip(str(e))
    yield lab
    lab.down()


def test_disagg_across_lab_hosts_equals_generate(tiny, lab, tmp_path):
    dep = Deployment("disagg", tiny.model_dir, num_prefill=1, num_decode=1,
                     worker_args=["--block-tokens", "4", "--num-blocks", "256", "--max-num-seqs", "8"],
                     placement=serve_link.placement(lab, num_prefill=1), log_dir=tmp_path)
    with dep:
        assert dep.url.startswith("http://10.211.0.1:")
        assert [w.url.split(":")[1] for w in dep.workers] == ["//10.211.0.2", "//10.211.0.3"]
        results = lab.call_in("h0", lambda: [completion_ids(dep.url, tiny.name, p) for p in tiny.prompts])
    assert [ids for ids, _ in results] == tiny.refs
    assert {st["kv_transport"] for _, st in results} == {"tcp"}


def test_bench_serve_link_checks_its_spec_first():
    env = {**os.environ, "PYTHONPATH": str(REPO / "python")}
    p = subprocess.run([sys.executable, "-m", "pdkv.cli", "bench", "serve", "--link", "1gbti"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert p.returncode == 2
    assert "InvalidArgument: link '1gbti': cannot parse rate" in p.stderr
