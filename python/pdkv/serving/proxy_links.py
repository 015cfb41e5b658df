"""The health of each prefill -> decode worker pair as the proxy saw it: the outcome
of every KV transfer and link check between them, counted by kind (authentication,
transport, other), and the startup check that asks every prefill worker to connect
to every decode worker's agent (``/pd/check_peer``)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from .metrics import Counter
from .proxy_client import WorkerClient
from .proxy_config import ProxyConfig, ProxyMode
from .proxy_pool import PoolWorker, WorkerPool

__all__ = ["LinkHealth", "error_kind"]


class LinkHealth:
    """Prefill -> decode links: (prefill URL, decode URL) -> health.

    Parameters
    ----------
    config : ProxyConfig
    prefill, decode : WorkerPool
    client : WorkerClient
    auth_failures, transport_errors : Counter
        ``pdkv_peer_auth_failures_total`` and ``pdkv_peer_transport_errors_total``
        (prefill, decode).
    """

    def __init__(self, config: ProxyConfig, prefill: WorkerPool, decode: WorkerPool, client: WorkerClient,
                 auth_failures: Counter, transport_errors: Counter) -> None:
        self.config = config
        self.prefill = prefill
        self.decode = decode
        self._client = client
        self.m_peer_auth = auth_failures
        self.m_peer_transport = transport_errors
        self._links: dict[tuple[str, str], dict[str, Any]] = {}

    def report(self) -> list[dict[str, Any]]:
        """Each prefill -> decode worker pair seen so far: ``auth_failures``,
        ``transport_errors`` (counts), ``last_error`` and ``ok`` (the last KV transfer or
        link check between them succeeded)."""
        return [{"prefill": p, "decode": d, **v} for (p, d), v in sorted(self._links.items())]

    def event(self, prefill: str, decode: str, error: str) -> str:
        """Records a transfer or check outcome between two workers ('' error: success);
        returns its kind: ok, auth, transport or other."""
        link = self._links.setdefault((prefill, decode), {"auth_failures": 0, "transport_errors": 0,
                                                          "last_error": "", "ok": True})
        if not error:
            link["ok"] = True
            return "ok"
        link["ok"] = False
        link["last_error"] = error
        kind = error_kind(error)
        if kind == "auth":
            link["auth_failures"] += 1
            self.m_peer_auth.inc((prefill, decode))
        elif kind == "transport":
            link["transport_errors"] += 1
            self.m_peer_transport.inc((prefill, decode))
        return kind

    async def check_all(self, timeout: float) -> list[dict[str, Any]]:
        """Asks every prefill worker to connect to every decode worker's agent now
        (``/pd/check_peer``: metadata and transport handshake, both authenticated).
        Waits up to ``timeout`` s for the workers to report their info first; workers
        that do not are skipped. Returns the failed pairs (``prefill``, ``decode``,
        ``kind``, ``error``)."""
        if self.config.mode is ProxyMode.COLOCATED:
            return []
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while any(w.info is None for w in self.prefill.workers + self.decode.workers) and loop.time() < end:
            await asyncio.sleep(0.1)

        async def check(p: PoolWorker, d: PoolWorker) -> dict[str, Any] | None:
            assert d.info is not None and d.info.agent is not None
            body = {"agent": d.info.agent.get("address", ""), "timeout": max(min(end - loop.time(), 10.0), 1.0)}
            for attempt in range(4):
                try:
                    async with self._client.post(p.url + "/pd/check_peer", body,
                                                 timeout=aiohttp.ClientTimeout(total=body["timeout"] + 5)) as r:
                        res = await r.json(content_type=None) if r.status == 200 else \
                            {"ok": False, "error": f"/pd/check_peer answered HTTP {r.status}"}
                        if r.status in (401, 403):
                            p.refused(r.status, "/pd/check_peer")
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                    res = {"ok": False, "error": f"prefill worker unreachable: {type(e).__name__}: {e}"}
                err = "" if res.get("ok") else str(res.get("error") or "unknown error")
                # An agent briefly refuses a whole host after failed authentications
                # under many agent names there (guard.h): no verdict on this pair yet.
                if "too many failed authentications" not in err or attempt == 3:
                    break
                await asyncio.sleep(0.5 * (attempt + 1))
            kind = self.event(p.url, d.url, err)
            return None if kind == "ok" else {"prefill": p.url, "decode": d.url, "kind": kind, "error": err}

        pairs = [(p, d) for p in self.prefill.workers if p.info is not None and p.compatible
                 for d in self.decode.workers if d.info is not None and d.compatible and d.info.agent]
        got = await asyncio.gather(*(check(p, d) for p, d in pairs))
        return [x for x in got if x is not None]


_TRANSPORT_ERRORS = ("PeerConnectionError", "TransferTimeout", "ProtocolError", "VersionMismatch", "StalePeer",
                     "prefill worker unreachable")


def error_kind(error: str) -> str:
    """The kind of a KV error as the prefill worker words it (``"Type: message"``)."""
    if error.startswith("AuthFailed"):
        return "auth"
    if error.startswith(_TRANSPORT_ERRORS):
        return "transport"
    return "other"
