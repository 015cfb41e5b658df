"""Loads the compiled core (``pdkv._pdkv``) on first use, with a clear error if absent."""

from __future__ import annotations

import functools


@functools.cache
def module():
    try:
        from . import _pdkv  # type: ignore[attr-defined]
    except ImportError as e:  # pragma: no cover - only on broken installs
        raise ImportError(
            "pdkv's native module is missing or broken; reinstall with `pip install -e .` "
            f"(original error: {e})"
        ) from e
    return _pdkv
