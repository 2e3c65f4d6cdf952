"""dev.py's torch matrix, pyproject.toml's torch range and the releases mpidist names in its errors agree."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.timeout(60), pytest.mark.one_rank, pytest.mark.one_library]


def _dev():
    spec = importlib.util.spec_from_file_location("dev_under_test", ROOT / "dev.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("dev_under_test", module)
    spec.loader.exec_module(module)
    return module


def test_the_torch_range_is_stated_once_and_tested_whole():
    import _mpidist_autoload

    dev = _dev()
    assert (dev.TORCH_OLDEST, *dev.TORCH_MATRIX) == _mpidist_autoload.TESTED_TORCH
    pyproject = (ROOT / "pyproject.toml").read_text()
    lower = re.search(r'^torch = \["torch>=([0-9.]+)"\]', pyproject, re.M)
    assert lower, "pyproject.toml's torch extra has no lower bound"
    assert dev.TORCH_OLDEST.startswith(lower.group(1) + "."), (lower.group(1), dev.TORCH_OLDEST)
    for version in _mpidist_autoload.TESTED_TORCH:
        for page in ("README.md", "docs/torch-backend.md"):
            assert version in (ROOT / page).read_text(), f"{page} does not name torch {version}, which CI tests"
