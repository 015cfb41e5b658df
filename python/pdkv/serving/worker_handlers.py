"""The worker protocol's request handlers (:mod:`pdkv.serving.protocol`): local
generation (``/pd/generate``), the decode side (``/pd/decode``, ``/pd/kv_failed``),
the prefill side (``/pd/prefill``, ``/pd/check_peer``) and the leases on cached
blocks (``/pd/kv_lease``, ``/pd/kv_release``) of a
:class:`~pdkv.serving.worker.Worker`. They parse requests, stream NDJSON token lines
from the engine's events and map errors to statuses; the KV hand-off itself is
:mod:`pdkv.serving.handoff`."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any, Protocol

from aiohttp import web

import pdkv
from pdkv.errors import AlreadyExists, InvalidArgument, PdkvError, ResourceExhausted

from .aio import json_error, start_ndjson
from .engine import Engine, FinishReason, RequestHandle, TokenEvent
from .handoff import KVReceiver, KVSender
from .kv_pull import LeaseTable, PrefixPuller, PullOutcome
from .protocol import (GenerateRequest, KVFailed, KVResult, LeaseRelease, LeaseRequest, PrefillRequest, StreamError,
                       dumps_line)
from .sampling import SamplingParams



class HandlerHost(Protocol):
    """What the handlers use of their :class:`~pdkv.serving.worker.Worker` (a protocol,
    so that this module does not import the worker that imports it)."""

    config: Any  # WorkerConfig
    in_flight: int
    sender: KVSender | None
    receiver: KVReceiver | None
    leases: LeaseTable | None

    def started_engine(self) -> Engine: ...

    async def read_raw(self, request: web.Request) -> bytes: ...

__all__ = ["EngineEvents", "ProtocolHandlers", "failure_message"]


class EngineEvents:
    """Engine events of one request, delivered into the event loop (thread-safe callback)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[TokenEvent] = asyncio.Queue()

    def __call__(self, ev: TokenEvent) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, ev)
        except RuntimeError:
            pass  # the loop is closed: the worker is shutting down


def stream_error(h: RequestHandle, ev: TokenEvent) -> StreamError:
    """The error line for a request the engine ended without finishing it: both are the
    worker's fault (an abort here means the worker is stopping or its reader left)."""
    code = "shutting_down" if ev.finish_reason is FinishReason.ABORT else "internal_error"
    return StreamError.of(code, failure_message(h, ev))


def failure_message(h: RequestHandle, ev: TokenEvent) -> str:
    """Why the engine ended request ``h`` without finishing it (abort or error)."""
    if ev.finish_reason is FinishReason.ABORT:
        return "the request was aborted"
    return f"the engine failed: {type(h.error).__name__}: {h.error}" if h.error else "the engine failed"


