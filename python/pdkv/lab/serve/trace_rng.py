"""Seeded random streams of the request traces (:mod:`pdkv.lab.serve.trace`).

Each kind of random draw has its own stream, keyed ``(seed, stream, block)``, and
draws come in blocks of :data:`BLOCK` requests; see the determinism section of
:mod:`pdkv.lab.serve.trace` for what this buys.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["BLOCK"]

#: Requests per random-number block (see the determinism section of :mod:`pdkv.lab.serve.trace`).
BLOCK = 1024

# Stream ids: each kind of random draw has its own stream so that they never interact.
STREAM_ARRIVAL = 1
STREAM_PROMPT_LEN = 2
STREAM_OUTPUT_LEN = 3
STREAM_PROMPT_CONTENT = 4


def stream_rng(seed: int, stream: int, key: int) -> np.random.Generator:
    """The generator of ``stream`` for ``seed`` and ``key`` (a block, or a request index)."""
    return np.random.default_rng([int(seed) & 0xFFFFFFFFFFFFFFFF, stream, int(key)])


def blocked(seed: int, stream: int, n: int, draw: Any) -> np.ndarray:
    """Concatenate ``draw(rng, BLOCK)`` over blocks and keep the first ``n`` values."""
    parts = [draw(stream_rng(seed, stream, b), BLOCK) for b in range((n + BLOCK - 1) // BLOCK)]
    if not parts:
        return np.zeros(0)
    return np.concatenate(parts)[:n]
