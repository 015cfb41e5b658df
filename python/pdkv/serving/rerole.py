"""A proxy that moves workers between the prefill and decode pools as the load moves.

Off by default (``ProxyConfig(rerole=RerolePolicy(...))``, ``pdkv serve proxy
--rerole PLAN_JSON``). The proxy keeps a sliding window of what it routed: prompt tokens
sent to prefill workers and tokens streamed from decode workers. Every ``interval_s``
it turns them into the workers each pool needs with the per-worker capacity
``pdkv plan`` measured (prefill seconds per prompt, decode tokens/s within the ITL
objective) and splits its current number of workers in that ratio
(:func:`decide`). When the integer split it has is off by more than rounding (plus
``hysteresis`` workers), it re-roles one worker of the pool with too many:

1. takes the least-loaded one out of rotation (no new requests),
2. waits until the requests it has there finish (in-flight requests are never moved),
3. ``POST /pd/role`` on the worker, which drains itself too (for other proxies: it
   answers new work with 503 and, when registered, publishes ``draining``), switches
   role and, when registered, publishes itself ``serving`` in the new role,
4. puts it into the other pool (the proxy fetches its ``/pd/info`` again).

A failed switch (the worker stayed busy past ``drain_timeout_s``, or is unreachable)
puts it back into rotation in its old role. Run the re-roling on one proxy per pool:
two controllers would each act on the same measurement.
"""

from __future__ import annotations

import collections
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Deque, Optional

from pdkv.errors import InvalidArgument
from pdkv.serving.capacity import Capacity

__all__ = ["DemandWindow", "RerolePolicy", "decide"]


@dataclass(frozen=True)
class RerolePolicy:
    """When and how the proxy re-roles workers.

    Attributes
    ----------
    prefill_fixed_s, prefill_s_per_token : float
        One prefill worker's time for a prompt of ``L`` tokens: ``fixed + L * per_token``.
    decode_tok_s : float
        Tokens/s one decode worker produces within the ITL objective.
    interval_s : float
        How often the measured ratio is checked.
    window_s : float
        The measurement window (sliding).
    min_requests : int
        Requests the window must hold before it is trusted.
    hysteresis : float
        Workers the ideal split must be beyond rounding before a worker moves.
    drain_timeout_s : float
        How long a worker may take to finish its requests before the switch is given up.
    """

    prefill_fixed_s: float
    prefill_s_per_token: float
    decode_tok_s: float
    interval_s: float = 5.0
    window_s: float = 30.0
    min_requests: int = 8
    hysteresis: float = 0.25
    drain_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        for k in ("prefill_fixed_s", "prefill_s_per_token", "hysteresis"):
            v = getattr(self, k)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise InvalidArgument(f"rerole {k} must be a finite number >= 0, got {v!r}")
        for k in ("decode_tok_s", "interval_s", "window_s", "drain_timeout_s"):
            v = getattr(self, k)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise InvalidArgument(f"rerole {k} must be a finite number > 0, got {v!r}")
        if self.prefill_fixed_s + self.prefill_s_per_token <= 0:
            raise InvalidArgument("rerole: a prefill cannot cost nothing (prefill_fixed_s + prefill_s_per_token > 0)")
        if not isinstance(self.min_requests, int) or self.min_requests < 1:
            raise InvalidArgument(f"rerole min_requests must be an integer >= 1, got {self.min_requests!r}")

    def prefill_s(self, prompt_tokens: int) -> float:
        return self.prefill_fixed_s + prompt_tokens * self.prefill_s_per_token

    @classmethod
    def from_plan(cls, path: str | Path, **overrides: Any) -> "RerolePolicy":
        """From the ``plan.json`` that ``pdkv plan --out DIR`` wrote: its capacity and ITL objective."""
        try:
            plan = json.loads(Path(path).read_text())
            cap, itl = plan["capacity"], float(plan["slo"]["itl_s"])
            c = Capacity.from_dict(cap)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InvalidArgument(f"{path} is not a `pdkv plan` result ({type(e).__name__}: {e})") from None
        if c.decode_tok_s(itl) <= 0:
            raise InvalidArgument(f"{path}: a decode worker cannot meet the ITL objective {itl:g} s at all")
        return cls(c.prefill_fixed_s, c.prefill_s_per_token, c.decode_tok_s(itl), **overrides)


class DemandWindow:
    """Prefill seconds and decode tokens the proxy routed in the last ``window_s``."""

    def __init__(self, policy: RerolePolicy) -> None:
        self.policy = policy
        self._events: Deque[tuple[float, float, int]] = collections.deque()  # (time, prefill s, decode tokens)

    def prefill(self, prompt_tokens: int, now: Optional[float] = None) -> None:
        self._events.append((time.monotonic() if now is None else now, self.policy.prefill_s(prompt_tokens), 0))

    def decode_tokens(self, n: int = 1, now: Optional[float] = None) -> None:
        self._events.append((time.monotonic() if now is None else now, 0.0, n))

    def needs(self, now: Optional[float] = None) -> tuple[float, float, int]:
        """(prefill workers needed, decode workers needed, prefills counted) over the window."""
        now = time.monotonic() if now is None else now
        while self._events and self._events[0][0] < now - self.policy.window_s:
            self._events.popleft()
        pre = sum(e[1] for e in self._events) / self.policy.window_s
        dec = sum(e[2] for e in self._events) / self.policy.window_s / self.policy.decode_tok_s
        return pre, dec, sum(1 for e in self._events if e[1] > 0)


def decide(need_prefill: float, need_decode: float, num_prefill: int, num_decode: int,
           hysteresis: float) -> Optional[str]:
    """The role one worker should move to (``"prefill"`` or ``"decode"``), or None.

    The ``N = num_prefill + num_decode`` workers are split in the measured ratio: the
    ideal prefill count is ``N * need_prefill / (need_prefill + need_decode)``; a worker
    moves when that is more than ``0.5 + hysteresis`` away from ``num_prefill`` (so
    rounding alone never moves one) and each pool keeps at least one worker.
    """
    total_need = need_prefill + need_decode
    n = num_prefill + num_decode
    if total_need <= 0 or n < 2:
        return None
    ideal = n * need_prefill / total_need
    if ideal - num_prefill > 0.5 + hysteresis and num_decode > 1:
        return "prefill"
    if num_prefill - ideal > 0.5 + hysteresis and num_prefill > 1:
        return "decode"
    return None
