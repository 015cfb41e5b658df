"""Loads the lab's compiled helpers (``pdkv.lab._pdkv_lab``: the ceilings of ``pdkv bench
transfer`` and netlab's delay line) on first use, with a clear error if absent.

A module apart from the library's ``pdkv._pdkv``: ``import pdkv`` never loads it.
"""

from __future__ import annotations

import functools


@functools.cache
def module():
    try:
        from pdkv.lab import _pdkv_lab  # type: ignore[attr-defined]
    except ImportError as e:  # pragma: no cover - only on broken installs
        raise ImportError(
            "pdkv's lab module (pdkv.lab._pdkv_lab) is missing or broken; reinstall with `pip install -e .` "
            f"(original error: {e})"
        ) from e
    return _pdkv_lab
