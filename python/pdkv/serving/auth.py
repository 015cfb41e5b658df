"""Signed worker calls: who may use a worker's ``/pd/*`` routes.

Every call a proxy (or a tool acting for the cluster) makes to a worker's ``/pd/*``
routes carries a request signature made with the cluster credential
(:class:`pdkv.credential.Credential`, purpose ``"http"``)::

    X-PDKV-Auth: v1 ts=<unix seconds> nonce=<32 hex> mac=<64 hex>
    mac = HMAC(key("http"), method, path?query, ts, nonce, sha256(body) hex)

The worker checks it in one aiohttp middleware (:class:`WorkerAuth`) before any
handler runs, so no route can forget it:

* no header, a malformed one, or a MAC no accepted secret made -> 401;
* a timestamp more than ``window_s`` (default 30 s) from the worker's clock -> 401
  ``expired``;
* a nonce already seen within the window -> 401 ``replayed``. Nonces are remembered
  for twice the window (a signature is accepted only within it), in a bounded cache;
  when the cache is full the worker refuses signed calls (503, ``Retry-After``)
  rather than forget a nonce that could then be replayed. Only correctly signed
  calls enter the cache, so only a holder of the secret can fill it.

Header checks (presence, syntax, timestamp, replay) come before the body is read;
the MAC (it covers the body's SHA-256) is checked once the body is read within the
worker's body limit and deadline, before it is parsed and before any side effect.
A worker without a secret (a colocated worker started without ``PDKV_SECRET``)
refuses every ``/pd/*`` call; its OpenAI routes, ``/health`` and ``/metrics`` stay
open. The secret itself never travels.
"""

from __future__ import annotations

import collections
import hashlib
import re
import secrets
import time
from typing import Any, Awaitable, Callable, Mapping

from aiohttp import web
from yarl import URL

from pdkv.credential import Credential

from .aio import json_error
from .limits import BODY_KEY  # where the middleware leaves the body it read (read_body returns it)

__all__ = ["AUTH_HEADER", "BODY_KEY", "DEFAULT_MAX_NONCES", "DEFAULT_WINDOW_S", "PROTECTED_PREFIX", "Signer",
           "WorkerAuth", "sign_headers"]

#: The request header carrying the signature.
AUTH_HEADER = "X-PDKV-Auth"
#: Paths under this prefix need a signature.
PROTECTED_PREFIX = "/pd/"
#: Seconds a signature's timestamp may be off the worker's clock.
DEFAULT_WINDOW_S = 30.0
#: Nonces remembered at once (each ~100 bytes: 100k is ~10 MB).
DEFAULT_MAX_NONCES = 100_000
PURPOSE = "http"

_HEADER_RE = re.compile(r"^v1 ts=(\d{1,12}) nonce=([0-9a-f]{32}) mac=([0-9a-f]{64})$")


def _target(url: URL | str) -> str:
    """``path?query`` as the server sees it (``request.path_qs``)."""
    u = URL(url) if isinstance(url, str) else url
    return u.raw_path_qs


def sign_headers(cred: Credential, method: str, target: str, body: bytes = b"", *, ts: int | None = None,
                 nonce: str | None = None) -> dict[str, str]:
    """The ``X-PDKV-Auth`` header for one call.

    Parameters
    ----------
    cred : Credential
    method : str
        ``GET``, ``POST``...
    target : str
        The path and query (``/pd/stats``), or a whole URL.
    body : bytes
        The exact bytes sent.
    """
    if "://" in target:
        target = _target(target)
    ts = int(time.time()) if ts is None else ts
    nonce = secrets.token_hex(16) if nonce is None else nonce
    mac = cred.sign(PURPOSE, method.upper(), target, str(ts), nonce, hashlib.sha256(body).hexdigest())
    return {AUTH_HEADER: f"v1 ts={ts} nonce={nonce} mac={mac}"}


class Signer:
    """Signs a client's calls to workers: :meth:`request` is ``session.request`` with
    the body serialized here (JSON) and the signature added."""

    def __init__(self, cred: Credential) -> None:
        self.cred = cred

    def kwargs(self, method: str, url: str, json_body: Any = None, headers: Mapping[str, str] | None = None
               ) -> dict[str, Any]:
        import json

        body = b"" if json_body is None else json.dumps(json_body, separators=(",", ":")).encode()
        h = dict(headers or {})
        if json_body is not None:
            h["Content-Type"] = "application/json"
        h.update(sign_headers(self.cred, method, _target(url), body))
        out: dict[str, Any] = {"headers": h}
        if json_body is not None:
            out["data"] = body
        return out

    def request(self, session: Any, method: str, url: str, *, json: Any = None, **kw: Any) -> Any:
        """``session.request(method, url, ...)``, signed (usable with ``async with``)."""
        return session.request(method, url, **self.kwargs(method, url, json), **kw)

    def post(self, session: Any, url: str, *, json: Any = None, **kw: Any) -> Any:
        return self.request(session, "POST", url, json=json if json is not None else {}, **kw)

    def get(self, session: Any, url: str, **kw: Any) -> Any:
        return self.request(session, "GET", url, **kw)


