"""A tiny OpenAI-compatible streaming server for the client tests (127.0.0.1 only).

It streams ``max_tokens`` tokens: the first chunk after ``ttft_s``, then one chunk of
``tokens_per_chunk`` tokens every ``itl_s``; with ``continuous_usage`` every chunk
carries the running ``usage`` when the request asks for it
(``stream_options.continuous_usage_stats``, as vLLM and pdkv's proxy do). A request body field ``"fake"`` (or the
server's ``behaviour``) selects a failure: ``"http500"``, ``"malformed"`` (a non-JSON
``data:`` line after two chunks), ``"truncate"`` (the body ends after two chunks without
``[DONE]``), ``"stream_error"`` (an ``{"error": ...}`` object mid-stream) or
``"json"`` (ignores ``stream`` and answers with one JSON body); ``behaviour_by_max_tokens``
picks a behaviour per request by its ``max_tokens``, so one run can mix them.

With ``"return_token_ids": true`` every completions choice carries ``token_ids``: the
answer to a token-id prompt is :meth:`FakeOpenAI.answer` (a function of the prompt, so
a client that builds the next prompt from it can be checked). ``received_at`` holds the
:func:`time.perf_counter` arrival time of every body; ``metrics_text`` is served at
``/metrics``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any, Dict, List, Optional

from aiohttp import web


class FakeOpenAI:
    """Async context manager running the fake server; ``url`` is its base URL."""

    def __init__(
        self,
        *,
        ttft_s: float = 0.05,
        itl_s: float = 0.01,
        tokens_per_chunk: int = 1,
        continuous_usage: bool = False,
        behaviour: str = "ok",
        behaviour_by_max_tokens: Optional[Dict[int, str]] = None,
        model: str = "fake-model",
    ) -> None:
        self.ttft_s = ttft_s
        self.itl_s = itl_s
        self.tokens_per_chunk = tokens_per_chunk
        self.continuous_usage = continuous_usage
        self.behaviour = behaviour
        self.behaviour_by_max_tokens = dict(behaviour_by_max_tokens or {})
        self.model = model
        self.bodies: List[Dict[str, Any]] = []
        self.received_at: List[float] = []
        self.metrics_text = ""
        self.in_flight = 0
        self.max_in_flight = 0
        self.url = ""
        self._runner: Optional[web.AppRunner] = None

    async def __aenter__(self) -> "FakeOpenAI":
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _metrics(self, request: web.Request) -> web.Response:
        text = self.metrics_text() if callable(self.metrics_text) else self.metrics_text
        return web.Response(text=text)

    @staticmethod
    def answer(prompt: List[int], n: int) -> List[int]:
        """The token ids the fake generates for a token-id prompt: a function of the prompt."""
        base = (sum(prompt) * 31 + len(prompt)) % 800
        return [100 + (base + 7 * i) % 800 for i in range(n)]

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._stream(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._stream(request, chat=True)

    def _choice(self, chat: bool, k: int, finish: Optional[str]) -> Dict[str, Any]:
        if chat:
            return {"index": 0, "delta": {"content": " tok" * k}, "finish_reason": finish}
        return {"index": 0, "text": " tok" * k, "finish_reason": finish}

    async def _stream(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        body = await request.json()
        self.received_at.append(time.perf_counter())
        self.bodies.append(body)
        behaviour = body.get("fake") or self.behaviour_by_max_tokens.get(int(body["max_tokens"]), self.behaviour)
        if behaviour == "http500":
            return web.json_response({"error": {"message": "boom", "type": "server_error"}}, status=500)
        n = int(body["max_tokens"])
        prompt = body.get("prompt") or body["messages"][0]["content"]
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if behaviour == "json":
                await asyncio.sleep(self.ttft_s)
                return web.json_response(
                    {
                        "object": "text_completion",
                        "choices": [self._choice(False, n, "length")],
                        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n},
                    }
                )
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)

            async def send(obj: Any) -> None:
                await resp.write(b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n")

            if chat:  # role-only first chunk, as OpenAI sends: not a token
                await send({"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
            await asyncio.sleep(self.ttft_s)
            sent = chunks = 0
            ids = self.answer(prompt, n) if isinstance(prompt, list) and body.get("return_token_ids") else None
            while sent < n:
                k = min(self.tokens_per_chunk, n - sent)
                sent += k
                chunks += 1
                choice = self._choice(chat, k, "length" if sent == n else None)
                if ids is not None:
                    choice["token_ids"] = ids[sent - k:sent]
                chunk: Dict[str, Any] = {"object": "chunk", "choices": [choice]}
                if self.continuous_usage and (body.get("stream_options") or {}).get("continuous_usage_stats"):
                    chunk["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": sent}
                await send(chunk)
                if chunks == 2 and behaviour == "malformed":
                    await send(b"{not json")
                    return resp
                if chunks == 2 and behaviour == "truncate":
                    return resp
                if chunks == 2 and behaviour == "stream_error":
                    await send({"error": {"message": "decode worker died", "code": 500}})
                    return resp
                if sent < n:
                    await asyncio.sleep(self.itl_s)
            if (body.get("stream_options") or {}).get("include_usage"):
                await send({"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n}})
            await send(b"[DONE]")
            await resp.write_eof()
            return resp
        finally:
            self.in_flight -= 1


class FakeOpenAIThread:
    """Run a :class:`FakeOpenAI` on its own event loop in a thread (for code that calls ``asyncio.run``).

    Use as a context manager; ``server`` is the running :class:`FakeOpenAI`.
    """

    def __init__(self, **kwargs: Any) -> None:
        self.server = FakeOpenAI(**kwargs)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> FakeOpenAI:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.__aenter__(), self._loop).result(10)
        return self.server

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.server.__aexit__(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
