"""The site (mkdocs.yml) lists every page of docs/ and its API reference every public name.

docs/design.md's layer table is checked by test_layers.py (every module listed once, imports downward)."""

from __future__ import annotations

import ast
import re

import pytest

from helpers import REPO

ROOT = REPO
PACKAGE = ROOT / "mpidist"

# files read, no MPI: in the world of one rank, under one MPI library
pytestmark = [pytest.mark.timeout(30), pytest.mark.one_rank, pytest.mark.one_library]


def _nav_pages() -> list[str]:
    """The pages mkdocs.yml's nav names (read as text: the file holds a tag that safe YAML loaders refuse)."""
    text = (ROOT / "mkdocs.yml").read_text()
    nav = re.search(r"^nav:\n(.*?)^\S", text, re.S | re.M)
    assert nav, "mkdocs.yml has no nav"
    return re.findall(r"^\s+- (?:.*: )?([\w./-]+\.md)\s*$", nav.group(1), re.M)


def test_the_site_nav_lists_every_page_of_docs_once():
    pages = sorted(str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md"))
    listed = _nav_pages()
    assert sorted(listed) == sorted(set(listed)), f"mkdocs.yml's nav names a page twice: {listed}"
    assert sorted(listed) == pages, (
        f"mkdocs.yml's nav and docs/ differ: not in the nav {sorted(set(pages) - set(listed))}, "
        f"not in docs/ {sorted(set(listed) - set(pages))}"
    )


def test_the_api_reference_has_every_public_name():
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    exported = next(
        node.value for node in tree.body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets)
    )
    public = {ast.literal_eval(elt) for elt in exported.elts} - {"__version__"}
    reference = "".join(p.read_text() for p in (ROOT / "docs" / "reference").glob("*.md"))
    # mpidist.NAME, or mpidist.MODULE.NAME where NAME is also a module's name (reduce_op); not mpidist.torch
    documented = set(re.findall(r"^::: mpidist\.(?!torch\.)(?:\w+\.)?(\w+)$", reference, re.M))
    assert not public - documented, f"docs/reference/ has no '::: mpidist.NAME' for {sorted(public - documented)}"
    assert not documented - public, f"docs/reference/ documents names mpidist does not export: {sorted(documented - public)}"
