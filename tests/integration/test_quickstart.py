"""The README's quick-start command, exactly as written, in a fresh shell.

It must train to a visible accuracy gain on an embedded Redis, write its
outputs, and leave no process behind.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.test_readme import README, bash_blocks

pytestmark = pytest.mark.integration
ROOT = README.parent


def ours() -> set[int]:
    """Processes running our services or a Redis server."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                continue
            if b"services." in cmd or b"redis-server" in cmd:
                found.add(int(entry))
    return found


def test_readme_quick_start_as_written(tmp_path):
    command = bash_blocks(README.read_text())[0]
    before = ours()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASTEROID_")}
    res = subprocess.run(
        ["bash", "-c", command],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    gain = re.search(r"held-out accuracy, round 0 → \d+ │\s+([\d.]+)% → ([\d.]+)%", out)
    assert gain, out[-3000:]
    assert float(gain.group(2)) > float(gain.group(1)) + 30
    assert "measured / simulated" in out
    assert (ROOT / "demo-output" / "weights.safetensors").stat().st_size > 0
    assert (ROOT / "demo-output" / "timeline.png").stat().st_size > 0
    assert "everything stopped" in out
    assert ours() - before == set(), "the quick start left processes behind"
