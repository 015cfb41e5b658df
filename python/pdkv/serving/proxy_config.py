"""The proxy's settings: :class:`ProxyMode` and :class:`ProxyConfig` (see
:mod:`pdkv.serving.proxy` for what the modes and deadlines mean)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Sequence

from pdkv.errors import InvalidArgument

from ..discovery import parse_registry_url
from .rerole import RerolePolicy

__all__ = ["DEFAULT_HYBRID_THRESHOLD", "ProxyConfig", "ProxyMode", "Routing", "parse_worker_urls"]

#: Default prompt length (tokens) up to which hybrid mode prefills on the decode
#: worker. Measured with ``python -m pdkv.serving.calibrate`` on the 2-core development
#: machine with SmolLM2-135M (README, "The hybrid threshold"): the KV hop (proxy round
#: trips, shm write, notification) costs a request about 10 ms there, while a local
#: prefill stalls a decode batch of 8 by about 15-25 ms at 8 tokens and 60-80 ms at 16;
#: so only prompts of up to 8 tokens are cheaper to prefill locally.
DEFAULT_HYBRID_THRESHOLD = 8


class ProxyMode(str, enum.Enum):
    """How the proxy serves requests (see :mod:`pdkv.serving.proxy`)."""

    DISAGG = "disagg"
    HYBRID = "hybrid"
    COLOCATED = "colocated"


class Routing(str, enum.Enum):
    """How the proxy picks workers (see :mod:`pdkv.serving.proxy_kv`)."""

    ROUND_ROBIN = "round-robin"   # the least-loaded worker, ties broken round-robin
    KV = "kv"                     # by the KV a worker holds (the fleet index) and its load


def parse_worker_urls(v: Sequence[str] | str) -> tuple[str, ...]:
    """Worker URLs from a list or a comma-separated string, without trailing slashes.

    Raises
    ------
    InvalidArgument
        A URL that is not ``http://`` or ``https://``.
    """
    items = v.split(",") if isinstance(v, str) else list(v)
    out = []
    for u in items:
        u = u.strip().rstrip("/")
        if not u:
            continue
        if not (u.startswith("http://") or u.startswith("https://")):
            raise InvalidArgument(f"worker URL must start with http:// or https://, got {u!r}")
        out.append(u)
    return tuple(out)


@dataclass(frozen=True)
class ProxyConfig:
    """Proxy settings.

    Attributes
    ----------
    mode : ProxyMode or str
    prefill : sequence of str
        Prefill worker URLs (disagg and hybrid).
    decode : sequence of str
        Decode worker URLs; in colocated mode the engine workers.
    hybrid_threshold : int
        Hybrid: prompts of at most this many tokens are prefilled by the decode worker.
    tokenizer : str, optional
        Model directory to load the tokenizer from (default: the one the workers report,
        if it exists here). Without a tokenizer only token-id prompts are served.
    kv_timeout_s : float
        How long a prefill worker may take to deliver a prompt's KV (queueing, compute
        and transfer) before the decode worker recomputes instead.
    connect_timeout_s : float
        TCP connect to a worker.
    read_timeout_s : float
        Longest silence from a decode worker while tokens are due.
    headers_timeout_s : float
        From sending a request to a worker to its response headers (a decode worker
        answers them once it reserved blocks, which may wait for free ones).
    liveness_s : float
        Interval of the liveness probes, and the silence after which a wait probes the
        worker it waits on.
    probe_timeout_s : float
        Deadline of one liveness probe (``GET /pd/stats``).
    retries : int
        Other workers tried after one failed (migrations included).
    down_cooldown_s : float
        How long an unreachable worker stays out of rotation.
    max_body_bytes : int, optional
        Largest request body (413 above); default: from the model's context (see
        :func:`~pdkv.serving.openai_api.body_limit`).
    registry : str, optional
        ``etcd://host:port``: also route to the workers registered there (see
        :mod:`pdkv.serving.discovery`); ``prefill``/``decode`` may then be empty.
    rerole : RerolePolicy, optional
        Disagg and hybrid: move idle workers between the prefill and decode pools as
        the measured ratio moves (see :mod:`pdkv.serving.rerole`). Off by default.
    secret : str, optional
        The cluster secret the proxy signs every worker call with (default
        ``$PDKV_SECRET``; required to start; see :mod:`pdkv.serving.auth`). Never shown
        in ``repr``.
    api_keys : tuple of str, optional
        Keys clients must send (``Authorization: Bearer <key>``) on the OpenAI routes;
        default ``$PDKV_API_KEY`` (comma-separated), else none: the routes are open.
        ``/health`` stays open.
    routing : Routing or str
        ``round-robin`` (default: the least-loaded worker) or ``kv``: by the prompt
        tokens each worker already holds (the fleet KV index) and its load, with
        session affinity while the index knows nothing of the prompt (see
        :mod:`pdkv.serving.proxy_kv`).
    kv_events_interval_s : float
        ``kv``: seconds between two polls of each worker's ``/pd/kv_events``.
    kv_snapshot_interval_s : float
        ``kv``: a full snapshot of each worker's cache at least this often.
    kv_load_tokens : int
        ``kv``: what one request in flight at a worker weighs against prompt tokens to
        compute or receive (a worker holding ``k`` more tokens of a prompt is preferred
        while it has fewer than ``k / kv_load_tokens`` more requests in flight).
    """

    mode: ProxyMode
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    hybrid_threshold: int = DEFAULT_HYBRID_THRESHOLD
    tokenizer: str | None = None
    kv_timeout_s: float = 30.0
    connect_timeout_s: float = 3.0
    read_timeout_s: float = 120.0
    headers_timeout_s: float = 90.0
    liveness_s: float = 2.0
    probe_timeout_s: float = 2.0
    retries: int = 2
    down_cooldown_s: float = 2.0
    max_body_bytes: int | None = None
    registry: str | None = None
    rerole: RerolePolicy | None = None
    secret: str | None = field(default=None, repr=False)
    api_keys: tuple[str, ...] | None = field(default=None, repr=False)
    routing: Routing = Routing.ROUND_ROBIN
    kv_events_interval_s: float = 0.25
    kv_snapshot_interval_s: float = 10.0
    kv_load_tokens: int = 128

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "mode", ProxyMode(self.mode))
        except ValueError:
            raise InvalidArgument(f"mode must be one of {[m.value for m in ProxyMode]}, got {self.mode!r}") \
                from None
        object.__setattr__(self, "prefill", parse_worker_urls(self.prefill))
        object.__setattr__(self, "decode", parse_worker_urls(self.decode))
        if self.registry is not None:
            parse_registry_url(self.registry)  # the workers may all come from the registry
        elif not self.decode:
            raise InvalidArgument("the proxy needs at least one decode (or, colocated, engine) worker URL")
        if self.mode is ProxyMode.COLOCATED and self.prefill:
            raise InvalidArgument("colocated mode takes engine workers only (no prefill workers)")
        if self.mode is not ProxyMode.COLOCATED and not self.prefill and self.registry is None:
            raise InvalidArgument(f"{self.mode.value} mode needs at least one prefill worker URL")
        if not isinstance(self.hybrid_threshold, int) or self.hybrid_threshold < 0:
            raise InvalidArgument(f"hybrid_threshold must be an integer >= 0, got {self.hybrid_threshold!r}")
        try:
            object.__setattr__(self, "routing", Routing(self.routing))
        except ValueError:
            raise InvalidArgument(f"routing must be one of {[r.value for r in Routing]}, got {self.routing!r}") \
                from None
        if not isinstance(self.kv_load_tokens, int) or self.kv_load_tokens < 0:
            raise InvalidArgument(f"kv_load_tokens must be an integer >= 0, got {self.kv_load_tokens!r}")
        for k in ("kv_timeout_s", "connect_timeout_s", "read_timeout_s", "down_cooldown_s", "headers_timeout_s",
                  "liveness_s", "probe_timeout_s", "kv_events_interval_s", "kv_snapshot_interval_s"):
            if not getattr(self, k) > 0:
                raise InvalidArgument(f"{k} must be > 0, got {getattr(self, k)!r}")
        if self.retries < 0:
            raise InvalidArgument(f"retries must be >= 0, got {self.retries}")
        if self.max_body_bytes is not None and (not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1):
            raise InvalidArgument(f"max_body_bytes must be an integer >= 1, got {self.max_body_bytes!r}")
        if self.api_keys is not None:
            if isinstance(self.api_keys, str):
                object.__setattr__(self, "api_keys", tuple(k.strip() for k in self.api_keys.split(",") if k.strip()))
            else:
                object.__setattr__(self, "api_keys", tuple(self.api_keys))
            if any(not isinstance(k, str) or not k for k in self.api_keys):
                raise InvalidArgument("api_keys must be non-empty strings")
        if self.rerole is not None and (self.mode is ProxyMode.COLOCATED or not isinstance(self.rerole, RerolePolicy)):
            raise InvalidArgument("rerole takes a RerolePolicy, in disagg or hybrid mode only")

