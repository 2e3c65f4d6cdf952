"""Every code block of README.md and docs/*.md runs as written, or says on the page why it cannot run here.

tools/check_docs.py finds the blocks and their marks (fragment, needs Slurm, needs several hosts, needs a GPU,
needs PyPI, once released on PyPI). Here each page's runnable blocks run in order, in a folder of the page's own:
``python`` blocks that start ``# NAME.py`` are saved there, ``# NAME.py: run with COMMAND`` ones are saved and
run with COMMAND (all files are saved before the first block runs), and ``bash`` blocks run as one ``bash -e``
script with this Python's ``bin`` first on PATH (as in an activated ``.venv``; ``.venv`` in the folder is this
Python's environment), ``examples``, ``benchmarks`` and ``tools`` of the checkout beside them, and ``HOME`` set
to the folder. Blocks about torch are skipped where torch is not installed. The one change to a
command: ``MASTER_PORT=29500`` gets a free port (other jobs on the machine may hold 29500).

The whole run takes about 1-2 minutes on the loaded 2-core development machine (mostly torch's imports).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO

# tools/ is not a package: load check_docs.py by its path, without putting tools/ on sys.path
_spec = importlib.util.spec_from_file_location("check_docs", REPO / "tools" / "check_docs.py")
check_docs = sys.modules.setdefault("check_docs", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(check_docs)  # in sys.modules first: its dataclass looks its module up there

# each page runs its own jobs (mpiexec -n 2 or 4, torchrun): once, in the world of one rank, under one library
pytestmark = [pytest.mark.one_rank, pytest.mark.one_library]

BLOCK_TIMEOUT_S = 150
HAS_TORCH = importlib.util.find_spec("torch") is not None
RUN_PAGES = [p for p in check_docs.pages() if any(not b.mark() and b.lang for b in check_docs.blocks(p))]


def _env(folder: Path) -> dict[str, str]:
    drop = ("PMI_", "PMIX_", "OMPI_", "HYDI_", "HYDRA_", "MPI_LOCAL", "SLURM_", "PRTE_", "MPIDIST_", "TORCHELASTIC_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"):
        env.pop(k, None)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["HOME"] = str(folder)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(script: str, folder: Path, where: str) -> tuple[str, float]:
    script = script.replace("MASTER_PORT=29500", f"MASTER_PORT={_free_port()}")
    start = time.monotonic()
    try:
        done = subprocess.run(
            ["bash", "-e", "-c", script], cwd=folder, env=_env(folder), capture_output=True, text=True,
            timeout=BLOCK_TIMEOUT_S, errors="replace",
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        return f"{where}: still running after {BLOCK_TIMEOUT_S} s:\n{script}\n{exc.stdout or ''}{exc.stderr or ''}", 0.0
    took = time.monotonic() - start
    if done.returncode != 0:
        return f"{where}: exit status {done.returncode}:\n{script}\n{done.stdout[-3000:]}{done.stderr[-3000:]}", took
    return "", took


@pytest.mark.timeout(30)
def test_every_block_is_run_or_marked():
    problems = [line for page in check_docs.pages() for line in check_docs.problems(page)]
    assert not problems, "\n".join(problems)


@pytest.mark.timeout(30)
def test_the_checker_finds_an_unmarked_fragment(tmp_path):
    """The check itself can fail: an unmarked python block, a command in an untagged block, a misused mark."""
    page = tmp_path / "page.md"
    page.write_text(
        "```python\nx = params.copy()\n```\n\n```\nmpiexec -n 2 python x.py\n```\n\n"
        "```bash\n# not run by CI: because\nls\n```\n\n```python\n# lonely.py\nprint(1)\n```\n"
    )
    old = check_docs.ROOT
    check_docs.ROOT = tmp_path
    try:
        found = check_docs.problems(page)
    finally:
        check_docs.ROOT = old
    assert len(found) == 4, found
    assert "page.md:1: a python block must start" in found[0]
    assert "tag it bash" in found[1] and "NOT_RUN" in found[2] and "lonely.py is saved" in found[3]


@pytest.mark.timeout(len(RUN_PAGES) * 4 * BLOCK_TIMEOUT_S)
@pytest.mark.parametrize("page", RUN_PAGES, ids=lambda p: p.name)
def test_the_blocks_run_as_written(page, tmp_path):
    for name in ("examples", "benchmarks", "tools"):
        (tmp_path / name).symlink_to(REPO / name)
    (tmp_path / ".venv").symlink_to(sys.prefix)  # `source .venv/bin/activate`: this Python's environment
    runnable = [b for b in check_docs.blocks(page) if b.lang and not b.mark()]
    for block in runnable:  # the page's files first: a command may come before the file it runs (pytest)
        if block.saved_as():
            (tmp_path / block.saved_as()[0]).write_text(block.text)
    failures, ran, skipped = [], [], []
    for block in runnable:
        if block.uses_torch() and not HAS_TORCH:
            skipped.append(block.where)
            continue
        saved = block.saved_as()
        if saved and saved[1] is None:
            continue
        script = saved[1] + "\n" if saved else block.script()
        problem, took = _run(script, tmp_path, block.where)
        ran.append(f"{block.where} {took:.1f} s")
        if problem:
            failures.append(problem)
    print(f"{page.name}: ran {ran}; skipped without torch: {skipped}")
    assert ran or skipped, f"{page.name}: no block ran"
    assert not failures, "\n\n".join(failures)


@pytest.mark.timeout(30)
def test_dev_example_suggests_commands_that_exist():
    """The commands `dev.py example` prints next name examples and tests of the checkout, and extras that exist."""
    import re

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    sys.path.insert(0, str(REPO))
    import dev

    text = dev.NEXT_STEPS
    assert "source .venv/bin/activate" in text
    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    named = {e for group in re.findall(r'\.\[([\w,]+)\]"', text) for e in group.split(",")}
    assert named and named <= extras, f"extras {sorted(named - extras)} are not in pyproject.toml"
    paths = re.findall(r"\b((?:examples|tests)/[\w/]+(?:\.py)?)", text)
    assert len(paths) >= 3, text
    missing = [p for p in paths if not (REPO / p).exists()]
    assert not missing, f"dev.py example suggests {missing}, which the checkout does not have"
