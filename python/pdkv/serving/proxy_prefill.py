"""The prefill half of a disaggregated request: a prefill worker computes the prompt
into the blocks a decode worker reserved, answers the first token and reports how the
KV push went (:class:`PrefillLeg`). A failure there never fails the request: the
caller makes the decode worker recompute the prompt."""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator

import aiohttp

from .frontend import RequestTrace, TokenOut
from .protocol import GenParams, KVResult, PrefillRequest, Reservation
from .proxy_client import WorkerClient, as_dict, done_with, error_message
from .proxy_config import ProxyConfig
from .proxy_links import LinkHealth
from .proxy_liveness import Liveness
from .proxy_metrics import ProxyMetrics
from .proxy_pool import WorkerFailed, WorkerPool

__all__ = ["PrefillLeg", "PrefillOutcome"]


@dataclass
class PrefillOutcome:
    """What :meth:`PrefillLeg.run` found out (the first token, whether the KV arrived)."""

    first_token: int | None = None
    finish: str | None = None
    kv_ok: bool = False
    terminal: bool = True
    error: str = ""


class PrefillLeg:
    """Runs prompts on the prefill pool.

    Parameters
    ----------
    config : ProxyConfig
    pool : WorkerPool
        The prefill workers.
    client : WorkerClient
    liveness : Liveness
    links : LinkHealth
        Told the outcome of every KV push between two workers.
    metrics : ProxyMetrics
    """

    def __init__(self, config: ProxyConfig, pool: WorkerPool, client: WorkerClient, liveness: Liveness,
                 links: LinkHealth, metrics: ProxyMetrics) -> None:
        self.config = config
        self.pool = pool
        self._client = client
        self._liveness = liveness
        self._links = links
        self._metrics = metrics

    async def run(self, rid: str, prompt: list[int], params: GenParams, res: Reservation,
                       trace: RequestTrace, out: PrefillOutcome) -> AsyncIterator[TokenOut]:
        """Runs the prompt on a prefill worker: yields the first token, fills ``out``.

        Never raises for a prefill-side failure: ``out.kv_ok`` stays False and the
        caller makes the decode worker recompute.
        """
        cfg = self.config
        body = PrefillRequest(rid, tuple(prompt), params, res, cfg.kv_timeout_s).to_json()
        exclude: set[str] = set()
        out.error = "no prefill worker is available"
        for _attempt in range(cfg.retries + 1):
            p = self.pool.pick(exclude)
            if p is None:
                return
            trace.prefill_worker = p.url
            p.in_flight += 1
            p.load_tokens += len(prompt)
            waiting = True
            try:
                try:
                    r = await self._liveness.bounded(
                        p, self._client.post(p.url + "/pd/prefill", body, timeout=self._client.timeout()),
                        cfg.headers_timeout_s, "response headers")
                except (aiohttp.ClientError, OSError) as e:
                    # It never got the request: no write can come from it; try another.
                    self._liveness.mark_down(p, f"{type(e).__name__}: {e}")
                    exclude.add(p.url)
                    out.error = f"prefill worker {p.url}: {type(e).__name__}: {e}"
                    self._metrics.m_retries.inc()
                    continue
                try:
                    if r.status != 200:
                        if r.status in (401, 403):
                            p.refused(r.status, "/pd/prefill")
                            self._liveness.mark_down(p, f"/pd/prefill answered HTTP {r.status}")
                        out.error = f"prefill worker {p.url} answered HTTP {r.status}: {await r.text()}"[:500]
                        out.terminal = True
                        self._metrics.m_kv.inc(("failed",))
                        return
                    async for line in self._liveness.lines(p, r, cfg.kv_timeout_s, "first token or KV result"):
                        if "first" in line:
                            f = as_dict(line["first"])
                            out.first_token = int(f["t"])
                            out.finish = f.get("f")
                            waiting = False
                            p.load_tokens -= len(prompt)
                            yield TokenOut(out.first_token, out.finish)
                        elif "kv" in line:
                            kv = KVResult.from_json(line["kv"])
                            self._record_kv(kv, trace)
                            out.kv_ok, out.terminal, out.error = kv.ok, True, kv.error
                            p.served += 1
                            return
                        elif "error" in line:
                            out.error = f"prefill worker {p.url}: {error_message(line)}"
                            out.terminal = True  # it failed before writing anything
                            self._metrics.m_kv.inc(("failed",))
                            return
                    raise WorkerFailed(p, "the stream ended before the KV result")
                finally:
                    done_with(r)
            except WorkerFailed as e:
                # It had the request: a write may still come, so the decode worker must
                # not reuse the blocks at once (terminal=False).
                self._liveness.mark_down(p, str(e))
                out.error = f"prefill worker {p.url}: {e}"
                out.terminal = False
                self._metrics.m_kv.inc(("failed",))
                return
            finally:
                p.in_flight -= 1
                if waiting:
                    p.load_tokens -= len(prompt)

    def _record_kv(self, kv: KVResult, trace: RequestTrace) -> None:
        if trace.prefill_worker and trace.decode_worker and (kv.posted or kv.error):
            self._links.event(trace.prefill_worker, trace.decode_worker, "" if kv.ok else kv.error)
        trace.kv_bytes = kv.bytes
        trace.kv_seconds = kv.seconds
        trace.kv_tail_seconds = kv.tail_seconds
        trace.kv_wire_seconds = kv.wire_seconds
        trace.kv_transport = kv.transport
        trace.kv_error = kv.error
        trace.extra.update(prefill_cached_tokens=kv.cached_tokens, prefill_computed_tokens=kv.computed_tokens,
                           kv_pulled_tokens=kv.pulled_tokens, kv_pulled_bytes=kv.pulled_bytes,
                           kv_skipped_blocks=kv.skipped_blocks)
        if kv.ok:
            self._metrics.m_kv.inc(("ok" if kv.posted else "none",))
            if kv.posted and kv.bytes:
                self._metrics.m_kv_bytes.inc((kv.transport,), kv.bytes)
                self._metrics.m_kv_time.observe(kv.seconds, (kv.transport,))
                self._metrics.m_kv_tail.observe(kv.tail_seconds, (kv.transport,))
                self._metrics.m_kv_wire_time.observe(kv.wire_seconds, (kv.transport,))
        else:
            self._metrics.m_kv.inc(("failed",))
