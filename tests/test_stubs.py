"""The committed stubs of the native modules (python/pdkv/_pdkv.pyi, the library's, and
python/pdkv/lab/_pdkv_lab/*.pyi, the lab's) are what pybind11-stubgen generates from the
built extensions now, and the package says it is typed (py.typed)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))


def test_package_is_marked_typed():
    assert os.path.isfile(os.path.join(ROOT, "python", "pdkv", "py.typed"))


@pytest.mark.skipif(importlib.util.find_spec("pybind11_stubgen") is None,
                    reason="needs pybind11-stubgen (the `test` extra: pip install -e '.[test]')")
def test_stubs_match_the_built_extension():
    import gen_stubs

    if gen_stubs.tools() != gen_stubs.committed_tools():
        pytest.skip(f"the stubs were generated with {gen_stubs.committed_tools()}, this build has {gen_stubs.tools()}: "
                    "the types are spelled differently (`make stubs` regenerates them)")
    stale = gen_stubs.drift()
    assert not stale, f"stubs differ from the bindings: {stale}; regenerate with `make stubs`"


def test_stubs_type_the_options_keywords():
    with open(os.path.join(ROOT, "python", "pdkv", "_pdkv.pyi")) as f:
        text = f.read()
    assert "def __init__(self, *, listen_host: str = '127.0.0.1', listen_port: int = 0," in text
    assert "def __init__(self, config: AgentConfig) -> None" in text


def test_lab_helpers_are_not_in_the_library_module():
    """The benchmark ceilings and the delay line are the lab's module, not the library's."""
    with open(os.path.join(ROOT, "python", "pdkv", "_pdkv.pyi")) as f:
        core = f.read()
    # (bench_switches, the registry of A/B switches the library itself reads, is the library's)
    assert "from . import bench" not in core and "'bench'," not in core and "netlab" not in core
    with open(os.path.join(ROOT, "python", "pdkv", "lab", "_pdkv_lab", "__init__.pyi")) as f:
        lab = f.read()
    assert "from . import bench" in lab and "from . import netlab" in lab
