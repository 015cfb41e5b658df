"""The prefill half of a disaggregated request: a prefill worker computes the prompt
into the blocks a decode worker reserved, answers the first token and reports how the
KV push went (:class:`PrefillLeg`). A failure there never fails the request: the
caller makes the decode worker recompute the prompt."""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator, Callable

import aiohttp

from .frontend import RequestTrace, TokenOut
from .protocol import GenParams, KVResult, PrefillRequest, Reservation
from .proxy_client import WorkerClient, as_dict, done_with, error_message
from .proxy_config import ProxyConfig
from .proxy_links import LinkHealth
from .proxy_liveness import Liveness
from .proxy_kv import KVRouting, RoutePlan
from .proxy_metrics import ProxyMetrics
from .proxy_pool import PoolWorker, WorkerFailed, WorkerPool

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
    kv : KVRouting, optional
        ``--routing kv``: picks the prefill worker by the KV it (and the decode worker)
        holds, and leases a third worker's blocks (see :mod:`pdkv.serving.proxy_kv`).
    """

    def __init__(self, config: ProxyConfig, pool: WorkerPool, client: WorkerClient, liveness: Liveness,
                 links: LinkHealth, metrics: ProxyMetrics, kv: KVRouting | None = None) -> None:
        self.config = config
        self.pool = pool
        self._client = client
        self._liveness = liveness
        self._links = links
        self._metrics = metrics
        self._kv = kv

    async def run(self, rid: str, prompt: list[int], params: GenParams, res: Reservation,
                  trace: RequestTrace, out: PrefillOutcome, *, plan: RoutePlan | None = None
                  ) -> AsyncIterator[TokenOut]:
        """Runs the prompt on a prefill worker: yields the first token, fills ``out``.

        Never raises for a prefill-side failure: ``out.kv_ok`` stays False and the
        caller makes the decode worker recompute. With a ``plan`` (KV routing) the
        worker is picked by what it holds, and a third worker's lease may go with the
        request as ``src`` (released when this ends).
        """
        body = PrefillRequest(rid, tuple(prompt), params, res, self.config.kv_timeout_s).to_json()
        if plan is None or self._kv is None:
            async for tok in self._run(body, len(prompt), trace, out, lambda ex: self.pool.pick(ex)):
                yield tok
            return
        kv = self._kv
        # What the decode worker holds: its reservation's cached blocks (exact) or the index's figure.
        have_d = max(plan.decode_tokens, int(getattr(res, "cached_blocks", 0) or 0) * res.block_tokens)
        first = kv.pick_prefill(plan, have_d, set())
        if first is not None:
            lease = await kv.lease(rid, plan, first.url, trace.decode_worker,
                                   max(have_d, plan.matched.get(first.url, 0)))
            if lease is not None:
                body["src"] = lease
                trace.extra["kv_lease_worker"] = plan.lease_worker
        picks = iter([first])

        def pick(ex: set[str]) -> PoolWorker | None:
            p = next(picks, None)
            return p if p is not None and p.url not in ex else kv.pick_prefill(plan, have_d, ex)

        try:
            async for tok in self._run(body, len(prompt), trace, out, pick):
                yield tok
        finally:
            if plan.lease is not None:
                kv.release(plan.lease_worker, plan.lease["lease_id"])

    async def _run(self, body: dict, n_prompt: int, trace: RequestTrace, out: PrefillOutcome,
                   pick: Callable[[set[str]], PoolWorker | None]) -> AsyncIterator[TokenOut]:
        cfg = self.config
        exclude: set[str] = set()
        out.error = "no prefill worker is available"
        for _attempt in range(cfg.retries + 1):
            p = pick(exclude)
            if p is None:
                return
            trace.prefill_worker = p.url
            p.in_flight += 1
            p.load_tokens += n_prompt
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
                            p.load_tokens -= n_prompt
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
                    p.load_tokens -= n_prompt

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
