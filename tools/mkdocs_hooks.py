"""MkDocs hooks for mpidist's site (mkdocs.yml names this file; `python3 dev.py docs` builds the site).

docs/ is also read on its own, in a checkout or a repository browser, so its pages link to
files of the repository outside docs/ (``[...](../examples/cg_persistent.py)``). The site holds
a copy of each such file under ``repo/`` and the links point there, so that they work on the site
too and ``mkdocs build --strict`` still fails on every link that resolves nowhere.

The docstrings name other objects with Sphinx roles (``:func:`all_reduce```,
``:class:`~mpidist.store.TCPStore```), which Markdown renders as the role's text followed by
the name in code: the role is dropped, and a ``~`` name keeps its last part, as Sphinx shows it.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
REPO_DIR = "repo"
#: a Markdown link target that leaves the page's folder: ](../examples/x.py) or ](../examples/x.py#L3)
LINK = re.compile(r"\]\((\.\./[^)#\s]+)")


def _outside_docs(docs: Path, page_uri: str, target: str) -> str | None:
    """The repository path (posix) of ``target`` linked from ``page_uri`` when it is a file outside docs/."""
    path = (docs / posixpath.dirname(page_uri) / target).resolve()
    if path.is_relative_to(docs.resolve()) or not path.is_relative_to(ROOT) or not path.is_file():
        return None
    return path.relative_to(ROOT).as_posix()


def on_files(files, config):
    docs = Path(config["docs_dir"])
    for page in list(files.documentation_pages()):
        text = Path(page.abs_src_path).read_text(encoding="utf-8")
        for target in LINK.findall(text):
            rel = _outside_docs(docs, page.src_uri, target)
            uri = f"{REPO_DIR}/{rel}"
            if rel and files.get_file_from_path(uri) is None:
                files.append(File.generated(config, uri, abs_src_path=str(ROOT / rel)))
    return files


def on_page_markdown(markdown, page, config, files):
    docs = Path(config["docs_dir"])

    def repoint(match: re.Match) -> str:
        rel = _outside_docs(docs, page.file.src_uri, match.group(1))
        if rel is None:
            return match.group(0)
        return "](" + posixpath.relpath(f"{REPO_DIR}/{rel}", posixpath.dirname(page.file.src_uri) or ".")

    return LINK.sub(repoint, markdown)


#: what Markdown made of a Sphinx role in a docstring: ":func:<code>~mpidist.all_reduce</code>"
ROLE = re.compile(r":(?:func|meth|class|attr|data|mod|exc|obj):<code>(~[\w.]*\.)?([^<]*)</code>")


def on_page_content(html, page, config, files):
    return ROLE.sub(lambda m: f"<code>{m.group(2)}</code>", html)

