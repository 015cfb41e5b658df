"""The package's three layers hold and it has no import cycle (docs/architecture.md).

* library (``import pdkv``: agent, layouts, transports, codecs, errors, the discovery
  client) < serving (``pdkv.serving``, ``pdkv.integrations``) < lab (``pdkv.lab``) <
  the command (``pdkv.cli``): a module imports only its own layer and the layers below;
* no module takes part in an import cycle: strongly connected components over the
  whole import graph, imports inside functions and ``if TYPE_CHECKING:`` included
  (grimp records every import statement);
* ``import pdkv`` loads library modules only.

``lint-imports`` (pyproject.toml's contracts, run by ``make test``) checks the layers
too; this test stands on its own so that plain pytest runs say the same, and each
check is shown to fail on a graph that breaks it.
"""

from __future__ import annotations

import copy
import re
import subprocess
import sys

import pytest

grimp = pytest.importorskip("grimp", reason="needs grimp (installed with import-linter: the `test` extra)")

#: Top-level packages of each layer above the library, lowest first; every other
#: module of pdkv is the library.
LAYERS = (("library", ()), ("serving", ("pdkv.serving", "pdkv.integrations")), ("lab", ("pdkv.lab",)),
          ("cli", ("pdkv.cli",)))
#: Native extension modules (grimp sees only Python files; it resolves an import of
#: one of these to the package holding it).
NATIVE = re.compile(r"\b(_pdkv_lab|_pdkv)\b")


def layer_of(module: str) -> int:
    """The index in LAYERS of the layer ``module`` belongs to."""
    for i, (_, roots) in reversed(list(enumerate(LAYERS))):
        if any(module == r or module.startswith(r + ".") for r in roots):
            return i
    return 0


def build_graph() -> grimp.ImportGraph:
    """pdkv's import graph, with imports of the native modules pointing at them (leaves)
    instead of at the package that holds them."""
    g = grimp.build_graph("pdkv", cache_dir=None)
    for importer in sorted(g.modules):
        for imported in sorted(g.find_modules_directly_imported_by(importer)):
            details = g.get_import_details(importer=importer, imported=imported)
            native = [d for d in details if NATIVE.search(d["line_contents"])]
            if native and len(native) == len(details):
                name = NATIVE.search(native[0]["line_contents"]).group(1)
                g.remove_import(importer=importer, imported=imported)
                g.add_module(f"{imported}.{name}")
                g.add_import(importer=importer, imported=f"{imported}.{name}")
    return g


def layer_violations(g: grimp.ImportGraph) -> list[str]:
    """Every direct import of a module from a higher layer, as 'a -> b (line n)'."""
    out = []
    for importer in sorted(g.modules):
        for imported in sorted(g.find_modules_directly_imported_by(importer)):
            if layer_of(imported) > layer_of(importer):
                lines = [d["line_number"] for d in g.get_import_details(importer=importer, imported=imported)]
                out.append(f"{importer} ({LAYERS[layer_of(importer)][0]}) -> {imported} "
                           f"({LAYERS[layer_of(imported)][0]}), line {lines}")
    return out


def import_cycles(g: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing
    itself), each sorted: every module in one imports every other, directly or not."""
    edges = {m: sorted(g.find_modules_directly_imported_by(m)) for m in sorted(g.modules)}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in edges:  # Tarjan's algorithm, iterative (no recursion limit)
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
                on_stack.add(v)
            if i < len(edges[v]):
                work.append((v, i + 1))
                w = edges[v][i]
                if w not in index:
                    work.append((w, 0))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1 or v in edges[v]:
                    out.append(sorted(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return sorted(out)


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return build_graph()


def test_each_layer_imports_only_the_layers_below(graph):
    assert len(graph.modules) > 50, sorted(graph.modules)  # the whole package was found
    assert layer_violations(graph) == []


def test_no_import_cycles(graph):
    cycles = import_cycles(graph)
    assert cycles == [], "\n".join(" <-> ".join(c) for c in cycles)


def test_native_imports_end_at_the_native_modules(graph):
    assert "pdkv._pdkv" in graph.find_modules_directly_imported_by("pdkv._native")
    assert "pdkv" not in graph.find_modules_directly_imported_by("pdkv._native")
    assert "pdkv.lab._pdkv_lab" in graph.find_modules_directly_imported_by("pdkv.lab._native")


def test_the_checks_fail_on_a_graph_that_breaks_them(graph):
    bad = copy.deepcopy(graph)
    bad.add_import(importer="pdkv.tp", imported="pdkv.serving.capacity", line_number=1,
                   line_contents="from pdkv.serving.capacity import Capacity")
    bad.add_import(importer="pdkv.serving.rerole", imported="pdkv.lab.plan.model", line_number=1,
                   line_contents="from pdkv.lab.plan.model import Workload")
    bad.add_import(importer="pdkv.lab.transfer.common", imported="pdkv.lab.transfer.bench", line_number=1,
                   line_contents="from pdkv.lab.transfer.bench import serve")
    assert layer_violations(bad) == [
        "pdkv.serving.rerole (serving) -> pdkv.lab.plan.model (lab), line [1]",
        "pdkv.tp (library) -> pdkv.serving.capacity (serving), line [1]",
    ]
    assert import_cycles(graph) == []
    assert any({"pdkv.lab.transfer.bench", "pdkv.lab.transfer.common"} <= set(c) for c in import_cycles(bad))


def test_a_function_level_import_closes_a_cycle_too(tmp_path, monkeypatch):
    pkg = tmp_path / "cyc"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from cyc import b\n")
    (pkg / "b.py").write_text("def f():\n    from cyc import a\n    return a\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from cyc import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    g = grimp.build_graph("cyc", cache_dir=None)
    assert import_cycles(g) == [["cyc.a", "cyc.b"]]
    (pkg / "a.py").write_text("from cyc import b, c\n")
    g = grimp.build_graph("cyc", cache_dir=None)
    assert import_cycles(g) == [["cyc.a", "cyc.b", "cyc.c"]]


def test_import_pdkv_loads_library_modules_only():
    code = "import sys, pdkv; print('\\n'.join(sorted(m for m in sys.modules if m.startswith('pdkv'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    loaded = out.stdout.split()
    assert "pdkv.agent" in loaded
    assert [m for m in loaded if layer_of(m) > 0] == []
