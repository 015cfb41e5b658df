"""The OpenAI-compatible HTTP API over a token-generating backend.

:class:`OpenAIFrontend` serves ``/v1/completions``, ``/v1/chat/completions``
(streaming SSE or one JSON body), ``/v1/models``, ``/health`` and ``/metrics``. It
validates and tokenizes requests (:mod:`pdkv.serving.openai_api`), asks a
:class:`Backend` for tokens, turns them into text incrementally, applies stop strings,
and records request metrics (TTFT, ITL, end-to-end latency, tokens, errors).

Every error is OpenAI's JSON error object: :meth:`OpenAIFrontend.add_routes` installs
one middleware that renders :class:`APIError`, aiohttp's own HTTP errors (404, 405,
413...) and anything unexpected (500, logged) that way. Request bodies are capped by
:func:`~pdkv.serving.openai_api.body_limit` (aiohttp's ``client_max_size``, per
request), and large bodies are parsed and tokenized on a small thread pool, so the
event loop keeps serving other requests meanwhile.

Two backends exist: the proxy's (:class:`pdkv.serving.proxy.ProxyBackend`, which routes
to prefill and decode workers) and a colocated worker's own engine
(:class:`pdkv.serving.worker.LocalBackend`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Protocol, Sequence

from aiohttp import web

from .limits import DEFAULT_BODY_TIMEOUT_S, read_body
from .metrics import CONTENT_TYPE, Registry
from .openai_api import (APIError, Endpoint, IncrementalDetokenizer, ModelInfo, OpenAIRequest, StopMatcher,
                         TextCodec, body_limit, decode_body, parse_request, resolve_prompt, session_id)
from .protocol import GenParams

__all__ = ["Backend", "OpenAIFrontend", "RequestTrace", "SESSION_HEADER", "TokenOut", "openai_error_middleware"]

#: The request header that names the client's session when the body has no ``user``.
SESSION_HEADER = "X-Session-Id"

log = logging.getLogger("pdkv.serving")

#: ITL buckets (seconds): finer than the latency defaults at the low end.
ITL_BUCKETS = (0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1,
               0.125, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)
#: Bodies up to this size are parsed and tokenized on the event loop (microseconds);
#: larger ones on the request pool.
INLINE_BODY_BYTES = 64 << 10
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 408: "request_timeout", 413: "request_too_large",
               429: "rate_limit_exceeded",
               503: "service_unavailable"}
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _request_pool() -> ThreadPoolExecutor:
    """The threads that parse and tokenize large requests (tokenizers release the GIL)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="pdkv-request")
        return _pool


def _response_started(request: web.Request) -> bool:
    """True once the handler sent the status line (an error can no longer replace it)."""
    writer = request.writer
    return writer is None or getattr(writer, "output_size", 0) > 0


def _http_error(e: web.HTTPException, request: web.Request) -> APIError:
    if e.status == 404:
        msg = f"{request.method} {request.path}: no such route on this server"
    elif e.status == 405:
        msg = f"{request.method} is not allowed on {request.path}; allowed: {e.headers.get('Allow', '')}"
    else:
        msg = e.text or e.reason
    return APIError(e.status, msg, code=_HTTP_CODES.get(e.status))


def openai_error_middleware(on_error: Callable[[int], None] | None = None) -> Any:
    """An aiohttp middleware answering every error as OpenAI's JSON error object.

    :class:`APIError` keeps its status; aiohttp's :class:`~aiohttp.web.HTTPException`
    (unknown path, wrong method, body too large...) keeps its status and headers
    (``Allow``); anything else is logged and answered as a 500 ``server_error``. An
    error raised after a streamed response started propagates (aiohttp closes the
    connection).

    Parameters
    ----------
    on_error : callable, optional
        Called with the status of each error answered (metrics).
    """

    @web.middleware
    async def openai_errors(request: web.Request, handler: _Handler) -> web.StreamResponse:
        headers: dict[str, str] = {}
        try:
            return await handler(request)
        except APIError as e:
            err = e
        except web.HTTPException as e:
            if e.status < 400:
                raise
            err = _http_error(e, request)
            headers = {k: v for k, v in e.headers.items() if k.lower() in ("allow", "retry-after")}
        except Exception as e:  # noqa: BLE001 - the client gets a JSON 500; the log the traceback
            if _response_started(request):
                raise
            log.exception("%s %s failed", request.method, request.path)
            err = APIError(500, f"internal server error ({type(e).__name__})", code="internal_error")
        if _response_started(request):
            raise err
        if on_error is not None:
            on_error(err.status)
        resp = web.json_response(err.to_json(), status=err.status, headers=headers)
        if err.status in (408, 413):
            resp.force_close()  # the rest of the body is not read: do not reuse the connection
        return resp

    return openai_errors


@dataclass(frozen=True)
class TokenOut:
    """One generated token from a backend (``finish_reason`` set on the last one).

    ``token_id`` None with a ``finish_reason``: the request ended on the token before
    (a worker that learnt only afterwards that it was the last)."""

    token_id: int | None
    finish_reason: str | None = None


@dataclass
class RequestTrace:
    """How a request was served; filled by the backend, reported by ``pdkv_stats``.

    Attributes
    ----------
    route : str
        ``"disagg"`` (prefill worker + KV transfer), ``"local"`` (prefilled where it
        was decoded) or ``"engine"`` (a colocated worker's own engine).
    prefill_worker, decode_worker : str
        URLs.
    kv_bytes : int
    kv_seconds : float
        The KV transfer's span, post to completion (a layer-wise stream's overlaps
        the prefill's compute).
    kv_tail_seconds : float
        What the KV transfer added after the prefill ended (last layer and first
        token): what it adds to the second token.
    kv_wire_seconds : float
        Time the KV bytes were on the wire.
    kv_transport : str
    kv_error : str
    recomputed : bool
        The decode worker recomputed the prompt (the KV did not arrive).
    recompute_reason : str
    retries : int
        Workers given up on before this request was served.
    session : str
        The client's session (the OpenAI ``user`` field, else the ``X-Session-Id``
        header; '' for none): KV-aware routing keeps a session on the same workers
        while the fleet index knows nothing of its prompt.
    """

    route: str = ""
    prefill_worker: str = ""
    decode_worker: str = ""
    kv_bytes: int = 0
    kv_seconds: float = 0.0
    kv_tail_seconds: float = 0.0
    kv_wire_seconds: float = 0.0
    kv_transport: str = ""
    kv_error: str = ""
    recomputed: bool = False
    recompute_reason: str = ""
    retries: int = 0
    session: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Backend(Protocol):
    """What :class:`OpenAIFrontend` needs from whatever produces tokens."""

    mode: str

    def model_info(self) -> ModelInfo | None:
        """The served model, or None while not ready."""

    def codec(self) -> TextCodec | None:
        """The tokenizer, or None (token-id prompts only)."""

    def health(self) -> tuple[bool, dict[str, Any]]:
        """``(ready, details)`` for ``/health``."""

    async def refresh_metrics(self) -> None:
        """Called before ``/metrics`` renders (e.g. to poll workers)."""

    def generate(self, rid: str, prompt: list[int], params: GenParams, trace: RequestTrace
                 ) -> AsyncIterator[TokenOut]:
        """Streams the request's tokens; raises :class:`APIError` on failure. Closing the
        iterator early cancels the request."""


