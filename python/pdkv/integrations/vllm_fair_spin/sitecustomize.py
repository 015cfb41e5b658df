"""Loaded (as ``sitecustomize``) into the vLLM processes that
:class:`pdkv.integrations.vllm_deploy.VllmInstance` starts with ``fair_spin=True``
(the default): their directory is put first on ``PYTHONPATH``, so every process of the
instance (API server, EngineCore, workers) imports this at start-up.

vLLM's processes wait for each other's messages by spinning on shared memory, calling
``os.sched_yield()`` between looks (``vllm.distributed.utils.sched_yield``, the only
caller of ``os.sched_yield`` in vLLM). Under the kernel's EEVDF scheduler (Linux 6.6
and later) a task that yields in a loop pushes its own deadline back on every call
and gets almost no CPU while another busy task shares its core: measured on this
2-core VM (kernel 6.18), a yielding loop next to a plain spinning loop on one core got
0.05 s of CPU in 5 s; with ``time.sleep(0)`` instead it got 1.4 s. In a deployment
where two vLLM instances share a core (the tests and benchmarks here), one instance's
worker busy-stepping while it waits for the other starved the other's worker for
tens of seconds (decode's worker runnable and not run for 18 s; pulls of 17 s).

``time.sleep(0)`` is what vLLM itself uses on Pythons before 3.11.1: it releases the
GIL like ``os.sched_yield`` and returns, without the yield's deadline penalty, so the
waiting worker keeps its fair share of the core. Nothing else in these processes
calls ``os.sched_yield`` from Python.
"""

import os
import sys
import time


def _fair_yield() -> None:
    time.sleep(0)


def _run_shadowed_sitecustomize() -> None:
    """Being first on the path, this module hides any other ``sitecustomize`` (Debian's
    Pythons ship one): run the next one on the path, as Python would have."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


os.sched_yield = _fair_yield
_run_shadowed_sitecustomize()
