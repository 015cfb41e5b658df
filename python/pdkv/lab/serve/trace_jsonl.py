"""Traces as JSONL files: :func:`save_trace` and :func:`load_trace` (replay).

One JSON object per line: ``timestamp`` (seconds; ``time_scale`` converts other units),
``prompt_len`` or ``prompt`` (text or a list of token ids), ``output_len``. The aliases
``input_length``/``output_length`` (the Mooncake trace format) are accepted.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Any, Iterable, List, Mapping, Optional, Tuple, Union

from pdkv.lab.serve.trace_gen import Trace, TraceRequest

__all__ = ["load_trace", "save_trace"]


def save_trace(trace: Union[Trace, Iterable[TraceRequest]], path: Union[str, "os.PathLike[str]"]) -> None:
    """Write a trace as JSONL (one :meth:`TraceRequest.to_dict` per line)."""
    with open(path, "w", encoding="utf-8") as f:
        for r in trace:
            f.write(json.dumps(r.to_dict()) + "\n")


def _first(d: Mapping[str, Any], *keys: str) -> Any:
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    return None


def load_trace(
    path: Union[str, "os.PathLike[str]"],
    *,
    time_scale: float = 1.0,
    seed: int = 0,
    default_output_len: Optional[int] = None,
) -> Trace:
    """Read a JSONL trace for replay.

    Parameters
    ----------
    path : path-like
        One JSON object per line; blank lines are skipped.
    time_scale : float
        Multiplies ``timestamp`` to get seconds (0.001 for milliseconds).
    seed : int
        Seed for prompts generated from ``prompt_len`` (lines without ``prompt``).
    default_output_len : int, optional
        Used when a line has no ``output_len``; otherwise that line is an error.

    Returns
    -------
    Trace
        Sorted by timestamp (stable), shifted so the first request is at t = 0,
        re-indexed ``0..n-1``.

    Raises
    ------
    ValueError
        A line that is not a JSON object or lacks a required field (message names the line).
    """
    rows: List[Tuple[float, int, TraceRequest]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                if not isinstance(d, dict):
                    raise ValueError("not a JSON object")
                ts = _first(d, "timestamp", "arrival_s", "time")
                if ts is None:
                    raise ValueError("missing 'timestamp'")
                prompt = d.get("prompt")
                if prompt is not None and not (
                    isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))
                ):
                    raise ValueError("'prompt' must be text or a list of token ids")
                plen = _first(d, "prompt_len", "input_length", "prompt_tokens")
                if plen is None:
                    if prompt is None:
                        raise ValueError("needs 'prompt_len' or 'prompt'")
                    plen = len(prompt) if isinstance(prompt, list) else len(prompt.split())
                olen = _first(d, "output_len", "output_length", "max_tokens")
                if olen is None:
                    if default_output_len is None:
                        raise ValueError("missing 'output_len'")
                    olen = default_output_len
                if int(olen) < 1 or int(plen) < 0:
                    raise ValueError("output_len must be >= 1 and prompt_len >= 0")
            except (ValueError, TypeError, KeyError) as exc:
                raise ValueError(f"{path}:{lineno}: {exc}") from None
            rows.append((float(ts) * time_scale, lineno, TraceRequest(0, 0.0, int(plen), int(olen), prompt)))
    rows.sort(key=lambda r: (r[0], r[1]))
    t0 = rows[0][0] if rows else 0.0
    reqs = tuple(replace(r, index=i, arrival_s=ts - t0) for i, (ts, _, r) in enumerate(rows))
    return Trace(reqs, seed, {"source": os.fspath(path), "time_scale": time_scale, "seed": seed})
