"""docs/design.md's layer table lists every module of the package, and nothing that is not there;
the site (mkdocs.yml) lists every page of docs/ and its API reference every public name."""

from __future__ import annotations

import ast
import re

import pytest

from helpers import REPO

ROOT = REPO
PACKAGE = ROOT / "mpidist"

pytestmark = pytest.mark.timeout(30)


def _listed() -> set[str]:
    """Module paths (relative to mpidist/; Python and C) named in the first code block of docs/design.md."""
    text = (ROOT / "docs" / "design.md").read_text()
    block = re.search(r"```\n(mpidist/__init__\.py.*?)```", text, re.S)
    assert block, "docs/design.md has no layer table starting with mpidist/__init__.py"
    names: set[str] = set()
    directory = ""
    for line in block.group(1).splitlines():
        left = line[:27]  # the name column
        indented = left.startswith("  ")
        match = re.match(r"\s*([\w/]+/)\s", left + " ")
        if match and not indented:
            directory = match.group(1)
        elif not indented and left.strip():
            directory = ""
        for name in re.findall(r"([\w/]+\.(?:py|c))\b", left):
            name = name.removeprefix("mpidist/")
            names.add(f"{directory}{name}" if indented or name == "__init__.py" and directory else name)
        for name in re.findall(r"(\w+\.(?:py|c))\b", line[27:]):  # modules named in the description column
            names.add(f"{directory}{name}" if directory else name)
    return names


def test_every_module_is_in_the_layer_table_and_every_entry_exists():
    modules = {str(p.relative_to(PACKAGE)) for ext in ("*.py", "*.c") for p in PACKAGE.rglob(ext)}
    listed = _listed()
    missing = sorted(modules - listed)
    stale = sorted(listed - modules)
    assert not missing, f"modules missing from docs/design.md's layer table: {missing}"
    assert not stale, f"docs/design.md's layer table names modules that do not exist: {stale}"


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
    documented = set(re.findall(r"^::: mpidist\.(\w+)$", reference, re.M))
    assert not public - documented, f"docs/reference/ has no '::: mpidist.NAME' for {sorted(public - documented)}"
    assert not documented - public, f"docs/reference/ documents names mpidist does not export: {sorted(documented - public)}"
