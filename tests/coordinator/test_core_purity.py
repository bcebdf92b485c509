"""The coordinator's pure core takes its clock from its caller and never waits itself.

import-linter keeps sockets, Redis, torch, the codec and the store out of the
core's imports (`make lint`); this test checks what an import contract cannot:
that no core module reads the clock, sleeps or pumps a socket, and that every
module of the coordinator stays small enough to read in one sitting.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from tests.pyproject import pyproject

ROOT = Path(__file__).resolve().parents[2]
COORDINATOR = ROOT / "services" / "coordinator"
MAX_LINES = 450
"""A module one reads in one sitting (STYLE.md); the few at the bound are noted in the issue."""
SLACK = 20
"""Lines a module may exceed the bound by (docstrings grow) before this test objects."""
WAITS = ("pump", "monotonic", "sleep", "perf_counter")
"""Methods a core must not call, whoever owns them: the clock comes in as `now`."""


def core_modules() -> list[str]:
    """The modules the pure-core import contract names."""
    for contract in pyproject()["tool"]["importlinter"]["contracts"]:
        if contract["name"].startswith("the coordinator's pure core"):
            return list(contract["source_modules"])
    raise AssertionError("pyproject.toml has no contract for the coordinator's pure core")


def source_files(module: str) -> list[Path]:
    """The files of `module`: itself, or every file of a package."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    origin = Path(spec.origin)
    return sorted(origin.parent.glob("*.py")) if origin.name == "__init__.py" else [origin]


def impure_calls(path: Path) -> list[str]:
    """Calls in `path` that read the clock, sleep or pump: `time.monotonic()`, `x.pump(...)`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        owner = node.func.value
        name = owner.id if isinstance(owner, ast.Name) else ""
        if node.func.attr in WAITS or (name, node.func.attr) == ("time", "time"):
            found.append(f"{path.name}:{node.lineno} {name}.{node.func.attr}()")
    return found


@pytest.mark.parametrize("module", core_modules())
def test_a_core_module_neither_reads_the_clock_nor_waits(module: str) -> None:
    calls = [c for path in source_files(module) for c in impure_calls(path)]
    assert not calls, f"{module} must take `now` from its caller: {calls}"


def test_the_check_finds_a_clock_read_and_a_pump(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import time\n\ndef f(host):\n    host.pump(0.1)\n    return time.monotonic()\n")
    assert impure_calls(bad) == ["bad.py:4 host.pump()", "bad.py:5 time.monotonic()"]


def test_every_coordinator_module_reads_in_one_sitting() -> None:
    long = {
        str(p.relative_to(COORDINATOR)): n
        for p in sorted(COORDINATOR.rglob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_LINES + SLACK
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"
