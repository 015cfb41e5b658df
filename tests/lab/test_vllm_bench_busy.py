"""pdkv.lab.vllm.bench's busy conditions without vLLM: the CPU lists and the background requests."""

from __future__ import annotations

import threading
import time

from pdkv.lab.vllm.bench import _Background, _cpu_list


def test_cpu_lists():
    assert _cpu_list("0") == [0] and _cpu_list("0-2") == [0, 1, 2] and _cpu_list("1,3-4") == [1, 3, 4]


class _Proxy:
    def __init__(self, fail_first: int = 0) -> None:
        self.calls, self.fail_first, self.lock = [], fail_first, threading.Lock()

    def complete(self, prompt, max_tokens):
        with self.lock:
            self.calls.append((len(prompt), max_tokens))
            if len(self.calls) <= self.fail_first:
                raise ConnectionError("not ready")
        time.sleep(0.01)
        return {}


def test_background_keeps_requests_in_flight_and_stops():
    proxy = _Proxy(fail_first=1)
    with _Background(proxy, 2, 64) as bg:
        assert len(bg.threads) == 2
    assert all(not t.is_alive() for t in bg.threads)
    assert bg.done >= 2 and len(proxy.calls) >= bg.done + 1  # a failed request is retried, not counted
    assert {c for c in proxy.calls} == {(32, 64)}
    n = len(proxy.calls)
    time.sleep(0.1)
    assert len(proxy.calls) == n  # nothing runs after the block


def test_no_background_is_a_no_op():
    proxy = _Proxy()
    with _Background(proxy, 0, 64) as bg:
        pass
    assert bg.threads == [] and proxy.calls == []


def test_kv_cpus_reach_the_pdkv_connector_config_only(tmp_path):
    from pdkv.lab.vllm.bench import _kv_config

    def extra(name, kv_cpus):
        cfg = _kv_config(name, "kv_consumer", tmp_path / "t", tmp_path / "s", kv_cpus)
        return cfg["kv_connector_extra_config"]

    assert "kv_cpus" not in extra("pdkv-tcp", "")
    assert extra("pdkv-tcp", "all")["kv_cpus"] == "all"
    assert extra("pdkv", "0,1")["kv_cpus"] == [0, 1]
    assert "kv_cpus" not in extra("nixl", "all")  # NixlConnector has no such option


def test_bad_kv_cpus_are_refused(capsys):
    import pytest

    from pdkv.lab.vllm.bench import main

    with pytest.raises(SystemExit):
        main(["--kv-cpus", "0;1", "--out", "/nonexistent/never-written"])
    assert "--kv-cpus must be 'all' or CPU numbers" in capsys.readouterr().err
