"""Request routing: which decode worker serves a request, whether its prompt goes
through a prefill worker first (disagg, hybrid) or is prefilled there (local), retries
on another worker, and the *migration* of a stream whose decode worker failed after
tokens were sent (see :mod:`pdkv.serving.proxy`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from typing import Any, AsyncIterator

import aiohttp

from pdkv.errors import InvalidArgument

from .frontend import RequestTrace, TokenOut
from .openai_api import APIError
from .protocol import GenerateRequest, GenParams, KVFailed, Reservation
from .proxy_client import WorkerClient, as_dict, check_status, done_with, raise_worker_error
from .proxy_config import ProxyConfig, ProxyMode
from .proxy_kv import KVRouting, RoutePlan
from .proxy_liveness import Liveness
from .proxy_metrics import ProxyMetrics
from .proxy_pool import PoolWorker, WorkerBusy, WorkerFailed, WorkerPool
from .proxy_prefill import PrefillLeg, PrefillOutcome
from .rerole import DemandWindow

__all__ = ["Router"]

log = logging.getLogger("pdkv.serving")


class Router:
    """Serves each request on the decode pool (through the prefill leg when disaggregated).

    Parameters
    ----------
    config : ProxyConfig
    decode : WorkerPool
        The decode workers (engine workers in colocated mode).
    prefill : PrefillLeg
    client : WorkerClient
    liveness : Liveness
    metrics : ProxyMetrics
    demand : DemandWindow, optional
        Told the prompt tokens and decoded tokens served (for re-roling).
    kv : KVRouting, optional
        ``--routing kv``: picks the decode worker by the KV it holds (see
        :mod:`pdkv.serving.proxy_kv`); default: the pool's least-loaded worker.
    """

    def __init__(self, config: ProxyConfig, decode: WorkerPool, prefill: PrefillLeg, client: WorkerClient,
                 liveness: Liveness, metrics: ProxyMetrics, demand: DemandWindow | None,
                 kv: KVRouting | None = None) -> None:
        self.config = config
        self.decode = decode
        self._prefill = prefill
        self._client = client
        self._liveness = liveness
        self._metrics = metrics
        self._demand = demand
        self._kv = kv
        self._traces: dict[str, RequestTrace] = {}  # request id -> its trace, while it runs

    def generate(self, rid: str, prompt: list[int], params: GenParams, trace: RequestTrace
                 ) -> AsyncIterator[TokenOut]:
        if self.config.mode is ProxyMode.COLOCATED or (self.config.mode is ProxyMode.HYBRID
                                                        and len(prompt) <= self.config.hybrid_threshold):
            self._metrics.m_routed.inc(("local",))
            return self._retrying(rid, prompt, params, trace, disagg=False)
        self._metrics.m_routed.inc(("disagg",))
        if self._demand is not None:
            self._demand.prefill(len(prompt))
        return self._traced(rid, trace, self._retrying(rid, prompt, params, trace, disagg=True))

    async def _traced(self, rid: str, trace: RequestTrace, gen: AsyncIterator[TokenOut]) -> AsyncIterator[TokenOut]:
        """``gen``, with ``trace`` findable by request id while it runs (see _kv_failed)."""
        self._traces[rid] = trace
        try:
            async for tok in gen:
                yield tok
        finally:
            self._traces.pop(rid, None)
            await gen.aclose()  # type: ignore[attr-defined]

    async def _retrying(self, rid: str, prompt: list[int], params: GenParams, trace: RequestTrace, *,
                        disagg: bool) -> AsyncIterator[TokenOut]:
        """Serves the request on one decode worker after another until one completes it.

        A worker that fails before any token was sent is simply replaced. One that
        fails after ``sent`` tokens is replaced by a *migration*: the next worker
        prefills ``prompt + sent`` itself and continues with ``max_tokens`` reduced by
        ``len(sent)`` and ``index_offset`` raised by it (the same seed, so the same
        random draws); the client's stream (detokenizer, stop strings, usage) goes on
        as if nothing happened.
        """
        exclude: set[str] = set()
        sent: list[int] = []
        finished = False
        last = ""
        plan = self._kv.plan(prompt, trace.session) if self._kv is not None else None
        for attempt in range(self.config.retries + 1):
            d = self.decode.pick(exclude) if plan is None else self._kv.pick_decode(plan, exclude)  # type: ignore
            if d is None:
                break
            arid = rid if attempt == 0 else f"{rid}.r{attempt}"
            trace.decode_worker = d.url
            if sent:
                left = params.max_tokens - len(sent)
                if left < 1:  # cannot happen (the last token carries the finish reason)
                    yield TokenOut(None, "length")
                    return
                trace.route = "local"
                trace.extra["migrated_after_tokens"] = len(sent)
                self._metrics.m_migrations.inc()
                log.warning("request %s: continuing on decode worker %s after %d tokens (%s)", rid, d.url,
                            len(sent), last)
                gen = self._local_on(d, arid, prompt + sent, dataclasses.replace(
                    params, max_tokens=left, index_offset=params.index_offset + len(sent)), trace)
            else:
                trace.route = "disagg" if disagg else "local"
                gen = self._disagg_on(d, arid, prompt, params, trace, plan) if disagg else \
                    self._local_on(d, arid, prompt, params, trace)
            try:
                async for tok in gen:
                    if tok.token_id is not None:
                        sent.append(tok.token_id)
                        if self._demand is not None and (len(sent) > 1 or not disagg):
                            self._demand.decode_tokens()  # disagg: the first token is the prefill's
                    finished = finished or tok.finish_reason is not None
                    yield tok
                return
            except WorkerBusy as e:
                last = f"{d.url}: {e}"
            except WorkerFailed as e:
                last = f"{e.worker.url}: {e}"
                self._liveness.mark_down(e.worker, str(e))
                if finished:
                    return  # the answer is complete: only the worker's statistics were lost
            finally:
                await gen.aclose()
            exclude.add(d.url)
            trace.retries += 1
            self._metrics.m_retries.inc()
        if sent:
            raise APIError(502, f"no decode worker is left to continue the stream after {len(sent)} tokens "
                           f"(last error: {last})", code="worker_failed")
        raise APIError(503, f"no decode worker could serve the request"
                       f"{' (last error: ' + last + ')' if last else ' (none is available)'}",
                       code="no_worker_available")

    async def _open_stream(self, d: PoolWorker, path: str, body: dict) -> aiohttp.ClientResponse:
        """POSTs ``body`` to a decode/engine worker and returns its 200 streaming response;
        a request the worker never received raises WorkerFailed (safe to retry)."""
        try:
            r = await self._liveness.bounded(d, self._client.post(d.url + path, body, timeout=self._client.timeout()),
                                             self.config.headers_timeout_s, "response headers")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise WorkerFailed(d, f"{type(e).__name__}: {e}", before_response=True) from None
        try:
            await check_status(d, r)
        except BaseException:
            done_with(r)
            raise
        return r

    @contextlib.asynccontextmanager
    async def _decode_stream(self, d: PoolWorker, path: str, body: dict
                             ) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """Opens decode worker ``d``'s NDJSON stream at ``path`` (counted in its
        ``in_flight``) and yields its lines."""
        d.in_flight += 1
        try:
            r = await self._open_stream(d, path, body)
            try:
                yield self._liveness.lines(d, r, self.config.read_timeout_s, "token")
            finally:
                done_with(r)
        finally:
            d.in_flight -= 1

    async def _local_on(self, d: PoolWorker, rid: str, prompt: list[int], params: GenParams, trace: RequestTrace
                        ) -> AsyncIterator[TokenOut]:
        body = GenerateRequest(rid, tuple(prompt), params).to_json()
        async with self._decode_stream(d, "/pd/generate", body) as lines:
            async for line in lines:
                raise_worker_error(d, line)
                if "done" in line:
                    d.served += 1
                    trace.extra.update(as_dict(line["done"]))
                    return
                if "t" in line or "f" in line:
                    yield TokenOut(line.get("t"), line.get("f"))
            raise WorkerFailed(d, "the stream ended before the request finished")

    async def _disagg_on(self, d: PoolWorker, rid: str, prompt: list[int], params: GenParams, trace: RequestTrace,
                         plan: RoutePlan | None = None) -> AsyncIterator[TokenOut]:
        body = GenerateRequest(rid, tuple(prompt), params, self.config.kv_timeout_s).to_json()
        async with self._decode_stream(d, "/pd/decode", body) as lines:
            try:
                first = await lines.__anext__()
            except StopAsyncIteration:
                raise WorkerFailed(d, "the decode worker closed the stream before reserving") from None
            raise_worker_error(d, first)
            try:
                res = Reservation.from_json(first.get("reserved"))
            except InvalidArgument as e:
                raise WorkerFailed(d, f"bad reservation: {e}") from None
            out = PrefillOutcome()
            async for tok in self._prefill.run(rid, prompt, params, res, trace, out, plan=plan):
                yield tok
            if not out.kv_ok:
                await self._kv_failed(d, KVFailed(rid, out.first_token, out.error, out.terminal))
            next_index = 0 if out.first_token is None else 1
            finished = out.finish is not None
            async for line in lines:
                raise_worker_error(d, line)
                if "done" in line:
                    done = as_dict(line["done"])
                    d.served += 1
                    if done.get("recomputed"):
                        trace.recomputed = True
                        trace.recompute_reason = str(done.get("recompute_reason", ""))
                        self._metrics.m_recompute.inc((trace.recompute_reason or "unknown",))
                        if not trace.kv_error:  # e.g. the KV timed out: the decode worker says why
                            trace.kv_error = str(done.get("kv_error") or trace.recompute_reason or "")
                    trace.extra["kv_wait_s"] = done.get("kv_wait_s")
                    return
                if "t" in line:
                    i = int(line.get("i", next_index))
                    if i < next_index:
                        continue  # already sent (the prefill side's first token)
                    next_index = i + 1
                if finished or not ("t" in line or "f" in line):
                    continue
                finished = line.get("f") is not None
                yield TokenOut(line.get("t"), line.get("f"))
            raise WorkerFailed(d, "the stream ended before the request finished")

    async def _kv_failed(self, d: PoolWorker, kf: KVFailed) -> None:
        trace = self._traces.get(kf.rid.split(".r", 1)[0])
        if trace is not None and not trace.kv_error:
            trace.kv_error = kf.error or "the KV did not arrive (no reason given)"  # the recompute's cause
        try:
            async with self._client.post(d.url + "/pd/kv_failed", kf.to_json(),
                                         timeout=aiohttp.ClientTimeout(total=self.config.connect_timeout_s + 2)) as r:
                await r.read()
                if r.status in (401, 403):
                    d.refused(r.status, "/pd/kv_failed")
                if r.status != 200:
                    raise WorkerFailed(d, f"/pd/kv_failed answered HTTP {r.status}")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise WorkerFailed(d, f"{type(e).__name__}: {e}") from None
