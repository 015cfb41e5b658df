"""``pdkv bench serve --link RATE[,rtt=..]``: every serving process on its own lab host.

One :mod:`pdkv.lab.netlab.testbed` lab for the whole run: the proxy on h0, prefill workers on
h1..hP, decode (or colocated) workers on the hosts after them, each behind the
emulated link, so every KV byte between prefill and decode crosses it over tcp
(lab hosts have distinct host ids: shm is never chosen between them). The benchmark
client runs on a thread of this process inside h0, next to the proxy.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from pdkv.lab.netlab.testbed import Lab


def hosts_needed(num_prefill: int, num_decode: int, replicas: int) -> int:
    """h0 for the proxy and one host per worker of the largest deployment of the run."""
    return 1 + max(num_prefill + num_decode, replicas)


def placement(lab: Lab, num_prefill: int) -> Callable[[str, int], tuple[Sequence[str], str]]:
    """``Deployment.placement`` putting each process on its own lab host."""
    def place(role: str, index: int) -> tuple[Sequence[str], str]:
        host = "h0" if role == "proxy" else f"h{1 + index + (num_prefill if role == 'decode' else 0)}"
        return lab.prefix(host), lab.address(host)

    return place


def client_runner(lab: Lab) -> Callable[[Any], Any]:
    """``asyncio.run`` on a thread inside h0 (where the proxy listens)."""
    import asyncio

    return lambda coro: lab.call_in("h0", asyncio.run, coro)


def describe(lab: Lab) -> dict[str, Any]:
    return {"spec": str(lab.link), "rate_bps": lab.link.rate_bps, "rtt_s": lab.link.rtt_s,
            "rtt_emulated": lab.info["rtt_emulated"], "delay": lab.info.get("delay"), "hosts": len(lab.hosts), "proxy_host": "h0"}