def _refuse(status: int, problem: str, message: str, headers: Mapping[str, str] | None = None) -> web.Response:
    resp = json_error(status, message, type="authentication_error" if status == 401 else None, code=problem)
    resp.headers["WWW-Authenticate"] = "PDKV-HMAC"
    for k, v in (headers or {}).items():
        resp.headers[k] = v
    return resp


class WorkerAuth:
    """The middleware that checks ``X-PDKV-Auth`` on every ``/pd/*`` call.

    Parameters
    ----------
    cred : Credential or None
        None: every ``/pd/*`` call is refused.
    read_body : callable
        ``await read_body(request) -> bytes``: the body within the worker's limit and
        deadline (raises aiohttp's 413/408).
    window_s : float
    max_nonces : int
    on_refuse : callable, optional
        Called with the problem code of each refusal (metrics).
    """

    def __init__(self, cred: Credential | None, read_body: Callable[[web.Request], Awaitable[bytes]], *,
                 window_s: float = DEFAULT_WINDOW_S, max_nonces: int = DEFAULT_MAX_NONCES,
                 on_refuse: Callable[[str], None] | None = None, clock: Callable[[], float] = time.time) -> None:
        self.cred = cred
        self.read_body = read_body
        self.window_s = float(window_s)
        self.max_nonces = int(max_nonces)
        self.on_refuse = on_refuse
        self.clock = clock
        self.refused: collections.Counter = collections.Counter()
        self._nonces: dict[str, float] = {}                       # nonce -> forget after (clock)
        self._order: collections.deque = collections.deque()      # (forget after, nonce), in insertion order

    def _purge(self, now: float) -> None:
        while self._order and self._order[0][0] <= now:
            _, n = self._order.popleft()
            self._nonces.pop(n, None)

    def _no(self, status: int, problem: str, message: str, headers: Mapping[str, str] | None = None
            ) -> web.Response:
        self.refused[problem] += 1
        if self.on_refuse is not None:
            self.on_refuse(problem)
        return _refuse(status, problem, message, headers)

    @web.middleware
    async def middleware(self, request: web.Request, handler: Callable) -> Any:
        if not request.path.startswith(PROTECTED_PREFIX) and request.path != PROTECTED_PREFIX.rstrip("/"):
            return await handler(request)
        if self.cred is None:
            return self._no(401, "auth_disabled", "this worker has no cluster secret (PDKV_SECRET): its /pd/* "
                            "routes are disabled")
        raw = request.headers.get(AUTH_HEADER)
        if raw is None:
            return self._no(401, "auth_missing", f"missing {AUTH_HEADER} header: /pd/* calls must be signed with "
                            "the cluster credential")
        m = _HEADER_RE.match(raw.strip()) if len(raw) < 200 else None
        if m is None:
            return self._no(401, "auth_malformed", f"malformed {AUTH_HEADER} header: expected "
                            "'v1 ts=<unix seconds> nonce=<32 hex> mac=<64 hex>'")
        ts_s, nonce, mac = m.groups()
        now = self.clock()
        if abs(now - int(ts_s)) > self.window_s:
            return self._no(401, "expired", f"the signature's timestamp is more than {self.window_s:g} s from "
                            "this worker's clock (expired, or clocks differ)")
        self._purge(now)
        if nonce in self._nonces:
            return self._no(401, "replayed", "this signature's nonce was already used (replayed)")
        body = await self.read_body(request)
        if not self.cred.verify(PURPOSE, mac, request.method.upper(), request.raw_path, ts_s, nonce,
                                hashlib.sha256(body).hexdigest()):
            return self._no(401, "auth_failed", "the request signature does not verify (wrong secret, or the "
                            "request was altered)")
        # Checked again: another call with the same nonce may have won while the body was read.
        if nonce in self._nonces:
            return self._no(401, "replayed", "this signature's nonce was already used (replayed)")
        if len(self._nonces) >= self.max_nonces:
            return self._no(503, "auth_busy", f"{len(self._nonces)} signatures seen within "
                            f"{2 * self.window_s:g} s: refusing more until they expire", {"Retry-After": "1"})
        forget = now + 2 * self.window_s
        self._nonces[nonce] = forget
        self._order.append((forget, nonce))
        request[BODY_KEY] = body
        return await handler(request)
