"""docs/design.md's layer table lists every module of the package, and nothing that is not there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
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