class OpenAIFrontend:
    """The OpenAI-compatible routes over ``backend``.

    Parameters
    ----------
    backend : Backend
    registry : Registry
        Request metrics are added to it (the backend may add its own).
    max_body_bytes : int, optional
        Largest request body (413 above). Default: derived from the model's context,
        see :func:`~pdkv.serving.openai_api.body_limit`.
    body_timeout_s : float
        Seconds a request body may take to arrive (408 and the connection closed after).
    api_keys : sequence of str
        If any: every route but ``/health`` needs ``Authorization: Bearer <one of them>``
        (401 in OpenAI's error shape without it), like vLLM's ``--api-key``.
    """

    def __init__(self, backend: Backend, registry: Registry, *, max_body_bytes: int | None = None,
                 body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S, api_keys: Sequence[str] = ()) -> None:
        if max_body_bytes is not None and max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        if not body_timeout_s > 0:
            raise ValueError(f"body_timeout_s must be > 0, got {body_timeout_s!r}")
        if isinstance(api_keys, str) or any(not isinstance(k, str) or not k or len(k) > 1024 for k in api_keys):
            raise ValueError("api_keys must be a sequence of non-empty strings (at most 1024 characters)")
        self.api_keys = tuple(hashlib.sha256(k.encode()).digest() for k in api_keys)
        self.backend = backend
        self.registry = registry
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.created = int(time.time())
        r = registry
        self.m_requests = r.counter("pdkv_requests_total", "Finished generation requests.", ("endpoint", "status"))
        self.m_errors = r.counter("pdkv_request_errors_total", "Requests answered with an error, by HTTP status.",
                                  ("status",))
        self.m_in_flight = r.gauge("pdkv_requests_in_flight", "Generation requests being served now.")
        self.m_ttft = r.histogram("pdkv_time_to_first_token_seconds",
                                  "From request arrival to the first output token.")
        self.m_itl = r.histogram("pdkv_inter_token_latency_seconds", "Between consecutive output tokens.",
                                 buckets=ITL_BUCKETS)
        self.m_e2e = r.histogram("pdkv_e2e_request_latency_seconds", "From request arrival to its last token.")
        self.m_prompt = r.counter("pdkv_prompt_tokens_total", "Prompt tokens of served requests.")
        self.m_gen = r.counter("pdkv_generation_tokens_total", "Generated tokens.")

    def add_routes(self, app: web.Application) -> None:
        """Adds ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/health``,
        ``/metrics``, and the middleware that answers every error of ``app`` (its other
        routes and unknown paths included) as OpenAI's error object."""
        app.middlewares.append(openai_error_middleware(lambda status: self.m_errors.inc((str(status),))))
        if self.api_keys:
            app.middlewares.append(self._check_api_key)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)

    @web.middleware
    async def _check_api_key(self, request: web.Request, handler: _Handler) -> web.StreamResponse:
        """Every route but ``/health`` (unknown paths included) needs one of the API keys."""
        if request.path != "/health":
            auth = request.headers.get("Authorization", "")
            scheme, _, key = auth.partition(" ")
            given = hashlib.sha256(key.strip().encode("utf-8", "surrogatepass")).digest()
            ok = False
            for k in self.api_keys:  # compare every key, in constant time each
                ok |= hmac.compare_digest(k, given)
            if scheme.lower() != "bearer" or not key.strip() or not ok:
                raise APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                               type="invalid_request_error", code="invalid_api_key")
        return await handler(request)

    # ------------------------------------------------------------------ simple routes
    async def models(self, request: web.Request) -> web.Response:
        info = self.backend.model_info()
        data = [info.to_model_card(self.created)] if info is not None else []
        return web.json_response({"object": "list", "data": data})

    async def health(self, request: web.Request) -> web.Response:
        ok, details = self.backend.health()
        return web.json_response({"status": "ok" if ok else "unavailable", "mode": self.backend.mode, **details},
                                 status=200 if ok else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        await self.backend.refresh_metrics()
        return web.Response(body=self.registry.render().encode(), headers={"Content-Type": CONTENT_TYPE})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, Endpoint.COMPLETIONS)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, Endpoint.CHAT)

    # ------------------------------------------------------------------ generation
    def _error(self, e: APIError) -> web.Response:
        self.m_errors.inc((str(e.status),))
        return web.json_response(e.to_json(), status=e.status)

    async def _read_body(self, request: web.Request, info: ModelInfo | None) -> bytes:
        """The body, refused with aiohttp's 413 past the limit and 408 past the body
        deadline (both rendered by the middleware)."""
        return await read_body(request, body_limit(info, self.max_body_bytes), self.body_timeout_s)

    @staticmethod
    def _prepare(raw: bytes, endpoint: Endpoint, info: ModelInfo | None, codec: TextCodec | None
                 ) -> tuple[OpenAIRequest, ModelInfo, list[int], GenParams]:
        """Decodes, validates and tokenizes a request (pure: runs on the request pool)."""
        req = parse_request(decode_body(raw), endpoint)
        if info is None:
            raise APIError(503, "the server is starting: no worker has reported its model yet",
                           code="service_unavailable")
        prompt, params = resolve_prompt(req, info, codec)
        return req, info, prompt, params

    async def _generate(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        t0 = time.perf_counter()
        info = self.backend.model_info()
        codec = self.backend.codec()
        raw = await self._read_body(request, info)
        if len(raw) <= INLINE_BODY_BYTES:
            req, info, prompt, params = self._prepare(raw, endpoint, info, codec)
        else:
            loop = asyncio.get_running_loop()
            req, info, prompt, params = await loop.run_in_executor(_request_pool(), self._prepare, raw, endpoint,
                                                                   info, codec)
        # Not kept for the whole request: the body and the prompt's text (the token ids are).
        del raw
        user = req.user or session_id(request.headers.get(SESSION_HEADER), SESSION_HEADER)
        if req.prompt is not None or req.messages is not None or user != req.user:
            req = dataclasses.replace(req, prompt=None, messages=None, user=user)
        rid = f"{'cmpl' if endpoint is Endpoint.COMPLETIONS else 'chatcmpl'}-{uuid.uuid4().hex}"
        run = _Run(self, request, req, rid, prompt, params, info, t0)
        self.m_in_flight.inc()
        status = "error"
        try:
            resp = await run.serve()
            status = run.status
            return resp
        except asyncio.CancelledError:
            status = "cancelled"
            raise
        finally:
            self.m_in_flight.dec()
            self.m_requests.inc((endpoint.value, status))


class _Run:
    """One generation request: pulls tokens, makes text, writes the response."""

    def __init__(self, fe: OpenAIFrontend, request: web.Request, req: OpenAIRequest, rid: str, prompt: list[int],
                 params: GenParams, info: ModelInfo, t0: float) -> None:
        self.fe = fe
        self.request = request
        self.req = req
        self.rid = rid
        self.prompt = prompt
        self.params = params
        self.info = info
        self.t0 = t0
        self.trace = RequestTrace(session=req.user)
        codec = fe.backend.codec()
        self.detok = IncrementalDetokenizer(codec, prompt) if codec is not None else None
        self.stop = StopMatcher(req.stop)
        self.tokens: list[int] = []
        self.last_time = 0.0
        self.finish_reason: str | None = None
        self.status = "error"
        self.chat = req.endpoint is Endpoint.CHAT

    # -------------------------------------------------------------- text
    def _text_of(self, tok: TokenOut) -> str:
        """Text for one token (nothing for a stop/EOS token that ends the request)."""
        if self.detok is None:
            return ""
        if tok.finish_reason == "stop":
            return self.detok.flush()
        return self.detok.add(tok.token_id)

    def _observe(self, now: float) -> None:
        if not self.tokens:
            self.fe.m_ttft.observe(now - self.t0)
        else:
            self.fe.m_itl.observe(now - self.last_time)
        self.last_time = now

    def _usage(self) -> dict[str, int]:
        n = len(self.tokens)
        return {"prompt_tokens": len(self.prompt), "completion_tokens": n, "total_tokens": len(self.prompt) + n}

    def _finish_metrics(self) -> None:
        self.fe.m_e2e.observe(time.perf_counter() - self.t0)
        self.fe.m_prompt.inc(amount=len(self.prompt))
        self.fe.m_gen.inc(amount=len(self.tokens))

    def _pdkv(self) -> dict[str, Any]:
        d = self.trace.to_json()
        d["mode"] = self.fe.backend.mode
        return d

    async def _pieces(self, gen: AsyncIterator[TokenOut]) -> AsyncIterator[tuple[str, list[int], str | None]]:
        """``(text delta, token ids, finish_reason)`` per token; the last one carries
        the finish reason. Stops the backend early on a stop string."""
        async for tok in gen:
            now = time.perf_counter()
            if self.finish_reason is not None:
                continue  # drain (trailing statistics)
            if tok.token_id is None:
                if tok.finish_reason is None:
                    raise APIError(502, "the backend sent an empty token", code="upstream_error")
                self.finish_reason = tok.finish_reason
                text = (self.detok.flush() if self.detok is not None else "")
                text, _ = self.stop.feed(text)
                yield text + self.stop.flush(), [], tok.finish_reason
                continue
            self._observe(now)
            self.tokens.append(tok.token_id)
            text = self._text_of(tok)
            finish = tok.finish_reason
            if finish is None and len(self.tokens) >= self.params.max_tokens:
                finish = "length"
            text, stopped = self.stop.feed(text)
            if stopped:
                finish = "stop"
            elif finish is not None:
                tail = self.detok.flush() if self.detok is not None and finish != "stop" else ""
                if tail:
                    more, stopped = self.stop.feed(tail)
                    text += more
                    if stopped:
                        finish = "stop"
                if not stopped:
                    text += self.stop.flush()
            if finish is not None:
                self.finish_reason = finish
                yield text, [tok.token_id], finish
                if stopped:
                    return  # the generator's close cancels the rest upstream
                continue
            yield text, [tok.token_id], None
        if self.finish_reason is None:
            raise APIError(502, "the backend ended the request without a finish reason", code="upstream_error")

    # -------------------------------------------------------------- response shapes
    def _chunk(self, text: str, ids: list[int], finish: str | None, *, first: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text or first:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            obj = "text_completion"
        if self.req.return_token_ids:
            choice["token_ids"] = ids
            if first:
                choice["prompt_token_ids"] = self.prompt
        out = {"id": self.rid, "object": obj, "created": int(time.time()), "model": self.info.name,
               "choices": [choice]}
        if self.req.continuous_usage:
            out["usage"] = self._usage()
        return out

    def _full(self, text: str) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": self.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": self.finish_reason}
            obj = "text_completion"
        if self.req.return_token_ids:
            choice["token_ids"] = self.tokens
            choice["prompt_token_ids"] = self.prompt
        out = {"id": self.rid, "object": obj, "created": int(time.time()), "model": self.info.name,
               "choices": [choice], "usage": self._usage()}
        if self.req.pdkv_stats:
            out["pdkv"] = self._pdkv()
        return out

    # -------------------------------------------------------------- serving
    async def serve(self) -> web.StreamResponse:
        gen = self.fe.backend.generate(self.rid, self.prompt, self.params, self.trace)
        pieces = self._pieces(gen)
        try:
            try:
                first = await pieces.__anext__()
            except StopAsyncIteration:
                raise APIError(502, "the backend produced no token", code="upstream_error") from None
            except APIError as e:
                return self.fe._error(e)
            if self.req.stream:
                return await self._stream(first, pieces)
            return await self._whole(first, pieces)
        finally:
            await pieces.aclose()
            await gen.aclose()

    async def _whole(self, first: tuple[str, list[int], str | None], pieces: AsyncIterator) -> web.StreamResponse:
        parts = [first[0]]
        try:
            async for text, _ids, _finish in pieces:
                parts.append(text)
        except APIError as e:
            return self.fe._error(e)
        self._finish_metrics()
        self.status = "ok"
        return web.json_response(self._full("".join(parts)))

    async def _stream(self, first: tuple[str, list[int], str | None], pieces: AsyncIterator) -> web.StreamResponse:
        resp = web.StreamResponse(status=200, headers={"Content-Type": "text/event-stream",
                                                       "Cache-Control": "no-cache"})
        await resp.prepare(self.request)

        async def send(obj: Any) -> None:
            await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")

        text, ids, finish = first
        try:
            if self.chat:
                await send(self._chunk("", [], None, first=True))
            if text or self.req.return_token_ids:
                await send(self._chunk(text, ids, None, first=not self.chat))
            last_finish = finish
            async for text, ids, fin in pieces:
                # After the last token the backend may still deliver statistics: drain it.
                last_finish = fin or last_finish
                if text or self.req.return_token_ids:
                    await send(self._chunk(text, ids, None))
            final = self._chunk("", [], last_finish)
            if self.chat:
                final["choices"][0]["delta"] = {}
            if self.req.return_token_ids:
                final["choices"][0]["token_ids"] = []
            if self.req.pdkv_stats:
                final["pdkv"] = self._pdkv()
            await send(final)
            if self.req.include_usage:
                await send({"id": self.rid, "object": final["object"], "created": int(time.time()),
                            "model": self.info.name, "choices": [], "usage": self._usage()})
            self._finish_metrics()
            self.status = "ok"
        except APIError as e:
            self.fe.m_errors.inc((str(e.status),))
            await send(e.to_json())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
