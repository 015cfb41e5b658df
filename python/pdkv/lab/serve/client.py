"""Asyncio load generator: replays a trace against any OpenAI-compatible server.

:func:`run_trace` sends every request of a :class:`~pdkv.lab.serve.trace.Trace` at
its arrival time to ``/v1/completions`` (or ``/v1/chat/completions``) with
``"stream": true``, timestamps every streamed chunk, and returns one
:class:`~pdkv.lab.serve.metrics.RequestRecord` per request. It never raises for a
failed request: HTTP errors, refused connections, timeouts, malformed or truncated
streams and in-stream ``{"error": ...}`` objects are recorded in ``record.error`` and
the run goes on.

Request body
------------
``model``, ``prompt`` (token ids or text) or ``messages``, ``max_tokens`` = the trace's
output length, ``temperature`` (0: greedy), ``stream: true``,
``stream_options: {"include_usage": true, "continuous_usage_stats": true}`` (token
counts in the last chunk, and the running count in every chunk where the server offers
it: vLLM and pdkv's proxy do; ``continuous_usage=False`` leaves it out), and
``ignore_eos: true`` so that every request generates exactly ``max_tokens`` tokens
(vLLM, SGLang and pdkv's proxy honour it; servers that do not know it ignore it, and
``ignore_eos=False`` leaves it out for strict servers).

Counting tokens
---------------
A chunk *carries output* when a choice has non-empty ``text`` (completions) or
``delta.content`` / ``delta.reasoning_content`` / ``delta.reasoning`` (chat), or when
a per-chunk ``usage.completion_tokens`` (``continuous_usage_stats``) grew. Each such chunk
is timestamped when its bytes arrive; it counts for the growth of
``usage.completion_tokens`` when the server reports per-chunk usage (the record's
``usage_per_chunk`` is then true and ITL is per token, see
:mod:`~pdkv.lab.serve.metrics`), otherwise for one token (ITL is then per chunk: a
detokenizer that holds back incomplete text sends several tokens in one chunk). The request's total output tokens is the final ``usage.completion_tokens`` when
reported, otherwise the sum over chunks. Chunks without output (the chat role chunk,
a bare ``finish_reason``, the usage-only last chunk) are not token arrivals. A server
that ignores ``stream`` and answers with one JSON body gives one chunk.

Clock and scheduling
--------------------
Times are :func:`time.perf_counter` seconds from the start of the run. A dispatcher
sleeps until each arrival time and starts the request; with a concurrency cap the
request then waits for a slot, and ``send_s`` is when it actually went out. The HTTP
connection pool is unbounded unless a cap is given (aiohttp's default of 100
connections would otherwise queue requests silently).

The client is one Python thread parsing one small JSON object per token. On a machine
where it shares cores with the servers it measures (the 2-core reference setup), it
takes CPU from them; ``lag`` in the results (and the report's checks) shows when it
could not keep up.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Literal, Mapping, Optional, Sequence, TextIO, Union

import aiohttp

from pdkv.lab.serve.metrics import RequestRecord
from pdkv.lab.serve.trace import Prompt, Trace, TraceRequest

__all__ = [
    "ClientConfig",
    "ProgressBar",
    "SSEParser",
    "ServerUnavailable",
    "build_body",
    "fetch_model",
    "normalize_base_url",
    "run_trace",
    "wait_until_ready",
]


class ServerUnavailable(RuntimeError):
    """The server could not be reached or did not become ready (raised before a run starts)."""


class _MalformedSSE(Exception):
    pass


class _StreamError(Exception):
    pass


@dataclass(frozen=True)
class ClientConfig:
    """Typed options of :func:`run_trace` (see its parameters).

    Attributes
    ----------
    model : str
        Model name sent in every request.
    endpoint : {"completions", "chat"}
        ``/v1/completions`` or ``/v1/chat/completions``.
    prompt_kind : {"tokens", "text"}
        Token-id prompts (completions only) or text prompts.
    vocab_size, first_token_id : int
        Range ``[first_token_id, vocab_size)`` of synthetic token ids.
    temperature : float
        Sampling temperature (0 = greedy).
    ignore_eos : bool
        Send ``"ignore_eos": true``.
    include_usage : bool
        Send ``"stream_options": {"include_usage": true}``.
    continuous_usage : bool
        With ``include_usage``, also send ``"continuous_usage_stats": true`` (usage in
        every chunk, so that multi-token chunks are counted per token).
    concurrency : int or None
        Maximum requests in flight; ``None`` for no cap.
    request_timeout_s : float
        Whole-request timeout, seconds.
    connect_timeout_s : float
        TCP connect timeout, seconds.
    api_key : str or None
        Sent as ``Authorization: Bearer``. Never written to results.
    extra_body : dict
        Merged into every request body last (overrides the fields above).
    """

    model: str
    endpoint: Literal["completions", "chat"] = "completions"
    prompt_kind: Literal["tokens", "text"] = "tokens"
    vocab_size: int = 1000
    first_token_id: int = 100
    temperature: float = 0.0
    ignore_eos: bool = True
    include_usage: bool = True
    continuous_usage: bool = True
    concurrency: Optional[int] = None
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    api_key: Optional[str] = field(default=None, repr=False)
    extra_body: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint must be 'completions' or 'chat', got {self.endpoint!r}")
        if self.prompt_kind not in ("tokens", "text"):
            raise ValueError(f"prompt_kind must be 'tokens' or 'text', got {self.prompt_kind!r}")
        if self.endpoint == "chat" and self.prompt_kind == "tokens":
            raise ValueError("the chat endpoint takes text prompts only (prompt_kind='text')")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1 or None, got {self.concurrency}")
        if not (self.request_timeout_s > 0 and self.connect_timeout_s > 0):
            raise ValueError("timeouts must be > 0")

    @property
    def path(self) -> str:
        """The request path, ``/v1/completions`` or ``/v1/chat/completions``."""
        return "/v1/completions" if self.endpoint == "completions" else "/v1/chat/completions"

    def to_dict(self) -> Dict[str, Any]:
        """JSON-serialisable form without the API key."""
        d = asdict(self)
        d.pop("api_key")
        d["extra_body"] = dict(self.extra_body)
        return d


def normalize_base_url(url: str) -> str:
    """``http://h:p``, ``http://h:p/`` and ``http://h:p/v1`` all become ``http://h:p``.

    Raises
    ------
    ValueError
        Not an ``http://`` or ``https://`` URL.
    """
    u = url.strip().rstrip("/")
    if not (u.startswith("http://") or u.startswith("https://")):
        raise ValueError(f"server URL must start with http:// or https://, got {url!r}")
    if u.endswith("/v1"):
        u = u[: -len("/v1")]
    return u


def build_body(config: ClientConfig, prompt: Prompt, max_tokens: int) -> Dict[str, Any]:
    """The JSON body of one streaming request (see the module docstring).

    Parameters
    ----------
    config : ClientConfig
        Client options.
    prompt : str or list of int
        Prompt text or token ids.
    max_tokens : int
        Output tokens to generate.

    Returns
    -------
    dict
    """
    body: Dict[str, Any] = {"model": config.model}
    if config.endpoint == "chat":
        if not isinstance(prompt, str):
            raise ValueError("the chat endpoint needs a text prompt")
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body.update(max_tokens=int(max_tokens), temperature=config.temperature, stream=True)
    if config.include_usage:
        body["stream_options"] = {"include_usage": True}
        if config.continuous_usage:
            body["stream_options"]["continuous_usage_stats"] = True
    if config.ignore_eos:
        body["ignore_eos"] = True
    body.update(config.extra_body)
    return body


class SSEParser:
    """Incremental server-sent-events parser.

    Feed raw bytes as they arrive; get back the ``data`` payload of every event that
    completed (an event ends at a blank line; several ``data:`` lines join with
    ``"\\n"``; comments and other fields are ignored; ``\\r\\n`` is accepted).
    """

    def __init__(self) -> None:
        self._buf = b""
        self._data: List[str] = []

    def feed(self, chunk: bytes) -> List[str]:
        """Consume ``chunk`` and return the payloads of the events it completed."""
        self._buf += chunk
        events: List[str] = []
        while True:
            nl = self._buf.find(b"\n")
            if nl < 0:
                break
            line = self._buf[:nl].rstrip(b"\r").decode("utf-8", errors="replace")
            self._buf = self._buf[nl + 1 :]
            self._line(line, events)
        return events

    def flush(self) -> List[str]:
        """End of stream: return a last event left without its blank line, if any."""
        events: List[str] = []
        if self._buf:
            self._line(self._buf.rstrip(b"\r").decode("utf-8", errors="replace"), events)
            self._buf = b""
        if self._data:
            events.append("\n".join(self._data))
            self._data = []
        return events

    def _line(self, line: str, events: List[str]) -> None:
        if not line:
            if self._data:
                events.append("\n".join(self._data))
                self._data = []
            return
        if line.startswith(":"):
            return
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)


class ProgressBar:
    """A dependency-free progress line on a text stream (stderr by default).

    On a terminal the line redraws in place at most ten times a second; elsewhere a
    line is printed at every 10% of completed requests.

    Parameters
    ----------
    total : int
        Requests in the run.
    label : str
        Prefix such as ``"mixed @ 0.6 req/s"``.
    stream : text stream, optional
        Where to write; ``sys.stderr`` by default.
    """

    def __init__(self, total: int, label: str = "", stream: Optional[TextIO] = None) -> None:
        self.total = total
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.sent = self.done = self.errors = 0
        self._start = time.perf_counter()
        self._last_draw = -math.inf
        self._last_decile = -1
        self._last_text = ""
        isatty = getattr(self.stream, "isatty", None)
        self._tty = bool(isatty and isatty())

    def update(self, *, sent: int = 0, done: int = 0, errors: int = 0) -> None:
        """Add to the counters and redraw if due."""
        self.sent += sent
        self.done += done
        self.errors += errors
        self._draw(final=False)

    def close(self) -> None:
        """Draw the final state and end the line."""
        self._draw(final=True)

    def _line(self) -> str:
        width = 24
        frac = self.done / self.total if self.total else 1.0
        fill = int(round(frac * width))
        elapsed = time.perf_counter() - self._start
        return (
            f"{self.label} [{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} done, "
            f"{self.sent - self.done} in flight, {self.errors} errors, {elapsed:.1f} s"
        )

    def _draw(self, *, final: bool) -> None:
        now = time.perf_counter()
        if self._tty:
            if final or now - self._last_draw >= 0.1:
                self.stream.write("\r" + self._line() + ("\n" if final else ""))
                self.stream.flush()
                self._last_draw = now
            return
        decile = (10 * self.done) // self.total if self.total else 10
        if decile > self._last_decile or final:
            text = self._line()
            if final and self._last_decile == decile and text.split(",")[:3] == self._last_text.split(",")[:3]:
                return  # the final state was already printed (only the clock moved)
            self.stream.write(text + "\n")
            self.stream.flush()
            self._last_decile = decile
            self._last_text = text


def _http_error_message(status: int, text: str) -> str:
    msg = text.strip()
    try:
        obj = json.loads(text)
        if isinstance(obj, dict):
            err = obj.get("error", obj)
            if isinstance(err, dict) and "message" in err:
                msg = str(err["message"])
            elif isinstance(err, str):
                msg = err
    except ValueError:
        pass
    return f"HTTP {status}: {msg[:300]}"


class _StreamState:
    """Per-request parse state: turns chunk objects into record updates."""

    def __init__(self, record: RequestRecord) -> None:
        self.record = record
        self.done = False
        self.usage_tokens: Optional[int] = None

    def handle(self, payload: str, t: float) -> None:
        if payload.strip() == "[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(payload)
        except ValueError:
            raise _MalformedSSE(f"data is not JSON: {payload[:120]!r}") from None
        if not isinstance(obj, dict):
            raise _MalformedSSE(f"data is not a JSON object: {payload[:120]!r}")
        self.handle_object(obj, t)

    def handle_object(self, obj: Mapping[str, Any], t: float) -> None:
        if "error" in obj and obj["error"]:
            err = obj["error"]
            msg = err.get("message", err) if isinstance(err, dict) else err
            raise _StreamError(str(msg)[:300])
        choices = obj.get("choices") or []
        if not isinstance(choices, list):
            raise _MalformedSSE("'choices' is not a list")
        has_text = False
        for choice in choices:
            if not isinstance(choice, dict):
                raise _MalformedSSE("a choice is not an object")
            delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
            message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
            for piece in (
                choice.get("text"),
                delta.get("content"),
                delta.get("reasoning_content"),
                delta.get("reasoning"),
                message.get("content"),
            ):
                if isinstance(piece, str) and piece:
                    has_text = True
            ids = choice.get("token_ids")
            if isinstance(ids, list) and all(isinstance(t, int) for t in ids):
                if self.record.output_token_ids is None:
                    self.record.output_token_ids = []
                self.record.output_token_ids.extend(ids)
                has_text = has_text or bool(ids)  # a token may decode to no text yet
            if choice.get("finish_reason"):
                self.record.finish_reason = str(choice["finish_reason"])
        usage = obj.get("usage")
        grew = 0
        if isinstance(usage, dict):
            ct = usage.get("completion_tokens")
            if isinstance(ct, int):
                # Per-chunk usage (present from the first output chunk on): the growth is
                # this chunk's token count. Usage that first shows up on a later content
                # chunk is a final total, not a per-chunk count.
                per_chunk = self.usage_tokens is not None or not self.record.chunk_times_s
                if choices and per_chunk:
                    grew = max(ct - (self.usage_tokens or 0), 0)
                    self.record.usage_per_chunk = True
                self.usage_tokens = ct
            pt = usage.get("prompt_tokens")
            if isinstance(pt, int):
                self.record.prompt_tokens = pt
        if choices and (has_text or grew > 0):
            self.record.add_chunk(t, grew if grew > 0 else 1)

    def finish(self) -> None:
        r = self.record
        r.output_tokens = self.usage_tokens if self.usage_tokens is not None else sum(r.chunk_tokens)


async def _one_request(
    session: aiohttp.ClientSession,
    url: str,
    config: ClientConfig,
    headers: Mapping[str, str],
    body: Dict[str, Any],
    record: RequestRecord,
    clock: Any,
) -> None:
    """Send one streaming request and fill ``record``; never raises except on cancellation."""
    state = _StreamState(record)
    timeout = aiohttp.ClientTimeout(total=config.request_timeout_s, sock_connect=config.connect_timeout_s)
    record.send_s = clock()
    try:
        async with session.post(url, json=body, headers=headers, timeout=timeout) as resp:
            record.http_status = resp.status
            if resp.status != 200:
                text = await resp.text(errors="replace")
                record.error = _http_error_message(resp.status, text)
                return
            ctype = resp.headers.get("Content-Type", "")
            if ctype.startswith("application/json"):
                # The server ignored "stream": the whole answer is one chunk.
                payload = await resp.read()
                t = clock()
                try:
                    obj = json.loads(payload)
                except ValueError:
                    raise _MalformedSSE(f"body is not JSON: {payload[:120]!r}") from None
                if not isinstance(obj, dict):
                    raise _MalformedSSE("body is not a JSON object")
                state.handle_object(obj, t)
                if record.chunk_times_s and state.usage_tokens:
                    record.chunk_tokens[-1] = state.usage_tokens
                state.done = True
            else:
                parser = SSEParser()
                async for data in resp.content.iter_any():
                    t = clock()
                    for payload in parser.feed(data):
                        state.handle(payload, t)
                        if state.done:
                            break
                    if state.done:
                        break
                if not state.done:
                    t = clock()
                    for payload in parser.flush():
                        state.handle(payload, t)
            t_end = clock()
            if not state.done and record.finish_reason is None:
                record.error = "IncompleteStream: the stream ended before data: [DONE]"
            elif not record.chunk_times_s:
                record.error = "NoOutput: the stream carried no output tokens"
            record.end_s = t_end
    except _MalformedSSE as exc:
        record.error = f"MalformedSSE: {exc}"
    except _StreamError as exc:
        record.error = f"StreamError: {exc}"
    except asyncio.TimeoutError:
        record.error = f"Timeout: no complete answer within {config.request_timeout_s:g} s"
    except aiohttp.ClientConnectorError as exc:
        record.error = f"ConnectionError: {exc}"
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError) as exc:
        record.error = f"Disconnected: {exc}"
    except Exception as exc:  # noqa: BLE001 - a failed request is data, never a crash
        record.error = f"{type(exc).__name__}: {exc}"
    finally:
        state.finish()
        if record.error is not None and record.end_s is None:
            record.end_s = clock()


async def fetch_model(session: aiohttp.ClientSession, url: str, *, timeout_s: float = 10.0) -> str:
    """The first model id that ``GET /v1/models`` lists.

    Parameters
    ----------
    session : aiohttp.ClientSession
        Session to use.
    url : str
        Server base URL.
    timeout_s : float
        Request timeout.

    Raises
    ------
    ServerUnavailable
        No answer, an HTTP error or an empty list.
    """
    base = normalize_base_url(url)
    try:
        async with session.get(base + "/v1/models", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                raise ServerUnavailable(_http_error_message(resp.status, await resp.text(errors="replace")))
            obj = await resp.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        raise ServerUnavailable(f"cannot list models at {base}/v1/models: {type(exc).__name__}: {exc}") from exc
    data = obj.get("data") if isinstance(obj, dict) else None
    if not data or not isinstance(data[0], dict) or "id" not in data[0]:
        raise ServerUnavailable(f"{base}/v1/models lists no model")
    return str(data[0]["id"])


async def wait_until_ready(url: str, *, timeout_s: float = 60.0, interval_s: float = 0.25) -> None:
    """Poll ``/health`` (then ``/v1/models``) until the server answers 200.

    Parameters
    ----------
    url : str
        Server base URL.
    timeout_s : float
        Give up after this long.
    interval_s : float
        Pause between polls.

    Raises
    ------
    ServerUnavailable
        Not ready within ``timeout_s``; the message has the last error.
    """
    base = normalize_base_url(url)
    deadline = time.perf_counter() + timeout_s
    last = "no answer"
    async with aiohttp.ClientSession() as session:
        while True:
            for path in ("/health", "/v1/models"):
                try:
                    timeout = aiohttp.ClientTimeout(total=max(interval_s * 4, 1.0))
                    async with session.get(base + path, timeout=timeout) as resp:
                        await resp.read()
                        if resp.status == 200:
                            return
                        last = f"{path}: HTTP {resp.status}"
                except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                    last = f"{path}: {type(exc).__name__}: {exc}"
            if time.perf_counter() >= deadline:
                raise ServerUnavailable(f"{base} not ready after {timeout_s:g} s ({last})")
            await asyncio.sleep(interval_s)


async def run_trace(
    url: str,
    trace: Union[Trace, Sequence[TraceRequest]],
    *,
    model: Optional[str] = None,
    concurrency: Optional[int] = None,
    endpoint: Literal["completions", "chat"] = "completions",
    prompt_kind: Optional[Literal["tokens", "text"]] = None,
    temperature: float = 0.0,
    ignore_eos: bool = True,
    include_usage: bool = True,
    continuous_usage: bool = True,
    request_timeout_s: float = 600.0,
    connect_timeout_s: float = 10.0,
    vocab_size: int = 1000,
    first_token_id: int = 100,
    api_key: Optional[str] = None,
    extra_body: Optional[Mapping[str, Any]] = None,
    progress: Union[bool, TextIO] = False,
    label: str = "",
    session: Optional[aiohttp.ClientSession] = None,
) -> List[RequestRecord]:
    """Replay ``trace`` against an OpenAI-compatible server and record every request.

    Parameters
    ----------
    url : str
        Server base URL such as ``http://127.0.0.1:8000`` (a trailing ``/v1`` is accepted).
    trace : Trace or sequence of TraceRequest
        Requests with arrival times (seconds from the start of the run). A plain
        sequence gets prompts from seed 0.
    model : str, optional
        Model name; by default the first one ``/v1/models`` lists.
    concurrency : int, optional
        Maximum requests in flight; later ones wait for a slot (their wait shows as
        ``lag``). ``None``: no cap, every request is sent at its arrival time.
    endpoint : {"completions", "chat"}
        Which API to drive.
    prompt_kind : {"tokens", "text"}, optional
        Token-id prompts of exact length, or text; default ``"tokens"`` for
        completions and ``"text"`` for chat. Replayed explicit prompts are sent as is.
    temperature : float
        0 for greedy decoding.
    ignore_eos, include_usage, continuous_usage : bool
        Send ``ignore_eos``, ``stream_options.include_usage`` and
        ``stream_options.continuous_usage_stats``.
    request_timeout_s, connect_timeout_s : float
        Per-request total and connect timeouts (a timeout is recorded as an error).
    vocab_size, first_token_id : int
        Token ids of synthetic prompts are drawn from ``[first_token_id, vocab_size)``.
    api_key : str, optional
        Bearer token.
    extra_body : mapping, optional
        Extra JSON fields merged into every body (e.g. ``{"min_tokens": 16}``).
    progress : bool or text stream
        Show a progress line on stderr (``True``) or on the given stream.
    label : str
        Progress-line prefix.
    session : aiohttp.ClientSession, optional
        Reuse a session (its connection limit then applies); one is created otherwise.

    Returns
    -------
    list of RequestRecord
        One per request, in trace order; failures have ``error`` set.

    Raises
    ------
    ValueError
        Invalid options, or a replayed token-id prompt for the chat endpoint.
    ServerUnavailable
        ``model`` is not given and ``/v1/models`` cannot be read.

    Examples
    --------
    >>> trace = get_preset("mixed").generate(seed=0, duration_s=60)  # doctest: +SKIP
    >>> records = asyncio.run(run_trace("http://127.0.0.1:8000", trace, progress=True))  # doctest: +SKIP
    >>> summarize(records, SLO(ttft_s=2.0, itl_s=0.1)).goodput_fraction  # doctest: +SKIP
    """
    if not isinstance(trace, Trace):
        trace = Trace(tuple(trace))
    base = normalize_base_url(url)
    kind = prompt_kind or ("tokens" if endpoint == "completions" else "text")
    # Validate everything that does not need the model before touching the network.
    ClientConfig(
        model="", endpoint=endpoint, prompt_kind=kind, concurrency=concurrency,
        request_timeout_s=request_timeout_s, connect_timeout_s=connect_timeout_s,
    )
    prompts = [trace.prompt(r, kind=kind, vocab_size=vocab_size, first_id=first_token_id) for r in trace.requests]
    if endpoint == "chat" and any(not isinstance(p, str) for p in prompts):
        raise ValueError("the chat endpoint needs text prompts, and the trace has token-id prompts")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    own = session is None
    if session is None:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency or 0))
    try:
        if model is None:
            model = await fetch_model(session, base, timeout_s=connect_timeout_s)
        config = ClientConfig(
            model=model,
            endpoint=endpoint,
            prompt_kind=kind,
            vocab_size=vocab_size,
            first_token_id=first_token_id,
            temperature=temperature,
            ignore_eos=ignore_eos,
            include_usage=include_usage,
            continuous_usage=continuous_usage,
            concurrency=concurrency,
            request_timeout_s=request_timeout_s,
            connect_timeout_s=connect_timeout_s,
            api_key=api_key,
            extra_body=dict(extra_body or {}),
        )
        bodies = [build_body(config, p, r.output_len) for p, r in zip(prompts, trace.requests)]
        records = [
            RequestRecord(index=r.index, scheduled_s=r.arrival_s, prompt_len=r.prompt_len, max_tokens=r.output_len,
                          prompt_token_ids=p if isinstance(p, list) else None)  # for the perfect-cache bound
            for p, r in zip(prompts, trace.requests)
        ]
        bar: Optional[ProgressBar] = None
        if progress:
            bar = ProgressBar(len(records), label, None if progress is True else progress)  # type: ignore[arg-type]
        await _dispatch(session, base + config.path, config, headers, bodies, records, bar)
        return records
    finally:
        if own:
            await session.close()


async def _dispatch(
    session: aiohttp.ClientSession,
    url: str,
    config: ClientConfig,
    headers: Mapping[str, str],
    bodies: List[Dict[str, Any]],
    records: List[RequestRecord],
    bar: Optional[ProgressBar],
) -> None:
    sem = asyncio.Semaphore(config.concurrency) if config.concurrency else None
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    async def one(i: int) -> None:
        if sem is not None:
            async with sem:
                await go(i)
        else:
            await go(i)

    async def go(i: int) -> None:
        if bar is not None:
            bar.update(sent=1)
        await _one_request(session, url, config, headers, bodies[i], records[i], clock)
        if bar is not None:
            bar.update(done=1, errors=int(records[i].error is not None))

    tasks: List["asyncio.Task[None]"] = []
    try:
        for i in sorted(range(len(records)), key=lambda j: records[j].scheduled_s):
            delay = records[i].scheduled_s - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(i)))
        if tasks:
            await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if bar is not None:
            bar.close()
