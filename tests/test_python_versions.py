"""The sources are Python 3.10, the oldest the package says it supports (JetPack 6 ships it).

mypy and ruff check against 3.10's standard library and syntax; this test has a
real 3.10 interpreter compile every module (in memory: nothing is written), where
the machine has one (on PATH or in pyenv's versions).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.pyproject import pyproject

ROOT = Path(__file__).resolve().parent.parent
COMPILE_ALL = """
import pathlib, sys
bad = []
for folder in sys.argv[1:]:
    for path in sorted(pathlib.Path(folder).rglob("*.py")):
        try:
            compile(path.read_text(encoding="utf-8"), str(path), "exec", dont_inherit=True)
        except SyntaxError as exc:
            bad.append(f"{path}:{exc.lineno}: {exc.msg}")
print("\\n".join(bad))
sys.exit(1 if bad else 0)
"""


def _python310() -> str | None:
    """A working python3.10, or None."""
    candidates = [shutil.which("python3.10")]
    if pyenv := shutil.which("pyenv"):
        root = subprocess.run([pyenv, "root"], capture_output=True, text=True, timeout=30)
        candidates += sorted(
            str(p) for p in Path(root.stdout.strip()).glob("versions/3.10*/bin/python3.10")
        )
    for python in filter(None, candidates):
        ok = subprocess.run([python, "--version"], capture_output=True, text=True, timeout=30)
        if ok.returncode == 0 and ok.stdout.startswith("Python 3.10"):
            return python
    return None


def test_the_package_says_python_3_10_and_the_checkers_agree():
    config = pyproject()
    assert config["project"]["requires-python"] == ">=3.10"
    assert config["tool"]["ruff"]["target-version"] == "py310"
    assert config["tool"]["mypy"]["python_version"] == "3.10"


def test_every_module_compiles_on_python_3_10():
    python = _python310()
    if python is None:
        pytest.skip("no Python 3.10 on this machine")
    res = subprocess.run(
        [python, "-c", COMPILE_ALL, "common", "services", "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr
