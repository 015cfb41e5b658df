"""One worker's measured capacity: the cost model ``pdkv plan`` fits and the proxy's
re-roling (:mod:`pdkv.serving.rerole`) reads back from ``plan.json``.

* **prefill**: seconds to prefill a prompt of ``L`` tokens on one worker, fitted as
  ``prefill_fixed_s + L * prefill_s_per_token``;
* **decode**: seconds per decode step with ``B`` requests in the batch, fitted as
  ``step_fixed_s + B * step_per_seq_s`` (one token per request per step, so a worker
  decodes ``B / step(B)`` tokens/s at inter-token latency ``step(B)``).

The planner that measures it and sizes pools from it is the lab's :mod:`pdkv.lab.plan`;
this record lives in serving because a running proxy uses it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from pdkv.errors import InvalidArgument

__all__ = ["Capacity"]


@dataclass(frozen=True)
class Capacity:
    """Measured per-worker cost model (see the module docstring).

    Attributes
    ----------
    prefill_fixed_s, prefill_s_per_token : float
        Prefill time of an ``L``-token prompt: ``prefill_fixed_s + L * prefill_s_per_token``.
    step_fixed_s, step_per_seq_s : float
        Decode step time with ``B`` requests: ``step_fixed_s + B * step_per_seq_s``.
    max_decode_batch : int
        Most requests one decode worker runs at once (its ``--max-num-seqs`` and KV pool).
    source : str
        Where the numbers come from (for the report).
    points : dict
        The raw measurements the fits came from.
    """

    prefill_fixed_s: float
    prefill_s_per_token: float
    step_fixed_s: float
    step_per_seq_s: float
    max_decode_batch: int = 64
    source: str = ""
    points: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for k in ("prefill_fixed_s", "prefill_s_per_token", "step_fixed_s", "step_per_seq_s"):
            v = getattr(self, k)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise InvalidArgument(f"capacity {k} must be a finite number >= 0, got {v!r}")
        if self.prefill_fixed_s + self.prefill_s_per_token <= 0 or self.step_fixed_s + self.step_per_seq_s <= 0:
            raise InvalidArgument("capacity: prefill and decode step times cannot both be zero")
        if not isinstance(self.max_decode_batch, int) or self.max_decode_batch < 1:
            raise InvalidArgument(f"capacity max_decode_batch must be an integer >= 1, got {self.max_decode_batch!r}")

    def prefill_s(self, prompt_len: float) -> float:
        return self.prefill_fixed_s + prompt_len * self.prefill_s_per_token

    def step_s(self, batch: float) -> float:
        return self.step_fixed_s + batch * self.step_per_seq_s

    def slo_batch(self, itl_slo_s: float) -> int:
        """The largest decode batch whose step meets ``itl_slo_s`` (0: not even one request)."""
        if self.step_s(1) > itl_slo_s:
            return 0
        if self.step_per_seq_s == 0:
            return self.max_decode_batch
        return min(self.max_decode_batch, int(math.floor((itl_slo_s - self.step_fixed_s) / self.step_per_seq_s
                                                          + 1e-9)))

    def decode_tok_s_max(self) -> float:
        """One decode worker's tokens/s with a full batch (its raw throughput)."""
        return self.max_decode_batch / self.step_s(self.max_decode_batch)

    def decode_tok_s(self, itl_slo_s: float) -> float:
        """One decode worker's tokens/s under the ITL objective (0 if it cannot meet it)."""
        b = self.slo_batch(itl_slo_s)
        return b / self.step_s(b) if b else 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Capacity":
        try:
            return cls(float(d["prefill_fixed_s"]), float(d["prefill_s_per_token"]), float(d["step_fixed_s"]),
                       float(d["step_per_seq_s"]), int(d.get("max_decode_batch", 64)), str(d.get("source", "")),
                       dict(d.get("points", {})))
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidArgument(f"not a capacity record ({type(e).__name__}: {e})") from None
