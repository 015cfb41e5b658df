"""The runnable examples in the public docstrings stay true."""

import doctest

import pytest

import pdkv.agent
import pdkv.layout


@pytest.mark.parametrize("mod", [pdkv.agent, pdkv.layout], ids=lambda m: m.__name__)
def test_docstring_examples(mod):
    res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert res.attempted > 0 and res.failed == 0
