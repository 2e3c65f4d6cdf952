#!/usr/bin/env python3
"""Check the docs: docs/api.md mentions every public name of mpidist (as `name`), and every code
block of README.md and docs/*.md is either run as written or marked as not runnable here.

The code blocks (``tests/tools/test_docs_blocks.py`` runs them):

* A block without a language is output or a listing, never run; it must not start with a command
  (``mpiexec``, ``python``, ``pip``, ...): tag those ``bash``.
* A block whose first line is a comment holding one of :data:`MARKS` is not run, and the mark says
  why on the page: ``# fragment: ...`` (names the program must define), ``# needs Slurm``,
  ``# needs several hosts``, ``# needs a GPU``, ``# once released on PyPI``, ``# not run by CI: ...``
  (only where :data:`NOT_RUN` allows it). A line of a ``bash`` block whose comment holds a mark is
  left out of the run, and the rest of the block runs.
* A ``python`` block that starts ``# NAME.py`` is saved as NAME.py for the page's ``bash`` blocks
  to run; ``# NAME.py: run with COMMAND`` is saved and run with COMMAND. Any other ``python``
  block must carry a mark.
* A ``bash`` block runs as one script (``bash -e``) in a folder of the page's own, with the
  virtual environment's ``bin`` first on PATH (as after ``source .venv/bin/activate``), and
  ``examples``, ``benchmarks`` and ``tools`` of the checkout beside it.

    python3 tools/check_docs.py            # the API check and the blocks' marks
    python3 tools/check_docs.py --blocks   # also list every block and what CI does with it
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: the marks of blocks and lines that CI does not run (the comment on the page says which)
MARKS = (
    "fragment", "needs Slurm", "needs several hosts", "needs a GPU", "needs PyPI", "once released on PyPI",
    "not run by CI",
)
#: the only blocks that may say "not run by CI": (page, the block's first line)
NOT_RUN = {
    ("README.md", "# not run by CI: these two make the environments CI runs in"),
    ("docs/performance.md", "# not run by CI: sweeps to 256 MiB, minutes each; the first two need a GPU"),
    ("docs/performance.md", "# not run by CI: benchmarks of minutes each (dev.py bench runs mpidist.bench on 2 ranks)"),
}
#: a block without a language that starts like this is a command, to be tagged bash
COMMANDS = re.compile(r"^\s*(mpiexec|mpirun|mpidistrun|mpidist-bench|srun|sbatch|salloc|python3?|pip|torchrun)\b")
_FENCE = re.compile(r"^( *)```(\w*)[^\n]*\n(.*?)^\1```", re.S | re.M)
_SAVE = re.compile(r"^# (\w[\w-]*\.py)(?:: run with (.+))?$")


@dataclass
class Block:
    page: str  #: relative to the checkout: README.md, docs/quickstart.md
    line: int  #: of the opening fence
    lang: str
    text: str

    @property
    def first(self) -> str:
        """The first line (the second after a ``#!`` line): where a block says what it is."""
        lines = self.text.split("\n", 2)
        return (lines[1] if lines[0].startswith("#!") and len(lines) > 1 else lines[0]).strip()

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    def mark(self) -> str | None:
        """The mark of the whole block (its first line is a comment holding one), else None."""
        if self.first.startswith("#"):
            return next((m for m in MARKS if m in self.first), None)
        return None

    def saved_as(self) -> tuple[str, str | None] | None:
        """(file name, command or None) of a python block that starts ``# NAME.py``."""
        found = _SAVE.match(self.first) if self.lang == "python" else None
        return (found.group(1), found.group(2)) if found else None

    def script(self) -> str:
        """A bash block's lines, those whose comment holds a mark left out (continued lines count as one)."""
        kept, pending = [], []
        for line in self.text.splitlines():
            pending.append(line)
            if line.rstrip().endswith("\\"):
                continue
            comment = "\n".join(pending).split("#", 1)[1] if "#" in "\n".join(pending) else ""
            if not any(m in comment for m in MARKS):
                kept.extend(pending)
            pending = []
        return "\n".join(kept + pending) + "\n"

    def uses_torch(self) -> bool:
        return bool(re.search(r"\btorch|lightning|ddp_|survive_ddp", self.text))


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    return [
        Block(str(page.relative_to(ROOT)), text.count("\n", 0, m.start()) + 1, m.group(2), m.group(3))
        for m in _FENCE.finditer(text)
    ]


def problems(page: Path) -> list[str]:
    """What is wrong with the marks of ``page``'s blocks (empty: every block is run or marked)."""
    found, saved, scripts = [], [], []
    for b in blocks(page):
        if not b.lang:
            if COMMANDS.match(b.first):
                found.append(f"{b.where}: a block without a language starts with a command: tag it bash")
            continue
        mark = b.mark()
        if mark == "not run by CI" and (b.page, b.first) not in NOT_RUN:
            found.append(f"{b.where}: '# not run by CI' is allowed only where tools/check_docs.py's NOT_RUN says")
        if mark:
            continue
        if b.lang == "python":
            if b.saved_as() is None:
                found.append(
                    f"{b.where}: a python block must start '# NAME.py' (run by a bash block), "
                    f"'# NAME.py: run with COMMAND', or a mark ({', '.join(MARKS)})"
                )
            elif b.saved_as()[1] is None:
                saved.append((b, b.saved_as()[0]))
        elif b.lang == "bash":
            scripts.append(b.script())
        else:
            found.append(f"{b.where}: a {b.lang!r} block: tag runnable code python or bash, or leave output untagged")
    for b, name in saved:
        if not any(name in s for s in scripts) and not name.startswith(("conftest", "test_")):
            found.append(f"{b.where}: {name} is saved, but no bash block of the page runs it")
    return found


def check_api() -> list[str]:
    sys.path.insert(0, str(ROOT))
    import mpidist

    text = (ROOT / "docs" / "api.md").read_text()
    documented = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_.]*)", text))
    missing = [name for name in mpidist.__all__ if name not in documented and name != "__version__"]
    return ["docs/api.md does not mention: " + ", ".join(missing)] if missing else []


def main(argv: list[str]) -> int:
    found = check_api()
    for page in pages():
        found += problems(page)
        if "--blocks" in argv:
            for b in blocks(page):
                saved = b.saved_as()
                what = (
                    "output" if not b.lang else f"not run: {b.mark()}" if b.mark()
                    else f"saved as {saved[0]}" + (f", run: {saved[1]}" if saved[1] else "") if saved
                    else "run"
                )
                print(f"{b.where} [{b.lang or '-'}] {what}")
    for line in found:
        print(line)
    if not found:
        print("docs: the API page covers every public name; every code block is run or marked")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
