"""`make gpu-check` runs every CUDA test the suite has.

The target names its test files (collecting the whole suite for a handful of
GPU tests would import every extra), so a CUDA test added in a new file is
silently never run on a GPU unless the list grows with it: the one in
tests/galaxy/test_llama.py was missed that way. This check needs no GPU.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKED = re.compile(r"pytest\.mark\.cuda\b|\bCUDA_MARKS\b")
SHARED = {"tests/gpu.py", "tests/bench/test_gpu_check_targets.py"}
"""Where the mark is defined or spoken of, not used by a test."""


def gpu_check_test_files(makefile: str) -> set[str]:
    """The test files of the gpu-check recipe's `-m cuda` pytest line."""
    lines = makefile.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("gpu-check:"))
    recipe = []
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        recipe.append(line)
    runs = [line for line in recipe if "-m cuda" in line]
    assert len(runs) == 1, f"one pytest -m cuda line expected in gpu-check, got {runs}"
    return set(re.findall(r"tests/\S+\.py", runs[0]))


def cuda_marked_test_files(root: Path) -> set[str]:
    """Test modules that mark a test (or themselves) `cuda`."""
    found = set()
    for path in (root / "tests").rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if rel not in SHARED and MARKED.search(path.read_text(encoding="utf-8")):
            found.add(rel)
    return found


def test_the_recipe_parser_reads_the_listed_files() -> None:
    makefile = (
        "other:\n\techo -m cuda tests/not_this.py\n"
        "gpu-check:  ## doc\n"
        "\t$(BIN)/python -c 'check'\n"
        "\t$(PYTEST) -m cuda -rs tests/a/test_x.py tests/test_y.py\n"
        "\t$(BIN)/python -m tests.bench.gpu_check\n"
        "\n"
        "next:\n\techo\n"
    )
    assert gpu_check_test_files(makefile) == {"tests/a/test_x.py", "tests/test_y.py"}


def test_gpu_check_runs_every_cuda_marked_test_file() -> None:
    listed = gpu_check_test_files((ROOT / "Makefile").read_text(encoding="utf-8"))
    marked = cuda_marked_test_files(ROOT)
    assert marked, "no cuda-marked test found: the scan is broken"
    assert marked - listed == set(), "cuda tests that make gpu-check never runs"
    assert listed - marked == set(), "files make gpu-check runs that hold no cuda test"
