"""The proxy's metrics (``/metrics``): routing, KV transfers, failures, retries,
migrations and role changes as they happen, and each worker's queue, batch and free
KV blocks polled from its ``/pd/stats`` when the metrics are read."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import aiohttp

from .metrics import Registry
from .proxy_client import WorkerClient
from .proxy_pool import PoolWorker

__all__ = ["ProxyMetrics"]


class ProxyMetrics:
    """The proxy's counters, gauges and histograms, added to ``registry``.

    Parameters
    ----------
    registry : Registry
    workers : callable
        Returns every worker of both pools now.
    rejected_records : callable
        The registry records the proxy's watch ignored (see
        :meth:`~pdkv.serving.proxy_discovery.WorkerDiscovery.rejected_records`).
    """

    def __init__(self, registry: Registry, workers: Callable[[], list[PoolWorker]],
                 rejected_records: Callable[[], list[Any]]) -> None:
        self._workers = workers
        r = registry
        self.m_reroles = r.counter("pdkv_worker_reroles_total", "Workers moved between the prefill and decode pools "
                                   "(from -> to), and switches given up (result).", ("from", "to", "result"))
        self.m_routed = r.counter("pdkv_routed_requests_total",
                                  "Requests by route: disagg (prefill worker + KV transfer) or local.", ("route",))
        # Apart from m_routed, so that summing it over its labels counts requests once.
        self.m_kv_picks = r.counter("pdkv_kv_decode_picks_total",
                                    "KV-aware routing's decode picks by how each was made: kv_prefix (the chosen "
                                    "worker held part of the prompt), kv_load (another held more but was busier), "
                                    "kv_session (affinity) or kv_cold (neither); a retried request is picked again.",
                                    ("how",))
        self.m_kv = r.counter("pdkv_kv_transfers_total", "KV transfers by result (ok, failed, none).", ("result",))
        self.m_kv_bytes = r.counter("pdkv_kv_transfer_bytes_total", "KV bytes moved, by transport.", ("transport",))
        self.m_kv_time = r.histogram("pdkv_kv_transfer_span_seconds", "KV transfer span, post to completion "
                                     "(a layer-wise stream: from its open, overlapping the prefill).", ("transport",))
        self.m_kv_tail = r.histogram("pdkv_kv_transfer_tail_seconds", "KV transfer time after the prefill ended "
                                     "(what it adds to the second token).", ("transport",))
        self.m_kv_wire_time = r.histogram("pdkv_kv_transfer_wire_seconds", "KV transfer time with bytes on the "
                                          "wire.", ("transport",))
        self.m_recompute = r.counter("pdkv_kv_recomputes_total",
                                     "Prompts recomputed on the decode worker because their KV did not arrive.",
                                     ("reason",))
        self.m_failures = r.counter("pdkv_worker_failures_total",
                                    "Times a worker was taken out of rotation because it failed a request or a "
                                    "liveness probe, by worker.",
                                    ("role", "worker"))
        self.m_retries = r.counter("pdkv_request_retries_total", "Requests moved to another worker.")
        self.m_migrations = r.counter("pdkv_request_migrations_total",
                                      "Streams continued on another decode worker after tokens were sent.")
        r.gauge("pdkv_worker_in_flight", "Requests the proxy has in flight at each worker.", ("role", "worker")) \
            .set_function(lambda: [((w.role, w.url), w.in_flight) for w in self._workers()])
        self.m_up = r.gauge("pdkv_worker_up", "1 if the worker answered the last poll.", ("role", "worker"))
        self.m_queue = r.gauge("pdkv_worker_queue_depth", "Requests queued in each worker's engine.",
                               ("role", "worker"))
        self.m_running = r.gauge("pdkv_worker_running", "Requests in each worker's running batch.",
                                 ("role", "worker"))
        self.m_free = r.gauge("pdkv_worker_free_kv_blocks", "Free KV blocks of each worker.", ("role", "worker"))
        self.m_peer_auth = r.counter("pdkv_peer_auth_failures_total",
                                     "KV transfers or link checks that failed because the decode worker's agent "
                                     "refused the prefill worker's secret, by worker pair.", ("prefill", "decode"))
        self.m_peer_transport = r.counter("pdkv_peer_transport_errors_total",
                                          "KV transfers or link checks that failed in the transport (connection, "
                                          "protocol, timeout), by worker pair.", ("prefill", "decode"))
        r.counter("pdkv_discovery_rejected_records_total", "etcd records ignored because they were unsigned, "
                  "wrongly signed, moved, altered, on another lease, future-dated or replayed, by kind and reason.",
                  ("kind", "reason")) \
            .set_function(rejected_records)

    async def refresh(self, client: WorkerClient) -> None:
        """Polls every worker's ``/pd/stats`` into the per-worker gauges."""
        async def poll(w: PoolWorker) -> None:
            labels = (w.role, w.url)
            try:
                async with client.get(w.url + "/pd/stats", timeout=aiohttp.ClientTimeout(total=1.0)) as r:
                    st = await r.json() if r.status == 200 else None
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                st = None
            self.m_up.set(1 if st is not None else 0, labels)
            if isinstance(st, dict):
                w.stats = st
                self.m_queue.set(st.get("waiting", 0), labels)
                self.m_running.set(st.get("running", 0), labels)
                self.m_free.set(st.get("free_blocks", 0), labels)

        await asyncio.gather(*(poll(w) for w in self._workers()))
