"""The docs stay true: docstring examples run, the README example runs, and every
relative link in README.md and docs/ names a file (and heading) that exists."""

import doctest
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import pdkv.agent
import pdkv.layout

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("mod", [pdkv.agent, pdkv.layout], ids=lambda m: m.__name__)
def test_docstring_examples(mod):
    res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert res.attempted > 0 and res.failed == 0


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Example\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_example_runs(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(readme_example())
    env = dict(os.environ, PDKV_LOG="error", PDKV_SHM_DIR=str(tmp_path))
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("[b'req-42']"), out.stdout


def heading_anchors(md: Path) -> set:
    """GitHub's anchors: lower case, punctuation other than '-' and '_' dropped, spaces to '-'."""
    anchors = set()
    in_code = False
    for line in md.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def relative_links(md: Path):
    in_code = False
    for line in md.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if not re.match(r"[a-z]+:", target):
                yield target


@pytest.mark.parametrize("md", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(md):
    broken = []
    for target in relative_links(md):
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest):
            broken.append(f"{target}: no heading '{anchor}' in {dest.relative_to(ROOT)}")
    assert not broken, broken


def test_readme_is_short_and_indexes_every_guide():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    for guide in sorted((ROOT / "docs").glob("*.md")):
        assert f"(docs/{guide.name})" in readme, f"README does not link docs/{guide.name}"
