#!/usr/bin/env python3
"""Check that docs/api.md mentions every public name of mpidist (as `name`)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import mpidist  # noqa: E402


def main() -> int:
    text = (ROOT / "docs" / "api.md").read_text()
    documented = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_.]*)", text))
    missing = [name for name in mpidist.__all__ if name not in documented and name != "__version__"]
    if missing:
        print("docs/api.md does not mention: " + ", ".join(missing))
        return 1
    print(f"docs/api.md covers all {len(mpidist.__all__) - 1} public names")
    return 0


if __name__ == "__main__":
    sys.exit(main())
