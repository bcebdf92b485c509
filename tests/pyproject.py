"""The project's pyproject.toml as a dict, on Python 3.10 too (tomllib is 3.11's; tomli before)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the dev extra installs tomli there
    import tomli as tomllib

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


def pyproject() -> dict[str, Any]:
    """The parsed pyproject.toml."""
    return tomllib.loads(PYPROJECT.read_text())
