"""The sitecustomize that VllmInstance(fair_spin=True) puts first on vLLM's PYTHONPATH
(pdkv/integrations/vllm_fair_spin): vLLM's spin-waits call time.sleep(0) instead of
os.sched_yield(), which under EEVDF starves a yielding waiter next to a busy task on
its core (see the module's docstring). Checked without vLLM: what the module does to
a fresh interpreter, and that VllmInstance puts it on the path."""

import os
import subprocess
import sys

from pdkv.integrations import vllm_deploy

PROBE = ("import os, time\n"
         "print(os.sched_yield.__module__, os.sched_yield.__name__)\n"
         "os.sched_yield()\n")


def _run(env_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if env_path is not None:
        env["PYTHONPATH"] = env_path
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=60)


def test_fair_spin_replaces_sched_yield_in_every_process_that_starts():
    p = _run(vllm_deploy.FAIR_SPIN_DIR)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["sitecustomize", "_fair_yield"]


def test_a_sitecustomize_it_shadows_still_runs(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("print('the other sitecustomize ran')\n")
    p = _run(os.pathsep.join([vllm_deploy.FAIR_SPIN_DIR, str(tmp_path)]))
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines() == ["the other sitecustomize ran", "sitecustomize _fair_yield"]


def test_without_it_sched_yield_is_the_system_call():
    p = _run(None)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["posix", "sched_yield"]


def test_vllm_instance_puts_it_first_on_the_path(monkeypatch, tmp_path):
    spawned = {}

    def fake_spawn(self, cmd, env, log_path):
        spawned["env"] = env

    monkeypatch.setattr(vllm_deploy.VllmInstance, "_spawn", fake_spawn)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    vllm_deploy.VllmInstance("model", wait=False, log_dir=tmp_path)
    assert spawned["env"]["PYTHONPATH"].split(os.pathsep) == [vllm_deploy.FAIR_SPIN_DIR, "/elsewhere"]
    vllm_deploy.VllmInstance("model", wait=False, log_dir=tmp_path, fair_spin=False)
    assert spawned["env"]["PYTHONPATH"] == "/elsewhere"
