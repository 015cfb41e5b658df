"""Closed-loop session client: runs a :class:`~pdkv.lab.serve.trace_sessions.SessionTrace`.

Each session is one asyncio task. It waits for the session's start time, sends turn 0
(the shared prefix plus the first message, as token ids to ``/v1/completions``), and
then, for every later turn, waits for the previous answer to end, waits the turn's
think time, and sends the previous prompt + the token ids the server actually
returned for the previous answer + the turn's new tokens. The server is asked for the
generated ids with ``"return_token_ids": true`` (the vLLM extension pdkv's proxy
implements); a server that does not return them cannot be driven this way, and the
session stops with a ``NoTokenIds`` error on its remaining turns.

Every request is streamed and recorded exactly like :func:`pdkv.lab.serve.client.run_trace`
(same :class:`~pdkv.lab.serve.metrics.RequestRecord`, TTFT/ITL definitions, error
handling). A turn's ``scheduled_s`` is when it became due (its session's start, or the
previous answer's end plus the think time), so ``lag`` is the client's own delay (a
concurrency cap). Records carry ``session`` and ``turn``, and keep the prompt they sent
in memory (``prompt_token_ids``, not written to results.json) for
:func:`pdkv.lab.serve.prefix.hit_rate_max`.

Every request of a session carries ``"user": "session-<i>"`` and the header
``X-Session-Id: <i>``, which a KV-aware proxy may use for session affinity.

A failed turn ends its session: its later turns are recorded as never sent, with
``error = "SessionAborted: ..."`` (their prompts would depend on the missing answer).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Dict, List, Literal, Mapping, Optional, TextIO, Union

import aiohttp

from pdkv.lab.serve.client import ClientConfig, ProgressBar, _one_request, build_body, fetch_model, normalize_base_url
from pdkv.lab.serve.metrics import RequestRecord
from pdkv.lab.serve.trace_sessions import Session, SessionTrace

__all__ = ["run_sessions"]


async def run_sessions(
    url: str,
    trace: SessionTrace,
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
    """Run every session of ``trace`` against an OpenAI-compatible server.

    Parameters
    ----------
    url : str
        Server base URL.
    trace : SessionTrace
        Sessions to run.
    endpoint, prompt_kind
        Only ``"completions"`` with ``"tokens"`` (the default): a turn's prompt holds
        the previous answer's token ids.
    extra_body : mapping, optional
        Extra JSON fields for every body (``return_token_ids`` is always sent).
    Other parameters
        As :func:`pdkv.lab.serve.client.run_trace`.

    Returns
    -------
    list of RequestRecord
        One per turn, in request-index order (session by session).

    Raises
    ------
    ValueError
        The chat endpoint or text prompts (sessions need token-id prompts), or bad options.
    ServerUnavailable
        ``model`` is not given and ``/v1/models`` cannot be read.
    """
    if endpoint != "completions" or (prompt_kind or "tokens") != "tokens":
        raise ValueError("session workloads send token-id prompts to /v1/completions: use --endpoint completions "
                         "and --prompt-format tokens")
    base = normalize_base_url(url)
    ClientConfig(model="", concurrency=concurrency, request_timeout_s=request_timeout_s,
                 connect_timeout_s=connect_timeout_s)
    own = session is None
    if session is None:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency or 0))
    try:
        if model is None:
            model = await fetch_model(session, base, timeout_s=connect_timeout_s)
        config = ClientConfig(
            model=model, temperature=temperature, ignore_eos=ignore_eos, include_usage=include_usage,
            continuous_usage=continuous_usage, concurrency=concurrency, request_timeout_s=request_timeout_s,
            connect_timeout_s=connect_timeout_s, api_key=api_key, vocab_size=vocab_size,
            first_token_id=first_token_id, extra_body={**dict(extra_body or {}), "return_token_ids": True},
        )
        records = [
            RequestRecord(index=s.first_index + k, scheduled_s=s.start_s if k == 0 else 0.0, prompt_len=t.prompt_len,
                          max_tokens=t.output_len, session=s.index, turn=k)
            for s in trace.sessions for k, t in enumerate(s.turns)
        ]
        by_index = {r.index: r for r in records}
        bar = ProgressBar(len(records), label, None if progress is True else progress) if progress else None
        runner = _Runner(session, base + config.path, config, api_key, trace, by_index, bar)
        await runner.run()
        return sorted(records, key=lambda r: r.index)
    finally:
        if own:
            await session.close()


class _Runner:
    """The session tasks of one run, sharing a clock, a concurrency cap and a progress bar."""

    def __init__(self, http: aiohttp.ClientSession, url: str, config: ClientConfig, api_key: Optional[str],
                 trace: SessionTrace, records: Dict[int, RequestRecord], bar: Optional[ProgressBar]) -> None:
        self.http, self.url, self.config, self.trace, self.records, self.bar = http, url, config, trace, records, bar
        self.auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.sem = asyncio.Semaphore(config.concurrency) if config.concurrency else None
        self.shared = trace.shared_prompt(vocab_size=config.vocab_size, first_id=config.first_token_id)
        self.t0 = 0.0

    def clock(self) -> float:
        return time.perf_counter() - self.t0

    async def run(self) -> None:
        self.t0 = time.perf_counter()
        tasks = [asyncio.ensure_future(self.session(s)) for s in self.trace.sessions]
        try:
            if tasks:
                await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            if self.bar is not None:
                self.bar.close()

    async def session(self, s: Session) -> None:
        kw = dict(vocab_size=self.config.vocab_size, first_id=self.config.first_token_id)
        prompt: List[int] = []
        for k, turn in enumerate(s.turns):
            rec = self.records[s.first_index + k]
            if k == 0:
                prompt = self.shared + self.trace.new_tokens(s, 0, **kw)
            else:
                prev = self.records[s.first_index + k - 1]
                prompt = prompt + list(prev.output_token_ids or []) + self.trace.new_tokens(s, k, **kw)
                rec.scheduled_s = (prev.end_s or 0.0) + turn.think_s
            delay = rec.scheduled_s - self.clock()
            if delay > 0:
                await asyncio.sleep(delay)
            rec.prompt_token_ids = prompt
            body = build_body(self.config, prompt, turn.output_len)
            body["user"] = f"session-{s.index}"
            headers = {**self.auth, "X-Session-Id": str(s.index)}
            await self.send(body, headers, rec)
            if rec.ok and rec.output_token_ids is None:
                rec.error = "NoTokenIds: the server did not return the answer's token ids (return_token_ids)"
            if not rec.ok:
                for later in range(k + 1, len(s.turns)):
                    self.records[s.first_index + later].error = (
                        f"SessionAborted: turn {k} of session {s.index} failed, so this turn's prompt is unknown")
                    if self.bar is not None:
                        self.bar.update(sent=1, done=1, errors=1)
                return

    async def send(self, body: Dict[str, Any], headers: Dict[str, str], rec: RequestRecord) -> None:
        if self.sem is not None:
            async with self.sem:
                await self._send(body, headers, rec)
        else:
            await self._send(body, headers, rec)

    async def _send(self, body: Dict[str, Any], headers: Dict[str, str], rec: RequestRecord) -> None:
        if self.bar is not None:
            self.bar.update(sent=1)
        await _one_request(self.http, self.url, self.config, headers, body, rec, self.clock)
        if self.bar is not None:
            self.bar.update(done=1, errors=int(rec.error is not None))