class ProtocolHandlers:
    """The ``/pd/*`` handlers that run requests on a worker's engine.

    Parameters
    ----------
    worker : HandlerHost
        Its engine, KV hand-off side (sender or receiver), config and in-flight count.
    """

    def __init__(self, worker: HandlerHost) -> None:
        self.worker = worker

    async def _body(self, request: web.Request) -> Any:
        """The JSON body (aiohttp's 413 past the body limit, 408 past the body deadline)."""
        raw = await self.worker.read_raw(request)
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise InvalidArgument("the request body is not valid JSON") from None

    async def _stream_tokens(self, resp: web.StreamResponse, events: EngineEvents, engine_rid: str,
                             handle: RequestHandle) -> bool:
        """Writes token lines until the request finishes; aborts it if the reader goes away
        (or, with ``debug_error_after``, ends the stream with an injected error).

        Returns
        -------
        bool
            True if it finished normally (stop or length).
        """
        eng = self.worker.started_engine()
        fail_after = self.worker.config.debug_error_after
        sent = 0
        try:
            while True:
                if fail_after is not None and sent >= fail_after:
                    eng.abort(engine_rid)
                    await resp.write(StreamError.of(self.worker.config.debug_error_code,
                                                    f"debug: injected after {sent} tokens").to_line())
                    return False
                ev = await events.queue.get()
                if ev.finish_reason in (FinishReason.ABORT, FinishReason.ERROR):
                    await resp.write(stream_error(handle, ev).to_line())
                    return False
                line: dict[str, Any] = {}
                if ev.token_id is not None:
                    line["t"] = ev.token_id
                    line["i"] = ev.index
                    sent += 1
                if ev.finish_reason is not None:
                    line["f"] = ev.finish_reason.value
                await resp.write(dumps_line(line))
                if ev.finish_reason is not None:
                    return True
        except BaseException:
            eng.abort(engine_rid)
            raise

    # ------------------------------------------------------------------ local generation
    async def generate(self, request: web.Request) -> web.StreamResponse:
        eng = self.worker.started_engine()
        events = EngineEvents(asyncio.get_running_loop())
        try:
            req = GenerateRequest.from_json(await self._body(request), limits=self.worker.config.protocol_limits)
            h = eng.add_request(req.rid, req.prompt, SamplingParams.of(req.params), on_event=events)
        except AlreadyExists as e:
            return json_error(409, str(e), code="duplicate_request")
        except InvalidArgument as e:
            return json_error(400, str(e), code="invalid_request")
        self.worker.in_flight += 1
        try:
            resp = await start_ndjson(request)
            if await self._stream_tokens(resp, events, req.rid, h):
                await resp.write(dumps_line({"done": {"recomputed": False, "preemptions": h.num_preemptions,
                                                      "cached_tokens": h.num_cached_tokens,
                                                      "computed_tokens": h.num_computed_tokens}}))
            await resp.write_eof()
            return resp
        finally:
            self.worker.in_flight -= 1

    # ------------------------------------------------------------------ decode
    async def decode(self, request: web.Request) -> web.StreamResponse:
        eng = self.worker.started_engine()
        receiver = self.worker.receiver
        assert receiver is not None
        cfg = self.worker.config
        try:
            req = GenerateRequest.from_json(await self._body(request), limits=self.worker.config.protocol_limits)
            sp = SamplingParams.of(req.params)
            eng.validate(req.rid, req.prompt, sp)
            ticket = await receiver.reserve(req.rid, req.prompt, wait_s=cfg.reserve_wait_s,
                                            kv_timeout_s=req.kv_timeout_s, margin_s=cfg.kv_margin_s)
        except AlreadyExists as e:
            return json_error(409, str(e), code="duplicate_request")
        except InvalidArgument as e:
            return json_error(400, str(e), code="invalid_request")
        except ResourceExhausted as e:
            return json_error(503, f"no KV blocks free for {cfg.reserve_wait_s:g} s: {e}", code="kv_pool_full")
        events = EngineEvents(asyncio.get_running_loop())
        self.worker.in_flight += 1
        try:
            resp = await start_ndjson(request)
            await resp.write(dumps_line({"reserved": ticket.reservation.to_json()}))
            arrival = await receiver.wait(ticket)
            h = receiver.admit(ticket, arrival, req.prompt, sp, events)
            if await self._stream_tokens(resp, events, req.rid, h):
                await resp.write(dumps_line({"done": {"recomputed": h.recomputed, "recompute_reason": arrival.reason,
                                                      "kv_error": arrival.error, "kv_wait_s": arrival.wait_s,
                                                      "preemptions": h.num_preemptions,
                                                      "cached_tokens": h.num_cached_tokens,
                                                      "computed_tokens": h.num_computed_tokens}}))
            await resp.write_eof()
            return resp
        finally:
            self.worker.in_flight -= 1
            receiver.finish(ticket)

    async def kv_failed(self, request: web.Request) -> web.Response:
        receiver = self.worker.receiver
        assert receiver is not None
        try:
            kf = KVFailed.from_json(await self._body(request), limits=self.worker.config.protocol_limits)
        except InvalidArgument as e:
            return json_error(400, str(e), code="invalid_request")
        return web.json_response({"ok": True, "state": receiver.kv_failed(kf)})

    # ------------------------------------------------------------------ prefill
    async def prefill(self, request: web.Request) -> web.StreamResponse:
        eng = self.worker.started_engine()
        sender = self.worker.sender
        assert sender is not None
        loop = asyncio.get_running_loop()
        t_recv = loop.time()
        events = EngineEvents(loop)
        streamer = None
        pull: PullOutcome | None = None
        try:
            req = PrefillRequest.from_json(await self._body(request), limits=self.worker.config.protocol_limits)
            eng.validate(req.rid, req.prompt, SamplingParams.of(req.params), prefill_only=True)
            pull = await _pull_prefix(sender.puller, req, t_recv + req.kv_timeout_s)
            streamer = await sender.layer_streamer(req, t_recv + req.kv_timeout_s)
            h = eng.add_request(req.rid, req.prompt, SamplingParams.of(req.params), on_event=events, prefill_only=True,
                                layer_sink=streamer)
        except AlreadyExists as e:
            sender.puller.done(pull)
            return json_error(409, str(e), code="duplicate_request")
        except InvalidArgument as e:
            sender.puller.done(pull)
            return json_error(400, str(e), code="invalid_request")
        except BaseException:
            sender.puller.done(pull)
            raise
        self.worker.in_flight += 1
        posted: list[pdkv.Transfer] = []  # the write reading this request's blocks, once posted
        try:
            resp = await start_ndjson(request)
            ev = await events.queue.get()
            sender.puller.done(pull)  # the request holds the pulled blocks now (or failed)
            if ev.token_id is None:
                await resp.write(stream_error(h, ev).to_line())
                await resp.write_eof()
                return resp
            finish = ev.finish_reason
            ended = finish in (FinishReason.STOP, FinishReason.LENGTH)
            await resp.write(dumps_line({"first": {"t": ev.token_id, "seed": h.seed,
                                                   "f": finish.value if ended else None,
                                                   "prefill_s": time.perf_counter() - h.arrival_time}}))
            result = await sender.push(req, h, ev.token_id, with_kv=not ended, deadline=t_recv + req.kv_timeout_s,
                                       posted=posted, streamer=streamer)
            await resp.write(dumps_line({"kv": _reuse(result, h, pull).to_json()}))
            await resp.write_eof()
            return resp
        finally:
            self.worker.in_flight -= 1
            sender.puller.done(pull)
            sender.finish(req.rid, h, posted, streamer)

    async def check_peer(self, request: web.Request) -> web.Response:
        """Connects to a decode worker's agent now (metadata, then the transport
        handshake, both authenticated); answers ``{"ok", "kind", "error"}``."""
        sender = self.worker.sender
        assert sender is not None
        try:
            obj = await self._body(request)
            address = obj["agent"]
            timeout = float(obj.get("timeout", 5.0))
            if not isinstance(address, str) or not address or not 0 < timeout <= 60 \
                    or len(address) > self.worker.config.protocol_limits.max_name_chars:
                raise ValueError
        except (InvalidArgument, KeyError, TypeError, ValueError, AttributeError, OverflowError):
            return json_error(400, "expected {\"agent\": \"host:port\" (at most "
                              f"{self.worker.config.protocol_limits.max_name_chars} characters), \"timeout\": seconds "
                              "(0, 60]}",
                              code="invalid_request")
        kind, error = await sender.check_peer(address, timeout)
        return web.json_response({"ok": kind == "ok", "kind": kind, "error": error})

    # ------------------------------------------------------------------ leases
    async def kv_lease(self, request: web.Request) -> web.Response:
        """Pins cached blocks for a reader: ``{"lease": KVLease}`` (maybe no blocks)."""
        table = self.worker.leases
        eng = self.worker.started_engine()
        try:
            req = LeaseRequest.from_json(await self._body(request), limits=self.worker.config.protocol_limits)
        except InvalidArgument as e:
            return json_error(400, str(e), code="invalid_request")
        if table is None or not eng.config.prefix_cache:
            return json_error(409, "this worker's prefix cache is off: it has no blocks to lease",
                              code="prefix_cache_off")
        try:
            lease = table.grant(req)
        except InvalidArgument as e:
            return json_error(400, str(e), code="invalid_request")
        except AlreadyExists as e:
            return json_error(409, str(e), code="duplicate_lease")
        except ResourceExhausted as e:
            return json_error(503, str(e), code="too_many_leases")
        return web.json_response({"lease": lease.to_json()})

    async def kv_release(self, request: web.Request) -> web.Response:
        """Ends a lease: ``{"ok": true}``, or 404 for an id with no live lease."""
        table = self.worker.leases
        try:
            rel = LeaseRelease.from_json(await self._body(request), limits=self.worker.config.protocol_limits)
        except InvalidArgument as e:
            return json_error(400, str(e), code="invalid_request")
        if table is None or not table.release(rel.lease_id):
            return json_error(404, f"no live lease {rel.lease_id!r} (released, expired, or never granted)",
                              code="unknown_lease")
        return web.json_response({"ok": True})


async def _pull_prefix(puller: PrefixPuller, req: PrefillRequest, deadline: float) -> PullOutcome | None:
    """Reads the prompt's prefix from the worker that holds it when that beats
    computing it (None: no pull planned). A failed pull is an outcome, not an error."""
    try:
        plan = puller.plan(req)
    except PdkvError:
        return None
    if plan is None:
        return None
    return await puller.pull(req, plan, deadline=deadline)


def _reuse(result: KVResult, h: RequestHandle, pull: PullOutcome | None) -> KVResult:
    """``result`` with the prefill's reuse figures: tokens cached, pulled, computed."""
    cached = h.num_cached_tokens
    ok = pull is not None and pull.ok
    return dataclasses.replace(result, cached_tokens=cached, pulled_tokens=pull.tokens if ok else 0,
                               pulled_bytes=pull.nbytes if ok else 0,
                               computed_tokens=len(h.prompt_ids) - cached)
