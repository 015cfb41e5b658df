"""The runnable examples in pdkv.serving's docstrings stay true."""

from __future__ import annotations

import doctest

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from pdkv.serving import kv_pool  # noqa: E402


def test_kv_pool_docstring_examples() -> None:
    res = doctest.testmod(kv_pool, optionflags=doctest.ELLIPSIS)
    assert res.attempted > 0 and res.failed == 0
