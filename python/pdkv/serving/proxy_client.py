"""The proxy's HTTP client to its workers: one ``aiohttp`` session whose every call is
signed with the cluster secret (:class:`WorkerClient`), and the helpers that read a
worker's answer (status, NDJSON lines, error lines)."""

from __future__ import annotations

from typing import Any, AsyncIterator

import aiohttp

from pdkv.errors import InvalidArgument

from ..credential import Credential
from .auth import Signer
from .openai_api import APIError
from .protocol import BUSY_CODES, StreamError
from .proxy_pool import PoolWorker, WorkerBusy, WorkerFailed

__all__ = ["END", "WorkerClient", "as_dict", "check_status", "done_with", "error_message", "next_or_end",
           "raise_worker_error"]


class WorkerClient:
    """Signed calls to workers over one keep-alive session.

    Parameters
    ----------
    secret : str, optional
        The cluster secret (default ``$PDKV_SECRET``).
    connect_timeout_s : float
        TCP connect deadline of every call.
    """

    def __init__(self, secret: str | None, connect_timeout_s: float) -> None:
        self.credential = Credential.from_env(secret)
        self._signer = Signer(self.credential) if self.credential is not None else None
        self._connect_timeout_s = connect_timeout_s
        self._session: aiohttp.ClientSession | None = None

    def start(self) -> None:
        """Opens the session.

        Raises
        ------
        InvalidArgument
            No cluster secret (``secret`` or ``$PDKV_SECRET``): workers refuse unsigned calls.
        """
        if self._signer is None:
            raise InvalidArgument("the proxy needs the cluster secret to call its workers: set PDKV_SECRET (the "
                                  "value the workers have) or pass --secret")
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=False))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def timeout(self) -> aiohttp.ClientTimeout:
        """No total deadline (the callers bound each wait), connect within ``connect_timeout_s``."""
        return aiohttp.ClientTimeout(total=None, sock_connect=self._connect_timeout_s,
                                     connect=self._connect_timeout_s)

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._signer is None:
            raise APIError(503, "the proxy is not started", code="service_unavailable")
        return self._session

    def post(self, url: str, body: Any, **kw: Any) -> Any:
        """A signed ``POST`` of JSON ``body`` to a worker (``async with`` or await it)."""
        assert self._signer is not None
        return self._signer.post(self.session, url, json=body, **kw)

    def get(self, url: str, **kw: Any) -> Any:
        """A signed ``GET`` to a worker."""
        assert self._signer is not None
        return self._signer.get(self.session, url, **kw)


async def check_status(w: PoolWorker, r: aiohttp.ClientResponse) -> None:
    """Raises unless worker ``w`` answered 200: :class:`WorkerBusy` (503), :class:`WorkerFailed`
    (refused our signature, or 5xx), :class:`APIError` (it refused the request: 4xx)."""
    if r.status == 200:
        return
    try:
        body = await r.json(content_type=None)
        msg = body["error"]["message"]
    except (ValueError, KeyError, TypeError, aiohttp.ClientError):
        msg = f"HTTP {r.status}"
    if r.status == 503:
        raise WorkerBusy(msg)
    if r.status in (401, 403):
        w.refused(r.status, r.url.path)
        raise WorkerFailed(w, f"HTTP {r.status}: {msg}", before_response=True)
    if 400 <= r.status < 500:
        raise APIError(400 if r.status != 409 else 409, f"{w.role} worker refused the request: {msg}",
                       code="invalid_request")
    raise WorkerFailed(w, f"HTTP {r.status}: {msg}")


def done_with(r: aiohttp.ClientResponse) -> None:
    """Returns the connection to the pool if the body was read to the end, else closes
    it (the worker sees the disconnect and cancels the request)."""
    if r.content.at_eof():
        r.release()
    else:
        r.close()


def raise_worker_error(d: PoolWorker, line: dict[str, Any]) -> None:
    """An ``{"error": ...}`` line from decode worker ``d``: the request's fault (4xx)
    goes to the client as is; the worker's fault raises :class:`WorkerBusy` (out of
    KV blocks: it stays in rotation) or :class:`WorkerFailed`, and the stream is
    continued on another worker like that of a dead one."""
    if "error" not in line:
        return
    err = StreamError.from_line(line)
    if err.request_fault:
        raise APIError(err.status, f"decode worker {d.url}: {err.message}", code=err.code)
    if err.code in BUSY_CODES:
        raise WorkerBusy(f"{err.code}: {err.message}")
    raise WorkerFailed(d, f"it ended the stream with {err.code}: {err.message}")


def error_message(line: dict[str, Any]) -> str:
    err = line.get("error")
    if isinstance(err, dict):
        return str(err.get("message", err))
    return str(err)


def as_dict(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


#: What :func:`next_or_end` returns at the end of the iterator.
END = object()


async def next_or_end(it: AsyncIterator[Any]) -> Any:
    try:
        return await it.__anext__()
    except StopAsyncIteration:  # not through a Task: return a marker instead
        return END
