"""Named trace presets and the cost model they are sized with.

:data:`PRESETS` holds the named trace specs (:class:`~pdkv.lab.serve.trace.TraceSpec`);
:func:`utilisation` and :func:`saturation_rate` give their load on the reference core
(:class:`CostModel`). The table of presets and their load is in the docstring of
:mod:`pdkv.lab.serve.trace`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from pdkv.lab.serve.trace_dist import Gamma, LogNormal, Mixture, Poisson, Uniform
from pdkv.lab.serve.trace_gen import TraceSpec

__all__ = ["PRESETS", "CostModel", "get_preset", "saturation_rate", "utilisation"]


@dataclass(frozen=True)
class CostModel:
    """A first-order cost model of one serving core, for sizing presets.

    Defaults are the issue-6 measurements of a ~40M-parameter Llama on one pinned CPU
    core: a 1024-token prefill takes ~0.8 s, a decode step for 8 requests ~50 ms.

    Attributes
    ----------
    prefill_s_per_token : float
        Prefill seconds per prompt token (linear; attention is negligible at this size).
    decode_step_s : float
        Seconds per decode step of a full batch.
    decode_batch : int
        Requests per decode step at that cost. Lower concurrency makes each token
        dearer, so :func:`utilisation` is a lower bound.
    """

    prefill_s_per_token: float = 0.8 / 1024
    decode_step_s: float = 0.050
    decode_batch: int = 8

    def request_cost_s(self, prompt_len: float, output_len: float) -> float:
        """Core-seconds for one request; the first output token comes from prefill."""
        decode_tokens = max(output_len - 1.0, 0.0)
        return prompt_len * self.prefill_s_per_token + decode_tokens * self.decode_step_s / self.decode_batch


def utilisation(
    spec: TraceSpec, *, rate: Optional[float] = None, cores: int = 1, model: CostModel = CostModel()
) -> float:
    """Expected busy fraction of ``cores`` cores serving ``spec`` at ``rate``.

    Parameters
    ----------
    spec : TraceSpec
        Trace parameters (mean lengths are exact, see :meth:`LengthDist.mean`).
    rate : float, optional
        Requests/s; the spec's rate by default.
    cores : int
        Cores sharing the load perfectly.
    model : CostModel
        Per-token costs.

    Returns
    -------
    float
        ``rate * cost(mean prompt, mean output) / cores``; 1.0 is saturation.
    """
    r = spec.rate if rate is None else rate
    return r * model.request_cost_s(spec.prompt_len.mean(), spec.output_len.mean()) / cores


def saturation_rate(spec: TraceSpec, *, cores: int = 1, model: CostModel = CostModel()) -> float:
    """Request rate (requests/s) at which :func:`utilisation` reaches 1."""
    return cores / model.request_cost_s(spec.prompt_len.mean(), spec.output_len.mean())


_SHORT_PROMPT = LogNormal(128, 0.5, 16, 512)
_LONG_PROMPT = LogNormal(1024, 0.25, 512, 2048)

#: Named trace specs; the docstring of :mod:`pdkv.lab.serve.trace` gives their load on the reference core.
PRESETS: Mapping[str, TraceSpec] = {
    s.name: s
    for s in (
        TraceSpec(
            "chat-short",
            "Chat turns: short prompts (median 128 tokens) and short answers (median 48), Poisson.",
            Poisson(1.0),
            _SHORT_PROMPT,
            LogNormal(48, 0.5, 8, 256),
        ),
        TraceSpec(
            "rag-long",
            "Retrieval-augmented: long prompts (median 1024 tokens) with short answers (median 48), Poisson.",
            Poisson(0.4),
            _LONG_PROMPT,
            LogNormal(48, 0.5, 16, 192),
        ),
        TraceSpec(
            "mixed",
            "80% chat prompts (median 128) and 20% long documents (median 1024), answers median 64, Poisson.",
            Poisson(0.6),
            Mixture(((0.8, _SHORT_PROMPT), (0.2, _LONG_PROMPT))),
            LogNormal(64, 0.6, 8, 256),
        ),
        TraceSpec(
            "prefill-heavy",
            "Long prompts (512-1536, mean 1024) with very short answers (16-64): prefill dominates, Poisson.",
            Poisson(0.5),
            Uniform(512, 1536),
            Uniform(16, 64),
        ),
        TraceSpec(
            "chat-bursty",
            "chat-short arriving in bursts: gamma gaps with CV 3 at the same mean rate.",
            Gamma(1.0, 3.0),
            _SHORT_PROMPT,
            LogNormal(48, 0.5, 8, 256),
        ),
    )
}


def get_preset(name: str) -> TraceSpec:
    """Look up a preset by name.

    Raises
    ------
    ValueError
        Unknown name (the message lists the presets).
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}") from None
