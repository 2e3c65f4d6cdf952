"""The package's imports obey docs/design.md's layer table: downward only, and no cycle.

The table lists every module from the top (what a program calls) to the bottom; a module may
import only modules listed after it (its own row's later entries, or any row below). The test
reads every import of the package (module level and inside functions; ``if TYPE_CHECKING:``
blocks excepted, they run in no program) with ``ast`` and fails on one that goes up, naming the
line, and on any import cycle. The few allowed exceptions are in ``ALLOWED``, each with its reason.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "mpidist"

# the package's source read, no MPI: in the world of one rank, under one MPI library
pytestmark = [pytest.mark.timeout(60), pytest.mark.one_rank, pytest.mark.one_library]

#: (importer, imported): imports against the table that are there on purpose, with the reason
ALLOWED: dict[tuple[str, str], str] = {}


def table_order() -> list[str]:
    """The modules of docs/design.md's layer table, top to bottom, as dotted names ("" is the package).

    The name column is the first 27 characters. ``pkg/`` at the start of a line opens a
    package (its description names ``__init__.py``), whose modules follow indented;
    ``pkg/mod.py`` at the start of a line places one module of a package on its own.
    """
    text = (ROOT / "docs" / "design.md").read_text()
    block = re.search(r"## Layers.*?```\n(.*?)```", text, re.S)
    assert block, "docs/design.md has no layer table under '## Layers'"
    order: list[str] = []
    package = ""
    for line in block.group(1).splitlines():
        left = line[:27]
        if not left.strip():
            continue
        if left.startswith("  "):  # a module of the open package
            paths = [f"{package}/{name}" for name in re.findall(r"(\w+)\.(?:py|c)\b", left)]
        else:
            header = re.match(r"(\w+)/\s", left)
            package = header.group(1) if header else ""
            if header:
                paths = [f"{package}/__init__"] if "__init__.py" in line else []
            else:
                paths = re.findall(r"([\w/]+)\.(?:py|c)\b", left)
        for path in paths:
            order.append(path.removeprefix("mpidist/").replace("/", ".").removesuffix("__init__").rstrip("."))
    return order


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _exists(dotted: str) -> bool:
    base = PACKAGE.joinpath(*dotted.split(".")) if dotted else PACKAGE
    return base.with_suffix(".py").exists() or base.with_suffix(".c").exists() or (base / "__init__.py").exists()


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def package_imports() -> dict[str, list[tuple[str, int]]]:
    """For each module of the package: the package's modules it imports, with the line."""
    graph: dict[str, list[tuple[str, int]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_lines(tree)
        found: list[tuple[str, int]] = []
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name == "mpidist" or a.name.startswith("mpidist.")]
                found += [(t.removeprefix("mpidist").lstrip("."), node.lineno) for t in targets]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".") if package else []
                    base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                    module = ".".join(base + ([node.module] if node.module else []))
                elif node.module == "mpidist" or (node.module or "").startswith("mpidist."):
                    module = node.module.removeprefix("mpidist").lstrip(".")
                else:
                    continue
                for alias in node.names:
                    sub = f"{module}.{alias.name}" if module else alias.name
                    found.append((sub if _exists(sub) else module, node.lineno))
        graph[name] = sorted({(t, line) for t, line in found if t != name}, key=lambda x: x[1])
    return graph


def test_the_table_lists_every_module_once_and_nothing_else():
    order = table_order()
    modules = set(package_imports()) | {_module_name(p) for p in PACKAGE.rglob("*.c")}
    twice = sorted({m for m in order if order.count(m) > 1})
    assert not twice, f"docs/design.md's layer table lists these modules more than once: {twice}"
    missing = sorted(modules - set(order))
    assert not missing, f"modules missing from docs/design.md's layer table: {missing}"
    stale = sorted(set(order) - modules)
    assert not stale, f"docs/design.md's layer table names modules that do not exist: {stale}"


def test_every_import_goes_down_the_layer_table():
    order = table_order()
    rank = {m: i for i, m in enumerate(order)}
    upward = []
    for module, imports in package_imports().items():
        for target, line in imports:
            if module in rank and target in rank and rank[target] <= rank[module] and (module, target) not in ALLOWED:
                upward.append(f"mpidist/{module.replace('.', '/')}.py:{line} imports {target or 'mpidist'} (listed above it)")
    assert not upward, "imports against docs/design.md's layer table:\n" + "\n".join(upward)


def test_no_import_cycle():
    graph = {m: {t for t, _ in imports} for m, imports in package_imports().items()}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)
