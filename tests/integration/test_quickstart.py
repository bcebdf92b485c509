"""The README's quick-start command, exactly as written, in a fresh shell.

It must train to a visible accuracy gain on an embedded Redis, write its
outputs during this run (a `demo-output/` left by an earlier one does not
count), and leave no process behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
import uuid

import pytest

from tests.cluster import Budget, marked_processes
from tests.test_readme import README, bash_blocks

pytestmark = pytest.mark.integration
ROOT = README.parent
OUT = ROOT / "demo-output"
MARKER = "ASTEROID_TEST_QUICKSTART_RUN"


def test_readme_quick_start_as_written(tmp_path, budget: Budget):
    command = bash_blocks(README.read_text())[0]
    tag = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTEROID_")}
    env[MARKER] = tag  # inherited by everything the demo starts
    started = time.time()
    log = tmp_path / "quickstart.log"
    with log.open("wb") as sink:
        shell = subprocess.Popen(
            ["bash", "-c", command],
            cwd=ROOT,
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    limit = budget.left(240)
    try:
        code = shell.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        code = None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGKILL)  # bash, make and the CLI, if still there
        shell.wait(timeout=10)
    out = log.read_text(errors="replace")
    assert code is not None, f"the quick start did not finish in {limit:.0f} s:\n{out[-3000:]}"
    assert code == 0, out[-3000:]
    gain = re.search(r"held-out accuracy, round 0 → \d+ │\s+([\d.]+)% → ([\d.]+)%", out)
    assert gain, out[-3000:]
    assert float(gain.group(2)) > float(gain.group(1)) + 30
    assert "measured / simulated" in out
    assert re.search(r"final weights \(round 80\) written to demo-output/weights\.safetensors", out)
    for name in ("weights.safetensors", "timeline.png", "logs/coordinator.log"):
        path = OUT / name
        assert path.stat().st_size > 0, path
        assert path.stat().st_mtime >= started, f"{path} is left from an earlier run"
    assert "everything stopped" in out
    left = marked_processes(MARKER, tag)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert left == {}, "the quick start left processes behind"
